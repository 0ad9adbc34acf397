"""The only module that calls ``torch.distributed`` collectives.

Every function works on this rank's local tensor and one mesh axis (or a list of
point-to-point transfers), handles uneven ``torch.chunk`` pieces, and records what it moved in
``CommDebugMode`` using the formulas in ``autoparallel.cost``.

Every dtype moves: ``NATIVE`` dtypes go to the backend as they are; the others move exactly
(see "dtypes" below and docs/dtypes.md). Bytes are recorded in the tensor's own dtype.

Process groups: each mesh axis line (the ranks that differ only in that axis) gets one group,
owned by ``autoparallel.runtime.groups`` (created for every line by every rank in a fixed order).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autoparallel import cost, runtime
from autoparallel.compat import profiler_enabled
from autoparallel.placement import chunk_bounds
from autoparallel.runtime import groups
from autoparallel.runtime.debug import record, timed

if TYPE_CHECKING:
    from autoparallel.mesh import ProcessMesh

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
# torch >= 2.13 names the tensor-in/tensor-out collectives *_single (the *_tensor names warn that
# they are deprecated); older releases have only *_tensor. Public: auto_parallel's calibration times them.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- dtypes: what the backend carries, and how every other dtype moves exactly -------------------
# Decided from (dtype, reduce type) alone, so every rank makes the same choice and a refusal is
# raised on every rank before any collective. Data movement (gather, all-to-all, broadcast,
# send/recv) of a dtype outside NATIVE moves its raw bytes (a uint8 view) and views them back.
# A reduction travels as ``Carry`` says: the same bytes under another dtype (bool ``sum`` is
# ``or``: uint8 max; unsigned sums: modular adds are sign-blind), widened to a dtype that holds
# every value and every partial result exactly and narrowed back once (int16/uint16 -> int32,
# uint32 max/min -> int64, float8 sum/avg -> float64 so the result is the correctly rounded
# exact sum, float8 max/min -> float32), or with the sign bit flipped (uint64 max/min: unsigned
# order as signed order). Refused, with a ValueError naming dtype and op: ``avg`` of bool and
# integers (the average is not an integer), max/min of complex numbers (no order), sum/avg of
# float8_e8m0fnu (powers of two: a sum is not one), and any dtype not listed.
NATIVE = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
})
_FLOAT8 = frozenset(
    dt for dt in (getattr(torch, name, None) for name in
                  ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))
    if dt is not None
)
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_COMPLEX = frozenset({torch.complex64, torch.complex128})
_INTS = frozenset({torch.uint8, torch.int8, torch.int32, torch.int64})  # native integers
_SIGN64 = -(2**63)  # int64 with only the sign bit set


@dataclass(frozen=True, slots=True)
class Carry:
    """How a reduction of ``dtype`` travels: the backend reduces ``wire`` values with ``op``.

    ``how``: ``native`` (as it is), ``view`` (the same bytes as ``wire``), ``widen`` (converted to
    ``wire`` and back, exactly), ``flip`` (viewed as int64 with the sign bit flipped) or ``ordered``
    (a float's max/min: its bits as an integer in the floats' order, a NaN above +inf for max and
    below -inf for min, so a NaN on any member wins as in ``torch.amax``; a backend's float max
    keeps a NaN only from its first operand).
    """

    dtype: torch.dtype
    wire: torch.dtype
    op: str
    how: str

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (contiguous) as the backend's operand: a view of it, or a new tensor."""
        if self.how == "native":
            return t
        if self.how == "view":
            return t.view(self.wire)
        if self.how == "flip":
            return t.view(self.wire).bitwise_xor(_SIGN64)
        if self.how == "ordered":
            x = t if t.dtype in (torch.float32, torch.float64) else t.float()
            nan = torch.full((), math.nan, dtype=x.dtype, device=x.device)
            x = torch.where(torch.isnan(x), nan if self.op == "max" else -nan, x)
            return _float_order(x.view(self.wire))
        return t.to(self.wire)

    def result(self, w: torch.Tensor, n: int, reduce_type: str) -> torch.Tensor:
        """The reduced ``wire`` values ``w`` over ``n`` members as ``dtype`` (``avg`` divides)."""
        if reduce_type == "avg":
            w = w / n  # native floats in their own dtype; float8 in float64
        if self.how == "native":
            return w
        if self.how == "view":
            return w.view(self.dtype)
        if self.how == "flip":
            return w.bitwise_xor(_SIGN64).view(self.dtype)
        if self.how == "ordered":
            return _float_order(w).view(torch.float64 if self.wire == torch.int64 else torch.float32).to(self.dtype)
        return w.to(self.dtype)


def _float_order(bits: torch.Tensor) -> torch.Tensor:
    """A float's bits (as int32/int64) mapped to integers in the floats' order, and back (the map
    is its own inverse): a negative float's magnitude bits flipped."""
    mask = (1 << (bits.element_size() * 8 - 1)) - 1
    return torch.where(bits < 0, bits ^ mask, bits)


def reduce_refusal(dtype: torch.dtype, reduce_type: str) -> str | None:
    """Why ``reduce_type`` over ``dtype`` is refused, or ``None`` when it is exact."""
    try:
        reduction_carry(dtype, reduce_type)
    except ValueError as e:
        return str(e)
    return None


@functools.cache
def reduction_carry(dtype: torch.dtype, reduce_type: str) -> Carry:
    """How ``reduce_type`` over ``dtype`` travels exactly; ``ValueError`` naming both if it cannot."""
    op = "sum" if reduce_type == "avg" else reduce_type
    if op not in ("sum", "max", "min"):
        raise ValueError(f"unknown reduce type {reduce_type!r}; expected sum, avg, max or min")
    why = None
    if reduce_type == "avg" and (dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)):
        why = "the average of integers is not an integer (reduce with 'sum' and divide, or use a floating dtype)"
    elif op != "sum" and dtype.is_complex:
        why = "complex numbers have no order"
    elif dtype in _FLOATS and op != "sum":
        return Carry(dtype, torch.int64 if dtype == torch.float64 else torch.int32, op, "ordered")
    elif dtype in _FLOATS or dtype in _COMPLEX or dtype in _INTS:
        return Carry(dtype, dtype, op, "native")
    elif dtype == torch.bool:  # bool ``+`` is ``or``
        return Carry(dtype, torch.uint8, "min" if op == "min" else "max", "view")
    elif dtype in (torch.int16, torch.uint16):
        return Carry(dtype, torch.int32, op, "widen")
    elif dtype == torch.uint32:
        return Carry(dtype, torch.int32, op, "view") if op == "sum" else Carry(dtype, torch.int64, op, "widen")
    elif dtype == torch.uint64:
        return Carry(dtype, torch.int64, op, "view" if op == "sum" else "flip")
    elif dtype in _FLOAT8:
        if op != "sum":
            return Carry(dtype, torch.int32, op, "ordered")
        if dtype != getattr(torch, "float8_e8m0fnu", None):
            return Carry(dtype, torch.float64, op, "widen")
        why = "its values are powers of two and a sum of them is not one"
    else:
        why = "there is no exact way to carry it over the backend"
    raise ValueError(f"cannot reduce a {dtype} tensor with {reduce_type!r}: {why}")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as the backend moves it: itself, or a flat uint8 view of its bytes."""
    return t if t.dtype in NATIVE else t.reshape(-1).view(torch.uint8)


def _wire_buffer(b: torch.Tensor) -> torch.Tensor:
    """A receive buffer as the backend fills it: itself, or a uint8 view sharing its storage."""
    if b.dtype not in NATIVE and not b.is_contiguous():
        raise ValueError(f"a receive buffer of {b.dtype} must be contiguous (it is filled through a byte view)")
    return _wire(b)


def _unwire(w: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of ``_wire`` for moved bytes that form a ``shape`` tensor of ``dtype``."""
    return w if dtype in NATIVE else w.view(dtype).reshape(tuple(shape))


def _reduce_local(stack: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce ``[n, ...]`` over dim 0 in its own dtype."""
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    return stack.amax(0) if op == "max" else stack.amin(0)


def _group(mesh: ProcessMesh, axis: int) -> tuple[object, tuple[int, ...], tuple[int, ...]]:
    """(process group, axis line in coordinate order, group rank of each coordinate)."""
    return groups.group_of(mesh, axis)


# ---- how collectives are issued ---------------------------------------------------------------
# Eager: torch.distributed's in-place c10d calls (async work objects). Captured: the functional
# collectives (``_c10d_functional.*`` + ``wait_tensor``), which a tracer (``make_fx``) records
# as graph nodes naming the group by its name, so a captured program replays them and holds
# no process group object. Switched only through ``functional_collectives()``.
_FUNCTIONAL: list[bool] = [False]
_APART: list[bool] = [False]  # (``functional_collectives(apart=True)``: ``reduce_apart``)
_fc = torch.ops._c10d_functional


class CaptureError(RuntimeError):
    """A collective that a captured program cannot hold (point-to-point transfers)."""


@contextmanager
def functional_collectives(apart: bool = False) -> Iterator[None]:
    """Issue every collective of this block as a functional collective (for a static capture).
    ``apart``: a kernel may reduce values it would reduce together one by one (``reduce_apart``),
    for a program whose passes start each where its input exists and merge them where that pays."""
    before = _FUNCTIONAL[0], _APART[0]
    _FUNCTIONAL[0], _APART[0] = True, apart
    try:
        yield
    finally:
        _FUNCTIONAL[0], _APART[0] = before


@contextmanager
def real_collectives() -> Iterator[None]:
    """Issue the collectives of this block for real, inside a capture too (the agreement
    checks' control messages: run at the capture, never part of a program)."""
    before = _FUNCTIONAL[0]
    _FUNCTIONAL[0] = False
    try:
        yield
    finally:
        _FUNCTIONAL[0] = before


def capturing() -> bool:
    """Whether collectives are being recorded into a captured program (``functional_collectives``):
    control messages (the agreement checks) stay out of programs."""
    return _FUNCTIONAL[0]


def reduce_apart() -> bool:
    """Whether a kernel may issue apart the reductions of values it reduces together eagerly (a
    mean loss's sum and count): inside ``functional_collectives(apart=True)`` only."""
    return _FUNCTIONAL[0] and _APART[0]


def profiled(name: str, of: Any = None) -> Any:
    """A ``torch.profiler`` range named ``name`` (``autoparallel::...``: planning, reshards,
    collectives show in a trace next to torch's ops), ``name`` followed by ``of`` where given
    (formatted only when a profiler records: an op's name costs microseconds); nothing while a
    program is captured (the range would become a node of the program) or while no profiler
    records (a range costs ~15 us per collective or decision even then)."""
    if _FUNCTIONAL[0] or not profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(name if of is None else f"{name} {of}")


def _ranged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` inside a profiler range ``autoparallel::<its name>``, timed for ``CommDebugMode``."""
    name = "autoparallel::" + fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with profiled(name), timed():
            try:
                return fn(*args, **kwargs)
            except RuntimeError as e:  # (DistBackendError is one)
                raise _stalled(fn.__name__, e) from e

    return call


_STALLED = ("timed out", "timeout", "connection closed by peer", "connection reset by peer")


def _stalled(what: str, e: RuntimeError) -> RuntimeError:
    """``e``, where the backend gave up waiting for the other ranks, with what a user can do about it."""
    text = str(e)
    if not any(s in text.lower() for s in _STALLED):
        return e
    msg = (f"autoparallel: {what} did not complete: the other ranks of its group did not take part within the "
           f"collective timeout ({runtime.collective_timeout_s()}). Every rank must run the same ops on DistTensors in "
           "the same order (SPMD): a branch on the rank or on data that differs between ranks, or a rank that raised "
           f"or exited early, leaves the others waiting. The backend said: {text.splitlines()[0][:300]}")
    try:
        return type(e)(msg)  # (the backend's own error type: DistBackendError, ...)
    except Exception:  # noqa: BLE001  (a type that takes other arguments)
        return RuntimeError(msg)


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a collective started without waiting) timed for ``CommDebugMode``."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with timed():
            return fn(*args, **kwargs)

    return call


class _Done:
    """The work of a collective that has completed (functional collectives wait at once)."""

    def wait(self) -> bool:
        return True


DONE = _Done()  # the work of a collective that is already complete


class _Finish:
    """A collective's work followed by a local step (narrowing a carried result) on ``wait``."""

    def __init__(self, work: object, then: Callable[[], None] | None = None) -> None:
        self.work: Any = work
        self.then = then
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise _stalled("a collective", e) from e
            if self.then is not None:
                self.then()
            self.done = True
            self.work = self.then = None  # the backend's hold on the operands ends here
        return True


def _name(group: object) -> str:
    return group.group_name  # type: ignore[attr-defined,no-any-return]


def captured_group(mesh: ProcessMesh, axis: int) -> tuple[str, tuple[int, ...]]:
    """The name a captured collective over the mesh axis gives its group, and the axis line."""
    group, line, _ = _group(mesh, axis)
    return _name(group), line


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


@_ranged
def all_reduce(local: torch.Tensor, mesh: ProcessMesh, axis: int, reduce_type: str, in_place: bool = False) -> torch.Tensor:
    """Reduce ``local`` over the axis; every member gets the result (a new tensor, or with
    ``in_place`` a contiguous ``local`` itself: a buffer the caller owns)."""
    out, work = all_reduce_start(local, mesh, axis, reduce_type, in_place)
    work.wait()  # type: ignore[attr-defined]
    return out


@_timed
def all_reduce_start(
    local: torch.Tensor, mesh: ProcessMesh, axis: int, reduce_type: str = "sum", in_place: bool = False
) -> tuple[torch.Tensor, object]:
    """Start reducing ``local`` over the axis without waiting: (result buffer, work to wait on).

    The buffer holds the result (for ``avg``: the average) once ``work.wait()`` returns. Every
    member must start the same collectives in the same order. A dtype the backend does not
    carry travels as ``reduction_carry`` says; one that cannot be reduced exactly raises
    ``ValueError`` before anything is sent.
    """
    carry = reduction_carry(local.dtype, reduce_type)
    group, line, _ = _group(mesh, axis)
    n = len(line)
    if _FUNCTIONAL[0]:
        w = _fc.wait_tensor(_fc.all_reduce(carry.to_wire(local.contiguous()), carry.op, _name(group)))
        out = carry.result(w, n, reduce_type)
        record("all_reduce", mesh, axis, line, *cost.all_reduce_bytes(_nbytes(out), n))
        return out, _Done()
    out = local if in_place and local.is_contiguous() else local.contiguous().clone()
    wire = carry.to_wire(out)  # ``out`` itself or a view of it, unless widened or flipped
    work = dist.all_reduce(wire, op=_reduce_op(carry.op), group=group, async_op=True)  # type: ignore[arg-type]
    record("all_reduce", mesh, axis, line, *cost.all_reduce_bytes(_nbytes(out), n))
    if wire.data_ptr() == out.data_ptr() and reduce_type != "avg":
        return out, work  # the backend wrote the result into ``out``

    def finish() -> None:
        out.copy_(carry.result(wire, n, reduce_type))

    return out, _Finish(work, finish)


@_ranged
def all_gather(local: torch.Tensor, mesh: ProcessMesh, axis: int, dim: int, sizes: Sequence[int]) -> torch.Tensor:
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
    if all(s == sizes[0] for s in sizes):
        shape = (n * sizes[0],) + tuple(rest)
        if _FUNCTIONAL[0]:
            out = _unwire(_fc.wait_tensor(_fc.all_gather_into_tensor(_wire(x), n, _name(group))), x.dtype, shape)
        else:
            out = x.new_empty(shape)
            all_gather_flat(_wire(out), _wire(x), group=group)  # type: ignore[arg-type]
        if list(grank) == list(range(n)):  # group-rank order is coordinate order: no copy
            record("all_gather", mesh, axis, line, *cost.all_gather_bytes([s * row * item for s in sizes], me))
            return out.movedim(0, dim).contiguous()
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


@_timed
def all_gather_start(flat: torch.Tensor, mesh: ProcessMesh, axis: int) -> tuple[torch.Tensor, object]:
    """Start concatenating the members' 1-d pieces ``flat`` (the same length on every member)
    in coordinate order, without waiting: (the result ``[n * len]``, work to wait on before
    reading it). Every member must start the same collectives in the same order; while captured,
    the collective is functional and done on return."""
    group, line, grank = _group(mesh, axis)
    n = len(line)
    x = flat.reshape(-1).contiguous()
    if _FUNCTIONAL[0] or not x.numel():
        return all_gather(x, mesh, axis, 0, [x.numel()] * n), DONE
    me = line.index(runtime.get_rank())
    out = x.new_empty(n * x.numel())
    work = all_gather_flat(_wire(out), _wire(x), group=group, async_op=True)  # type: ignore[arg-type]
    record("all_gather", mesh, axis, line, *cost.all_gather_bytes([_nbytes(x)] * n, me))
    if list(grank) == list(range(n)):
        return out, _Finish(work)  # group-rank order is coordinate order
    ordered = torch.empty_like(out)

    def finish() -> None:  # group-rank order -> coordinate order
        pieces = out.split(x.numel())
        torch.cat([pieces[g] for g in grank], out=ordered)

    return ordered, _Finish(work, finish)


@_timed
def reduce_scatter_start(flat: torch.Tensor, mesh: ProcessMesh, axis: int, reduce_type: str = "sum") -> tuple[torch.Tensor, object]:
    """Start reducing the 1-d ``flat`` over the axis — ``n`` equal segments, segment ``c`` for
    the member at coordinate ``c`` — without waiting: (this member's reduced segment, work to
    wait on before reading it). While captured, the collective is functional and done on return."""
    group, line, grank = _group(mesh, axis)
    n = len(line)
    if _FUNCTIONAL[0] or not flat.numel():
        return reduce_scatter(flat, mesh, axis, 0, reduce_type), DONE
    carry = reduction_carry(flat.dtype, reduce_type)
    me = line.index(runtime.get_rank())
    width = flat.numel() // n
    record("reduce_scatter", mesh, axis, line,
           *cost.pieces_reduce_scatter_bytes([width * flat.element_size()] * n, me))
    if list(grank) == list(range(n)):
        ordered = flat.contiguous()
    else:
        segments = flat.split(width)
        ordered = torch.cat([segments[c] for c in sorted(range(n), key=lambda c: grank[c])])
    inp = carry.to_wire(ordered)
    w = inp.new_empty(width)
    work = reduce_scatter_flat(w, inp, op=_reduce_op(carry.op), group=group, async_op=True)  # type: ignore[arg-type]
    if carry.how == "native" and reduce_type != "avg":
        return w, _Finish(work)
    out = flat.new_empty(width)

    def finish() -> None:
        out.copy_(carry.result(w, n, reduce_type))

    return out, _Finish(work, finish)


@_ranged
def reduce_scatter(
    local: torch.Tensor, mesh: ProcessMesh, axis: int, dim: int, reduce_type: str
) -> torch.Tensor:
    """Reduce over the axis and keep this member's ``torch.chunk`` piece along ``dim``.

    Even pieces: one reduce-scatter. Uneven pieces (``local.shape[dim] % n``, the same on every
    member): an all-to-all of the exact pieces, then this member reduces the ``n`` summands of
    its own piece — no padding, so a member receives ``n - 1`` times its own piece.
    """
    carry = reduction_carry(local.dtype, reduce_type)
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    size = local.shape[dim]
    x = local.movedim(dim, 0)  # [size, ...rest]
    rest = tuple(x.shape[1:])
    item = local.element_size()
    length = chunk_bounds(size, n, me)[1]
    pieces_c = [chunk_bounds(size, n, c) for c in range(n)]
    row = _numel(rest)
    record("reduce_scatter", mesh, axis, line,
           *cost.pieces_reduce_scatter_bytes([ln * row * item for _, ln in pieces_c], me))
    if size % n:
        # [n summands, length, ...rest] of this member's piece, in coordinate order
        stack = _exchange_pieces(x, pieces_c, length, grank, group)
        out = carry.result(_reduce_local(carry.to_wire(stack), carry.op), n, reduce_type)
    elif size:
        if list(grank) == list(range(n)) and x.is_contiguous():
            ordered = x  # coordinate order is group-rank order: the input as it is, no copy
        else:
            by_group: list[torch.Tensor] = [x] * n
            for c, g in enumerate(grank):
                by_group[g] = x.narrow(0, *pieces_c[c])
            ordered = torch.cat(by_group, dim=0)
        inp = carry.to_wire(ordered)  # [size, ...rest], group-rank order
        if _FUNCTIONAL[0]:
            w = _fc.wait_tensor(_fc.reduce_scatter_tensor(inp, carry.op, n, _name(group)))
        else:
            w = inp.new_empty((length,) + rest)
            reduce_scatter_flat(w, inp, op=_reduce_op(carry.op), group=group)  # type: ignore[arg-type]
        out = carry.result(w, n, reduce_type)
    else:
        out = x.new_empty((0,) + rest)
    return out.movedim(0, dim).contiguous()


def _exchange_pieces(
    x: torch.Tensor, pieces_c: list[tuple[int, int]], length: int, grank: tuple[int, ...], group: object
) -> torch.Tensor:
    """Send member ``c`` its piece ``pieces_c[c]`` of ``x`` (along dim 0); receive every member's
    summand of this member's piece (``length`` rows): ``[n, length, ...rest]`` in coordinate order."""
    n, rest = len(grank), tuple(x.shape[1:])
    row = _numel(rest)
    send_by_group: list[torch.Tensor] = [x.new_empty(0)] * n
    in_splits = [0] * n
    for c, g in enumerate(grank):
        send_by_group[g] = x.narrow(0, *pieces_c[c]).reshape(-1)
        in_splits[g] = pieces_c[c][1] * row
    recv = _all_to_all_flat(torch.cat(send_by_group), [length * row] * n, in_splits, group)
    by_group = recv.view((n, length) + rest)
    return torch.stack([by_group[g] for g in grank])


@_ranged
def all_to_all(
    local: torch.Tensor,
    mesh: ProcessMesh,
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


@_ranged
def exchange(
    sends: Sequence[Sequence[torch.Tensor]], recv_shapes: Sequence[Sequence[Sequence[int]]],
    mesh: ProcessMesh, axis: int,
) -> list[list[torch.Tensor]]:
    """Point-to-point along one axis line as one all-to-all (so a captured program holds it).

    ``sends[c]``: the tensors for the member at axis coordinate ``c``, in order; ``recv_shapes[c]``:
    the shapes of those the member at ``c`` sends here, in its order. Every tensor has one dtype.
    Returns the received tensors, ``[c][i]``. A ring rotation is the special case of one
    neighbour each way. Members must agree on the pairs (each member's sends to ``c`` are ``c``'s
    receives from it): the callers derive both from global metadata.
    """
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    like = next((t for ts in sends for t in ts), None)
    if like is None:
        raise ValueError("exchange: nothing to send")
    in_splits, out_splits = [0] * n, [0] * n
    send_by_group: list[torch.Tensor] = [like.new_empty(0)] * n
    for c, g in enumerate(grank):
        flat = [t.reshape(-1) for t in sends[c]]
        in_splits[g] = sum(f.numel() for f in flat)
        out_splits[g] = sum(_numel(s) for s in recv_shapes[c])
        if flat:
            send_by_group[g] = torch.cat(flat) if len(flat) > 1 else flat[0]
    recv = _all_to_all_flat(torch.cat(send_by_group), out_splits, in_splits, group)
    flat_recv = list(recv.split(out_splits))
    out: list[list[torch.Tensor]] = []
    for c, g in enumerate(grank):
        shapes = [tuple(s) for s in recv_shapes[c]]
        parts = flat_recv[g].split([_numel(s) for s in shapes]) if shapes else ()
        out.append([p.reshape(s) for p, s in zip(parts, shapes)])
    item = like.element_size()
    record("all_to_all", mesh, axis, line,
           *cost.all_to_all_bytes([in_splits[grank[c]] * item for c in range(n)],
                                  [out_splits[grank[c]] * item for c in range(n)], me))
    return out


def _all_to_all_flat(send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: object) -> torch.Tensor:
    """One flat all-to-all: ``in_splits[g]`` elements of ``send`` go to group rank ``g``."""
    if send.dtype not in NATIVE:  # move the raw bytes
        k = send.element_size()
        recv = _all_to_all_flat(_wire(send), [s * k for s in out_splits], [s * k for s in in_splits], group)
        return recv.view(send.dtype)
    if _FUNCTIONAL[0]:
        return _fc.wait_tensor(_fc.all_to_all_single(send, out_splits, in_splits, _name(group)))
    recv = send.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)  # type: ignore[arg-type]
    return recv


@_ranged
def broadcast(local: torch.Tensor, mesh: ProcessMesh, axis: int, src: int) -> torch.Tensor:
    """Every member of the axis line gets the tensor of the member at axis coordinate ``src``
    (a new tensor; ``local`` must have the same shape and dtype on every member)."""
    group, line, grank = _group(mesh, axis)
    n = len(line)
    me = line.index(runtime.get_rank())
    x = local.contiguous()
    if _FUNCTIONAL[0]:
        out = _unwire(_fc.wait_tensor(_fc.broadcast(_wire(x), grank[src], _name(group))), x.dtype, x.shape)
    else:
        out = x.clone()
        dist.broadcast(_wire_buffer(out), line[src], group=group)  # type: ignore[arg-type]
    record("broadcast", mesh, axis, line, *cost.broadcast_bytes(_nbytes(x), n, me == src))
    return out


@_ranged
def send_recv(
    sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], mesh: object = None
) -> None:
    """Point-to-point: send each ``(tensor, dst_rank)``, fill each ``(buffer, src_rank)``.

    Every rank must list its transfers in the same global order so pairs match up.
    """
    _refuse_in_capture("send/recv")
    ops = [dist.P2POp(dist.isend, _wire(t.contiguous()), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, _wire_buffer(b), peer) for b, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    sent = sum(_nbytes(t) for t, _ in sends)
    recv = sum(_nbytes(b) for b, _ in recvs)
    peers = tuple(sorted({p for _, p in sends} | {p for _, p in recvs}))
    if ops:
        record("send_recv", mesh, None, peers, sent, recv)


@_timed
def isend(sends: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> list[object]:
    """Start sending each ``(tensor, dst_rank)`` with ``tag``; returns the works to wait on.

    Does not block: pipeline stages post a send and go on computing (keep the tensors alive
    until the works complete). The receiver matches by ``(source rank, tag)``.
    """
    _refuse_in_capture("isend")
    works: list[object] = [dist.isend(_wire(t.contiguous()), peer, tag=tag) for t, peer in sends]
    if sends:
        record("send_recv", mesh, None, tuple(sorted({p for _, p in sends})), sum(_nbytes(t) for t, _ in sends), 0)
    return works


@_timed
def irecv(recvs: Sequence[tuple[torch.Tensor, int]], tag: int, mesh: object = None) -> list[object]:
    """Post receives into each ``(buffer, src_rank)`` with ``tag``; wait on the returned works."""
    _refuse_in_capture("irecv")
    works: list[object] = [dist.irecv(_wire_buffer(b), peer, tag=tag) for b, peer in recvs]
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
