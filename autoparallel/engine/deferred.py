"""Deferred statistics: a small all-reduce started in the forward and waited on only when needed.

The mean of a loss over a batch split across ranks divides the global sum by a global count
(``ignore_index`` and class weights make the count data-dependent), so it needs an all-reduce.
Waiting for it inside the forward puts a synchronisation point between forward and backward.
Instead, a kernel allowed to (``LocalContext.may_defer``: the engine sets it in a
differentiable forward, outside observed runs such as a local region's trace) *starts* the
all-reduce (``ctx.comm.start_sum`` -> ``Stat``) and returns ``Deferred`` values in place of
outputs: the engine wraps each as a pending DistTensor (``PendingTensor`` in
``autoparallel.engine.dtensor``) whose value is ``finish(placeholder, stat)``, computed on first
use. The backward, which is linear in the incoming gradient, then runs on unscaled gradients
and applies the scale where it is cheapest (the optimizer's bucketed reduction), long after the
all-reduce has finished.

No rank ever waits on a collective the others did not start: every member starts the
all-reduce in the same forward op, so a value read on one rank only (``if rank == 0:
print(loss.item())``) cannot hang. Both classes are plain values: nothing here issues a
collective or knows the tensor subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Stat:
    """A statistic in flight: an all-reduced buffer and its pending work; ``result()`` waits
    once and returns it."""

    __slots__ = ("_buf", "_work", "_scale")

    def __init__(self, buf: torch.Tensor, work: Any) -> None:
        self._buf, self._work = buf, work
        self._scale: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._buf

    def inverse_count(self) -> torch.Tensor:
        """``1 / total`` for a (sum, total) statistic, 0 where the total is 0 (nothing counted:
        the unscaled gradient is zero, as one device's is)."""
        if self._scale is None:
            total = self.result()[1]
            self._scale = torch.where(total != 0, 1 / total, torch.zeros_like(total))
        return self._scale


Finish = Callable[[torch.Tensor, Stat], torch.Tensor]


class Deferred:
    """What a kernel returns in place of an output whose value waits on ``stat``: the value is
    ``finish(placeholder, stat)``; ``placeholder`` is a local tensor of the output's local
    shape and dtype (its contents are not read before ``finish``)."""

    __slots__ = ("placeholder", "stat", "finish")

    def __init__(self, placeholder: torch.Tensor, stat: Stat, finish: Finish) -> None:
        self.placeholder, self.stat, self.finish = placeholder, stat, finish


def split_deferred(out: Any) -> tuple[Any, tuple[Deferred | None, ...]]:
    """A kernel's result with each ``Deferred`` replaced by its placeholder, and per output the
    ``Deferred`` it was (None: an ordinary output); no ``Deferred`` -> ``(out, ())``."""
    if type(out) is Deferred:
        return out.placeholder, (out,)
    if isinstance(out, (tuple, list)) and any(type(o) is Deferred for o in out):
        marks = tuple(o if type(o) is Deferred else None for o in out)
        plain = [o.placeholder if type(o) is Deferred else o for o in out]
        return (tuple(plain) if isinstance(out, tuple) else plain), marks
    return out, ()
