"""What a module's forward may read besides its tensors: the objects it holds, by content.

A captured program (a local region's, a static step's) is replayed only under the signature it
was captured with. A module's plain attribute values are part of that signature
(``compat.module_values``). So are the other objects a module holds as attributes, described
here by what they hold: changing a value inside one (``model.config.scale = 2.0``), putting
another object in its place, or assigning another function (``block.act = F.silu``) makes a new
signature, and the next call is captured again (or runs op by op) instead of replaying a program
made for the old value.

``describe(x, memo)`` gives a hashable description of ``x``:

* numbers, strings, bytes, ``None``: the value with its type (``1`` and ``True`` differ);
* lists, tuples, dicts, sets: their items described, in order (a container of more than
  ``MAX_ITEMS`` items, a tokenizer's vocabulary say, by identity and length only);
* an object with a ``__dict__`` (a config, a dataclass, a namespace): its class and each of its
  attributes described, nested objects followed up to ``MAX_DEPTH`` levels (deeper: identity);
* a tensor or a module: its identity (a module's state is read as a module's; a tensor is data);
* a function, class, method, dtype, device, enum member or other value that compares by
  identity or by a cheap ``__eq__``: the object itself; anything else: its identity.

An object met twice in one description (shared, or a cycle) is described once: ``memo`` maps
identities to descriptions for the duration of one signature. Past ``MAX_OBJECTS`` containers
and objects in one signature (a module holding a trainer and its datasets), the rest are read by
identity. Nothing here reads tensor data.

``Reads(modules)`` notes, while a block of code runs (a capture), which attribute names it reads
of each module; ``read_values`` gives the values at those names, so a program may serve a call
whose values differ only where its capture read none.
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoparallel import compat

MAX_ITEMS = 256
MAX_DEPTH = 4
MAX_OBJECTS = 4096  # containers and objects one description follows, in all
_COUNT = -1  # (the memo's count of them: no object has a negative identity)

_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None)})
# compared and hashed by identity or by a cheap value: kept as they are
_AS_IS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType,
          type, torch.dtype, torch.device, enum.Enum, functools.partial)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MODULE_FIELDS = frozenset(vars(nn.Module())) | {"forward"}  # nn.Module's own fields, and a region's wrapper


def describe(x: Any, memo: dict[int, Any], depth: int = 0) -> Any:
    """A hashable description of ``x`` by content (see the module's docstring)."""
    t = type(x)
    if t in _ATOMS:
        return (t, x)
    key = id(x)
    got = memo.get(key)
    if got is not None:
        return got
    memo[key] = ("cycle", key)  # (an object reached again while it is described)
    count = memo[_COUNT] = memo.get(_COUNT, 0) + 1
    if count > MAX_OBJECTS:  # (a large graph of objects, a trainer holding its datasets: not read at every call)
        memo[key] = out = ("id", key)
        return out
    memo[key] = out = _describe(x, t, memo, depth)
    return out


def _describe(x: Any, t: type, memo: dict[int, Any], depth: int) -> Any:
    if isinstance(x, (torch.Tensor, nn.Module)):
        return ("id", id(x))
    if isinstance(x, _AS_IS):
        return (t, x) if _hashable(x) else ("id", id(x))
    if isinstance(x, _CONTAINERS):
        if len(x) > MAX_ITEMS or depth >= MAX_DEPTH:
            return ("id", id(x), len(x))
        if isinstance(x, dict):
            return (t, tuple((describe(k, memo, depth + 1), describe(v, memo, depth + 1)) for k, v in x.items()))
        if isinstance(x, (set, frozenset)):
            return (t, frozenset(describe(v, memo, depth + 1) for v in x))
        return (t, tuple(describe(v, memo, depth + 1) for v in x))
    try:
        d = getattr(x, "__dict__", None)
    except Exception:  # (a proxy whose attribute access fails otherwise)
        d = None
    if isinstance(d, dict):
        if len(d) > MAX_ITEMS or depth >= MAX_DEPTH:
            return ("id", id(x), len(d))
        return (t, tuple((k, describe(v, memo, depth + 1)) for k, v in d.items()))
    if t.__eq__ is object.__eq__ and t.__hash__ is object.__hash__:
        return (t, x)  # (compared by identity: kept alive by the description, so never confused)
    return ("id", id(x))


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def held_names(names: tuple[str, ...], types_: tuple[type, ...], slots: frozenset[str]) -> tuple[str, ...]:
    """Of a module's attributes (``names`` holding values of ``types_``), those ``held`` describes:
    not a plain value (``compat.module_values`` has those), not a field of ``nn.Module`` or of this
    library (``_ap...``), not a tensor standing in for one of the module's parameters or buffers
    (``slots``, their names: a ZeRO-3 unit's gathered weight is the module's state, read as such)."""
    return tuple(n for n, t in zip(names, types_)
                 if t not in compat.PLAIN_VALUES and n not in _MODULE_FIELDS and not n.startswith("_ap")
                 and not (n in slots and issubclass(t, torch.Tensor)))


def slot_names(module: nn.Module) -> frozenset[str]:
    """The names of ``module``'s own parameters and buffers."""
    return frozenset(compat.own_parameters(module)) | frozenset(compat.own_buffers(module))


def held(module: nn.Module, memo: dict[int, Any]) -> tuple[tuple[str, Any], ...]:
    """``(name, description)`` of each object ``module`` holds as an attribute (``held_names``)."""
    d = module.__dict__
    names = held_names(tuple(d), tuple(map(type, d.values())), slot_names(module))
    return tuple((n, describe(d[n], memo)) for n in names)


@functools.lru_cache(maxsize=1024)
def _own_classes(cls: type) -> tuple[type, ...]:
    """``cls`` and its bases below ``nn.Module`` (nn.Module's own class attributes are not a model's)."""
    return tuple(c for c in cls.__mro__ if c is not object and not (isinstance(c, type) and issubclass(nn.Module, c)))


@functools.lru_cache(maxsize=1024)
def _class_slots(cls: type, sizes: tuple[int, ...]) -> tuple[tuple[type, str], ...]:
    """Where each plain class attribute of ``cls`` lives: (the class that sets it first in the
    method resolution order, its name). ``sizes``: how many names each class holds (a name
    added or deleted: worked out again)."""
    seen: set[str] = set()
    out = []
    for c in _own_classes(cls):
        for k, v in vars(c).items():
            if k not in seen and not k.startswith("__"):
                seen.add(k)
                if type(v) in compat.PLAIN_VALUES:
                    out.append((c, k))
    return tuple(out)


def class_values(cls: type) -> tuple[tuple[str, type, Any], ...]:
    """The plain values ``cls`` (a module class) sets as class attributes, with their types:
    ``is_causal = True`` read as ``self.is_causal``; changed on the class (``Attention.is_causal =
    False``), a new signature. A value an instance sets itself shadows it and is read as the
    instance's."""
    classes = _own_classes(cls)
    slots = _class_slots(cls, tuple(len(vars(c)) for c in classes))
    return tuple((k, type(v), v) for c, k in slots for v in (vars(c).get(k),))


# ---- which attributes a block of code reads -----------------------------------------------------
_WATCH = "_ap_reads"  # a watched module's ``_Watch``
_WATCHING: dict[type, type] = {}  # a module class -> its watching subclass (made once)


class _Watch:
    """The names a watched module's code read."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: set[str] = set()


class Reads:
    """Which attributes the code run inside a ``with`` block reads of each module of a tree, by
    name (``self.x``, ``getattr(self, "x")``): a capture's forward (and its backward) reading a
    plain value makes the program depend on it; one it never reads (a decoder layer's
    ``layer_idx`` when no cache is passed) does not, and modules differing only there may share
    the program. Each module's class is swapped for a subclass whose ``__getattribute__`` notes
    the name, for the block's duration only. Code that reads a module's ``__dict__`` itself
    (``vars(self)``; not ``nn.Module``'s own attribute machinery, nor this library's bookkeeping)
    counts as reading every value."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.watches = [_Watch() for _ in modules]
        self._classes: list[type | None] = []
        self.entered = False  # whether a block ran (what it read is known)

    def __enter__(self) -> Reads:
        self.entered, self._classes = True, []
        for m, watch in zip(self.modules, self.watches):
            cls = type(m)
            if _WATCH in m.__dict__:  # (watched already, by an enclosing block: every value counts)
                watch.names.add("__dict__")
                self._classes.append(None)
                continue
            m.__dict__[_WATCH] = watch
            try:
                m.__class__ = _watching(cls)
            except TypeError:  # (a class whose layout forbids it: every value counts)
                watch.names.add("__dict__")
                del m.__dict__[_WATCH]
                self._classes.append(None)
                continue
            self._classes.append(cls)
        return self

    def __exit__(self, *exc: object) -> None:
        for m, cls in zip(self.modules, self._classes):
            if cls is not None:
                m.__class__ = cls
                m.__dict__.pop(_WATCH, None)

    def of(self, values: tuple[Any, ...]) -> tuple[tuple[str, ...] | None, ...]:
        """Per module, the plain values (``TreeReader`` ``values``' names) the block read; None:
        all of them."""
        return tuple(None if "__dict__" in w.names else tuple(n for n in names if n in w.names)
                     for w, (names, _, _) in zip(self.watches, values))


class Alike:
    """Programs kept by a signature without the modules' attribute values, with the values their
    capture read (``Reads``): a call differing from a captured one only in values the capture did
    not read (a step counter or a log the training loop keeps on the model) is served by its
    program. The one table static steps, pipeline chunks and local regions keep them in; ``key``
    is the rest of a signature, ``values`` per module ``(names, kinds, values)`` (``read_values``'
    form). At most ``per_key`` programs per key and ``keys`` keys, the oldest dropped first."""

    def __init__(self, per_key: int = 16, keys: int = 64) -> None:
        self.per_key, self.keys = per_key, keys
        self._kept: dict[Any, list[tuple[Any, Any, Any]]] = {}

    def find(self, key: Any, values: tuple[Any, ...]) -> Any:
        """The program kept under ``key`` whose capture read the same of ``values`` (None: none)."""
        for reads, seen, program in self._kept.get(key, ()) if self._kept else ():
            if read_values(values, reads) == seen:
                return program
        return None

    def keep(self, key: Any, values: tuple[Any, ...], reads: Reads, program: Any) -> None:
        """Note ``program``, captured inside ``reads`` from a call of ``values``."""
        if not reads.entered:
            return
        read = reads.of(values)
        kept = self._kept.setdefault(key, [])
        kept.append((read, read_values(values, read), program))
        if len(kept) > self.per_key:
            del kept[0]
        if len(self._kept) > self.keys:
            del self._kept[next(iter(self._kept))]


def read_values(values: tuple[Any, ...], reads: tuple[tuple[str, ...] | None, ...]) -> tuple[Any, ...] | None:
    """``values`` (``TreeReader.read``'s) at the names ``reads`` (``Reads.of``) gives, with
    their types; None where a module lacks one of them."""
    out: list[Any] = []
    for (names, kinds, vals), r in zip(values, reads):
        if r is None:
            out.append((names, kinds, vals))
        elif r:
            where = {n: i for i, n in enumerate(names)}
            if any(n not in where for n in r):
                return None
            out.append(tuple((n, kinds[where[n]], vals[where[n]]) for n in r))
        else:
            out.append(())
    return tuple(out)


def _watching(cls: type) -> type:
    """The subclass of module class ``cls`` that notes the names read of an instance."""
    sub = _WATCHING.get(cls)
    if sub is not None:
        return sub
    get: Callable[[Any, str], Any] = cls.__getattribute__  # type: ignore[assignment]

    def __getattribute__(self: Any, name: str) -> Any:
        watch = object.__getattribute__(self, "__dict__").get(_WATCH)
        if watch is not None and (name != "__dict__" or not _machinery(sys._getframe(1))):
            watch.names.add(name)
        return get(self, name)

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _WATCHING[cls] = sub
    return sub


def _machinery(frame: Any) -> bool:
    """Whether a read of a module's ``__dict__`` comes from nn.Module's own attribute machinery
    or from this library (a capture's bookkeeping), not from a forward's code."""
    name = frame.f_globals.get("__name__", "")
    return name == "torch.nn.modules.module" or name.startswith("autoparallel.")
