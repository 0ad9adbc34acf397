"""The op path: ``__torch_dispatch__`` -> rule -> strategy choice -> reshard inputs -> local op.

A *decision* (chosen input layouts, their reshard plans, output specs and strides) is a pure
function of the op, the inputs' specs and strides, and the non-tensor arguments, so it is cached
on exactly that key and every rank reaches the same one. Execution then only runs the cached
plans and the local op. Walking the arguments (key, plain tensors, slots, written inputs) lives
in ``autoparallel.dispatch_args``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch
from torch.utils._mode_utils import no_dispatch

from autoparallel import deferred as _deferred
from autoparallel.dispatch_args import (
    adopt_plain,
    call_key,
    dist_slots,
    flatten_out,
    map_args,
    mesh_coord,
    mutated_inputs,
    out_aliases,
    place_locals,
)
from autoparallel.placement import Replicate, Shard
from autoparallel.spec import DistSpec, _itemsize
from reshard.crossmesh import CrossMeshPlan, plan_best
from reshard.executor import run_any
from reshard.plan import RELABEL, SLICE, Plan
from reshard.planner import LATENCY_BYTES
from spmd_rules.base import LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import get_local_impl, get_out_shapes, get_rule

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class Decision:
    mesh: Any
    plans: tuple[Plan | CrossMeshPlan | None, ...]  # per DistTensor input, None when in place
    out_specs: tuple[DistSpec | None, ...]    # per output (None: not a tensor)
    out_strides: tuple[tuple[int, ...] | None, ...]
    out_kind: str                             # "tensor" | "tuple" | "list" | "value"
    value: Any                                # the result when out_kind == "value"
    local_fn: Callable[..., Any] | None
    call: OpCall | None
    mutated: tuple[int, ...]                  # DistTensor inputs written in place (in_place/out=)
    coord: tuple[int, ...] | None             # this rank's mesh coordinate (None: not a member)
    in_specs: tuple[DistSpec, ...] = ()       # layout of each DistTensor input when the op runs
    restore: tuple[Plan | CrossMeshPlan | None, ...] = ()  # per written input: back to its layout
    slots: Any = None                         # where each DistTensor sits in (args, kwargs)
    detached_view: bool = False               # a view op whose input had to be moved first
    fallback: bool = False                    # no rule: replicated inputs, the kernel's outputs
    out_alias: tuple[int | None, ...] = ()    # per output: the written input it is (None: new)
    contexts: tuple[LocalContext, LocalContext] | None = None  # what local_fn gets (may_defer False, True)
    simple: bool = False                      # one new tensor out, nothing written: wrap it and return


def dispatch(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DistTensors of class ``cls`` (the body of ``__torch_dispatch__``)."""
    if func is _DETACH and not TRACES and not kwargs and len(args) == 1 and type(args[0]) is cls:
        x = args[0]  # autograd detaches every gradient it accumulates: same layout, no decision
        return cls._wrap(x._local.detach(), x._spec, x._stride)
    dts: list[Any] = []
    plain: list[torch.Tensor] = []
    key = (func, call_key(cls, args, dts, plain), call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    if not dts:
        return func(*args, **kwargs)
    if plain:  # rare: adopt them as Replicate, then key the call again
        args, kwargs = adopt_plain(cls, func, args, kwargs, dts, plain)
        dts, plain = [], []
        key = (func, call_key(cls, args, dts, plain), call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    decision = _CACHE.get(key)
    if decision is None:
        decision = _finish(cls, func, _decide(cls, func, args, kwargs, dts), args, kwargs, [t._spec for t in dts])
        if len(_CACHE) >= MAX_CACHED_DECISIONS:  # e.g. a changing Python scalar in the key
            _CACHE.clear()
        _CACHE[key] = decision
    if TRACES:  # a local region is being traced (autoparallel.regions)
        return TRACES[-1].observe(func, decision, args, kwargs, lambda: _execute(cls, func, args, kwargs, dts, decision))
    return _execute(cls, func, args, kwargs, dts, decision)


_CACHE: dict[Any, Decision] = {}
_DETACH = torch.ops.aten.detach.default
# Observers of the op path while a local region is traced (autoparallel.regions.checks._Trace).
TRACES: list[Any] = []
# Ops whose result is a Python value of the whole tensor (``x.item()``, ``torch.equal``): they
# need the replicated value by definition, so running them replicated is the rule, not a gap.
_VALUE_OPS = frozenset({
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
})
MAX_CACHED_DECISIONS = 65536
# Views whose local implementation computes a new tensor (a lazy conj/neg bit cannot live on the
# wrapper): like views of a moved input, writes through them raise instead of being lost.
_MATERIALISED_VIEWS = frozenset({torch.ops.aten._conj.default, torch.ops.aten._neg_view.default})
# In-place views (they change the tensor's own shape or strides) and their out-of-place view.
_aten = torch.ops.aten
_INPLACE_VIEWS = {
    _aten.squeeze_.default: _aten.squeeze.default, _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims, _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.transpose_.default: _aten.transpose.int, _aten.t_.default: _aten.t.default,
}


def clear_cache() -> None:
    _CACHE.clear()


# ---- deciding ----------------------------------------------------------------------------
def _decide(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any]) -> Decision:
    mesh = dts[0]._spec.mesh
    for d in dts[1:]:
        if d._spec.mesh != mesh:
            raise ValueError(
                f"{func}: inputs live on different meshes {mesh} and {d._spec.mesh}; "
                "reshard one of them onto the other's mesh first (ap.reshard)"
            )
    specs = [d._spec for d in dts]
    metas: dict[int, TensorMeta] = {}

    def to_meta(t: Any) -> Any:
        if isinstance(t, cls):
            return metas.setdefault(id(t), TensorMeta(t._spec.shape, t._spec.dtype))
        return ScalarMeta(t.dtype)

    def to_fake(t: Any) -> Any:
        if isinstance(t, cls):
            return torch.empty_strided(t._spec.shape, t._stride, dtype=t._spec.dtype, device="meta")
        return torch.empty((), dtype=t.dtype, device="meta")

    mutated = mutated_inputs(func, args, kwargs, dts)
    if func in _INPLACE_VIEWS:  # run as the out-of-place view, then re-point the wrapper
        return Decision(mesh, (None,) * len(dts), (), (), "inplace_view", _INPLACE_VIEWS[func], None, None, (), None)
    if func in _VALUE_OPS:
        return _fallback_decision(func, specs, mesh, None, mutated, reason="", warn=False)
    try:
        fake_out = func(*map_args(cls, args, to_fake), **map_args(cls, kwargs, to_fake))
    except Exception:  # no meta kernel: compute replicated and learn the outputs from it
        return _fallback_decision(func, specs, mesh, None, mutated, reason="it has no meta kernel")
    out_kind, outs = flatten_out(fake_out)
    alias = out_aliases(func, args, kwargs, dts, mutated, len(outs))
    for k, i in enumerate(alias):
        if i is not None and outs[k] is not None and tuple(outs[k].shape) != specs[i].shape:
            raise RuntimeError(
                f"{func} changes the shape of a DistTensor in place ({tuple(specs[i].shape)} -> "
                f"{tuple(outs[k].shape)}); use the out-of-place op instead"
            )
    if out_kind == "value" and not mutated:
        return Decision(mesh, (None,) * len(dts), (), (), "value", fake_out, None, None, (), None)
    out_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    call = OpCall(
        func,
        map_args(cls, args, to_meta),
        map_args(cls, kwargs, to_meta),
        tuple(to_meta(d) for d in dts),
        out_metas,
        tuple(s.placements for s in specs),
        tuple(mesh.shape),
    )
    shapes = get_out_shapes(func)
    fixed = shapes(call) if shapes is not None else None
    if fixed is not None:  # the CPU kernel's shapes, where its meta kernel says otherwise
        outs = [o if o is None or s is None else torch.empty(s, dtype=o.dtype, device="meta") for o, s in zip(outs, fixed)]
        out_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) if o is not None else None for o in outs)
        call = replace(call, out=out_metas)
    rule = get_rule(func)
    strategies = rule(call) if rule is not None else []
    if mutated:
        # An output that IS a written input (``x.mul_(y)``, ``out=``) must come out in the layout
        # the input was written in: (R, P) -> P is fine for ``x * y`` but would leave a summand in
        # a tensor still labelled R. Then prefer strategies that keep the written layouts.
        strategies = [
            s for s in strategies if all(i is None or s.outputs[k] == s.inputs[i] for k, i in enumerate(alias))
        ]
        strategies = [s for s in strategies if all(s.inputs[i] == specs[i].placements for i in mutated)] or strategies
    if not strategies:
        why = "it has no SPMD rule" if rule is None else "its rule offered no strategy"
        return replace(_fallback_decision(func, specs, mesh, outs, mutated, reason=why, kind=out_kind), out_alias=alias)
    best = _cheapest(strategies, specs, mesh, out_metas)
    plans = tuple(_plan(spec, req) for spec, req in zip(specs, best.inputs))
    out_specs = tuple(
        DistSpec(mesh, pl, m.shape, m.dtype) if m is not None else None for m, pl in zip(out_metas, best.outputs)
    )
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return Decision(
        mesh, plans, out_specs, strides, out_kind, None, get_local_impl(func), call, mutated, mesh_coord(mesh),
        _in_specs(specs, plans), out_alias=alias,
    )


@lru_cache(maxsize=65536)
def _plan(spec: DistSpec, req: tuple[Any, ...]) -> Plan | CrossMeshPlan | None:
    """The plan taking ``spec`` to placements ``req`` (default shard order); None if none needed."""
    dst = spec.with_placements(req) if tuple(req) != spec.placements or spec.shard_order else spec
    return None if dst == spec else plan_best(spec, dst)


@lru_cache(maxsize=65536)
def _plan_price(spec: DistSpec, req: tuple[Any, ...]) -> int | None:
    plan = _plan(spec, req)
    if plan is None:
        return None
    return plan.max_bytes() + (LATENCY_BYTES if plan.collectives() else 0)


def _cheapest(strategies: Sequence[Strategy], specs: list[DistSpec], mesh: Any, out_metas: tuple[TensorMeta | None, ...]) -> Strategy:
    """The first strategy of least ``_cost``, planning as few reshards as possible.

    The cost is lexicographic with bytes moved and inputs changed first, so when some strategy
    takes every input as it is, only such strategies can win: they are compared without running
    the planner for the others (the same choice, at a fraction of a cache miss's time).
    """
    free = [s for s in strategies if all(_as_is(spec, req) for spec, req in zip(specs, s.inputs))]
    return min(free or strategies, key=lambda s: _cost(s, specs, mesh, out_metas))


def _as_is(spec: DistSpec, req: tuple[Any, ...]) -> bool:
    return not spec.shard_order and tuple(req) == tuple(spec.placements)


def _cost(s: Strategy, specs: list[DistSpec], mesh: Any, out_metas: tuple[TensorMeta | None, ...]) -> tuple[int, int, int]:
    """(bytes moved, inputs changed, largest local output bytes): lexicographic."""
    moved = changed = 0
    for spec, req in zip(specs, s.inputs):
        price = _plan_price(spec, req)
        if price is not None:
            changed += 1
            moved += price
    compute = 0
    for m, pl in zip(out_metas, s.outputs):
        if m is not None:
            compute += _largest_local_numel(m.shape, pl, tuple(mesh.shape)) * _itemsize(m.dtype)
    return moved, changed, compute


@lru_cache(maxsize=65536)
def _largest_local_numel(shape: tuple[int, ...], placements: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> int:
    """Elements of the shard at mesh coordinate 0 (torch.chunk gives it the largest piece)."""
    n = 1
    for dim, size in enumerate(shape):
        for a, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim % len(shape) == dim:
                size = -(-size // mesh_shape[a])
        n *= size
    return n


def _fallback_decision(
    func: Any, specs: list[DistSpec], mesh: Any, outs: list[Any] | None, mutated: tuple[int, ...], reason: str,
    warn: bool = True, kind: str = "tensor",
) -> Decision:
    """Gather every input to Replicate and run the op itself; members wrap what the kernel
    returns (its shapes may differ from the meta kernel's, e.g. empty saved statistics), so the
    ``outs`` metas (None: no meta kernel) only give the layout for ranks outside the mesh."""
    name = str(func)
    if warn and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"autoparallel: {name} runs replicated (gather inputs, compute, keep Replicate) because "
            f"{reason}; register a rule with ap.register_rule to shard it",
            stacklevel=4,
        )
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    plans = tuple(_plan(s, rep) for s in specs)
    if outs is None:
        return Decision(mesh, plans, (), (), "unknown", None, None, None, mutated, mesh_coord(mesh), _in_specs(specs, plans),
                        fallback=True)
    out_specs = tuple(DistSpec(mesh, rep, tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return Decision(mesh, plans, out_specs, strides, kind, None, None, None, mutated, mesh_coord(mesh), _in_specs(specs, plans),
                    fallback=True)


def _in_specs(specs: list[DistSpec], plans: tuple[Plan | CrossMeshPlan | None, ...]) -> tuple[DistSpec, ...]:
    return tuple(p.dst if p is not None else s for s, p in zip(specs, plans))


def _finish(cls: Any, func: Any, d: Decision, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[DistSpec]) -> Decision:
    """Add what execution needs: where the DistTensors sit, and for in-place writes the way back
    to each written tensor's own layout (in-place ops never change a tensor's layout)."""
    back = tuple(None if d.in_specs[i] == specs[i] else plan_best(d.in_specs[i], specs[i]) for i in d.mutated)
    returns_view = any(r.alias_info is not None for r in func._schema.returns)
    moved_input = func in _MATERIALISED_VIEWS or any(_copies(p) for p in d.plans)
    contexts = None
    if d.local_fn is not None and d.coord is not None:
        assert d.call is not None
        shapes = tuple(None if s is None else s.local_shape(d.coord) for s in d.out_specs)
        contexts = (LocalContext(d.call, shapes, d.in_specs, d.out_specs, d.coord, False),
                    LocalContext(d.call, shapes, d.in_specs, d.out_specs, d.coord, True))
    detached_view = returns_view and moved_input
    simple = d.out_kind == "tensor" and not d.mutated and not d.fallback and not detached_view
    return replace(d, restore=back, slots=dist_slots(cls, args, kwargs), detached_view=detached_view,
                   contexts=contexts, simple=simple)


def _copies(plan: Plan | CrossMeshPlan | None) -> bool:
    """Whether running ``plan`` yields a new tensor rather than a view of the old shard."""
    if plan is None:
        return False
    if isinstance(plan, CrossMeshPlan):
        return True
    return any(s.kind not in (SLICE, RELABEL) for s in plan.steps)


# ---- executing ---------------------------------------------------------------------------
def _execute(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], d: Decision) -> Any:
    if d.out_kind == "value" and not d.mutated:
        return d.value
    if d.out_kind == "inplace_view":
        return _inplace_view(cls, func, d.value, args, kwargs)
    for i in d.mutated:
        if getattr(dts[i], "_detached_view", False):
            raise RuntimeError(
                f"{func}: in-place write to a view of a DistTensor whose layout had to change to "
                "take the view (e.g. slicing a sharded dim); the write would not reach the original "
                "tensor. Reshard the original first (e.g. to Replicate on that dim) or write out of place."
            )
    member = d.coord is not None
    if member:
        locs = [t._local if p is None else run_any(t._local, p) for t, p in zip(dts, d.plans)]
        if d.slots is not None:
            largs = place_locals(list(args), d.slots[0], locs)
            lkwargs = place_locals(dict(kwargs), d.slots[1], locs) if d.slots[1] else kwargs
        else:
            moved = {id(t): loc for t, loc in zip(dts, locs)}
            largs = map_args(cls, args, lambda t: moved[id(t)] if isinstance(t, cls) else t)
            lkwargs = map_args(cls, kwargs, lambda t: moved[id(t)] if isinstance(t, cls) else t)
        if d.local_fn is not None:
            assert d.contexts is not None
            # deferring is allowed in a differentiable forward outside region traces
            out = d.local_fn(d.contexts[not TRACES and torch.is_grad_enabled()], *largs, **lkwargs)
        else:
            out = func(*largs, **lkwargs)
        if d.simple and not _deferred.FRESH and isinstance(out, torch.Tensor):
            return cls._wrap(out, d.out_specs[0], d.out_strides[0])
    else:
        out = None
    if d.fallback and member and not d.mutated:  # the kernel's outputs, whatever meta said
        return _wrap_unknown(cls, out, d)
    if d.out_kind == "unknown" and not d.mutated:
        raise RuntimeError(f"autoparallel: {func} has no meta kernel and ran on a rank outside its mesh")
    if d.mutated:
        # Written tensors keep their identity and their layout. A written input that had to move
        # is copied back INTO its own shard: views of it (and what it is a view of) see the write.
        for i, back in zip(d.mutated, d.restore):
            if member and back is not None:
                dts[i]._local.copy_(run_any(locs[i], back))
        kind = d.out_kind if d.out_kind != "unknown" else flatten_out(out)[0] if member else "tensor"
        if kind in ("none", "value"):
            return None if kind == "none" else d.value
        if d.out_kind == "unknown" or all(a is not None for a in d.out_alias):
            written = [dts[i] for i in (d.out_alias if d.out_kind != "unknown" else d.mutated) if i is not None]
            return written[0] if kind == "tensor" else type(written)(written) if kind == "list" else tuple(written)
    if member:
        _, louts = flatten_out(out)
    else:
        louts = [None if s is None else torch.empty((0,), dtype=s.dtype, device=dts[0]._local.device) for s in d.out_specs]
    wrapped = [
        None if s is None else cls._wrap(lo, s, st)
        for lo, s, st in zip(louts, d.out_specs, d.out_strides)
    ]
    if _deferred.FRESH:  # the op started a deferred statistic: its outputs wait on it
        wrapped = _deferred.ADOPT[0](wrapped)
    if d.detached_view:
        for w in wrapped:
            if w is not None:
                w._detached_view = True
    if d.mutated:  # new outputs next to written inputs: the written ones are returned as themselves
        wrapped = [w if a is None else dts[a] for w, a in zip(wrapped, d.out_alias)]
    if d.out_kind == "tensor":
        return wrapped[0]
    if d.out_kind == "none":
        return None
    return tuple(wrapped) if d.out_kind == "tuple" else wrapped


def _inplace_view(cls: Any, func: Any, view_op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.squeeze_()`` and kin: ``x`` becomes the out-of-place view ``view_op(x)`` (its shard, a
    view of the old one, and its layout), and the wrapper's own sizes and strides follow."""
    x = args[0]
    out = dispatch(cls, view_op, args, kwargs)
    if getattr(out, "_detached_view", False):
        raise RuntimeError(
            f"{func}: the layout of the DistTensor had to change to take this view in place; "
            f"reshard it first (e.g. to Replicate) or use the out-of-place {view_op}"
        )
    x._local, x._spec, x._stride = out._local, out._spec, out._stride
    # Change the wrapper's metadata by running the op's meta kernel on it, dispatching nowhere
    # else (as torch.utils._python_dispatch.return_and_correct_aliasing does).
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    assert tuple(x.shape) == x._spec.shape, (func, tuple(x.shape), x._spec)
    return x


def _wrap_unknown(cls: Any, out: Any, d: Decision) -> Any:
    """Replicate DistTensors of exactly what a replicated (fallback) kernel returned."""
    kind, outs = flatten_out(out)
    if kind in ("value", "none"):
        return out
    rep = tuple(Replicate() for _ in range(d.mesh.ndim))
    wrapped: list[Any] = []
    for o in outs:
        if o is None:
            wrapped.append(None)
            continue
        if o.is_conj() or o.is_neg():  # the wrapper cannot carry the lazy bit: materialise it
            o = o.resolve_conj().resolve_neg()
        stride = tuple(o.stride()) if o.layout == torch.strided else None
        w = cls._wrap(o, DistSpec(d.mesh, rep, tuple(o.shape), o.dtype), stride)
        if d.detached_view:
            w._detached_view = True
        wrapped.append(w)
    if kind == "tensor":
        return wrapped[0]
    return tuple(wrapped) if kind == "tuple" else wrapped


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["Decision", "clear_cache", "dispatch"]
