"""Reductions and scans: a sharded reduced dim stays Partial where the math allows, else is gathered.

Along one mesh axis every reduction offers ``R -> R`` and ``Shard(kept dim) -> Shard(its output
dim)``; what a shard of a *reduced* dim, or a Partial input, may become depends on the op:

=============================  ======================  ====================================
op                             Shard(reduced dim) ->   Partial input passes through
=============================  ======================  ====================================
sum, mean                      P(sum)                  P(sum) (not bool); P(avg) for floats
nansum, count_nonzero          P(sum)                  -
amax, max (full)               P(max)                  P(max)
amin, min (full)               P(min)                  P(min)
aminmax                        (P(min), P(max))        -
all / any                      P(min) / P(max)         P(min) / P(max) for bool/uint8 input
vector_norm, ord 1 or 0        P(sum)                  -
vector_norm, ord inf / -inf    P(max) / P(min)         -
histc with a given range       P(sum) (any dim)        -
prod, logsumexp, var, std,     needs Replicate         -
var_mean, std_mean, max/min
.dim, argmax, argmin, norm 2
=============================  ======================  ====================================

``mean`` runs ``sum(local) / global count`` on each shard (exact for uneven shards). ``amax``,
``max``, ``amin``, ``min``, ``aminmax`` and the inf-norms of an empty local piece (ranks past
the end of an uneven shard) give the reduction's identity (``-inf``/``+inf``, the dtype's
limits, ``0`` for ``|x|``) instead of an error, so the Partial result stays exact.

Only the overloads named here have rules: ``out=`` overloads take the replicated fallback.

Scans (``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``, ``cummin``) need the scan dim
replicated; other dims keep their shard, and ``cumsum`` (linear) passes ``P(sum|avg)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard, StridedShard
from spmd_rules.base import P_SUM, AxisStrategy, LocalContext, OpCall, R, with_strided
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten
P_MAX, P_MIN = Partial("max"), Partial("min")


# ---- reading the call ---------------------------------------------------------------------
def bound_args(call: OpCall) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, a in enumerate(call.op._schema.arguments):
        if not a.kwarg_only and i < len(call.args):
            out[a.name] = call.args[i]
        elif a.name in call.kwargs:
            out[a.name] = call.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def reduced_dims(call: OpCall, empty_is_all: bool = True) -> tuple[tuple[int, ...], bool]:
    """(reduced tensor dims, keepdim); no ``dim`` (or ``[]`` when ``empty_is_all``) is every dim."""
    x = call.inputs[0]
    args = bound_args(call)
    keepdim = bool(args.get("keepdim", False))
    dim = args.get("dim")
    if x.ndim == 0:
        return (), keepdim
    if dim is None or (isinstance(dim, (list, tuple)) and not dim and empty_is_all):
        return tuple(range(x.ndim)), keepdim
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({int(d) % x.ndim for d in dims})), keepdim


def _out_dim(d: int, dims: Sequence[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in dims if r < d)


def _shapes_match(call: OpCall, dims: Sequence[int], keepdim: bool) -> bool:
    """Whether every output has the shape reducing ``dims`` predicts (a guard on the parsing)."""
    shape = call.inputs[0].shape
    if keepdim:
        want = tuple(1 if d in dims else s for d, s in enumerate(shape))
    else:
        want = tuple(s for d, s in enumerate(shape) if d not in dims)
    return all(o is None or o.shape == want for o in call.out)


def linear_passes(call: OpCall) -> tuple[str, ...]:
    """Partial types a linear op passes: sum and avg for floats, sum for ints, none for bool
    (an integer avg is floor-divided; a bool "sum" of pieces is their or)."""
    dtype = call.inputs[0].dtype
    if dtype.is_floating_point or dtype.is_complex:
        return ("sum", "avg")
    return () if dtype == torch.bool else ("sum",)


# ---- the strategies -----------------------------------------------------------------------
def reduction_strategies(
    call: OpCall, axis: int, on_shard: Placement | None, passes: Sequence[str], empty_is_all: bool = True
) -> list[AxisStrategy]:
    """Along ``axis``: R -> R, Shard(kept) -> Shard(out dim), Shard(reduced) -> ``on_shard``
    (when not None), P(t) -> P(t) for ``t`` in ``passes``; every output gets the same placement."""
    if len(call.inputs) != 1:
        return []  # e.g. an out= overload: leave it to the fallback
    x = call.inputs[0]
    n_out = len(call.out)

    def strategy(p_in: Placement, p_out: Placement) -> AxisStrategy:
        return AxisStrategy((p_in,), (p_out,) * n_out)

    dims, keepdim = reduced_dims(call, empty_is_all)
    strategies = [strategy(R, R)]
    if not _shapes_match(call, dims, keepdim):
        return strategies
    current = call.placements[0][axis]
    for d in range(x.ndim):
        if x.shape[d] < 2 and current != Shard(d):
            continue
        if d not in dims:
            strategies.append(strategy(Shard(d), Shard(_out_dim(d, dims, keepdim))))
        elif on_shard is not None:
            strategies.append(strategy(Shard(d), on_shard))
    strategies += [strategy(Partial(t), Partial(t)) for t in passes]
    return strategies


@register_axis_rule([aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim])
@with_strided  # (a reduction of any subset of indices is a piece)
def sum_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """sum/mean: Shard(reduced) -> P(sum); P(sum|avg) pass as ``linear_passes`` allows."""
    return reduction_strategies(call, axis, P_SUM, linear_passes(call))


@register_axis_rule([aten.nansum.default, aten.count_nonzero.default, aten.count_nonzero.dim_IntList])
@with_strided  # (a reduction of any subset of indices is a piece)
def count_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """nansum/count_nonzero: Shard(reduced) -> P(sum); no Partial input (NaN/zero tests are per value)."""
    return reduction_strategies(call, axis, P_SUM, ())


@register_axis_rule([aten.amax.default, aten.max.default])
@with_strided  # (a reduction of any subset of indices is a piece)
def max_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """amax/max: Shard(reduced) -> P(max); a max of P(max) pieces is P(max)."""
    return reduction_strategies(call, axis, P_MAX, ("max",))


@register_axis_rule([aten.amin.default, aten.min.default])
@with_strided  # (a reduction of any subset of indices is a piece)
def min_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """amin/min: Shard(reduced) -> P(min); a min of P(min) pieces is P(min)."""
    return reduction_strategies(call, axis, P_MIN, ("min",))


@register_axis_rule(aten.aminmax.default)
def aminmax_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """aminmax -> (min, max): Shard(reduced) -> (P(min), P(max)); no Partial input (either
    output would be wrong)."""
    strategies = []
    for s in reduction_strategies(call, axis, P_MIN, ()):
        if s.outputs[0] == P_MIN:
            s = AxisStrategy(s.inputs, (P_MIN, P_MAX))
        strategies.append(s)
    return strategies


def _logical_input(call: OpCall) -> bool:
    """bool/uint8 values: min/max over pieces is and/or of their truth values."""
    return call.inputs[0].dtype in (torch.bool, torch.uint8)


@register_axis_rule([aten.all.default, aten.all.dim, aten.all.dims])
@with_strided  # (a reduction of any subset of indices is a piece)
def all_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """all: Shard(reduced) -> P(min) (and of the pieces); P(min) passes for bool/uint8 input."""
    return reduction_strategies(call, axis, P_MIN, ("min",) if _logical_input(call) else (), empty_is_all=False)


@register_axis_rule([aten.any.default, aten.any.dim, aten.any.dims])
@with_strided  # (a reduction of any subset of indices is a piece)
def any_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """any: Shard(reduced) -> P(max) (or of the pieces); P(max) passes for bool/uint8 input."""
    return reduction_strategies(call, axis, P_MAX, ("max",) if _logical_input(call) else (), empty_is_all=False)


@register_axis_rule([aten.histc.default])
def histc_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """histc(input, bins, min, max): with a range given (min < max) the histogram of the whole is
    the sum of the pieces' histograms, whichever dim is split (an empty piece counts nothing);
    without one the range is the data's min and max: replicated."""
    args = bound_args(call)
    strategies = [AxisStrategy((R,), (R,))]
    lo, hi = args.get("min", 0), args.get("max", 0)
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi:
        strategies += [AxisStrategy((Shard(d),), (P_SUM,)) for d in range(call.inputs[0].ndim)]
    return strategies


NORM_OPS = [aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
            aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dim_dtype]


def norm_order(call: OpCall) -> float:
    args = bound_args(call)
    p = args.get("ord", args.get("p"))
    return 2.0 if p is None else float(p)


@register_axis_rule(NORM_OPS)
def norm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Vector norms: ord 1/0 sum over pieces (P(sum)), ord inf/-inf take max/min (P(max|min));
    any other ord needs the reduced dims replicated. No Partial input (|x| is not linear)."""
    on_shard = {1.0: P_SUM, 0.0: P_SUM, math.inf: P_MAX, -math.inf: P_MIN}.get(norm_order(call))
    return reduction_strategies(call, axis, on_shard, ())


GATHERED_OPS = [
    aten.prod.default, aten.prod.dim_int, aten.logsumexp.default,
    aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
    aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default,
]


@register_axis_rule(GATHERED_OPS)
def gathered_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """prod, logsumexp, var/std(_mean), max/min.dim, argmax/argmin, kthvalue, (nan)median.dim,
    mode: reduced dims must be Replicate (no reduce type combines their pieces; indices need
    global offsets)."""
    return reduction_strategies(call, axis, None, ())


SCAN_OPS = [aten.cumsum.default, aten.cumsum_.default, aten.cumprod.default, aten.cumprod_.default,
            aten.logcumsumexp.default, aten.cummax.default, aten.cummin.default,
            # ordering along one dim (MoE routers' top-k, samplers' sort): the same shape of rule
            aten.sort.default, aten.sort.stable, aten.topk.default]


@register_axis_rule(SCAN_OPS)
def scan_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Scans (and sort/topk along ``dim``): that dim must be Replicate, other dims keep their
    shard; cumsum passes P(sum|avg)."""
    if len(call.inputs) != 1:
        return []
    x = call.inputs[0]
    n_out = len(call.out)
    scan = int(bound_args(call)["dim"]) % max(x.ndim, 1)
    current = call.placements[0][axis]
    strategies = [AxisStrategy((R,), (R,) * n_out)]
    for d in range(x.ndim):
        if d != scan and (x.shape[d] >= 2 or current == Shard(d)):
            strategies.append(AxisStrategy((Shard(d),), (Shard(d),) * n_out))
    if call.op.overloadpacket in (aten.cumsum, aten.cumsum_):
        for t in linear_passes(call):
            strategies.append(AxisStrategy((Partial(t),), (Partial(t),)))
    return strategies


# ---- local implementations ----------------------------------------------------------------
@register_local_impl([aten.mean.default, aten.mean.dim])
def mean_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``sum(local) / global count`` where a reduced dim is split across ranks: the shards'
    results add up to the global mean. Where none is (an RMSNorm's mean over the hidden dim of
    batch-sharded activations), every rank holds whole rows: the op itself, as one device runs
    it (the same aten call a local region's replay issues; decided from the layout, so every
    rank runs the same)."""
    call = ctx.call
    dims, keepdim = reduced_dims(call)
    spec = ctx.in_specs[0] if ctx.in_specs else None
    if spec is not None and not any(isinstance(p, (Shard, StridedShard)) and p.dim in dims and spec.mesh.shape[a] > 1
                                    for a, p in enumerate(spec.placements)):
        return call.op(x, *args, **kwargs)  # type: ignore[no-any-return]
    count = math.prod(call.inputs[0].shape[d] for d in dims)
    return aten.sum.dim_IntList(x, list(dims), keepdim, dtype=kwargs.get("dtype")) / count


def identity(dtype: torch.dtype, reduce_type: str) -> bool | int | float:
    """The value that never wins a ``max``/``min`` in ``dtype``."""
    if dtype == torch.bool:
        return reduce_type == "min"
    if dtype.is_floating_point:
        return -math.inf if reduce_type == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if reduce_type == "max" else info.max


def _empty_shard(ctx: LocalContext, x: torch.Tensor) -> bool:
    """This rank's piece is empty although the global input is not (an uneven shard's tail)."""
    return x.numel() == 0 and math.prod(ctx.call.inputs[0].shape) > 0


def _filled(ctx: LocalContext, x: torch.Tensor, value: bool | int | float) -> torch.Tensor:
    shape, meta = ctx.out_shapes[0], ctx.call.out[0]
    assert shape is not None and meta is not None
    return torch.full(shape, value, dtype=meta.dtype, device=x.device)


@register_local_impl([aten.amax.default, aten.max.default])
def max_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """amax/max; an empty shard gives the max identity so P(max) stays exact."""
    if _empty_shard(ctx, x):
        return _filled(ctx, x, identity(x.dtype, "max"))
    return ctx.call.op(x, *args, **kwargs)


@register_local_impl([aten.amin.default, aten.min.default])
def min_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """amin/min; an empty shard gives the min identity so P(min) stays exact."""
    if _empty_shard(ctx, x):
        return _filled(ctx, x, identity(x.dtype, "min"))
    return ctx.call.op(x, *args, **kwargs)


@register_local_impl(aten.aminmax.default)
def aminmax_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """aminmax; an empty shard gives (min identity, max identity)."""
    if _empty_shard(ctx, x):
        return _filled(ctx, x, identity(x.dtype, "min")), _filled(ctx, x, identity(x.dtype, "max"))
    lo, hi = ctx.call.op(x, *args, **kwargs)
    return lo, hi


@register_local_impl(NORM_OPS)
def norm_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Vector norm; the inf (-inf) norm of an empty shard is 0 (+inf), the identity of P(max|min)."""
    p = norm_order(ctx.call)
    if math.isinf(p) and _empty_shard(ctx, x):
        return _filled(ctx, x, 0.0 if p > 0 else math.inf)
    return ctx.call.op(x, *args, **kwargs)
