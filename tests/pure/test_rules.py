"""Pure tests of the SPMD rules, called directly with an ``OpCall`` built by hand.

Besides pinning the expected strategies, every strategy a rule offers for a few ops is checked
by brute force on a 1-d mesh: shard the global inputs as the strategy asks (random summands
for Partial), run the op on every rank's pieces, and combine the local outputs as the strategy
claims — the result must be the op on the global inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autoparallel import Partial, Replicate, Shard
from autoparallel.placement import StridedShard, chunk_bounds
from spmd_rules import OpCall, Strategy, TensorMeta, get_rule
from tests.treeutil import map_tensors, tensors_in

aten = torch.ops.aten
R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P = Partial()
_GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN)


def meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), t.dtype)




def make_call(
    op: Any, args: tuple, placements: list, mesh_shape: tuple[int, ...] = (2,), kwargs: dict | None = None
) -> OpCall:
    """An ``OpCall`` for ``op(*args, **kwargs)`` on real tensors; ``placements`` per input."""
    kwargs = kwargs or {}
    out = op(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    inputs = tensors_in(args) + tensors_in(kwargs)
    placements = [tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in placements]
    assert len(placements) == len(inputs)
    metas = {id(t): meta(t) for t in inputs}
    return OpCall(
        op,
        map_tensors(args, lambda t: metas[id(t)]),
        map_tensors(kwargs, lambda t: metas[id(t)]),
        tuple(metas[id(t)] for t in inputs),
        tuple(meta(o) for o in outs),
        tuple(placements),
        mesh_shape,
    )


def strategies(call: OpCall) -> list[Strategy]:
    rule = get_rule(call.op)
    assert rule is not None, call.op
    return list(rule(call))


def offers(call: OpCall, inputs: list, outputs: list) -> bool:
    """Whether the rule offers inputs -> outputs (1-d mesh: one placement each)."""
    want = Strategy(tuple((p,) for p in inputs), tuple((p,) for p in outputs))
    return want in strategies(call)


def outputs_for(call: OpCall, inputs: list) -> list[tuple]:
    key = tuple((p,) for p in inputs)
    return [s.outputs for s in strategies(call) if s.inputs == key]


# ---- matmul ----------------------------------------------------------------------------------
A, B = rnd(4, 6), rnd(6, 8)


def test_mm_strategies() -> None:
    call = make_call(aten.mm.default, (A, B), [S0, R])
    assert offers(call, [S0, R], [S0])
    assert offers(call, [R, S1], [S1])
    assert offers(call, [S1, S0], [P])
    assert offers(call, [R, R], [R])
    assert offers(call, [P, R], [P]) and offers(call, [R, P], [P])
    assert outputs_for(call, [S0, S0]) == []
    assert outputs_for(call, [S1, R]) == []


def test_mm_on_2d_mesh_is_product_of_axes() -> None:
    call = make_call(aten.mm.default, (A, B), [(S0, R), (R, S1)], mesh_shape=(2, 2))
    found = strategies(call)
    assert Strategy(((S0, R), (R, S1)), ((S0, S1),)) in found
    assert Strategy(((S1, S0), (S0, R)), ((P, S0),)) in found
    # every combination of the 1-d strategies is there
    one = strategies(make_call(aten.mm.default, (A, B), [S0, R]))
    assert len(found) == len(one) ** 2


def test_addmm_bias_follows_output() -> None:
    bias = rnd(8)
    call = make_call(aten.addmm.default, (bias, A, B), [R, S0, R])
    assert offers(call, [R, S0, R], [S0])  # 1-d bias broadcast along rows stays replicated
    assert offers(call, [S0, R, S1], [S1])
    assert offers(call, [P, P, R], [P])  # bias_i + m1_i @ m2 sums to bias + m1 @ m2
    # a Partial bias alone is wrong: sum_i (bias_i + m1 @ m2) counts the product n times
    assert outputs_for(call, [P, R, R]) == []


# ---- pointwise -------------------------------------------------------------------------------
X, Y = rnd(4, 6), rnd(4, 6)


def test_add_two_tensors_keeps_partial() -> None:
    call = make_call(aten.add.Tensor, (X, Y), [P, P])
    assert offers(call, [P, P], [P])
    assert offers(call, [Partial("avg"), Partial("avg")], [Partial("avg")])
    assert offers(call, [S0, S0], [S0]) and offers(call, [S1, S1], [S1])
    assert outputs_for(call, [P, R]) == []  # x + y summed on every rank adds y n times
    assert outputs_for(call, [Partial("max"), Partial("max")]) == []


def test_add_scalar_offers_no_partial() -> None:
    call = make_call(aten.add.Tensor, (X, 2.0), [P])
    assert all(not isinstance(p, Partial) for s in strategies(call) for o in s.outputs for p in o)
    assert outputs_for(call, [P]) == []
    assert offers(call, [S0], [S0])


def test_add_broadcast_follows_output() -> None:
    row = rnd(6)
    call = make_call(aten.add.Tensor, (X, row), [S0, R])
    assert offers(call, [S0, R], [S0])
    assert offers(call, [S1, S0], [S1])


def test_mul_by_scalar_and_replicated_keeps_partial() -> None:
    assert offers(make_call(aten.mul.Tensor, (X, 3.0), [P]), [P], [P])
    assert offers(make_call(aten.mul.Tensor, (X, Y), [P, R]), [P, R], [P])
    assert offers(make_call(aten.mul.Tensor, (X, Y), [R, P]), [R, P], [P])
    assert outputs_for(make_call(aten.mul.Tensor, (X, Y), [P, P]), [P, P]) == []
    # only the numerator of a division may be partial
    div = make_call(aten.div.Tensor, (X, Y), [P, R])
    assert offers(div, [P, R], [P]) and outputs_for(div, [R, P]) == []


def test_masked_fill_keeps_a_partial_where_the_fill_reduces_to_itself() -> None:
    mask = X > 0
    zero = make_call(aten.masked_fill.Scalar, (X, mask, 0.0), [P, R])
    assert offers(zero, [P, R], [P])  # a sum of zeros is zero
    three = make_call(aten.masked_fill.Scalar, (X, mask, 3.0), [P, R])
    assert outputs_for(three, [P, R]) == []  # a sum of threes is not three
    pmax = Partial("max")
    assert offers(make_call(aten.masked_fill.Scalar, (X, mask, 3.0), [pmax, R]), [pmax, R], [pmax])


def test_nonlinear_pointwise_offers_no_partial() -> None:
    call = make_call(aten.exp.default, (X,), [P])
    assert outputs_for(call, [P]) == []
    assert offers(call, [S1], [S1])


# ---- reductions ------------------------------------------------------------------------------
def test_sum_over_sharded_dim_is_partial() -> None:
    call = make_call(aten.sum.dim_IntList, (X, [0]), [S0])
    assert offers(call, [S0], [P])
    assert offers(call, [S1], [S0])  # the kept dim 1 becomes output dim 0
    call = make_call(aten.sum.dim_IntList, (X, [0], True), [S0])
    assert offers(call, [S1], [S1])  # keepdim
    call = make_call(aten.sum.default, (X,), [S1])
    assert offers(call, [S1], [P]) and offers(call, [S0], [P])
    assert offers(call, [P], [P])


# ---- views -----------------------------------------------------------------------------------
def test_view_merging_sharded_leading_dim_keeps_shard() -> None:
    x = rnd(4, 6)
    call = make_call(aten.view.default, (x, [24]), [S0])
    assert strategies(call) == [Strategy(((S0,),), ((S0,),))]


def test_view_merging_unevenly_sharded_dim_needs_replicate() -> None:
    # rows 0-1 and row 2 of a (3, 6) tensor flatten to 12 and 6 elements: not torch.chunk(18, 2)
    x = rnd(3, 6)
    call = make_call(aten.view.default, (x, [18]), [S0])
    assert strategies(call) == [Strategy(((R,),), ((R,),))]


def test_view_merging_inner_sharded_dim_is_strided() -> None:
    x = rnd(4, 6)
    call = make_call(aten.view.default, (x, [24]), [S1])
    assert strategies(call) == [Strategy(((S1,),), ((StridedShard(0, 4),),))]
    call = make_call(aten.view.default, (rnd(4, 5, 3), [60]), [S1])  # uneven, not its block's last dim
    assert strategies(call) == [Strategy(((R,),), ((R,),))]


def test_view_split_and_partial() -> None:
    x = rnd(8, 3)
    call = make_call(aten.view.default, (x, [2, 4, 3]), [S0])
    assert strategies(call) == [Strategy(((S0,),), ((S0,),))]
    call = make_call(aten.view.default, (x, [2, 4, 3]), [P])
    assert strategies(call) == [Strategy(((P,),), ((P,),))]


def test_transpose_moves_shard() -> None:
    x = rnd(4, 6)
    assert strategies(make_call(aten.transpose.int, (x, 0, 1), [S0])) == [Strategy(((S0,),), ((S1,),))]
    assert strategies(make_call(aten.transpose.int, (x, 0, 1), [S1])) == [Strategy(((S1,),), ((S0,),))]
    assert strategies(make_call(aten.t.default, (x,), [S0])) == [Strategy(((S0,),), ((S1,),))]
    y = rnd(2, 3, 4)
    assert strategies(make_call(aten.transpose.int, (y, -1, 0), [S1])) == [Strategy(((S1,),), ((S1,),))]
    assert strategies(make_call(aten.transpose.int, (y, -1, 0), [S2])) == [Strategy(((S2,),), ((S0,),))]


# ---- brute force: every offered strategy computes the right thing ---------------------------
def shard(x: torch.Tensor, p: Any, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The n local pieces of ``x`` under placement ``p`` (random summands for Partial)."""
    if isinstance(p, Replicate):
        return [x.clone() for _ in range(n)]
    if isinstance(p, Shard):
        return [x.narrow(p.dim, *chunk_bounds(x.shape[p.dim], n, i)) for i in range(n)]
    if isinstance(p, StridedShard):  # each of the blocks split alike, a rank's pieces in block order
        d, f = p.dim, p.split_factor
        blocks = x.unflatten(d, (f, x.shape[d] // f))
        return [blocks.narrow(d + 1, *chunk_bounds(blocks.shape[d + 1], n, i)).flatten(d, d + 1) for i in range(n)]
    noise = [torch.randint(0, 5, x.shape, generator=gen).to(x.dtype) for _ in range(n)]
    if p.reduce_type == "sum":
        return [x - sum(noise[1:])] + noise[1:]
    if p.reduce_type == "avg":
        mean = sum(noise) / n
        return [x + e - mean for e in noise]
    sign = -1 if p.reduce_type == "max" else 1
    return [x] + [x + sign * e for e in noise[1:]]


def combine(pieces: list[torch.Tensor], p: Any) -> torch.Tensor:
    if isinstance(p, Replicate):
        for q in pieces[1:]:
            torch.testing.assert_close(q, pieces[0])
        return pieces[0]
    if isinstance(p, Shard):
        return torch.cat(pieces, dim=p.dim)
    stacked = torch.stack(pieces)
    reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}[p.reduce_type]
    return reduce(stacked, 0)


BRUTE = [
    (aten.mm.default, (rnd(5, 3), rnd(3, 4))),
    (aten.mm.default, (rnd(1, 7), rnd(7, 2))),
    (aten.addmm.default, (rnd(4), rnd(5, 3), rnd(3, 4))),
    (aten.addmv.default, (rnd(5), rnd(5, 3), rnd(3))),
    (aten.bmm.default, (rnd(3, 2, 5), rnd(3, 5, 2))),
    (aten.baddbmm.default, (rnd(2, 1), rnd(3, 2, 5), rnd(3, 5, 2))),
    (aten.add.Tensor, (rnd(5, 3), rnd(5, 3))),
    (aten.add.Tensor, (rnd(5, 3), rnd(3))),
    (aten.add.Tensor, (rnd(5, 3), 2.0)),
    (aten.sub.Tensor, (rnd(5, 3), rnd(1, 3))),
    (aten.mul.Tensor, (rnd(5, 3), rnd(5, 3))),
    (aten.mul.Tensor, (rnd(5, 3), 0.5)),
    (aten.div.Tensor, (rnd(5, 3), rnd(5, 3).abs() + 1)),
    (aten.neg.default, (rnd(5, 3),)),
    (aten.exp.default, (rnd(5, 3),)),
    (aten.clone.default, (rnd(5, 3),)),
    (aten.sum.default, (rnd(5, 3),)),
    (aten.sum.dim_IntList, (rnd(5, 3), [1])),
    (aten.sum.dim_IntList, (rnd(5, 3, 2), [0, 2], True)),
    (aten.transpose.int, (rnd(5, 3), 0, 1)),
    (aten.permute.default, (rnd(5, 3, 2), [2, 0, 1])),
    (aten.unsqueeze.default, (rnd(5, 3), 1)),
]
PLACEMENTS = [R, S0, S1, S2, P, Partial("avg"), Partial("max")]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op, args", BRUTE, ids=[f"{op}-{i}" for i, (op, _) in enumerate(BRUTE)])
def test_offered_strategies_are_exact(op: Any, args: tuple, n: int) -> None:
    inputs = tensors_in(args)
    gen = torch.Generator().manual_seed(0)
    expected = op(*args)
    seen: set[Strategy] = set()
    # ask with every current placement of the first input that fits (rules may depend on it)
    for cur in PLACEMENTS:
        if isinstance(cur, Shard) and cur.dim >= inputs[0].ndim:
            continue
        call = make_call(op, args, [cur] + [R] * (len(inputs) - 1), mesh_shape=(n,))
        seen.update(strategies(call))
    assert seen
    for s in seen:
        pieces = [shard(t, p[0], n, gen) for t, p in zip(inputs, s.inputs)]
        local_out = []
        for i in range(n):
            it = iter([pc[i] for pc in pieces])
            local_out.append(op(*map_tensors(args, lambda _t: next(it))))
        got = combine(local_out, s.outputs[0][0])
        torch.testing.assert_close(got, expected, msg=lambda m: f"{op} {s}: {m}")


VIEWS = [
    ((4, 6), (24,)), ((3, 6), (18,)), ((6, 4), (24,)), ((8, 3), (2, 4, 3)), ((6, 4), (3, 2, 4)),
    ((12,), (4, 3)), ((12,), (3, 4)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 12)), ((4, 2, 3), (8, 3)),
    ((6, 2), (3, 4)), ((9, 2), (3, 6)), ((5, 4), (20,)), ((1, 6), (6,)), ((4, 1, 3), (4, 3)),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("in_shape, out_shape", VIEWS, ids=[f"{a}->{b}" for a, b in VIEWS])
def test_view_strategies_are_exact(in_shape: tuple, out_shape: tuple, n: int) -> None:
    """A view keeps a shard only where each rank's piece, read in order, is its output piece."""
    x = torch.arange(torch.Size(in_shape).numel()).reshape(in_shape)
    y = x.reshape(out_shape)
    gen = torch.Generator().manual_seed(0)
    sharded = (Shard, StridedShard)
    strided = [StridedShard(d, f) for d in range(len(in_shape)) for f in range(2, in_shape[d]) if in_shape[d] % f == 0]
    for cur in [R, P] + [Shard(d) for d in range(len(in_shape))] + strided:
        (s,) = strategies(make_call(aten.view.default, (x, list(out_shape)), [cur], mesh_shape=(n,)))
        (p_in,), (p_out,) = s.inputs[0], s.outputs[0]
        assert p_in == cur or isinstance(p_in, Replicate)  # keeps the layout or asks for R
        assert isinstance(p_out, sharded) == isinstance(p_in, sharded)
        if isinstance(p_in, sharded):
            for a, b in zip(shard(x, p_in, n, gen), shard(y, p_out, n, gen)):
                assert a.flatten().tolist() == b.flatten().tolist(), (s, a, b)
