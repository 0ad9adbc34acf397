"""Pointwise ops: elementwise with broadcasting; Partial passes only where the op is linear.

Along one mesh axis the output may be sharded on any of its dims (each input follows through
broadcasting), replicated, or — for linear ops — Partial:

- copies (``clone``, ``detach``, casts, ``zero_``): ``P(t) -> P(t)`` for every reduce type, but
  a floating value cast to an integer type keeps only ``P(max|min)`` (truncating each summand is
  not truncating the sum), and a cast to bool none;
- ``neg``: ``P(sum|avg) -> P``;
- ``add``/``sub`` of two tensors: ``P + P -> P`` (same sum/avg type). ``P + scalar`` and
  ``P + R`` are not linear (the scalar would be added once per rank) and need a reduction;
- ``mul``/``div``: one ``P(sum|avg)`` operand (the numerator for ``div``) times replicated
  operands or scalars stays ``P``;
- ``isin``, ``bucketize``, ``searchsorted`` (1-d sequence): sharded like their elements or
  values, the tested values, boundaries or sorted sequence replicated;
- a ``StridedShard`` input stays strided where every sharded operand is strided alike
  (``base.with_strided``);
- any other op tagged ``torch.Tag.pointwise`` (``rsub.Scalar``, ``sinc``, ``logaddexp``, the
  in-place ``cos_``...): sharded or replicated, no Partial (``registry.register_tag_rule``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import AxisStrategy, OpCall, R, TensorMeta, follow, replicate_all, with_strided
from spmd_rules.registry import register_axis_rule, register_tag_rule

aten = torch.ops.aten

COPY_OPS = [
    aten.clone, aten.detach, aten.alias, aten.contiguous, aten._to_copy, aten.positive,
    aten.lift_fresh, aten.zero_, aten.zero, aten.conj, aten.resolve_conj,
    aten.resolve_neg,
]
NEG_OPS = [aten.neg, aten.neg_]
ADD_OPS = [aten.add, aten.add_, aten.sub, aten.sub_]
MUL_OPS = [aten.mul, aten.mul_, aten.div, aten.div_, aten.threshold_backward]

PLAIN_OPS = [
    aten.abs, aten.abs_, aten.acos, aten.acosh, aten.asin, aten.asinh, aten.atan, aten.atan2,
    aten.atanh, aten.bitwise_and, aten.bitwise_not, aten.bitwise_or, aten.bitwise_xor,
    aten.ceil, aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_max, aten.copysign, aten.cos,
    aten.cosh, aten.eq, aten.erf, aten.erfc, aten.erfinv, aten.exp, aten.exp_, aten.exp2,
    aten.expm1, aten.fill, aten.fill_, aten.floor, aten.floor_divide, aten.fmod, aten.frac,
    aten.ge, aten.gelu, aten.gelu_backward, aten.gt, aten.hardtanh, aten.hardtanh_backward,
    aten.isnan, aten.isinf, aten.le, aten.leaky_relu, aten.leaky_relu_backward, aten.lerp,
    aten.log, aten.log10, aten.log1p, aten.log2, aten.logical_and, aten.logical_not,
    aten.logical_or, aten.logical_xor, aten.lt,
    aten.maximum, aten.minimum, aten.ne, aten.nan_to_num, aten.pow, aten.pow_,
    aten.reciprocal, aten.relu, aten.relu_, aten.remainder, aten.round, aten.rsqrt,
    aten.sigmoid, aten.sigmoid_, aten.sigmoid_backward, aten.sign, aten.silu, aten.silu_,
    aten.silu_backward, aten.sin, aten.sinh, aten.sqrt, aten.sqrt_, aten.square, aten.tan,
    aten.tanh, aten.tanh_, aten.tanh_backward, aten.trunc, aten.where, aten.addcmul,
    aten.addcmul_, aten.addcdiv, aten.addcdiv_, aten.lerp_, aten.mish, aten.elu,
    aten.elu_backward, aten.softplus, aten.hardswish, aten.hardsigmoid, aten.logit,
    aten.xlogy, aten.sgn, aten.signbit, aten.isfinite, aten.threshold, aten.heaviside,
    aten.bitwise_left_shift, aten.bitwise_right_shift, aten.float_power, aten.hypot,
    aten.igamma, aten.lgamma, aten.digamma, aten.i0, aten.nextafter, aten.fmax, aten.fmin,
    # activations' backward ops torch does not tag pointwise
    aten.softplus_backward, aten.hardswish_backward, aten.hardsigmoid_backward, aten.mish_backward,
]


def _sharded_strategies(call: OpCall) -> list[AxisStrategy]:
    out = call.out[0]
    assert out is not None
    strategies = [replicate_all(call)]
    for d in range(out.ndim):
        if out.shape[d] < 2:
            continue
        ins = tuple(follow(Shard(d), out.shape, m.shape) for m in call.inputs)
        strategies.append(AxisStrategy(ins, tuple(Shard(d) if o is not None else R for o in call.out)))
    return strategies


def _partial(call: OpCall, inputs: Sequence[Placement], t: str) -> AxisStrategy:
    return AxisStrategy(tuple(inputs), tuple(Partial(t) for _ in call.out))


@register_tag_rule(torch.Tag.pointwise)  # every other pointwise op (rsub.Scalar, sinc, ...): not linear
@register_axis_rule(PLAIN_OPS)
@with_strided
def plain_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return _sharded_strategies(call)


@register_axis_rule([aten.masked_fill, aten.masked_fill_])
@with_strided
def masked_fill_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``masked_fill(x, mask, value)``: pointwise; a Partial ``x`` stays Partial with the mask whole
    where the filled value reduces to itself: every rank fills ``value``, so its avg, max and min
    over the ranks is ``value``, and its sum is ``value`` when that is 0 (a Python 0: the loss-parallel
    label smoothing's fill of ignored targets)."""
    strategies = _sharded_strategies(call)
    if not call.inputs or not isinstance(call.placements[0][axis], Partial):
        return strategies
    value = call.args[2] if len(call.args) > 2 else None
    kinds = ["avg", "max", "min"] + (["sum"] if isinstance(value, (int, float)) and value == 0 else [])
    rest = tuple(R for _ in call.inputs[1:])
    return strategies + [_partial(call, (Partial(t),) + rest, t) for t in kinds]


def _elementwise_in(call: OpCall, k: int) -> list[AxisStrategy]:
    """The output is elementwise in input ``k`` and keeps its sharding; every other tensor input
    (values tested against, bucket boundaries, a sorted sequence) is needed whole (Replicate)."""
    strategies = [replicate_all(call)]
    out = call.out[0]
    if out is None or len(call.inputs) <= k or out.shape != call.inputs[k].shape:
        return strategies
    for d in range(out.ndim):
        if out.shape[d] >= 2:
            strategies.append(AxisStrategy(tuple(Shard(d) if i == k else R for i in range(len(call.inputs))), (Shard(d),)))
    return strategies


@register_axis_rule([aten.isin])
def isin_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``isin(elements, test_elements)``: elementwise in ``elements``, whose sharding the output
    keeps; the values tested against are needed whole (Replicate). A scalar ``elements`` gives
    a 0-d result: replicated."""
    if not call.args or not isinstance(call.args[0], TensorMeta):
        return [replicate_all(call)]
    return _elementwise_in(call, 0)


@register_axis_rule([aten.bucketize.Tensor])
def bucketize_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``bucketize(input, boundaries)``: elementwise in ``input``; the boundaries whole."""
    return _elementwise_in(call, 0)


@register_axis_rule([aten.searchsorted.Tensor])
def searchsorted_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``searchsorted(sorted_sequence, values)``: with a 1-d sequence, elementwise in ``values``
    (the sequence, and a ``sorter``, whole); an n-d sequence pairs its rows with the values'
    rows: replicated."""
    if len(call.args) < 2 or not isinstance(call.args[0], TensorMeta) or call.args[0].ndim != 1:
        return [replicate_all(call)]
    return _elementwise_in(call, 1)


@register_axis_rule(COPY_OPS)
@with_strided
def copy_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    strategies = _sharded_strategies(call)
    out = call.out[0] if call.out else None
    kinds = ("sum", "avg", "max", "min") if _sums_survive(call) else () if out is not None and out.dtype == torch.bool \
        else ("max", "min")
    strategies += [_partial(call, (Partial(t),), t) for t in kinds]
    return strategies


def _sums_survive(call: OpCall) -> bool:
    """Whether a cast keeps a sum of summands the sum (the cast of each summand adds up to the
    cast of the sum): into a floating type, or between integer types. A floating value made
    integer or bool is not (``1.6 + -0.4`` is ``1.2 -> 1``, the summands ``1 + 0``); a monotone
    cast (to an integer type) keeps a max or min, one to bool (``-5 -> True``, ``0 -> False``) not."""
    src, out = call.inputs[0] if call.inputs else None, call.out[0] if call.out else None
    if src is None or out is None or src.dtype == out.dtype:
        return True
    if out.dtype.is_floating_point or out.dtype.is_complex:
        return True
    return out.dtype != torch.bool and not (src.dtype.is_floating_point or src.dtype.is_complex or src.dtype == torch.bool)


@register_axis_rule(NEG_OPS)
@with_strided
def neg_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return _sharded_strategies(call) + [_partial(call, (Partial(t),), t) for t in ("sum", "avg")]


def _tensor_operands(call: OpCall, n: int) -> bool:
    return all(isinstance(a, TensorMeta) for a in call.args[:n])


@register_axis_rule(ADD_OPS)
@with_strided
def add_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    strategies = _sharded_strategies(call)
    if len(call.inputs) == 2 and _tensor_operands(call, 2):
        strategies += [_partial(call, (Partial(t), Partial(t)), t) for t in ("sum", "avg")]
    return strategies


@register_axis_rule(MUL_OPS)
@with_strided
def mul_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    strategies = _sharded_strategies(call)
    if call.kwargs.get("rounding_mode") is not None:
        return strategies  # floor/trunc division is not linear
    linear_args = (0,) if call.op.overloadpacket in (aten.div, aten.div_, aten.threshold_backward) else (0, 1)
    for i, m in enumerate(call.inputs):
        if i not in linear_args or call.args[i] is not m:
            continue
        for t in ("sum", "avg"):
            ins = tuple(Partial(t) if j == i else R for j in range(len(call.inputs)))
            strategies.append(_partial(call, ins, t))
    return strategies
