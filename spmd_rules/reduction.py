"""Reductions ``sum``/``mean``: a sharded reduced dim becomes ``P(sum)``; others pass through.

``mean`` runs ``sum(local) / global count`` on each shard, which is exact for uneven shards
and adds up across ranks to the global mean.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import P_SUM, R, AxisStrategy, LocalContext, OpCall
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten


def reduced_dims(call: OpCall) -> tuple[tuple[int, ...], bool]:
    """(reduced tensor dims, keepdim) of a ``sum``/``mean`` call."""
    x = call.inputs[0]
    name = call.op._overloadname
    if name == "default":
        return tuple(range(x.ndim)), False
    dim: Any = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    keepdim = bool(call.args[2] if len(call.args) > 2 else call.kwargs.get("keepdim", False))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(x.ndim)), keepdim
    if isinstance(dim, int):
        dim = [dim]
    nd = max(x.ndim, 1)
    return tuple(sorted({d % nd for d in dim})), keepdim


@register_axis_rule([aten.sum, aten.mean])
def sum_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims, keepdim = reduced_dims(call)
    strategies = [AxisStrategy((R,), (R,))]
    for d in range(x.ndim):
        if x.shape[d] < 2 and not call.placements[0][axis] == Shard(d):
            continue
        out: Placement = P_SUM if d in dims else Shard(d if keepdim else d - sum(1 for r in dims if r < d))
        strategies.append(AxisStrategy((Shard(d),), (out,)))
    for t in ("sum", "avg"):
        strategies.append(AxisStrategy((Partial(t),), (Partial(t),)))
    return strategies


@register_local_impl(aten.mean)
def mean_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    call = ctx.call
    dims, keepdim = reduced_dims(call)
    count = math.prod(call.inputs[0].shape[d] for d in dims) if call.inputs[0].ndim else 1
    dtype = kwargs.get("dtype")
    return aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype) / count
