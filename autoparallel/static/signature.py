"""The signature a captured program is kept under: what a replay depends on besides the values.

``DistModel`` (one program per call signature) and the static pipeline chunks (one per chunk
input signature) build their keys from these parts, so both replay under the same conditions:

* ``value(a)``: an argument, nested lists, tuples and dicts (any pytree) described leaf by leaf
  with their structure — a DistTensor's layout (mesh, placements, global shape, dtype) and
  strides, a plain tensor's shape, dtype and strides, any other value as it is (with its type:
  ``1`` and ``True`` differ); an unhashable leaf is described by its type only, and
  ``unkeyed(args)`` says why no program may be kept for it;
* ``parameters(module)``: each parameter's layout (None: plain) and ``requires_grad``;
* ``buffers(module)``: each buffer's layout or plain shape and dtype (a step may assign a buffer
  a new value: a program reads the buffers it was captured with);
* ``modules(module)``: each submodule's train/eval flag, hooks (a hook added after a capture
  makes a new signature, so it runs) and plain Python attribute values (a temperature, a flag a
  forward branches on: ``compat.module_values``).

``changed(old, new, module)`` names, in user terms, what differs between two such keys.
Everything here reads metadata only: every rank builds the same key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoparallel import compat
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


def parameters(module: nn.Module) -> tuple[Any, ...]:
    """The layout (None: plain) and ``requires_grad`` of each of ``module``'s parameters."""
    return tuple((layout.spec_or_none(p), p.requires_grad) for p in module.parameters())


def buffers(module: nn.Module) -> tuple[Any, ...]:
    """The name, layout or plain shape and dtype of each of ``module``'s buffers."""
    return tuple((name, leaf(b)) for name, b in module.named_buffers())


def modules(module: nn.Module) -> tuple[Any, ...]:
    """The train/eval flag, hooks and plain attribute values of ``module`` and each submodule."""
    return tuple((m.training, _values(m), *compat.module_hooks(m)) for m in module.modules())


def _values(m: nn.Module) -> tuple[tuple[str, type, Any], ...]:
    # with each value's type: a flag set to 1 instead of True is told apart (1 == True)
    return tuple((k, type(v), v) for k, v in compat.module_values(m))


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
        if a[1] != b[1]:
            attrs = sorted({k for k, *_ in set(a[1]) ^ set(b[1])})
            what.append(f"attribute{'s' if len(attrs) > 1 else ''} {', '.join(attrs)} of {where}")
        if a[2:] != b[2:]:
            what.append(f"the hooks of {where}")
    return "; ".join(what) or "nothing visible"
