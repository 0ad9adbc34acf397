"""What a local region's signature reads of a module: the slots that hold its tensors, its plain
attribute values, the tree's structure; a call's arguments flattened and its signature's parts
(ties, autocast). See ``autoparallel.regions``."""

from __future__ import annotations

import dis
import functools
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.compat import tree_flatten, tree_unflatten


def slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (submodule, attribute) holding a parameter or buffer, ties included."""
    out = []
    for m in module.modules():
        out += [(m, a) for a, t in compat.own_parameters(m).items() if t is not None]
        out += [(m, a) for a, t in compat.own_buffers(m).items() if t is not None]
    return out


def structure(modules: list[nn.Module]) -> tuple[tuple[Any, ...], ...]:
    """Per module of the tree as last seen: how many parameters and buffers it holds and which
    children (a flat walk: a change anywhere in the tree shows in some module's entry)."""
    return tuple((len(compat.own_parameters(m)), len(compat.own_buffers(m)), *compat.child_modules(m).values())
                 for m in modules)


def current(m: nn.Module, attr: str) -> torch.Tensor:
    """What ``m.<attr>`` resolves to now (a ZeRO-3 gathered tensor shadows the parameter)."""
    t = m.__dict__.get(attr)
    if t is None:
        t = compat.own_parameters(m).get(attr)
    if t is None:
        t = compat.own_buffers(m)[attr]
    assert t is not None, (type(m).__name__, attr)
    return t


def read_values(m: nn.Module) -> tuple[tuple[str, Any], ...]:
    """The plain attribute values of ``m`` a signature includes (``compat.module_values``): all
    but those its forward only writes (``self.length = x.shape[1]``: its output, not its input).
    One it reads too (``self.calls += 1; if self.calls > 3: ...``) is included: each value is a
    signature of its own."""
    written = _written_only(getattr(type(m).forward, "__code__", None))
    return tuple(kv for kv in compat.module_values(m) if kv[0] not in written)


@functools.lru_cache(maxsize=1024)
def _written_only(code: Any) -> frozenset[str]:
    """The attribute names a function's code assigns and never reads."""
    if code is None:
        return frozenset()
    stored, loaded = set(), set()
    for i in dis.get_instructions(code):
        if i.opname in ("STORE_ATTR", "DELETE_ATTR"):
            stored.add(str(i.argval))
        elif i.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            loaded.add(str(i.argval))
    return frozenset(stored - loaded)


# arity -> the tree spec of a call with that many positional tensors and no keywords (the usual
# ``module(x)``): such calls skip the general pytree walk
_POSITIONAL: dict[int, Any] = {}


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``, fast for positional tensors only."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        spec = _POSITIONAL.get(len(args))
        if spec is None:
            spec = _POSITIONAL[len(args)] = tree_flatten((args, kwargs))[1]
        return list(args), spec
    return tree_flatten((args, kwargs))


def unflatten_call(values: list[Any], tree: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inverse of ``flatten_call``."""
    if _POSITIONAL.get(len(values)) is tree:
        return tuple(values), {}
    return tree_unflatten(values, tree)


def autocast_state() -> tuple[Any, ...]:
    """Autocast changes which ops run and their dtypes: part of the signature."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def ties(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Which slots hold the same tensor: per slot, the index of its first occurrence."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), k) for k, t in enumerate(tensors))
