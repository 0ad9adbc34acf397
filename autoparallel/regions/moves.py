"""A parallel style's moves: the door ``nn.layout.to_layout`` goes through, and the marks of the
styles' hooks.

The styles (``ColWiseParallel``, ``RowWiseParallel``, ``PrepareModuleInput``, ...) lay a
module's activations out with forward hooks that call ``to_layout``. Their hooks are marked
(``style_hook``): they change nothing but through such a move, so a module holding styled
submodules may be captured as one program (``regions.program``), the moves part of it. Any other
forward hook on a submodule that is not quiet now (``compat.QuietHook``) keeps the module from
being captured: it would run at the capture only (``foreign_hooks``).

While a door is open (``opened``) every style move goes through ``door.move(x, run)``. One door
is defined here: ``Whole``, for running a model as one device would (``ap.auto_parallel`` records
the step on whole fake tensors): every move hands its value back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autoparallel import compat

Run = Callable[[Any], Any]
_DOORS: list[Any] = []  # the innermost open door last: entered and left only through ``opened``
_STYLE = "_ap_style_hook"
_KEY = "_ap_style_key"


def style_hook(hook: Any, key: Hashable = None) -> Any:
    """Mark ``hook`` as a style's: it changes nothing but through ``to_layout`` (and may raise on
    sizes), so a captured program of a module around it holds its moves. ``key``: what the hook
    does, from metadata (its kind, layouts, mesh and axis; not its module's name): modules whose
    hooks have equal keys may share one captured program (``style_key``); None: they do not."""
    setattr(hook, _STYLE, True)
    if key is not None:
        setattr(hook, _KEY, key)
    return hook


def style_key(hook: Any) -> Hashable:
    """The key a style's hook was marked with (``style_hook``), or None."""
    return getattr(hook, _KEY, None)


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


class Whole:
    """A door for running a model as one device would (``ap.auto_parallel`` recording its step
    on whole fake tensors): a style's move changes no value, so it hands the tensor back as it is."""

    def move(self, x: Any, run: Run) -> Any:
        return x


__all__ = ["Whole", "current", "foreign_hooks", "opened", "style_hook", "style_key"]
