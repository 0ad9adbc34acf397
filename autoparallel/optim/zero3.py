"""ZeRO-3 parameters: stored sharded, gathered around each module's forward, freed after it.

``shard_parameter_`` changes a parameter's layout in place (same Python object, so the model
and the optimizer keep their references): the data-parallel axis goes from Replicate to Shard
and the local shard shrinks to a ``torch.chunk`` piece. Two process-wide module hooks (installed
on first use) then, for any module whose own parameters are ZeRO-3 sharded:

* before ``forward``: all-gather them (one collective per module, mesh and dtype) and let the
  module's attribute (``module.weight``) resolve to the gathered tensor;
* after ``forward``: drop that reference.

While the module runs, autograd saves no gathered parameter: a saved-tensor hook replaces any
tensor viewing a gathered parameter's storage (``weight.t()`` saved by ``addmm``) with a token,
and backward all-gathers that parameter again when it needs it. So a full parameter lives only
while its module computes (forward) or its gradient is computed (backward).

The gather is an autograd function whose backward is the mirror image: the gradients (Partial
over the data-parallel axis) are reduce-scattered in one collective straight into the shard
layout, so a full gradient never persists.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.dtensor import DistTensor
from autoparallel.optim import buckets
from autoparallel.placement import Partial, chunk_bounds
from autoparallel.spec import DistSpec
from reshard.executor import reshard_local

_ATTR = "_ap_zero3"
_CALLS = "_ap_zero3_calls"  # per module: a stack of (saved-tensor hooks, gathered storages)
_HOOKS: list[Any] = []  # the two global module hooks, once installed
_LIVE: dict[int, "_Regather"] = {}  # storage address of a gathered local -> how to gather it again


@dataclass(frozen=True)
class Zero3Layout:
    """A ZeRO-3 parameter's layouts: ``shard`` (stored) and ``full`` (gathered, used)."""

    axis: int
    shard: DistSpec
    full: DistSpec

    @property
    def dim(self) -> int:
        return self.shard.placements[self.axis].dim  # type: ignore[union-attr]


def shard_parameter_(p: DistTensor, axis: int, shard: DistSpec) -> None:
    """Store ``p`` in layout ``shard`` from now on (in place; no data moves: a local slice)."""
    full = p._spec
    layout = Zero3Layout(axis, shard, full)
    coord = full.mesh.coordinate_of(runtime.get_rank())
    if coord is not None:
        local = p._local
        p._local = local.narrow(layout.dim, *chunk_bounds(local.shape[layout.dim], full.mesh.shape[axis], coord[axis])).clone()
    p._spec = shard
    setattr(p, _ATTR, layout)
    _install_hooks()


def zero3_layout(p: torch.Tensor) -> Zero3Layout | None:
    return getattr(p, _ATTR, None)


def _install_hooks() -> None:
    if not _HOOKS:
        _HOOKS.append(torch.nn.modules.module.register_module_forward_pre_hook(_before_forward))
        _HOOKS.append(torch.nn.modules.module.register_module_forward_hook(_after_forward, always_call=True))


def _own_sharded(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None and hasattr(p, _ATTR)]


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    own = _own_sharded(module)
    if not own:
        return
    layouts = tuple(getattr(p, _ATTR) for _, p in own)
    fulls = _GatherParams.apply(layouts, *[p for _, p in own])
    live = []
    for (name, p), full, layout in zip(own, fulls, layouts):
        module.__dict__[name] = full  # found before Module.__getattr__ looks in _parameters
        if full._local.numel():
            key = full._local.untyped_storage().data_ptr()
            _LIVE[key] = _Regather(p, layout)  # type: ignore[arg-type]  # a DistTensor (has _ATTR)
            live.append(key)
    hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    hooks.__enter__()
    module.__dict__.setdefault(_CALLS, []).append((hooks, live))


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    calls = module.__dict__.get(_CALLS)
    if not calls:
        return
    hooks, live = calls.pop()
    hooks.__exit__(None, None, None)
    for key in live:
        _LIVE.pop(key, None)
    for name, _ in _own_sharded(module):
        module.__dict__.pop(name, None)


class _Regather:
    """Gathers one ZeRO-3 parameter again (backward); shares the result while it is alive."""

    def __init__(self, param: DistTensor, layout: Zero3Layout) -> None:
        self.param = weakref.ref(param)
        self.layout = layout
        self.cached: Any = None

    def local(self) -> torch.Tensor:
        full = self.cached() if self.cached is not None else None
        if full is None:
            param = self.param()
            assert param is not None, "a ZeRO-3 parameter was freed before its backward"
            coord = self.layout.full.mesh.coordinate_of(runtime.get_rank())
            assert coord is not None
            (full,) = buckets.all_gather(
                [param._local], [self.layout.dim], [self.layout.full.local_shape(coord)],
                self.layout.full.mesh, self.layout.axis,
            )
            self.cached = weakref.ref(full)
        return full


@dataclass(frozen=True)
class _Saved:
    """A saved DistTensor viewing a gathered parameter: what to gather and how to view it."""

    source: _Regather
    spec: DistSpec
    stride: tuple[int, ...]
    size: tuple[int, ...]
    local_stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor) -> Any:
    if isinstance(t, DistTensor) and _LIVE and t._local.numel():
        source = _LIVE.get(t._local.untyped_storage().data_ptr())
        if source is not None:
            loc = t._local
            return _Saved(source, t._spec, t._stride, tuple(loc.shape), tuple(loc.stride()), int(loc.storage_offset()))
    return t


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Saved):
        return saved
    local = saved.source.local().as_strided(saved.size, saved.local_stride, saved.offset)
    return DistTensor._wrap(local, saved.spec, saved.stride)


def _groups(layouts: tuple[Zero3Layout, ...], dtypes: list[torch.dtype]) -> dict[tuple[Any, ...], list[int]]:
    out: dict[tuple[Any, ...], list[int]] = {}
    for k, (lay, dt) in enumerate(zip(layouts, dtypes)):
        out.setdefault((lay.shard.mesh, lay.axis, dt), []).append(k)
    return out


class _GatherParams(torch.autograd.Function):
    """Shards -> gathered parameters (one all-gather per mesh, axis and dtype).

    Backward: gradients -> Partial over the axis -> one reduce-scatter into the shard layouts.
    """

    @staticmethod
    def forward(ctx: Any, layouts: tuple[Zero3Layout, ...], *params: DistTensor) -> tuple[DistTensor, ...]:  # type: ignore[override]
        ctx.layouts = layouts
        rank = runtime.get_rank()
        outs: list[DistTensor | None] = [None] * len(params)
        for (mesh, axis, _), idx in _groups(layouts, [p.dtype for p in params]).items():
            coord = mesh.coordinate_of(rank)
            if coord is None:
                fulls = [params[k]._local for k in idx]
            else:
                fulls = buckets.all_gather(
                    [params[k]._local for k in idx],
                    [layouts[k].dim for k in idx],
                    [layouts[k].full.local_shape(coord) for k in idx],
                    mesh, axis,
                )
            for k, full in zip(idx, fulls):
                outs[k] = DistTensor._wrap(full, layouts[k].full)
        return tuple(outs)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, *grads: DistTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        layouts: tuple[Zero3Layout, ...] = ctx.layouts
        rank = runtime.get_rank()
        out: list[DistTensor | None] = [None] * len(grads)
        live = [k for k, g in enumerate(grads) if g is not None]
        sub = tuple(layouts[k] for k in live)
        for (mesh, axis, _), idx in _groups(sub, [grads[k].dtype for k in live]).items():  # type: ignore[union-attr]
            ks = [live[i] for i in idx]
            summands = [_summand(grads[k], layouts[k]) for k in ks]  # type: ignore[arg-type]
            if mesh.coordinate_of(rank) is None:
                pieces = summands
            else:
                pieces = buckets.reduce_scatter(summands, [layouts[k].dim for k in ks], mesh, axis, "sum")
            for k, piece in zip(ks, pieces):
                out[k] = DistTensor._wrap(piece, layouts[k].shard)
        return (None, *out)


def _summand(grad: DistTensor, layout: Zero3Layout) -> torch.Tensor:
    """This rank's local summand of ``grad`` laid out as ``full`` but Partial(sum) on the axis."""
    placements = list(layout.full.placements)
    placements[layout.axis] = Partial("sum")
    target = layout.full.with_placements(placements, layout.full.shard_order)
    if grad._spec == target:
        return grad._local
    return reshard_local(grad._local, grad._spec, target)
