"""Pure reshard planner: (src spec, dst spec) -> the cheapest ordered ``Plan``.

States are layouts of one tensor on one mesh (placements plus the order in which several mesh
axes shard the same tensor dim). Edges are single steps on one mesh axis:

    R    -> S(d)  slice (local)              S(d) -> R     all-gather
    R    -> P     to_partial (local)         P    -> R     all-reduce
    S(d) -> P     fill (local, where exact)
    P    -> S(d)  reduce-scatter             S(i) -> S(j)  all-to-all
    any  -> any   relabel, on a mesh axis of size 1

An axis that shards dim ``d`` can only be undone (gathered, moved) while it is the innermost
split of ``d``; a new split always becomes innermost. Edge weights are the bytes the busiest
rank receives plus a small per-step latency term, so among equally cheap plans the one with
fewest steps wins. A ``StridedShard`` layout is planned on its expanded shape (``DistSpec.expanded``: the strided
dim cut into blocks x block, every axis a plain ``Shard``), between two local reshapes (``view``
steps); where the two layouts cut a dim differently, through their layouts with the strided
axes replicated. The search is Dijkstra over the lazily expanded graph (it stops as soon as
``dst`` is settled, so cheap plans are found without building every layout), cached on
``(src, dst)``. ``layout_graph`` builds the whole graph as a networkx ``DiGraph`` — the
reference the tests check the search against, and a way to look at the alternatives.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from functools import lru_cache

import networkx as nx

from autoparallel.compat import size_hint, whole
from autoparallel.placement import Partial, Placement, Replicate, Shard, StridedShard, partials_compatible
from autoparallel.spec import DistSpec, strided_factors
from reshard.plan import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    FILL,
    REDUCE_SCATTER,
    RELABEL,
    SLICE,
    TO_PARTIAL,
    VIEW,
    Plan,
    Step,
    fill_exact,
    step_bytes_table,
)

LATENCY_BYTES = 64      # per collective: breaks ties towards fewer collectives
LOCAL_STEP_WEIGHT = 1   # per local step: breaks ties towards fewer local copies


class ReshardError(ValueError):
    """No plan exists between the two specs (different shape, dtype or mesh)."""


def plan_reshard(src: DistSpec, dst: DistSpec) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` on the same mesh (pure; searched plans cached)."""
    if src.mesh != dst.mesh:
        raise ReshardError(f"plan_reshard needs one mesh; got {src.mesh} and {dst.mesh} (use plan_cross_mesh)")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ReshardError(
            f"cannot reshard a {tuple(src.shape)} {src.dtype} tensor into {tuple(dst.shape)} {dst.dtype}"
        )
    if src.has_strided or dst.has_strided:
        return _plan_strided(src, dst)
    return one_move(src, dst) or (_lifted(src, dst) if src.symbolic else _plan(src, dst))


def _lifted(src: DistSpec, dst: DistSpec) -> Plan:
    """The search's plan for symbolic sizes (a capture's open sizes): searched at their present
    values and carried over step by step (every step scales with the tensor's size alike: the
    search at any size finds the same path but where a collective's start-up outweighs its bytes)."""
    hinted = tuple(size_hint(n) for n in src.shape)
    plan = _plan(src.with_shape(hinted), dst.with_shape(hinted))
    return Plan(src, dst, tuple(Step(s.kind, s.axis, s.src.with_shape(src.shape), s.dst.with_shape(src.shape))
                                for s in plan.steps))


@lru_cache(maxsize=4096)
def _plan_strided(src: DistSpec, dst: DistSpec) -> Plan:
    """A plan where either layout has a ``StridedShard`` axis: on the shape both expand to, or
    through ``src.unstrided()`` and ``dst.unstrided()`` (each of which expands as its own)."""
    found = dict(strided_factors(src.placements))
    common = True
    for d, f in strided_factors(dst.placements):
        common = common and found.setdefault(d, f) == f
    factors = tuple(sorted(found.items()))
    if common and src.fits(factors) and dst.fits(factors):
        wide_src, wide_dst = src.expanded(factors), dst.expanded(factors)
        return Plan(src, dst, _view(src, wide_src) + plan_reshard(wide_src, wide_dst).steps + _view(wide_dst, dst))
    mid_src, mid_dst = src.unstrided(), dst.unstrided()
    return Plan(src, dst, plan_reshard(src, mid_src).steps + plan_reshard(mid_src, mid_dst).steps
                + plan_reshard(mid_dst, dst).steps)


def _view(src: DistSpec, dst: DistSpec) -> tuple[Step, ...]:
    return () if src == dst else (Step(VIEW, 0, src, dst),)


def one_move(src: DistSpec, dst: DistSpec) -> Plan | None:
    """The plan of one step where ``src`` and ``dst`` differ on one mesh axis by an all-gather,
    an all-to-all or a local step (None otherwise, or where they are equal). Such a step moves
    exactly what each rank lacks, so no plan beats it at any size: it is built from the
    placements alone — no search, no byte count — and not cached (it costs about what a cache
    lookup does), so a tensor at a new shape (a new sequence length) adds nothing to the
    planner's caches for it. A reduction (all-reduce, reduce-scatter) is built so where it is
    cheapest at any size (``_reduction_is_direct``); elsewhere ``_plan`` compares it with
    its alternatives."""
    a = -1
    for b, (p, q) in enumerate(zip(src.placements, dst.placements)):
        if p != q:
            if a >= 0:
                return None
            a = b
    if a < 0:
        return None
    p = dst.placements[a]
    kind = RELABEL if src.mesh.shape[a] == 1 else _kind(src, a, src.placements[a], p)
    if kind is None:
        return None
    if kind in (ALL_REDUCE, REDUCE_SCATTER) and not _reduction_is_direct(src, a, p):
        return None
    if src.shard_order or dst.shard_order:
        if _moved(src, a, p) != dst:
            return None
    elif isinstance(p, Shard) and dst.axes_of_dim(p.dim)[-1] != a:
        return None  # the step makes ``a`` the innermost split of the dim: an explicit order
    return Plan(src, dst, (Step(kind, a, src, dst),))


def _reduction_is_direct(src: DistSpec, a: int, p: Placement) -> bool:
    """Whether reducing axis ``a`` of ``src`` into ``p`` in one collective is the cheapest plan
    at any size, as ``_direct_step`` finds it: no other mesh axis holds replicas (they could
    split the reduction), and for a reduce-scatter onto ``Shard(d)``, ``d`` is split by no other
    axis (``len >= n``): every rank then receives ``(n - 1) x ceil(len / n)`` rows, at most
    the ``2 (n - 1) / n x len`` rows of an all-reduce, so the all-reduce and slice never wins."""
    if _replicas_elsewhere(src, a):
        return False
    return not isinstance(p, Shard) or (not src.axes_of_dim(p.dim) and src.shape[p.dim] >= src.mesh.shape[a])


def _replicas_elsewhere(src: DistSpec, a: int) -> bool:
    """Whether a mesh axis other than ``a`` holds replicas (a reduction on ``a`` may then be
    split: slice, reduce a smaller piece, gather)."""
    shape = src.mesh.shape
    return any(isinstance(q, Replicate) and shape[b] > 1 for b, q in enumerate(src.placements) if b != a)


@lru_cache(maxsize=8192)
def _plan(src: DistSpec, dst: DistSpec) -> Plan:
    if src == dst:
        return Plan(src, dst, ())
    direct = _direct_step(src, dst)
    if direct is not None:
        return Plan(src, dst, (direct,))
    allowed = _allowed_placements(src, dst)
    best: dict[DistSpec, int] = {src: 0}
    came: dict[DistSpec, Step] = {}
    heap: list[tuple[int, int, DistSpec]] = [(0, 0, src)]
    tie = itertools.count(1)
    while heap:
        dist, _, state = heapq.heappop(heap)
        if state == dst:
            steps = []
            while state != src:
                steps.append(came[state])
                state = came[state].src
            return Plan(src, dst, tuple(reversed(steps)))
        if dist > best[state]:
            continue
        for step, weight in _edges(state, allowed):
            nd = dist + weight
            if nd < best.get(step.dst, nd + 1):
                best[step.dst] = nd
                came[step.dst] = step
                heapq.heappush(heap, (nd, next(tie), step.dst))
    raise ReshardError(f"no reshard plan from {src} to {dst}")  # pragma: no cover


def layout_graph(src: DistSpec, dst: DistSpec) -> nx.DiGraph:
    """Every layout reachable from ``src`` (with ``dst``'s partials) and every single step.

    Edges carry ``weight`` and ``step``; ``nx.dijkstra_path(g, src, dst, weight="weight")`` is
    the reference answer ``plan_reshard`` must match in cost.
    """
    graph = nx.DiGraph()
    allowed = _allowed_placements(src, dst)
    frontier = [src]
    graph.add_node(src)
    while frontier:
        state = frontier.pop()
        for step, weight in _edges(state, allowed):
            if step.dst not in graph:
                frontier.append(step.dst)
            graph.add_edge(state, step.dst, weight=weight, step=step)
    return graph


def plan_cost(plan: Plan) -> int:
    """The planner's weight of ``plan``: per step, busiest rank's bytes plus latency."""
    return sum(LOCAL_STEP_WEIGHT if s.is_local else _weight(s) for s in plan.steps)


def _direct_step(src: DistSpec, dst: DistSpec) -> Step | None:
    """The one-step plan when src and dst differ on one axis and that step is provably cheapest.

    A gather, all-to-all or local step moves exactly the bytes each rank lacks, so nothing beats
    it. A reduction is only taken directly when no other mesh axis holds replicas (replicas can
    split the reduction: slice, reduce a smaller piece, gather) and, for reduce-scatter, when
    padding uneven pieces does not make it dearer than all-reduce + slice; otherwise search.
    """
    diff = [a for a in range(src.mesh.ndim) if src.placements[a] != dst.placements[a]]
    if len(diff) != 1:
        return None
    a = diff[0]
    for step, weight in _axis_edges(src, a, (dst.placements[a],)):
        if step.dst != dst:
            continue
        if step.kind in (ALL_REDUCE, REDUCE_SCATTER):
            if _replicas_elsewhere(src, a):
                return None
            if step.kind == REDUCE_SCATTER:
                via = _move(src, a, Replicate())
                if via is not None and _weight(Step(ALL_REDUCE, a, src, via)) + LOCAL_STEP_WEIGHT < weight:
                    return None
        return step
    return None


def _allowed_placements(src: DistSpec, dst: DistSpec) -> tuple[tuple[Placement, ...], ...]:
    """Per axis, the placements a state may take: R, every S(d), and the src/dst partials."""
    shards = tuple(Shard(d) for d in range(src.ndim))
    out = []
    for a in range(src.mesh.ndim):
        extra = {p for p in (src.placements[a], dst.placements[a]) if isinstance(p, Partial)}
        out.append((Replicate(),) + shards + tuple(sorted(extra, key=str)))
    return tuple(out)


def _edges(state: DistSpec, allowed: tuple[tuple[Placement, ...], ...]) -> Iterator[tuple[Step, int]]:
    for a in range(state.mesh.ndim):
        yield from _axis_edges(state, a, allowed[a])


def _axis_edges(state: DistSpec, a: int, targets: tuple[Placement, ...]) -> Iterator[tuple[Step, int]]:
    src_p = state.placements[a]
    size = state.mesh.shape[a]
    for p in targets:
        if p == src_p:
            continue
        if size == 1:
            nxt = _move(state, a, p)
            if nxt is not None:
                yield Step(RELABEL, a, state, nxt), LOCAL_STEP_WEIGHT
            continue
        kind = _kind(state, a, src_p, p)
        if kind is None:
            continue
        nxt = _move(state, a, p)
        if nxt is None:
            continue
        step = Step(kind, a, state, nxt)
        yield step, (LOCAL_STEP_WEIGHT if step.is_local else _weight(step))


def _kind(state: DistSpec, a: int, src: Placement, dst: Placement) -> str | None:
    if isinstance(src, StridedShard) or isinstance(dst, StridedShard):
        return None  # (planned on the expanded layouts: ``_plan_strided``)
    if isinstance(src, Replicate):
        return SLICE if isinstance(dst, Shard) else TO_PARTIAL
    if isinstance(src, Shard):
        if state.axes_of_dim(src.dim)[-1] != a:  # only the innermost split can be undone
            return None
        if isinstance(dst, Replicate):
            return ALL_GATHER
        if isinstance(dst, Shard):
            return ALL_TO_ALL
        return FILL if fill_exact(state.dtype, dst.reduce_type, state.mesh.shape[a]) else None
    if isinstance(dst, Replicate):
        return ALL_REDUCE
    return REDUCE_SCATTER if isinstance(dst, Shard) else None


@lru_cache(maxsize=65536)
def _move(state: DistSpec, a: int, p: Placement) -> DistSpec | None:
    """``state`` with axis ``a`` set to ``p``; a new split of a dim becomes its innermost."""
    return _moved(state, a, p)


def _moved(state: DistSpec, a: int, p: Placement) -> DistSpec | None:
    """``_move``, uncached."""
    placements = list(state.placements)
    old = placements[a]
    placements[a] = p
    order = {d: list(state.axes_of_dim(d)) for d in range(state.ndim)}
    if isinstance(old, Shard):
        order[old.dim].remove(a)
    if isinstance(p, Shard):
        order[p.dim].append(a)
    if not partials_compatible(tuple(placements)):
        return None
    shard_order = tuple((d, tuple(axes)) for d, axes in order.items() if len(axes) > 1)
    return state.with_placements(placements, shard_order)


def _weight(step: Step) -> int:
    _, recv = step_bytes_table(step)
    return whole(recv.max()) + LATENCY_BYTES  # type: ignore[no-any-return]
