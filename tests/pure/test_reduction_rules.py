"""Reduction and scan rules: pure strategy tests (brute force); the 4-rank world against torch is
``tests/world/test_reduction_rules_world.py``.

The brute-force check distributes the global inputs over a 1-d or 2-d mesh exactly as each
offered strategy asks (uneven ``torch.chunk`` shards, empty pieces past the end, random
summands/candidates for Partial), runs the op -- or its registered local implementation -- on
every rank's pieces, and combines the local outputs as the strategy claims: the result must be
the op on the global inputs.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from autoparallel import Partial, Replicate, Shard
from autoparallel.placement import Placement, chunk_bounds, partials_compatible
from spmd_rules import LocalContext, OpCall, Strategy, get_local_impl, get_rule
from tests.pure.test_rules import make_call, meta, strategies
from tests.treeutil import map_tensors, tensors_in

aten = torch.ops.aten
R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P, PAVG, PMAX, PMIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
INF = math.inf
_GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN)


def rint(*shape: int) -> torch.Tensor:
    return torch.randint(-5, 6, shape, generator=_GEN)


X, Y3, TINY, ZERO_D = rnd(5, 3), rnd(3, 2, 5), rnd(1, 4), rnd()
XI = rint(5, 3)
XB = rnd(5, 3) > 0
XU8 = (rnd(5, 3) > 0).to(torch.uint8)
XZ = X * (rnd(5, 3) > 0)  # with zeros
XNAN = X.masked_fill(rnd(5, 3) > 1.0, math.nan)


def outputs_of(call: OpCall, inputs: Sequence[Placement]) -> list[tuple]:
    """Output placements the rule offers for these input placements (1-d mesh)."""
    key = tuple((p,) for p in inputs)
    return [tuple(o[0] for o in s.outputs) for s in strategies(call) if s.inputs == key]


# ---- expected strategies ---------------------------------------------------------------------
def test_sum_mean_keep_partial_and_shard_to_partial() -> None:
    for op, args in [(aten.sum.dim_IntList, (X, [0])), (aten.mean.dim, (X, [0]))]:
        call = make_call(op, args, [S0])
        assert outputs_of(call, [S0]) == [(P,)] and outputs_of(call, [S1]) == [(S0,)]
        assert outputs_of(call, [P]) == [(P,)] and outputs_of(call, [PAVG]) == [(PAVG,)]
        assert outputs_of(call, [PMAX]) == []
    # an integer P(avg) is floor-divided: its sums do not average to the sum
    call = make_call(aten.sum.default, (XI,), [PAVG])
    assert outputs_of(call, [PAVG]) == [] and outputs_of(call, [P]) == [(P,)]
    # a 0-d tensor: replicate or keep the Partial
    call = make_call(aten.sum.default, (ZERO_D,), [P])
    assert outputs_of(call, [P]) == [(P,)] and outputs_of(call, [R]) == [(R,)]


def test_amax_amin_max_min_give_partial_max_min() -> None:
    call = make_call(aten.amax.default, (X, [0]), [S0])
    assert outputs_of(call, [S0]) == [(PMAX,)] and outputs_of(call, [S1]) == [(S0,)]
    assert outputs_of(call, [PMAX]) == [(PMAX,)]
    assert outputs_of(call, [P]) == [] and outputs_of(call, [PMIN]) == []
    call = make_call(aten.amin.default, (Y3, [0, 2], True), [S2])
    assert outputs_of(call, [S2]) == [(PMIN,)] and outputs_of(call, [S1]) == [(S1,)]
    assert outputs_of(call, [PMIN]) == [(PMIN,)] and outputs_of(call, [PMAX]) == []
    assert outputs_of(make_call(aten.max.default, (X,), [S1]), [S1]) == [(PMAX,)]
    assert outputs_of(make_call(aten.min.default, (X,), [S0]), [S0]) == [(PMIN,)]
    call = make_call(aten.aminmax.default, (X,), [S0], kwargs={"dim": 0})
    assert outputs_of(call, [S0]) == [(PMIN, PMAX)] and outputs_of(call, [S1]) == [(S0, S0)]
    assert outputs_of(call, [PMAX]) == [] and outputs_of(call, [PMIN]) == []


def test_indices_and_nonlinear_reductions_need_the_reduced_dim_replicated() -> None:
    cases = [  # (op, args, output placement of a shard on the kept dim 1)
        (aten.max.dim, (X, 0), S0), (aten.min.dim, (X, 0, True), S1), (aten.argmax.default, (X, 0), S0),
        (aten.argmin.default, (X, 0), S0), (aten.prod.dim_int, (X, 0), S0),
        (aten.logsumexp.default, (X, [0], True), S1), (aten.var.correction, (X, [0]), S0),
        (aten.std.correction, (X, [0]), S0), (aten.var_mean.correction, (X, [0]), S0),
        (aten.linalg_vector_norm.default, (X, 2, [0]), S0),
    ]
    for op, args, kept in cases:
        call = make_call(op, args, [S0])
        n_out = len(call.out)
        assert outputs_of(call, [S0]) == [], op
        assert outputs_of(call, [S1]) == [(kept,) * n_out], op
        assert all(outputs_of(call, [p]) == [] for p in (P, PAVG, PMAX, PMIN)), op
    # a full argmax (dim=None) indexes the flattened tensor: replicate only
    assert strategies(make_call(aten.argmax.default, (X,), [S0])) == [Strategy(((R,),), ((R,),))]
    assert outputs_of(make_call(aten.prod.default, (X,), [S0]), [S0]) == []


def test_norm_orders() -> None:
    for ord_, out in [(1, P), (0, P), (INF, PMAX), (-INF, PMIN), (2, None), (3, None)]:
        call = make_call(aten.linalg_vector_norm.default, (X, ord_, [1]), [S1])
        assert outputs_of(call, [S1]) == ([] if out is None else [(out,)]), ord_
        assert outputs_of(call, [S0]) == [(S0,)]
        assert all(outputs_of(call, [p]) == [] for p in (P, PMAX))
    assert outputs_of(make_call(aten.norm.ScalarOpt_dim, (X, INF, [0]), [S0]), [S0]) == [(PMAX,)]
    assert outputs_of(make_call(aten.norm.Scalar, (X, 1), [S0]), [S0]) == [(P,)]


def test_all_any_count_nonzero() -> None:
    call = make_call(aten.all.dim, (XB, 0), [S0])
    assert outputs_of(call, [S0]) == [(PMIN,)] and outputs_of(call, [PMIN]) == [(PMIN,)]
    call = make_call(aten.any.default, (XB,), [S1])
    assert outputs_of(call, [S1]) == [(PMAX,)] and outputs_of(call, [PMAX]) == [(PMAX,)]
    # for signed or float values min/max of the pieces is not and/or of their truth values
    call = make_call(aten.any.default, (X,), [PMAX])
    assert outputs_of(call, [S0]) == [(PMAX,)] and outputs_of(call, [PMAX]) == []
    # all.dims with dim=[] reduces nothing
    call = make_call(aten.all.dims, (XB, []), [S0])
    assert outputs_of(call, [S0]) == [(S0,)]
    call = make_call(aten.count_nonzero.dim_IntList, (XZ, [0]), [S0])
    assert outputs_of(call, [S0]) == [(P,)] and outputs_of(call, [P]) == []


def test_scans_need_the_scan_dim_replicated() -> None:
    call = make_call(aten.cumsum.default, (X, 1), [S1])
    assert outputs_of(call, [S1]) == [] and outputs_of(call, [S0]) == [(S0,)]
    assert outputs_of(call, [P]) == [(P,)] and outputs_of(call, [PAVG]) == [(PAVG,)]
    call = make_call(aten.cumprod.default, (X, 0), [S0])
    assert outputs_of(call, [S0]) == [] and outputs_of(call, [S1]) == [(S1,)] and outputs_of(call, [P]) == []
    call = make_call(aten.cummax.default, (X, 0), [S1])
    assert outputs_of(call, [S1]) == [(S1, S1)]


def test_sort_topk_kthvalue_keep_the_other_dims_sharded() -> None:
    # a router's top-k over experts (last dim) on token-sharded scores stays token-sharded
    call = make_call(aten.topk.default, (X, 2), [S0])
    assert outputs_of(call, [S0]) == [(S0, S0)] and outputs_of(call, [S1]) == [] and outputs_of(call, [P]) == []
    call = make_call(aten.sort.default, (Y3, 1), [S2])
    assert outputs_of(call, [S2]) == [(S2, S2)] and outputs_of(call, [S1]) == []
    call = make_call(aten.kthvalue.default, (Y3, 1, 0), [S2])  # dim 0 reduced: S2 -> S1
    assert outputs_of(call, [S2]) == [(S1, S1)] and outputs_of(call, [S0]) == []


def test_out_overloads_have_no_rule() -> None:
    for op in [aten.sum.IntList_out, aten.amax.out, aten.max.dim_max, aten.cumsum.out, aten.norm.out]:
        assert get_rule(op) is None, op


# ---- local implementations -------------------------------------------------------------------
def _ctx(op: Any, args: tuple, local_out: tuple[int, ...]) -> LocalContext:
    return LocalContext(make_call(op, args, [S0]), (local_out,))


def test_empty_shard_gives_the_identity() -> None:
    x = rnd(3, 4)
    empty = x[3:]
    ctx = _ctx(aten.amax.default, (x, [0]), (4,))
    impl = get_local_impl(aten.amax.default)
    assert impl is not None
    assert torch.equal(impl(ctx, empty, [0]), torch.full((4,), -INF))
    xi = rint(3, 4)
    impl = get_local_impl(aten.min.default)
    assert impl is not None
    got = impl(_ctx(aten.min.default, (xi,), ()), xi[3:])
    assert got.dtype == xi.dtype and got.item() == torch.iinfo(xi.dtype).max
    impl = get_local_impl(aten.linalg_vector_norm.default)
    assert impl is not None
    assert torch.equal(impl(_ctx(aten.linalg_vector_norm.default, (x, INF, [0]), (4,)), empty, INF, [0]), torch.zeros(4))
    # a globally empty input still raises like torch (meta max() of an empty tensor does not)
    e = torch.empty(0)
    call = OpCall(aten.max.default, (meta(e),), {}, (meta(e),), (meta(torch.zeros(())),), ((S0,),), (2,))
    impl = get_local_impl(aten.max.default)
    assert impl is not None
    with pytest.raises(RuntimeError):
        impl(LocalContext(call, ((),)), e)


# ---- brute force over 1-d and 2-d meshes -----------------------------------------------------
def split(x: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The n pieces of ``x`` under ``p`` along one mesh axis (random summands/candidates)."""
    if isinstance(p, Replicate):
        return [x.clone() for _ in range(n)]
    if isinstance(p, Shard):
        return [x.narrow(p.dim, *chunk_bounds(x.shape[p.dim], n, i)) for i in range(n)]
    if x.dtype == torch.bool:
        noise = [torch.rand(x.shape, generator=gen) > 0.5 for _ in range(n)]
    elif x.is_floating_point():
        noise = [torch.randint(-4, 5, x.shape, generator=gen).to(x.dtype) for _ in range(n)]
    else:
        noise = [torch.randint(0, 5, x.shape, generator=gen).to(x.dtype) for _ in range(n)]
    if p.reduce_type == "sum":
        pieces = [x - sum(noise[1:])] + noise[1:]
    elif p.reduce_type == "avg":
        mean = sum(noise) / n
        pieces = [x + e - mean for e in noise]
    elif p.reduce_type == "max":
        pieces = [x] + [torch.minimum(x, e) for e in noise[1:]]
    else:
        pieces = [x] + [torch.maximum(x, e) for e in noise[1:]]
    order = torch.randperm(n, generator=gen).tolist()  # any rank may hold the winning candidate
    return [pieces[i] for i in order]


def combine(pieces: list[torch.Tensor], p: Placement) -> torch.Tensor:
    if isinstance(p, Replicate):
        for q in pieces[1:]:
            torch.testing.assert_close(q, pieces[0], rtol=1e-5, atol=1e-5, equal_nan=True)
        return pieces[0]
    if isinstance(p, Shard):
        return torch.cat(pieces, dim=p.dim)
    stacked = torch.stack(pieces)
    if p.reduce_type == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    reduce = {"avg": torch.mean, "max": torch.amax, "min": torch.amin}[p.reduce_type]
    return reduce(stacked, 0)


def distribute(x: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], gen: torch.Generator) -> dict:
    """coord -> local piece; axes split one after another (the default shard order)."""
    pieces: dict[tuple[int, ...], torch.Tensor] = {(): x}
    for p, n in zip(placements, mesh_shape):
        pieces = {c + (i,): q for c, t in pieces.items() for i, q in enumerate(split(t, p, n, gen))}
    return pieces


def collect(pieces: dict, placements: Sequence[Placement]) -> torch.Tensor:
    for axis in reversed(range(len(placements))):
        groups: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        for c in sorted(pieces):
            groups[c[:-1]].append(pieces[c])
        pieces = {c: combine(g, placements[axis]) for c, g in groups.items()}
    return pieces[()]


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Sequence[int]) -> tuple[int, ...]:
    out = list(shape)
    for p, n, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Shard):
            out[p.dim] = chunk_bounds(out[p.dim], n, c)[1]
    return tuple(out)


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def check_strategy(op: Any, args: tuple, kwargs: dict, s: Strategy, mesh_shape: tuple[int, ...], gen: torch.Generator) -> None:
    inputs = tensors_in(args)
    expected = _as_tuple(op(*args, **kwargs))
    dist_in = [distribute(t, p, mesh_shape, gen) for t, p in zip(inputs, s.inputs)]
    call = make_call(op, args, [p for p in s.inputs], mesh_shape, kwargs)
    impl = get_local_impl(op)
    local_outs: list[dict] = [{} for _ in expected]
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        it = iter([d[coord] for d in dist_in])
        largs = map_tensors(args, lambda _t: next(it))
        if impl is not None:
            shapes = tuple(local_shape(e.shape, p, mesh_shape, coord) for e, p in zip(expected, s.outputs))
            out = _as_tuple(impl(LocalContext(call, shapes, coord=coord), *largs, **kwargs))
        else:
            out = _as_tuple(op(*largs, **kwargs))
        for i, o in enumerate(out):
            local_outs[i][coord] = o
    for i, (e, p) in enumerate(zip(expected, s.outputs)):
        got = collect(local_outs[i], p)
        torch.testing.assert_close(got, e, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{op} {s} out {i}: {m}")


BRUTE: list[tuple[Any, tuple, dict]] = [
    (aten.sum.default, (X,), {}),
    (aten.sum.default, (ZERO_D,), {}),
    (aten.sum.default, (XI,), {}),
    (aten.sum.default, (XB,), {}),
    (aten.sum.dim_IntList, (X, [1]), {"dtype": torch.float64}),
    (aten.sum.dim_IntList, (Y3, [0, 2], True), {}),
    (aten.sum.dim_IntList, (TINY, []), {}),
    (aten.mean.default, (X,), {}),
    (aten.mean.default, (ZERO_D,), {}),
    (aten.mean.default, (X,), {"dtype": torch.float64}),
    (aten.mean.dim, (Y3, [1], True), {}),
    (aten.mean.dim, (XI, [0]), {"dtype": torch.float32}),
    (aten.nansum.default, (XNAN, [1]), {}),
    (aten.count_nonzero.default, (XZ, 0), {}),
    (aten.count_nonzero.default, (XZ,), {}),
    (aten.count_nonzero.dim_IntList, (Y3, [0, 2]), {}),
    (aten.amax.default, (X, [0]), {}),
    (aten.amax.default, (Y3, [0, 2], True), {}),
    (aten.amax.default, (TINY,), {}),
    (aten.amax.default, (XI, [1]), {}),
    (aten.amax.default, (XB, [0]), {}),
    (aten.amin.default, (Y3, [1]), {}),
    (aten.amin.default, (XI,), {}),
    (aten.max.default, (X,), {}),
    (aten.max.default, (ZERO_D,), {}),
    (aten.min.default, (Y3,), {}),
    (aten.min.default, (XU8,), {}),
    (aten.aminmax.default, (X,), {}),
    (aten.aminmax.default, (Y3,), {"dim": 1, "keepdim": True}),
    (aten.aminmax.default, (XI,), {"dim": 0}),
    (aten.max.dim, (X, 1), {}),
    (aten.min.dim, (Y3, 0, True), {}),
    (aten.argmax.default, (X, 1), {}),
    (aten.argmax.default, (X,), {}),
    (aten.argmin.default, (Y3, 2, True), {}),
    (aten.prod.default, (X,), {}),
    (aten.prod.dim_int, (Y3, 1, True), {}),
    (aten.logsumexp.default, (X, [1]), {}),
    (aten.logsumexp.default, (Y3, [0, 2]), {}),
    (aten.var.correction, (X, [1]), {}),
    (aten.std.correction, (Y3, [0, 2]), {"correction": 0, "keepdim": True}),
    (aten.var_mean.correction, (X, [0]), {}),
    (aten.std_mean.correction, (X, None), {}),
    (aten.linalg_vector_norm.default, (X, 2, [1]), {}),
    (aten.linalg_vector_norm.default, (X, 1, [0]), {}),
    (aten.linalg_vector_norm.default, (Y3, INF, [0, 2], True), {}),
    (aten.linalg_vector_norm.default, (Y3, -INF, [1]), {}),
    (aten.linalg_vector_norm.default, (XZ, 0), {}),
    (aten.linalg_vector_norm.default, (X, INF), {"dtype": torch.float64}),
    (aten.norm.ScalarOpt_dim, (Y3, INF, [0]), {}),
    (aten.norm.Scalar, (X, 1), {}),
    (aten.all.default, (XB,), {}),
    (aten.all.dim, (XU8, 0), {}),
    (aten.all.dims, (XB, [0, 1], True), {}),
    (aten.all.dims, (XB, []), {}),
    (aten.any.dim, (X, 1), {}),
    (aten.any.dims, (Y3 > 0, [0, 1]), {}),
    (aten.any.default, (XB,), {}),
    (aten.cumsum.default, (X, 1), {}),
    (aten.cumsum.default, (Y3, 0), {"dtype": torch.float64}),
    (aten.cumsum.default, (XI, 0), {}),
    (aten.cumprod.default, (X, 0), {}),
    (aten.logcumsumexp.default, (X, 1), {}),
    (aten.cummax.default, (X, 0), {}),
    (aten.cummin.default, (Y3, 2), {}),
    (aten.sort.default, (X,), {}),
    (aten.sort.default, (Y3, 0, True), {}),
    (aten.sort.stable, (X,), {"dim": 0, "stable": True}),
    (aten.topk.default, (X, 2), {}),
    (aten.topk.default, (Y3, 2, 1, False), {}),
    (aten.kthvalue.default, (X, 2), {}),
    (aten.kthvalue.default, (Y3, 1, 0, True), {}),
    (aten.median.dim, (X, 0), {}),
    (aten.nanmedian.dim, (XNAN, 1, True), {}),
    (aten.mode.default, (XI, 0), {}),
]
CURRENT = [R, S0, S1, S2, P, PAVG, PMAX, PMIN]


def _currents(x: torch.Tensor, mesh_shape: tuple[int, ...]) -> list[tuple[Placement, ...]]:
    """Current placements to ask the rule with (rules may depend on them), valid for ``x``."""
    ok = [p for p in CURRENT if not (isinstance(p, Shard) and p.dim >= x.ndim)]
    if x.dtype in (torch.bool, torch.uint8) or not x.is_floating_point():
        ok = [p for p in ok if p != PAVG]
    if x.dtype == torch.bool:
        ok = [p for p in ok if p not in (P,)]
    combos = [c for c in itertools.product(ok, repeat=len(mesh_shape)) if partials_compatible(c)]
    return combos


@pytest.mark.parametrize("mesh_shape", [(3,), (4,), (2, 2), (2, 3)], ids=str)
@pytest.mark.parametrize("op, args, kwargs", BRUTE, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BRUTE)])
def test_offered_strategies_are_exact(op: Any, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    x = tensors_in(args)[0]
    seen: set[Strategy] = set()
    for cur in _currents(x, mesh_shape):
        seen.update(strategies(make_call(op, args, [cur], mesh_shape, kwargs)))
    assert seen
    for s in seen:
        for inp in s.inputs:
            assert partials_compatible(inp)
        check_strategy(op, args, kwargs, s, mesh_shape, gen)
