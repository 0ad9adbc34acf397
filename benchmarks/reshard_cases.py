"""Pure parts of ``benchmarks/reshard.py``: the cases, the placement tokens, the lower bound,
and what our executor is expected to do. Nothing here needs a process group.

Cases
    ``(mesh, shape, src placements -> dst placements)``; placements are tokens ``R``, ``P``
    (Partial sum) and ``S<dim>``. "single-axis" cases run on a 1-d mesh of all ranks,
    "multi-axis" ones on 2-d/3-d meshes (2x2 on 4 ranks; 2x4, 4x2 and 2x2x2 on 8).

Lower bound (``lower_bound_bytes``)
    bytes received, under the cost model of ``autoparallel/cost.py`` (a message carries one
    value, or one partial sum, per element); the reported figure is the max over ranks. With
    ``T`` a rank's target region and ``B`` its source region (``DistSpec.local_box``, Partial
    read as Replicate):

    * no Partial axis to reduce: ``|T| - |T n B|``, the bytes of its target the rank does not
      already hold;
    * ``m > 1`` summands to reduce (``m`` = product of the sizes of the src Partial axes whose
      placement changes): the larger of ``|T|`` (no rank can finish an element alone) and the
      average over the mesh of the least total traffic: per element, ``m - 1`` messages to
      combine its summands plus one for every rank that needs it beyond the first, i.e.
      ``((m-2) x size + sum over ranks |T_r|) / ranks``. On one axis this is the ring cost:
      ``2(n-1)/n x size`` for ``P -> R``, ``(n-1)/n x size`` for ``P -> S``. Partial axes kept
      Partial count as ``k`` separate values (``x k`` on the size term). Integer division, as
      in ``cost.py``.

    The averaged term bounds the *mean* rank, which the busiest rank of an uneven split cannot
    reach: it still receives ``(n-1) x`` the largest piece (directly, the owner of that piece
    receives the other ``n-1`` summands of its rows; a ring over chunks padded to equal size
    passes ``n-1`` such chunks to every rank). ``P -> S0`` of a (1001, 300) float32 over 4
    ranks (pieces of 251, 251, 251, 248 rows): 3 x 251 x 300 x 4 = 903,600 B against an
    average of 900,900 B; any split of 1001 rows has a piece of at least 251 rows. Ours is
    above the bound there by design.

Our plan (``ap_plan``)
    ``ap.reshard`` runs ``reshard.plan_best(src, dst)``: the same-mesh ``Plan`` of collectives,
    or a point-to-point ``CrossMeshPlan``, whichever the busiest rank receives less from.
    ``ap_plan_bytes`` is what that plan promises a rank receives; ``plan_kind`` names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------

SINGLE_TRANSITIONS = [
    ("S0", "R"), ("S1", "R"), ("S0", "S1"), ("S1", "S0"),
    ("P", "R"), ("P", "S0"), ("P", "S1"),
    ("R", "S0"), ("R", "S1"), ("R", "P"),
]
SINGLE_SHAPES = [(1024, 512), (64, 128, 64), (1000, 300), (1001, 300), (10, 6)]
# On the 3-d shape, the transitions of the 2-d ones move to its last dim.
SINGLE_3D_TRANSITIONS = [("S0", "R"), ("S2", "R"), ("S0", "S2"), ("S2", "S1"), ("P", "R"), ("P", "S2"), ("R", "S2"), ("R", "P")]

MULTI_2D_TRANSITIONS = [
    ("S0,S1", "R,R"),
    ("S0,S1", "S1,S0"),
    ("P,P", "R,R"),
    ("P,S0", "S0,R"),
    ("S0,S0", "R,S0"),
    ("R,S0", "S0,S1"),
    ("S0,R", "R,S0"),
    ("S0,S0", "R,R"),
    ("P,P", "S0,S1"),
    ("P,S1", "R,R"),
    ("S1,S0", "S0,R"),
    ("P,R", "R,R"),
    ("S0,R", "R,R"),
    ("R,S1", "S0,R"),
]
MULTI_2D_SHAPES = [(1024, 512), (1001, 300)]

MULTI_3D_TRANSITIONS = [
    ("S0,S1,S2", "R,R,R"),
    ("P,P,P", "R,R,R"),
    ("S0,S0,S1", "R,S1,S0"),
    ("P,S0,R", "R,R,S1"),
    ("S0,S1,R", "R,S0,S1"),
    ("P,S1,S0", "S0,R,R"),
    ("S0,S0,S0", "R,R,R"),
]
MULTI_3D_SHAPES = [(64, 128, 64), (1024, 512)]

QUICK_SINGLE = [("S0", "R"), ("S0", "S1"), ("P", "R"), ("P", "S0"), ("R", "P")]
QUICK_MULTI = [("S0,S1", "R,R"), ("P,P", "R,R"), ("P,S0", "S0,R"), ("S0,S0", "R,S0"), ("R,S0", "S0,S1")]


@dataclass(frozen=True)
class Case:
    name: str
    mesh_shape: tuple[int, ...]
    shape: tuple[int, ...]
    src: tuple[str, ...]
    dst: tuple[str, ...]

    @property
    def kind(self) -> str:
        return "single" if len(self.mesh_shape) == 1 else "multi"

    @property
    def transition(self) -> str:
        return f"[{','.join(self.src)}]->[{','.join(self.dst)}]"


def _fits(tokens: Sequence[str], ndim: int) -> bool:
    return all(not t.startswith("S") or int(t[1:]) < ndim for t in tokens)


def _mesh_shapes(world: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """2-d and 3-d mesh shapes over all ranks: 2x2 on 4; 2x4, 4x2 and 2x2x2 on 8."""
    two_d: list[tuple[int, ...]] = [(a, world // a) for a in range(2, world) if world % a == 0 and world // a >= 2]
    if world == 4:
        two_d = [(2, 2)]
    three_d: list[tuple[int, ...]] = [(2, 2, 2)] if world == 8 else []
    return two_d, three_d


def enumerate_cases(world: int, quick: bool) -> list[Case]:
    cases: list[Case] = []
    single = QUICK_SINGLE if quick else SINGLE_TRANSITIONS
    shapes_1d = [(1024, 512), (1001, 300)] if quick else SINGLE_SHAPES
    for shape in shapes_1d:
        for s, d in (SINGLE_3D_TRANSITIONS if len(shape) == 3 and not quick else single):
            if _fits((s, d), len(shape)):
                cases.append(Case("", (world,), shape, (s,), (d,)))
    two_d, three_d = _mesh_shapes(world)
    multi = QUICK_MULTI if quick else MULTI_2D_TRANSITIONS
    for mesh_shape in two_d[:1] if quick else two_d:
        for shape in MULTI_2D_SHAPES:
            for s, d in multi:
                src, dst = tuple(s.split(",")), tuple(d.split(","))
                if _fits(src + dst, len(shape)):
                    cases.append(Case("", mesh_shape, shape, src, dst))
    if not quick:
        for mesh_shape in three_d:
            for shape in MULTI_3D_SHAPES:
                for s, d in MULTI_3D_TRANSITIONS:
                    src, dst = tuple(s.split(",")), tuple(d.split(","))
                    if _fits(src + dst, len(shape)):
                        cases.append(Case("", mesh_shape, shape, src, dst))
    return [
        Case(f"{c.kind[0]}{i:02d}", c.mesh_shape, c.shape, c.src, c.dst)
        for i, c in enumerate(cases, 1)
    ]


def ap_placement(tok: str) -> Any:
    import autoparallel as ap

    if tok == "R":
        return ap.Replicate()
    if tok == "P":
        return ap.Partial("sum")
    return ap.Shard(int(tok[1:]))


def torch_placement(tok: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if tok == "R":
        return Replicate()
    if tok == "P":
        return Partial("sum")
    return Shard(int(tok[1:]))


# --------------------------------------------------------------------------------------------
# lower bound (pure: needs no world)
# --------------------------------------------------------------------------------------------


def _volume(box: Sequence[tuple[int, int]] | None) -> int:
    if box is None:
        return 0
    n = 1
    for _, length in box:
        n *= length
    return n


def no_partial(spec: Any) -> Any:
    return spec.without_partial()


def lower_bound_bytes(src: Any, dst: Any) -> dict[int, int]:
    """Per rank: a lower bound on the bytes it receives to turn ``src`` into ``dst``.

    ``T``/``B``: the rank's target/source region (``local_box``, Partial read as Replicate).
    With no Partial axis to reduce: ``|T| - |T n B|``. With ``m > 1`` summands to reduce
    (``m``: product of the sizes of the src Partial axes whose placement changes): the larger
    of ``|T|`` (every target element needs an incoming value) and the mesh-wide average
    ``((m-2) x k x size + sum over ranks |T_r|) / ranks``, which comes from: each element
    (in each of the ``k`` classes of Partial axes kept as they are) needs ``m-1`` messages to
    combine its ``m`` summands and one more for every rank needing it beyond the first.
    See the module docstring (and why an uneven reduce-scatter stays above the average).
    """
    from autoparallel.placement import Partial
    from autoparallel.spec import intersect_boxes

    mesh = src.mesh
    item = src.itemsize
    src_full, dst_full = no_partial(src), no_partial(dst)
    reduced = [a for a, p in enumerate(src.placements) if isinstance(p, Partial) and dst.placements[a] != p]
    kept = [a for a, p in enumerate(src.placements) if isinstance(p, Partial) and dst.placements[a] == p]
    m = math.prod(mesh.shape[a] for a in reduced)
    k = math.prod(mesh.shape[a] for a in kept)
    own: dict[int, int] = {}
    for r in mesh.process_ids:
        c = mesh.coordinate_of(r)
        t_box, b_box = dst_full.local_box(c), src_full.local_box(c)
        t = _volume(t_box)
        own[r] = (t if m > 1 else t - _volume(intersect_boxes(t_box, b_box))) * item
    if m == 1:
        return own
    numel = math.prod(src.shape)
    average = ((m - 2) * k * numel * item + sum(own.values())) // mesh.size
    return {r: max(b, average) for r, b in own.items()}


# --------------------------------------------------------------------------------------------
# our plan (what ``ap.reshard`` runs)
# --------------------------------------------------------------------------------------------


def ap_plan(src_spec: Any, dst_spec: Any) -> Any:
    """``reshard.plan_best``: the executor's choice of collectives (``Plan``) or point-to-point
    (``CrossMeshPlan``)."""
    from reshard import plan_best

    return plan_best(src_spec, dst_spec)


def ap_plan_bytes(src_spec: Any, dst_spec: Any, rank: int) -> int:
    """Bytes ``rank`` receives under ``ap_plan``; both plan types have ``bytes_per_rank``."""
    return ap_plan(src_spec, dst_spec).bytes_per_rank(rank)[1]


def plan_kind(plan: Any) -> str:
    """``p2p`` (a ``CrossMeshPlan``), ``coll`` (a ``Plan`` with collectives) or ``local``
    (a ``Plan`` that communicates nothing: slices, relabels, ``R -> P``)."""
    from reshard import CrossMeshPlan

    if isinstance(plan, CrossMeshPlan):
        return "p2p"
    return "coll" if plan.collectives() else "local"
