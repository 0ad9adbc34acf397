"""Deferred statistics: a small all-reduce started in the forward and waited on only when needed.

The mean of a loss over a batch split across ranks divides the global sum by a global count
(``ignore_index`` and class weights make the count data-dependent), so it needs an all-reduce.
Waiting for it inside the forward puts a synchronisation point between forward and backward.
Instead, a local implementation allowed to (``LocalContext.may_defer``: the dispatcher sets it
in a differentiable forward, outside local-region traces) may *start* the all-reduce (``Stat``)
and return placeholders registered with ``defer``: the dispatcher turns its outputs into pending DistTensors
(``autoparallel.pending``) whose value is computed from the reduced statistic on first use.
The backward, which is linear in the incoming gradient, then runs on unscaled gradients and
applies the scale where it is cheapest (the optimizer's bucketed reduction), long after the
all-reduce has finished.

No rank ever waits on a collective the others did not start: every member starts the
all-reduce in the same forward op, so a value read on one rank only (``if rank == 0:
print(loss.item())``) cannot hang. This module holds no tensor subclass (the rules import it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autoparallel import comm

# id(placeholder) -> (placeholder, stat, finish): local outputs of the op now running whose value
# is ``finish(placeholder, stat)``; the dispatcher claims them when it wraps outputs.
FRESH: dict[int, tuple[torch.Tensor, "Stat", Callable[[torch.Tensor, "Stat"], torch.Tensor]]] = {}
# Set by ``autoparallel.pending`` at import (it defines the pending tensor class, which this
# module and the dispatcher cannot import): turns the wrapped outputs claimed in FRESH pending.
ADOPT: list[Callable[[list[Any]], list[Any]]] = []


class Stat:
    """``local`` summed over one mesh axis, in flight; ``result()`` waits once and returns it."""

    __slots__ = ("_buf", "_work", "_scale")

    def __init__(self, local: torch.Tensor, mesh: Any, axis: int) -> None:
        self._buf, self._work = comm.all_reduce_start(local, mesh, axis)
        self._scale: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()  # type: ignore[attr-defined]
            self._work = None
        return self._buf

    def inverse_count(self) -> torch.Tensor:
        """``1 / total`` for a (sum, total) statistic, 0 where the total is 0 (nothing counted:
        the unscaled gradient is zero, as one device's is)."""
        if self._scale is None:
            total = self.result()[1]
            self._scale = torch.where(total != 0, 1 / total, torch.zeros_like(total))
        return self._scale


def defer(placeholder: torch.Tensor, stat: Stat, finish: Callable[[torch.Tensor, Stat], torch.Tensor]) -> torch.Tensor:
    """Register ``placeholder`` (an output of the running local implementation) as pending:
    its value is ``finish(placeholder, stat)``, computed on first use."""
    FRESH[id(placeholder)] = (placeholder, stat, finish)
    return placeholder
