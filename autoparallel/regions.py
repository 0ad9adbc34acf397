"""Local regions: run a module on local shards when its DistTensor execution moves no data.

A module whose every op, run on DistTensors, takes its inputs as they are (no reshard, no
collective, no fallback, no random op) computes on each rank exactly what the same module run
on the rank's local shards computes: that is what an SPMD rule's "as-is" strategy means. For
such a module the per-op dispatch is pure overhead. ``enable_local_regions(model)`` installs a
wrapper on ``model.forward`` that finds out, once per *signature* (the layouts of the arguments,
parameters and buffers, the training flags, grad mode and non-tensor arguments), whether the
module is such a region, and from then on runs it on local tensors:

1. **Trace** (first call of a signature): run the module on DistTensors as usual, recording
   every decision and the aten calls made on local shards; any moved input, collective,
   fallback, value op or random op refuses the signature.
2. **Classify** the outputs: no Partial; on each mesh axis either every output is sharded
   (the ranks along it computed disjoint pieces) or every input is Replicate (they computed
   the same thing). This gives each input's gradient layout: a Replicate input (a parameter
   of a data-parallel model) used on a sharded axis gets a Partial(sum) gradient there.
3. **Replay** the module once on copies of the local shards (RNG restored) and require the
   very same aten calls with the same shapes and non-tensor arguments. This catches Python
   code that reads global sizes (``x / x.shape[0]``), hooks that reshard, and anything that
   behaves differently on plain tensors.

Every check reads metadata only (shards must be even, so all ranks see identical local
shapes): all ranks reach the same verdict. A refused module has the wrapper installed on its
children, which are tried in turn (a data-parallel GPT runs as one region; a tensor-parallel
block's column-parallel Linear and its sequence-parallel LayerNorm become regions, its
row-parallel Linear does not). ``AUTOPARALLEL_LOCAL_REGIONS=0`` turns the feature off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoparallel import dispatch as _dispatch
from autoparallel import runtime
from autoparallel.debug import CommDebugMode
from autoparallel.dtensor import DistTensor
from autoparallel.placement import Partial, Replicate, Shard, chunk_bounds
from autoparallel.spec import DistSpec
from reshard.executor import reshard_local

_ATTR = "_ap_region"
_MODE: list[str] = []          # "trace" (a parent is tracing) or "local" (running on shards)
MAX_SIGNATURES = 16            # per module; beyond that (a changing scalar argument) give up
_MISSING = object()


def _enabled() -> bool:
    return os.environ.get("AUTOPARALLEL_LOCAL_REGIONS", "1") not in ("0", "false", "off")


# ---- public API ----------------------------------------------------------------------------
def enable_local_regions(module: nn.Module) -> nn.Module:
    """Let ``module`` (and, where it is refused, its submodules) run on local shards; in place."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"enable_local_regions: expected an nn.Module, got {type(module).__name__}")
    if _enabled():
        _install(module)
    return module


def disable_local_regions(module: nn.Module) -> nn.Module:
    """Remove the wrappers from ``module`` and every submodule; in place."""
    for m in module.modules():
        region = m.__dict__.pop(_ATTR, None)
        if region is not None:
            m.__dict__.pop("forward", None)
    return module


def local_regions_report(module: nn.Module) -> dict[str, list[str]]:
    """Per wrapped submodule name: one line per signature seen, ``local`` or ``refused: why``."""
    out: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        region = m.__dict__.get(_ATTR)
        if region is not None:
            out[name or "<root>"] = [v.summary() for v in region.verdicts.values()]
    return out


# ---- installing ------------------------------------------------------------------------------
def _install(module: nn.Module) -> None:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers are never called
        for child in module.children():
            _install(child)
        return
    if _ATTR in module.__dict__ or not _has_dist_state(module):
        return
    region = _Region(module)
    module.__dict__[_ATTR] = region
    module.__dict__["forward"] = region.run  # a bound method: copy.deepcopy gives the copy its own


def _has_dist_state(module: nn.Module) -> bool:
    return any(isinstance(t, DistTensor) for t in [*module.parameters(), *module.buffers()])


def _slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (submodule, attribute) holding a parameter or buffer, ties included."""
    out = []
    for m in module.modules():
        out += [(m, a) for a, t in m._parameters.items() if t is not None]
        out += [(m, a) for a, t in m._buffers.items() if t is not None]
    return out


def _current(m: nn.Module, attr: str) -> torch.Tensor:
    """What ``m.<attr>`` resolves to now (a ZeRO-3 gathered tensor shadows the parameter)."""
    t = m.__dict__.get(attr)
    if t is None:
        t = m._parameters.get(attr)
    if t is None:
        t = m._buffers[attr]
    assert t is not None, (type(m).__name__, attr)
    return t


# ---- verdicts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Verdict:
    """What the trace of one signature found: refused (``reason``) or how to run locally."""

    reason: str = ""
    out_tree: Any = None
    out_specs: tuple[DistSpec | None, ...] = ()      # per output leaf (None: not a DistTensor)
    arg_grads: tuple[DistSpec | None, ...] = ()      # per argument leaf: its gradient's layout
    slot_grads: tuple[DistSpec | None, ...] = ()     # per parameter/buffer slot
    out_local_shapes: tuple[tuple[int, ...] | None, ...] = ()  # per output leaf, on this rank

    @property
    def local(self) -> bool:
        return not self.reason

    def summary(self) -> str:
        return "local" if self.local else f"refused: {self.reason}"


def _refused(reason: str) -> _Verdict:
    return _Verdict(reason=reason)


# ---- the per-module wrapper --------------------------------------------------------------------
class _Region:
    """The wrapper state of one module: its original forward, slots and verdicts."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward: Callable[..., Any] = module.forward
        self.slots = _slots(module)
        self.modules = list(module.modules())
        self.verdicts: dict[Any, _Verdict] = {}
        self.children_done = False

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``forward`` while regions are enabled."""
        return self.call(args, kwargs)

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _MODE:  # inside a parent's trace or local run: behave as the plain module
            return self.forward(*args, **kwargs)
        leaves, tree = tree_flatten((args, kwargs))
        tensors = [_current(m, a) for m, a in self.slots]
        key = self._key(leaves, tree, tensors)
        if key is None:
            return self._plain(args, kwargs)
        verdict = self.verdicts.get(key)
        if verdict is None:
            if len(self.verdicts) >= MAX_SIGNATURES:
                return self._plain(args, kwargs)
            return self._first_call(key, leaves, tree, tensors, args, kwargs)
        if verdict.local:
            return self._run_local(verdict, leaves, tree, tensors)
        return self._plain(args, kwargs)

    def _plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The usual DistTensor path; submodules get their own chance to be regions."""
        if not self.children_done:
            self.children_done = True
            for child in self.module.children():
                _install(child)
        return self.forward(*args, **kwargs)

    def _key(self, leaves: list[Any], tree: Any, tensors: list[torch.Tensor]) -> Any:
        """The signature, or None when this call cannot be a region (no DistTensor at all)."""
        parts: list[Any] = []
        for x in leaves:
            if isinstance(x, DistTensor):
                parts.append((x._spec, x._stride, x.requires_grad))
            elif isinstance(x, torch.Tensor):
                parts.append(("plain", tuple(x.shape), x.dtype, x.requires_grad))
            else:
                parts.append(("value", x))
        slot_parts = tuple(
            (t._spec, t.requires_grad) if isinstance(t, DistTensor) else ("plain", tuple(t.shape), t.requires_grad)
            for t in tensors
        )
        if not any(isinstance(x, DistTensor) for x in leaves) and not any(isinstance(t, DistTensor) for t in tensors):
            return None
        key = (tree, tuple(parts), slot_parts, _ties(tensors), tuple(m.training for m in self.modules),
               torch.is_grad_enabled(), _autocast_state())
        try:
            hash(key)
        except TypeError:
            return None
        return key

    # ---- first call of a signature: trace, classify, replay ---------------------------------
    def _first_call(self, key: Any, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reason = _precheck(leaves, tensors)
        if reason:
            self.verdicts[key] = _refused(reason)
            return self._plain(args, kwargs)
        trace = _Trace()
        with CommDebugMode() as comm, _mode("trace"), trace.spy():
            out = self.forward(*args, **kwargs)
        verdict = _refused(trace.reason) if trace.reason else (
            _refused(f"it communicates ({comm.records[0].kind})") if comm.records else
            _classify(out, leaves, tensors))
        if verdict.local:
            verdict = self._replay(verdict, trace, out, leaves, tree, tensors)
        self.verdicts[key] = verdict
        if not verdict.local and not self.children_done:
            self.children_done = True
            for child in self.module.children():
                _install(child)
        return out

    def _replay(self, verdict: _Verdict, trace: "_Trace", out: Any, leaves: list[Any], tree: Any,
                tensors: list[torch.Tensor]) -> _Verdict:
        """Run once on detached local shards; the aten calls must be the traced ones."""
        replay = _Trace(replay=True)
        try:
            with torch.random.fork_rng(devices=[]):
                local_out, replay_inputs = self._run_local(verdict, leaves, tree, tensors, spy=replay)
        except Exception as e:  # noqa: BLE001  (any failure on plain tensors refuses the region)
            return _refused(f"it fails on local tensors ({type(e).__name__}: {str(e)[:80]})")
        if replay.reason:
            return _refused(replay.reason)
        if len(replay.ops) != len(trace.ops):
            return _refused(f"on local tensors it runs {len(replay.ops)} aten calls, not {len(trace.ops)}")
        for k, (a, b) in enumerate(zip(trace.ops, replay.ops)):
            if a != b:
                return _refused(f"aten call {k} differs on local tensors ({a[0]} vs {b[0]}): "
                                "it reads global sizes or layouts")
        dist_leaves, _ = tree_flatten(out)
        local_leaves, local_tree = tree_flatten(local_out)
        if local_tree != verdict.out_tree:
            return _refused("its output structure differs on local tensors")
        coord = _coord(verdict)
        inputs = {_storage(t) for t in replay_inputs.values() if t.numel()}
        for d, lo, spec in zip(dist_leaves, local_leaves, verdict.out_specs):
            if spec is None:
                if isinstance(d, torch.Tensor) or d != lo:
                    return _refused("a non-DistTensor output differs on local tensors")
            elif tuple(lo.shape) != spec.local_shape(coord) or lo.dtype != spec.dtype:
                return _refused("an output's local shape differs from its layout")
            elif lo.numel() and _storage(lo) in inputs:
                return _refused("an output aliases an input")
        shapes = tuple(None if s is None else s.local_shape(coord) for s in verdict.out_specs)
        return replace(verdict, out_local_shapes=shapes)

    # ---- running on shards -------------------------------------------------------------------
    def _run_local(self, verdict: _Verdict, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                   spy: "_Trace | None" = None) -> Any:
        """Run the module on shards. With ``spy`` (a replay): on detached shards, recording its
        aten calls, returning the local outputs."""
        grad = torch.is_grad_enabled()
        want: dict[int, tuple[DistTensor, DistSpec | None]] = {}
        for x, g in zip(leaves, verdict.arg_grads):
            if isinstance(x, DistTensor):
                want.setdefault(id(x), (x, g))
        for t, g in zip(tensors, verdict.slot_grads):
            if isinstance(t, DistTensor):
                want.setdefault(id(t), (t, g))
        call = None if spy is not None else _Call(single=sum(o is not None for o in verdict.out_specs) == 1)
        local = _localize(list(want.values()), grad, call)
        if spy is not None:  # plain tensor arguments: copies too (see _localize)
            for x in leaves:
                if isinstance(x, torch.Tensor) and not isinstance(x, DistTensor):
                    local.setdefault(id(x), x.detach().clone())
        largs, lkwargs = tree_unflatten([local.get(id(x), x) for x in leaves], tree)
        saved = []
        for m, a in self.slots:
            t = _current(m, a)
            saved.append(m.__dict__.get(a, _MISSING))
            m.__dict__[a] = local.get(id(t), t)
        try:
            with _mode("local"):
                if spy is None:
                    out = self.forward(*largs, **lkwargs)
                else:
                    with spy.spy():
                        out = self.forward(*largs, **lkwargs)
        finally:
            for (m, a), prev in zip(self.slots, saved):
                if prev is _MISSING:
                    del m.__dict__[a]
                else:
                    m.__dict__[a] = prev
        if spy is not None:
            return out, local
        outs, _ = tree_flatten(out)
        for o, s, shape in zip(outs, verdict.out_specs, verdict.out_local_shapes):
            if s is not None and (not isinstance(o, torch.Tensor) or isinstance(o, DistTensor) or o.dtype != s.dtype
                                  or tuple(o.shape) != shape):
                raise RuntimeError(
                    f"local region {type(self.module).__name__}: an output came out as "
                    f"{getattr(o, 'dtype', type(o).__name__)} {tuple(getattr(o, 'shape', ()))} where its traced "
                    f"layout {s} gives {s.dtype} {shape} locally; the module behaves differently from its "
                    "traced call with the same signature. Run with AUTOPARALLEL_LOCAL_REGIONS=0 and report it."
                )
        wrapped = [o if s is None else _wrap_out(o, s, call) for o, s in zip(outs, verdict.out_specs)]  # type: ignore[arg-type]
        return tree_unflatten(wrapped, verdict.out_tree)


def _autocast_state() -> tuple[Any, ...]:
    """Autocast changes which ops run and their dtypes: part of the signature."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def _coord(verdict: _Verdict) -> tuple[int, ...]:
    spec = next(s for s in verdict.out_specs if s is not None)
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    assert coord is not None
    return coord


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _ties(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Which slots hold the same tensor: per slot, the index of its first occurrence."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), k) for k, t in enumerate(tensors))


class _mode:
    """Push ``name`` on the region mode stack for the duration of a ``with`` block."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _MODE.append(self.name)

    def __exit__(self, *exc: object) -> None:
        _MODE.pop()


# ---- checks on metadata --------------------------------------------------------------------------
def _precheck(leaves: list[Any], tensors: list[torch.Tensor]) -> str:
    """Why this signature cannot be a region, from layouts alone ('' when it may be one)."""
    dts = [x for x in [*leaves, *tensors] if isinstance(x, DistTensor)]
    mesh = dts[0]._spec.mesh
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, DistTensor) and x.requires_grad:
            return "a plain tensor argument requires grad"
    for t in dts:
        spec = t._spec
        if spec.mesh != mesh:
            return "its DistTensors live on several meshes"
        if spec.partial_axes():
            return f"an input is Partial ({spec})"
        if getattr(t, "_ap_zero3", None) is not None:
            return "it owns ZeRO-3 sharded parameters (gathered by their unit)"
        for dim in range(len(spec.shape)):
            pieces = 1
            for a in spec.axes_of_dim(dim):
                pieces *= mesh.shape[a]
            if spec.shape[dim] % pieces:
                return f"an input's dim {dim} of size {spec.shape[dim]} is split unevenly ({pieces} pieces)"
    if mesh.coordinate_of(runtime.get_rank()) is None:
        return "this rank is outside the mesh"
    return ""


def _classify(out: Any, leaves: list[Any], tensors: list[torch.Tensor]) -> _Verdict:
    """Output layouts -> gradient layouts of the inputs, or why the outputs do not allow it."""
    outs, out_tree = tree_flatten(out)
    specs = tuple(o._spec if isinstance(o, DistTensor) else None for o in outs)
    dist_out = [s for s in specs if s is not None]
    if not dist_out:
        return _refused("it returns no DistTensor")
    for o, s in zip(outs, specs):
        if s is None and isinstance(o, torch.Tensor):
            return _refused("it returns a plain tensor")
    mesh = dist_out[0].mesh
    if any(s.mesh != mesh for s in dist_out):
        return _refused("its outputs live on another mesh")
    if any(s.partial_axes() for s in dist_out):
        return _refused("an output is Partial (a reduction is left pending)")
    inputs = [x for x in [*leaves, *tensors] if isinstance(x, DistTensor)]
    sharded: list[int] = []
    for a in range(mesh.ndim):
        kinds = {isinstance(s.placements[a], Shard) for s in dist_out}
        if kinds == {True, False}:
            return _refused(f"its outputs are sharded on mesh axis {a} and replicated on it")
        if True in kinds:
            sharded.append(a)
        elif any(not isinstance(t._spec.placements[a], Replicate) for t in inputs):
            return _refused(f"an input is sharded on mesh axis {a} but no output is")

    def grad_of(x: Any) -> DistSpec | None:
        if not isinstance(x, DistTensor):
            return None
        pl = [Partial("sum") if a in sharded and isinstance(p, Replicate) else p for a, p in enumerate(x._spec.placements)]
        return x._spec.with_placements(pl, x._spec.shard_order)

    return _Verdict(out_tree=out_tree, out_specs=specs, arg_grads=tuple(grad_of(x) for x in leaves),
                    slot_grads=tuple(grad_of(t) for t in tensors))


# ---- recording aten calls ------------------------------------------------------------------------
def _describe(x: Any) -> Any:
    """An aten argument as comparable metadata: tensors by shape and dtype, the rest by value."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_describe(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _describe(v)) for k, v in x.items()))
    return x


_aten = torch.ops.aten
_SIZED = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default})


class _Trace:
    """Aten calls on local tensors, in order, and the first reason to refuse the region.

    In a trace, DistTensor ops go through dispatch, which reports each decision (``observe``)
    and runs the local computation under the spy; plain ops (factories) are recorded directly.
    In a replay every op must be on plain tensors.
    """

    def __init__(self, replay: bool = False) -> None:
        self.replay = replay
        self.ops: list[tuple[Any, ...]] = []
        self.reason = ""

    def refuse(self, reason: str) -> None:
        self.reason = self.reason or reason

    def spy(self) -> "_Spy":
        return _Spy(self)

    def observe(self, func: Any, decision: Any, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """Called by dispatch for each DistTensor op of a trace: check, then run under the spy."""
        if decision.fallback or decision.out_kind in ("value", "unknown"):
            self.refuse(f"{func} runs replicated or returns a Python value")
        elif any(p is not None for p in decision.plans):
            self.refuse(f"{func} moves an input")
        elif _is_random(func, args, kwargs):
            self.refuse(f"{func} is random (its DistTensor result is the single-device draw)")
        with _Spy(self):
            return run()

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func in _SIZED:  # the size may say -1 where the other side says the number
            args = args[:1] + args[2:]
        self.ops.append((func, _describe(args), _describe(kwargs), _describe(out)))


def _is_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A seeded op that draws: attention and dropout with probability 0 do not."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for k, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p"):
            value = kwargs.get(a.name, args[k] if k < len(args) else a.default_value)
            return bool(value)
    return True


class _Spy(TorchDispatchMode):
    """Records plain aten calls into a trace; hands DistTensor calls on to dispatch."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __enter__(self) -> "_Spy":
        _dispatch.TRACES.append(self.trace)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _dispatch.TRACES.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DistTensor) for t in types):
            if self.trace.replay:
                self.trace.refuse(f"{func} meets a DistTensor on local tensors")
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.trace.record(func, args, kwargs, out)
        return out


# ---- crossing between DistTensors and shards -------------------------------------------------------
def _localize(items: list[tuple[DistTensor, DistSpec | None]], grad: bool, call: "_Call | None") -> dict[int, torch.Tensor]:
    """id of each DistTensor -> its shard; those needing a gradient go through one autograd node.
    ``call`` None (a replay): detached copies, so an in-place write in the module (a counter
    buffer, an input) does not happen twice."""
    out: dict[int, torch.Tensor] = {}
    needs = [(t, g) for t, g in items if grad and t.requires_grad and g is not None]
    if call is None:
        for t, _ in items:
            out[id(t)] = t._local.detach().clone()
        for t, _ in needs:
            out[id(t)].requires_grad_(True)
        return out
    for t, _ in items:
        out[id(t)] = t._local
    if needs:
        locs = _Localize.apply(call, tuple(g for _, g in needs), *[t for t, _ in needs])
        for (t, _), loc in zip(needs, locs):
            out[id(t)] = loc
    return out


class _Call:
    """One local run of a region, shared by its input and output autograd nodes.

    ``partial``: mesh axes on which the region's (single) output is Replicate but its gradient
    arrived Partial(sum). The backward is linear in that gradient, so it runs on the summands
    and the inputs' gradients are Partial(sum) there too — no all-reduce inside the backward
    (the DistTensor path would also pass the Partial on, to the optimizer's bucketed reduction).
    """

    def __init__(self, single: bool) -> None:
        self.single = single
        self.partial: tuple[int, ...] = ()


class _Localize(torch.autograd.Function):
    """DistTensors -> their local shards, as one autograd node.

    Backward: each shard's gradient becomes a DistTensor in the layout the region's
    classification gave it (a Replicate input used on a sharded axis: Partial(sum) there; on
    the ``call.partial`` axes, Partial(sum)). Unused outputs get no gradient (not zeros): an
    unused parameter keeps ``grad is None``.
    """

    @staticmethod
    def forward(ctx: Any, call: _Call, specs: tuple[DistSpec, ...], *xs: DistTensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.call, ctx.specs = call, specs
        ctx.set_materialize_grads(False)
        return tuple(x._local.view_as(x._local) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        specs = ctx.specs if not ctx.call.partial else tuple(_with_partial(s, ctx.call.partial) for s in ctx.specs)
        return (None, None, *[
            None if g is None else DistTensor._wrap(g if g.is_contiguous() else g.contiguous(), s)
            for g, s in zip(grads, specs)
        ])


class _Out(torch.autograd.Function):
    """A region's local output -> its DistTensor. Backward: the gradient in the output's layout
    (a Partial(sum) gradient on an axis where the output is Replicate stays Partial for a
    single-output region: see ``_Call``), then its shard."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DistSpec, call: _Call) -> DistTensor:  # type: ignore[override]
        ctx.spec, ctx.call = spec, call
        return DistTensor._wrap(local.view_as(local) if local.is_contiguous() else local.contiguous(), spec)

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        target: DistSpec = ctx.spec
        local, spec = grad._local, grad._spec
        if ctx.call.single:
            keep = []
            coord = spec.mesh.coordinate_of(runtime.get_rank())
            for a, (p, q) in enumerate(zip(spec.placements, target.placements)):
                if not isinstance(q, Replicate) or coord is None:
                    continue
                if p == Partial("sum"):
                    keep.append(a)
                elif isinstance(p, Shard) and spec.axes_of_dim(p.dim) == (a,):
                    # a shard of the gradient of a replicated output: zero-padded to the whole
                    # dim it is a summand (Partial(sum)) of that gradient — no all-gather
                    local = _zero_pad(local, p.dim, spec.shape[p.dim], spec.mesh.shape[a], coord[a])
                    spec = spec.with_placements([Partial("sum") if b == a else x for b, x in enumerate(spec.placements)],
                                                spec.shard_order)
                    keep.append(a)
            if keep:
                ctx.call.partial = tuple(keep)
                target = _with_partial(target, ctx.call.partial)
        return reshard_local(local, spec, target), None, None


def _zero_pad(local: torch.Tensor, dim: int, size: int, parts: int, index: int) -> torch.Tensor:
    """``local`` (piece ``index`` of ``parts`` along ``dim``) inside zeros of the whole ``size``."""
    off, length = chunk_bounds(size, parts, index)
    shape = list(local.shape)
    shape[dim] = size
    full = local.new_zeros(shape)
    full.narrow(dim, off, length).copy_(local)
    return full


def _with_partial(spec: DistSpec, axes: tuple[int, ...]) -> DistSpec:
    pl = [Partial("sum") if a in axes and isinstance(p, Replicate) else p for a, p in enumerate(spec.placements)]
    return spec.with_placements(pl, spec.shard_order)


def _wrap_out(local: torch.Tensor, spec: DistSpec, call: _Call) -> DistTensor:
    if local.requires_grad:
        return _Out.apply(local, spec, call)  # type: ignore[no-any-return]
    return DistTensor._wrap(local if local.is_contiguous() else local.contiguous(), spec)
