"""Slots: where the DistTensors sit in an op's ``(args, kwargs)``, putting local shards there, and
the shape of a result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoparallel.engine.decision import OutKind


def map_args(cls: Any, items: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(items, dict):
        return {k: map_args(cls, v, fn) for k, v in items.items()}
    if isinstance(items, cls):
        return fn(items)
    if isinstance(items, (list, tuple)):
        mapped = [map_args(cls, a, fn) for a in items]
        return type(items)(mapped) if isinstance(items, tuple) else mapped
    if isinstance(items, torch.Tensor) and items.dim() == 0:
        return fn(items)
    return items


def dist_slots(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Positions of the DistTensors: ``((arg index, k | (k or None per element)), ...)`` for args,
    the same keyed by name for kwargs; None when tensors nest deeper than one list."""
    k = 0

    def walk(items: Any) -> list[tuple[Any, Any]] | None:
        nonlocal k
        out: list[tuple[Any, Any]] = []
        for pos, a in items:
            if isinstance(a, cls):
                out.append((pos, k))
                k += 1
            elif isinstance(a, (list, tuple)) and any(isinstance(x, (cls, list, tuple)) for x in a):
                inner: list[int | None] = []
                for x in a:
                    if isinstance(x, cls):
                        inner.append(k)
                        k += 1
                    elif isinstance(x, (list, tuple)):
                        return None
                    else:
                        inner.append(None)
                out.append((pos, tuple(inner)))
        return out

    a = walk(enumerate(args))
    kw = walk(kwargs.items()) if a is not None else None
    return None if a is None or kw is None else (tuple(a), tuple(kw))


def place_locals(items: Any, slots: Any, locs: list[torch.Tensor]) -> Any:
    """``items`` (a list of args, or a dict of kwargs) with DistTensors swapped for locals."""
    for pos, k in slots:
        if type(k) is int:
            items[pos] = locs[k]
        else:
            seq = items[pos]
            items[pos] = type(seq)(x if j is None else locs[j] for x, j in zip(seq, k))
    return items


def flatten_out(out: Any) -> tuple[OutKind, list[Any]]:
    """The kind of a result and its tensors (None entries kept)."""
    if out is None:
        return OutKind.NONE, []
    if isinstance(out, torch.Tensor):
        return OutKind.TENSOR, [out]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out) and any(
        isinstance(o, torch.Tensor) for o in out
    ):
        return (OutKind.TUPLE if isinstance(out, tuple) else OutKind.LIST), list(out)
    return OutKind.VALUE, []


__all__ = ["dist_slots", "flatten_out", "map_args", "place_locals"]
