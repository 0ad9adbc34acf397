"""Flatten a nested state dict into ``{key: leaf}`` and write loaded values back (pure).

Containers are mappings (str/int keys), lists and tuples. Leaves are tensors (plain or
``DistTensor``) and plain values: ``None``, ``bool``, ``int``, ``float``, ``str``, and any
container holding no tensor at all (``[1.5, 2.0]``, ``{"epoch": 3, "index": 7}``, a param
group), which is stored and restored whole, whatever the target holds there (a list of losses
of any length loads into ``[]``). A leaf's key joins its path with dots:
``{"optim": {"state": {0: {"step": t}}}}`` -> ``"optim.state.0.step"``. Anything else raises
``TypeError`` naming the key, so a state dict either round-trips or fails before any file is
written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

Value = None | bool | int | float | str
VALUE_TYPES = (type(None), bool, int, float, str)


def _child_key(prefix: str, k: object, where: str) -> str:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise TypeError(f"{where}: key {k!r} under {prefix or 'the top level'!r} is a "
                        f"{type(k).__name__}; state dict keys must be str or int")
    return f"{prefix}.{k}" if prefix else str(k)


def is_plain(obj: Any, key: str, where: str) -> bool:
    """True for a plain value or a container of plain values only (raises on unsupported types)."""
    if isinstance(obj, VALUE_TYPES):
        return True
    if isinstance(obj, torch.Tensor):
        return False
    if isinstance(obj, Mapping):
        return all(is_plain(v, _child_key(key, k, where), where) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(is_plain(v, _child_key(key, i, where), where) for i, v in enumerate(obj))
    raise TypeError(f"{where}: {key!r} is a {type(obj).__name__}; a state dict may hold "
                    "tensors, None, bool, int, float, str and dicts/lists/tuples of them")


def _items(obj: Any, key: str, where: str) -> list[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        return [(_child_key(key, k, where), v) for k, v in obj.items()]
    return [(_child_key(key, i, where), v) for i, v in enumerate(obj)]


def flatten(state_dict: Any, where: str) -> dict[str, Any]:
    """``{dotted key: leaf}`` in traversal order; raises on unsupported keys, leaves, or clashes."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where}: state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, Any] = {}
    _flatten_into(out, state_dict, "", where)
    return out


def _flatten_into(out: dict[str, Any], obj: Any, key: str, where: str) -> None:
    """``flatten``'s walk (a module function: a closure calling itself is a reference cycle that
    would keep the whole flattened state dict alive until a full garbage collection)."""
    if isinstance(obj, torch.Tensor) or (key and is_plain(obj, key, where)):
        if key in out:
            raise ValueError(f"{where}: two entries flatten to the same key {key!r}; "
                             "rename one (keys are joined with '.')")
        out[key] = obj
        return
    for k, v in _items(obj, key, where):
        _flatten_into(out, v, k, where)


def replace_values(state_dict: MutableMapping[str, Any], new: Callable[[str, Any], Any]) -> None:
    """Set every leaf to ``new(key, leaf)`` in place (tuples are rebuilt inside their parent)."""
    _replaced(state_dict, "", new)


def _replaced(obj: Any, key: str, new: Callable[[str, Any], Any]) -> Any:
    """``replace_values``' walk (a module function: see ``_flatten_into``)."""
    if isinstance(obj, torch.Tensor) or (key and is_plain(obj, key, "load_state_dict")):
        return new(key, obj)
    if isinstance(obj, MutableMapping):
        for k in list(obj):
            obj[k] = _replaced(obj[k], _child_key(key, k, "load_state_dict"), new)
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = _replaced(v, _child_key(key, i, "load_state_dict"), new)
        return obj
    if isinstance(obj, tuple):
        items = [_replaced(v, _child_key(key, i, "load_state_dict"), new) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def map_leaves(obj: Any, fn: Callable[[str, Any], Any], key: str = "") -> Any:
    """A copy of the nested containers of ``obj`` with every tensor replaced by ``fn(key, tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(key, obj)
    if isinstance(obj, Mapping):
        return {k: map_leaves(v, fn, _child_key(key, k, "map")) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [map_leaves(v, fn, _child_key(key, i, "map")) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


# ---- plain values as JSON (tagged so tuples and int dict keys survive) ------------------------
def encode_value(v: Any) -> Any:
    """A JSON-able form of a plain value: lists stay lists, tuples and dicts become tagged objects."""
    if isinstance(v, VALUE_TYPES):
        return v
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [encode_value(x) for x in v]}
    return {"dict": [[k, encode_value(x)] for k, x in v.items()]}


def decode_value(v: Any, key: str) -> Any:
    """The value ``encode_value`` encoded; ValueError on anything it cannot have produced."""
    if isinstance(v, VALUE_TYPES):
        return v
    if isinstance(v, list):
        return [decode_value(x, key) for x in v]
    if isinstance(v, dict) and len(v) == 1 and isinstance(v.get("tuple"), list):
        return tuple(decode_value(x, key) for x in v["tuple"])
    if isinstance(v, dict) and len(v) == 1 and isinstance(v.get("dict"), list):
        out = {}
        for item in v["dict"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                    and not isinstance(item[0], bool)):
                raise ValueError(f"bad dict item {item!r:.100} in the value of {key!r}")
            out[item[0]] = decode_value(item[1], key)
        return out
    raise ValueError(f"bad value {v!r:.100} for {key!r}")
