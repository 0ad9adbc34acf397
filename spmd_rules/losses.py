"""Elementwise losses and their backward ops: a term per element, then ``reduction``.

``mse_loss``, ``huber_loss``, ``smooth_l1_loss``, ``soft_margin_loss``,
``binary_cross_entropy`` and ``binary_cross_entropy_with_logits`` compute one term per
element of ``broadcast(self, target)`` (times a broadcast ``weight``; ``pos_weight`` along the
last dim), then ``reduction`` none / mean / sum. Their inputs may be sharded alike on any dim
(a broadcast input follows: ``base.follow``):

* ``none``: pointwise, the loss sharded as its inputs;
* ``sum``: the local sum of this rank's terms: ``Partial(sum)``;
* ``mean``: the same divided by the *global* count (``loss_local``): summands of the mean.

Their backward ``op_backward(grad_output, self, target, ..., reduction, ...)`` is elementwise in
``self``/``target`` (where both have the gradient's shape): sharded alike, with the 0-d
``grad_output`` of mean/sum replicated (mean: the local step divides by the global count,
``loss_backward_local``); linear in ``grad_output``: a Partial one passes with the rest whole.

Also ``log_sigmoid_forward``/``log_sigmoid_backward`` (``F.logsigmoid``, a DPO loss's core):
pointwise, with a ``buffer`` the same shape as the input on CPU (sharded alike) and empty on
CUDA (left whole).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R, TensorMeta, bound_args, follow, replicate_all, tensor_names
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2
LINEAR = ("sum", "avg")

# forward -> backward (``binary_cross_entropy_with_logits`` has no backward op: autograd's
# formula is made of pointwise ops)
LOSSES = {
    aten.mse_loss.default: aten.mse_loss_backward.default,
    aten.huber_loss.default: aten.huber_loss_backward.default,
    aten.smooth_l1_loss.default: aten.smooth_l1_loss_backward.default,
    aten.soft_margin_loss.default: aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy.default: aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default: None,
}
FORWARD = list(LOSSES)
BACKWARD = [b for b in LOSSES.values() if b is not None]


def _reduction(call: OpCall) -> int:
    return int(bound_args(call.op, call.args, call.kwargs).get("reduction", MEAN))


def _terms_shape(call: OpCall, names: Sequence[str]) -> tuple[int, ...] | None:
    """The shape of the per-element terms: ``self`` and ``target`` broadcast (None: they do not)."""
    b = bound_args(call.op, call.args, call.kwargs)
    shapes = [tuple(b[n].shape) for n in names if isinstance(b.get(n), TensorMeta)]
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


def _sharded(call: OpCall, shape: tuple[int, ...], d: int, keep: Sequence[str] = ()) -> tuple[Placement, ...]:
    """Every tensor input following ``Shard(d)`` of the terms' ``shape``; those named in ``keep`` whole."""
    return tuple(R if n in keep else follow(Shard(d), shape, m.shape) for n, m in zip(tensor_names(call), call.inputs))


@register_axis_rule(FORWARD)
def loss_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Inputs sharded alike on a dim of the terms: the loss sharded (none) or ``Partial(sum)``."""
    strategies = [replicate_all(call)]
    shape = _terms_shape(call, ("self", "target"))
    if shape is None:
        return strategies
    none = _reduction(call) == NONE
    for d in range(len(shape)):
        if shape[d] >= 2:
            strategies.append(AxisStrategy(_sharded(call, shape, d), (Shard(d) if none else Partial("sum"),)))
    return strategies


@register_axis_rule(BACKWARD)
def loss_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Elementwise in ``self``/``target`` where both have the gradient's shape: all sharded
    alike (a 0-d ``grad_output`` of mean/sum whole); linear in ``grad_output``."""
    strategies = [replicate_all(call)]
    grad = call.out[0]
    shape = _terms_shape(call, ("self", "target"))
    names = tensor_names(call)
    if grad is not None and shape == tuple(grad.shape):
        keep = ("grad_output",) if _reduction(call) != NONE else ()
        for d in range(len(shape)):
            if shape[d] >= 2:
                strategies.append(AxisStrategy(_sharded(call, shape, d, keep), (Shard(d),)))
    for t in LINEAR:
        strategies.append(AxisStrategy(tuple(Partial(t) if n == "grad_output" else R for n in names), (Partial(t),)))
    return strategies


def _split(ctx: LocalContext) -> bool:
    """Whether this step's inputs are split (the mean's count is the global one, not the local)."""
    return any(isinstance(p, Shard) for spec in ctx.in_specs for p in spec.placements)


def _count(call: OpCall) -> int:
    shape = _terms_shape(call, ("self", "target"))
    assert shape is not None
    return math.prod(shape)


def _as_sum(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call with ``reduction`` = sum."""
    names = [a.name for a in op._schema.arguments]
    k = names.index("reduction")
    if k < len(args):
        return (*args[:k], SUM, *args[k + 1:]), kwargs
    return args, {**kwargs, "reduction": SUM}


@register_local_impl(FORWARD + BACKWARD)
def loss_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``mean`` over split inputs: the local sum over the global count (the summands of the
    mean, forward; the gradient's share, backward). Otherwise the op on the shards."""
    op = ctx.call.op
    if _reduction(ctx.call) != MEAN or not _split(ctx):
        return op(*args, **kwargs)  # type: ignore[no-any-return]
    sargs, skwargs = _as_sum(op, args, kwargs)
    return op(*sargs, **skwargs) / _count(ctx.call)  # type: ignore[no-any-return]


# ---- log-sigmoid ------------------------------------------------------------------------------
@register_axis_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Pointwise; the buffer (the input's shape on CPU, empty on CUDA) sharded alike where it is
    the input's shape."""
    x, buffer = call.inputs[0], call.out[1]
    strategies = [replicate_all(call)]
    for d in range(len(x.shape)):
        if x.shape[d] >= 2:
            same = buffer is not None and tuple(buffer.shape) == tuple(x.shape)
            strategies.append(AxisStrategy((Shard(d),), (Shard(d), Shard(d) if same else R)))
    return strategies


@register_axis_rule(aten.log_sigmoid_backward.default)
def log_sigmoid_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Pointwise in (grad_output, self); the buffer sharded alike where it is their shape."""
    g, x, buffer = call.inputs[:3]
    strategies = [replicate_all(call)]
    if tuple(g.shape) != tuple(x.shape):
        return strategies
    for d in range(len(x.shape)):
        if x.shape[d] >= 2:
            b = Shard(d) if tuple(buffer.shape) == tuple(x.shape) else R
            strategies.append(AxisStrategy((Shard(d), Shard(d), b), (Shard(d),)))
    return strategies
