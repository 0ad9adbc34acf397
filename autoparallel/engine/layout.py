"""The one door through which model-level code reads and re-lays out a DistTensor.

Model-level packages (``optim``, ``pipeline``, ``regions``, ``nn``, ``checkpoint``, ``api``)
use the public API plus this module, never a DistTensor's private fields: what a DistTensor
holds (``_local``, ``_spec``, ``_stride``), how one is made from a shard, and how a shard moves
between layouts may change inside the engine without touching them.

Three kinds of operation:

- **read**: ``dist_args`` (a call's DistTensors, in the order the dispatcher collects them),
  ``written_args`` (the arguments an op writes in place), ``VALUE_OPS`` (the ops whose result
  is a Python value read from a tensor), ``is_dist``, ``spec_of`` (global layout; ``spec_or_none`` for any value),
  ``local_of`` (this rank's shard; an awaited value is waited for; ``local_or_plain`` for any
  value), ``stride_of`` (the strides the wrapper advertises);
- **make**: ``wrap`` (a DistTensor around a shard, not differentiable: for values autograd
  does not track, e.g. gradients handed over by hand), ``adopt`` (the Replicate DistTensor an
  op takes a plain tensor as), the differentiable ``from_local`` (a
  shard) and ``shard_full`` (the full value) and ``awaited`` (the result of an asynchronous collective, waited for
  when first read); ``keep_grad_layout`` (a leaf's ``.grad`` comes back in its own layout);
- **move**: ``move`` (a shard from one layout to another: the planner's plan, run),
  ``run_plan`` (a plan already made), the differentiable ``reshard`` (a DistTensor
  into another layout or mesh), ``grad_spec`` (the layout a gradient comes back in),
  and the in-place re-layouts ``relayout_`` (the same object takes a new shard and layout with
  the same global value: ZeRO shards a parameter, a reduced gradient becomes its parameter's
  layout) and ``set_local_`` (a new shard, the same layout). On an awaited value the new
  shard replaces the one in flight.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch

from autoparallel.engine.decide import VALUE_OPS, written_args
from autoparallel.engine.dispatch import adopt_one, call_key
from autoparallel.engine.dtensor import (
    DistTensor,
    _FromLocal,
    _Reshard,
    _ShardTensor,
    awaited,
    grad_spec,
    keep_grad_layout,
)
from autoparallel.spec import DistSpec
from reshard.executor import reshard_local, run_plan


# ---- read ------------------------------------------------------------------------------------
def dist_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DistTensor]:
    """The DistTensors of an op call, in the order its decision's plans follow."""
    dts: list[DistTensor] = []
    plain: list[torch.Tensor] = []
    call_key(DistTensor, args, dts, plain)
    call_key(DistTensor, tuple(kwargs.items()), dts, plain)
    return dts


def is_dist(t: Any) -> TypeGuard[DistTensor]:
    """Whether ``t`` is a DistTensor (awaited ones included)."""
    return isinstance(t, DistTensor)


def spec_of(t: DistTensor) -> DistSpec:
    """The layout of ``t``: mesh, placements, global shape and dtype."""
    return t._spec


def spec_or_none(t: Any) -> DistSpec | None:
    """The layout of a DistTensor, None for anything else."""
    return t._spec if isinstance(t, DistTensor) else None


def local_of(t: DistTensor) -> torch.Tensor:
    """This rank's shard of ``t`` (the stored object, not a view; an awaited value is waited for)."""
    return t._local


def stride_of(t: DistTensor) -> tuple[int, ...]:
    """The global strides ``t``'s wrapper advertises."""
    return t._stride


def local_or_plain(t: Any) -> Any:
    """The shard of a DistTensor, anything else as it is."""
    return t._local if isinstance(t, DistTensor) else t


# ---- make ------------------------------------------------------------------------------------
def adopt(t: torch.Tensor, mesh: Any) -> DistTensor:
    """The plain tensor ``t`` as the Replicate DistTensor on ``mesh`` an op takes it as (its
    shard is ``t`` itself; an empty tensor on ranks outside the mesh)."""
    return adopt_one(DistTensor, t, mesh)  # type: ignore[no-any-return]


def wrap(local: torch.Tensor, spec: DistSpec, stride: tuple[int, ...] | None = None,
         requires_grad: bool = False) -> DistTensor:
    """A DistTensor of layout ``spec`` around ``local`` (this rank's shard, taken as it is; not
    tracked by autograd: use ``from_local`` for that)."""
    return DistTensor._wrap(local, spec, stride, requires_grad)


def from_local(local: torch.Tensor, spec: DistSpec) -> DistTensor:
    """Differentiable ``local`` -> DistTensor of layout ``spec`` (a non-contiguous shard is
    copied); the gradient flows back as the local shard of the gradient's layout."""
    return _FromLocal.apply(local, spec)


def shard_full(full: torch.Tensor, spec: DistSpec) -> DistTensor:
    """Differentiable ``full`` (the whole value, the same on every rank) -> DistTensor of layout
    ``spec`` holding this rank's shard (contiguous); the gradient flows back as the full one."""
    return _ShardTensor.apply(full, spec)


# ---- move ------------------------------------------------------------------------------------
def move(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    """This rank's shard of a value of layout ``src``, moved to layout ``dst`` (collectives on
    every member; ``local`` itself when nothing moves)."""
    return reshard_local(local, src, dst)


def reshard(x: DistTensor, dst: DistSpec) -> DistTensor:
    """Differentiable: the value of ``x`` in layout ``dst`` (any mesh; a new DistTensor even
    when nothing moves); the gradient moves back to ``x``'s layout (Partial as Replicate)."""
    return _Reshard.apply(x, dst)  # type: ignore[no-any-return]


def relayout_(t: DistTensor, local: torch.Tensor, spec: DistSpec) -> DistTensor:
    """``t`` becomes the same global value in layout ``spec`` with shard ``local``: the same
    object (optimizer state, autograd leaf, module attribute keep pointing at it); an awaited
    value is replaced (``local`` is its value)."""
    if spec.shape != t._spec.shape or spec.dtype != t._spec.dtype:
        raise ValueError(f"relayout_: {spec} does not describe the global tensor {t._spec}")
    t._local = local
    t._spec = spec
    return t


def set_local_(t: DistTensor, local: torch.Tensor) -> DistTensor:
    """``t`` takes ``local`` as its shard (same layout; an awaited value is replaced)."""
    t._local = local
    return t


__all__ = [
    "VALUE_OPS", "adopt", "awaited", "dist_args", "from_local", "grad_spec", "is_dist", "keep_grad_layout", "local_of", "local_or_plain", "move",
    "relayout_", "reshard", "run_plan", "set_local_",
    "shard_full", "spec_of", "spec_or_none", "stride_of", "wrap", "written_args",
]
