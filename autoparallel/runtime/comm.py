"""The only module that calls ``torch.distributed`` collectives.

Every function works on this rank's local tensor and one mesh axis (or a list of
point-to-point transfers), handles uneven ``torch.chunk`` pieces, and records what it moved in
``CommDebugMode`` using the formulas in ``autoparallel.cost``.

Process groups: each mesh axis line (the ranks that differ only in that axis) gets one group,
owned by ``autoparallel.runtime.groups`` (created for every line by every rank in a fixed order).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
import torch.distributed as dist

from autoparallel import cost, runtime
from autoparallel.runtime import groups
from autoparallel.runtime.debug import record
from autoparallel.placement import chunk_bounds

if TYPE_CHECKING:
    from autoparallel.mesh import ProcessMesh

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
# torch >= 2.13 names the tensor-in/tensor-out collectives *_single; older releases *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(mesh: "ProcessMesh", axis: int) -> tuple[object, tuple[int, ...], tuple[int, ...]]:
    """(process group, axis line in coordinate order, group rank of each coordinate)."""
    return groups.group_of(mesh, axis)


# ---- how collectives are issued ---------------------------------------------------------------
# Eager: torch.distributed's in-place c10d calls (async work objects). Captured: the functional
# collectives (``_c10d_functional.*`` + ``wait_tensor``), which a tracer (``make_fx``) records
# as graph nodes naming the group by its name, so a captured program replays them and holds
# no process group object. Switched only through ``functional_collectives()``.
_FUNCTIONAL: list[bool] = [False]
_fc = torch.ops._c10d_functional


class CaptureError(RuntimeError):
    """A collective that a captured program cannot hold (point-to-point transfers)."""


@contextmanager
def functional_collectives() -> Iterator[None]:
    """Issue every collective of this block as a functional collective (for a static capture)."""
    before = _FUNCTIONAL[0]
    _FUNCTIONAL[0] = True
    try:
        yield
    finally:
        _FUNCTIONAL[0] = before


def capturing() -> bool:
    """Whether collectives are being recorded into a captured program (``functional_collectives``):
    control messages (the agreement checks) stay out of programs."""
    return _FUNCTIONAL[0]


class _Done:
    """The work of a collective that has completed (functional collectives wait at once)."""

    def wait(self) -> bool:
        return True


def _name(group: object) -> str:
    return group.group_name  # type: ignore[attr-defined,no-any-return]


def _refuse_in_capture(what: str) -> None:
    if _FUNCTIONAL[0]:
        raise CaptureError(f"{what} (point-to-point) cannot be captured in a static program")


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
    if _FUNCTIONAL[0]:
        out = _fc.wait_tensor(_fc.all_reduce(local.contiguous(), _REDUCE_OPS[reduce_type].lower(), _name(group)))
        record("all_reduce", mesh, axis, line, *cost.all_reduce_bytes(_nbytes(out), len(line)))
        return out, _Done()
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
        if _FUNCTIONAL[0]:
            out = _fc.wait_tensor(_fc.all_gather_into_tensor(x, n, _name(group)))
        else:
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
        recv = _all_to_all_flat(send, out_splits, in_splits, group)
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
    if step and _FUNCTIONAL[0]:
        out = _fc.wait_tensor(_fc.reduce_scatter_tensor(inp, _REDUCE_OPS[reduce_type].lower(), n, _name(group)))
    elif step:
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
    recv = _all_to_all_flat(torch.cat(send_by_group), out_splits, in_splits, group)
    flat = list(recv.split(out_splits))
    parts = [flat[g].reshape(shapes[c]) for c, g in enumerate(grank)]
    item = local.element_size()
    record(
        "all_to_all", mesh, axis, line,
        *cost.all_to_all_bytes([s * item for s in send_sizes_c], [s * item for s in recv_sizes_c], me),
    )
    return torch.cat(parts, dim=gather_dim)


def _all_to_all_flat(send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: object) -> torch.Tensor:
    """One flat all-to-all: ``in_splits[g]`` elements of ``send`` go to group rank ``g``."""
    if _FUNCTIONAL[0]:
        return _fc.wait_tensor(_fc.all_to_all_single(send, out_splits, in_splits, _name(group)))
    recv = send.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)  # type: ignore[arg-type]
    return recv


def send_recv(
    sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], mesh: object = None
) -> None:
    """Point-to-point: send each ``(tensor, dst_rank)``, fill each ``(buffer, src_rank)``.

    Every rank must list its transfers in the same global order so pairs match up.
    """
    _refuse_in_capture("send/recv")
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
    _refuse_in_capture("isend")
    works: list[object] = [dist.isend(t.contiguous(), peer, tag=tag) for t, peer in sends]
    if sends:
        record("send_recv", mesh, None, tuple(sorted({p for _, p in sends})), sum(_nbytes(t) for t, _ in sends), 0)
    return works


def irecv(recvs: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> list[object]:
    """Post receives into each ``(buffer, src_rank)`` with ``tag``; wait on the returned works."""
    _refuse_in_capture("irecv")
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
