"""Run a plan on this rank's local shard; every collective goes through ``autoparallel.runtime.comm``."""

from __future__ import annotations

import torch

from autoparallel import runtime
from autoparallel.placement import Partial, Replicate, Shard, chunk_bounds
from autoparallel.runtime import agree, comm
from autoparallel.spec import Box, DistSpec, intersect_boxes
from reshard.crossmesh import CrossMeshPlan, plan_best
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
    fill_value,
)


def empty_local(spec: DistSpec, like: torch.Tensor) -> torch.Tensor:
    """What a rank outside ``spec.mesh`` holds: an empty tensor of the right dtype."""
    return torch.empty((0,), dtype=spec.dtype, device=like.device)


def check_reductions(plan: Plan | CrossMeshPlan) -> None:
    """Raise the ``ValueError`` of the first reduction in ``plan`` that its dtype cannot do
    exactly (``comm.reduction_carry``): from metadata, so on every rank before any collective."""
    for p in (plan.pre, plan.post) if isinstance(plan, CrossMeshPlan) else (plan,):
        for step in p.steps:
            if step.kind in (ALL_REDUCE, REDUCE_SCATTER):
                comm.reduction_carry(step.src.dtype, step.src.placements[step.axis].reduce_type)  # type: ignore[union-attr]


def run_plan(local: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Apply ``plan`` to this rank's shard of ``plan.src``; returns its shard of ``plan.dst``."""
    check_reductions(plan)
    coord = plan.src.mesh.coordinate_of(runtime.get_rank())
    if coord is None:
        return empty_local(plan.dst, local)
    for step in plan.steps:
        local = _run_step(local, step, coord)
    return local


def _sizes_along(spec: DistSpec, coord: tuple[int, ...], axis: int, dim: int) -> list[int]:
    return [
        spec.local_box(coord[:axis] + (i,) + coord[axis + 1:])[dim][1]
        for i in range(spec.mesh.shape[axis])
    ]


def _run_step(local: torch.Tensor, step: Step, coord: tuple[int, ...]) -> torch.Tensor:
    a, mesh = step.axis, step.src.mesh
    src_p, dst_p = step.src.placements[a], step.dst.placements[a]
    kind = step.kind
    if kind == RELABEL:
        return local
    if kind == VIEW:
        return local.reshape(step.dst.local_shape(coord))
    if kind == SLICE:
        assert isinstance(dst_p, Shard)
        size = local.shape[dst_p.dim]
        n = mesh.shape[a]
        step_len = -(-size // n) if size else 0
        start = min(coord[a] * step_len, size)
        return local.narrow(dst_p.dim, start, max(0, min(size, start + step_len) - start))
    if kind == TO_PARTIAL:
        assert isinstance(dst_p, Partial)
        if dst_p.reduce_type == "sum" and coord[a] != 0:
            return torch.zeros_like(local)
        return local
    if kind == FILL:
        assert isinstance(src_p, Shard) and isinstance(dst_p, Partial)
        return _fill(local, step, coord)
    agree.check_collective(mesh, a, lambda: _describe(step))
    if kind == ALL_GATHER:
        assert isinstance(src_p, Shard)
        return comm.all_gather(local, mesh, a, src_p.dim, _sizes_along(step.src, coord, a, src_p.dim))
    if kind == ALL_REDUCE:
        assert isinstance(src_p, Partial)
        return comm.all_reduce(local, mesh, a, src_p.reduce_type)
    if kind == REDUCE_SCATTER:
        assert isinstance(src_p, Partial) and isinstance(dst_p, Shard)
        return comm.reduce_scatter(local, mesh, a, dst_p.dim, src_p.reduce_type)
    if kind == ALL_TO_ALL:
        assert isinstance(src_p, Shard) and isinstance(dst_p, Shard)
        sizes = _sizes_along(step.src, coord, a, src_p.dim)
        return comm.all_to_all(local, mesh, a, src_p.dim, dst_p.dim, sizes)
    raise AssertionError(f"unknown step kind {kind}")


def _describe(step: Step) -> str:
    """What every member of the step's axis line must plan alike (``AUTOPARALLEL_CHECK=1``)."""
    src, a = step.src, step.axis
    return (f"{step.kind} on axis {a} of a {list(src.shape)} {src.dtype} tensor: "
            f"{list(src.placements)} -> {list(step.dst.placements)}")


def _fill(local: torch.Tensor, step: Step, coord: tuple[int, ...]) -> torch.Tensor:
    """S(d) -> P on one axis, no communication: this member's piece in place in its axis block,
    the reduction's identity elsewhere (``avg``: n x the piece; the planner allows it only where
    that is exact, see ``reshard.plan.fill_exact``)."""
    a, dtype = step.axis, step.src.dtype
    d = step.src.placements[a].dim  # type: ignore[union-attr]  # a Shard, checked by the caller
    reduce_type = step.dst.placements[a].reduce_type  # type: ignore[union-attr]  # a Partial
    shape = step.dst.local_shape(coord)  # the whole axis block: [..., block along d, ...]
    out = torch.full(shape, fill_value(dtype, reduce_type), dtype=dtype, device=local.device)  # type: ignore[arg-type]
    offset, length = chunk_bounds(shape[d], step.src.mesh.shape[a], coord[a])
    out.narrow(d, offset, length).copy_(local * step.src.mesh.shape[a] if reduce_type == "avg" else local)
    return out


def run_cross_mesh(local: torch.Tensor, plan: CrossMeshPlan) -> torch.Tensor:
    """Apply a cross-mesh plan: reduce on the source mesh, point-to-point, finish on the target."""
    check_reductions(plan)
    rank = runtime.get_rank()
    src_coord = plan.src.mesh.coordinate_of(rank)
    dst_coord = plan.dst.mesh.coordinate_of(rank)
    held = run_plan(local, plan.pre) if src_coord is not None else None
    src_full = plan.pre.dst
    dst_full = plan.post.src
    out: torch.Tensor | None = None
    if dst_coord is not None:
        like = held if held is not None else local
        out = torch.empty(dst_full.local_shape(dst_coord), dtype=plan.dst.dtype, device=like.device)
        out_box = dst_full.local_box(dst_coord)
        if held is not None:
            _copy_overlap(held, src_full.local_box(src_coord), out, out_box)  # type: ignore[arg-type]
    sends, recvs, places = [], [], []
    for t in plan.transfers:
        if t.src_rank == rank:
            assert held is not None and src_coord is not None
            sends.append((_view(held, src_full.local_box(src_coord), t.box), t.dst_rank))
        if t.dst_rank == rank:
            buf = torch.empty([length for _, length in t.box], dtype=plan.dst.dtype, device=local.device)
            recvs.append((buf, t.src_rank))
            places.append((buf, t.box))
    comm.send_recv(sends, recvs, mesh=(plan.src.mesh, plan.dst.mesh))
    if out is None:
        return empty_local(plan.dst, local)
    for buf, box in places:
        _view(out, out_box, box).copy_(buf)
    return run_plan(out, plan.post)


def _view(t: torch.Tensor, held_box, box) -> torch.Tensor:
    """View of ``t`` (holding global region ``held_box``) covering global region ``box``."""
    for dim, ((ho, _), (o, length)) in enumerate(zip(held_box, box)):
        t = t.narrow(dim, o - ho, length)
    return t


def _copy_overlap(src: torch.Tensor, src_box: Box, dst: torch.Tensor, dst_box: Box) -> None:
    inter = intersect_boxes(src_box, dst_box)
    if inter is not None:
        _view(dst, dst_box, inter).copy_(_view(src, src_box, inter))


def run_any(local: torch.Tensor, plan: Plan | CrossMeshPlan) -> torch.Tensor:
    """Run a same-mesh ``Plan`` or a point-to-point ``CrossMeshPlan``."""
    return run_cross_mesh(local, plan) if isinstance(plan, CrossMeshPlan) else run_plan(local, plan)


def reshard_local(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    """This rank's shard of ``dst``, given its shard of ``src`` (same or different mesh)."""
    if src == dst:
        return local
    if _slices_only(src, dst):
        return piece_of_whole(local, dst)
    with comm.profiled("autoparallel::reshard"):
        return run_any(local, plan_best(src, dst))


def _slices_only(src: DistSpec, dst: DistSpec) -> bool:
    """Whether ``src`` is replicated and ``dst`` the same tensor on the same mesh, sharded or
    replicated on every axis: each rank's piece is a view of what it holds, by its box (what
    ``shard_tensor`` of every batch asks: no plan, so nothing kept per shape)."""
    return (src.shape == dst.shape and src.dtype == dst.dtype and not dst.has_partial
            and (src.mesh is dst.mesh or src.mesh == dst.mesh)
            and all(type(p) is Replicate for p in src.placements))


def piece_of_whole(full: torch.Tensor, dst: DistSpec) -> torch.Tensor:
    """This rank's piece of ``dst`` (no Partial axis) from the whole tensor, as every rank holds
    it: a view by its box; empty outside the mesh."""
    coord = dst.mesh.coordinate_of(runtime.get_rank())
    if coord is None:
        return empty_local(dst, full)
    if dst.has_strided:  # a box of the expanded tensor, flattened back
        wide = dst.expanded()
        piece = _view(full.reshape(wide.shape), tuple((0, n) for n in wide.shape), wide.local_box(coord))
        return piece.reshape(dst.local_shape(coord))
    return _view(full, tuple((0, n) for n in full.shape), dst.local_box(coord))
