"""Tensor-creating and copying ops that autograd and optimizers issue on every step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R, follow
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten

LIKE_OPS = [aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like]
NEW_OPS = [aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided]


@register_axis_rule(LIKE_OPS)
def like_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``*_like(x)`` keeps x's layout (no communication); a Partial x gives a Replicate result."""
    p = call.placements[0][axis]
    return [AxisStrategy((p,), (R if isinstance(p, Partial) else p,))]


_SIZED_NEW_OPS = [aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided]


@register_axis_rule(NEW_OPS)
def new_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x.new_*(size)`` builds a tensor of the global ``size``; x is not moved. Of x's shape
    (``x.new_zeros(x.shape)``: a buffer filled from x next, as T5's shifted decoder inputs), it
    is sharded as x is (its values depend on nothing, so any layout holds them; x's keeps the
    writes that follow local: autograd's ``CopySlices`` fills ``grad.new_empty_strided(base)``
    with the gradient); else replicated."""
    p = call.placements[0][axis]
    out, x = call.out[0] if call.out else None, call.inputs[0]
    if isinstance(p, Shard) and out is not None and call.op.overloadpacket in _SIZED_NEW_OPS:
        if tuple(out.shape) == tuple(x.shape):
            return [AxisStrategy((p,), (p,))]
        if (p.dim == 0 and len(out.shape) == 1 and len(x.shape) > 1 and x.shape[0] % size == 0
                and out.shape[0] == math.prod(x.shape)):
            # x's storage flattened (autograd's as_strided backward: ``grad.new_zeros(numel)``,
            # viewed as x and filled with the gradient): whole rows of x per rank, in order
            return [AxisStrategy((p,), (p,))]
    return [AxisStrategy((p,), (R,))]


@register_local_impl(_SIZED_NEW_OPS)
def new_local(ctx: LocalContext, x: torch.Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``x.new_*`` at this rank's local size of the result (the global size where replicated;
    ``new_empty_strided``'s strides: dense on the local size, the engine nests them as asked)."""
    local = ctx.out_shapes[0]
    assert local is not None
    if ctx.call.op.overloadpacket is aten.new_empty_strided:
        kwargs = {k: v for k, v in kwargs.items() if k != "stride"}
        return aten.new_empty.default(x, list(local), **kwargs)  # type: ignore[no-any-return]
    return ctx.call.op(x, list(local), *args, **kwargs)  # type: ignore[no-any-return]


@register_axis_rule([aten.copy_, aten.copy])
def copy_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``dst.copy_(src)``: dst keeps its layout; src is brought to it (through broadcasting)."""
    dst_p: Placement = call.placements[0][axis]
    dst, src = call.inputs[0], call.inputs[1]
    return [AxisStrategy((dst_p, follow(dst_p, dst.shape, src.shape)), (dst_p,))]
