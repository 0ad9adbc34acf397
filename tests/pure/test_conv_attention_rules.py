"""Rules of ``spmd_rules.conv_attention``: SDPA, convolution, pooling, batch/group norm.

Brute force on a 1-d mesh of 3 ranks (uneven shards, empty ones on 2-long dims): every strategy a rule offers,
asked with every fitting current placement of the first input, must reproduce the op on the
global inputs — outputs combined as claimed, and inputs written in place (running stats)
combined as their placement says. The 4-rank world part (each op forward and backward on
DistTensors against plain torch) is ``tests/world/test_conv_attention_rules_world.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autoparallel import Partial, ProcessMesh, Replicate, Shard
from autoparallel.engine.kernels import kernel_for
from autoparallel.placement import chunk_bounds
from autoparallel.spec import DistSpec
from spmd_rules import LocalContext, OpCall, Strategy, TensorMeta, get_rule
from tests.pure.test_rules import combine, shard
from tests.simcomm import SimComm
from tests.treeutil import map_tensors, tensors_in

aten = torch.ops.aten
R = Replicate()
_GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN, dtype=torch.float64)


def _meta(t: Any) -> TensorMeta | None:
    return None if t is None else TensorMeta(tuple(t.shape), t.dtype)


def _outs(out: Any) -> list[Any]:
    return [out] if isinstance(out, torch.Tensor) or out is None else list(out)


def _clone(x: Any) -> Any:
    return map_tensors(x, lambda t: t.clone())


def make_call(op: Any, args: tuple, kwargs: dict, placements: list, n: int) -> OpCall:
    outs = _outs(op(*_clone(args), **_clone(kwargs)))
    inputs = tensors_in(args) + tensors_in(kwargs)
    metas = {id(t): _meta(t) for t in inputs}
    return OpCall(
        op, map_tensors(args, lambda t: metas[id(t)]), map_tensors(kwargs, lambda t: metas[id(t)]),
        tuple(metas[id(t)] for t in inputs), tuple(_meta(o) for o in outs),  # type: ignore[misc]
        tuple((p,) for p in placements), (n,),
    )


def _sdpa_bwd_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, mask: Any = None) -> tuple:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, attn_mask=mask)
    return (rnd(*out.shape), q, k, v, out, lse, 0.0, causal)


def _conv_bwd_args(x: torch.Tensor, w: torch.Tensor, b: Any, stride: list, pad: list, transposed: bool,
                   groups: int, mask: list) -> tuple:
    dil, opad = [1] * len(stride), [0] * len(stride)
    y = aten.convolution.default(x, w, b, stride, pad, dil, transposed, opad, groups)
    return (rnd(*y.shape), x, w, None if b is None else list(b.shape), stride, pad, dil, transposed, opad, groups, mask)


Q, K, V = rnd(3, 5, 4, 6), rnd(3, 5, 7, 6), rnd(3, 5, 7, 6)
CAUSAL6 = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
X4 = rnd(3, 5, 6, 6)
W, B = rnd(4, 5, 3, 3), rnd(4)
C5 = rnd(5)
_idx = aten.max_pool2d_with_indices.default(X4, [2, 2], [2, 2], [0, 0], [1, 1], False)[1]
_idx4 = aten.max_pool2d_with_indices.default(X4[:2, :2, :4, :4], [2, 2], [2, 2], [0, 0], [1, 1], False)[1]
_bn = aten.native_batch_norm.default(X4, C5, C5 + 1, C5 * 0, C5.abs() + 1, True, 0.1, 1e-5)
_gn = aten.native_group_norm.default(rnd(3, 6, 2, 2), rnd(6), rnd(6), 3, 6, 4, 3, 1e-5)

SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
GQA = (rnd(2, 6, 4, 5), rnd(2, 3, 4, 5), rnd(2, 3, 4, 5))
SDPA_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
CASES: list[tuple[Any, tuple, dict]] = [
    (SDPA, (Q, K, V), {}),
    (SDPA, (Q, K, V, 0.0, True), {}),
    (SDPA, (Q, K, V), {"attn_mask": rnd(3, 5, 4, 7)}),
    (SDPA, (Q, K, V), {"attn_mask": rnd(1, 5, 4, 7)}),
    (SDPA, (Q, K, V), {"attn_mask": rnd(4, 7)}),
    (SDPA_BWD, _sdpa_bwd_args(Q, K, V), {}),
    (SDPA_BWD, _sdpa_bwd_args(Q, K, V, True), {}),
    (SDPA_BWD, _sdpa_bwd_args(Q, K, V, mask=rnd(3, 1, 4, 7)), {"attn_mask": rnd(3, 1, 4, 7)}),
    (aten.convolution.default, (X4, W, B, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
    (aten.convolution.default, (rnd(3, 5, 8), rnd(3, 5, 3), None, [2], [0], [1], False, [0], 1), {}),
    (aten.convolution.default, (rnd(3, 4, 5, 5), rnd(6, 2, 3, 3), rnd(6), [1, 1], [0, 0], [1, 1], False, [0, 0], 2), {}),
    (aten.convolution.default, (X4, rnd(5, 4, 3, 3), rnd(4), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}),
    (aten.convolution_backward.default, _conv_bwd_args(X4[..., :4, :4], W, B, [1, 1], [1, 1], False, 1, [True, True, True]), {}),
    (aten.convolution_backward.default, _conv_bwd_args(X4[..., :4, :4], W, B, [2, 2], [0, 0], False, 1, [True, False, True]), {}),
    (aten.convolution_backward.default, _conv_bwd_args(X4[..., :4, :4], W, None, [1, 1], [0, 0], False, 1, [False, True, False]), {}),
    (aten.convolution_backward.default,
     _conv_bwd_args(rnd(3, 4, 5, 5), rnd(6, 2, 3, 3), rnd(6), [1, 1], [0, 0], False, 2, [True, True, True]), {}),
    (aten.convolution.default, (rnd(2, 2, 5, 5), rnd(2, 2, 3, 3), rnd(2), [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
    (aten.convolution_backward.default,
     _conv_bwd_args(rnd(2, 2, 5, 5), rnd(2, 2, 3, 3), rnd(2), [1, 1], [0, 0], False, 1, [True, True, True]), {}),
    (SDPA, (rnd(2, 2, 3, 4), rnd(2, 2, 3, 4), rnd(2, 2, 3, 4)), {}),
    (SDPA, GQA, {}),  # grouped-query attention: 6 query heads read 3 key/value heads (2 each)
    (SDPA, (GQA[0], GQA[1], GQA[2], 0.0, True), {}),
    (SDPA_BWD, _sdpa_bwd_args(*GQA, True), {}),
    (SDPA, (rnd(2, 4, 3, 4), rnd(2, 2, 3, 4), rnd(2, 2, 3, 4)), {}),  # 2 kv heads on 3 ranks: not by heads
    # the sequence sharded (the ring kernel): 6 = 2 halves per rank, so causal runs balanced
    (SDPA, (rnd(2, 2, 6, 4), rnd(2, 2, 6, 4), rnd(2, 2, 6, 4), 0.0, True), {}),
    (SDPA, (rnd(1, 6, 6, 4), rnd(1, 3, 6, 4), rnd(1, 3, 6, 4)), {"scale": 0.3}),
    (SDPA_BWD, _sdpa_bwd_args(rnd(2, 6, 6, 4), rnd(2, 3, 6, 4), rnd(2, 3, 6, 4), True), {}),
    (SDPA_BWD, _sdpa_bwd_args(rnd(1, 2, 9, 4), rnd(1, 2, 9, 4), rnd(1, 2, 9, 4), True), {}),  # unbalanced
    (SDPA_BWD, _sdpa_bwd_args(rnd(1, 2, 6, 4), rnd(1, 2, 6, 4), rnd(1, 2, 6, 4)), {}),
    # ... with a mask tensor (transformers passes its causal mask as one; the kernel takes it
    # additive, in the query's dtype): its rows follow the queries
    (SDPA, (rnd(2, 2, 6, 4), rnd(2, 2, 6, 4), rnd(2, 2, 6, 4)), {"attn_mask": CAUSAL6}),
    (SDPA, (rnd(2, 2, 6, 4), rnd(2, 2, 6, 4), rnd(2, 2, 6, 4)), {"attn_mask": rnd(2, 1, 6, 6)}),
    (SDPA_BWD, _sdpa_bwd_args(rnd(1, 2, 6, 4), rnd(1, 2, 6, 4), rnd(1, 2, 6, 4), False, CAUSAL6), {"attn_mask": CAUSAL6}),
    (aten.max_pool2d_with_indices.default, (X4, [2, 2]), {}),
    (aten.max_pool2d_with_indices.default, (rnd(5, 7, 7), [3, 3], [2, 2], [1, 1]), {}),
    (aten.max_pool2d_with_indices_backward.default,
     (rnd(3, 5, 3, 3), X4, [2, 2], [2, 2], [0, 0], [1, 1], False, _idx), {}),
    (aten.avg_pool2d.default, (X4, [3, 3], [2, 2], [1, 1]), {}),
    (aten.avg_pool2d_backward.default, (rnd(3, 5, 3, 3), X4, [3, 3], [2, 2], [1, 1], False, True, None), {}),
    (aten._adaptive_avg_pool2d.default, (X4, [2, 4]), {}),
    (aten._adaptive_avg_pool2d_backward.default, (rnd(3, 5, 2, 4), X4), {}),
    (aten.max_pool2d_with_indices.default, (rnd(2, 2, 4, 4), [2, 2]), {}),
    (aten.max_pool2d_with_indices_backward.default, (rnd(2, 2, 2, 2), X4[:2, :2, :4, :4], [2, 2], [2, 2], [0, 0], [1, 1],
                                                     False, _idx4), {}),
    (aten.avg_pool2d_backward.default, (rnd(2, 2, 2, 2), rnd(2, 2, 4, 4), [2, 2], [2, 2], [0, 0], False, True, None), {}),
    (aten._adaptive_avg_pool2d.default, (rnd(2, 4, 5), [3, 2]), {}),
    (aten._adaptive_avg_pool2d_backward.default, (rnd(2, 3, 2), rnd(2, 4, 5)), {}),
    (aten.avg_pool3d.default, (rnd(3, 5, 4, 4, 4), [2, 2, 2]), {}),
    (aten.native_batch_norm.default, (X4, C5, C5 + 1, C5 * 0, C5.abs() + 1, True, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (X4, C5, C5 + 1, C5 * 0, C5.abs() + 1, False, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (X4, C5, None, None, None, True, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit.default, (X4, C5, C5 + 1, C5 * 0, C5.abs() + 1, True, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit.no_stats, (X4, C5, C5 + 1, True, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit_no_training.default, (X4, C5, C5 + 1, C5 * 0, C5.abs() + 1, 0.1, 1e-5), {}),
    (aten.native_batch_norm_backward.default,
     (rnd(3, 5, 6, 6), X4, C5, C5 * 0, C5.abs() + 1, _bn[1], _bn[2], True, 1e-5, [True, True, True]), {}),
    (aten.native_batch_norm.default, (rnd(2, 2, 3), rnd(2), rnd(2), rnd(2), rnd(2).abs(), True, 0.1, 1e-5), {}),
    (aten.native_batch_norm_backward.default,
     (rnd(2, 2, 3), rnd(2, 2, 3), rnd(2), None, None, rnd(2), rnd(2).abs(), True, 1e-5, [True, True, True]), {}),
    (aten.native_batch_norm_backward.default,
     (rnd(3, 5, 6, 6), X4, C5, C5 * 0, C5.abs() + 1, rnd(0), rnd(0), False, 1e-5, [True, True, False]), {}),
    (aten.native_group_norm.default, (rnd(3, 6, 2, 2), rnd(6), rnd(6), 3, 6, 4, 3, 1e-5), {}),
    (aten.native_group_norm_backward.default,
     (rnd(3, 6, 2, 2), rnd(3, 6, 2, 2), _gn[1], _gn[2], rnd(6), 3, 6, 4, 3, [True, True, True]), {}),
]
PLACEMENTS = [R, Shard(0), Shard(1), Shard(2), Partial(), Partial("avg")]


def _local_shape(t: Any, p: Any, n: int, i: int) -> tuple[int, ...] | None:
    if t is None:
        return None
    shape = list(t.shape)
    if isinstance(p, Shard):
        shape[p.dim] = chunk_bounds(shape[p.dim], n, i)[1]
    return tuple(shape)


def _run(op: Any, call: OpCall, s: Strategy, expected: list, i: int, args: tuple, kwargs: dict,
         in_specs: tuple, comm: SimComm) -> Any:
    """The op's local step at rank ``i`` as the engine runs it (``kernel_for``: a rule's local
    implementation, or a kernel issuing its collectives through ``comm``)."""
    impl = kernel_for(op)
    if impl is None:
        return op(*args, **kwargs)
    n = call.mesh_shape[0]
    shapes = tuple(_local_shape(t, p[0], n, i) for t, p in zip(expected, s.outputs))
    return impl(LocalContext(call, shapes, in_specs, (), (i,), comm), *args, **kwargs)


@pytest.mark.parametrize("n", [3])  # uneven shards, and empty ones on the 2-long dims
@pytest.mark.parametrize("op, args, kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_offered_strategies_are_exact(op: Any, args: tuple, kwargs: dict, n: int) -> None:
    inputs = tensors_in(args) + tensors_in(kwargs)
    gen = torch.Generator().manual_seed(0)
    g_args, g_kwargs = _clone(args), _clone(kwargs)
    expected = _outs(op(*g_args, **g_kwargs))
    expected_inputs = tensors_in(g_args) + tensors_in(g_kwargs)  # after any in-place update
    rule = get_rule(op)
    assert rule is not None, op
    seen: set[Strategy] = set()
    for cur in PLACEMENTS:
        if isinstance(cur, Shard) and cur.dim >= inputs[0].ndim:
            continue
        seen.update(rule(make_call(op, args, kwargs, [cur] + [R] * (len(inputs) - 1), n)))
    assert len(seen) > 1
    for s in seen:
        call = make_call(op, args, kwargs, [p[0] for p in s.inputs], n)
        pieces = [[pc.clone() for pc in shard(t, p[0], n, gen)] for t, p in zip(inputs, s.inputs)]
        mesh = ProcessMesh(list(range(n)))
        in_specs = tuple(DistSpec(mesh, p, tuple(t.shape), t.dtype) for t, p in zip(inputs, s.inputs))
        comm = SimComm([(i,) for i in range(n)])

        def rank(c: tuple[int, ...], pieces: list = pieces, call: OpCall = call, s: Strategy = s,
                 in_specs: tuple = in_specs, comm: SimComm = comm) -> Any:
            it = iter([pc[c[0]] for pc in pieces])
            take = lambda _t: next(it)  # noqa: E731
            return _outs(_run(op, call, s, expected, c[0], map_tensors(args, take), map_tensors(kwargs, take),
                              in_specs, comm))

        done = comm.run(rank)
        local_out = [done[(i,)] for i in range(n)]
        for k, want in enumerate(expected):
            if want is None:
                continue
            got = combine([lo[k] for lo in local_out], s.outputs[k][0])
            torch.testing.assert_close(got, want, msg=lambda m: f"{op} {s} out {k}: {m}")
        for j, (want, pc) in enumerate(zip(expected_inputs, pieces)):
            got = combine(pc, s.inputs[j][0]) if not isinstance(s.inputs[j][0], Partial) else want
            torch.testing.assert_close(got, want, msg=lambda m: f"{op} {s} in {j}: {m}")


def _case(op: Any) -> tuple[Any, tuple]:
    return next((c[0], c[1]) for c in CASES if c[0] is op)


def test_expected_strategies() -> None:
    S0, S1, P = Shard(0), Shard(1), Partial()
    conv = make_call(aten.convolution.default, CASES[8][1], {}, [R, R, R], 2)
    found = {(tuple(p[0] for p in s.inputs), s.outputs[0][0]) for s in get_rule(conv.op)(conv)}  # type: ignore[misc]
    assert ((S0, R, R), S0) in found and ((R, S0, S0), S1) in found and ((S1, S1, P), P) in found
    grouped = make_call(aten.convolution.default, CASES[10][1], {}, [R, R, R], 2)
    assert all(s.inputs[1] != (S0,) for s in get_rule(grouped.op)(grouped))  # type: ignore[misc]
    bn = make_call(*_case(aten.native_batch_norm.default), {}, [R] * 5, 2)
    # training: channel shards, or batch/spatial shards whose statistics the kernel all-reduces
    assert {s.inputs[0][0] for s in get_rule(bn.op)(bn)} == {R, S0, S1, Shard(2), Shard(3)}  # type: ignore[misc]
    gn = make_call(*_case(aten.native_group_norm.default), {}, [R] * 3, 2)
    assert {s.inputs[0][0] for s in get_rule(gn.op)(gn)} == {R, S0}  # type: ignore[misc]


def test_sdpa_gqa_offers_the_heads_split_only_where_the_groups_align() -> None:
    """GQA (Llama's 8 query / 4 key-value heads) kept head-sharded: no all-to-all around attention."""
    rule = get_rule(SDPA)
    aligned = make_call(SDPA, GQA, {}, [Shard(1)] * 3, 3)
    assert any(all(p == (Shard(1),) for p in s.inputs[:3]) for s in rule(aligned)), rule(aligned)
    off = (rnd(2, 4, 3, 4), rnd(2, 2, 3, 4), rnd(2, 2, 3, 4))  # 2 key/value heads cannot split over 3 ranks
    assert not any(s.inputs[1] == (Shard(1),) for s in rule(make_call(SDPA, off, {}, [Shard(1)] * 3, 3)))


def test_sdpa_gqa_heads_split_counts_only_the_axes_that_split_the_heads() -> None:
    """dp x tp (2 x 2), 4 query / 2 key-value heads: the batch on dp and the heads on tp is kept
    as it is (each tp rank: 2 query heads, the 1 key/value head they read); both axes splitting
    the heads (half a key/value head each) is never offered."""
    q, kv = rnd(4, 4, 3, 4), rnd(4, 2, 3, 4)
    base = make_call(SDPA, (q, kv, kv.clone()), {}, [R] * 3, 2)
    now = ((Shard(0), Shard(1)),) * 3
    call = OpCall(base.op, base.args, base.kwargs, base.inputs, base.out, now, (2, 2))
    strategies = get_rule(SDPA)(call)
    assert any(s.inputs[:3] == now for s in strategies), strategies
    assert not any(s.inputs[1] == (Shard(1), Shard(1)) for s in strategies)


@pytest.mark.parametrize("current", [R, Shard(2)])
def test_the_sequence_is_sharded_on_one_mesh_axis_at_most(current: Any) -> None:
    """On a 2 x 2 mesh each axis may take the sequence, never both at once (the ring runs along
    one axis): the combinations offered shard query dim 2 on at most one axis."""
    q = rnd(2, 2, 8, 4)
    args = (q, q.clone(), q.clone(), 0.0, True)
    base = make_call(SDPA, args, {}, [R, R, R], 2)
    call = OpCall(base.op, base.args, base.kwargs, base.inputs, base.out,
                  ((current, current), (R, R), (R, R)), (2, 2))
    strategies = get_rule(SDPA)(call)
    seq = [s for s in strategies if Shard(2) in s.inputs[0]]
    assert seq, strategies  # offered, on either axis
    assert all(list(s.inputs[0]).count(Shard(2)) == 1 for s in seq)
