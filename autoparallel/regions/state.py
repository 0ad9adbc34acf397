"""The modules' own state around a local region's first call: what a signature reads of it, and
what each run of the forward (trace, replay) starts from. See ``autoparallel.regions``."""

from __future__ import annotations

import dis
import functools
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.engine.dtensor import DistTensor


class State:
    """The modules' own state at one moment: each one's buffer slots, the values of its plain
    tensor buffers (a step counter written in place) and its plain attribute values. A first
    call runs the forward more than once (trace, replay): each run starts from the same state,
    and what the trace wrote is what stands."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.buffers = [dict(compat.own_buffers(m)) for m in modules]
        self.values = [compat.module_values(m) for m in modules]
        with torch.no_grad():
            self.plain = [(t, t.clone()) for own in self.buffers for t in own.values()
                          if isinstance(t, torch.Tensor) and not isinstance(t, DistTensor)]

    def assigned(self) -> str:
        """Why a region cannot run the forward: it assigned a buffer of a module ('' when it did
        not): a local run would put a shard in the buffer."""
        for m, own in zip(self.modules, self.buffers):
            for name, t in compat.own_buffers(m).items():
                if own.get(name) is not t:
                    return f"its forward assigns the buffer {type(m).__name__}.{name}"
        return ""

    def rewind(self) -> State:
        """Put this state back; returns the state it replaced."""
        now = State(self.modules)
        with torch.no_grad():
            for m, own, values in zip(self.modules, self.buffers, self.values):
                slots = compat.own_buffers(m)
                slots.clear()
                slots.update(own)
                m.__dict__.update(values)
            for t, value in self.plain:
                t.copy_(value)
        return now


def read_values(m: nn.Module) -> tuple[tuple[str, Any], ...]:
    """The plain attribute values of ``m`` a signature includes (``compat.module_values``): those
    its forward does not set itself (a length or a counter it keeps is its output, not its input)."""
    stored = _stored_names(getattr(type(m).forward, "__code__", None))
    return tuple(kv for kv in compat.module_values(m) if kv[0] not in stored)


@functools.lru_cache(maxsize=1024)
def _stored_names(code: Any) -> frozenset[str]:
    """The attribute names a function's code assigns (``self.length = ...``, ``self.calls += 1``)."""
    if code is None:
        return frozenset()
    return frozenset(str(i.argval) for i in dis.get_instructions(code) if i.opname in ("STORE_ATTR", "DELETE_ATTR"))
