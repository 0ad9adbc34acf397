"""Property test: random meshes, shapes and layouts, reshard src -> dst on an 8-rank gloo world.

Against a brute-force reference: ``full_tensor()`` after the reshard equals the tensor we started
from, and the bytes ``CommDebugMode`` saw on every rank equal the plan's bytes for that rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard, partials_compatible
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
