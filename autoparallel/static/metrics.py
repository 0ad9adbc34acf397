"""``ap.metrics``: Paddle's metric protocol for ``ap.Engine``, counted over the global batch.

A metric has ``compute(pred, label)`` (per batch, on DistTensors: what ``update`` needs),
``update(*computed)`` (adds a batch, returns its value), ``accumulate()`` (the value over the
batches since ``reset()``) and ``name()`` (a list with one name per value). The counts are
DistTensor reductions made whole with ``full_tensor()``: a batch split across data-parallel
ranks is counted once, as one process counts it, and every rank gets the same numbers. Any
callable ``(outputs, labels) -> dict`` may stand in for a metric (``ap.Engine`` reports its
values per batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.engine.dtensor import DistTensor


def whole(t: Any) -> Any:
    """``t`` as a plain tensor of its global value (a DistTensor gathered), anything else as is."""
    return t.full_tensor() if isinstance(t, DistTensor) else t


class Metric:
    """Base class of Paddle-style metrics (``compute`` is optional: it defaults to passing through)."""

    def compute(self, pred: torch.Tensor, label: torch.Tensor, *args: Any) -> Any:
        return pred, label, *args

    def update(self, *args: Any) -> Any:
        raise NotImplementedError

    def accumulate(self) -> float | list[float]:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def name(self) -> list[str]:
        raise NotImplementedError


class Accuracy(Metric):
    """Top-k accuracy: the fraction of samples whose label is among the ``k`` largest scores.

    ``topk``: one or more k; ``name()`` is ``["acc"]`` for ``topk=(1,)`` and
    ``["acc_top1", "acc_top5"]`` for ``topk=(1, 5)`` (Paddle's names). ``pred``: scores of shape
    ``[batch, classes]``; ``label``: class indices of shape ``[batch]`` or ``[batch, 1]``.
    """

    def __init__(self, topk: Sequence[int] = (1,), name: str | None = None) -> None:
        ks = tuple(topk) if isinstance(topk, (list, tuple)) else (topk,)
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
            raise ValueError(f"Accuracy: topk must be positive ints, got {topk!r}")
        self.topk = ks
        self.maxk = max(ks)
        base = name or "acc"
        self._names = [f"{base}_top{k}" for k in ks] if self.maxk != 1 else [base]
        self.reset()

    def compute(self, pred: torch.Tensor, label: torch.Tensor, *args: Any) -> torch.Tensor:
        """``[batch, maxk]`` of 0/1: whether the i-th largest score of a sample is its label."""
        if pred.dim() != 2:
            raise ValueError(f"Accuracy: pred must be [batch, classes], got shape {tuple(pred.shape)}")
        if pred.shape[1] < self.maxk:
            raise ValueError(f"Accuracy: topk {self.topk} needs at least {self.maxk} classes, "
                             f"pred has {pred.shape[1]}")
        if label.dim() == 2 and label.shape[1] == 1:
            label = label.reshape(-1)
        if label.dim() != 1 or label.shape[0] != pred.shape[0]:
            raise ValueError(f"Accuracy: label must be [batch] or [batch, 1] for pred of shape "
                             f"{tuple(pred.shape)}, got shape {tuple(label.shape)}")
        top = pred.detach().topk(self.maxk, dim=1).indices        # [batch, maxk]
        return (top == label.unsqueeze(1)).to(torch.float32)     # [batch, maxk]

    def update(self, correct: torch.Tensor, *args: Any) -> float | list[float]:
        """Add a batch's ``compute`` result; return its accuracy (a list for several k)."""
        hits = whole(correct.sum(dim=0)).cumsum(0)               # [maxk]: hits within the top i+1
        n = int(correct.shape[0])
        accs = [float(hits[k - 1]) / max(n, 1) for k in self.topk]
        for i, k in enumerate(self.topk):
            self.total[i] += float(hits[k - 1])
        self.count += n
        return accs[0] if len(accs) == 1 else accs

    def accumulate(self) -> float | list[float]:
        accs = [t / self.count if self.count else 0.0 for t in self.total]
        return accs[0] if len(accs) == 1 else accs

    def reset(self) -> None:
        self.total = [0.0] * len(self.topk)
        self.count = 0

    def name(self) -> list[str]:
        return list(self._names)


__all__ = ["Accuracy", "Metric", "whole"]
