"""SPMD agreement: every rank of a mesh passed the same metadata to an entry point.

``shard_tensor``, ``dtensor_from_local`` and ``reshard`` take a global shape, dtype, mesh and
placements that every rank must pass alike (SPMD). A rank passing something else used to be
accepted and then fail far away: gloo aborting a mismatched collective, a hang, or silently
wrong values (Shard(0) against Shard(1) on a square tensor). ``check`` compares a 64-bit digest
of the metadata over the mesh with one tiny all-reduce per mesh axis (the max of the digest and
of its negation: equal everywhere iff min == max; control messages, which ``CommDebugMode``
does not record), and on a mismatch gathers the descriptions so
that every rank raises the same ``ValueError`` naming the first rank that differs from the
mesh's first rank and both values — before any data moves.

When it runs: the first ``SETUP_CALLS`` calls of each entry point on each mesh (the set-up:
laying out parameters, the first batches), which every member makes in the same order, so every
member takes part in the same checks. ``AUTOPARALLEL_CHECK=1`` checks every call and adds a
checksum of the values for ``shard_tensor`` (whose data must be identical on every rank), like
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and extends the check to every planned collective
(``check_collective``: a reshard plan's steps, a kernel's statistics all-reduce): before each
one, the members of its axis line compare a digest of what each is about to issue (kind,
ranks, global shape, dtype, layouts), and on a mismatch every member raises the same
``ValueError`` naming the first differing rank and both collectives — where a rank-dependent
decision would otherwise abort in gloo, hang, or silently mix pieces. ``AUTOPARALLEL_CHECK=0``
turns the checks off.

``check_plain`` holds plain tensors that meet DistTensors to the same contract: taken as
Replicate, they must hold the same value on every rank; the ranks compare their shapes, dtypes
and a checksum of their values (sampled in the default mode, whole with ``AUTOPARALLEL_CHECK=1``),
so per-rank data fed as a plain tensor raises instead of desynchronising replicated weights.

A mesh of one
rank and a rank outside the mesh check nothing. A static capture (``autoparallel.static``)
checks as an eager call does: the control messages run for real while the step is traced on
fake tensors (never part of the program), and a plain tensor the step was given is compared by
the real value its fake stands for (``stand_ins``); a program run checks nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from autoparallel import compat
from autoparallel.runtime import comm, groups
from autoparallel.runtime.debug import unrecorded
from autoparallel.runtime.world import get_rank, world_available

if TYPE_CHECKING:
    from autoparallel.mesh import ProcessMesh

CHECK_VAR = "AUTOPARALLEL_CHECK"
SETUP_CALLS = 64
DESCRIPTION_BYTES = 480  # a description is cut to this many bytes for the gather
PLAIN_SAMPLE = 4096  # elements of a plain tensor checksummed in the default mode


class _Calls:
    """How many calls of each (entry point, mesh) this process made: the same on every member."""

    def __init__(self) -> None:
        self.count: Counter[tuple[str, object]] = Counter()


_CALLS = _Calls()


class _StandIns:
    """The real tensors that a capture's fake inputs stand for, innermost capture last."""

    def __init__(self) -> None:
        self.stack: list[dict[int, torch.Tensor]] = []


_STAND_INS = _StandIns()


@contextlib.contextmanager
def stand_ins(reals: dict[int, torch.Tensor]) -> Iterator[None]:
    """While a step is traced on fake tensors: ``reals`` maps each fake input (by ``id``) to
    the real tensor it stands for, so ``check_plain`` compares the values the ranks were given."""
    _STAND_INS.stack.append(reals)
    try:
        yield
    finally:
        _STAND_INS.stack.pop()


def _control() -> Any:
    """The context the checks run in: inside a capture, for real (the trace's fake and proxy
    modes suspended, collectives not functional); elsewhere, as they are."""
    if not comm.capturing():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(compat.outside_trace())
    stack.enter_context(comm.real_collectives())
    return stack


def mode() -> str:
    """``"setup"`` (default), ``"all"`` (AUTOPARALLEL_CHECK=1) or ``"off"`` (AUTOPARALLEL_CHECK=0)."""
    raw = os.environ.get(CHECK_VAR, "").strip()
    return {"": "setup", "1": "all", "0": "off"}.get(raw, "setup")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def checksum(t: torch.Tensor, sample: bool = False) -> str:
    """A checksum of ``t``'s values (bytes), for comparing data across ranks; ``sample``: of
    ``PLAIN_SAMPLE`` evenly spaced elements at most (and all of a smaller tensor)."""
    if compat.is_fake(t):
        return "(traced: no value)"
    flat = t.detach().reshape(-1)
    if sample and flat.numel() > PLAIN_SAMPLE:
        flat = flat[:: flat.numel() // PLAIN_SAMPLE][:PLAIN_SAMPLE]
    # a one-element tensor of stride 0 (an expanded scalar) counts as contiguous, and cannot be
    # viewed as bytes: such a tensor is copied into a fresh buffer
    flat = flat.contiguous() if flat.numel() != 1 or flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)
    b = flat.view(torch.uint8).to(torch.int64)
    if b.numel() == 0:
        return "empty"
    w = torch.arange(b.numel(), dtype=torch.int64) % 65521 + 1
    return f"{int((b * w).sum())}:{int(b.sum())}"


def check(where: str, mesh: ProcessMesh, describe: Callable[[], str],
          values: Callable[[], str] | None = None) -> None:
    """Raise the same ``ValueError`` on every member of ``mesh`` when they passed different
    metadata (``describe()``) — see the module docstring for when this runs."""
    how = _due(where, mesh)
    if how is None:
        return
    with _control():
        text = describe()
        if how == "all" and values is not None:
            text += f"; values checksum {values()}"
        found = _disagreement(text, mesh)
    if found is not None:
        r0, first, r, other = found
        raise ValueError(
            f"{where}: the ranks of {mesh!r} disagree (every rank must pass the same global shape, dtype, "
            f"mesh and placements): rank {r0} passed {first}; rank {r} passed {other}")


def check_plain(where: str, mesh: ProcessMesh, tensors: Sequence[torch.Tensor]) -> None:
    """Raise the same ``ValueError`` on every member of ``mesh`` when the plain tensors an op
    (or a module) takes as Replicate (docs/plain_tensors.md) differ across its ranks.

    A plain tensor mixed with DistTensors must hold the same full value on every rank. Per-rank
    data there (the DDP habit: each rank feeds its own batch) would make every rank compute a
    different "replicated" result and silently desynchronise replicated weights. The digest is
    the shapes, dtypes and a checksum of the values (an even sample of ``PLAIN_SAMPLE`` elements
    per tensor in the default mode, every byte with ``AUTOPARALLEL_CHECK=1``), compared like
    ``check``'s metadata: the first ``SETUP_CALLS`` calls per ``where`` (an op or a module)
    and mesh, every call with ``AUTOPARALLEL_CHECK=1``. Nothing is checked inside a backward: its
    plain tensors are the backward formulas' own, and a recomputation repeats a checked forward
    (a checkpoint's recomputation must run the ops its forward ran)."""
    if compat.in_backward():  # backward formulas' own tensors, and recomputations of a checked forward
        return
    how = _due(where, mesh)
    if how is None:
        return
    reals = _STAND_INS.stack[-1] if _STAND_INS.stack else {}
    live = [t for t in (reals.get(id(t), t) for t in tensors)
            if t.layout == torch.strided and t.device.type != "meta" and not compat.is_fake(t)]
    if not live:
        return
    with _control():
        text = "; ".join(f"shape {list(t.shape)}, {t.dtype}, values checksum {checksum(t, sample=how != 'all')}"
                         for t in live)
        found = _disagreement(text, mesh)
    if found is None:
        return
    r0, first, r, other = found
    raise ValueError(
        f"{where}: a plain tensor met DistTensors on {mesh!r} and was taken as Replicate (the same full "
        f"value on every rank), but the ranks hold different values: rank {r0} has {first}; rank {r} has "
        f"{other}. Per-rank data must be laid out: the global batch "
        "with ap.shard_tensor(batch, mesh, [Shard(0)]), a loader with ap.shard_dataloader(loader, mesh, "
        "shard_dims='dp'), or each rank's own piece with ap.dtensor_from_local(local, mesh, [Shard(0)])")


def _due(where: str, mesh: ProcessMesh) -> str | None:
    """The mode of a check of ``where`` on ``mesh`` that is due on this rank now (it counts the
    call), or None: no check (off, a one-rank mesh, a capture, no world, past the set-up calls,
    not a member)."""
    how = mode()
    if how == "off" or mesh.size == 1 or not world_available():
        return None
    key = (where, mesh)
    n = _CALLS.count[key]
    _CALLS.count[key] = n + 1
    if how == "setup" and n >= SETUP_CALLS:
        return None
    if mesh.coordinate_of(get_rank()) is None:
        return None
    return how


def _disagreement(text: str, mesh: ProcessMesh) -> tuple[int, str, int, str] | None:
    """None when every member of ``mesh`` passed ``text``; else (the mesh's first rank, its text,
    the first rank whose text differs, that text), the same on every member. Control messages:
    one tiny all-reduce per mesh axis (and the gather on a mismatch), which ``CommDebugMode`` does
    not record."""
    groups.ensure(mesh)
    d = _digest(text)
    both = torch.tensor([d, -d], dtype=torch.int64)
    with unrecorded():  # control messages, not the program's communication
        for axis in range(mesh.ndim):
            if mesh.shape[axis] > 1:  # a one-rank line has nothing to compare (and no group)
                both = comm.all_reduce(both, mesh, axis, "max")
        if int(both[0]) == d and int(both[1]) == -d:
            return None  # max == min == this rank's digest: every member agrees
        texts = _gather(text, mesh)
    origin = (0,) * mesh.ndim
    c, other = next((c, t) for c, t in sorted(texts.items()) if t != texts[origin])
    return mesh.rank_at(origin), texts[origin], mesh.rank_at(c), other


def _gather(text: str, mesh: ProcessMesh) -> dict[tuple[int, ...], str]:
    """Every member's description, by mesh coordinate (one all-gather per axis)."""
    raw = text.encode()[:DESCRIPTION_BYTES]
    buf = torch.zeros(1, DESCRIPTION_BYTES + 2, dtype=torch.uint8)
    buf[0, 0], buf[0, 1] = len(raw) // 256, len(raw) % 256
    buf[0, 2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    rows = buf
    # gather along the last axis first, then the next: rows end up in row-major coordinate order
    for axis in reversed(range(mesh.ndim)):
        n = mesh.shape[axis]
        if n == 1:
            continue
        rows = comm.all_gather(rows.unsqueeze(0), mesh, axis, 0, [1] * n).reshape(-1, DESCRIPTION_BYTES + 2)
    out: dict[tuple[int, ...], str] = {}
    shape = tuple(mesh.shape)
    for i in range(rows.shape[0]):
        coord, rest = [], i
        for size in reversed(shape):
            coord.append(rest % size)
            rest //= size
        length = int(rows[i, 0]) * 256 + int(rows[i, 1])
        out[tuple(reversed(coord))] = bytes(rows[i, 2:2 + length].tolist()).decode(errors="replace")
    return out


def check_collective(mesh: ProcessMesh, axis: int, describe: Callable[[], str]) -> None:
    """``AUTOPARALLEL_CHECK=1``: raise the same ``ValueError`` on every member of this rank's line
    along ``axis`` when the members are about to issue different collectives (``describe()``:
    kind, ranks, global shape, dtype, layouts — what every member must plan alike). One tiny
    all-reduce of a digest over the line (a control message); nothing in the default mode."""
    if mode() != "all" or mesh.shape[axis] == 1 or not world_available():
        return
    coord = mesh.coordinate_of(get_rank())
    if coord is None:
        return
    with _control():
        text = describe()
        d = _digest(text)
        both = torch.tensor([d, -d], dtype=torch.int64)
        with unrecorded():
            both = comm.all_reduce(both, mesh, axis, "max")
            if int(both[0]) == d and int(both[1]) == -d:
                return
            texts = _gather_line(text, mesh, axis)
    line = [mesh.rank_at(coord[:axis] + (i,) + coord[axis + 1:]) for i in range(mesh.shape[axis])]
    for i, t in enumerate(texts):
        if t != texts[0]:
            raise ValueError(
                f"the ranks {line} of {mesh!r} (axis {axis}) planned different collectives (every rank must "
                f"plan the same ones from the same metadata): rank {line[0]} planned {texts[0]}; "
                f"rank {line[i]} planned {t}")


def _gather_line(text: str, mesh: ProcessMesh, axis: int) -> list[str]:
    """Every member's description along ``axis``, in coordinate order (one all-gather)."""
    raw = text.encode()[:DESCRIPTION_BYTES]
    buf = torch.zeros(1, DESCRIPTION_BYTES + 2, dtype=torch.uint8)
    buf[0, 0], buf[0, 1] = len(raw) // 256, len(raw) % 256
    buf[0, 2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    n = mesh.shape[axis]
    rows = comm.all_gather(buf, mesh, axis, 0, [1] * n)
    return [bytes(rows[i, 2:2 + int(rows[i, 0]) * 256 + int(rows[i, 1])].tolist()).decode(errors="replace")
            for i in range(n)]
