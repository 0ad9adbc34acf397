"""Flatten a nested state dict into ``{key: leaf}`` and write loaded values back (pure).

Containers are mappings (str/int keys), lists and tuples; leaves are tensors (plain or
``DistTensor``) or plain values (``None``, ``bool``, ``int``, ``float``, ``str``). A leaf's key
joins its path with dots: ``{"optim": {"state": {0: {"step": t}}}}`` -> ``"optim.state.0.step"``.
Anything else raises ``TypeError`` naming the key, so a state dict either round-trips or fails
before any file is written.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch

Value = None | bool | int | float | str
VALUE_TYPES = (type(None), bool, int, float, str)


def _child_key(prefix: str, k: object, where: str) -> str:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise TypeError(f"{where}: key {k!r} under {prefix or 'the top level'!r} is a "
                        f"{type(k).__name__}; state dict keys must be str or int")
    return f"{prefix}.{k}" if prefix else str(k)


def flatten(state_dict: Any, where: str) -> dict[str, Any]:
    """``{dotted key: leaf}`` in traversal order; raises on unsupported keys, leaves, or clashes."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where}: state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Any] = {}

    def visit(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor) or isinstance(obj, VALUE_TYPES):
            if key in out:
                raise ValueError(f"{where}: two entries flatten to the same key {key!r}; "
                                 "rename one (keys are joined with '.')")
            out[key] = obj
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                visit(v, _child_key(key, k, where))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, _child_key(key, i, where))
        else:
            raise TypeError(f"{where}: {key!r} is a {type(obj).__name__}; a state dict may hold "
                            "tensors, None, bool, int, float, str and dicts/lists/tuples of them")

    visit(state_dict, "")
    return out


def replace_values(state_dict: MutableMapping[str, Any], new: Callable[[str, Any], Any]) -> None:
    """Set every leaf to ``new(key, leaf)`` in place (tuples are rebuilt inside their parent)."""

    def visit(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor) or isinstance(obj, VALUE_TYPES):
            return new(key, obj)
        if isinstance(obj, MutableMapping):
            for k in list(obj):
                obj[k] = visit(obj[k], _child_key(key, k, "load"))
            return obj
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                obj[i] = visit(v, _child_key(key, i, "load"))
            return obj
        if isinstance(obj, tuple):
            items = [visit(v, _child_key(key, i, "load")) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return obj

    visit(state_dict, "")


def map_leaves(obj: Any, fn: Callable[[str, Any], Any], key: str = "") -> Any:
    """A copy of the nested containers of ``obj`` with every leaf replaced by ``fn(key, leaf)``."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, VALUE_TYPES):
        return fn(key, obj)
    if isinstance(obj, Mapping):
        return {k: map_leaves(v, fn, _child_key(key, k, "map")) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [map_leaves(v, fn, _child_key(key, i, "map")) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj
