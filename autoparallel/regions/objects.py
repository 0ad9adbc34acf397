"""Argument objects a region's module writes into: transformers' key/value caches.

A ``DynamicCache`` is passed to every decoder layer and attention module, even in training, and
each writes its own layer's keys and values into it (attributes set on a ``DynamicLayer`` held
in a list). Such an argument is walked here as *entries*: every attribute of a plain Python
object (hashed by identity, with a ``__dict__``; not a module, not a tensor), every item of a
list, tuple or dict it holds, recursively — each named by its *path* from the call's argument
leaf (``(leaf index, ("a", name) | ("i", index) | ("k", key), ...)``), which does not depend on
the objects' identities. What a captured call needs of them (``regions.program``):

* ``signature``/``walked``: the entries' structure and kinds (a DistTensor by its layout, dtype
  and rank; a value by itself) for the call's signature; None where an entry is something else (a
  set, an object with slots, a cycle, more than ``MAX_ENTRIES``): such an argument is refused.
* ``Writing``: the module's forward returning ``(its output, the tensors it wrote)``, with the
  paths written (``paths``: of tensors, in order; ``values``: the other values written, as
  ``(path, value)``); ``get``/``put`` read and set entries by path.
* ``snapshot``/``restore``: the containers' contents, so that a capture leaves the objects as
  the call found them.

A write that removes an entry or writes an object or container (a new cache layer appended) is
not a program's (``Writing.why``).

An object the forward makes and returns (the cache a transformers model makes in training) is
kept by its structure (``Made``): its tensors are the program's outputs, and every call gets a
new object of that structure holding its own.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor

MAX_ENTRIES = 1024  # walked twice per call (the signature, which the run starts from, and after the run)
MAX_DEPTH = 8
Path = tuple[Any, ...]

# values: compared by value, never changed in place
VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, slice, type(Ellipsis), type, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType)
_LEAVES = (torch.Tensor, *VALUES)  # not walked into
_EXACT = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})  # the usual values, by type


def is_object(x: Any) -> bool:
    """Whether a non-tensor argument is an object with state of its own, which a module may
    change in place (``transformers``' key/value caches): one of a class hashed by identity."""
    return type(x) not in _EXACT and not isinstance(x, _LEAVES) and type(x).__hash__ is object.__hash__


class _Unsupported(Exception):
    pass


def _walkable(x: Any) -> bool:
    return (is_object(x) and not isinstance(x, (nn.Module, list, dict, tuple))
            and isinstance(getattr(x, "__dict__", None), dict))


def _walk(x: Any, path: Path, out: dict[Path, Any], seen: set[int], depth: int) -> None:
    """Every entry under ``x`` (at ``path``) into ``out``; raises ``_Unsupported``."""
    if depth > MAX_DEPTH or id(x) in seen:
        raise _Unsupported
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        tag = "i" if isinstance(x, list) else "t"
        items: Any = ((tag, k, v) for k, v in enumerate(x))
    elif isinstance(x, dict):
        items = (("k", k, v) for k, v in x.items())
    elif _walkable(x):
        items = (("a", k, v) for k, v in vars(x).items())
    else:
        raise _Unsupported
    for tag, k, v in items:
        if tag == "k" and not isinstance(k, (str, int)):
            raise _Unsupported
        p = path + ((tag, k),)
        out[p] = v
        if len(out) > MAX_ENTRIES:
            raise _Unsupported
        if type(v) in _EXACT or isinstance(v, _LEAVES):
            continue
        _walk(v, p, out, seen, depth + 1)


def entries(leaves: Sequence[Any]) -> dict[Path, Any] | None:
    """Every entry of the object arguments among ``leaves``; None where one is not walkable."""
    out: dict[Path, Any] = {}
    try:
        for k, x in enumerate(leaves):
            if is_object(x):
                _walk(x, (k,), out, set(), 0)
    except _Unsupported:
        return None
    return out


def _kind(v: Any) -> Any:
    if type(v) in _EXACT:
        return ("value", v)
    if isinstance(v, DistTensor):
        s = layout.spec_of(v)
        return ("dist", s.mesh, s.placements, s.shard_order, s.dtype, len(s.shape), v.requires_grad)
    if isinstance(v, torch.Tensor):
        return ("plain", v.dtype, v.dim(), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, len(v))
    if isinstance(v, dict):
        return ("dict",)
    if isinstance(v, VALUES):
        return ("value", v)
    return ("object", type(v))


def signature(x: Any) -> Any:
    """One object argument's part of a region's signature (module docstring), or None."""
    return walked(x, 0)[0]


def walked(x: Any, index: int) -> tuple[Any, dict[Path, Any] | None]:
    """(``signature(x)``, the entries of ``x`` as argument leaf ``index``, as ``entries`` names
    them; None where it cannot be walked): a call's key and its local run read one walk."""
    found: dict[Path, Any] = {}
    try:
        _walk(x, (index,), found, set(), 0)
    except _Unsupported:
        return None, None
    sig = tuple((p[1:], _kind(v)) for p, v in found.items())
    try:
        hash(sig)
    except TypeError:
        return None, found
    return sig, found


def snapshot(leaves: Sequence[Any], found: dict[Path, Any] | None = None) -> list[tuple[Any, Any]]:
    """Every container under the object arguments and a copy of its contents (``found``: their
    entries, where the caller walked them already)."""
    if found is None:
        found = entries(leaves)
    assert found is not None
    containers: list[Any] = [x for x in leaves if is_object(x)]
    containers += [v for v in found.values() if isinstance(v, (list, dict)) or _walkable(v)]
    out: list[tuple[Any, Any]] = []
    for c in containers:
        if isinstance(c, list):
            out.append((c, list(c)))
        elif isinstance(c, dict):
            out.append((c, dict(c)))
        else:
            out.append((c.__dict__, dict(c.__dict__)))
    return out


def restore(saved: list[tuple[Any, Any]]) -> None:
    for c, before in saved:
        if isinstance(c, list):
            c[:] = before
        else:
            c.clear()
            c.update(before)


def _writes(before: dict[Path, Any], after: dict[Path, Any] | None) -> tuple[str, list[tuple[Path, Any]]]:
    """(why the writes are not a region's ('' when they are), the entries written, in order)."""
    if after is None:
        return "it makes an argument object that cannot be walked", []
    if any(p not in after for p in before):
        return "it removes an entry of an argument object", []
    out = []
    for p, v in after.items():
        old = before.get(p, _absent)
        if old is v:
            continue
        if (isinstance(v, VALUES) and type(old) is type(v) and not isinstance(v, type)
                and bool(old == v)):
            continue  # (an equal value written again)
        if not isinstance(v, _LEAVES):
            return "it writes an object or container into an argument object", []
        if p[-1][0] == "t":
            return "it writes into a tuple of an argument object", []
        out.append((p, v))
    return "", out


_absent = object()


class Writing:
    """``forward`` returning ``(its output, the tensors it wrote into object arguments)``;
    ``paths``/``values``/``why`` describe the last call's writes (module docstring)."""

    def __init__(self, forward: Callable[..., Any], leaves: Sequence[Any], held: dict[Path, Any] | None = None) -> None:
        self.forward = forward
        self.leaves = leaves
        self.paths: tuple[Path, ...] = ()
        self.values: tuple[tuple[Path, Any], ...] = ()
        self.why = ""
        self._given = held  # the walk the call's signature made of these objects as they are now

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
        before = self._given if self._given is not None else entries(self.leaves)
        assert before is not None  # (the signature walked them)
        self._given = None  # (a second call walks afresh)
        out = self.forward(*args, **kwargs)
        after = entries(self.leaves)
        self.why, written = _writes(before, after)
        self.paths = tuple(p for p, v in written if isinstance(v, torch.Tensor))
        self.values = tuple((p, v) for p, v in written if not isinstance(v, torch.Tensor))
        return out, tuple(v for _, v in written if isinstance(v, torch.Tensor))


def get(leaves: Sequence[Any], path: Path) -> Any:
    """The entry at ``path`` under the object arguments among ``leaves``."""
    c = leaves[path[0]]
    for tag, k in path[1:]:
        c = vars(c)[k] if tag == "a" else c[k]
    return c


def put(leaves: Sequence[Any], paths: Sequence[Path], values: Sequence[Any]) -> None:
    """Set each ``values[k]`` at ``paths[k]`` under the object arguments among ``leaves``."""
    for path, v in zip(paths, values):
        c = leaves[path[0]]
        for tag, k in path[1:-1]:
            c = vars(c)[k] if tag == "a" else c[k]
        tag, k = path[-1]
        if tag == "a":
            vars(c)[k] = v
        elif tag == "i" and k == len(c):  # (an item the forward appended)
            c.append(v)
        else:
            c[k] = v


class Made:
    """An object a forward makes and returns (transformers' key/value cache, made afresh by every
    training call): its structure, rebuilt around each call's tensors. The structure is what an
    argument object's walk follows (plain objects with a ``__dict__``, lists, tuples, dicts with
    str or int keys), every entry a tensor or a value; the values are kept as they are, shared
    by the objects rebuilt (as the forward would have set the same ones again)."""

    def __init__(self, shape: Any, n: int) -> None:
        self.shape = shape  # nested: ("t",) a tensor | ("v", value) | (container tag, type, children)
        self.n = n          # its tensors

    @classmethod
    def of(cls, x: Any) -> tuple[Made, list[torch.Tensor]] | None:
        """``x``'s structure and its tensors (in the order ``build`` takes them); None where it
        is not such an object, or not rebuilt as it was (a class whose instances need their
        constructor's arguments)."""
        tensors: list[torch.Tensor] = []
        try:
            made = cls(_shape(x, tensors, set(), 0), 0)
            made.n = len(tensors)
            if not _same_structure(made.build(tensors), x):
                return None
        except Exception:  # noqa: BLE001  (_Unsupported, or a class that cannot be rebuilt this way)
            return None
        return made, tensors

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """A new object of this structure holding ``tensors``."""
        return _build(self.shape, iter(tensors))

    def tensors(self, x: Any) -> list[torch.Tensor]:
        """The tensors of ``x``, an object of this structure, in ``build``'s order."""
        got = Made.of(x)
        if got is None or got[0].shape != self.shape:
            raise ValueError(f"a {type(x).__name__} of another structure than the one captured")
        return got[1]


def _shape(x: Any, tensors: list[torch.Tensor], seen: set[int], depth: int) -> Any:
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return ("t",)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unsupported  # (a size the trace left open: a value of one call only)
    if type(x) in _EXACT or isinstance(x, VALUES):
        return ("v", x)
    if depth > MAX_DEPTH or id(x) in seen or len(seen) > MAX_ENTRIES:
        raise _Unsupported
    seen.add(id(x))
    if isinstance(x, list) and type(x) is list:
        return ("list", list, tuple(_shape(v, tensors, seen, depth + 1) for v in x))
    if isinstance(x, tuple) and (type(x) is tuple or hasattr(type(x), "_fields")):
        return ("tuple", type(x), tuple(_shape(v, tensors, seen, depth + 1) for v in x))
    if isinstance(x, dict) and type(x) is dict:
        if not all(isinstance(k, (str, int)) for k in x):
            raise _Unsupported
        return ("dict", dict, tuple((k, _shape(v, tensors, seen, depth + 1)) for k, v in x.items()))
    if _walkable(x):
        return ("object", type(x), tuple((k, _shape(v, tensors, seen, depth + 1)) for k, v in vars(x).items()))
    raise _Unsupported


def _build(shape: Any, tensors: Any) -> Any:
    tag = shape[0]
    if tag == "t":
        return next(tensors)
    if tag == "v":
        return shape[1]
    kind, children = shape[1], shape[2]
    if tag == "list":
        return [_build(c, tensors) for c in children]
    if tag == "tuple":
        items = [_build(c, tensors) for c in children]
        return tuple(items) if kind is tuple else kind(*items)
    if tag == "dict":
        return {k: _build(c, tensors) for k, c in children}
    obj = kind.__new__(kind)
    obj.__dict__.update({k: _build(c, tensors) for k, c in children})
    return obj


def _same_structure(a: Any, b: Any) -> bool:
    """Whether ``a`` (rebuilt) has ``b``'s classes and entries (a class whose ``__new__`` or
    namedtuple-like constructor made something else is not rebuilt this way)."""
    if type(a) is not type(b):
        return False
    if isinstance(b, torch.Tensor) or type(b) in _EXACT or isinstance(b, VALUES):
        return a is b
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_structure(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same_structure(a[k], b[k]) for k in b)
    va, vb = vars(a), vars(b)
    return list(va) == list(vb) and all(_same_structure(va[k], vb[k]) for k in vb)


def any_object(leaves: Sequence[Any]) -> bool:
    return any(is_object(x) for x in leaves)


__all__ = ["MAX_ENTRIES", "VALUES", "Made", "Writing", "any_object", "entries", "get", "is_object", "put", "restore",
           "signature", "snapshot", "walked"]
