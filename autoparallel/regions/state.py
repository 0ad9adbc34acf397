"""What a local region's signature reads of a module: the slots that hold its tensors, its plain
attribute values, the tree's structure; a call's arguments flattened and its signature's parts
(ties, autocast). See ``autoparallel.regions``."""

from __future__ import annotations

import dis
import functools
import operator
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.attributes import class_values, describe, held_names, slot_names
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


class TreeReader:
    """What a call's signature reads of a module tree's attributes, per module in ``modules``:

    * **values**: the plain values (``compat.module_values``, ``training`` included) but those its
      forward only writes (``self.length = x.shape[1]``: its output, not its input; one it reads
      too, ``self.calls += 1; if self.calls > 3: ...``, is included: each value a signature of
      its own);
    * **held**: every other attribute that is neither a field of ``nn.Module``, nor ours
      (``_ap*``), nor a tensor standing in for a parameter or buffer (a ZeRO-3 gathered weight),
      nor one its forward only writes, by content (``attributes.describe``: a config's values, a
      function itself, a tensor's identity): a value changed inside a config the forward reads
      makes a new signature;
    * **class values**: the plain values its class sets (``attributes.class_values``: a class's
      ``is_causal = True`` changed on the class, a new signature).

    All three are values a forward reads by name (``self.x``): ``values`` holds them together,
    so that ``Reads`` tells which of them a capture read.

    Which names are which is worked out again only when a module's attribute names, their types or
    its class's ``forward`` change (a comparison of tuples made at C speed); otherwise one getter
    reads them. Run at every call of a local region: a walk of every attribute of every module in
    Python cost more than a small model's step's other bookkeeping."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self._seen: list[Any] = [None] * len(modules)  # per module, the entry of its last layout
        self._layouts: list[dict[Any, Any]] = [{} for _ in modules]

    def read(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(values, held): per module, every value a forward may read of it by name — (the
        names, their types, what they hold now: plain values, then the held objects'
        descriptions, then the class's plain values an instance does not shadow) — and the held
        objects alone, (their names, their descriptions)."""
        values: list[Any] = []
        held: list[Any] = []
        seen_all = self._seen
        memo: dict[int, Any] = {}  # (a config shared by many modules: described once)
        by_class: dict[type, Any] = {}  # (a model's many blocks, norms and linears: read once per class)
        for k, m in enumerate(self.modules):
            d = m.__dict__
            fp = (tuple(d), tuple(map(type, d.values())), getattr(type(m).forward, "__code__", None))
            seen = seen_all[k]
            if seen is None or seen[0] != fp:
                seen = seen_all[k] = self._known(k, m, fp)
            names, kinds, vals = seen[1], seen[5], seen[2](d)
            if seen[3]:
                objs = seen[4](d)
                descs = tuple(describe(v, memo) for v in objs)
                names, kinds, vals = names + seen[3], kinds + tuple(map(type, objs)), vals + descs
                held.append((seen[3], descs))
            else:
                held.append(())
            t = type(m)
            cv = by_class.get(t)
            if cv is None:
                cv = by_class[t] = class_values(t)
            cls = [c for c in cv if c[0] not in d] if cv else cv
            if cls:
                names += tuple(c[0] for c in cls)
                kinds += tuple(c[1] for c in cls)
                vals += tuple(c[2] for c in cls)
            values.append((names, kinds, vals))
        return tuple(values), tuple(held)

    def _known(self, k: int, m: nn.Module, fp: tuple[Any, ...]) -> tuple[Any, ...]:
        """The entry of module ``k`` at attribute layout ``fp``: one of the last few it had (a
        ZeRO-3 unit's modules alternate between two: gathered weights shadowing the parameters
        or not), or worked out."""
        known = self._layouts[k]
        entry = known.get(fp)
        if entry is None:
            if len(known) >= 8:
                del known[next(iter(known))]
            entry = known[fp] = (fp, *self._names(m, fp))
        return entry

    def _names(self, m: nn.Module, fp: tuple[Any, ...]) -> tuple[Any, ...]:
        names, types, code = fp
        written = _written_only(code)
        plain = tuple(n for n, t in zip(names, types)
                      if t in compat.PLAIN_VALUES and (n == "training" or n not in written))
        kinds = tuple(t for n, t in zip(names, types) if n in plain)  # (a flag set to 1 is not True: 1 == True)
        others = tuple(n for n in held_names(names, types, slot_names(m)) if n not in written)
        return plain, _getter(plain), others, _getter(others), kinds


def _getter(names: tuple[str, ...]) -> Any:
    """A function of a dict giving the tuple of its values at ``names``."""
    if not names:
        return lambda d: ()
    if len(names) == 1:
        name = names[0]
        return lambda d: (d[name],)
    return operator.itemgetter(*names)


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
