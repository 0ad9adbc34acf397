"""One side of a cross-mesh reshard: the sender's half and the receiver's half, run apart.

``ap.reshard`` across meshes runs both halves at one program point. A pipeline schedule needs
them at different points (stage ``s`` sends after its forward, stage ``s + 1`` receives before
its own), so this module splits the same :class:`~reshard.crossmesh.CrossMeshPlan`: the sender
reduces Partial axes on its mesh and posts non-blocking sends of exactly the pieces each
receiver lacks; the receiver posts the matching receives (same tag), assembles its shard and
runs the local finishing steps. The stage meshes of a pipeline are disjoint, so no rank is on
both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoparallel import runtime
from autoparallel.engine import layout
from autoparallel.runtime import comm
from autoparallel.spec import Box, DistSpec
from reshard.crossmesh import CrossMeshPlan, plan_cross_mesh


def _region(t: torch.Tensor, held: Box, box: Box) -> torch.Tensor:
    """View of ``t`` (which holds the global region ``held``) covering the global region ``box``."""
    for dim, ((h0, _), (b0, length)) in enumerate(zip(held, box)):
        t = t.narrow(dim, b0 - h0, length)
    return t


@dataclass
class PendingSends:
    """Sends in flight: their works and the tensors they read (kept alive until done)."""

    works: list[object] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    def reap(self) -> None:
        """Forget the sends that completed (their tensors may be freed)."""
        keep = [(w, t) for w, t in zip(self.works, self.tensors) if not w.is_completed()]  # type: ignore[attr-defined]
        self.works, self.tensors = [w for w, _ in keep], [t for _, t in keep]

    def wait(self) -> None:
        for w in self.works:
            w.wait()  # type: ignore[attr-defined]
        self.works.clear()
        self.tensors.clear()


def boundary_plan(src: DistSpec, dst: DistSpec) -> CrossMeshPlan:
    """The cached plan moving a tensor of layout ``src`` to ``dst`` on another mesh."""
    return plan_cross_mesh(src, dst)


def send(local: torch.Tensor, plan: CrossMeshPlan, tag: int, pending: PendingSends) -> None:
    """Sender half: reduce on the source mesh (collective), then post this rank's sends."""
    rank = runtime.get_rank()
    coord = plan.src.mesh.coordinate_of(rank)
    assert coord is not None, f"rank {rank} sends from a mesh it is not in"
    held = layout.run_plan(local, plan.pre)
    box = plan.pre.dst.local_box(coord)
    sends = [(_region(held, box, t.box).contiguous(), t.dst_rank) for t in plan.transfers if t.src_rank == rank]
    pending.reap()
    pending.works.extend(comm.isend(sends, tag, mesh=(plan.src.mesh, plan.dst.mesh)))
    pending.tensors.extend(t for t, _ in sends)


@dataclass
class PendingRecv:
    """Receives posted for one boundary crossing; ``wait`` assembles this rank's shard."""

    plan: CrossMeshPlan
    out: torch.Tensor
    box: Box
    pieces: list[tuple[torch.Tensor, Box]]
    works: list[object]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()  # type: ignore[attr-defined]
        for buf, box in self.pieces:
            _region(self.out, self.box, box).copy_(buf)
        return layout.run_plan(self.out, self.plan.post)


def post_recv(plan: CrossMeshPlan, tag: int, device: torch.device) -> PendingRecv:
    """Receiver half, started: post this rank's receives now, assemble later with ``wait``."""
    rank = runtime.get_rank()
    coord = plan.dst.mesh.coordinate_of(rank)
    assert coord is not None, f"rank {rank} receives on a mesh it is not in"
    full = plan.post.src
    out = torch.empty(full.local_shape(coord), dtype=plan.dst.dtype, device=device)
    box = full.local_box(coord)
    mine = [t for t in plan.transfers if t.dst_rank == rank]
    if len(mine) == 1 and mine[0].box == box:  # one sender holds all of it: receive in place
        works = comm.irecv([(out, mine[0].src_rank)], tag, mesh=(plan.src.mesh, plan.dst.mesh))
        return PendingRecv(plan, out, box, [], works)
    pieces = [(torch.empty([n for _, n in t.box], dtype=plan.dst.dtype, device=device), t) for t in mine]
    works = comm.irecv([(buf, t.src_rank) for buf, t in pieces], tag, mesh=(plan.src.mesh, plan.dst.mesh))
    return PendingRecv(plan, out, box, [(buf, t.box) for buf, t in pieces], works)


def recv(plan: CrossMeshPlan, tag: int, device: torch.device) -> torch.Tensor:
    """Receiver half: this rank's shard of ``plan.dst``, assembled from the sent pieces."""
    return post_recv(plan, tag, device).wait()


__all__ = ["PendingRecv", "PendingSends", "boundary_plan", "post_recv", "recv", "send"]
