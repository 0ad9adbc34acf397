"""Property test: random meshes, shapes and layouts, reshard src -> dst on an 8-rank gloo world.

Against a brute-force reference: ``full_tensor()`` after the reshard equals the tensor we started
from, and the bytes ``CommDebugMode`` saw on every rank equal the plan's bytes for that rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard, StridedShard, partials_compatible
from reshard import plan_best
from tests.layouts import make_dist, reference

WORLD = 8
RANK_ORDERS = [list(range(WORLD)), list(reversed(range(WORLD))), [3, 0, 6, 1, 7, 2, 5, 4]]


def _check(rank: int, src_mesh, src_pl, dst_mesh, dst_pl, shape, seed):  # type: ignore[no-untyped-def]
    full = reference(shape, seed)
    m_src = ap.ProcessMesh(src_mesh)
    m_dst = ap.ProcessMesh(dst_mesh)
    x = make_dist(full, m_src, src_pl)
    with ap.CommDebugMode() as comm:
        y = ap.reshard(x, m_dst, list(dst_pl))
    expected = plan_best(x.dist_spec, y.dist_spec).bytes_per_rank(rank)  # what the executor runs
    got_bytes = (comm.bytes_sent, comm.bytes_received)
    value = y.full_tensor()
    assert tuple(y.shape) == tuple(shape)
    assert list(y.placements) == [p if not isinstance(p, Shard) else Shard(p.dim % len(shape)) for p in dst_pl]
    if rank in m_dst:
        assert torch.allclose(value, full, rtol=1e-5, atol=1e-5), f"rank {rank}: wrong value"
    else:
        assert value.numel() == 0 and y.to_local().numel() == 0
    assert got_bytes == expected, f"rank {rank}: CommDebugMode saw {got_bytes}, plan says {expected}"
    return True


@st.composite
def mesh_st(draw):  # type: ignore[no-untyped-def]
    ndim = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(ndim)]
    while math.prod(sizes) > WORLD:
        sizes[sizes.index(max(sizes))] -= 1
    n = math.prod(sizes)
    order = draw(st.sampled_from(RANK_ORDERS))
    start = draw(st.integers(0, WORLD - n))
    ids = order[start:start + n]
    return torch.tensor(ids).reshape(sizes).tolist()


def placements_st(ndim_mesh: int, ndim_tensor: int, allow_partial: bool):  # type: ignore[no-untyped-def]
    choices = [Replicate()] + [Shard(d) for d in range(ndim_tensor)]
    if allow_partial:
        choices += [Partial("sum"), Partial("avg"), Partial("max")]
    return st.lists(st.sampled_from(choices), min_size=ndim_mesh, max_size=ndim_mesh).filter(
        lambda pl: partials_compatible(tuple(pl))
    )


@st.composite
def case_st(draw, cross: bool):  # type: ignore[no-untyped-def]
    src_mesh = draw(mesh_st())
    dst_mesh = draw(mesh_st()) if cross else src_mesh
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    src_nd = len(torch.tensor(src_mesh).shape)
    dst_nd = len(torch.tensor(dst_mesh).shape)
    src = draw(placements_st(src_nd, len(shape), True))
    dst = draw(placements_st(dst_nd, len(shape), not cross))
    return src_mesh, tuple(src), dst_mesh, tuple(dst), shape, draw(st.integers(0, 1000))


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(case=case_st(cross=False))
def test_same_mesh_reshard_matches_reference(world8, case):  # type: ignore[no-untyped-def]
    assert all(world8.run(_check, *case))


@SETTINGS
@given(case=case_st(cross=True))
def test_cross_mesh_reshard_matches_reference(world8, case):  # type: ignore[no-untyped-def]
    assert all(world8.run(_check, *case))


@pytest.mark.parametrize(
    "src,dst",
    [
        ((Shard(0), Shard(0)), (Replicate(), Shard(0))),
        ((Shard(0), Shard(1)), (Shard(1), Shard(0))),
        ((Partial(), Partial("avg")), (Shard(1), Replicate())),
        ((Partial("max"), Shard(1)), (Replicate(), Replicate())),
    ],
)
def test_two_axis_cases_uneven(world8, src, dst):  # type: ignore[no-untyped-def]
    assert all(world8.run(_check, [[0, 1, 2, 3], [4, 5, 6, 7]], src, [[0, 1, 2, 3], [4, 5, 6, 7]], dst, (7, 5), 3))


def test_explicit_shard_order_roundtrip(world8):  # type: ignore[no-untyped-def]
    assert all(world8.run(_order_case))


def _order_case(rank: int) -> bool:
    mesh = ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]])
    full = reference((9, 4), 1)
    x = make_dist(full, mesh, (Shard(0), Shard(0)), shard_order={0: (1, 0)})
    assert x.dist_spec.axes_of_dim(0) == (1, 0)
    y = ap.reshard(x, mesh, [Shard(0), Shard(0)])  # default order: axis 0 outermost
    assert y.dist_spec.axes_of_dim(0) == (0, 1)
    assert torch.equal(y.full_tensor(), full)
    return True


def _valid(mesh: list, placements: tuple, shape: tuple) -> bool:  # type: ignore[type-arg]
    try:
        ap.DistSpec(ap.ProcessMesh(mesh), placements, shape, torch.float32)
    except ValueError:
        return False
    return True


@st.composite
def strided_case_st(draw, cross: bool):  # type: ignore[no-untyped-def]
    """A dim cut into 2-4 blocks; src and dst mix StridedShard of it with the other placements."""
    src_mesh = draw(mesh_st())
    dst_mesh = draw(mesh_st()) if cross else src_mesh
    shape = [draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 3)))]
    d, f = draw(st.integers(0, len(shape) - 1)), draw(st.integers(2, 4))
    shape[d] *= f
    other_f = draw(st.sampled_from([f, shape[d] // f if shape[d] // f > 1 else f]))
    e = draw(st.integers(0, len(shape) - 1))  # another dim, strided in both layouts if it can be
    second = [StridedShard(e, shape[e])] if e != d and shape[e] > 1 else []

    def layout(mesh, partial, factor):  # type: ignore[no-untyped-def]
        choices = [Replicate(), StridedShard(d, factor), StridedShard(d, factor), *second] + [Shard(i) for i in range(len(shape))]
        choices += [Partial("sum"), Partial("max")] if partial else []
        return tuple(draw(st.lists(st.sampled_from(choices), min_size=len(torch.tensor(mesh).shape),
                                   max_size=len(torch.tensor(mesh).shape))))

    src = layout(src_mesh, True, f)
    dst = layout(dst_mesh, not cross, other_f)
    assume(any(isinstance(p, StridedShard) for p in src + dst))
    assume(partials_compatible(src) and partials_compatible(dst))
    assume(_valid(src_mesh, src, tuple(shape)) and _valid(dst_mesh, dst, tuple(shape)))
    return src_mesh, src, dst_mesh, dst, tuple(shape), draw(st.integers(0, 1000))


STRIDED_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@STRIDED_SETTINGS
@given(case=strided_case_st(cross=False))
def test_strided_reshard_matches_reference(world8, case):  # type: ignore[no-untyped-def]
    """To, from and between StridedShard layouts (the same or another block count) on one mesh."""
    assert all(world8.run(_check, *case))


@STRIDED_SETTINGS
@given(case=strided_case_st(cross=True))
def test_strided_cross_mesh_reshard_matches_reference(world8, case):  # type: ignore[no-untyped-def]
    assert all(world8.run(_check, *case))


def test_strided_to_shard_gathers_only_the_strided_axis(world8):  # type: ignore[no-untyped-def]
    assert all(world8.run(_strided_moves))


def _strided_moves(rank: int) -> bool:
    """[S(0), S(0/4)] (the flattened [4, 6] of a batch on axis 0 and heads on axis 1) reshards to
    [S(0), R] by one all-gather of axis 1, and back by a local slice."""
    mesh = ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]])
    full = reference((24, 3), 2)
    x = make_dist(full, mesh, (Shard(0), StridedShard(0, 4)))
    with ap.CommDebugMode() as comm:
        y = ap.reshard(x, mesh, [Shard(0), Replicate()])
    assert comm.get_comm_counts() == {"all_gather": 1}, comm.get_comm_counts()
    assert torch.equal(y.to_local(), full.narrow(0, 12 * (rank // 4), 12))
    with ap.CommDebugMode() as comm:
        z = ap.reshard(y, mesh, [Shard(0), StridedShard(0, 4)])
    assert comm.get_comm_counts() == {} and torch.equal(z.to_local(), x.to_local())
    assert torch.equal(z.full_tensor(), full)
    return True
