"""Shape ops (split, cat, slice, index, gather, scatter, pad, ...): untouched dims keep their shards.

Along one mesh axis every rule here offers:

- everything replicated;
- a dim the op does not touch sharded in every tensor that has it, the output following
  (dims renumbered for ops that remove or add a dim: ``select``, ``unbind``, ``stack``);
- for ops that move or copy elements without arithmetic (``split``, ``slice``, ``gather``,
  ``flip``, ``index``, ...) a ``Partial`` input of any reduce type, giving the same ``Partial``
  (picking elements commutes with an elementwise sum/avg/max/min); ops that also write a
  constant (``tril``, ``constant_pad_nd``, ``slice_backward``, ``scatter.value``) keep ``P(sum)``
  only when that constant is 0 (avg/max/min of equal constants is the constant);
- where an index tensor is data: sharding the index along a dim the output inherits
  (output follows), and for accumulating writes (``index_add``, ``scatter_add``,
  ``index_put(accumulate=True)``) sharding the index and the source along the indexed dim with
  a ``P(sum)`` destination — each rank adds its part, the sum over ranks adds all.

The dim an op works along (split/cat/slice/select/roll/flip dim, padded dims, indexed dims,
repeated dims) is replicated first: a ``torch.chunk`` piece of a sliced, padded or concatenated
dim is not the slice of a piece. The exception is ``tril``/``triu``, whose local
implementation shifts the diagonal by the shard's offsets, so it is exact on any sharding.
Ops taking global sizes (``slice_backward``/``select_backward``'s ``input_sizes``) run with the
local sizes.

``as_strided`` is deliberately left to the replicated fallback: it reads storage through the
GLOBAL strides of its input, which neither a rule (``OpCall``) nor a local implementation
(``LocalContext``) can see, and a replicated local tensor may have other strides (e.g. after an
all-gather along an inner dim).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R, ScalarMeta, TensorMeta, follow
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten

ALL_REDUCE = ("sum", "avg", "max", "min")
SUM_AVG = ("sum", "avg")


# ---- helpers ---------------------------------------------------------------------------------
def _arg(call: OpCall, i: int, name: str, default: Any = None) -> Any:
    return call.args[i] if len(call.args) > i else call.kwargs.get(name, default)


def _ints(v: Any) -> list[int]:
    """An ``int[]`` argument (a bare int is accepted for ``int[1]``) as a list."""
    return [int(v)] if isinstance(v, int) else [int(i) for i in (v or [])]


def _norm(dim: int, ndim: int) -> int:
    return int(dim) % max(ndim, 1)


def _out(call: OpCall, i: int = 0) -> TensorMeta:
    o = call.out[i]
    assert o is not None
    return o


def fill_types(value: Any) -> tuple[str, ...]:
    """Partial reduce types surviving an op that writes the constant ``value``."""
    try:
        zero = float(value) == 0.0
    except (TypeError, ValueError):  # complex or unknown: be safe
        zero = False
    return ALL_REDUCE if zero else ("avg", "max", "min")


def _shardable(call: OpCall, axis: int, size: int, *current: tuple[int, int]) -> bool:
    """Offer a shard of a dim of ``size`` when it has 2+ elements or an input (index, dim) is on it."""
    return size >= 2 or any(call.placements[i][axis] == Shard(d) for i, d in current)


def follow_strategies(
    call: OpCall, axis: int, dim_map: Sequence[int | None], partial: Sequence[str]
) -> list[AxisStrategy]:
    """Single-tensor-input op: input dim ``d`` -> output dim ``dim_map[d]`` (None: touched)."""
    x = call.inputs[0]
    n_out = len(call.out)
    strategies = [AxisStrategy((R,), (R,) * n_out)]
    for d, o in enumerate(dim_map):
        if o is not None and _shardable(call, axis, x.shape[d], (0, d)):
            strategies.append(AxisStrategy((Shard(d),), (Shard(o),) * n_out))
    for t in partial:
        strategies.append(AxisStrategy((Partial(t),), (Partial(t),) * n_out))
    return strategies


def _keep(ndim: int, touched: set[int]) -> list[int | None]:
    return [None if d in touched else d for d in range(ndim)]


def _remove(ndim: int, removed: int) -> list[int | None]:
    return [None if d == removed else d - (d > removed) for d in range(ndim)]


# ---- split / unbind / slice / select ---------------------------------------------------------
@register_axis_rule([aten.split, aten.split_with_sizes, aten.unsafe_split, aten.unsafe_split_with_sizes], size_args=(1,))
def split_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``split(x, sizes, dim)``: dim replicated, other dims and any Partial pass to every piece."""
    x = call.inputs[0]
    dim = _norm(_arg(call, 2, "dim", 0), x.ndim)
    return follow_strategies(call, axis, _keep(x.ndim, {dim}), ALL_REDUCE)


@register_axis_rule(aten.unbind)
def unbind_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``unbind(x, dim)``: dim replicated; other dims renumber in every output."""
    x = call.inputs[0]
    dim = _norm(_arg(call, 1, "dim", 0), x.ndim)
    return follow_strategies(call, axis, _remove(x.ndim, dim), ALL_REDUCE)


@register_axis_rule(aten.slice, size_args=(2, 3, 4))
def slice_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``slice(x, dim, start, end, step)``: dim replicated unless the slice is the whole dim."""
    x = call.inputs[0]
    dim = _norm(_arg(call, 1, "dim", 0), x.ndim)
    whole = _out(call).shape == x.shape  # same length with step 1 only when it is all of it
    return follow_strategies(call, axis, _keep(x.ndim, set() if whole else {dim}), ALL_REDUCE)


@register_axis_rule(aten.select)
def select_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``select(x, dim, index)``: dim replicated (the index is global); other dims renumber."""
    x = call.inputs[0]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    return follow_strategies(call, axis, _remove(x.ndim, dim), ALL_REDUCE)


@register_axis_rule(aten.slice_backward, size_args=(1, 3, 4, 5))
def slice_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``slice_backward(g, sizes, dim, ...)``: zeros with g in the slice; dim replicated."""
    g, out = call.inputs[0], _out(call)
    dim = _norm(_arg(call, 2, "dim"), out.ndim)
    whole = g.shape == out.shape
    return follow_strategies(call, axis, _keep(g.ndim, set() if whole else {dim}), ALL_REDUCE)


@register_axis_rule(aten.select_backward)
def select_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``select_backward(g, sizes, dim, index)``: g's dims map around the re-inserted dim."""
    g, out = call.inputs[0], _out(call)
    dim = _norm(_arg(call, 2, "dim"), out.ndim)
    return follow_strategies(call, axis, [d + (d >= dim) for d in range(g.ndim)], ALL_REDUCE)


@register_local_impl([aten.slice_backward, aten.select_backward])
def backward_sized_local(
    ctx: LocalContext, g: torch.Tensor, input_sizes: Sequence[int], *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``input_sizes`` is global: run with this rank's local output shape."""
    local = ctx.out_shapes[0]
    assert local is not None
    return ctx.call.op(g, list(local), *args, **kwargs)


@register_axis_rule([aten.slice_scatter, aten.select_scatter])
def slice_scatter_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``slice_scatter(x, src, dim, ...)``: x with a slice replaced; dim replicated, rest follows."""
    x, src = call.inputs[0], call.inputs[1]
    dim = _norm(_arg(call, 2, "dim", 0), x.ndim)
    whole = call.op.overloadpacket == aten.slice_scatter and src.shape == x.shape
    strategies = [AxisStrategy((R, R), (R,))]
    for d in range(x.ndim):
        if d == dim and not whole:
            continue
        s = d if src.ndim == x.ndim else d - (d > dim)
        if _shardable(call, axis, x.shape[d], (0, d), (1, s)):
            strategies.append(AxisStrategy((Shard(d), Shard(s)), (Shard(d),)))
    for t in ALL_REDUCE:  # every element comes from exactly one of x, src
        strategies.append(AxisStrategy((Partial(t), Partial(t)), (Partial(t),)))
    return strategies


@register_axis_rule(aten.diagonal_scatter)
def diagonal_scatter_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``diagonal_scatter(x, src, offset, dim1, dim2)``: x with a diagonal replaced; ``dim1`` and
    ``dim2`` replicated (and src's last dim, the diagonal), every other dim follows."""
    x = call.inputs[0]
    nd = x.ndim
    d1, d2 = int(_arg(call, 3, "dim1", 0)) % nd, int(_arg(call, 4, "dim2", 1)) % nd
    strategies = [AxisStrategy((R, R), (R,))]
    for d in range(nd):
        if d in (d1, d2):
            continue
        s = d - sum(1 for k in (d1, d2) if k < d)
        if _shardable(call, axis, x.shape[d], (0, d), (1, s)):
            strategies.append(AxisStrategy((Shard(d), Shard(s)), (Shard(d),)))
    for t in ALL_REDUCE:  # every element comes from exactly one of x, src
        strategies.append(AxisStrategy((Partial(t), Partial(t)), (Partial(t),)))
    return strategies


# ---- cat / stack -----------------------------------------------------------------------------
def _joined_strategies(call: OpCall, axis: int, in_to_out: Callable[[int], int | None]) -> list[AxisStrategy]:
    """Inputs joined along one dim: a dim ``d`` of every input maps to output dim ``in_to_out(d)``."""
    out = _out(call)
    n = len(call.inputs)
    strategies = [AxisStrategy((R,) * n, (R,))]
    # cat skips legacy empty 1-d inputs of shape (0,) whatever the output rank: keep them replicated
    real = [i for i, m in enumerate(call.inputs) if m.ndim == out.ndim or call.op.overloadpacket == aten.stack]
    ndim = call.inputs[real[0]].ndim if real else 0
    for d in range(ndim):
        o = in_to_out(d)
        if o is None or not _shardable(call, axis, out.shape[o], *[(i, d) for i in real]):
            continue
        ins = tuple(Shard(d) if i in real else R for i in range(n))
        strategies.append(AxisStrategy(ins, (Shard(o),)))
    for t in ALL_REDUCE:
        strategies.append(AxisStrategy((Partial(t),) * n, (Partial(t),)))
    return strategies


@register_axis_rule(aten.cat)
def cat_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``cat(xs, dim)``: every input sharded alike on a non-cat dim, or all the same Partial. Where
    one input alone has length along ``dim`` (a key/value cache's first ``cat`` onto an empty
    one), the cat dim too: the result is that input."""
    out = _out(call)
    dim = _norm(_arg(call, 1, "dim", 0), out.ndim)
    filled = [m for m in call.inputs if m.ndim == out.ndim and m.shape[dim] > 0]
    if len(filled) == 1:
        return _joined_strategies(call, axis, lambda d: d)
    return _joined_strategies(call, axis, lambda d: None if d == dim else d)


@register_axis_rule(aten.stack)
def stack_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``stack(xs, dim)``: every input sharded alike; the new dim shifts the dims after it."""
    out = _out(call)
    dim = _norm(_arg(call, 1, "dim", 0), out.ndim)
    return _joined_strategies(call, axis, lambda d: d + (d >= dim))


# ---- flip / roll / tril / pad / repeat -------------------------------------------------------
@register_axis_rule(aten.flip)
def flip_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``flip(x, dims)``: flipped dims replicated."""
    x = call.inputs[0]
    dims = {_norm(d, x.ndim) for d in _ints(_arg(call, 1, "dims"))}
    return follow_strategies(call, axis, _keep(x.ndim, dims), ALL_REDUCE)


@register_axis_rule(aten.roll)
def roll_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``roll(x, shifts, dims)``: rolled dims replicated (no dims: the flattened tensor rolls)."""
    x = call.inputs[0]
    dims = _ints(_arg(call, 2, "dims", []))
    touched = {_norm(d, x.ndim) for d in dims} if dims else set(range(x.ndim))
    return follow_strategies(call, axis, _keep(x.ndim, touched), ALL_REDUCE)


@register_axis_rule([aten.tril, aten.tril_, aten.triu, aten.triu_])
def tril_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``tril(x, k)``: any dim may stay sharded (the local diagonal is shifted); zeros keep P."""
    x = call.inputs[0]
    return follow_strategies(call, axis, list(range(x.ndim)), ALL_REDUCE)


@register_local_impl([aten.tril, aten.tril_, aten.triu, aten.triu_])
def tril_local(ctx: LocalContext, x: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
    """Element (i, j) is kept by ``j - i <= k``; with shard offsets (r, c) locally ``<= k + r - c``."""
    assert ctx.coord is not None
    box = ctx.in_specs[0].local_box(ctx.coord)
    (row, _), (col, _) = box[-2], box[-1]
    return ctx.call.op(x, int(diagonal) + row - col)


@register_axis_rule(aten.constant_pad_nd)
def pad_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``constant_pad_nd(x, pad, value)``: padded dims replicated; P(sum) only for value 0."""
    x = call.inputs[0]
    pad = _ints(_arg(call, 1, "pad"))
    touched = {x.ndim - 1 - i // 2 for i, w in enumerate(pad) if w != 0}
    return follow_strategies(call, axis, _keep(x.ndim, touched), fill_types(_arg(call, 2, "value", 0)))


@register_axis_rule(aten.repeat)
def repeat_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``repeat(x, reps)``: dims repeated once pass (shifted by new leading dims); others replicate."""
    x = call.inputs[0]
    reps = _ints(_arg(call, 1, "repeats"))
    lead = len(reps) - x.ndim
    return follow_strategies(call, axis, [d + lead if reps[d + lead] == 1 else None for d in range(x.ndim)], ALL_REDUCE)


# ---- index_select / index_add ----------------------------------------------------------------
@register_axis_rule(aten.index_select)
def index_select_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``index_select(x, dim, idx)``: dim replicated; other dims pass; a sharded idx shards dim."""
    x, idx = call.inputs[0], call.inputs[1]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    strategies = [AxisStrategy((R, R), (R,))]
    for d in range(x.ndim):
        if d != dim and _shardable(call, axis, x.shape[d], (0, d)):
            strategies.append(AxisStrategy((Shard(d), R), (Shard(d),)))
    if x.ndim and idx.ndim == 1 and _shardable(call, axis, idx.shape[0], (1, 0)):
        strategies.append(AxisStrategy((R, Shard(0)), (Shard(dim),)))
    for t in ALL_REDUCE:
        strategies.append(AxisStrategy((Partial(t), R), (Partial(t),)))
    return strategies


@register_axis_rule([aten.index_add, aten.index_add_])
def index_add_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``index_add(x, dim, idx, src)``: other dims pass; idx+src split along dim add into a P(sum) x."""
    x, idx, src = call.inputs[0], call.inputs[1], call.inputs[2]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    strategies = [AxisStrategy((R, R, R), (R,))]
    if x.ndim and src.ndim == x.ndim:  # 0-d x/src: nothing to shard
        for d in range(x.ndim):
            if d != dim and _shardable(call, axis, x.shape[d], (0, d), (2, d)):
                strategies.append(AxisStrategy((Shard(d), R, Shard(d)), (Shard(d),)))
        if idx.ndim == 1 and _shardable(call, axis, idx.shape[0], (1, 0)):
            strategies.append(AxisStrategy((Partial("sum"), Shard(0), Shard(dim)), (Partial("sum"),)))
    for t in SUM_AVG:
        strategies.append(AxisStrategy((Partial(t), R, Partial(t)), (Partial(t),)))
    return strategies


# ---- gather / scatter ------------------------------------------------------------------------
@register_axis_rule(aten.gather)
def gather_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``gather(x, dim, idx)``: x and idx sharded alike on a dim they share in full; idx alone on dim."""
    x, idx = call.inputs[0], call.inputs[1]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    strategies = [AxisStrategy((R, R), (R,))]
    if idx.ndim == x.ndim:
        for d in range(x.ndim):
            if not _shardable(call, axis, idx.shape[d], (0, d), (1, d)):
                continue
            if d == dim:  # out[.., j, ..] = x[.., idx[.., j, ..], ..]: rows of idx are independent
                strategies.append(AxisStrategy((R, Shard(d)), (Shard(d),)))
            elif x.shape[d] == idx.shape[d]:  # positional in d: pieces must line up
                strategies.append(AxisStrategy((Shard(d), Shard(d)), (Shard(d),)))
    for t in ALL_REDUCE:
        strategies.append(AxisStrategy((Partial(t), R), (Partial(t),)))
    return strategies


def _scatter_positional(call: OpCall, axis: int, dim: int) -> list[AxisStrategy]:
    """Every tensor input sharded alike on a non-scatter dim they all have in full."""
    x = call.inputs[0]
    out: list[AxisStrategy] = []
    if any(m.ndim != x.ndim for m in call.inputs):
        return out
    n = len(call.inputs)
    for d in range(x.ndim):
        if d == dim or any(m.shape[d] != x.shape[d] for m in call.inputs):
            continue
        if _shardable(call, axis, x.shape[d], *[(i, d) for i in range(n)]):
            out.append(AxisStrategy((Shard(d),) * n, (Shard(d),)))
    return out


@register_axis_rule([aten.scatter_add, aten.scatter_add_])
def scatter_add_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``scatter_add(x, dim, idx, src)``: positional dims pass; idx+src split along dim add into P(sum) x."""
    if len(call.inputs) < 3:  # a plain 0-dim idx or src is a scalar, not an input: 0-dim x, replicate
        return [AxisStrategy((R,) * len(call.inputs), (R,))]
    x, idx, src = call.inputs[0], call.inputs[1], call.inputs[2]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    strategies = [AxisStrategy((R, R, R), (R,))] + _scatter_positional(call, axis, dim)
    if x.ndim and idx.ndim == x.ndim == src.ndim and idx.shape[dim] == src.shape[dim]:
        if _shardable(call, axis, idx.shape[dim], (1, dim), (2, dim)):
            strategies.append(AxisStrategy((Partial("sum"), Shard(dim), Shard(dim)), (Partial("sum"),)))
    for t in SUM_AVG:
        strategies.append(AxisStrategy((Partial(t), R, Partial(t)), (Partial(t),)))
    return strategies


@register_axis_rule([aten.scatter, aten.scatter_, aten.scatter_reduce, aten.scatter_reduce_])
def scatter_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``scatter(x, dim, idx, src|value)``: positional dims pass; writing a constant keeps P."""
    x = call.inputs[0]
    dim = _norm(_arg(call, 1, "dim"), x.ndim)
    n = len(call.inputs)
    strategies = [AxisStrategy((R,) * n, (R,))] + _scatter_positional(call, axis, dim)
    value = _arg(call, 3, "value")
    if call.op._overloadname == "value" and n == 2 and not isinstance(value, (TensorMeta, ScalarMeta)):
        for t in fill_types(value):
            strategies.append(AxisStrategy((Partial(t), R), (Partial(t),)))
    return strategies


# ---- advanced indexing: index / index_put ----------------------------------------------------
def _index_layout(x: TensorMeta, indices: Sequence[Any]) -> tuple[int, dict[int, int], tuple[int, ...], list[int]] | None:
    """Where ``x[indices]`` puts things: (first output dim of the broadcast index dims,
    {non-indexed x dim: output dim}, broadcast index shape, output shape).

    None when the indices are not plain integer tensors (bool masks, ...).
    """
    metas = [(i, m) for i, m in enumerate(indices) if m is not None]
    if not metas or any(not isinstance(m, (TensorMeta, ScalarMeta)) for _, m in metas):
        return None
    if any(m.dtype not in (torch.int64, torch.int32) for _, m in metas):
        return None
    try:
        bcast = tuple(torch.broadcast_shapes(*[m.shape if isinstance(m, TensorMeta) else () for _, m in metas]))
    except RuntimeError:
        return None
    where = [i for i, _ in metas]
    rest = [d for d in range(x.ndim) if d not in where]
    if where == list(range(where[0], where[-1] + 1)):  # adjacent: index dims replace them in place
        start = where[0]
        mapping = {d: d if d < start else d - len(where) + len(bcast) for d in rest}
    else:  # separated: index dims go first
        start = 0
        mapping = {d: len(bcast) + k for k, d in enumerate(rest)}
    shape = [0] * (len(rest) + len(bcast))
    for d, o in mapping.items():
        shape[o] = x.shape[d]
    shape[start:start + len(bcast)] = bcast
    return start, mapping, bcast, shape


def _index_inputs(indices: Sequence[Any], bcast: tuple[int, ...], k: int | None) -> list[Placement]:
    """Placement of each index tensor input: R, or following ``Shard(k)`` of the broadcast shape."""
    out: list[Placement] = []
    for m in indices:
        if isinstance(m, TensorMeta):
            out.append(R if k is None else follow(Shard(k), bcast, m.shape))
    return out


@register_axis_rule(aten.index)
def index_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x[idx...]``: indexed dims replicated; other dims pass; sharded indices shard their out dims."""
    x, out = call.inputs[0], _out(call)
    indices = list(_arg(call, 1, "indices"))
    n = len(call.inputs)
    strategies = [AxisStrategy((R,) * n, (R,))]
    layout = _index_layout(x, indices)
    if layout is None or tuple(layout[3]) != out.shape or n != 1 + sum(isinstance(m, TensorMeta) for m in indices):
        return strategies
    start, mapping, bcast, _ = layout
    rep = tuple(_index_inputs(indices, bcast, None))
    for d, o in mapping.items():
        if _shardable(call, axis, x.shape[d], (0, d)):
            strategies.append(AxisStrategy((Shard(d),) + rep, (Shard(o),)))
    for k in range(len(bcast)):
        placed = tuple(_index_inputs(indices, bcast, k))
        if bcast[k] >= 2 and any(p != R for p in placed):
            strategies.append(AxisStrategy((R,) + placed, (Shard(start + k),)))
    for t in ALL_REDUCE:
        strategies.append(AxisStrategy((Partial(t),) + rep, (Partial(t),)))
    return strategies


@register_axis_rule([aten.index_put, aten.index_put_, aten._index_put_impl_])
def index_put_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x[idx...] = v`` (``+=`` with accumulate): non-indexed dims pass with v following.

    With ``accumulate`` the indices (and v) may be split along their broadcast dims into a
    ``P(sum)`` x, and ``P + P`` stays ``P`` (sum/avg).
    """
    x = call.inputs[0]
    indices = list(_arg(call, 1, "indices"))
    values = _arg(call, 2, "values")
    accumulate = bool(_arg(call, 3, "accumulate", False))
    n = len(call.inputs)
    strategies = [AxisStrategy((R,) * n, (R,))]
    layout = _index_layout(x, indices)
    v_is_input = isinstance(values, TensorMeta)
    if layout is None or n != 1 + sum(isinstance(m, TensorMeta) for m in indices) + v_is_input:
        return strategies
    start, mapping, bcast, sub = layout  # v broadcasts to sub, the shape of x[idx...]
    rep = tuple(_index_inputs(indices, bcast, None))

    def v(p: Placement) -> tuple[Placement, ...]:
        return (follow(p, sub, values.shape),) if v_is_input else ()

    for d, o in mapping.items():
        if _shardable(call, axis, x.shape[d], (0, d)):
            strategies.append(AxisStrategy((Shard(d),) + rep + v(Shard(o)), (Shard(d),)))
    if accumulate:
        for k in range(len(bcast)):
            placed = tuple(_index_inputs(indices, bcast, k))
            # each index position is added by exactly one rank (a v broadcast along k stays R)
            if bcast[k] >= 2 and any(p != R for p in placed):
                strategies.append(AxisStrategy((Partial("sum"),) + placed + v(Shard(start + k)), (Partial("sum"),)))
    if accumulate and v_is_input:
        for t in SUM_AVG:
            strategies.append(AxisStrategy((Partial(t),) + rep + (Partial(t),), (Partial(t),)))
    return strategies
