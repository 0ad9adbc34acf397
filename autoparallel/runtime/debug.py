"""``CommDebugMode``: record every collective ``autoparallel.runtime.comm`` issues on this rank,
with the module and the op that issued it and how long it took.

Who issued a collective is known through doors, never through another module's globals:

- the op: the engine runs an op's local step inside ``attributed(func)`` while a mode is active
  (``active()``); a reshard called by user code (``ap.reshard``, a parallel style's hook)
  runs inside no op;
- the module: while a mode that asks for it is active, global module hooks
  (``torch.nn.modules.module.register_module_forward_pre_hook`` / ``..._forward_hook``) keep
  the stack of modules whose forward runs, each named by its path in the first root module
  called (``named_modules``; the root by its class name, a module outside it by its class
  name). A module's own forward hooks (a parallel style's output move) count as its forward.
  In a backward, the module is the innermost one whose output's gradient arrived last (a
  hook on each module output that requires a gradient): its backward is running;
- the time: ``comm`` runs each collective inside ``timed()``, the wall time of the call (a
  collective started without waiting, as bucketed gradient reductions are, records the time to
  start it).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from autoparallel import compat

_ACTIVE: list[CommDebugMode] = []
GROUPINGS = ("module", "op", "kind")
# a record's fields but its time: kind, mesh, axis, group, sent, received, module, op
_Fields = tuple[str, Any, "int | None", "tuple[int, ...]", int, int, "str | None", "str | None"]


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as this rank saw it: kind, mesh axis (None for point-to-point), bytes; the
    module and the op that issued it (None: outside any module's forward and backward; no op, an
    explicit reshard) and the wall time of the call in seconds (0.0 in a replayed program)."""

    kind: str
    mesh: Any
    axis: int | None
    group: tuple[int, ...]
    sent_bytes: int
    recv_bytes: int
    module: str | None = None
    op: str | None = None
    seconds: float = 0.0

    def __str__(self) -> str:
        where = f"axis {self.axis}" if self.axis is not None else "p2p"
        text = f"{self.kind}({where}, ranks {list(self.group)}): sent {self.sent_bytes} B, received {self.recv_bytes} B"
        by = [f"in {self.module}"] if self.module is not None else []
        by += [f"by {self.op}"] if self.op is not None else []
        return text + (f" ({', '.join(by)})" if by else "") + f", {self.seconds * 1e3:.3f} ms"


class CommDebugMode:
    """Context manager recording the collectives issued by this rank.

    >>> with CommDebugMode() as comm:
    ...     loss = model(x).sum(); loss.backward()
    >>> comm.get_comm_counts()          # {'all_reduce': 2}
    >>> comm.bytes_received             # bytes this rank received
    >>> print(comm.summary(by="module"))  # count, bytes and time per module ("op", "kind")

    ``modules=False``: no module hooks (records name no module). Nested modes each see every
    record, except what an ``isolated`` mode records: the modes outside it do not see that (a
    static capture's collectives are a program's, issued when it runs, not the trace's).
    """

    def __init__(self, modules: bool = True, *, isolated: bool = False) -> None:
        self.records: list[CommRecord] = []
        self.modules = modules
        self.isolated = isolated

    def __enter__(self) -> CommDebugMode:
        _ACTIVE.append(self)
        if self.modules:
            _MODULES.install()
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        if self.modules:
            _MODULES.uninstall()

    def get_comm_counts(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.records))

    def get_total_counts(self) -> int:
        return len(self.records)

    @property
    def bytes_sent(self) -> int:
        return sum(r.sent_bytes for r in self.records)

    @property
    def bytes_received(self) -> int:
        return sum(r.recv_bytes for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def summary(self, by: str | None = None) -> str:
        """A readable report: one line per collective (``by=None``), or a table of the count,
        bytes sent and received, and time per ``module``, ``op`` or ``kind``, in the order each
        group first issued one ("-": no module, or no op — an explicit reshard)."""
        if by is None:
            lines = [str(r) for r in self.records]
            lines.append(f"total: {len(self.records)} collectives, sent {self.bytes_sent} B, "
                         f"received {self.bytes_received} B, {self.seconds * 1e3:.3f} ms")
            return "\n".join(lines)
        if by not in GROUPINGS:
            raise ValueError(f"CommDebugMode.summary(by={by!r}): expected one of {GROUPINGS} (or None: one line "
                             "per collective)")
        groups: dict[str, list[CommRecord]] = {}
        for r in self.records:
            key = getattr(r, by)
            groups.setdefault("-" if key is None else str(key), []).append(r)
        rows = [(name, str(len(rs)), f"{sum(r.sent_bytes for r in rs):,}", f"{sum(r.recv_bytes for r in rs):,}",
                 f"{sum(r.seconds for r in rs) * 1e3:.3f}",
                 ", ".join(f"{k} x{n}" for k, n in Counter(r.kind for r in rs).items()))
                for name, rs in groups.items()]
        rows.append(("total", str(len(self.records)), f"{self.bytes_sent:,}", f"{self.bytes_received:,}",
                     f"{self.seconds * 1e3:.3f}", ""))
        head = (by, "count", "sent B", "received B", "ms", "kinds")
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

        def line(row: tuple[str, ...]) -> str:
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:5], widths[1:5])]
            return "  ".join(cells + ([row[5]] if by != "kind" else [])).rstrip()

        return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])


def active() -> bool:
    """Whether a ``CommDebugMode`` records (the engine then names each op: ``attributed``)."""
    return bool(_ACTIVE)


# ---- the op ------------------------------------------------------------------------------------
_OPS: list[Any] = []  # the ops whose local step runs, innermost last (entered through ``attributed``)


class attributed:  # noqa: N801  (used as a context manager, named like one)
    """Collectives issued inside are the op ``func``'s (the engine enters it around an op's local
    step while ``active()``)."""

    __slots__ = ("func",)

    def __init__(self, func: Any) -> None:
        self.func = func

    def __enter__(self) -> None:
        _OPS.append(self.func)

    def __exit__(self, *exc: object) -> None:
        _OPS.pop()


def attributing(func: Any) -> bool:
    """Whether ``func`` is the innermost op collectives are attributed to."""
    return bool(_OPS) and _OPS[-1] is func


# ---- the module --------------------------------------------------------------------------------
class _Modules:
    """Which module's forward or backward runs, from global module hooks installed while a mode
    asks for them (see the module docstring). Entries of ``stack``: [module id, name, token of a
    pending late hook or None]."""

    def __init__(self) -> None:
        self.users = 0
        self._reset()

    def _reset(self) -> None:
        self.stack: list[list[Any]] = []
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.rooted = False
        self.root: weakref.ref[nn.Module] | None = None
        self.backward: str | None = None        # the module whose backward began last
        self.hooked: dict[int, weakref.ref[torch.Tensor]] = {}  # outputs given a gradient hook
        self.handles: list[RemovableHandle] = []
        self.late: dict[int, RemovableHandle] = {}  # token -> a module's own late hook
        self.tokens = 0

    def install(self) -> None:
        self.users += 1
        if self.users > 1:
            return
        pre, post = functools.partial(_Modules._pre, self), functools.partial(_Modules._post, self)
        for hook in (pre, post):
            setattr(hook, compat.OBSERVER_HOOK, True)  # reads no tensor: safe on a region's fake run
        self.handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                        nn.modules.module.register_module_forward_hook(post, always_call=True)]

    def uninstall(self) -> None:
        self.users -= 1
        if self.users:
            return
        for h in [*self.handles, *self.late.values()]:
            h.remove()
        self._reset()  # forget every name and entry

    def path(self, m: nn.Module) -> str | None:
        """``m``'s path from the root the names were given from ('' for the root; None: unnamed)."""
        root = self.root() if self.root is not None else None
        return "" if root is m else self.names.get(m)

    def current(self) -> str | None:
        if self.stack:
            return self.stack[-1][1]  # type: ignore[no-any-return]
        return self.backward if self.backward is not None and compat.in_backward() else None

    def _name(self, m: nn.Module) -> str:
        name = self.names.get(m)
        if name is None:
            if not self.rooted and not self.stack:  # the first root: every module below it by its path
                self.rooted = True
                self.root = weakref.ref(m)
                for path, sub in m.named_modules():
                    self.names.setdefault(sub, path or type(m).__name__)
                name = self.names[m]
            else:
                name = type(m).__name__
        return name

    def _pre(self, m: nn.Module, args: Any) -> None:
        if not self.stack:  # a forward from the top: a new step
            self.backward = None
            self.hooked.clear()
        token = None
        if compat.module_hooks(m)[1]:  # its own hooks run after ours: the entry closes after them
            self.tokens += 1
            token = self.tokens
            self.late[token] = m.register_forward_hook(functools.partial(self._late, token))
        self.stack.append([id(m), self._name(m), token])

    def _post(self, m: nn.Module, args: Any, out: Any) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == id(m):
                if self.stack[i][2] is None:  # (else its late hook closes it)
                    self._close(i, out)
                return

    def _late(self, token: int, m: nn.Module, args: Any, out: Any) -> None:
        handle = self.late.pop(token, None)
        if handle is not None:
            handle.remove()  # (torch iterates a copy of the module's hooks)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][2] == token:
                self._close(i, out)
                return

    def _close(self, i: int, out: Any) -> None:
        """Close entry ``i`` (and any left above it by an exception); hook the outputs."""
        name = self.stack[i][1]
        del self.stack[i:]
        if not torch.is_grad_enabled():
            return
        for t in out if isinstance(out, (tuple, list)) else out.values() if isinstance(out, dict) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad and not compat.is_fake(t):
                seen = self.hooked.get(id(t))
                if seen is None or seen() is not t:  # the innermost module's hook comes first
                    self.hooked[id(t)] = weakref.ref(t)
                    t.register_hook(functools.partial(_backward_began, self, name))


def _backward_began(modules: _Modules, name: str, grad: torch.Tensor) -> None:
    """An output's gradient arrived: module ``name``'s backward runs (the gradient is unchanged)."""
    modules.backward = name


_MODULES = _Modules()


# ---- the time ----------------------------------------------------------------------------------
class _Timed:
    """One collective call: what it records waits for its end, which gives the time (an inner call,
    ``all_reduce`` starting one, passes its records out)."""

    __slots__ = ("start", "pending")

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        self.pending: list[_Fields] = []
        _FRAMES.append(self)

    def __exit__(self, *exc: object) -> None:
        _FRAMES.pop()
        if _FRAMES:
            _FRAMES[-1].pending.extend(self.pending)
            return
        seconds = time.perf_counter() - self.start
        for fields in self.pending:
            _add(CommRecord(*fields, seconds=seconds))


_FRAMES: list[_Timed] = []
_UNTIMED = contextlib.nullcontext()


def timed() -> Any:
    """The context ``comm`` runs a collective call in: its records get the call's wall time."""
    return _Timed() if _ACTIVE else _UNTIMED


def _add(rec: CommRecord) -> None:
    first = 0
    for k, mode in enumerate(_ACTIVE):  # the innermost isolated mode hides the record from those outside it
        if mode.isolated:
            first = k
    for mode in _ACTIVE[first:]:
        mode.records.append(rec)


_PAUSED = [0]  # > 0 while control messages run (``unrecorded``)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Collectives issued inside are control messages (the SPMD agreement checks), not the
    program's communication: ``CommDebugMode`` does not record them."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def record(kind: str, mesh: Any, axis: int | None, group: tuple[int, ...], sent: int, recv: int) -> None:
    """Note a collective for the active modes (at the end of its ``timed`` call, if any)."""
    if _ACTIVE and not _PAUSED[0]:
        fields: _Fields = (kind, mesh, axis, tuple(group), compat.whole(sent), compat.whole(recv), _MODULES.current(),
                           str(_OPS[-1]) if _OPS else None)
        if _FRAMES:
            _FRAMES[-1].pending.append(fields)
        else:
            _add(CommRecord(*fields))


def replay(records: list[CommRecord] | tuple[CommRecord, ...], within: nn.Module | None = None) -> None:
    """Record again collectives a captured program issues when it replays (static mode).
    ``within``: the program is this module's call (``named_within``): its records' module names
    are paths from it, joined here to the module's own name."""
    if _ACTIVE:
        if within is not None:
            where = _MODULES.path(within)
            records = [replace(r, module=_joined(where, r.module)) for r in records]
        for mode in _ACTIVE:
            mode.records.extend(records)


def _joined(where: str | None, path: str | None) -> str | None:
    if not where:
        return path or where
    return f"{where}.{path}" if path else where


@contextlib.contextmanager
def named_within(root: nn.Module) -> Iterator[None]:
    """While a call of ``root`` is captured: collectives are attributed to ``root``'s submodules
    by their paths from it ('' for ``root`` itself; ``replay(..., within=True)`` joins them to
    where the program runs)."""
    global _MODULES
    outer, inner = _MODULES, _Modules()
    for path, sub in root.named_modules():
        inner.names[sub] = path
    inner.rooted, inner.root = True, weakref.ref(root)
    inner.stack.append([id(root), "", None])
    _MODULES = inner
    inner.install()
    try:
        yield
    finally:
        inner.uninstall()
        _MODULES = outer
