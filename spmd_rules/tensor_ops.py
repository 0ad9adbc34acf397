"""Tensor-creating and copying ops that autograd and optimizers issue on every step."""

from __future__ import annotations

import torch

from autoparallel.placement import Partial, Placement
from spmd_rules.base import AxisStrategy, OpCall, R, follow
from spmd_rules.registry import register_axis_rule

aten = torch.ops.aten

LIKE_OPS = [aten.ones_like, aten.zeros_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like]
NEW_OPS = [aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided]


@register_axis_rule(LIKE_OPS)
def like_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``*_like(x)`` keeps x's layout (no communication); a Partial x gives a Replicate result."""
    p = call.placements[0][axis]
    return [AxisStrategy((p,), (R if isinstance(p, Partial) else p,))]


@register_axis_rule(NEW_OPS)
def new_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x.new_*(size)`` builds a replicated tensor of the global ``size``; x is not moved.

    Not sharded as x even where it has x's shape (T5's ``labels.new_zeros(labels.shape)``,
    autograd's ``grad.new_empty_strided(base)``): its values depend on nothing, but the writes
    that follow may go through a slice of a sharded dim (``buf[0] = v``), which a shard does not
    take (the view would move: the write could not reach the buffer). Replicated, every write
    stays local; the cost is a move where it meets sharded values."""
    return [AxisStrategy((call.placements[0][axis],), (R,))]


@register_axis_rule([aten.copy_, aten.copy])
def copy_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``dst.copy_(src)``: dst keeps its layout; src is brought to it (through broadcasting). A
    0-d plain ``src`` (``x[0, 1] = 7.0``) is a value, as ``fill_``'s: dst sharded or replicated
    keeps its layout (a Partial one has no strategy: each summand would take the value)."""
    dst_p: Placement = call.placements[0][axis]
    if len(call.inputs) < 2:
        return [] if isinstance(dst_p, Partial) else [AxisStrategy((dst_p,), (dst_p,))]
    dst, src = call.inputs[0], call.inputs[1]
    return [AxisStrategy((dst_p, follow(dst_p, dst.shape, src.shape)), (dst_p,))]
