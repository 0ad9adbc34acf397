"""``shard_optimizer``: data parallel with bucketed gradient reduction, and ZeRO stages 1/2/3.

The wrapper is a ``torch.optim.Optimizer`` (LR schedulers accept it) around an unmodified
``torch.optim`` optimizer. One step:

1. ``reduce_gradients``: every Partial gradient of a mesh is reduced in buckets — one
   collective per bucket and mesh axis (all-reduce; reduce-scatter along the data-parallel axis
   for stages 2 and 3).
2. The inner optimizer steps — on the local shards when it is elementwise and every gradient
   and state has its parameter's layout (``autoparallel.optim.local_step``). Stages 1/2 give
   it, per parameter, a *shard*: a DistTensor that is this rank's ``torch.chunk`` piece of the
   parameter along the data-parallel axis (a view of the parameter's local shard), so its
   states (momentum, ``exp_avg``...) are created sharded.
   Stage 3 shards the parameters themselves in place (``autoparallel.optim.zero3``).
3. Stages 1/2: the updated shards are all-gathered back into the parameters, in buckets.

Without ``shard_optimizer`` nothing changes for correctness: Partial gradients are reduced by
the optimizer's own ops, one parameter at a time.

``mixed_precision=ap.MixedPrecision(...)``: the parameters stay the fp32 masters the optimizer
steps; their modules compute with copies in ``param_dtype`` made around each forward (by the
units of ``optim.zero3``, which under ZeRO-3 gather the shards in that dtype), and step 1
reduces gradients in ``reduce_dtype`` (``optim.precision``, docs/mixed_precision.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.optim import buckets
from autoparallel.optim.local_step import local_step
from autoparallel.optim.precision import MixedPrecision, casts, check_precision
from autoparallel.optim.reduction import BucketOp, SlotLayout, meta_bytes, plan_reduction
from autoparallel.optim.stages import ShardingStage, check_stage, param_axis, shard_layout
from autoparallel.optim.zero3 import Zero3Params
from autoparallel.placement import Replicate, chunk_bounds
from autoparallel.spec import DistSpec

# torch.optim's global step hooks (register_optimizer_step_pre_hook/post_hook), which torch's own
# step wrapper runs and ShardedOptimizer.step runs itself
_GLOBAL_PRE, _GLOBAL_POST = compat.optimizer_global_hooks()


@dataclass
class _Slot:
    """One parameter: the model's tensor, the tensor the inner optimizer steps, their layouts."""

    param: torch.Tensor
    stepped: torch.Tensor           # == param unless stage 1/2 shards it
    axis: int | None                # data-parallel axis in the parameter's mesh
    shard: DistSpec | None          # the parameter's shard layout (None: not sharded)


def shard_optimizer(
    optimizer: torch.optim.Optimizer, shard_fn: ShardingStage | None = None, *,
    bucket_bytes: int = buckets.DEFAULT_BUCKET_BYTES, mixed_precision: MixedPrecision | None = None,
) -> ShardedOptimizer:
    """Wrap ``optimizer`` for data parallel (``shard_fn=None``) or ZeRO (``ap.ShardingStage1/2/3``).

    Call it after the parameters are DistTensors and before the first step (states the
    optimizer's constructor made, as Adagrad's, are sharded like the others). Every check runs
    on metadata before any collective, so a bad configuration raises the same error everywhere.
    ``mixed_precision``: compute in ``param_dtype`` with the parameters kept as fp32 masters,
    gradients reduced in ``reduce_dtype`` (docs/mixed_precision.md).
    """
    return ShardedOptimizer(optimizer, shard_fn, bucket_bytes=bucket_bytes, mixed_precision=mixed_precision)


def _warn_idle_ranks(params: list[torch.Tensor]) -> None:
    """One warning (on rank 0) where the parameters' meshes leave ranks of the world out: those
    ranks hold no parameter and compute nothing (a mesh built for fewer processes than launched);
    or where no parameter is laid out at all on a world of several ranks (a model never laid out)."""
    meshes = {layout.spec_of(p).mesh for p in params if layout.is_dist(p)}
    if runtime.get_rank() != 0:
        return
    world = runtime.get_world_size()
    if not meshes:
        if params and world > 1:
            warnings.warn(
                f"shard_optimizer: no parameter is a DistTensor, so each of the {world} ranks trains its own copy "
                "(gradients are neither reduced nor sharded: no data parallelism). Lay the model out first: "
                "ap.shard_layer(model, mesh) or ap.parallelize(model, mesh, plan)", stacklevel=4)
        return
    covered = {r for m in meshes for r in m.process_ids}
    idle = sorted(set(range(world)) - covered)
    if idle:
        shown = ", ".join(repr(m) for m in sorted(meshes, key=lambda m: tuple(m.process_ids))[:3])
        warnings.warn(
            f"shard_optimizer: the parameters live on {shown}, which leave{'s' if len(meshes) == 1 else ''} "
            f"ranks {idle} of the world of {world} out: those ranks hold no parameter and compute nothing. "
            f"Build the mesh over the whole world (e.g. ap.ProcessMesh(list(range({world})))) or launch "
            f"{len(covered)} processes", stacklevel=4)


class ShardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer whose step reduces gradients in buckets and shards states.

    ``param_groups`` and ``state`` are the inner optimizer's (for stages 1/2 its parameters are
    the shards). ``reduce_gradients()`` may be called before ``clip_grad_norm_`` so clipping sees
    reduced gradients; ``step()`` calls it anyway (a no-op when nothing is Partial).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shard_fn: Any = None, *,
                 bucket_bytes: int = buckets.DEFAULT_BUCKET_BYTES, mixed_precision: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"shard_optimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("shard_optimizer: the optimizer is already wrapped by shard_optimizer")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"shard_optimizer: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.inner = optimizer
        self.stage = check_stage(shard_fn)
        self.precision = check_precision(mixed_precision)
        self.bucket_bytes = bucket_bytes
        if self.stage is not None:
            _check_unstepped(optimizer)
        plans = [self._plan_group(g, k) for k, g in enumerate(optimizer.param_groups)]  # all checks first
        _warn_idle_ranks([p for g in optimizer.param_groups for p in g["params"]])
        self._slots: list[_Slot] = []
        self._zero3 = Zero3Params()  # stage 3 / mixed precision: the parameters' units and their hooks
        self._zero3.overlap = bool(getattr(self.stage, "overlap", False))
        if self.precision is not None and self.precision.cast_inputs:
            self._zero3.cast_inputs = self.precision.param_dtype
        self._sharded = False
        for group, plan in zip(optimizer.param_groups, plans):
            group["params"] = [self._adopt(*item) for item in plan]
        self._shard_initial_states()
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._ready = True
        self.stepped_locally = False  # whether the last step ran on local shards (optim.local_step)
        self._plans: dict[Any, tuple[BucketOp, ...]] = {}  # gradient layouts -> reduction plan

    # ---- setting up ---------------------------------------------------------------------
    def _plan_group(self, group: dict[str, Any], k: int) -> list[tuple[torch.Tensor, int | None, DistSpec | None]]:
        """(parameter, data-parallel axis, shard layout) per parameter; raises on bad configs."""
        out: list[tuple[torch.Tensor, int | None, DistSpec | None]] = []
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{k}] parameter {i} of shape {tuple(p.shape)}"
            if self.stage is None and not casts(self.precision, p):
                out.append((p, None, None))
                continue
            if not isinstance(p, DistTensor):
                raise TypeError(
                    f"shard_optimizer: {where} is a plain tensor; make the model's parameters "
                    "DistTensors first (ap.shard_layer, ap.parallelize or ap.shard_tensor)"
                    + ("" if self.stage is not None else " (mixed_precision casts DistTensor parameters)")
                )
            if self.stage is None:
                out.append((p, None, None))
                continue
            spec = layout.spec_of(p)
            axis = param_axis(self.stage, spec, where)
            out.append((p, axis, shard_layout(spec, axis)))
        return out

    def _adopt(self, p: torch.Tensor, axis: int | None, shard: DistSpec | None) -> torch.Tensor:
        stepped = p
        mp = self.precision
        compute = mp.param_dtype if mp is not None and casts(mp, p) else None
        reduce = mp.reduce_dtype if compute is not None and mp is not None else None
        if shard is not None and self.stage is not None and self.stage.stage == 3:
            self._zero3.shard_(p, axis, shard, compute, reduce)  # type: ignore[arg-type]
        else:
            if compute is not None:
                self._zero3.cast_(p, compute)  # type: ignore[arg-type]  # checked a DistTensor
            if shard is not None:
                stepped = layout.wrap(_narrow_to(layout.local_of(p), layout.spec_of(p), shard, axis), shard)  # type: ignore[arg-type]
        self._slots.append(_Slot(p, stepped, axis, shard))
        self._sharded |= stepped is not p  # stages 1/2 step a shard of the parameter
        return stepped

    def _shard_initial_states(self) -> None:
        """The states the inner optimizer's constructor made (Adagrad's ``sum``), moved to the
        tensors it steps, in their layouts (stages 1/2: keyed by the shards; stage 3: the parameter
        sharded in place), each its own copy: a full-size state does not outlive sharding."""
        state = self.inner.state
        for s in self._slots:
            st = state.pop(s.param, None)
            if st:
                state[s.stepped] = {k: _own_copy(_to_layout(v, s.stepped), v) for k, v in st.items()}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (after construction: planned and checked like the others)."""
        if not getattr(self, "_ready", False):  # Optimizer.__init__ passing the adopted groups
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        plan = self._plan_group({"params": params}, len(self.inner.param_groups))  # checks first
        self.inner.add_param_group({**param_group, "params": [self._adopt(*item) for item in plan]})

    def hook_model(self, model: torch.nn.Module) -> None:
        """ZeRO-3 and mixed precision hook the modules holding their parameters at their first
        forward; this hooks ``model`` now instead (``ap.to_static`` does, so the first call's
        signature already has the hooks every later call has)."""
        self._zero3.hook_model(model)

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def stepped_trained(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps (the parameters, or their ZeRO-1/2 shards, which
        never require grad themselves) whose model parameter requires grad: what a step gives state."""
        return [s.stepped for s in self._slots if s.param.requires_grad]

    def reduce_gradients(self) -> None:
        """Reduce every Partial gradient, one collective per bucket and mesh axis.

        The plan depends on the layouts only and is kept for the next step with the same layouts.

        Each reduced gradient keeps its object: it is re-laid out in place (new local shard and
        layout, the same global value), as ``dist.all_reduce`` reduces a tensor in place.
        """
        with compat.attribute_access():
            grads = [s.param.grad for s in self._slots]
        key = tuple(layout.spec_or_none(g) for g in grads)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:  # layouts that keep changing: do not grow without bound
                self._plans.clear()
            layouts = [SlotLayout(s.axis, s.shard) for s in self._slots]
            plan = plan_reduction(key, layouts, self._scatters(), self.bucket_bytes)
            # a reduced gradient in its parameter's layout gets the parameter's spec object, so
            # the local step's layout check is an identity test
            own: list[Any] = [layout.spec_or_none(s.param) for s in self._slots]
            plan = self._plans[key] = tuple(
                replace(op, targets=tuple(own[i] if own[i] == t else t for i, t in zip(op.members, op.targets)))
                for op in plan
            )
        rank = runtime.get_rank()
        local_of, relayout_ = layout.local_of, layout.relayout_
        wire = self.precision.reduce_dtype if self.precision is not None else None
        for op in plan:
            chosen: list[Any] = [grads[i] for i in op.members]
            member = op.mesh.coordinate_of(rank) is not None
            locs = [local_of(g) for g in chosen]
            back = None  # mixed precision: the dtype the reduced gradients return to
            if wire is not None and member and locs and locs[0].is_floating_point() and locs[0].dtype != wire:
                back, locs = locs[0].dtype, [t.to(wire) for t in locs]
            if not member:
                results = locs
            elif op.kind == "rs":
                results = buckets.reduce_scatter(locs, op.dims, op.mesh, op.axis, op.reduce_type)
            else:
                results = buckets.all_reduce(locs, op.mesh, op.axis, op.reduce_type)
            if back is not None:
                results = [r.to(back) for r in results]
            for g, target, local in zip(chosen, op.targets, results):
                relayout_(g, local, target)  # the same value in place
        self._match_params(grads)

    def gradients(self) -> list[torch.Tensor | None]:
        """The model parameters' gradients, one per parameter this optimizer steps (for stages
        1/2 the gradients of the whole parameters, not of the shards the inner optimizer holds)."""
        return [s.param.grad for s in self._slots]

    def _match_params(self, grads: list[Any]) -> None:
        """A reduced gradient laid out unlike its parameter (sequence parallel gives a replicated
        position table a sequence-sharded gradient) is moved to the parameter's layout, in place:
        the optimizer then steps every parameter on local shards (``optim.local_step``) instead of
        dispatching each of its ops. Metadata decides, so every rank moves the same gradients."""
        spec_or_none, local_of = layout.spec_or_none, layout.local_of
        for s, g in zip(self._slots, grads):
            if s.stepped is not s.param or not isinstance(g, DistTensor):
                continue  # stages 1/2 move gradients to their shards in _attach_shard_grads
            gs, ps = spec_or_none(g), spec_or_none(s.param)
            if ps is None or gs is None or gs is ps or gs.has_partial or gs.mesh != ps.mesh or gs == ps \
                    or gs.shape != ps.shape or gs.dtype != ps.dtype:
                continue
            layout.relayout_(g, layout.move(local_of(g), gs, ps), ps)

    def _scatters(self) -> bool:
        return self.stage is not None and self.stage.stage >= 2

    @torch.no_grad()
    def _gather_updated(self) -> None:
        """Stages 1/2: all-gather the updated shards into the parameters, in buckets."""
        groups: dict[tuple[Any, ...], list[_Slot]] = {}
        for s in self._slots:
            if s.stepped is not s.param:
                groups.setdefault((layout.spec_of(s.param).mesh, s.axis, s.param.dtype), []).append(s)  # type: ignore[arg-type]
        rank = runtime.get_rank()
        for (mesh, axis, _), slots in groups.items():
            if mesh.coordinate_of(rank) is None:
                continue
            sizes = [meta_bytes(layout.spec_of(s.param)) for s in slots]  # type: ignore[arg-type]
            for bucket in buckets.plan_buckets(sizes, self.bucket_bytes):
                chosen = [slots[i] for i in bucket]
                fulls = buckets.all_gather(
                    [layout.local_of(s.stepped) for s in chosen],  # type: ignore[arg-type]
                    [s.shard.placements[axis].dim for s in chosen],  # type: ignore[union-attr]
                    [tuple(layout.local_of(s.param).shape) for s in chosen],  # type: ignore[arg-type]
                    mesh, axis,
                )
                for s, full in zip(chosen, fulls):
                    layout.local_of(s.param).copy_(full)  # type: ignore[arg-type]

    def _attach_shard_grads(self) -> None:
        """Stages 1/2: point each shard at its parameter's current values and give it its gradient."""
        spec_of, local_of = layout.spec_of, layout.local_of
        for s in self._slots:
            if s.stepped is s.param:
                continue
            p = s.param
            layout.set_local_(s.stepped, _narrow_to(local_of(p), spec_of(p), s.shard, s.axis))  # type: ignore[arg-type]
            g = p.grad
            if g is None:
                s.stepped.grad = None
            elif not isinstance(g, DistTensor):
                raise TypeError(f"shard_optimizer: a DistTensor parameter has a plain gradient of shape {tuple(g.shape)}")
            elif (gs := spec_of(g)) == s.shard:
                s.stepped.grad = g
            else:
                s.stepped.grad = layout.wrap(layout.move(local_of(g), gs, s.shard), s.shard)  # type: ignore[arg-type]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce gradients (bucketed), step the inner optimizer, gather updated parameters.

        Step hooks (``register_step_pre_hook``/``post_hook`` on this optimizer, and the global
        ones) run around it as around any optimizer's step. The profiler range is the inner
        optimizer's (``Optimizer.step#AdamW.step``): torch's own step wrapper, which would open a
        second range around this one, is not installed (``hooked`` below), as it costs more than
        the rest of this method's Python on a small model.
        """
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        for pre_hook in (*_GLOBAL_PRE.values(), *self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (args, kwargs), got {result!r}")
                args, kwargs = result
        out = self._step(*args[1:], **kwargs)
        for post_hook in (*self._optimizer_step_post_hooks.values(), *_GLOBAL_POST.values()):
            post_hook(self, args, kwargs)
        return out

    step.hooked = True  # type: ignore[attr-defined]  # tells torch.optim.Optimizer not to wrap it again

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        if self._sharded:
            self._attach_shard_grads()
        self.stepped_locally = local_step(self.inner)
        if not self.stepped_locally:
            self.inner.step()
        if self._sharded:
            self._gather_updated()
            for s in self._slots:
                if s.stepped is not s.param:
                    s.stepped.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (and the shards')."""
        if set_to_none:
            with compat.attribute_access():
                for s in self._slots:
                    s.param.grad = None
                    s.stepped.grad = None
            return
        for s in self._slots:
            for t in (s.param, s.stepped):
                if t.grad is not None:
                    t.grad.detach_()
                    t.grad.zero_()

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict; ZeRO states are DistTensors in the shard layout."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load states of any layout (full plain tensors included) into the shard layouts."""
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        for s in self._slots:
            st = self.state.get(s.stepped)
            if not st:
                continue
            for key, value in st.items():
                st[key] = _to_layout(value, s.stepped)

    def __repr__(self) -> str:
        mp = "" if self.precision is None else f", {self.precision!r}"
        return f"ShardedOptimizer({self.stage!r}{mp}, {self.inner!r})"


def _check_unstepped(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` has not stepped: its states, if any, are those its constructor
    makes (Adagrad's ``sum`` and ``step``), each with a ``step`` of 0. Every rank built and
    stepped it alike, so every rank decides alike."""
    for p, st in optimizer.state.items():
        if not st:
            continue
        step = layout.local_or_plain(st.get("step"))  # (a DistTensor step: its replicated local value)
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if not isinstance(step, (int, float)) or step != 0:
            held = f"step {step}" if step is not None else f"states {sorted(map(str, st))} and no 'step'"
            raise ValueError(
                "shard_optimizer: wrap the optimizer before its first step (the state of a parameter "
                f"of shape {tuple(p.shape)} has {held}; an optimizer that has not stepped has none, "
                "or only states with step 0)"
            )


def _own_copy(moved: Any, value: Any) -> Any:
    """``moved`` (``value`` in a shard layout), its local tensor copied when it may view ``value``'s."""
    if moved is value or not isinstance(moved, DistTensor) or not isinstance(value, DistTensor):
        return moved
    return layout.wrap(layout.local_of(moved).clone(memory_format=torch.contiguous_format), layout.spec_of(moved))


def _narrow_to(local: torch.Tensor, spec: DistSpec, shard: DistSpec, axis: int) -> torch.Tensor:
    """This rank's piece of ``local`` (layout ``spec``) in layout ``shard``: a view along one dim."""
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    if coord is None:
        return local
    dim = shard.placements[axis].dim  # type: ignore[union-attr]
    return local.narrow(dim, *chunk_bounds(local.shape[dim], spec.mesh.shape[axis], coord[axis]))


def _to_layout(value: Any, param: torch.Tensor) -> Any:
    """A loaded state value in the parameter's layout (values of another shape stay as they are)."""
    if not isinstance(param, DistTensor) or not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
        return value
    dst = layout.spec_of(param).with_dtype(value.dtype)
    if isinstance(value, DistTensor):
        src = layout.spec_of(value)
        if src == dst:
            return value
        return layout.wrap(layout.move(layout.local_of(value), src, dst), dst)
    full = dst.with_placements([Replicate()] * dst.mesh.ndim)
    return layout.wrap(layout.move(value.to(layout.local_of(param).device), full, dst).clone(), dst)
