"""``StridedShard``: the layout, its expansion, the planner and the rules that keep it (no world).

Reference: ``tests.layouts.held_indices`` lists every rank's global indices from the placements'
definitions (blocks split by the plain axes, each block by the strided ones), without
``DistSpec.local_shape`` or ``expanded``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard, StridedShard
from autoparallel.spec import DistSpec
from reshard import plan_best
from reshard.plan import ALL_GATHER, VIEW, local_shape_table
from reshard.planner import plan_reshard
from spmd_rules.base import OpCall, TensorMeta
from spmd_rules.registry import get_rule
from tests.layouts import held_indices

aten = torch.ops.aten
R = Replicate()
MESH = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def spec(placements: tuple, shape: tuple[int, ...], mesh: ap.ProcessMesh = MESH) -> DistSpec:  # type: ignore[type-arg]
    return DistSpec(mesh, placements, shape, torch.float32)


def test_a_block_count_must_divide_the_dim_and_be_one_per_dim() -> None:
    with pytest.raises(ValueError, match="4 blocks do not divide tensor dim 0 of size 6"):
        spec((R, StridedShard(0, 4)), (6, 3))
    with pytest.raises(ValueError, match="different block counts"):
        spec((StridedShard(0, 2), StridedShard(0, 4)), (8, 3))
    with pytest.raises(TypeError, match="positive int split_factor"):
        StridedShard(0, 0)
    with pytest.raises(ValueError, match="does not exist"):
        spec((R, StridedShard(2, 2)), (8, 3))


def test_one_block_is_a_shard() -> None:
    s = spec((R, StridedShard(-2, 1)), (8, 3))
    assert s.placements == (R, Shard(0)) and not s.has_strided


def test_a_strided_layout_holds_no_box() -> None:
    s = spec((Shard(0), StridedShard(0, 4)), (24, 3))
    with pytest.raises(ValueError, match="holds no box"):
        s.local_box((0, 0))
    assert s.expanded() == spec((Shard(0), Shard(1)), (4, 6, 3))
    assert s.unstrided() == spec((Shard(0), R), (24, 3))


def test_uneven_block_splits_are_replicated_when_unstrided() -> None:
    """[b=3, h] flattened with b split over 2: the plain axis splits the 3 blocks 2 + 1, which is
    no Shard(0) of the 3 * h rows, so without the strided axis it is replicated too."""
    s = spec((Shard(0), StridedShard(0, 3)), (12, 5))
    assert s.local_shape((0, 0)) == (4, 5) and s.local_shape((1, 1)) == (2, 5)
    assert s.unstrided() == spec((R, R), (12, 5))


@st.composite
def _layouts(draw):  # type: ignore[no-untyped-def]
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    choices = [R, Partial()] + [Shard(i) for i in range(ndim)]
    for d in sorted(set(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=2)))):  # one or two strided dims
        f = draw(st.integers(2, 4))
        shape[d] *= f
        choices.append(StridedShard(d, f))
    placements = tuple(draw(st.lists(st.sampled_from(choices), min_size=2, max_size=2)))
    return placements, tuple(shape)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=_layouts())
def test_local_shapes_match_the_definition(case) -> None:  # type: ignore[no-untyped-def]
    placements, shape = case
    s = spec(placements, shape)
    for coord in [(i, j) for i in range(2) for j in range(2)]:
        want = tuple(len(held_indices(s, coord, dim)) for dim in range(len(shape)))
        assert s.local_shape(coord) == want, (s, coord)
    table = local_shape_table(s)  # the planner's vectorised shapes
    assert all(tuple(table[i, j]) == s.local_shape((i, j)) for i in range(2) for j in range(2)), s
    covered = sum(math.prod(s.local_shape((i, j))) for i in range(2) for j in range(2))
    assert covered == math.prod(shape) * math.prod(2 for p in placements if not isinstance(p, (Shard, StridedShard)))


def test_strided_to_its_unstrided_layout_is_one_gather_between_views() -> None:
    s = spec((Shard(0), StridedShard(0, 4)), (24, 3))
    plan = plan_reshard(s, s.unstrided())
    assert [st.kind for st in plan.steps] == [VIEW, ALL_GATHER, VIEW]
    assert plan.collectives() == [ALL_GATHER]
    back = plan_reshard(s.unstrided(), s)
    assert back.collectives() == [] and plan_best(s.unstrided(), s) == back


def test_other_block_counts_go_through_the_unstrided_layouts() -> None:
    a = spec((R, StridedShard(0, 4)), (24, 3))
    b = spec((R, StridedShard(0, 3)), (24, 3))
    plan = plan_reshard(a, b)
    assert plan.collectives() == [ALL_GATHER] and plan.src == a and plan.dst == b


def test_strided_moves_across_meshes_gather_first() -> None:
    other = ap.ProcessMesh([4, 5], dim_names=["x"])
    s = spec((Shard(0), StridedShard(0, 4)), (24, 3))
    plan = plan_best(s, DistSpec(other, (Shard(0),), (24, 3), torch.float32))
    assert plan.pre.dst == s.unstrided() and plan.pre.collectives() == [ALL_GATHER]  # type: ignore[union-attr]


def _call(op, shapes, placements, out_shapes, args=None, mesh_shape=(2, 2)):  # type: ignore[no-untyped-def]
    metas = tuple(TensorMeta(tuple(s), torch.float32) for s in shapes)
    return OpCall(op, args if args is not None else metas, {}, metas,
                  tuple(TensorMeta(tuple(s), torch.float32) for s in out_shapes), tuple(placements), mesh_shape)


def _view(shape_in, shape_out, placements, mesh_shape=(2, 2)):  # type: ignore[no-untyped-def]
    call = _call(aten.view.default, [shape_in], [placements], [shape_out],
                 (TensorMeta(tuple(shape_in), torch.float32), list(shape_out)), mesh_shape)
    (s,) = get_rule(aten.view.default)(call)  # type: ignore[misc]
    return s.inputs[0], s.outputs[0]


@pytest.mark.parametrize("shape_in,shape_out,placements,want", [
    # batch on dp, heads on tp: [b, h, s, d] -> [b * h, s, d] keeps both
    ((4, 6, 3, 5), (24, 3, 5), (Shard(0), Shard(1)), (Shard(0), StridedShard(0, 4))),
    ((24, 3, 5), (4, 6, 3, 5), (Shard(0), StridedShard(0, 4)), (Shard(0), Shard(1))),
    # an uneven batch (3 over 2): the plain axis splits the 3 blocks
    ((3, 5, 3, 5), (15, 3, 5), (Shard(0), Shard(1)), (Shard(0), StridedShard(0, 3))),
    ((15, 3, 5), (3, 5, 3, 5), (Shard(0), StridedShard(0, 3)), (Shard(0), Shard(1))),
    # the heads alone, and a sequence split under data parallelism (F.linear's [b * s, w])
    ((3, 6), (18,), (R, Shard(1)), (R, StridedShard(0, 3))),
    ((4, 8, 16), (32, 16), (Shard(0), Shard(1)), (Shard(0), StridedShard(0, 4))),
    # a strided dim through a 1:1 dim and a further merge
    ((24, 3), (24, 3), (R, StridedShard(0, 4)), (R, StridedShard(0, 4))),
    ((24, 3), (72,), (R, StridedShard(0, 4)), (R, StridedShard(0, 4))),
    # the uneven batch split merged with more than the heads: no Shard of the rows
    ((3, 5, 3, 5), (45, 5), (Shard(0), Shard(1)), (R, R)),
    # uneven pieces of a dim that is not its block's last: replicated
    ((4, 6, 3, 5), (4, 90), (Shard(0), Shard(2)), (Shard(0), R)),
])
def test_view_keeps_co_sharded_dims(shape_in, shape_out, placements, want) -> None:  # type: ignore[no-untyped-def]
    ins, outs = _view(shape_in, shape_out, placements)
    assert outs == want
    assert all(i == p or i == R for i, p in zip(ins, placements))
    spec(outs, shape_out)  # a valid layout


def _axis_strategies(op, shapes, placements, out_shapes):  # type: ignore[no-untyped-def]
    return [(s.inputs, s.outputs) for s in get_rule(op)(_call(op, shapes, placements, out_shapes))]  # type: ignore[misc]


def test_bmm_keeps_strided_batches_and_takes_a_replicated_operand_alike() -> None:
    ss = (Shard(0), StridedShard(0, 4))
    got = _axis_strategies(aten.bmm.default, [(24, 3, 5), (24, 5, 2)], [ss, ss], [(24, 3, 2)])
    assert ((ss, ss), (ss,)) in got
    got = _axis_strategies(aten.bmm.default, [(24, 3, 5), (24, 5, 2)], [ss, (R, R)], [(24, 3, 2)])
    assert ((ss, ss), (ss,)) in got


def test_a_contraction_over_a_strided_dim_is_partial() -> None:
    a = (R, StridedShard(1, 4))
    b = (R, StridedShard(0, 4))
    got = _axis_strategies(aten.mm.default, [(3, 24), (24, 2)], [a, b], [(3, 2)])
    assert ((a, b), ((R, Partial()),)) in got


def test_pointwise_keeps_one_block_count_only() -> None:
    ss4, ss3 = (R, StridedShard(0, 4)), (R, StridedShard(0, 3))
    assert ((ss4, ss4), (ss4,)) in _axis_strategies(aten.add.Tensor, [(24, 3), (24, 3)], [ss4, ss4], [(24, 3)])
    got = _axis_strategies(aten.add.Tensor, [(24, 3), (24, 3)], [ss4, ss3], [(24, 3)])
    assert not any(isinstance(p, StridedShard) for ins, outs in got for t in ins + outs for p in t)


def test_ops_without_strided_support_ask_for_plain_layouts() -> None:
    """cumsum along the strided dim: no strategy keeps it (the planner then moves it)."""
    ss = (R, StridedShard(0, 4))
    call = _call(aten.cumsum.default, [(24, 3)], [ss], [(24, 3)], (TensorMeta((24, 3), torch.float32), 0))
    got = get_rule(aten.cumsum.default)(call)  # type: ignore[misc]
    assert got and not any(isinstance(p, StridedShard) for s in got for t in s.inputs + s.outputs for p in t)


def _piece(x: torch.Tensor, s: DistSpec, coord: tuple[int, ...]) -> torch.Tensor:
    for dim in range(x.ndim):
        x = x.index_select(dim, torch.tensor(held_indices(s, coord, dim), dtype=torch.long))
    return x


_GROUPS = [((4, 6, 3), (24, 3)), ((4, 6, 3), (4, 18)), ((4, 6, 3), (72,)), ((3, 4, 2), (12, 2)), ((3, 5, 2), (15, 2)),
           ((2, 3, 4, 5), (6, 20)), ((2, 3, 4, 5), (2, 12, 5)), ((6, 4), (2, 3, 4)), ((12, 5), (3, 4, 5)), ((24,), (4, 6)),
           ((24, 2), (2, 3, 4, 2)), ((6, 1, 4), (24,)), ((2, 6, 2), (4, 6)), ((8, 3), (2, 4, 3))]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_view_pieces_are_the_inputs_pieces(data) -> None:  # type: ignore[no-untyped-def]
    """On a 2 x 3 mesh, whatever layout (plain, strided, uneven) a view is asked with: each rank's
    output piece, by the definitions of the placements, is its input piece reshaped — both ways."""
    shapes = data.draw(st.sampled_from(_GROUPS))
    src_shape, dst_shape = shapes if data.draw(st.booleans()) else shapes[::-1]
    mesh = ap.ProcessMesh([[0, 1, 2], [3, 4, 5]])
    choices = [R, Partial()] + [Shard(d) for d in range(len(src_shape))]
    choices += [StridedShard(d, f) for d in range(len(src_shape)) for f in range(2, src_shape[d]) if src_shape[d] % f == 0]
    placements = tuple(data.draw(st.sampled_from(choices)) for _ in range(2))
    try:
        cur = DistSpec(mesh, placements, src_shape, torch.float32)
    except ValueError:
        return
    ins, outs = _view(src_shape, dst_shape, placements, (2, 3))
    src, dst = cur.with_placements(ins), spec(outs, dst_shape, mesh)
    x = torch.arange(math.prod(src_shape)).reshape(src_shape)
    y = x.reshape(dst_shape)
    for coord in [(i, j) for i in range(2) for j in range(3)]:
        a, b = _piece(x, src, coord), _piece(y, dst, coord)
        assert tuple(b.shape) == dst.local_shape(coord), (src, dst, coord)
        assert a.flatten().tolist() == b.flatten().tolist(), (src, dst, coord)


_LINE = ap.ProcessMesh([0, 1, 2])  # one mesh axis of 3: uneven pieces of most blocks


def _local(x: torch.Tensor, p, rank: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return x if isinstance(p, Replicate) else _piece(x, DistSpec(_LINE, (p,), tuple(x.shape), x.dtype), (rank,))


def _whole(pieces: list[torch.Tensor], p, like: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if isinstance(p, Replicate):
        assert all(torch.equal(q, pieces[0]) for q in pieces)
        return pieces[0]
    if isinstance(p, Partial):
        reduce = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[p.reduce_type]
        return reduce(torch.stack(pieces), 0)
    out = torch.zeros_like(like)
    s = DistSpec(_LINE, (p,), tuple(like.shape), like.dtype)
    for rank, q in enumerate(pieces):
        index = torch.tensor(held_indices(s, (rank,), p.dim), dtype=torch.long)
        out.index_copy_(p.dim, index, q)
    return out


_OPS = [  # (op, input shapes, the strided input dims (None: replicated), extra args)
    (aten.add.Tensor, [(12, 5), (12, 5)], [0, 0], ()),
    (aten.add.Tensor, [(12, 5), (12, 5)], [0, None], ()),
    (aten.mul.Tensor, [(12, 5), (5,)], [0, None], ()),
    (aten.bmm.default, [(12, 3, 5), (12, 5, 2)], [0, 0], ()),
    (aten.bmm.default, [(12, 3, 5), (12, 5, 2)], [0, None], ()),
    (aten.mm.default, [(3, 12), (12, 2)], [1, 0], ()),
    (aten.mm.default, [(12, 4), (4, 2)], [0, None], ()),
    (aten.sum.dim_IntList, [(12, 5)], [0], ([0],)),
    (aten.sum.dim_IntList, [(12, 5)], [0], ([1],)),
    (aten.amax.default, [(12, 5)], [0], ([0],)),
    (aten._softmax.default, [(12, 5)], [0], (1, False)),
    (aten._log_softmax.default, [(12, 5)], [0], (1, False)),
    (aten.transpose.int, [(12, 5)], [0], (0, 1)),
    (aten.unsqueeze.default, [(12, 5)], [0], (0,)),
    (aten.clone.default, [(12, 5)], [0], ()),
]


def _run(op, args, extra, like):  # type: ignore[no-untyped-def]
    if op is aten.amax.default and args[0].shape[extra[0][0]] == 0:  # an empty piece: max's identity
        return torch.full_like(like, -math.inf)
    return op(*args, *extra)


@pytest.mark.parametrize("factor", [2, 3, 4])
@pytest.mark.parametrize("op,shapes,dims,extra", _OPS, ids=[f"{o}-{d}" for o, _, d, _ in _OPS])
def test_kept_strided_strategies_compute_the_op(op, shapes, dims, extra, factor) -> None:  # type: ignore[no-untyped-def]
    """Every strategy a rule offers that keeps a StridedShard, run on 3 simulated ranks' pieces
    (blocks of 12 / factor split 3 ways: uneven for 4 and 6), gives the op's value."""
    gen = torch.Generator().manual_seed(factor)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    current = tuple((R,) if d is None else (StridedShard(d, factor),) for d in dims)
    metas = tuple(TensorMeta(tuple(s), torch.float32) for s in shapes)
    want = op(*xs, *extra)
    wants = want if isinstance(want, tuple) else (want,)
    call = OpCall(op, metas + tuple(extra), {}, metas, tuple(TensorMeta(tuple(w.shape), w.dtype) for w in wants),
                  current, (3,))
    kept = [s for s in get_rule(op)(call) if any(isinstance(p[0], StridedShard) for p in s.inputs + s.outputs)]  # type: ignore[misc]
    assert kept, "the strided input is not kept"
    for s in kept:
        outs = [_run(op, [_local(x, p[0], r) for x, p in zip(xs, s.inputs)], extra, wants[0]) for r in range(3)]
        for k, w in enumerate(wants):
            got = _whole([o[k] if isinstance(o, tuple) else o for o in outs], s.outputs[k][0], w)
            torch.testing.assert_close(got, w, msg=lambda m: f"{op} {s}: {m}")  # noqa: B023
