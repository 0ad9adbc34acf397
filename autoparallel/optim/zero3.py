"""ZeRO-3 parameters: stored sharded, gathered per unit around its forward, freed after it.

A stage-3 ``ShardedOptimizer`` owns one :class:`Zero3Params`: the parameters it sharded, the
hooks that gather them and their state. ``Zero3Params.shard_`` changes a parameter's layout in
place (same Python object, so the model and the optimizer keep their references): the
data-parallel axis goes from Replicate to Shard and the local shard shrinks to a
``torch.chunk`` piece.

The hooks are per model, and owned. The optimizer is given parameters, not the model, so until
a forward reaches a module holding them one process-wide forward pre-hook (the *finder*) looks
at module calls: the first module it sees holding some of the owner's parameters is a model's
root, and it and every submodule get their own forward pre/post hooks, ahead of the module's
other hooks. Once one root holds every live parameter of the owner the finder is removed, and
other models' forwards run no ZeRO-3 code. The state is the owner's (the gathered storages, the
generation) and the model's (each module's unit and calls, kept per owner), never a module
global, so nothing depends on import order or on what another model did. The per-module hooks
die with the model's modules; when the owner's last parameter dies, the finder and every hook
it registered are removed. The hooks are tied to the parameters' life, not the optimizer's:
the parameters stay stored sharded after the optimizer is gone (``ap.shard_optimizer(...)``
may be called for its effect alone) and must still be gathered. Parameters of one model
sharded by two stage-3 optimizers are gathered by each owner's units (one collective each).

The hooks work per *unit*: the first module a forward reaches that holds ZeRO-3 parameters is a
unit, and so is every child of an ``nn.ModuleList``/``nn.ModuleDict`` inside it (a
transformer's blocks); a unit owns the parameters of its submodules that are not units.

* before a unit's ``forward``: all-gather its parameters (one collective per mesh, axis and
  dtype) and let each module's attribute (``module.weight``) resolve to the gathered tensor;
* after it: drop those references.

The outermost unit (the model's own: its embedding, head and norms) is the exception, as FSDP2's
root is: its forward ends just before the loss, and its backward begins right after it and
needs its parameters first, so it keeps its gathered parameters until its backward instead of
gathering them again (the latest forward's only: an earlier one's backward gathers again).

While the unit runs, autograd saves no gathered parameter: a saved-tensor hook replaces any
tensor viewing a gathered parameter's storage (``weight.t()`` saved by ``addmm``, DistTensor or
the plain shard of a local region) with a token, and backward all-gathers the unit's parameters
again, in one collective, when the first token is unpacked. So full parameters live only while
their unit computes (forward) or its gradients are computed (backward).

The gather is an autograd function whose backward is the mirror image: the gradients (Partial
over the data-parallel axis) are reduce-scattered in one collective straight into the shard
layout, so a full gradient never persists. Each gradient is copied once, into the collective's
one buffer (``buckets.reduce_scatter``): beside the unit's gradients, which autograd holds
until this backward returns, the reduction makes one full-size buffer, no more.

With ``ShardingStage3(..., overlap=True)`` (``Zero3Params.overlap``) communication runs beside
compute, one unit ahead at most. The order units gather in (forward) and regather in (backward)
is learned from the previous step, as the module calls come, so it is the same on every rank.
When a unit has gathered, the next unit's all-gather is started (``_Ahead``) and its unit waits
for it on its turn; when a unit has regathered in backward, the next one to regather (a unit whose
forward saved gathered tensors) is started likewise. A guess that turns out wrong is waited for
and dropped (every member started it), and nothing started in a forward outlives it. A unit's
reduce-scatter is started and its gradients returned as awaited values
(``layout.awaited``: any read waits), the reduction before it waited for first, so one is in
flight. Inside a recomputed region, or while a program is captured, nothing runs ahead.

Mixed precision (``ap.MixedPrecision``, ``optim.precision``) rides on the same units. A ZeRO-3
parameter's layout then names a compute dtype: the shard is cast before the all-gather (half the
bytes for bf16) and the reduce-scatter runs in the policy's reduce dtype, the result cast to the
master's dtype. A parameter that is not sharded (DP, ZeRO-1/2, or one ZeRO-3 leaves whole) is
owned with no axis: its unit's "gather" is the cast alone, its backward casts the gradient back
to the master's dtype (left Partial, for ``ShardedOptimizer.reduce_gradients``). Either way the
module's attribute resolves to the compute copy while its unit runs, the saved-tensor hook keeps
no copy between forward and backward (backward casts again), and the unit's forward casts the
floating tensors it is given to the compute dtype (``MixedPrecision.cast_inputs``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from autoparallel import compat, runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.optim import buckets
from autoparallel.placement import Partial, Replicate, chunk_bounds
from autoparallel.runtime.comm import capturing, profiled
from autoparallel.spec import DistSpec

_ATTR = "_ap_zero3"         # per parameter: its Zero3Layout
_SEATS = "_ap_zero3_seats"  # per module: {owner: _Seat}, what each Zero3Params keeps on it


@dataclass(frozen=True)
class Zero3Layout:
    """A ZeRO-3 parameter's layouts: ``shard`` (stored) and ``full`` (gathered, used).

    ``axis`` None: a parameter owned for its compute copy only (``shard == full``). ``compute``:
    the dtype the unit casts it to (None: its own); ``reduce``: the dtype its gradient is
    reduce-scattered in (None: the gradient's own).
    """

    axis: int | None
    shard: DistSpec
    full: DistSpec
    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None

    @property
    def dim(self) -> int:
        assert self.axis is not None, "a parameter owned for its compute copy is not sharded"
        return self.shard.placements[self.axis].dim  # type: ignore[union-attr]

    @property
    def used(self) -> DistSpec:
        """The layout the unit's forward sees: the full layout in the compute dtype."""
        return self.full if self.compute is None else self.full.with_dtype(self.compute)


def zero3_layout(p: torch.Tensor) -> Zero3Layout | None:
    return getattr(p, _ATTR, None)


class _Seat:
    """What one owner keeps on one module: its unit (assigned at ``generation``), the unit calls
    its forward entered (a stack; None for a call that gathered nothing), whether it is hooked."""

    __slots__ = ("generation", "unit", "calls", "hooked")

    def __init__(self) -> None:
        self.generation = -1
        self.unit: _Unit | None = None
        self.calls: list[_UnitCall | None] = []
        self.hooked = False


class _Live(dict[int, tuple["_UnitGather", int]]):
    """The storage address of each gathered parameter's local (while its unit runs) -> its source
    and index; its ``pack`` is the saved-tensor hook, so a kept graph pins this map, not the owner."""

    @compat.mark_own_observer
    def pack(self, t: torch.Tensor) -> Any:
        if not self:
            return t
        loc = layout.local_or_plain(t)
        if loc.layout != torch.strided or not loc.numel():
            return t
        found = self.get(compat.storage_id(loc))
        if found is None:
            return t
        spec, stride = (layout.spec_of(t), layout.stride_of(t)) if layout.is_dist(t) else (None, None)
        found[0].saved = True
        return _Saved(found[0], found[1], spec, stride, tuple(loc.shape), tuple(loc.stride()), int(loc.storage_offset()))


class Zero3Params:
    """The parameters one stage-3 optimizer sharded, and the per-model hooks that gather them."""

    def __init__(self) -> None:
        self.generation = 0  # bumped whenever a parameter is sharded: units assigned before are stale
        self.live = _Live()
        self._params: dict[int, weakref.ref[DistTensor]] = {}  # id -> the live sharded parameters
        self._roots: list[weakref.ref[nn.Module]] = []  # the models' roots the finder found
        self._hooks: list[tuple[weakref.ref[nn.Module], RemovableHandle, RemovableHandle]] = []
        self._finder: RemovableHandle | None = None  # the process-wide pre-hook, while needed
        self._recheck = False  # parameters were sharded after roots were found: do they hold them?
        # modules the finder saw holding none of the parameters: id -> (module, generation then)
        self._plain: dict[int, tuple[weakref.ref[nn.Module], int]] = {}
        self.cast_inputs: torch.dtype | None = None  # mixed precision: a unit's floating inputs -> this
        self.overlap = False  # prefetch one unit ahead; reduce-scatter without waiting
        self._running = 0  # unit calls whose forward runs (0: between forwards)
        self._chain: _Unit | None = None  # the unit this forward gathered last (learns the order)
        self._ahead: _Unit | None = None  # the unit whose forward gather was started early
        self._regathered: weakref.ref[_Unit] | None = None  # the unit the backward regathered last
        self._back_ahead: weakref.ref[_UnitGather] | None = None  # the regather started early last
        self._reduction: Any = None  # the reduce-scatter in flight (at most one)

    # ---- parameters -----------------------------------------------------------------------
    def shard_(self, p: DistTensor, axis: int, shard: DistSpec,
               compute: torch.dtype | None = None, reduce: torch.dtype | None = None) -> None:
        """Store ``p`` in layout ``shard`` from now on (in place; no data moves: a local slice);
        gather it cast to ``compute`` and reduce-scatter its gradient in ``reduce``."""
        full = layout.spec_of(p)
        lay = Zero3Layout(axis, shard, full, compute, reduce)
        local = layout.local_of(p)
        coord = full.mesh.coordinate_of(runtime.get_rank())
        if coord is not None:
            local = local.narrow(lay.dim, *chunk_bounds(local.shape[lay.dim], full.mesh.shape[axis], coord[axis])).clone()
        layout.relayout_(p, local, shard)
        self._own(p, lay)

    def cast_(self, p: DistTensor, compute: torch.dtype) -> None:
        """Keep ``p`` as it is, but let its unit's forward see it cast to ``compute``."""
        spec = layout.spec_of(p)
        self._own(p, Zero3Layout(None, spec, spec, compute))

    def _own(self, p: DistTensor, lay: Zero3Layout) -> None:
        setattr(p, _ATTR, lay)
        key = id(p)
        self._params[key] = weakref.ref(p, functools.partial(self._gone, key))
        self.generation += 1
        self._recheck = bool(self._roots)
        if self._finder is None:
            self._finder = torch.nn.modules.module.register_module_forward_pre_hook(self._find)

    def owns(self, p: Any) -> bool:
        """Whether ``p`` is a live parameter this owner sharded."""
        ref = self._params.get(id(p))
        return ref is not None and ref() is p

    def _gone(self, key: int, ref: weakref.ref[DistTensor]) -> None:
        """A parameter died; with the last one every hook this owner registered goes."""
        if self._params.get(key) is ref:
            del self._params[key]
        if self._params:
            return
        self._stop_finding()
        for module_ref, pre, post in self._hooks:
            pre.remove()
            post.remove()
            module = module_ref()
            if module is not None:
                module.__dict__.get(_SEATS, {}).pop(self, None)
        self._hooks.clear()
        self._roots.clear()

    # ---- finding the models ---------------------------------------------------------------
    def hook_model(self, module: nn.Module) -> None:
        """Hook ``module`` (a model holding parameters of this owner) now, as its first forward
        would: for a caller that knows the model before it runs (``ap.to_static``), so the
        first call already has the hooks every later call has (one signature, one program)."""
        if self._seat_hooked(module) or not any(self.owns(p) for p in module.parameters()):
            return
        self._roots.append(weakref.ref(module))
        if self._hook(module):
            self._stop_finding()

    def _find(self, module: nn.Module, args: Any) -> Any:
        """The process-wide pre-hook while no found root holds every parameter: a module holding
        some of them that is not hooked yet is a root; hook it and its submodules, and do its
        pre-hook's work for this call (its own hook runs from the next call on)."""
        hooked = self._seat_hooked(module)
        if self._recheck:  # parameters sharded since the roots were hooked (add_param_group)
            self._recheck = False
            roots = [m for m in (r() for r in self._roots) if m is not None]
            if any([self._hook(m) for m in roots]):  # a list: every root's new submodules hooked
                self._stop_finding()
        if hooked:
            return None
        if not self._seat_hooked(module):
            seen = self._plain.get(id(module))
            if seen is not None and seen[1] == self.generation and seen[0]() is module:
                return None
            if not any(self.owns(p) for p in module.parameters()):
                key = id(module)
                self._plain[key] = (weakref.ref(module, functools.partial(self._unsee, key)), self.generation)
                return None
            self._roots.append(weakref.ref(module))
            if self._hook(module):
                self._stop_finding()
        return self._before(module, args)

    def _unsee(self, key: int, ref: weakref.ref[nn.Module]) -> None:
        self._plain.pop(key, None)

    def _seat_hooked(self, module: nn.Module) -> bool:
        seat = module.__dict__.get(_SEATS, {}).get(self)
        return seat is not None and seat.hooked

    def _stop_finding(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None

    def _hook(self, root: nn.Module) -> bool:
        """Hook ``root`` and its submodules (once each); whether the roots found so far hold
        every live parameter this rank has a shard of (a pipeline rank never runs the modules of
        another stage, whose parameters no forward on it could find: with its own stage found,
        the process-wide pre-hook goes)."""
        for m in root.modules():
            seat = self._seat(m)
            if not seat.hooked:
                seat.hooked = True
                pre = m.register_forward_pre_hook(compat.QuietHook(self._before, self._quiet), prepend=True)
                post = m.register_forward_hook(compat.QuietHook(self._after, self._quiet), prepend=True, always_call=True)
                self._hooks.append((weakref.ref(m), pre, post))
        held = {id(p) for r in self._roots if (found := r()) is not None for p in found.parameters()}  # root among them
        rank = runtime.get_rank()
        return all(k in held or (p := ref()) is None or layout.spec_of(p).mesh.coordinate_of(rank) is None
                   for k, ref in self._params.items())

    # ---- units ----------------------------------------------------------------------------
    def _seat(self, module: nn.Module) -> _Seat:
        seats = module.__dict__.get(_SEATS)
        if seats is None:
            seats = module.__dict__[_SEATS] = {}
        seat = seats.get(self)
        if seat is None:
            seat = seats[self] = _Seat()
        return seat

    def _assign(self, module: nn.Module, unit: _Unit) -> None:
        seat = self._seat(module)
        seat.generation, seat.unit = self.generation, unit
        unit.slots += [(module, a) for a, p in compat.own_parameters(module).items() if p is not None and self.owns(p)]
        for child in module.children():
            self._assign(child, _Unit(self, child) if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else unit)

    def _unit_of(self, module: nn.Module) -> _Unit | None:
        """The unit gathering ``module``'s parameters; assigned when a forward first reaches it (the
        outermost module first), again after any parameter was sharded since."""
        seat = self._seat(module)
        if seat.generation != self.generation:
            if not any(self.owns(p) for p in module.parameters()):
                seat.generation, seat.unit = self.generation, None
                return None
            self._assign(module, _Unit(self, module, outermost=True))
        return seat.unit

    def _before(self, module: nn.Module, args: Any) -> Any:
        seat = self._seat(module)
        unit = seat.unit if seat.generation == self.generation else self._unit_of(module)
        if unit is None:
            return None
        call = None
        if unit.root is module:
            call = unit.gather()
        elif not unit.active:  # called on its own, outside the unit that owns it: gather its own
            own = _Unit(self, module)
            own.slots = [(m, a) for m, a in unit.slots if m is module]
            call = own.gather() if own.slots else None
        seat.calls.append(call)
        dtype = self.cast_inputs
        if dtype is None or call is None:
            return None
        leaves, tree = compat.tree_flatten(args)
        return compat.tree_unflatten([_cast_input(dtype, x) for x in leaves], tree)

    def _quiet(self, module: nn.Module) -> bool:
        """Whether ``module``'s hooks do nothing now: a submodule of a unit that has gathered
        (its parameters are the unit's), or a module owning none of this owner's parameters."""
        seat = self._seat(module)
        if seat.generation != self.generation:
            return False
        unit = seat.unit
        return unit is None or (unit.root is not module and unit.active > 0)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        calls = self._seat(module).calls
        if calls:
            call = calls.pop()
            if call is not None:
                call.close()

    # ---- overlap: one unit ahead -----------------------------------------------------------
    # The order units gather in is learned from the previous forward (and backward): the same
    # on every rank, like the module calls themselves. A unit's gather is started (async) when
    # the unit before it in that order has gathered, and waited for when its own turn comes; a
    # wrong guess (the model took another path) waits for the started gather and drops it.
    def _overlapping(self) -> bool:
        return self.overlap and not capturing()

    def starting(self) -> None:
        """A unit call begins; the first of a forward starts a new chain."""
        if not self._running and not compat.in_backward():  # (a recomputation's forward is not)
            self._chain = None
            self._regathered = None
        self._running += 1

    def stopping(self) -> None:
        """A unit call ends; with the last one the forward is over and nothing stays prefetched."""
        self._running -= 1
        if not self._running:
            self._chain = None
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        unit, self._ahead = self._ahead, None
        if unit is not None and unit.ahead is not None:
            unit.ahead.finish()  # every member started it: wait, then let it go
            unit.ahead = None

    def gathered(self, unit: _Unit, source: _UnitGather) -> None:
        """``unit``'s forward gathered its parameters: learn the order, start the next one."""
        if compat.in_backward():
            return  # a recomputation's gather: not the forward's order
        unit.source = weakref.ref(source)
        last = self._chain
        if last is not None and last is not unit:
            last.next = weakref.ref(unit)
        self._chain = unit
        if self._ahead is unit:
            self._ahead = None
        nxt = unit.next() if unit.next is not None else None
        if (nxt is None or nxt is unit or nxt.active or nxt.ahead is not None or nxt.recomputed
                or nxt.generation != self.generation or not self._overlapping()):
            return
        self._drop_ahead()
        nxt.ahead = _Ahead.start(*nxt.members()[:2], self.generation, "autoparallel::zero3_prefetch")
        self._ahead = nxt

    def regathered(self, source: _UnitGather) -> None:
        """The backward reached ``source``'s unit (it regathered its parameters, or first used those
        the outermost unit kept since its forward): learn the order, start the next one's regather
        (a unit whose forward saved gathered tensors, not regathered yet)."""
        unit = source.unit()
        if unit is None:
            return
        last = self._regathered() if self._regathered is not None else None
        if last is not None and last is not unit:
            last.bnext = weakref.ref(unit)
        self._regathered = weakref.ref(unit)
        nxt = unit.bnext() if unit.bnext is not None else None
        src = nxt.source() if nxt is not None and nxt.source is not None else None
        if (src is None or src is source or not src.saved or src.done or src.cached is not None
                or src.ahead is not None or not self._overlapping()):
            return
        before = self._back_ahead() if self._back_ahead is not None else None
        if before is not None and before.ahead is not None:
            return  # the last one started is not taken yet (a wrong guess): one at a time
        params = [ref() for ref in src.params]
        if any(p is None for p in params):
            return
        if nxt is not None:  # (it is: src is its source)
            nxt.unkeep(but=src)  # another forward's kept copy goes before this one is made
        src.ahead = _Ahead.start(params, src.layouts, self.generation, "autoparallel::zero3_prefetch")  # type: ignore[arg-type]
        self._back_ahead = weakref.ref(src)

    def reduction(self, work: Any) -> None:
        """A reduce-scatter was started: the one before it is waited for (one in flight)."""
        before, self._reduction = self._reduction, work
        if before is not None:
            before.wait()


class _Ahead:
    """A gather started before its turn: the parameters it read (and their shards' versions),
    the owner's generation then, and the pending result."""

    def __init__(self, params: list[DistTensor], generation: int, finish: Any) -> None:
        self.params = [weakref.ref(p) for p in params]
        self.versions = [layout.local_of(p)._version for p in params]
        self.generation = generation
        self.finish = finish

    @classmethod
    def start(cls, params: list[DistTensor], layouts: tuple[Zero3Layout, ...], generation: int, name: str) -> _Ahead:
        with profiled(name):
            return cls(params, generation, _gather_locals(params, layouts, wait=False))

    def take(self, params: list[DistTensor], generation: int) -> list[torch.Tensor] | None:
        """The gathered tensors if they are still those of ``params`` (else None: gather again)."""
        fulls = self.finish()  # waited for either way: every member started it
        if generation != self.generation or len(params) != len(self.params):
            return None
        if any(ref() is not p or layout.local_of(p)._version != v for ref, p, v in zip(self.params, params, self.versions)):
            return None
        return fulls  # type: ignore[no-any-return]


class _Unit:
    """The ZeRO-3 parameters one module gathers in one collective: its own and those of every
    submodule that is not a unit itself. The module a forward first reaches is a unit, and so is
    each child of an ``nn.ModuleList``/``nn.ModuleDict`` (a transformer's blocks): like FSDP
    wrapping each block and the root, one all-gather per block in forward and one in backward."""

    def __init__(self, owner: Zero3Params, root: nn.Module, outermost: bool = False) -> None:
        self.owner = owner
        self.root = root
        self.outermost = outermost  # the model's own unit: kept gathered from its forward to its backward
        self.kept: weakref.ref[_UnitGather] | None = None  # the forward whose gathered parameters it keeps
        self.slots: list[tuple[nn.Module, str]] = []
        self.active = 0
        self.generation = owner.generation
        self.next: weakref.ref[_Unit] | None = None  # the unit gathered after it in the last forward
        self.bnext: weakref.ref[_Unit] | None = None  # ... regathered after it in the last backward
        self.ahead: _Ahead | None = None  # its forward gather, started early
        self.source: weakref.ref[_UnitGather] | None = None  # its last forward's gather
        self.recomputed = False  # its last forward ran inside a recomputed region

    def members(self) -> tuple[list[DistTensor], tuple[Zero3Layout, ...], list[int | None]]:
        """(the owned parameters, each once; their layouts; per slot its index, None: not owned)."""
        owner = self.owner
        params: list[DistTensor] = []
        index: dict[int, int] = {}
        where: list[int | None] = []
        for m, a in self.slots:
            p = compat.own_parameters(m)[a]
            if p is None or not owner.owns(p):
                where.append(None)
                continue
            where.append(index.setdefault(id(p), len(params)))
            if where[-1] == len(params):
                params.append(p)  # type: ignore[arg-type]  # a DistTensor (owned)
        return params, tuple(getattr(p, _ATTR) for p in params), where

    def gather(self) -> _UnitCall:
        """All-gather the unit's parameters; their modules' attributes resolve to the result."""
        owner = self.owner
        params, layouts, where = self.members()
        ahead, self.ahead = self.ahead, None
        ready = ahead.take(params, owner.generation) if ahead is not None else None
        del ahead  # (its buffers go before the next unit's gather starts)
        # A recomputed region (torch's checkpoint) replays this forward in backward, where its
        # gather runs whole; its first run must run the same ops: no gather ahead of its turn.
        self.recomputed = compat.foreign_saved_hooks()
        if self.recomputed:
            ready = None
        if not compat.in_backward():  # (a recomputation's forward: the kept ones are for the backward)
            self.unkeep()
        source = _UnitGather(self, params, layouts)
        fulls = _GatherParams.apply(layouts, source, ready, *params)
        self._keep(source, fulls)
        owner.starting()  # (after the gather: one that raised leaves no call running)
        owner.gathered(self, source)
        for (m, a), k in zip(self.slots, where):
            if k is not None:
                m.__dict__[a] = fulls[k]  # found before Module.__getattr__ looks in _parameters
        live = []
        for k, full in enumerate(fulls):
            local = layout.local_of(full)
            if local.numel():
                key = compat.storage_id(local)
                owner.live[key] = (source, k)
                live.append(key)
        # Inside a recomputed region the checkpoint keeps no gathered parameter (its recompute
        # gathers the unit again: the backward's one all-gather); our hook would take the
        # region's saves away from it, so none is installed.
        # Likewise under torch's checkpoint (or offloading hooks): theirs stay on top.
        hooks = (contextlib.nullcontext() if compat.foreign_saved_hooks()
                 else torch.autograd.graph.saved_tensors_hooks(owner.live.pack, _unpack))
        hooks.__enter__()
        self.active += 1
        return _UnitCall(self, hooks, live)

    def _keep(self, source: _UnitGather, fulls: tuple[DistTensor, ...]) -> None:
        """The outermost unit keeps its gathered parameters until its backward (FSDP2 leaves its
        root unsharded after forward): its backward starts as soon as the loss is computed, and
        would gather them again at once. None for a forward without autograd or one run in a
        recomputation."""
        if not self.outermost or self.recomputed or not torch.is_grad_enabled() or compat.in_backward():
            return
        source.cached = [layout.local_of(f) for f in fulls]
        self.kept = weakref.ref(source)

    def unkeep(self, but: _UnitGather | None = None) -> None:
        """Drop the kept parameters (their backward gathers them again) unless they are ``but``'s:
        another forward of the unit starts before the kept one's backward, or another forward's
        backward regathers (gradient accumulation, pipeline micro-batches). So the unit has no
        more gathered copies alive than without keeping."""
        kept = self.kept() if self.kept is not None else None
        if kept is None or kept is but:
            return
        self.kept = None
        if not kept.done:
            kept.cached = None


@dataclass
class _UnitCall:
    unit: _Unit
    hooks: Any
    live: list[int]

    def close(self) -> None:
        self.hooks.__exit__(None, None, None)
        for key in self.live:
            self.unit.owner.live.pop(key, None)
        self.unit.active -= 1
        if not self.unit.active:
            for m, a in self.unit.slots:
                m.__dict__.pop(a, None)
        self.unit.owner.stopping()


class _UnitGather:
    """Gathers a unit's parameters again for backward, all in one collective, and keeps them
    until the unit's gather node runs its backward (every use of them is done by then)."""

    def __init__(self, unit: _Unit, params: list[DistTensor], layouts: tuple[Zero3Layout, ...]) -> None:
        # (weak: autograd keeps this object as long as any tensor made from the gathered
        # parameters lives, and it must not keep the model's modules alive through the unit)
        self.unit = weakref.ref(unit)
        self.owner = weakref.ref(unit.owner)
        self.params = [weakref.ref(p) for p in params]
        self.layouts = layouts
        self.cached: list[torch.Tensor] | None = None
        self.saved = False  # the forward saved a tensor viewing a gathered parameter
        self.done = False  # the unit's backward is over
        self.ahead: _Ahead | None = None  # the regather, started early
        self.announced = False  # the backward has used its parameters (the next regather may start)

    def local(self, k: int) -> torch.Tensor:
        if self.cached is None:
            params = [ref() for ref in self.params]
            assert all(p is not None for p in params), "a ZeRO-3 parameter was freed before its backward"
            unit = self.unit()
            if unit is not None:
                unit.unkeep(but=self)  # another forward's kept copy goes before this one is made
            owner = self.owner()
            ahead, self.ahead = self.ahead, None
            self.cached = ahead.take(params, owner.generation) if ahead is not None and owner is not None else None  # type: ignore[arg-type]
            del ahead  # (its buffers go before the next unit's regather starts)
            if self.cached is None:
                with profiled("autoparallel::zero3_regather"):
                    self.cached = _gather_locals(params, self.layouts)  # type: ignore[arg-type]
        if not self.announced:  # the backward reached this unit (regathered, or kept since its forward)
            self.announced = True
            owner = self.owner()
            if owner is not None:
                owner.regathered(self)
        return self.cached[k]

    def release(self) -> None:
        self.cached = None
        self.done = True
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.finish()  # started on every member: waited for, then dropped


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


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Saved):
        return saved
    local = saved.source.local(saved.index).as_strided(saved.size, saved.local_stride, saved.offset)
    return local if saved.spec is None else layout.wrap(local, saved.spec, saved.stride)


def _gather_locals(params: list[DistTensor], layouts: tuple[Zero3Layout, ...], wait: bool = True) -> Any:
    """The full local tensors of ``params`` in their compute dtypes (one all-gather per mesh,
    axis and dtype; a parameter owned for its compute copy only is cast, not gathered).
    ``wait=False``: the all-gathers are started and a function returned that waits for them
    and returns the tensors."""
    rank = runtime.get_rank()
    parts: list[tuple[list[int], Any]] = []
    dtypes = [lay.compute or p.dtype for p, lay in zip(params, layouts)]
    for (mesh, axis, dtype), idx in _groups(layouts, dtypes).items():
        locs = [layout.local_of(params[k]).to(dtype) for k in idx]  # a cast before the gather
        coord = mesh.coordinate_of(rank)
        if axis is None or coord is None:
            parts.append((idx, locs))
            continue
        args = (locs, [layouts[k].dim for k in idx], [layouts[k].full.local_shape(coord) for k in idx], mesh, axis)
        parts.append((idx, buckets.all_gather(*args) if wait else buckets.all_gather_start(*args)))
    n = len(params)

    def collect() -> list[torch.Tensor]:
        outs: list[Any] = [None] * n
        for idx, fulls in parts:
            for k, full in zip(idx, fulls if isinstance(fulls, list) else fulls()):
                outs[k] = full
        return outs

    if wait:
        return collect()
    done: list[list[torch.Tensor]] = []

    def once() -> list[torch.Tensor]:
        if not done:
            done.append(collect())
            parts.clear()  # the gathered buffers, unpacked: freed now
        return done[0]

    return once


def _groups(layouts: tuple[Zero3Layout, ...], dtypes: list[torch.dtype]) -> dict[tuple[Any, ...], list[int]]:
    out: dict[tuple[Any, ...], list[int]] = {}
    for k, (lay, dt) in enumerate(zip(layouts, dtypes)):
        out.setdefault((lay.shard.mesh, lay.axis, dt), []).append(k)
    return out


def _cast_input(dtype: torch.dtype, x: Any) -> Any:
    """A floating tensor a unit's forward is given, in the compute dtype (anything else as it is)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


class _GatherParams(torch.autograd.Function):
    """Shards -> gathered parameters in their compute dtypes (one all-gather per mesh, axis and dtype).

    Backward: gradients -> (reduce dtype) -> Partial over the axis -> one reduce-scatter into the
    shard layouts -> the masters' dtype. A parameter with no axis: the gradient cast back, as is.
    A parameter with no gradient (unused this step): None, no collective for it.
    """

    @staticmethod
    def forward(ctx: Any, layouts: tuple[Zero3Layout, ...], source: _UnitGather, ready: list[torch.Tensor] | None,  # type: ignore[override]
                *params: DistTensor) -> tuple[DistTensor, ...]:
        ctx.layouts = layouts
        ctx.source = source
        # A parameter its unit did not use (an unused head, a branch not taken) gets no gradient:
        # None in backward, not a zero tensor autograd would make without a layout, so it stays
        # None, as without ZeRO-3, and the optimizer skips it.
        ctx.set_materialize_grads(False)
        if ready is None:  # (else: gathered ahead of its turn, waited for)
            with profiled("autoparallel::zero3_gather"):
                ready = _gather_locals(list(params), layouts)
        return tuple(layout.wrap(full, lay.used) for full, lay in zip(ready, layouts))

    @staticmethod
    def backward(ctx: Any, *grads: DistTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.source.release()  # every use of the gathered parameters is behind us
        owner: Zero3Params | None = ctx.source.owner()
        layouts: tuple[Zero3Layout, ...] = ctx.layouts
        rank = runtime.get_rank()
        out: list[DistTensor | None] = [None] * len(grads)
        live = [k for k, g in enumerate(grads) if g is not None]
        sub = tuple(layouts[k] for k in live)
        wire = [layouts[k].reduce or grads[k].dtype for k in live]  # type: ignore[union-attr]
        with profiled("autoparallel::zero3_reduce_scatter"):
            for (mesh, axis, dtype), idx in _groups(sub, wire).items():
                ks = [live[i] for i in idx]
                if axis is None:  # a compute copy only: the gradient in the master's dtype, reduced later
                    for k in ks:
                        g, master = grads[k], layouts[k].shard.dtype
                        out[k] = layout.wrap(layout.local_of(g).to(master), layout.spec_of(g).with_dtype(master))  # type: ignore[arg-type]
                    continue
                if mesh.coordinate_of(rank) is None:
                    pieces = [_summand(grads[k], layouts[k]).to(dtype) for k in ks]  # type: ignore[arg-type]
                    work = None
                else:
                    overlapping = owner is not None and owner._overlapping()
                    # other axes where a gradient is a Partial sum (context or tensor parallelism's
                    # replicated weights): reduced bucketed, after the reduce-scatter on the shards;
                    # overlapped, before it (its pieces are waited for later), on the whole summands
                    extra = [_extra_partial_axes(grads[k], layouts[k]) for k in ks]  # type: ignore[arg-type]
                    summands = [_summand(grads[k], layouts[k], e).to(dtype) for k, e in zip(ks, extra)]  # type: ignore[arg-type]
                    dims = [layouts[k].dim for k in ks]
                    if overlapping:  # the next unit's backward computes while this one reduces
                        summands = _reduce_extra(summands, extra, mesh)
                        pieces, work = buckets.reduce_scatter_start(summands, dims, mesh, axis, "sum")
                        owner.reduction(work)  # type: ignore[union-attr]
                    else:
                        pieces, work = buckets.reduce_scatter(summands, dims, mesh, axis, "sum"), None
                        pieces = _reduce_extra(list(pieces), extra, mesh)
                    del summands  # (the full-size gradients themselves are autograd's until we return)
                for k, piece in zip(ks, pieces):
                    shard = layouts[k].shard
                    out[k] = (layout.wrap(piece.to(shard.dtype), shard) if work is None
                              else layout.awaited(piece, shard, work))
        return (None, None, None, *out)


def _partial(lay: Zero3Layout, dtype: torch.dtype, extra: tuple[int, ...] = ()) -> DistSpec:
    """A sharded parameter's full layout, Partial(sum) on its axis (and on ``extra`` axes), in ``dtype``."""
    placements = list(lay.full.placements)
    for a in (lay.axis, *extra):
        placements[a] = Partial("sum")  # type: ignore[index]  # a sharded parameter's axis
    return lay.full.with_placements(placements, lay.full.shard_order).with_dtype(dtype)


def _extra_partial_axes(grad: DistTensor, lay: Zero3Layout) -> tuple[int, ...]:
    """The axes besides the parameter's own where its gradient is a Partial sum and its full
    layout replicated (a weight replicated on a context- or tensor-parallel axis whose gradient
    sums over that axis's tokens or heads)."""
    spec = layout.spec_of(grad)
    return tuple(b for b, (p, f) in enumerate(zip(spec.placements, lay.full.placements))
                 if b != lay.axis and p == Partial("sum") and isinstance(f, Replicate))


def _reduce_extra(pieces: list[torch.Tensor], extra: list[tuple[int, ...]], mesh: ProcessMesh) -> list[torch.Tensor]:
    """Each reduce-scattered piece summed over its ``extra`` axes: one all-reduce per axis for the
    pieces that share it (on the shards: ``1/n`` of the bytes of reducing the gradients first)."""
    for axes in dict.fromkeys(e for e in extra if e):
        idx = [i for i, e in enumerate(extra) if e == axes]
        for b in axes:
            for i, t in zip(idx, buckets.all_reduce([pieces[i] for i in idx], mesh, b, "sum")):
                pieces[i] = t
    return pieces


def _summand(grad: DistTensor, lay: Zero3Layout, extra: tuple[int, ...] = ()) -> torch.Tensor:
    """This rank's local summand of ``grad`` laid out as ``full`` but Partial(sum) on the axis
    (and on ``extra`` axes, left to ``_reduce_extra``)."""
    return layout.move(layout.local_of(grad), layout.spec_of(grad), _partial(lay, grad.dtype, extra))
