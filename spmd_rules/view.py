"""View and layout ops: the output follows the input's sharding wherever that is exact.

``view``/``reshape`` keep a sharded dim sharded when it maps onto one output dim with the same
leading element count and the pieces stay ``torch.chunk`` pieces: a 1:1 dim always; the
outermost dim of a merged group, or the first dim of a split, when the shard count divides it.
Anything else is replicated along that axis first — never a silently wrong view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Replicate, Shard
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R, Strategy
from spmd_rules.registry import register_axis_rule, register_local_impl, register_rule

aten = torch.ops.aten


def map_view_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, shards: int, inner_sharded: set[int]) -> int | None:
    """Output dim that input dim ``d`` (split into ``shards`` pieces) maps to exactly, or None."""
    lead = math.prod(in_shape[:d])
    for o in range(len(out_shape)):
        if math.prod(out_shape[:o]) != lead:
            continue
        a, b = in_shape[d], out_shape[o]
        if a == b and math.prod(in_shape[d + 1:]) == math.prod(out_shape[o + 1:]):
            return o
        if b > a and b % a == 0:  # merge: d is the outermost dim of the group
            rest, k = b // a, d + 1
            while rest > 1 and k < len(in_shape) and rest % in_shape[k] == 0:
                if k in inner_sharded:
                    return None
                rest //= in_shape[k]
                k += 1
            if rest == 1 and a % shards == 0:
                return o
        if a > b and a % b == 0 and b % shards == 0:  # split: o is the first dim of the group
            return o
    return None


@register_rule([aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias])
def view_rule(call: OpCall) -> list[Strategy]:
    x, out = call.inputs[0], call.out[0]
    assert out is not None
    cur = call.placements[0]
    sharded = {p.dim for p in cur if isinstance(p, Shard)}
    ins: list[Placement] = []
    outs: list[Placement] = []
    for _, p in enumerate(cur):
        if isinstance(p, Shard):
            axes = [b for b, q in enumerate(cur) if q == p]
            shards = math.prod(call.mesh_shape[b] for b in axes)
            o = map_view_dim(x.shape, out.shape, p.dim, shards, sharded - {p.dim})
            if o is None:
                ins.append(R)
                outs.append(R)
            else:
                ins.append(p)
                outs.append(Shard(o))
        else:
            ins.append(p)
            outs.append(p)
    return [Strategy((tuple(ins),), (tuple(outs),))]


def _follow_rule(dim_map: Callable[[OpCall, int], int | None]) -> Callable[[OpCall, int, int], list[AxisStrategy]]:
    """Per-axis rule for ops that move dims: ``dim_map(call, d)`` -> output dim or None."""

    def rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
        p = call.placements[0][axis]
        if isinstance(p, Shard):
            o = dim_map(call, p.dim)
            if o is None:
                return [AxisStrategy((R,), (R,))]
            return [AxisStrategy((p,), (Shard(o),))]
        if isinstance(p, Partial):
            return [AxisStrategy((p,), (p,))]
        return [AxisStrategy((Replicate(),), (Replicate(),))]

    return rule


def _arg(call: OpCall, i: int, name: str, default: Any = None) -> Any:
    return call.args[i] if len(call.args) > i else call.kwargs.get(name, default)


def _transpose_map(call: OpCall, d: int) -> int:
    nd = call.inputs[0].ndim
    if call.op.overloadpacket in (aten.t, aten.t_) or nd < 2:
        a, b = 0, min(1, nd - 1)
    else:
        a, b = int(_arg(call, 1, "dim0")) % nd, int(_arg(call, 2, "dim1")) % nd
    return b if d == a else a if d == b else d


def _permute_map(call: OpCall, d: int) -> int:
    dims = [int(x) % call.inputs[0].ndim for x in _arg(call, 1, "dims")]
    return dims.index(d)


def _unsqueeze_map(call: OpCall, d: int) -> int:
    at = int(_arg(call, 1, "dim")) % (call.inputs[0].ndim + 1)
    return d + 1 if d >= at else d


def _squeeze_map(call: OpCall, d: int) -> int | None:
    out = call.out[0]
    assert out is not None
    removed = _squeezed(call)
    if d in removed:
        return None
    return d - sum(1 for r in removed if r < d)


def _squeezed(call: OpCall) -> set[int]:
    x = call.inputs[0]
    dim = _arg(call, 1, "dim")
    if dim is None:
        return {i for i, s in enumerate(x.shape) if s == 1}
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {int(i) % max(x.ndim, 1) for i in dims if x.ndim and x.shape[int(i) % x.ndim] == 1}


def _expand_map(call: OpCall, d: int) -> int | None:
    x, out = call.inputs[0], call.out[0]
    assert out is not None
    o = d + out.ndim - x.ndim
    return o if out.shape[o] == x.shape[d] else None


register_axis_rule([aten.t, aten.transpose])(_follow_rule(_transpose_map))
register_axis_rule(aten.permute)(_follow_rule(_permute_map))
register_axis_rule(aten.unsqueeze)(_follow_rule(_unsqueeze_map))
register_axis_rule(aten.squeeze)(_follow_rule(_squeeze_map))
register_axis_rule(aten.expand)(_follow_rule(_expand_map))


@register_local_impl([aten.view, aten._unsafe_view, aten.reshape, aten.expand])
def sized_local(ctx: LocalContext, x: torch.Tensor, size: Sequence[int], *args: object, **kwargs: object) -> torch.Tensor:
    """Ops taking a global size run locally with this rank's local output size."""
    local = ctx.out_shapes[0]
    assert local is not None
    return ctx.call.op(x, list(local), *args, **kwargs)


@register_local_impl(aten._reshape_alias)
def reshape_alias_local(ctx: LocalContext, x: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    local = ctx.out_shapes[0]
    assert local is not None
    return aten.view.default(x, list(local))


@register_local_impl(aten.squeeze)
def squeeze_local(ctx: LocalContext, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Squeeze exactly the dims that are size 1 globally: a shard may be size 1 (or 0) locally
    in a dim that is not, and a plain local ``squeeze()`` would drop it."""
    dims = sorted(_squeezed(ctx.call))
    return aten.squeeze.dims(x, dims) if dims else aten.alias.default(x)


# ---- complex views, lazy conj/neg bits, diagonal ---------------------------------------------
def _linear_view_rule(dim_map: Callable[[OpCall, int], int | None]) -> Callable[[OpCall, int, int], list[AxisStrategy]]:
    """``_follow_rule`` for views that reinterpret numbers (complex <-> pairs of reals): a
    Partial passes only for sum/avg (a max of complex numbers is not defined)."""
    follow_dims = _follow_rule(dim_map)

    def rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
        p = call.placements[0][axis]
        if isinstance(p, Partial) and p.reduce_type not in ("sum", "avg"):
            return [AxisStrategy((R,), (R,))]
        return follow_dims(call, axis, size)

    return rule


def _view_as_complex_map(call: OpCall, d: int) -> int | None:
    """The last dim (the pairs) becomes the complex numbers: it cannot stay sharded."""
    return None if d == call.inputs[0].ndim - 1 else d


# view_as_real appends the (real, imag) dim: every input dim keeps its number.
register_axis_rule(aten.view_as_real)(_linear_view_rule(lambda call, d: d))
register_axis_rule(aten.view_as_complex)(_linear_view_rule(_view_as_complex_map))
register_axis_rule([aten._conj, aten._neg_view])(_linear_view_rule(lambda call, d: d))


@register_local_impl([aten._conj, aten._neg_view])
def lazy_bit_local(ctx: LocalContext, x: torch.Tensor) -> torch.Tensor:
    """The wrapper cannot carry a lazy conj/neg bit (kernels read the local shard's bits, ops
    on the wrapper see none): compute the values instead. The dispatcher marks the result as
    not aliasing its input, so a write through it raises instead of being lost."""
    return torch.conj_physical(x) if ctx.call.op.overloadpacket is aten._conj else torch.neg(x)


def _diagonal_dims(call: OpCall) -> tuple[int, int, int]:
    nd = call.inputs[0].ndim
    return int(_arg(call, 1, "offset", 0)), int(_arg(call, 2, "dim1", 0)) % nd, int(_arg(call, 3, "dim2", 1)) % nd


def _diagonal_map(call: OpCall, d: int) -> int | None:
    """Other dims keep their order, the diagonal comes last. ``dim1`` (rows) may stay sharded
    for ``offset >= 0`` when row piece i holds exactly diagonal piece i (the diagonal, of length
    ``L = min(n, m - offset)``, is cut like the rows); ``dim2`` likewise for ``offset <= 0``."""
    x, out = call.inputs[0], call.out[0]
    assert out is not None
    offset, d1, d2 = _diagonal_dims(call)
    n, m = x.shape[d1], x.shape[d2]
    length = out.shape[-1]
    if d == d1:
        return out.ndim - 1 if offset >= 0 and _cut_alike(call, d, n, length) else None
    if d == d2:
        return out.ndim - 1 if offset <= 0 and _cut_alike(call, d, m, length) else None
    return d - sum(1 for k in (d1, d2) if k < d)


def _cut_alike(call: OpCall, d: int, size: int, length: int) -> bool:
    """Whether ``torch.chunk`` pieces of ``size`` and of ``length <= size`` start alike: always
    when equal; else when one mesh axis shards dim ``d`` and both pieces have the same step."""
    if length <= 0:
        return False
    if length == size:
        return True
    axes = [a for a, p in enumerate(call.placements[0]) if p == Shard(d)]
    k = call.mesh_shape[axes[0]] if len(axes) == 1 else 0
    return k > 0 and -(-size // k) == -(-length // k)


register_axis_rule(aten.diagonal)(_follow_rule(_diagonal_map))


@register_local_impl(aten.diagonal)
def diagonal_local(ctx: LocalContext, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """The local diagonal of a shard at offsets (r, c) of (dim1, dim2) is shifted by r - c."""
    assert ctx.coord is not None
    offset, d1, d2 = _diagonal_dims(ctx.call)
    box = ctx.in_specs[0].local_box(ctx.coord)
    return aten.diagonal.default(x, offset + box[d1][0] - box[d2][0], d1, d2)
