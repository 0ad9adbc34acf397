"""Optimizer ops: ``_foreach_*`` list ops and the fused optimizer steps.

A foreach op is its per-element op applied to the groups of same-index tensors (``self[i]``,
``other[i]``, ...; scalars and ScalarList entries go along). Taking a per-axis product of
per-tensor choices would explode for many tensors, so the rule is whole-mesh and answers ONE
strategy: for each group it asks the element op's own rule (``add_`` for ``_foreach_add_``)
and keeps the cheapest strategy in which the written (first-list) tensor keeps its layout; a
single tensor shared by every group (``_foreach_mul_(grads, coef)``) is taken Replicate.
Exactness is the element rule's: a Partial gradient added into a sharded parameter is
reduce-scattered to the parameter's layout, ``P * scalar`` stays Partial, and so on.

Norms of lists (``_foreach_norm``, ``_foreach_powsum``, ``_foreach_max``) have their own rule:
a sharded tensor gives a Partial result only where the norm combines across shards (``sum``
for the 0-/1-norm and powsum, ``max``/``min`` for the inf-norms and max); the 2-norm needs
the whole tensor on every rank (Replicate).

Fused steps (``_fused_sgd_``, ``_fused_adam_``, ``_fused_adamw_``, ``_fused_adagrad_``) are
elementwise per parameter: every list follows the parameter's layout (a Partial parameter is
replicated for the step; the dispatcher restores its layout after), while ``state_steps`` and
tensor scalars (``lr``, ``grad_scale``, ``found_inf``) that are DistTensors must be Replicate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.compat import all_op_schemas
from autoparallel.placement import Partial, Placement, Replicate, Shard
from spmd_rules.base import LocalContext, OpCall, R, Strategy, TensorMeta
from spmd_rules.registry import get_local_impl, get_rule, register_local_impl, register_rule

aten = torch.ops.aten
Layout = tuple[Placement, ...]

_NORM_OPS = ("_foreach_norm", "_foreach_powsum", "_foreach_max")
_ELEMENT_OVERLOADS = {"List": ("Tensor", "Tensor_Tensor"), "ScalarList": ("Scalar", "Tensor_Scalar"),
                      "Scalar": ("Scalar", "Tensor_Scalar"), "ScalarAndTensor": ("Scalar",)}


# ---- argument layout ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Arg:
    """One schema argument as given: its name, whether it is a list, and its value."""

    name: str
    is_list: bool
    is_kwarg: bool
    value: Any


def _given_args(call: OpCall) -> list[_Arg]:
    """The call's arguments in the order the dispatcher flattens tensors (args, then kwargs)."""
    schema = call.op._schema.arguments
    out = [_Arg(a.name, isinstance(a.type, torch.ListType), False, v) for a, v in zip(schema, call.args)]
    by_name = {a.name: a for a in schema}
    for k, v in call.kwargs.items():
        a = by_name.get(k)
        out.append(_Arg(k, a is not None and isinstance(a.type, torch.ListType), True, v))
    return out


def _positions(call: OpCall) -> list[Any]:
    """Per given argument: flat input index (tensor), list of indices/None (list), or None."""
    k = 0
    out: list[Any] = []
    for a in _given_args(call):
        if isinstance(a.value, TensorMeta):
            out.append(k)
            k += 1
        elif isinstance(a.value, (list, tuple)):
            idx = []
            for v in a.value:
                idx.append(k if isinstance(v, TensorMeta) else None)
                k += isinstance(v, TensorMeta)
            out.append(idx)
        else:
            out.append(None)
    assert k == len(call.inputs), (call.op, k, len(call.inputs))
    return out


def _list_len(call: OpCall) -> int:
    return max((len(a.value) for a in _given_args(call) if a.is_list and isinstance(a.value, (list, tuple))), default=0)


# ---- per-group element calls -------------------------------------------------------------------
def element_op(op: Any) -> Any:
    """The per-element overload of a foreach overload (``_foreach_add_.List`` -> ``add_.Tensor``).

    An in-place op whose twin has no rule (``sin_``) gets the out-of-place op; None if none exists.
    """
    name = op.overloadpacket.__name__.removeprefix("_foreach_")
    elem = _overload(name, op._overloadname)
    if name.endswith("_") and (elem is None or get_rule(elem) is None):
        elem = _overload(name[:-1], op._overloadname)  # no rule for ``sin_``: the rule of ``sin``
    return elem


def _overload(name: str, overload: str) -> Any:
    if not hasattr(aten, name):
        return None
    packet = getattr(aten, name)
    for cand in (overload, *_ELEMENT_OVERLOADS.get(overload, ()), "default"):
        if cand in packet.overloads():
            return getattr(packet, cand)
    return getattr(packet, packet.overloads()[0])


@dataclass(frozen=True, slots=True)
class _Group:
    call: OpCall                  # the element op's call
    index: tuple[int, ...]        # flat input index (in the foreach call) of each element input
    shared: frozenset[int]        # element inputs that are the same tensor for every group


def _groups(call: OpCall, elem: Any) -> list[_Group]:
    given, pos = _given_args(call), _positions(call)
    in_place = not call.out
    groups = []
    for i in range(_list_len(call)):
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        index: list[int] = []
        shared: set[int] = set()
        for a, p in zip(given, pos):
            v = a.value[i] if a.is_list and isinstance(a.value, (list, tuple)) else a.value
            flat = p[i] if isinstance(p, list) else p
            if flat is not None:
                if not isinstance(p, list):
                    shared.add(len(index))
                index.append(flat)
            if a.is_kwarg:
                kwargs[a.name] = v
            else:
                args.append(v)
        inputs = tuple(call.inputs[j] for j in index)
        out = (inputs[0],) if in_place else (call.out[i],)
        sub = OpCall(elem, tuple(args), kwargs, inputs, out, tuple(call.placements[j] for j in index), call.mesh_shape)
        groups.append(_Group(sub, tuple(index), frozenset(shared)))
    return groups


def move_cost(m: TensorMeta, cur: Layout, req: Layout, mesh_shape: Sequence[int]) -> int:
    """Rough bytes one rank moves to take ``m`` from layout ``cur`` to ``req`` (a tie-breaker)."""
    local = math.prod(m.shape) * m.dtype.itemsize
    for a, p in enumerate(cur):
        if isinstance(p, Shard):
            local = -(-local // mesh_shape[a])
    cost = 0
    for a, (c, r) in enumerate(zip(cur, req)):
        n = mesh_shape[a]
        if c == r or isinstance(c, Replicate):
            continue
        if isinstance(c, Shard) and isinstance(r, Replicate):
            cost += (n - 1) * local
        elif isinstance(c, Partial) and isinstance(r, Replicate):
            cost += 2 * local
        elif isinstance(r, Shard):
            cost += local
        else:
            cost += 2 * n * local
    return cost


def _consistent(g: _Group, s: Strategy) -> bool:
    """The same tensor twice in a group (``addcmul_(v, g, g)``) must get one layout."""
    seen: dict[int, Layout] = {}
    for m, p in zip(g.call.inputs, s.inputs):
        if seen.setdefault(id(m), p) != p:
            return False
    return True


def _choose(g: _Group, strategies: Sequence[Strategy], in_place: bool) -> Strategy | None:
    """The group's cheapest exact strategy, keeping the written ``self`` in its layout if it can.

    Exact here means: a tensor met twice gets one layout, shared tensors are Replicate, and an
    in-place result comes out in the layout ``self`` went in (``x.mul_(P)`` with x Replicate
    would otherwise leave a Partial value in a tensor still labelled Replicate).
    """
    rep = tuple(R for _ in g.call.mesh_shape)
    cands = [s for s in strategies if _consistent(g, s) and all(s.inputs[k] == rep for k in g.shared)]
    if in_place:  # the result is written into self: it must come out in the layout self went in
        cands = [s for s in cands if s.outputs[0] == s.inputs[0]]
        cands = [s for s in cands if s.inputs[0] == g.call.placements[0]] or cands
    if not cands:
        return None

    def key(s: Strategy) -> tuple[int, int]:
        moved = changed = 0
        for m, cur, req in zip(g.call.inputs, g.call.placements, s.inputs):
            moved += move_cost(m, cur, req, g.call.mesh_shape)
            changed += cur != req
        return moved, changed

    return min(cands, key=key)


def _assemble(call: OpCall, groups: Sequence[_Group], chosen: Sequence[Strategy]) -> Strategy:
    """One whole-call strategy from per-group strategies (all Replicate if groups disagree)."""
    rep = tuple(R for _ in call.mesh_shape)
    inputs: list[Layout | None] = [None] * len(call.inputs)
    by_tensor: dict[int, Layout] = {}
    outputs: list[Layout] = []
    for g, s in zip(groups, chosen):
        for k, flat in enumerate(g.index):
            req = s.inputs[k]
            if by_tensor.setdefault(id(call.inputs[flat]), req) != req:  # one tensor in two groups
                return Strategy(tuple(rep for _ in call.inputs), tuple(rep for _ in call.out))
            inputs[flat] = req
        if call.out:
            outputs.append(s.outputs[0])
    return Strategy(tuple(p if p is not None else rep for p in inputs), tuple(outputs))


# ---- foreach: elementwise families -------------------------------------------------------------
def _foreach_ops() -> list[Any]:
    ops = []
    for schema in all_op_schemas():
        if not schema.name.startswith("aten::_foreach_") or schema.overload_name.endswith("out"):
            continue
        name = schema.name.removeprefix("aten::")
        if name in _NORM_OPS:
            continue
        packet = getattr(aten, name)
        ops.append(getattr(packet, schema.overload_name or "default"))
    return ops


FOREACH_OPS = _foreach_ops()


@register_rule(FOREACH_OPS)
def foreach_rule(call: OpCall) -> list[Strategy]:
    """One strategy: each same-index group takes its element op's cheapest layout-keeping strategy."""
    elem = element_op(call.op)
    rule = get_rule(elem) if elem is not None else None
    if rule is None:
        return []
    groups = _groups(call, elem)
    chosen = []
    for g in groups:
        s = _choose(g, rule(g.call), in_place=not call.out)
        if s is None:
            return []
        chosen.append(s)
    return [_assemble(call, groups, chosen)]


@register_local_impl(FOREACH_OPS)
def foreach_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """The foreach op on local lists; per element when the element op has a local implementation."""
    elem = element_op(ctx.call.op)
    impl = get_local_impl(elem) if elem is not None else None
    if impl is None:
        return ctx.call.op(*args, **kwargs)
    return _per_element(ctx, elem, impl, args, kwargs)


def _per_element(ctx: LocalContext, elem: Any, impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = ctx.call
    schema = call.op._schema.arguments
    is_list = {a.name: isinstance(a.type, torch.ListType) for a in schema}
    pos_lists = [isinstance(a.type, torch.ListType) for a in schema]
    groups = _groups(call, elem)
    outs = []
    for i, g in enumerate(groups):
        eargs = tuple(v[i] if pos_lists[j] else v for j, v in enumerate(args))
        ekw = {k: (v[i] if is_list.get(k) else v) for k, v in kwargs.items()}
        in_specs = tuple(ctx.in_specs[j] for j in g.index) if ctx.in_specs else ()
        if call.out:
            out_specs = (ctx.out_specs[i],) if ctx.out_specs else ()
            shapes = (ctx.out_shapes[i],)
        else:
            out_specs = in_specs[:1]
            shapes = (None if ctx.coord is None or not in_specs else in_specs[0].local_shape(ctx.coord),)
        out = impl(LocalContext(g.call, shapes, in_specs, out_specs, ctx.coord), *eargs, **ekw)
        if not call.out and out is not eargs[0]:  # the out-of-place twin stood in for ``op_``
            eargs[0].copy_(out)
        outs.append(out)
    return outs if call.out else None


# ---- foreach: norms ----------------------------------------------------------------------------
def _norm_kind(call: OpCall) -> str | None:
    """Partial type a sharded input's result takes (None: it needs the whole tensor)."""
    name = call.op.overloadpacket.__name__
    if name == "_foreach_max":
        return "max"
    ord_ = call.args[1] if len(call.args) > 1 else call.kwargs.get("ord", 2)
    ord_ = float(ord_)
    if name == "_foreach_powsum":
        return "sum" if math.isfinite(ord_) else None
    if ord_ in (0.0, 1.0):
        return "sum"
    return {math.inf: "max", -math.inf: "min"}.get(ord_)


@register_rule([aten._foreach_norm.Scalar, aten._foreach_powsum.Scalar, aten._foreach_max.default])
def foreach_norm_rule(call: OpCall) -> list[Strategy]:
    """Per tensor and axis: Shard -> Partial where the norm combines across shards, else Replicate.

    ``max`` also keeps a ``Partial(max)`` input Partial; no other Partial input passes.
    """
    kind = _norm_kind(call)
    keeps_max = call.op.overloadpacket is aten._foreach_max
    ins: list[Layout] = []
    outs: list[Layout] = []
    for cur in call.placements:
        passes = [kind is not None and (isinstance(p, Shard) or (keeps_max and p == Partial("max"))) for p in cur]
        ins.append(tuple(p if ok else R for p, ok in zip(cur, passes)))
        outs.append(tuple(Partial(kind) if ok and kind else R for ok in passes))
    return [Strategy(tuple(ins), tuple(outs))]


@register_local_impl([aten._foreach_norm.Scalar, aten._foreach_powsum.Scalar, aten._foreach_max.default])
def foreach_norm_local(ctx: LocalContext, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The op on local shards; an empty shard gives the identity of its max/min combination."""
    op = ctx.call.op
    kind = _norm_kind(ctx.call)
    if kind not in ("max", "min") or all(t.numel() for t in tensors):
        return list(op(tensors, *args, **kwargs))
    outs = []
    for t, m in zip(tensors, ctx.call.out):
        assert m is not None
        if t.numel():
            outs.append(op([t], *args, **kwargs)[0])
            continue
        ident: float
        if kind == "min":
            ident = math.inf                   # min |x| over nothing
        elif op.overloadpacket is not aten._foreach_max:
            ident = 0.0                        # max |x| over nothing
        elif m.dtype.is_floating_point:
            ident = -math.inf
        else:
            ident = torch.iinfo(m.dtype).min
        outs.append(torch.full((), ident, dtype=m.dtype, device=t.device))
    return outs


# ---- fused optimizer steps ---------------------------------------------------------------------
FUSED_OPS = [
    aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr,
    aten._fused_adam_.default, aten._fused_adam_.tensor_lr,
    aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr,
    aten._fused_adagrad_.default, aten._fused_adagrad_.tensor_lr,
]


# ``_fused_sgd_``/``_fused_adagrad_`` ship without a Meta kernel, so the dispatcher could not learn
# their (empty) outputs and would fall back. They return nothing: the Meta kernel does nothing.
_META_LIB = torch.library.Library("aten", "IMPL", "Meta")
for _op in ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_fused_adagrad_", "_fused_adagrad_.tensor_lr"):
    try:
        _META_LIB.impl(_op, lambda *args, **kwargs: None)
    except RuntimeError:  # a later torch that registers its own
        pass


@register_rule(FUSED_OPS)
def fused_rule(call: OpCall) -> list[Strategy]:
    """Every list follows its parameter's layout (Partial -> Replicate); state steps, tensor scalars R."""
    rep = tuple(R for _ in call.mesh_shape)
    req: list[Layout] = [rep] * len(call.inputs)
    given, pos = _given_args(call), _positions(call)
    params = pos[0]
    for a, p in zip(given, pos):
        if not isinstance(p, list) or a.name == "state_steps":
            continue
        for i, flat in enumerate(p):
            param = params[i]
            if flat is None or param is None:
                continue
            req[flat] = tuple(R if isinstance(q, Partial) else q for q in call.placements[param])
    return [Strategy(tuple(req), tuple(rep for _ in call.out))]


@register_local_impl(FUSED_OPS)
def fused_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> None:
    """The fused step on local shards, through contiguous copies where a shard is a strided view.

    The CPU fused kernels walk raw memory (they assume contiguous tensors, as parameters are
    on one device); a ``Shard(1)`` piece may be a non-contiguous view of a larger buffer.
    """
    written: list[tuple[torch.Tensor, torch.Tensor]] = []

    def dense(xs: Any) -> Any:
        if not isinstance(xs, (list, tuple)):
            return xs
        out = []
        for x in xs:
            if isinstance(x, torch.Tensor) and not x.is_contiguous():
                c = x.contiguous()
                written.append((x, c))
                x = c
            out.append(x)
        return out

    ctx.call.op(*[dense(a) for a in args], **{k: dense(v) for k, v in kwargs.items()})
    for orig, copy in written:
        orig.copy_(copy)


__all__ = ["FOREACH_OPS", "FUSED_OPS", "element_op", "foreach_norm_rule", "foreach_rule", "fused_rule", "move_cost"]
