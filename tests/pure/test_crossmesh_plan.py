"""Pure tests of the cross-mesh planner: which rank sends which box to whom, and the bytes.

A brute-force property checks, for random meshes (disjoint or overlapping) and placements,
that every destination rank ends up with exactly its target region: what it already held plus
what it received, with no element twice, and every transfer sent by a rank that holds it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel import DistSpec, Partial, ProcessMesh, Replicate, Shard
from reshard import CrossMeshPlan, ReshardError, Transfer, plan_cross_mesh

R = Replicate()
S0, S1 = Shard(0), Shard(1)
F32 = torch.float32
ROW = 12 * 4  # bytes of one row of an (8, 12) float32 tensor


def spec(mesh: ProcessMesh, placements: list, shape: tuple[int, ...] = (8, 12)) -> DistSpec:
    return DistSpec(mesh, tuple(placements), shape, F32)


def test_disjoint_replicate_to_shard() -> None:
    src = spec(ProcessMesh([0, 1]), [R])
    dst = spec(ProcessMesh([2, 3]), [S0])
    plan = plan_cross_mesh(src, dst)
    assert isinstance(plan, CrossMeshPlan) and plan.src == src and plan.dst == dst
    assert plan.pre.steps == () and plan.post.steps == ()
    # each destination rank gets its half from one source; the replicas share the load
    assert plan.transfers == (
        Transfer(0, 2, ((0, 4), (0, 12))),
        Transfer(1, 3, ((4, 4), (0, 12))),
    )
    half = 4 * ROW
    assert [plan.bytes_per_rank(r) for r in range(5)] == [(half, 0), (half, 0), (0, half), (0, half), (0, 0)]
    assert plan.collectives() == ["send_recv"]


def test_disjoint_1d_to_2d() -> None:
    src = spec(ProcessMesh([0, 1, 2, 3]), [S0])
    dst = spec(ProcessMesh([[4, 5], [6, 7]]), [S0, S1])
    plan = plan_cross_mesh(src, dst)
    # source rank r holds rows 2r, 2r+1; destination (i, j) needs rows 4i..4i+3, cols 6j..6j+5
    expected = []
    for r in range(4):
        i = r // 2
        for j in range(2):
            expected.append(Transfer(r, 4 + 2 * i + j, ((2 * r, 2), (6 * j, 6))))
    assert plan.transfers == tuple(expected)
    block = 2 * 6 * 4
    assert [plan.bytes_per_rank(r) for r in range(8)] == [(2 * block, 0)] * 4 + [(0, 2 * block)] * 4


def test_overlapping_meshes_shard_to_shard() -> None:
    src = spec(ProcessMesh([0, 1, 2, 3]), [S0])
    dst = spec(ProcessMesh([2, 3, 4, 5]), [S0])
    plan = plan_cross_mesh(src, dst)
    # destination rank 2 needs rows 0-1 (held by source rank 0), and so on
    assert plan.transfers == tuple(Transfer(r, r + 2, ((2 * r, 2), (0, 12))) for r in range(4))


def test_ranks_that_already_hold_their_part_receive_nothing() -> None:
    src = spec(ProcessMesh([0, 1, 2, 3]), [S0])
    dst = spec(ProcessMesh([0, 1, 6, 7]), [S0])
    plan = plan_cross_mesh(src, dst)
    assert plan.transfers == (Transfer(2, 6, ((4, 2), (0, 12))), Transfer(3, 7, ((6, 2), (0, 12))))
    assert plan.bytes_per_rank(0) == plan.bytes_per_rank(1) == (0, 0)
    # replicated source: destination ranks 2, 3 slice their rows locally
    plan = plan_cross_mesh(spec(ProcessMesh([0, 1, 2, 3]), [R]), spec(ProcessMesh([2, 3, 4, 5]), [S0]))
    assert {t.dst_rank for t in plan.transfers} == {4, 5}
    assert plan.transfers == (Transfer(2, 4, ((4, 2), (0, 12))), Transfer(3, 5, ((6, 2), (0, 12))))
    assert plan.bytes_per_rank(2) == (2 * ROW, 0) and plan.bytes_per_rank(4) == (0, 2 * ROW)


def test_same_layout_same_mesh_moves_nothing() -> None:
    s = spec(ProcessMesh([[0, 1], [2, 3]]), [S0, S1])
    assert plan_cross_mesh(s, s).transfers == ()


def test_partial_source_is_reduced_first() -> None:
    src = spec(ProcessMesh([0, 1]), [Partial()])
    dst = spec(ProcessMesh([2, 3]), [R])
    plan = plan_cross_mesh(src, dst)
    assert [(s.kind, s.axis) for s in plan.pre.steps] == [("all_reduce", 0)]
    assert plan.pre.dst.placements == (R,)
    assert plan.collectives() == ["all_reduce", "send_recv"]
    assert plan.transfers == (Transfer(0, 2, ((0, 8), (0, 12))), Transfer(1, 3, ((0, 8), (0, 12))))
    full = 8 * ROW
    # ring all-reduce on 2 ranks moves the whole tensor, then each source ships it once
    assert plan.bytes_per_rank(0) == (full + full, full)
    assert plan.bytes_per_rank(2) == (0, full)


def test_partial_destination_is_made_locally() -> None:
    src = spec(ProcessMesh([0, 1]), [S0])
    dst = spec(ProcessMesh([2, 3]), [Partial()])
    plan = plan_cross_mesh(src, dst)
    assert [s.kind for s in plan.post.steps] == ["to_partial"]
    assert plan.post.src.placements == (R,)
    assert plan.collectives() == ["send_recv"]
    assert {t.box for t in plan.transfers if t.dst_rank == 2} == {((0, 4), (0, 12)), ((4, 4), (0, 12))}


def test_cross_mesh_is_cached_and_checks_shape() -> None:
    a, b = spec(ProcessMesh([0, 1]), [S0]), spec(ProcessMesh([2, 3]), [S1])
    assert plan_cross_mesh(a, b) is plan_cross_mesh(a, b)
    with pytest.raises(ReshardError):
        plan_cross_mesh(a, spec(ProcessMesh([2, 3]), [S1], (8, 13)))
    with pytest.raises(ReshardError):
        plan_cross_mesh(a, DistSpec(ProcessMesh([2, 3]), (S1,), (8, 12), torch.float64))


def test_empty_targets_receive_nothing() -> None:
    plan = plan_cross_mesh(spec(ProcessMesh([0, 1]), [R], (2, 3)), spec(ProcessMesh([2, 3, 4, 5]), [S0], (2, 3)))
    assert {t.dst_rank for t in plan.transfers} == {2, 3}


# ---- brute-force property --------------------------------------------------------------------
def _coords(mesh: ProcessMesh) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh.shape)))


def _cells(box: tuple) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in box)))


@st.composite
def meshes(draw: st.DrawFn) -> ProcessMesh:
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3).filter(lambda m: int(np.prod(m)) <= 8))
    ranks = draw(st.permutations(range(10)))[: int(np.prod(shape))]
    return ProcessMesh(np.array(ranks).reshape(shape))


@st.composite
def cross_pairs(draw: st.DrawFn) -> tuple[DistSpec, DistSpec]:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    shards = [Shard(d) for d in range(len(shape))]

    def one(mesh: ProcessMesh, partial: bool) -> DistSpec:
        choice = st.sampled_from([R, *shards] + ([Partial()] if partial else []))
        placements = [draw(choice) for _ in range(mesh.ndim)]
        order = []
        for d in range(len(shape)):
            axes = [a for a, p in enumerate(placements) if p == Shard(d)]
            if len(axes) > 1:
                order.append((d, tuple(draw(st.permutations(axes)))))
        return DistSpec(mesh, tuple(placements), shape, F32, tuple(order))

    return one(draw(meshes()), False), one(draw(meshes()), True)


@settings(max_examples=60, deadline=None)
@given(cross_pairs())
def test_every_target_is_covered_exactly_once(pair: tuple[DistSpec, DistSpec]) -> None:
    src, dst = pair
    plan = plan_cross_mesh(src, dst)
    assert plan.pre.steps == ()  # no Partial in src
    assert all(s.is_local for s in plan.post.steps)
    dst_full = plan.post.src
    assert all(not isinstance(p, Partial) for p in dst_full.placements)

    for t in plan.transfers:
        assert t.src_rank != t.dst_rank
        assert t.src_rank in src.mesh and t.dst_rank in dst.mesh
        have = src.local_box(src.mesh.coordinate_of(t.src_rank))  # type: ignore[arg-type]
        assert _cells(t.box) and _cells(t.box) <= _cells(have), (t, have)

    for r in dst.mesh.process_ids:
        target = _cells(dst_full.local_box(dst.mesh.coordinate_of(r)))  # type: ignore[arg-type]
        held: set[tuple[int, ...]] = set()
        if r in src.mesh:
            held = _cells(src.local_box(src.mesh.coordinate_of(r))) & target  # type: ignore[arg-type]
        got = [_cells(t.box) for t in plan.transfers if t.dst_rank == r]
        union = set(held)
        for cells in got:
            assert cells <= target, (r, cells, target)
            assert not (cells & union), f"rank {r} gets some elements twice"
            union |= cells
        assert union == target, f"rank {r}: missing {sorted(target - union)[:5]}"
        _, recv = plan.bytes_per_rank(r)
        assert recv == 4 * sum(len(c) for c in got)

    # every byte sent is received
    ranks = set(src.mesh.process_ids) | set(dst.mesh.process_ids)
    totals = [plan.bytes_per_rank(r) for r in ranks]
    assert sum(s for s, _ in totals) == sum(r for _, r in totals)
