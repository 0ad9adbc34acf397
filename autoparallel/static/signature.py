"""The signature a captured program is kept under: what a replay depends on besides the values.

``DistModel`` (one program per call signature) and the static pipeline chunks (one per chunk
input signature) build their keys from these parts, so both replay under the same conditions:

* ``value(a)``: an argument — a DistTensor's layout (mesh, placements, global shape, dtype) and
  local strides, a plain tensor's shape, dtype and strides, ``None``, or any other value as it is;
* ``parameters(module)``: each parameter's layout (None: plain) and ``requires_grad``;
* ``modules(module)``: each submodule's train/eval flag and hooks (a hook added after a capture
  makes a new signature, so it runs).

Everything here reads metadata only: every rank builds the same key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.engine import layout


def value(a: Any) -> Any:
    """One argument's part of a signature."""
    if layout.is_dist(a):
        return ("dist", layout.spec_of(a), layout.stride_of(a))
    if isinstance(a, torch.Tensor):
        return ("plain", tuple(a.shape), a.dtype, tuple(a.stride()))
    return ("value", a)


def parameters(module: nn.Module) -> tuple[Any, ...]:
    """The layout (None: plain) and ``requires_grad`` of each of ``module``'s parameters."""
    return tuple((layout.spec_or_none(p), p.requires_grad) for p in module.parameters())


def modules(module: nn.Module) -> tuple[Any, ...]:
    """The train/eval flag and hooks of ``module`` and each of its submodules."""
    return tuple((m.training, *compat.module_hooks(m)) for m in module.modules())
