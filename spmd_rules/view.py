"""View and layout ops: the output follows the input's sharding wherever that is exact.

``view``/``reshape`` keep a sharded dim sharded when it maps onto one output dim with the same
leading element count and the pieces stay ``torch.chunk`` pieces: a 1:1 dim always; the
outermost dim of a merged group, or the first dim of a split, when the shard count divides it.
An inner dim of a merged group (the heads of ``[b, h, s, d] -> [b * h, s, d]``) becomes a
``StridedShard`` of the merged dim, its block count the product of the dims before it in the
group, when the shard count divides it and no dim after it in the group is sharded; a
``StridedShard`` dim maps back to a ``Shard`` where a split puts its blocks on whole output dims,
and stays strided through 1:1 dims and merges. Anything else is replicated along that axis
first — never a silently wrong view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Replicate, Shard, StridedShard
from autoparallel.spec import strided_layout_ok
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R, Strategy
from spmd_rules.registry import register_axis_rule, register_local_impl, register_rule

aten = torch.ops.aten


def map_view_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, shards: int) -> int | None:
    """Output dim that input dim ``d`` (split into ``shards`` pieces) maps to exactly, or None
    (dims merged inside its group are the caller's: strided, or replicated)."""
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
    sharded = {p.dim for p in cur if isinstance(p, (Shard, StridedShard))}
    targets: dict[int, Placement | None] = {}
    blocks_needed: dict[int, int] = {}  # axis -> the output's block count its Shard target assumes
    for d in sorted(sharded):
        plain = [a for a, p in enumerate(cur) if p == Shard(d)]
        strided = [a for a, p in enumerate(cur) if isinstance(p, StridedShard) and p.dim == d]
        kp = math.prod(call.mesh_shape[a] for a in plain)
        if strided:
            f = cur[strided[0]].split_factor  # type: ignore[union-attr]  # a StridedShard
            ks = math.prod(call.mesh_shape[a] for a in strided)
            t = _strided_target(x.shape, out.shape, d, f, ks, sharded)
            targets.update(dict.fromkeys(strided, t))
            o, need = _blocks_target(x.shape, out.shape, d, f, kp)
            for a in plain:
                targets[a] = None if o is None else Shard(o)
                if need:
                    blocks_needed[a] = need
            continue
        o = map_view_dim(x.shape, out.shape, d, kp)
        if o is None:
            o = _uneven_outer(x.shape, out.shape, d, kp)
            if o is not None:  # its pieces are whole rows only as the blocks of a strided dim
                blocks_needed.update(dict.fromkeys(plain, x.shape[d]))
            t = Shard(o) if o is not None else _strided_target(x.shape, out.shape, d, 1, kp, sharded)
        else:
            t = Shard(o)
        targets.update(dict.fromkeys(plain, t))
    outs = [targets.get(a, p) for a, p in enumerate(cur)]
    if not strided_layout_ok(tuple(q for q in outs if q is not None), out.shape):
        outs = [None if isinstance(q, StridedShard) else q for q in outs]
    for a, need in blocks_needed.items():
        q = outs[a]
        if isinstance(q, Shard) and StridedShard(q.dim, need) not in outs:
            outs[a] = None
    ins = tuple(R if q is None else p for p, q in zip(cur, outs))
    return [Strategy((ins,), (tuple(R if q is None else q for q in outs),))]


def _uneven_outer(in_shape: Sequence[int], out_shape: Sequence[int], d: int, shards: int) -> int | None:
    """The output dim that input dim ``d`` heads as the outer dim of a merge with the next one
    (``[b, h] -> [b * h]``), its split uneven: whole rows of the merged dim only if that dim is
    strided with ``in_shape[d]`` blocks (the caller checks)."""
    if d + 1 >= len(in_shape) or 0 in in_shape:
        return None
    lead = math.prod(in_shape[:d])
    for o in range(len(out_shape)):
        if math.prod(out_shape[:o]) == lead and in_shape[d] < out_shape[o] and out_shape[o] % in_shape[d] == 0:
            return o
    return None


def _blocks_target(in_shape: Sequence[int], out_shape: Sequence[int], d: int, blocks: int,
                   shards: int) -> tuple[int | None, int]:
    """(the output dim, the block count it must be strided with or 0) of the ``Shard`` axes of a
    strided input dim ``d`` (they split its ``blocks``): a dim the blocks stay blocks of (1:1, or
    ``d`` outermost in a merge), or the output dim the blocks become in a split."""
    if 0 in in_shape or 0 in out_shape:
        return None, 0
    lead = math.prod(in_shape[:d])
    for o in range(len(out_shape)):
        if math.prod(out_shape[:o]) != lead:
            continue
        if out_shape[o] >= in_shape[d] and out_shape[o] % in_shape[d] == 0:  # 1:1 or outermost of a merge
            return o, (0 if blocks % shards == 0 else blocks)
        if out_shape[o] == blocks:  # a split whose first dim is the blocks
            return o, 0
        if blocks % out_shape[o] == 0 and out_shape[o] % shards == 0:  # the blocks over several dims: even
            return o, 0
    return None, 0


def _strided_target(in_shape: Sequence[int], out_shape: Sequence[int], d: int, blocks: int, shards: int,
                    sharded: set[int]) -> Placement | None:
    """Where input dim ``d``, cut into ``blocks`` blocks each split into ``shards`` pieces (1:
    a plain ``Shard``), lands in the output: a ``StridedShard`` of the output dim its merge group
    becomes (no other dim of the group but the outermost sharded), a ``Shard`` of the output dim
    that starts its block in a split (``blocks`` whole output dims before it), or None."""
    if 0 in in_shape or 0 in out_shape:
        return None
    block = in_shape[d] // blocks
    lead = math.prod(in_shape[:d])
    for o in range(len(out_shape)):
        for g0 in range(d, -1, -1):  # merge (or 1:1): input dims g0..e-1 are output dim o
            if math.prod(in_shape[:g0]) != math.prod(out_shape[:o]):
                continue
            e = d + 1
            while e <= len(in_shape) and math.prod(in_shape[g0:e]) < out_shape[o]:
                e += 1
            if e > len(in_shape) or math.prod(in_shape[g0:e]) != out_shape[o]:
                continue
            if any(k in sharded for k in range(g0 + 1, e) if k != d):
                continue
            if block % shards and e > d + 1:  # uneven pieces of a block stay pieces only as its last dim
                return None
            # (a factor of open sizes, a capture's symbolic batch, is held at its present value:
            # a layout holds a number; the capture's guards then admit that value only)
            factor = int(math.prod(in_shape[g0:d]) * blocks)
            return StridedShard(o, factor) if factor > 1 else Shard(o)
        if math.prod(out_shape[:o]) == lead and blocks > 1:  # split: d is output dims o..
            j, before = o, 1
            while j < len(out_shape) and before < blocks:
                before *= out_shape[j]
                j += 1
            if before != blocks or j >= len(out_shape) or in_shape[d] % (blocks * out_shape[j]):
                continue
            if out_shape[j] % shards == 0 or blocks * out_shape[j] == in_shape[d]:  # (uneven: the block's last dim)
                return Shard(j)
    return None


def _follow_rule(dim_map: Callable[[OpCall, int], int | None],
                 strided: bool = True) -> Callable[[OpCall, int, int], list[AxisStrategy]]:
    """Per-axis rule for ops that move dims: ``dim_map(call, d)`` -> output dim or None. A
    ``StridedShard`` dim follows to an output dim of the same size where ``strided``."""

    def rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
        p = call.placements[0][axis]
        if isinstance(p, Shard):
            o = dim_map(call, p.dim)
            if o is None:
                return [AxisStrategy((R,), (R,))]
            return [AxisStrategy((p,), (Shard(o),))]
        if isinstance(p, StridedShard) and strided:
            o = dim_map(call, p.dim)
            out = call.out[0]
            if o is not None and out is not None and out.shape[o] == call.inputs[0].shape[p.dim]:
                return [AxisStrategy((p,), (StridedShard(o, p.split_factor),))]
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
    """Ops taking a global size run locally with this rank's local output size (``expand`` stays
    an expand: its local step broadcasts whatever the layout, strided or not)."""
    local = ctx.out_shapes[0]
    assert local is not None
    if ctx.call.op.overloadpacket is not aten.expand and _strided_view(ctx):
        return aten.reshape.default(x, list(local))
    return ctx.call.op(x, list(local), *args, **kwargs)


def _strided_view(ctx: LocalContext) -> bool:
    """Whether a view's local step is a reshape: a ``StridedShard`` in or out merges a shard's
    dims that a slice of a larger tensor (a shard whose strides are its wrapper's) cannot view
    as one, where the whole tensor could; the engine marks such views as not reaching their
    input (``engine.decide``: a write through one raises)."""
    return bool(ctx.in_specs) and bool(ctx.out_specs) and (
        ctx.in_specs[0].has_strided or (ctx.out_specs[0] is not None and ctx.out_specs[0].has_strided))


@register_local_impl(aten._reshape_alias)
def reshape_alias_local(ctx: LocalContext, x: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    local = ctx.out_shapes[0]
    assert local is not None
    if _strided_view(ctx):
        return aten.reshape.default(x, list(local))
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


register_axis_rule(aten.diagonal)(_follow_rule(_diagonal_map, strided=False))


@register_local_impl(aten.diagonal)
def diagonal_local(ctx: LocalContext, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """The local diagonal of a shard at offsets (r, c) of (dim1, dim2) is shifted by r - c."""
    assert ctx.coord is not None
    offset, d1, d2 = _diagonal_dims(ctx.call)
    box = ctx.in_specs[0].local_box(ctx.coord)
    return aten.diagonal.default(x, offset + box[d1][0] - box[d2][0], d1, d2)
