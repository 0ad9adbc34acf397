"""ZeRO-3 parameters: stored sharded, gathered per unit around its forward, freed after it.

``shard_parameter_`` changes a parameter's layout in place (same Python object, so the model
and the optimizer keep their references): the data-parallel axis goes from Replicate to Shard
and the local shard shrinks to a ``torch.chunk`` piece. Two process-wide module hooks (installed
on first use) then work per *unit*: the first module a forward reaches that holds ZeRO-3
parameters is a unit, and so is every child of an ``nn.ModuleList``/``nn.ModuleDict`` inside it
(a transformer's blocks); a unit owns the parameters of its submodules that are not units.

* before a unit's ``forward``: all-gather its parameters (one collective per mesh, axis and
  dtype) and let each module's attribute (``module.weight``) resolve to the gathered tensor;
* after it: drop those references.

While the unit runs, autograd saves no gathered parameter: a saved-tensor hook replaces any
tensor viewing a gathered parameter's storage (``weight.t()`` saved by ``addmm``, DistTensor or
the plain shard of a local region) with a token, and backward all-gathers the unit's parameters
again, in one collective, when the first token is unpacked. So full parameters live only while
their unit computes (forward) or its gradients are computed (backward).

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
_UNIT = "_ap_zero3_unit"    # per module: the _Unit that gathers its parameters (None: it has none)
_CALLS = "_ap_zero3_calls"  # per module: a stack of the unit calls its forward entered (or None)
_HOOKS: list[Any] = []  # the two global module hooks, once installed
_LIVE: dict[int, tuple["_UnitGather", int]] = {}  # storage address of a gathered local -> its source
_UNSET = object()
_GENERATION = [0]  # bumped whenever a parameter is sharded: unit assignments made before are stale


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
    _GENERATION[0] += 1
    _install_hooks()


def zero3_layout(p: torch.Tensor) -> Zero3Layout | None:
    return getattr(p, _ATTR, None)


def _install_hooks() -> None:
    if not _HOOKS:
        _HOOKS.append(torch.nn.modules.module.register_module_forward_pre_hook(_before_forward))
        _HOOKS.append(torch.nn.modules.module.register_module_forward_hook(_after_forward, always_call=True))


class _Unit:
    """The ZeRO-3 parameters one module gathers in one collective: its own and those of every
    submodule that is not a unit itself. The module a forward first reaches is a unit, and so is
    each child of an ``nn.ModuleList``/``nn.ModuleDict`` (a transformer's blocks): like FSDP
    wrapping each block and the root, one all-gather per block in forward and one in backward."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.slots: list[tuple[torch.nn.Module, str]] = []
        self.active = 0

    def gather(self) -> "_UnitCall":
        """All-gather the unit's parameters; their modules' attributes resolve to the result."""
        params: list[DistTensor] = []
        index: dict[int, int] = {}
        where: list[int | None] = []
        for m, a in self.slots:
            p = m._parameters[a]
            if p is None or not hasattr(p, _ATTR):
                where.append(None)
                continue
            where.append(index.setdefault(id(p), len(params)))
            if where[-1] == len(params):
                params.append(p)  # type: ignore[arg-type]  # a DistTensor (has _ATTR)
        layouts = tuple(getattr(p, _ATTR) for p in params)
        source = _UnitGather(params, layouts)
        fulls = _GatherParams.apply(layouts, source, *params)
        for (m, a), k in zip(self.slots, where):
            if k is not None:
                m.__dict__[a] = fulls[k]  # found before Module.__getattr__ looks in _parameters
        live = []
        for k, full in enumerate(fulls):
            if full._local.numel():
                key = full._local.untyped_storage().data_ptr()
                _LIVE[key] = (source, k)
                live.append(key)
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        self.active += 1
        return _UnitCall(self, hooks, live)


@dataclass
class _UnitCall:
    unit: _Unit
    hooks: Any
    live: list[int]

    def close(self) -> None:
        self.hooks.__exit__(None, None, None)
        for key in self.live:
            _LIVE.pop(key, None)
        self.unit.active -= 1
        if not self.unit.active:
            for m, a in self.unit.slots:
                m.__dict__.pop(a, None)


def _assign(module: torch.nn.Module, unit: _Unit) -> None:
    module.__dict__[_UNIT] = (_GENERATION[0], unit)
    unit.slots += [(module, a) for a, p in module._parameters.items() if p is not None and hasattr(p, _ATTR)]
    for child in module.children():
        _assign(child, _Unit(child) if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) else unit)


def _unit_of(module: torch.nn.Module) -> _Unit | None:
    """The unit gathering ``module``'s parameters; assigned when a forward first reaches it (the
    outermost module first), again after any parameter was sharded since."""
    entry = module.__dict__.get(_UNIT, _UNSET)
    if entry is _UNSET or entry[0] != _GENERATION[0]:  # type: ignore[index]
        if not any(hasattr(p, _ATTR) for p in module.parameters()):
            module.__dict__[_UNIT] = (_GENERATION[0], None)
            return None
        _assign(module, _Unit(module))
        entry = module.__dict__[_UNIT]
    return entry[1]  # type: ignore[index,no-any-return]


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    unit = _unit_of(module)
    if unit is None:
        return
    call = None
    if unit.root is module:
        call = unit.gather()
    elif not unit.active:  # called on its own, outside the unit that owns it: gather its own
        own = _Unit(module)
        own.slots = [(m, a) for m, a in unit.slots if m is module]
        call = own.gather() if own.slots else None
    module.__dict__.setdefault(_CALLS, []).append(call)


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    calls = module.__dict__.get(_CALLS)
    if calls:
        call = calls.pop()
        if call is not None:
            call.close()


class _UnitGather:
    """Gathers a unit's parameters again for backward, all in one collective, and keeps them
    until the unit's gather node runs its backward (every use of them is done by then)."""

    def __init__(self, params: list[DistTensor], layouts: tuple[Zero3Layout, ...]) -> None:
        self.params = [weakref.ref(p) for p in params]
        self.layouts = layouts
        self.cached: list[torch.Tensor] | None = None

    def local(self, k: int) -> torch.Tensor:
        if self.cached is None:
            params = [ref() for ref in self.params]
            assert all(p is not None for p in params), "a ZeRO-3 parameter was freed before its backward"
            self.cached = _gather_locals(params, self.layouts)  # type: ignore[arg-type]
        return self.cached[k]

    def release(self) -> None:
        self.cached = None


@dataclass(frozen=True)
class _Saved:
    """A saved tensor viewing a gathered parameter: what to gather and how to view it."""

    source: _UnitGather
    index: int
    spec: DistSpec | None  # None: a plain (local) tensor, saved inside a local region
    stride: tuple[int, ...] | None
    size: tuple[int, ...]
    local_stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor) -> Any:
    if not _LIVE:
        return t
    loc = t._local if isinstance(t, DistTensor) else t
    if loc.layout != torch.strided or not loc.numel():
        return t
    found = _LIVE.get(loc.untyped_storage().data_ptr())
    if found is None:
        return t
    spec, stride = (t._spec, t._stride) if isinstance(t, DistTensor) else (None, None)
    return _Saved(found[0], found[1], spec, stride, tuple(loc.shape), tuple(loc.stride()), int(loc.storage_offset()))


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Saved):
        return saved
    local = saved.source.local(saved.index).as_strided(saved.size, saved.local_stride, saved.offset)
    return local if saved.spec is None else DistTensor._wrap(local, saved.spec, saved.stride)


def _gather_locals(params: list[DistTensor], layouts: tuple[Zero3Layout, ...]) -> list[torch.Tensor]:
    """The full local tensors of ``params`` (one all-gather per mesh, axis and dtype)."""
    rank = runtime.get_rank()
    outs: list[torch.Tensor | None] = [None] * len(params)
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
            outs[k] = full
    return outs  # type: ignore[return-value]


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
    def forward(ctx: Any, layouts: tuple[Zero3Layout, ...], source: _UnitGather, *params: DistTensor) -> tuple[DistTensor, ...]:  # type: ignore[override]
        ctx.layouts = layouts
        ctx.source = source
        fulls = _gather_locals(list(params), layouts)
        return tuple(DistTensor._wrap(full, lay.full) for full, lay in zip(fulls, layouts))

    @staticmethod
    def backward(ctx: Any, *grads: DistTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.source.release()  # every use of the gathered parameters is behind us
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
        return (None, None, *out)


def _summand(grad: DistTensor, layout: Zero3Layout) -> torch.Tensor:
    """This rank's local summand of ``grad`` laid out as ``full`` but Partial(sum) on the axis."""
    placements = list(layout.full.placements)
    placements[layout.axis] = Partial("sum")
    target = layout.full.with_placements(placements, layout.full.shard_order)
    if grad._spec == target:
        return grad._local
    return reshard_local(grad._local, grad._spec, target)
