"""Pure cross-mesh planner: move a tensor between two meshes with point-to-point transfers.

Pipeline stages live on disjoint meshes; other moves go between overlapping meshes or meshes
of different shapes. The plan is three parts:

1. ``pre``: on the source mesh, reduce every Partial axis (``P -> R``) — summands cannot be
   shipped piecemeal and summed later without sending every one of them.
2. ``transfers``: each destination rank receives exactly the parts of its target region that
   it does not already hold, each from one holder of that part (a holder on the destination
   rank itself is used first; otherwise holders take turns so replicas share the load).
3. ``post``: on the destination mesh, the local steps that turn the received Replicate-for-
   Partial layout into the requested one (``R -> P``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autoparallel.compat import size_dtype, whole
from autoparallel.placement import Shard
from autoparallel.spec import Box, DistSpec, intersect_boxes
from reshard.plan import Plan, Step
from reshard.planner import ReshardError, plan_reshard


@dataclass(frozen=True, slots=True)
class Transfer:
    """``box`` of the global tensor goes from ``src_rank`` to ``dst_rank``."""

    src_rank: int
    dst_rank: int
    box: Box

    def nbytes(self, itemsize: int) -> int:
        n = itemsize
        for _, length in self.box:
            n *= length
        return n


@dataclass(frozen=True, slots=True)
class CrossMeshPlan:
    src: DistSpec
    dst: DistSpec
    pre: Plan
    transfers: tuple[Transfer, ...]
    post: Plan

    def bytes_per_rank(self, rank: int) -> tuple[int, int]:
        """(sent, received) bytes of ``rank`` over the whole plan."""
        sent, recv = self.pre.bytes_per_rank(rank) if rank in self.src.mesh else (0, 0)
        item = self.src.itemsize
        for t in self.transfers:
            if t.src_rank == rank:
                sent += t.nbytes(item)
            if t.dst_rank == rank:
                recv += t.nbytes(item)
        return sent, recv

    def max_bytes(self) -> int:
        """The largest number of bytes any rank receives."""
        received = dict.fromkeys(set(self.src.mesh.process_ids) | set(self.dst.mesh.process_ids), 0)
        if self.pre.steps:
            for r in self.src.mesh.process_ids:
                received[r] += self.pre.bytes_per_rank(r)[1]
        item = self.src.itemsize
        for t in self.transfers:  # one pass over the transfers, not one per rank
            received[t.dst_rank] += t.nbytes(item)
        return max(received.values())

    def collectives(self) -> list[str]:
        return self.pre.collectives() + (["send_recv"] if self.transfers else []) + self.post.collectives()

    def __str__(self) -> str:
        moves = ", ".join(f"{t.src_rank}->{t.dst_rank}" for t in self.transfers) or "none"
        return f"CrossMeshPlan({self.src} on {self.src.mesh} -> {self.dst} on {self.dst.mesh}: pre {self.pre}; p2p {moves}; post {self.post})"


def plan_cross_mesh(src: DistSpec, dst: DistSpec) -> CrossMeshPlan:
    """Plan the move of a tensor from ``src`` (on one mesh) to ``dst`` (on another); cached."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ReshardError(
            f"cannot reshard a {tuple(src.shape)} {src.dtype} tensor into {tuple(dst.shape)} {dst.dtype}"
        )
    return _plan_cross_mesh(src, dst)


def plan_best(src: DistSpec, dst: DistSpec) -> Plan | CrossMeshPlan:
    """What the executor runs: collectives on the mesh, or point-to-point when that is cheaper.

    Between meshes it is always point-to-point. On one mesh, a plan of several collectives can
    move more than each rank lacks (a layout swap like [S(0), S(1)] -> [S(1), S(0)] gathers
    whole blocks to re-split them); shipping exactly the missing pieces point-to-point then
    moves less, so when the source has no Partial we take whichever the busiest rank receives
    less from (ties go to the collectives).
    """
    if src.mesh != dst.mesh:
        return plan_cross_mesh(src, dst)
    plan = plan_reshard(src, dst)  # one step: built from placements (``one_move``), not cached
    if src.partial_axes() or not plan.collectives() or len(plan.steps) < 2 or src.has_strided or dst.has_strided:
        return plan  # a single collective already moves exactly what each rank lacks
    return _plan_best_same_mesh(src, dst)


@lru_cache(maxsize=8192)
def best_price(src: DistSpec, dst: DistSpec) -> tuple[int, tuple[Step, ...], bool]:
    """What ``plan_best(src, dst)`` costs, without building a point-to-point plan on one mesh:
    (bytes the busiest rank receives, its steps, whether it communicates). The steps are the
    planner's, or for point-to-point the local steps around the transfers."""
    if src.mesh != dst.mesh:
        cm = plan_cross_mesh(src, dst)
        return cm.max_bytes(), cm.pre.steps + cm.post.steps, bool(cm.collectives())
    plan = plan_reshard(src, dst)
    if src.partial_axes() or not plan.collectives() or len(plan.steps) < 2 or src.has_strided or dst.has_strided:
        return plan.max_bytes(), plan.steps, bool(plan.collectives())
    mine, p2p = plan.max_bytes(), _p2p_max_received(src, dst)
    if p2p >= mine:
        return mine, plan.steps, True
    return p2p, plan_reshard(dst.without_partial(), dst).steps, p2p > 0


@lru_cache(maxsize=8192)
def _plan_best_same_mesh(src: DistSpec, dst: DistSpec) -> Plan | CrossMeshPlan:
    """The planner's plan (several collectives, no Partial source) or point-to-point, whichever
    is cheaper."""
    plan = plan_reshard(src, dst)
    if _p2p_max_received(src, dst) >= plan.max_bytes():
        return plan  # the point-to-point plan would not move less: no need to build it
    p2p = plan_cross_mesh(src, dst)
    return p2p if p2p.max_bytes() < plan.max_bytes() else plan


def _p2p_max_received(src: DistSpec, dst: DistSpec) -> int:
    """What the busiest rank receives under the point-to-point plan between two layouts of one
    mesh, the source without Partial: the distinct source pieces partition the tensor, so each
    rank receives exactly the part of its destination piece it does not hold. Only the mesh axes
    that shard either layout tell ranks' pieces apart: their coordinates are visited at once as
    arrays (a 256 x 2 mesh is 512 rows of arithmetic, not 512 boxes built one by one)."""
    dst_full = dst.without_partial()
    shape = src.mesh.shape
    axes = [a for a in range(len(shape))
            if isinstance(src.placements[a], Shard) or isinstance(dst_full.placements[a], Shard)]
    grid = np.indices([shape[a] for a in axes]).reshape(len(axes), -1)
    coords = np.zeros((len(shape), grid.shape[1]), dtype=np.int64)
    coords[axes] = grid
    need_off, need_len = _boxes(dst_full, coords)
    have_off, have_len = _boxes(src, coords)
    lo = np.maximum(need_off, have_off)
    hi = np.minimum(need_off + need_len, have_off + have_len)
    missing = need_len.prod(axis=0) - np.clip(hi - lo, 0, None).prod(axis=0)
    return whole(missing.max(initial=0)) * src.itemsize  # type: ignore[no-any-return]


def _boxes(spec: DistSpec, coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths (tensor dim x coordinate) of the pieces ``spec`` gives the mesh
    coordinates ``coords`` (mesh axis x coordinate): ``DistSpec.local_box`` over many at once."""
    explicit = dict(spec.shard_order)
    dtype = size_dtype(spec.shape)
    offs = np.zeros((len(spec.shape), coords.shape[1]), dtype=dtype)
    lens = np.empty_like(offs)
    for dim, size in enumerate(spec.shape):
        axes = explicit.get(dim) or tuple(
            a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == dim)
        length = np.full(coords.shape[1], size, dtype=dtype)
        for a in axes:  # torch.chunk's split of the piece so far, as ``placement.chunk_bounds``
            step = -(-length // spec.mesh.shape[a])
            start = np.minimum(coords[a] * step, length)
            offs[dim] += start
            length = np.maximum(0, np.minimum(length, start + step) - start)
        lens[dim] = length
    return offs, lens


def _volume(box: Box) -> int:
    n = 1
    for _, length in box:
        n *= length
    return n


@lru_cache(maxsize=4096)
def _plan_cross_mesh(src: DistSpec, dst: DistSpec) -> CrossMeshPlan:
    src_full = src.without_partial().unstrided()  # (a strided piece is no box: gathered first)
    dst_full = dst.without_partial().unstrided()
    pre = plan_reshard(src, src_full)
    post = plan_reshard(dst_full, dst)
    # Distinct source pieces and who holds each (mesh order).
    holders: dict[Box, list[int]] = {}
    for r in src.mesh.process_ids:
        holders.setdefault(src_full.local_box(src.mesh.coordinate_of(r)), []).append(r)  # type: ignore[arg-type]
    transfers: list[Transfer] = []
    for k, r in enumerate(dst.mesh.process_ids):
        need = dst_full.local_box(dst.mesh.coordinate_of(r))  # type: ignore[arg-type]
        if any(length == 0 for _, length in need):
            continue
        for box, ranks in holders.items():
            piece = intersect_boxes(need, box)
            if piece is None or r in ranks:
                continue
            transfers.append(Transfer(ranks[k % len(ranks)], r, piece))
    transfers.sort(key=lambda t: (t.src_rank, t.dst_rank, t.box))
    return CrossMeshPlan(src, dst, pre, tuple(transfers), post)
