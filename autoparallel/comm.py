"""The only module that calls ``torch.distributed`` collectives.

Every function works on this rank's local tensor and one mesh axis (or a list of
point-to-point transfers), handles uneven ``torch.chunk`` pieces, and records what it moved in
``CommDebugMode`` using the formulas in ``autoparallel.cost``.

Process groups: each mesh axis line (the ranks that differ only in that axis) gets one group,
created for every line by every rank in a fixed order when the mesh is bound, and cached by its
rank tuple for the life of the world.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from autoparallel import cost, runtime
from autoparallel.debug import record
from autoparallel.placement import chunk_bounds

if TYPE_CHECKING:
    from autoparallel.mesh import ProcessMesh

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
# torch >= 2.13 names the tensor-in/tensor-out collectives *_single; older releases *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_groups: dict[tuple[int, ...], object] = {}
_world_token: list[object] = [None]
# (mesh, axis, rank) -> what ``_group`` returns, for the current world (cleared with ``_groups``)
_resolved: dict[tuple[object, int, int], tuple[object, tuple[int, ...], tuple[int, ...]]] = {}


def _group_cache() -> dict[tuple[int, ...], object]:
    world = dist.group.WORLD if dist.is_initialized() else None
    if _world_token[0] is not world:
        _groups.clear()
        _resolved.clear()
        _world_token[0] = world
    return _groups


def create_mesh_groups(mesh: "ProcessMesh") -> None:
    """Create the process group of every axis line of ``mesh`` (all ranks, same order)."""
    if not dist.is_initialized():
        return
    cache = _group_cache()
    world = dist.get_world_size()
    for axis in range(mesh.ndim):
        for line in mesh.axis_groups(axis):
            key = tuple(sorted(line))
            if len(key) < 2 or key in cache:
                continue
            cache[key] = dist.group.WORLD if key == tuple(range(world)) else dist.new_group(list(key))


def _group(mesh: "ProcessMesh", axis: int) -> tuple[object, tuple[int, ...], tuple[int, ...]]:
    """(process group, axis line in coordinate order, group rank of each coordinate)."""
    rank = runtime.get_rank()
    cache = _group_cache()
    found = _resolved.get((mesh, axis, rank))
    if found is not None:
        return found
    line = mesh.axis_group_of(axis, rank)
    assert line is not None, f"rank {rank} called a collective on a mesh it is not in"
    key = tuple(sorted(line))
    if key not in cache:
        mesh.bind()
    found = _resolved[mesh, axis, rank] = (cache[key], line, tuple(key.index(r) for r in line))
    return found


def _reduce_op(reduce_type: str) -> dist.ReduceOp:
    return getattr(dist.ReduceOp, _REDUCE_OPS[reduce_type])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def all_reduce(local: torch.Tensor, mesh: "ProcessMesh", axis: int, reduce_type: str, in_place: bool = False) -> torch.Tensor:
    """Reduce ``local`` over the axis; every member gets the result (a new tensor, or with
    ``in_place`` a contiguous ``local`` itself: a buffer the caller owns)."""
    out, work = all_reduce_start(local, mesh, axis, reduce_type, in_place)
    work.wait()  # type: ignore[attr-defined]
    if reduce_type == "avg":
        n = mesh.shape[axis]
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    return out


def all_reduce_start(
    local: torch.Tensor, mesh: "ProcessMesh", axis: int, reduce_type: str = "sum", in_place: bool = False
) -> tuple[torch.Tensor, object]:
    """Start reducing ``local`` over the axis without waiting: (result buffer, work to wait on).

    The buffer holds the result once ``work.wait()`` returns (for ``avg``: the sum; dividing
    is ``all_reduce``'s). Every member must start the same collectives in the same order.
    """
    group, line, _ = _group(mesh, axis)
    out = local if in_place and local.is_contiguous() else local.contiguous().clone()
    work = dist.all_reduce(out, op=_reduce_op(reduce_type), group=group, async_op=True)  # type: ignore[arg-type]
    record("all_reduce", mesh, axis, line, *cost.all_reduce_bytes(_nbytes(out), len(line)))
    return out, work


def all_gather(local: torch.Tensor, mesh: "ProcessMesh", axis: int, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate the members' pieces along tensor ``dim``; ``sizes`` are their lengths there."""
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    x = local.movedim(dim, 0).contiguous()  # [len, ...rest]
    rest = x.shape[1:]
    row = _numel(rest)
    item = local.element_size()
    if sum(sizes) * row == 0:  # nothing to move: every member knows it from metadata
        record("all_gather", mesh, axis, line, 0, 0)
        return x.new_empty((sum(sizes),) + tuple(rest)).movedim(0, dim)
    if len(set(sizes)) == 1:
        out = x.new_empty((n * sizes[0],) + tuple(rest))
        _all_gather_flat(out, x, group=group)  # type: ignore[arg-type]
        pieces = list(out.split(sizes[0]))
        pieces = [pieces[g] for g in grank]  # group-rank order -> coordinate order
    else:
        # Uneven pieces: an all-to-all where each member sends its piece to everyone.
        send = x.reshape(-1).repeat(n)
        in_splits = [x.numel()] * n
        out_splits_coord = [s * row for s in sizes]
        out_splits = [0] * n
        for c, g in enumerate(grank):
            out_splits[g] = out_splits_coord[c]
        recv = x.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)  # type: ignore[arg-type]
        flat = list(recv.split(out_splits))
        pieces = [flat[g].reshape((sizes[c],) + tuple(rest)) for c, g in enumerate(grank)]
    record("all_gather", mesh, axis, line, *cost.all_gather_bytes([s * row * item for s in sizes], me))
    return torch.cat(pieces, dim=0).movedim(0, dim).contiguous()


def reduce_scatter(
    local: torch.Tensor, mesh: "ProcessMesh", axis: int, dim: int, reduce_type: str
) -> torch.Tensor:
    """Reduce over the axis and keep this member's ``torch.chunk`` piece along ``dim``."""
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    size = local.shape[dim]
    step = -(-size // n) if size else 0
    x = _pad_dim(local.movedim(dim, 0), 0, step * n).contiguous()
    chunks = list(x.split(step)) if step else [x] * n
    by_group: list[torch.Tensor] = [x] * n
    for c, g in enumerate(grank):
        by_group[g] = chunks[c]
    inp = torch.cat(by_group, dim=0) if step else x
    out = x.new_empty((step,) + tuple(x.shape[1:]))
    if step:
        _reduce_scatter_flat(out, inp, op=_reduce_op(reduce_type), group=group)  # type: ignore[arg-type]
    if reduce_type == "avg":
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    _, length = chunk_bounds(size, n, me)
    record("reduce_scatter", mesh, axis, line, *cost.reduce_scatter_bytes(out.numel() * out.element_size(), n))
    return out[:length].movedim(0, dim).contiguous()


def all_to_all(
    local: torch.Tensor,
    mesh: "ProcessMesh",
    axis: int,
    gather_dim: int,
    scatter_dim: int,
    gather_sizes: Sequence[int],
) -> torch.Tensor:
    """Shard(gather_dim) -> Shard(scatter_dim) on one axis.

    ``local`` is this member's piece along ``gather_dim`` (lengths ``gather_sizes`` per member)
    and the whole axis block along ``scatter_dim``, which is split ``torch.chunk``-style.
    """
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    size = local.shape[scatter_dim]
    pieces = [local.narrow(scatter_dim, *chunk_bounds(size, n, j)).contiguous() for j in range(n)]
    my_len = chunk_bounds(size, n, me)[1]
    shapes = []
    for c in range(n):
        shp = list(local.shape)
        shp[gather_dim] = gather_sizes[c]
        shp[scatter_dim] = my_len
        shapes.append(shp)
    send_sizes_c = [p.numel() for p in pieces]
    recv_sizes_c = [_numel(s) for s in shapes]
    in_splits, out_splits = [0] * n, [0] * n
    send_by_group: list[torch.Tensor] = [local.new_empty(0)] * n
    for c, g in enumerate(grank):
        in_splits[g], out_splits[g] = send_sizes_c[c], recv_sizes_c[c]
        send_by_group[g] = pieces[c].reshape(-1)
    recv = local.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, torch.cat(send_by_group), out_splits, in_splits, group=group)  # type: ignore[arg-type]
    flat = list(recv.split(out_splits))
    parts = [flat[g].reshape(shapes[c]) for c, g in enumerate(grank)]
    item = local.element_size()
    record(
        "all_to_all", mesh, axis, line,
        *cost.all_to_all_bytes([s * item for s in send_sizes_c], [s * item for s in recv_sizes_c], me),
    )
    return torch.cat(parts, dim=gather_dim)


def send_recv(
    sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], mesh: object = None
) -> None:
    """Point-to-point: send each ``(tensor, dst_rank)``, fill each ``(buffer, src_rank)``.

    Every rank must list its transfers in the same global order so pairs match up.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, b, peer) for b, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    sent = sum(_nbytes(t) for t, _ in sends)
    recv = sum(_nbytes(b) for b, _ in recvs)
    peers = tuple(sorted({p for _, p in sends} | {p for _, p in recvs}))
    if ops:
        record("send_recv", mesh, None, peers, sent, recv)


def isend(sends: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> list[object]:
    """Start sending each ``(tensor, dst_rank)`` with ``tag``; returns the works to wait on.

    Does not block: pipeline stages post a send and go on computing (keep the tensors alive
    until the works complete). The receiver matches by ``(source rank, tag)``.
    """
    works: list[object] = [dist.isend(t.contiguous(), peer, tag=tag) for t, peer in sends]
    if sends:
        record("send_recv", mesh, None, tuple(sorted({p for _, p in sends})), sum(_nbytes(t) for t, _ in sends), 0)
    return works


def irecv(recvs: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> list[object]:
    """Post receives into each ``(buffer, src_rank)`` with ``tag``; wait on the returned works."""
    works: list[object] = [dist.irecv(b, peer, tag=tag) for b, peer in recvs]
    if recvs:
        record("send_recv", mesh, None, tuple(sorted({p for _, p in recvs})), 0, sum(_nbytes(b) for b, _ in recvs))
    return works


def recv(recvs: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> None:
    """Fill each ``(buffer, src_rank)`` from the message with ``tag``; blocks until all arrived."""
    for w in irecv(recvs, tag, mesh):
        w.wait()  # type: ignore[attr-defined]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable ``obj`` in rank order, over the whole world (control messages only)."""
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
