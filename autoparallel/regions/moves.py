"""A parallel style's moves inside a local region: the door ``nn.layout.to_layout`` goes through.

The styles (``ColWiseParallel``, ``RowWiseParallel``, ``PrepareModuleInput``, ...) lay a
module's activations out with forward hooks that call ``to_layout``. A module holding styled
submodules (an MLP of a column- and a row-parallel Linear, an attention block) runs those hooks
inside its forward. While a local region traces such a module or runs it on shards, every such
move goes through the region's door (``opened``):

* in a **trace** (on DistTensors) the move is made and noted (``Traced``). One that moves
  nothing (the value already has the layout: a column-parallel input hook under plain TP) may
  stand anywhere. One that moves one of the module's arguments is a *prologue* (the
  sequence-parallel all-gather at the start of an attention block): the local run gets that
  argument moved (every read of it sees it so; the replay finds any op that read it before the
  move: its local call differs). One that moves other data may only lay out a value the module
  returns, after its last op: an *epilogue* (the row-parallel projection's all-reduce or
  reduce-scatter at the end of an MLP or attention block). The region makes both itself, on
  DistTensors, with their usual autograd, and runs the module locally in between.
* in a **local run** (on shards, or fake tensors) the hook meets the plain shard and gets it back
  as it is (``Local``): a move that moved nothing leaves it so, and an epilogue is the region's.

Anything else (a style laying out a plain tensor inside a trace, or a DistTensor inside a local
run) is noted, and the trace refuses the region / the local run is not trusted.

A third door, ``Whole``, is for running a model as one device would (``ap.auto_parallel`` records
the step on whole fake tensors): every move hands its value back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autoparallel import compat
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.spec import DistSpec

Run = Callable[[Any], Any]
_DOORS: list[Any] = []  # the innermost open door last: entered and left only through ``opened``
_STYLE = "_ap_style_hook"


def style_hook(hook: Any) -> Any:
    """Mark ``hook`` as a style's: it changes nothing but through ``move`` (and may raise on
    sizes), so a local region's fake run may call it (``regions.symbolic``)."""
    setattr(hook, _STYLE, True)
    return hook


def foreign_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a forward (pre-)hook that is not a style's and not quiet now
    (``compat.QuietHook``)."""
    return any(not getattr(h, _STYLE, False) and not compat.quiet_hook(h, module)
               for h in compat.forward_hook_fns(module))


def current() -> Any:
    """The innermost open door (its ``move(x, run)`` makes a style's move of ``x``), or None."""
    return _DOORS[-1] if _DOORS else None


@contextmanager
def opened(door: Any) -> Iterator[Any]:
    """Inside the block every style move goes through ``door.move(x, run)``."""
    _DOORS.append(door)
    try:
        yield door
    finally:
        _DOORS.pop()


class Traced:
    """A trace's door: each move made and noted.

    ``moved``: per data-moving move, (the value before, the value after); ``calls``: how many
    moves the module made (a local run must make as many); ``comm``: how many of the
    trace's communication records the moves made; ``ops_before``: how many aten calls the trace
    had recorded at its first data-moving move (none may follow it); ``reason``: the first
    reason to refuse.
    """

    def __init__(self, trace: Any, records: Callable[[], int], leaves: list[Any]) -> None:
        self.trace, self.records = trace, records
        self.moved: list[tuple[DistTensor, DistTensor]] = []
        self.calls = self.comm = 0
        self.ops_before: int | None = None
        self.reason = ""
        # prologues: the module's DistTensor arguments (id -> leaf index) and, per leaf moved,
        # the first value it was moved to (every move of it must go to that layout)
        self.args = {id(x): k for k, x in enumerate(leaves) if isinstance(x, DistTensor)}
        self.prologue: dict[int, DistTensor] = {}
        self.moved_args: set[int] = set()

    def move(self, x: Any, run: Run) -> Any:
        self.calls += 1
        if not isinstance(x, DistTensor):
            if isinstance(x, torch.Tensor):
                self.reason = self.reason or "a parallel style lays out a plain tensor inside it"
            return run(x)
        before, quiet = self.records(), self.trace.quiet
        self.trace.quiet = True  # the move's local calls are not the module's own
        try:
            y = run(x)
        finally:
            self.trace.quiet = quiet
        self.comm += self.records() - before
        if y is x:
            return y
        k = self.args.get(id(x))
        if k is not None:  # an argument: a prologue (the local run gets it moved)
            self.moved_args.add(id(x))
            first = self.prologue.setdefault(k, y)
            if layout.spec_of(first) != layout.spec_of(y):
                self.reason = self.reason or "parallel styles move an argument to two layouts"
            return y
        if self.ops_before is None:
            self.ops_before = len(self.trace.ops)
        self.moved.append((x, y))
        return y

    def arguments(self, leaves: list[Any]) -> tuple[list[Any], tuple[DistSpec | None, ...], list[Any] | None]:
        """(the arguments as the local run gets them: each moved one as the trace moved it, per
        leaf the layout its prologue moves it to (None: not moved), per leaf the trace's moved
        value (None where not moved), or None where nothing was moved)."""
        if not self.prologue:
            return leaves, (), None
        done = [self.prologue.get(k) for k in range(len(leaves))]
        return ([x if d is None else d for x, d in zip(leaves, done)],
                tuple(None if d is None else layout.spec_of(d) for d in done), done)

    def epilogue(self, outs: list[Any]) -> tuple[str, list[Any], tuple[DistSpec | None, ...]]:
        """(why the moves cannot stand around the local run ('' when they can), the output leaves
        before their moves, per output leaf the layout it is moved to (None: not moved))."""
        if not self.reason and self.moved_args & self.trace.reads:
            # (on shards it would read the moved argument: another value, perhaps of the same shape)
            self.reason = "an op reads an argument a parallel style moves"
        if self.reason or not self.moved:
            return self.reason, outs, ()
        if self.ops_before != len(self.trace.ops):
            return "a parallel style moves data before its last op", outs, ()
        at = {id(o): k for k, o in enumerate(outs)}
        before = list(outs)
        moves: list[DistSpec | None] = [None] * len(outs)
        for x, y in self.moved:
            k = at.get(id(y))
            if k is None or moves[k] is not None:
                return "a parallel style moves data it does not return", outs, ()
            if id(x) in at:
                return "it returns a value both before and after a parallel style moves it", outs, ()
            before[k], moves[k] = x, layout.spec_of(y)
        return "", before, tuple(moves)


class Local:
    """A local run's door: a style's move hands the shard back as it is (``calls`` counted;
    ``reason`` where a DistTensor met a style, which a local run never holds)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected  # the moves the trace made
        self.calls = 0
        self.reason = ""

    def move(self, x: Any, run: Run) -> Any:
        self.calls += 1
        if isinstance(x, DistTensor):
            self.reason = self.reason or "a parallel style meets a DistTensor on local tensors"
            return run(x)
        return x

    def why(self) -> str:
        """Why the run did not move as traced ('' when it did)."""
        if self.reason or self.calls == self.expected:
            return self.reason
        return f"its parallel styles move {self.calls} times on local tensors, not {self.expected}"


class Whole:
    """A door for running a model as one device would (``ap.auto_parallel`` recording its step
    on whole fake tensors): a style's move changes no value, so it hands the tensor back as it is."""

    def move(self, x: Any, run: Run) -> Any:
        return x


def remake(x: DistTensor, dst: DistSpec, done: DistTensor | None) -> DistTensor:
    """A style's move of ``x`` to ``dst`` (the layout noted at a proven length, at ``x``'s shape),
    differentiable; ``done``: that move already made by the trace (taken, nothing moves again)."""
    spec = layout.spec_of(x)
    if dst.shape != spec.shape or dst.dtype != spec.dtype:  # (a layout noted on a view of ``x``, or on a value made from it)
        dst = DistSpec(dst.mesh, dst.placements, spec.shape, spec.dtype, dst.shard_order)
    return layout.reshard(x, dst, done)
