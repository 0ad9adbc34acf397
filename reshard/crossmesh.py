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

from autoparallel.spec import Box, DistSpec, intersect_boxes
from reshard.plan import Plan
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
        ranks = set(self.src.mesh.process_ids) | set(self.dst.mesh.process_ids)
        return max(self.bytes_per_rank(r)[1] for r in ranks)

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
    if src.partial_axes() or not plan.collectives() or len(plan.steps) < 2:
        return plan  # a single collective already moves exactly what each rank lacks
    return _plan_best_same_mesh(src, dst)


@lru_cache(maxsize=8192)
def _plan_best_same_mesh(src: DistSpec, dst: DistSpec) -> Plan | CrossMeshPlan:
    """The planner's plan (several collectives, no Partial source) or point-to-point, whichever
    is cheaper."""
    plan = plan_reshard(src, dst)
    p2p = plan_cross_mesh(src, dst)
    return p2p if p2p.max_bytes() < plan.max_bytes() else plan


@lru_cache(maxsize=4096)
def _plan_cross_mesh(src: DistSpec, dst: DistSpec) -> CrossMeshPlan:
    src_full = src.without_partial()
    dst_full = dst.without_partial()
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
