"""Repeated blocks recorded twice, not N times: a deep model's step from two and three of its blocks.

A transformer is a stack of N identical blocks (``model.layers``, ``transformer.h``, ``blocks``).
Recording all N costs time in proportion to N (Llama-3 70B: 80 blocks), although every block
after the first asks the same questions. ``record(model, example, loss)`` records the step with
the stack cut to its first two blocks and to its first three; their difference is one middle
block, so the N-block step's totals are ``two + (N - 2) x (three - two)``: FLOPs, bytes, saved
activations, ops and collectives (``Recording.simulate``), and the peak of live bytes (which a
stack of blocks reaches where the forward turns into the backward, holding every block's saved
tensors), and the parameters, gradients and
block inputs of the blocks not recorded stand in for those of the middle block
(``Recording.step``). This is exact when the blocks are identical (same class, same parameters'
names, shapes and types, no parameter shared with another block), which is checked; otherwise,
or when the cut model cannot run, every block is recorded.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autoparallel import compat
from autoparallel.auto.simulate import Collective, Part, Simulation, simulate
from autoparallel.auto.trace import Step, trace_step
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Placement

MIN_BLOCKS = 4  # fewer blocks: recording two and three of them saves nothing


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(qualified name, length) of the longest ``nn.ModuleList`` of identical blocks (see the
    module docstring), or None."""
    best: tuple[str, int] | None = None
    owners: dict[int, int] = {}  # parameter id -> how many blocks hold it
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < MIN_BLOCKS or (best is not None and len(m) <= best[1]):
            continue
        if len({signature(b) for b in m}) != 1:
            continue
        owners.clear()
        for b in m:
            for p in b.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                   if not n.startswith(f"{name}.")} if name else set()
        if any(c > 1 for c in owners.values()) or outside & owners.keys():
            continue  # a parameter shared between blocks (or with the rest): not independent copies
        best = (name, len(m))
    return best


def signature(block: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks copies of each other: class, parameter and buffer shapes, submodule classes."""
    return (type(block),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
            tuple((n, type(c)) for n, c in block.named_modules()))


@contextlib.contextmanager
def cut(model: nn.Module, name: str, keep: int) -> Iterator[None]:
    """``model`` with its block list ``name`` holding its first ``keep`` blocks (put back after)."""
    blocks = model.get_submodule(name)
    whole = compat.child_modules(blocks)
    compat.set_child_modules(blocks, dict(list(whole.items())[:keep]))
    try:
        yield
    finally:
        compat.set_child_modules(blocks, whole)


@dataclass
class Recording:
    """The step of the whole model, recorded whole or as two and three blocks (``record``)."""

    step: Step                     # for pricing: every parameter, gradient and block of the model
    short: Step                    # a step with every kind of op and module (the whole one, or three blocks)
    two: Step | None = None        # the cut recordings (None: recorded whole)
    blocks: int = 0                # N, when cut
    prefix: str = ""

    def simulate(self, mesh: ProcessMesh, param_placements: Mapping[str, tuple[Placement, ...]],
                 input_placements: Any, io: Any = None, axis: int = 0,
                 memo: dict[Any, Any] | None = None) -> Simulation:
        """``simulate`` of the whole step (see the module docstring for the cut case)."""
        if self.two is None:
            return simulate(self.step, mesh, param_placements, input_placements, io, axis, memo)
        a = simulate(self.two, mesh, param_placements, input_placements, io, axis, memo)
        b = simulate(self.short, mesh, param_placements, input_placements, io, axis, memo)
        k = self.blocks - 3  # blocks beyond the three recorded, each like b's middle one
        per_block = Counter(self._kind(c) for c in b.collectives) - Counter(self._kind(c) for c in a.collectives)
        extra = [c for c, n in sorted(per_block.items(), key=repr) for _ in range(n * k)]
        return replace(b, collectives=b.collectives + extra,
                       flops=b.flops + k * (b.flops - a.flops),
                       forward_flops=b.forward_flops + k * (b.forward_flops - a.forward_flops),
                       touched_bytes=b.touched_bytes + k * (b.touched_bytes - a.touched_bytes),
                       saved_bytes=b.saved_bytes + k * (b.saved_bytes - a.saved_bytes),
                       ops=b.ops + k * (b.ops - a.ops),
                       live_peak=b.live_peak + k * (b.live_peak - a.live_peak),
                       live_peak_recompute=b.live_peak_recompute + k * (b.live_peak_recompute - a.live_peak_recompute),
                       parts=self._parts(b))

    def _parts(self, three: Simulation) -> dict[str, Part]:
        """The N-block step's parts from three blocks': the first and the last block as recorded,
        every block between like the middle one (in forward order)."""
        p = self.prefix
        out: dict[str, Part] = {}
        for name, part in three.parts.items():
            if name == f"{p}.1":
                out.update({f"{p}.{i}": part for i in range(1, self.blocks - 1)})
            elif name == f"{p}.2":
                out[f"{p}.{self.blocks - 1}"] = part
            else:
                out[name] = part
        return out

    def _kind(self, c: Collective) -> Collective:
        """``c`` with its block's index made ``*`` (block 1 of two and block 2 of three are alike)."""
        head = f"{re.escape(self.prefix)}\\." if self.prefix else ""
        return replace(c, module=re.sub(rf"^({head})\d+(?=\.|$)", r"\1*", c.module))


def record(model: nn.Module, example: Any, loss: Callable[..., Any] | None = None, extrapolate: bool = True) -> Recording:
    """Record ``model``'s step on ``example`` (``trace_step``), from two and three of its repeated
    blocks when it has identical ones and ``extrapolate`` (see the module docstring)."""
    found = repeated_blocks(model) if extrapolate else None
    if found is not None:
        name, n = found
        try:
            with cut(model, name, 2):
                two = trace_step(model, example, loss)
            with cut(model, name, 3):
                three = trace_step(model, example, loss)
        except ValueError:
            pass  # the cut model does not run (a forward that counts its blocks): record it whole
        else:
            return Recording(widen(three, name, n), three, two, n, name)
    step = trace_step(model, example, loss)
    return Recording(step, step)


def widen(three: Step, prefix: str, n: int) -> Step:
    """The step of three blocks with blocks 3 .. n-1 added as copies of block 1 (the middle one):
    their parameters, gradients, modules and block inputs name block 1's tensors. Its ops are
    three blocks' (replay ``Recording.simulate``, not this step)."""
    middle = f"{prefix}.1"

    def renamed(names: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(names)
        for i in range(3, n):
            for key, value in names.items():
                if key == middle or key.startswith(f"{middle}."):
                    out[f"{prefix}.{i}{key[len(middle):]}"] = value
        return out

    return replace(three, params=renamed(three.params), grads=renamed(three.grads),
                   modules=renamed(three.modules), module_inputs=renamed(three.module_inputs))
