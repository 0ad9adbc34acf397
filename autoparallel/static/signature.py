"""The signature a captured program is kept under: what a replay depends on besides the values.

``DistModel`` (one program per call signature) and the static pipeline chunks (one per chunk
input signature) build their keys from these parts, so both replay under the same conditions:

* ``value(a)``: an argument, nested lists, tuples and dicts (any pytree) described leaf by leaf
  with their structure — a DistTensor's layout (mesh, placements, global shape, dtype) and
  strides, a plain tensor's shape, dtype and strides, any other value as it is (with its type:
  ``1`` and ``True`` differ); an unhashable leaf is described by its type only, and
  ``unkeyed(args)`` says why no program may be kept for it;
* ``tree(module)``, read in one walk: each parameter's layout (None: plain) and
  ``requires_grad``; each buffer's layout or plain shape and dtype (a step may assign a buffer
  a new value: a program reads the buffers it was captured with); each submodule's train/eval
  flag, plain Python attribute values (a temperature, a flag a forward branches on:
  ``compat.module_values``), the other objects it holds by content (a config's values, a
  function: ``attributes.held``), its class's plain values (``attributes.class_values``) and hooks (a hook added after a capture makes a new signature,
  so it runs).

``changed(old, new, module)`` names, in user terms, what differs between two such keys;
``alike_parts`` keys ``attributes.Alike``, which serves a call from a program whose capture read
none of the attribute values that differ.
Everything here reads metadata only: every rank builds the same key.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import torch
from torch import nn

from autoparallel import attributes, compat
from autoparallel.compat import tree_flatten
from autoparallel.engine import layout


def leaf(a: Any) -> Any:
    """One leaf of an argument: a tensor's layout or shape, another value as it is (or, when it
    cannot key a dict, its type: see ``unkeyed``)."""
    if layout.is_dist(a):
        return ("dist", layout.spec_of(a), layout.stride_of(a))
    if isinstance(a, torch.Tensor):
        return ("plain", tuple(a.shape), a.dtype, tuple(a.stride()))
    try:
        hash(a)
    except TypeError:
        return ("unhashable", type(a))
    return ("value", type(a), a)


def value(a: Any) -> Any:
    """One argument's part of a signature: its nesting (a pytree spec) and each leaf's ``leaf``."""
    leaves, tree = tree_flatten(a)
    if tree.is_leaf():
        return leaf(a)
    return ("tree", tree, tuple(leaf(x) for x in leaves))


def unkeyed(args: Any) -> str:
    """Why no program can be kept for ``args`` ('' when one can): a leaf that is no tensor and
    cannot be hashed (a numpy array, a mutable object) is not part of any key, so a program
    captured with one value would be replayed with another."""
    for x in tree_flatten(args)[0]:
        if leaf(x)[0] == "unhashable":
            return (f"an argument holds a {type(x).__name__}, which is neither a tensor nor hashable: a program "
                    "made for one such value cannot be told apart from another (pass tensors, or numbers, strings "
                    "and tuples)")
    return ""


class Tree(NamedTuple):
    """One walk of a module tree: its parameters and buffers in the order (and with the sharing)
    of ``module.parameters()`` and ``module.buffers()``, and its parts of a key."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    param_parts: tuple[Any, ...]  # per parameter: its layout (None: plain) and ``requires_grad``
    buffer_parts: tuple[Any, ...]  # per buffer: its name, and its layout or plain shape and dtype
    module_parts: tuple[Any, ...]  # per module: train/eval flag, plain values, held objects, class values, hooks
    modules: list[nn.Module]  # the modules, in ``module_parts`` order

    @property
    def key(self) -> tuple[Any, Any, Any]:
        """The parameters, buffers and modules parts, in ``PARTS`` order."""
        return self.param_parts, self.buffer_parts, self.module_parts


def tree(module: nn.Module) -> Tree:
    """``module`` and its submodules read in one walk (``named_modules`` order, each module,
    parameter and buffer once: a tied weight is one parameter). Run at every call of a captured
    step: five walks of the tree (parameters, buffers, and the key's three parts) cost more than
    a small model's step's other bookkeeping. A parameter's ``requires_grad`` is read: call it
    under ``compat.attribute_access()``."""
    mods: list[tuple[str, nn.Module]] = []
    _visit("", module, mods, set())
    params: list[torch.Tensor] = []
    bufs: list[torch.Tensor] = []
    buffer_parts: list[Any] = []
    held: set[int] = set()
    held_buffers: set[int] = set()
    for prefix, m in mods:
        for p in compat.own_parameters(m).values():
            if p is not None and id(p) not in held:
                held.add(id(p))
                params.append(p)
        for name, b in compat.own_buffers(m).items():
            if b is not None and id(b) not in held_buffers:
                held_buffers.add(id(b))
                bufs.append(b)
                buffer_parts.append((f"{prefix}.{name}" if prefix else name, leaf(b)))
    memo: dict[int, Any] = {}  # (a config shared by many modules: described once)
    return Tree(params, bufs, tuple((layout.spec_or_none(p), p.requires_grad) for p in params), tuple(buffer_parts),
                tuple((m.training, _values(m), attributes.held(m, memo), attributes.class_values(type(m)),
                       *compat.module_hooks(m)) for _, m in mods), [m for _, m in mods])


def split_values(module_parts: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``Tree.module_parts`` without the attribute values (their names kept: an attribute set or
    deleted still makes a new key), and per module its attributes as ``(names, kinds, values)``
    (``attributes.read_values``' form: plain values, held objects' descriptions, then the class
    values no instance attribute shadows). A program whose capture read none of the values that
    differ may serve a call (``attributes.Reads``)."""
    rest: list[Any] = []
    values: list[Any] = []
    for training, plain, held, of_class, *hooks in module_parts:
        names = tuple(n for n, _, _ in plain) + tuple(n for n, _ in held)
        own = set(names)
        of_class = tuple(c for c in of_class if c[0] not in own)
        names += tuple(n for n, _, _ in of_class)
        kinds = tuple(k for _, k, _ in plain) + (object,) * len(held) + tuple(k for _, k, _ in of_class)
        vals = tuple(v for *_, v in plain) + tuple(d for _, d in held) + tuple(v for *_, v in of_class)
        rest.append((training, names, *hooks))
        values.append((names, kinds, vals))
    return tuple(rest), tuple(values)


def _visit(prefix: str, m: nn.Module, mods: list[tuple[str, nn.Module]], seen: set[int]) -> None:
    """Append ``m`` and its submodules to ``mods`` with their paths, as ``named_modules`` walks
    them (pre-order, each module once)."""
    if id(m) in seen:
        return
    seen.add(id(m))
    mods.append((prefix, m))
    for name, child in compat.child_modules(m).items():
        if child is not None:
            _visit(f"{prefix}.{name}" if prefix else name, child, mods, seen)


def _values(m: nn.Module) -> tuple[tuple[str, type, Any], ...]:
    """``compat.module_values(m)``, each with its type (a flag set to 1 instead of True is told
    apart: 1 == True); which attributes are plain values is worked out once per attribute layout."""
    d = m.__dict__
    names, kinds, get = _plain(tuple(d), tuple(map(type, d.values())))
    return tuple(zip(names, kinds, get(d)))


@functools.lru_cache(maxsize=1024)
def _plain(names: tuple[str, ...], types: tuple[type, ...]) -> tuple[tuple[str, ...], tuple[type, ...], Any]:
    """Of a module's attributes (``names`` holding values of ``types``), the plain values'
    names, their types, and a getter of them from the module's ``__dict__``."""
    plain = [(n, t) for n, t in zip(names, types) if t in compat.PLAIN_VALUES and n != "training"]
    picked = tuple(n for n, _ in plain)
    if not picked:
        return (), (), lambda d: ()
    if len(picked) == 1:
        return picked, (plain[0][1],), lambda d: (d[picked[0]],)
    return picked, tuple(t for _, t in plain), operator.itemgetter(*picked)


def alike_parts(other: Any, module_parts: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """A key for ``attributes.Alike`` (``other``, the rest of a signature: inputs, layouts, ...,
    with ``module_parts`` less their attribute values) and those values (``split_values``)."""
    rest, values = split_values(module_parts)
    return (other, rest), values


# the parts of a ``DistModel`` key, in order (``changed`` names the ones that differ)
PARTS = ("mode", "autograd", "inputs", "parameters", "buffers", "modules")
_WHAT = {"mode": "the mode (train/eval/predict)", "autograd": "autograd on/off",
         "inputs": "the inputs' shapes, layouts or values", "parameters": "the parameters' layouts",
         "buffers": "the buffers' shapes or layouts"}


def changed(old: tuple[Any, ...], new: tuple[Any, ...], module: nn.Module) -> str:
    """What differs between the keys ``old`` and ``new`` (parts in ``PARTS`` order) of ``module``'s
    calls, in user terms: 'attribute temp of module fc (Linear)', 'the inputs' shapes, ...'."""
    what: list[str] = [_WHAT[p] for p, a, b in zip(PARTS, old, new) if p != "modules" and a != b]
    names = [name for name, _ in module.named_modules()]
    for name, a, b in zip(names, old[-1], new[-1]):
        if a == b:
            continue
        where = f"module {name!r}" if name else "the model"
        if a[0] != b[0]:
            what.append(f"the train/eval flag of {where}")
        if a[1:4] != b[1:4]:
            attrs = sorted({k for part in (1, 2, 3) for k, *_ in set(a[part]) ^ set(b[part])})
            what.append(f"attribute{'s' if len(attrs) > 1 else ''} {', '.join(attrs)} of {where}")
        if a[4:] != b[4:]:
            what.append(f"the hooks of {where}")
    return "; ".join(what) or "nothing visible"
