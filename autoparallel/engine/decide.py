"""Deciding: rule -> strategy choice -> reshard plans, for one op call (pure metadata, cached by
the dispatcher).

The rule for the op (``spmd_rules``) offers strategies; the cheapest (bytes moved, inputs
changed, local output size: lexicographic) wins; the planner (``reshard``) plans each input's
move. Ops with no rule, or whose rule offers nothing, run replicated and warn once. The result
is a ``LocalStep`` (or a ``ValueDecision`` / ``InplaceViewDecision``) of
``autoparallel.engine.decision``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

import torch

from autoparallel.engine import generic
from autoparallel.engine.aliases import may_write, mutated_inputs, out_aliases
from autoparallel.engine.decision import Decision, InplaceViewDecision, LocalStep, OutKind, ValueDecision, evolve
from autoparallel.engine.kernels import Collectives, kernel_for
from autoparallel.engine.keys import mesh_coord
from autoparallel.engine.slots import dist_slots, flatten_out, map_args
from autoparallel.placement import Replicate, StridedShard
from autoparallel.spec import DistSpec
from autoparallel.strides import dense_strides
from reshard.choice import as_is, cheapest, cost, plan_price, plan_to
from reshard.crossmesh import CrossMeshPlan, plan_best
from reshard.plan import RELABEL, SLICE, Plan
from spmd_rules.base import LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import get_out_shapes, get_rule

_warned: set[str] = set()  # ops that warned they run replicated (once each)


def forget_warnings() -> None:
    """Let every op warn again that it runs replicated (with a cleared decision cache)."""
    _warned.clear()
# Ops whose result is a Python value of the whole tensor (``x.item()``, ``torch.equal``): they
# need the replicated value by definition, so running them replicated is the rule, not a gap.
VALUE_OPS = frozenset({
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
})
# Ops whose output's shape depends on the values (``nonzero``, ``masked_select``, ``unique``):
# every rank must see the whole input to agree on it, so they run replicated by definition too.
DATA_SHAPED_OPS = frozenset({
    torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default, torch.ops.aten.argwhere.default,
    torch.ops.aten.bincount.default,  # its length is the largest value + 1
})
# Views whose local implementation computes a new tensor (a lazy conj/neg bit cannot live on the
# wrapper): like views of a moved input, writes through them raise instead of being lost.
_MATERIALISED_VIEWS = frozenset({torch.ops.aten._conj.default, torch.ops.aten._neg_view.default})
_SIZED_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._reshape_alias.default})
# In-place views (they change the tensor's own shape or strides) and their out-of-place view.
_aten = torch.ops.aten
INPLACE_VIEWS = {
    _aten.squeeze_.default: _aten.squeeze.default, _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims, _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.transpose_.default: _aten.transpose.int, _aten.t_.default: _aten.t.default,
    _aten.as_strided_.default: _aten.as_strided.default,
}


def _restrides_only(args: tuple[Any, ...], kwargs: dict[str, Any], x: Any) -> bool:
    """Whether ``as_strided(x, size, stride, offset)`` is ``x`` itself: the same shape and offset,
    and the same strides on every dim longer than 1 (the strides of size-1 dims address nothing).
    Kernels restride so (``adaptive_avg_pool2d`` to 1 x 1 on a channels-last input)."""
    size, stride = args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    shape = x._spec.shape
    return (tuple(size) == tuple(shape) and offset in (None, 0) and len(stride) == len(shape)
            and all(n == 1 or int(a) == int(b) for n, a, b in zip(shape, stride, x._stride)))


def decide(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
           filled: list[Any] | None = None) -> Decision:
    """The decision for ``func`` on these arguments (``dts``: the DistTensors among them, in
    order): a pure function of their specs, strides and the non-tensor arguments. ``filled``
    gets the template's key where the decision is one shape of a template: filled in from one
    made at another shape, or the one made afresh that becomes the template (the dispatcher
    keeps a bounded number of each template's shapes)."""
    specs = [t._spec for t in dts]
    key, out = _template_key(cls, func, args, kwargs, dts, specs)
    template = generic.template(key)
    if template is not None and out is not None:
        if filled is not None:
            filled.append(key)
        return _from_template(template, specs, out, cls, func, args, kwargs, dts)
    stored: list[bool] = []
    d = _finish(cls, func, _decide(cls, func, args, kwargs, dts, stored), args, kwargs, specs, [t._stride for t in dts])
    if stored and key is not None and _template_kind(d, func):
        generic.store_template(key, d)
        if filled is not None:
            filled.append(key)
    return d


# ---- whole decisions at a new shape ----------------------------------------------------------
# A decision whose choice is stored shape-generically (``generic.choice_key``), that moves no
# input, writes none, runs the op itself and returns one new tensor of a known layout is the same
# decision at every shape of its signature but for the input and output specs and strides:
# those are filled in from a decision made at another shape, without the meta kernel, the
# ``OpCall``, the rule or the planner. ``tests/pure/test_generic_choice.py`` and
# ``tests/world/test_generic_decisions.py`` check it against fresh decisions.
@lru_cache(maxsize=4096)
def _templatable(func: Any) -> bool:
    return (func not in INPLACE_VIEWS and func not in VALUE_OPS and func not in DATA_SHAPED_OPS
            and func not in _MATERIALISED_VIEWS and func is not _aten.as_strided.default
            and not may_write(func) and get_out_shapes(func) is None)


def _strided(specs: Any) -> bool:
    return any(s is not None and s.has_strided for s in specs)


def _template_kind(d: Decision, func: Any) -> bool:
    """Whether ``d`` can be filled in at another shape: a local step on this mesh writing nothing,
    its outputs all tensors, its moves (if any) re-plannable from placements alone — and none
    for a view (a view of a moved input is detached: decided afresh)."""
    return (type(d) is LocalStep and d.coord is not None and not d.mutated and not d.fallback
            and not _strided(d.in_specs) and not _strided(d.out_specs)
            and not d.detached_view and d.out_kind in (OutKind.TENSOR, OutKind.TUPLE, OutKind.LIST)
            and all(o is not None for o in d.out_specs)
            and all(not isinstance(p, CrossMeshPlan) for p in d.plans)
            and all(p is None or not p.dst.shard_order for p in d.plans)
            and (not _returns_view(func) or all(p is None for p in d.plans)))


def _template_key(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
                  specs: list[DistSpec]) -> tuple[Any, generic.Layouts | None]:
    """(the template key, the known output layouts) of this call; (None, None) where none."""
    if not _templatable(func):
        return None, None
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh is not mesh and s.mesh != mesh:
            return None, None

    def is_dist(a: Any) -> bool:
        return isinstance(a, cls)

    return generic.template_key(func, specs, [(s.shape, d._stride) for s, d in zip(specs, dts)], args, kwargs, is_dist)


def _from_template(t: LocalStep, specs: list[DistSpec], outs: generic.Layouts, cls: Any, func: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any], dts: list[Any]) -> LocalStep:
    """The decision ``t`` made at another shape, for inputs ``specs`` and output layouts ``outs``."""
    assert t.coord is not None and len(outs) == len(t.out_specs)
    out_specs: list[DistSpec] = []
    locals_: list[tuple[int, ...]] = []
    dense: list[tuple[int, ...] | None] = []
    for (shape, stride, dtype), was, d in zip(outs, t.out_specs, t.out_dense):
        assert was is not None
        spec = was.with_shape(shape, dtype)
        local = spec.local_shape(t.coord)
        out_specs.append(spec)
        locals_.append(local)
        dense.append(dense_strides(local, stride) if d is not None else None)
    strides, dense_out = tuple(o[1] for o in outs), tuple(dense)
    moves: dict[str, Any] = {}
    if any(p is not None for p in t.plans):
        # the stored choice's moves, planned for these inputs (``_plan`` as ``_local_step`` does)
        plans = tuple(None if p is None else plan_to(s, p.dst.placements) for s, p in zip(specs, t.plans))
        in_specs = _in_specs(specs, plans)
        wrapper = [d._stride for d in dts]
        moves = dict(plans=plans, in_conform=tuple(
            (i, wrapper[i], dense_strides(in_specs[i].local_shape(t.coord), wrapper[i]))
            for i, p in enumerate(plans) if _copies(p)))
    else:
        in_specs = tuple(specs)
    specs_out = tuple(out_specs)
    if t.context is None:  # the op itself runs: the rule's view of the call is not needed
        return evolve(t, in_specs=in_specs, call=None, out_specs=specs_out, out_strides=strides, out_dense=dense_out,
                      **moves)
    metas: dict[int, TensorMeta] = {}

    def to_meta(x: Any) -> Any:
        if isinstance(x, cls):
            return metas.setdefault(id(x), TensorMeta(x._spec.shape, x._spec.dtype))
        return ScalarMeta(x.dtype)

    call = OpCall(func, map_args(cls, args, to_meta), map_args(cls, kwargs, to_meta), tuple(to_meta(d) for d in dts),
                  tuple(TensorMeta(o[0], o[2]) for o in outs), tuple(s.placements for s in specs), tuple(t.mesh.shape))
    shapes = tuple(locals_)
    context = evolve(t.context, call=call, out_shapes=shapes, in_specs=in_specs, out_specs=specs_out)
    return evolve(t, in_specs=in_specs, call=call, context=context, out_specs=specs_out, out_strides=strides,
                  out_dense=dense_out, **moves)


def _decide(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
            stored: list[Any]) -> Decision:
    """``stored`` gets an entry where the choice is stored shape-generically."""
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
    if func in INPLACE_VIEWS:  # run as the out-of-place view, then re-point the wrapper
        return InplaceViewDecision(INPLACE_VIEWS[func])
    if func in VALUE_OPS or func in DATA_SHAPED_OPS:
        return _fallback_decision(func, specs, mesh, None, mutated, reason="", warn=False)
    fake_kwargs = map_args(cls, kwargs, to_fake)
    if isinstance(fake_kwargs.get("device"), (torch.device, str)):  # ``_to_copy(x, device=cpu)``
        # (autocast's casts, ``.to(device)``): where the result lives is the local step's business;
        # the shapes and dtypes come from meta either way
        fake_kwargs["device"] = torch.device("meta")
    same = func is _aten.as_strided.default and _restrides_only(args, kwargs, dts[0])
    # An op whose output shape follows from its definition runs its meta kernel once per dtype
    # signature, not per shape (autoparallel.engine.generic).
    shaped = [(d._spec.shape, d._stride) for d in dts] if not mutated else None
    out_key = generic.out_key(func, args, kwargs, lambda a: isinstance(a, cls)) if shaped else None
    fake_out = generic.known_out(func, out_key, shaped, args, kwargs) if shaped else None
    if fake_out is None:
        try:
            fake_out = func(*map_args(cls, args, to_fake), **fake_kwargs)
        except Exception:  # no meta kernel: compute replicated and learn the outputs from it
            return _fallback_decision(func, specs, mesh, None, mutated, reason="it has no meta kernel")
        if shaped:
            generic.learn_out(func, out_key, shaped, fake_out, args, kwargs)
    out_kind, outs = flatten_out(fake_out)
    alias = out_aliases(func, args, kwargs, dts, mutated, len(outs))
    for k, i in enumerate(alias):
        if i is not None and outs[k] is not None and tuple(outs[k].shape) != specs[i].shape:
            raise RuntimeError(
                f"{func} changes the shape of a DistTensor in place ({tuple(specs[i].shape)} -> "
                f"{tuple(outs[k].shape)}); use the out-of-place op instead"
            )
    if out_kind is OutKind.VALUE and not mutated:
        if isinstance(fake_out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in fake_out):
            # tensors next to values (CUDA flash attention's (out, lse, ..., max_q, max_k, seed, ...)):
            # no rule speaks for them; run replicated, wrapping the tensors the kernel returns
            return _fallback_decision(func, specs, mesh, None, mutated, reason="it returns tensors mixed with values")
        return ValueDecision(fake_out)
    out_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    if same:  # decided and run as the alias it is; the wrapper advertises the asked strides
        func, args, kwargs = _aten.alias.default, args[:1], {}
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
    key = generic.choice_key(call, specs) if rule is not None and not mutated else None
    best = generic.stored_choice(key)
    if best is not None:  # decided at another shape of this signature: the same choice
        stored.append(True)
        return _local_step(func, mesh, specs, best, call, out_metas, outs, out_kind, alias, mutated, fake_out)
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
        return replace(_fallback_decision(func, specs, mesh, outs, mutated, reason=why, kind=out_kind), out_alias=alias,
                       meta_value=fake_out if out_kind is OutKind.VALUE else None)
    best = cheapest(strategies, specs, tuple(mesh.shape), out_metas)
    if key is not None and _generic_best(strategies, specs, mesh, out_metas) is best:
        generic.store_choice(key, best)
        stored.append(True)
    return _local_step(func, mesh, specs, best, call, out_metas, outs, out_kind, alias, mutated, fake_out)


def _local_step(func: Any, mesh: Any, specs: list[DistSpec], best: Strategy, call: OpCall,
                out_metas: tuple[TensorMeta | None, ...], outs: list[Any], out_kind: OutKind,
                alias: tuple[int | None, ...], mutated: tuple[int, ...], fake_out: Any) -> LocalStep:
    """The ``LocalStep`` running ``best`` on these inputs (plans, output specs and strides)."""
    plans = tuple(plan_to(spec, req) for spec, req in zip(specs, best.inputs))
    out_specs = tuple(
        DistSpec(mesh, pl, m.shape, m.dtype) if m is not None else None for m, pl in zip(out_metas, best.outputs)
    )
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return LocalStep(
        mesh=mesh, coord=mesh_coord(mesh), plans=plans, in_specs=_in_specs(specs, plans),
        local_fn=kernel_for(func), call=call, out_kind=out_kind, out_specs=out_specs, out_strides=strides,
        out_alias=alias, mutated=mutated, meta_value=fake_out if out_kind is OutKind.VALUE else None,
    )


def _generic_best(strategies: Sequence[Strategy], specs: Sequence[DistSpec], mesh: Any,
                  out_metas: tuple[TensorMeta | None, ...]) -> Strategy | None:
    """The strategy the cost comparison picks at every shape of the call's signature, where that
    follows without comparing sizes: the one strategy taking every input as it is (only such
    strategies compete when there is one); with several, and one output, the one of least local
    output (each strategy's is the output's size over a divisor of its own at every shape of the
    signature: its generic sizes are multiples of the mesh's size, the rest are fixed, so their
    order holds; with several outputs sums of such terms may swap; and where a generic size is
    no multiple, ``torch.chunk``'s rounding up may too); with none taking every
    input as it is, the one strategy that moves nothing (every input as it is or reached by local
    steps: slices, relabels, ``R -> P``; priced 0 at any size, while every other plan has a
    collective or a fill, priced above 0 at any size). None where sizes decide, and where a
    ``StridedShard`` is in or out (its block count is a product of sizes)."""
    if _strided(specs):
        return None
    free = [s for s in strategies if all(as_is(spec, req) for spec, req in zip(specs, s.inputs))]
    if len(free) == 1:
        best: Strategy | None = free[0]
    elif free:
        if sum(m is not None for m in out_metas) != 1 or _uneven_sizes(mesh, out_metas):
            return None
        best = min(free, key=lambda s: cost(s, list(specs), tuple(mesh.shape), out_metas))
    else:
        still = [s for s in strategies if all(not plan_price(spec, tuple(req)) for spec, req in zip(specs, s.inputs))]
        best = still[0] if len(still) == 1 else None
    if best is not None and any(isinstance(p, StridedShard) for o in best.outputs for p in o):
        return None
    return best


def _uneven_sizes(mesh: Any, out_metas: tuple[TensorMeta | None, ...]) -> bool:
    """Whether an output's size is generic but no multiple of the mesh's size (``generic._coding``):
    free strategies are compared by their local outputs alone (``_cost``: nothing moves), so
    the inputs' sizes (an odd sequence length reduced away) do not matter."""
    n = mesh.size
    return any(size % n and generic.is_generic(size, n) for m in out_metas if m is not None for size in m.shape)


def _fallback_decision(
    func: Any, specs: list[DistSpec], mesh: Any, outs: list[Any] | None, mutated: tuple[int, ...], reason: str,
    warn: bool = True, kind: OutKind = OutKind.TENSOR,
) -> LocalStep:
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
    plans = tuple(plan_to(s, rep) for s in specs)
    where = dict(mesh=mesh, coord=mesh_coord(mesh), plans=plans, in_specs=_in_specs(specs, plans), mutated=mutated)
    if outs is None:
        return LocalStep(**where, out_kind=OutKind.UNKNOWN, fallback=True)
    out_specs = tuple(DistSpec(mesh, rep, tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return LocalStep(**where, out_kind=kind, out_specs=out_specs, out_strides=strides, fallback=True)


def _in_specs(specs: list[DistSpec], plans: tuple[Plan | CrossMeshPlan | None, ...]) -> tuple[DistSpec, ...]:
    return tuple(p.dst if p is not None else s for s, p in zip(specs, plans))


def _finish(cls: Any, func: Any, d: Decision, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[DistSpec],
            strides: list[tuple[int, ...]]) -> Decision:
    """Add what execution needs: where the DistTensors sit, for in-place writes the way back
    to each written tensor's own layout (in-place ops never change a tensor's layout), and the
    strides the shards must follow (``autoparallel.strides``): the meta kernel computed the
    outputs' strides from the inputs' wrapper strides, so a shard a plan copied is made to
    follow its wrapper's, and every new output's shard the strides its wrapper advertises."""
    if not isinstance(d, LocalStep):
        return d
    back = tuple(None if d.in_specs[i] == specs[i] else plan_best(d.in_specs[i], specs[i]) for i in d.mutated)
    returns_view = _returns_view(func)
    moved_input = func in _MATERIALISED_VIEWS or any(_copies(p) for p in d.plans)
    context = None
    if d.local_fn is not None and d.coord is not None:
        assert d.call is not None
        shapes = tuple(None if s is None else s.local_shape(d.coord) for s in d.out_specs)
        context = LocalContext(d.call, shapes, d.in_specs, d.out_specs, d.coord, Collectives(d.mesh))
    # (a view of a StridedShard layout may copy the shard: ``spmd_rules.view._strided_view``)
    detached_view = returns_view and (moved_input or (func in _SIZED_VIEWS and _strided(d.in_specs + d.out_specs)))
    simple = d.out_kind is OutKind.TENSOR and not d.mutated and not d.fallback and not detached_view
    in_conform: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    out_dense: tuple[tuple[int, ...] | None, ...] = ()
    if d.coord is not None:
        in_conform = tuple((i, strides[i], dense_strides(d.in_specs[i].local_shape(d.coord), strides[i]))
                           for i, p in enumerate(d.plans) if _copies(p))
        # views and written inputs follow their inputs' shards; fallback outputs carry the kernel's own strides
        fresh = not returns_view and not d.fallback
        alias = d.out_alias or (None,) * len(d.out_specs)
        out_dense = tuple(
            dense_strides(s.local_shape(d.coord), st) if fresh and s is not None and st is not None and a is None else None
            for s, st, a in zip(d.out_specs, d.out_strides, alias)
        )
    return replace(d, restore=back, slots=dist_slots(cls, args, kwargs), detached_view=detached_view,
                   context=context, simple=simple, in_conform=in_conform, out_dense=out_dense)


@lru_cache(maxsize=4096)
def _returns_view(func: Any) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _copies(plan: Plan | CrossMeshPlan | None) -> bool:
    """Whether running ``plan`` yields a new tensor rather than a view of the old shard."""
    if plan is None:
        return False
    if isinstance(plan, CrossMeshPlan):
        return True
    return any(s.kind not in (SLICE, RELABEL) for s in plan.steps)


