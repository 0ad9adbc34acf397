"""Neural-network ops: softmax, layer/RMS norm, embedding, NLL loss, dropout backward.

Per mesh axis (the registry takes the product over axes); every strategy is exact for uneven
shards:

- ``_softmax``/``_log_softmax``: any dim may be sharded. A sharded softmax dim ("loss
  parallel") runs a local implementation that all-gathers each piece's row max and row sum of
  exponentials (one collective per axis sharding it) and merges them. No Partial input (softmax is not linear). The
  backward ops all-reduce the one row sum they need and are linear in the incoming gradient,
  so a Partial gradient passes. ``_safe_softmax`` keeps its softmax dim whole.
- ``native_layer_norm``/``_fused_rms_norm``: leading (not normalized) dims may be sharded with
  weight/bias replicated; the per-row statistics follow. Backward: the input gradient follows,
  the weight/bias gradients are sums over the leading dims, so sharded rows give ``P(sum)``;
  a Partial output gradient passes (the backward is linear in it).
- ``embedding``: indices sharded (weight replicated) -> the output follows the indices; weight
  ``S(1)`` -> output sharded on its last dim; weight ``S(0)`` ("vocab parallel") -> each rank
  looks up only the rows it holds, zeros elsewhere -> ``P(sum)``; a Partial weight passes.
  ``embedding_dense_backward`` mirrors them: sharded indices -> ``P(sum)``; gradient sharded on
  its last dim -> ``S(1)``; replicated -> ``S(0)`` (each rank builds only its own rows).
- ``nll_loss_forward``/``nll_loss2d_forward`` and backward: batch dims sharded with the target
  (``sum``: ``P``; ``none``: sharded; ``mean``: ``P`` of ``local sum / global total weight``);
  the class dim sharded with the target replicated (each rank scores the targets in its class
  range -> ``P``); a Partial input passes (the loss is linear in it). Class weights stay
  replicated.
- ``native_dropout_backward``: pointwise, linear in the gradient.

Rules are strategies only. Where a strategy's local step needs a collective (loss-parallel
softmax: one all-gather of ``[2, rows, 1]`` statistics; NLL ``mean`` over batch shards: one scalar all-reduce)
the step is a kernel of the engine (``autoparallel.engine.kernels``), which receives its
collectives from the context the engine passes. The dispatcher's cost model does not see these
bytes; they are small against gathering the sharded logits, which is what the strategies avoid.

``native_dropout`` (random) is left to the random-op rules; eval-mode dropout issues no op.
``F.rms_norm`` on CPU decomposes into pointwise ops and ``mean`` (no rule needed here); the fused
``_fused_rms_norm`` and its backward (accelerator kernels; the backward has no CPU kernel) are
covered for the devices that emit them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from autoparallel import known_sums
from autoparallel.placement import Partial, Placement, Shard, StridedShard
from spmd_rules.base import P_SUM, AxisStrategy, LocalContext, OpCall, R, with_strided
from spmd_rules.base import input_slots as _slots
from spmd_rules.base import named_strategy as _make
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2  # ``reduction`` codes of the aten loss ops
LINEAR = ("sum", "avg")     # Partial types a linear map passes


# ---- helpers --------------------------------------------------------------------------------
def _arg(call: OpCall, i: int, name: str, default: Any = None) -> Any:
    return call.args[i] if len(call.args) > i else call.kwargs.get(name, default)


def _dims(call: OpCall, i: int, axis: int, dims: Sequence[int]) -> list[int]:
    """Of ``dims`` of input ``i``: those worth sharding (2+ elements, or sharded there now)."""
    m, cur = call.inputs[i], call.placements[i][axis]
    return [d for d in dims if m.shape[d] >= 2 or cur == Shard(d)]


def axes_sharding(spec: Any, dim: int) -> tuple[int, ...]:
    """Mesh axes (of more than one rank) that shard tensor ``dim`` of ``spec``, ``StridedShard``
    axes included (a softmax's row statistics merge over any partition of the row)."""
    return _axes_sharding(spec.placements, spec.mesh.shape, dim)


@lru_cache(maxsize=1024)
def _axes_sharding(placements: tuple[Any, ...], mesh_shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """(cached on what it reads, not on the spec: every local softmax and loss asks, and a
    spec's shape changes with every sequence length)"""
    return tuple(a for a, p in enumerate(placements)
                 if isinstance(p, (Shard, StridedShard)) and p.dim == dim and mesh_shape[a] > 1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---- softmax --------------------------------------------------------------------------------
SOFTMAX_OPS = [aten._softmax.default, aten._log_softmax.default]
SOFTMAX_BACKWARD_OPS = [aten._softmax_backward_data.default, aten._log_softmax_backward_data.default]


def _softmax_dim(call: OpCall, i: int) -> int:
    return int(_arg(call, i, "dim")) % max(call.inputs[0].ndim, 1)


def _softmax_dim_last(call: OpCall, i: int) -> list[int]:
    """Every dim, the softmax dim last: on a cost tie the dispatcher takes the earlier strategy,
    and sharding the softmax dim adds all-reduces its cost model does not see."""
    dim = _softmax_dim(call, i)
    return [d for d in range(call.inputs[0].ndim) if d != dim] + ([dim] if call.inputs[0].ndim else [])


@register_axis_rule(SOFTMAX_OPS)
@with_strided
def softmax_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Any dim may be sharded; a sharded softmax dim all-reduces the row statistics."""
    strategies = [AxisStrategy((R,), (R,))]
    strategies += [AxisStrategy((Shard(d),), (Shard(d),)) for d in _dims(call, 0, axis, _softmax_dim_last(call, 1))]
    return strategies


@register_axis_rule(aten._safe_softmax.default)
def safe_softmax_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Dims other than the softmax dim may be sharded (no local implementation)."""
    x, dim = call.inputs[0], _softmax_dim(call, 1)
    dims = [d for d in range(x.ndim) if d != dim]
    return [AxisStrategy((R,), (R,))] + [AxisStrategy((Shard(d),), (Shard(d),)) for d in _dims(call, 0, axis, dims)]


@register_axis_rule(SOFTMAX_BACKWARD_OPS)
@with_strided
def softmax_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Gradient and output sharded alike (any dim); a Partial gradient with the output replicated."""
    strategies = [AxisStrategy((R, R), (R,))]
    dims = _dims(call, 0, axis, _softmax_dim_last(call, 2))
    strategies += [AxisStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in dims]
    strategies += [AxisStrategy((Partial(t), R), (Partial(t),)) for t in LINEAR]
    return strategies


# ---- layer norm / RMS norm ------------------------------------------------------------------
# op -> position of ``normalized_shape``; whether the op is a backward (input 0 is grad_out).
# Rules here are registered for the functional (``.default``) overloads only: an ``out=``
# overload has extra tensor inputs, and falls back to replicated compute.
NORM_OPS = {
    aten.native_layer_norm: (1, False),
    aten._fused_rms_norm: (1, False),
    aten.native_layer_norm_backward: (2, True),
    aten._fused_rms_norm_backward: (2, True),
}


@register_axis_rule([op.default for op in NORM_OPS])
def norm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Leading dims sharded, weight/bias replicated; parameter gradients of sharded rows are P(sum).

    Row-shaped tensors (input, grad_out, mean, rstd) have the input's ndim; weight/bias and
    their gradients have the normalized ndim, smaller whenever there is a leading dim.
    """
    pos, backward = NORM_OPS[call.op.overloadpacket]
    x = call.inputs[0]
    lead = x.ndim - len(_arg(call, pos, "normalized_shape"))
    strategies = [AxisStrategy(tuple(R for _ in call.inputs), tuple(R for _ in call.out))]
    for d in _dims(call, 0, axis, range(lead)):
        ins: tuple[Placement, ...] = tuple(Shard(d) if m.ndim == x.ndim else R for m in call.inputs)
        outs = tuple(R if o is None else Shard(d) if o.ndim == x.ndim else P_SUM for o in call.out)
        strategies.append(AxisStrategy(ins, outs))
    if backward:  # every output is linear in grad_out
        for t in LINEAR:
            ins = (Partial(t),) + tuple(R for _ in call.inputs[1:])
            strategies.append(AxisStrategy(ins, tuple(R if o is None else Partial(t) for o in call.out)))
    return strategies


def check_in_range(outside: torch.Tensor, message: str) -> None:
    """Fail where any of ``outside`` (indices out of a whole table's range) is set, as torch does
    on one device, with no read of the value on the host: an ``aten._assert_async`` (an
    ``IndexError`` with ``message`` here on the CPU; a device-side assert on CUDA, as torch's
    own kernels; a node of a captured program, so a replay checks too)."""
    try:
        torch._assert_async(~outside.any(), message)
    except RuntimeError as e:
        raise IndexError(message) from e


# ---- embedding ------------------------------------------------------------------------------
@register_axis_rule(aten.embedding.default)
def embedding_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """weight (V, D) at indices: indices sharded -> follows; weight S(1) -> last dim; S(0) -> P(sum)."""
    slots = _slots(call)
    w = call.inputs[slots["weight"]]
    out = call.out[0]
    assert out is not None
    strategies = [_make(call, {}, [R])]
    if "indices" in slots:
        for d in _dims(call, slots["indices"], axis, range(out.ndim - 1)):
            strategies.append(_make(call, {"indices": Shard(d)}, [Shard(d)]))
    for d in _dims(call, slots["weight"], axis, range(w.ndim)):
        strategies.append(_make(call, {"weight": Shard(d)}, [Shard(out.ndim - 1) if d == 1 else P_SUM]))
    # indexing commutes with every elementwise reduction over ranks
    strategies += [_make(call, {"weight": Partial(t)}, [Partial(t)]) for t in ("sum", "avg", "max", "min")]
    return strategies


@register_local_impl(aten.embedding.default)
def embedding_local(ctx: LocalContext, weight: torch.Tensor, indices: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Row-sharded weight: look up the indices this rank holds (shifted), zeros for the others.

    An index outside the whole table (``< 0`` or ``>= num_embeddings``) stays out of range in
    the local lookup on every rank (``-1``), so it fails as it does on one device (an
    ``IndexError`` on the CPU, a device-side assert on CUDA) instead of reading as a row of
    zeros on every rank; the ranks of the weight's mesh hold the same indices on its sharded
    axis, so they fail alike."""
    assert ctx.coord is not None
    spec = ctx.in_specs[_slots(ctx.call)["weight"]]
    off, n = spec.local_box(ctx.coord)[0]
    if n == spec.shape[0]:
        return aten.embedding.default(weight, indices, *args, **kwargs)
    mine = (indices >= off) & (indices < off + n)
    valid = (indices >= 0) & (indices < spec.shape[0])
    if n == 0:  # no rows here to look anything up in: the check, then zeros
        check_in_range(~valid, f"embedding: index out of range in self (an index outside [0, {spec.shape[0]}))")
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    local = torch.where(mine, indices - off, torch.where(valid, 0, -1))  # others' rows: 0, backward only
    out = aten.embedding.default(weight, local)
    return torch.where(mine.unsqueeze(-1), out, 0)


@register_axis_rule(aten.embedding_dense_backward.default, size_args=(2,))  # num_weights: the output's rows
def embedding_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Indices sharded -> P(sum) (not with scale_grad_by_freq: counts are global); grad
    sharded on its last dim -> S(1); replicated -> S(0), each rank building its own rows."""
    slots = _slots(call)
    g = call.inputs[slots["grad_output"]]
    out = call.out[0]
    assert out is not None
    scale = bool(_arg(call, 4, "scale_grad_by_freq", False))
    strategies = [_make(call, {}, [R])]
    if "indices" in slots and not scale:
        for d in _dims(call, slots["grad_output"], axis, range(g.ndim - 1)):
            strategies.append(_make(call, {"grad_output": Shard(d), "indices": Shard(d)}, [P_SUM]))
    if out.shape[1] >= 2:
        strategies.append(_make(call, {"grad_output": Shard(g.ndim - 1)}, [Shard(1)]))
    if out.shape[0] >= 2:
        strategies.append(_make(call, {}, [Shard(0)]))
    strategies += [_make(call, {"grad_output": Partial(t)}, [Partial(t)]) for t in LINEAR]
    return strategies


@register_local_impl(aten.embedding_dense_backward.default)
def embedding_backward_local(
    ctx: LocalContext, grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """Row-sharded result: local rows only; other indices (and padding) go to a dropped extra row."""
    assert ctx.coord is not None
    spec = ctx.out_specs[0]
    off, n = spec.local_box(ctx.coord)[0]
    if n == num_weights:
        return aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    keep = (indices >= off) & (indices < off + n) & (indices != padding_idx)
    local = torch.where(keep, indices - off, n)  # row n: the padding row, zero and dropped
    return aten.embedding_dense_backward.default(grad, local, n + 1, n, scale_grad_by_freq)[:n]


# ---- NLL loss ------------------------------------------------------------------------------
NLL_FORWARD = [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default]
NLL_BACKWARD = [aten.nll_loss_backward.default, aten.nll_loss2d_backward.default]


def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _class_sharded(call: OpCall, s: AxisStrategy) -> bool:
    """Whether ``s`` shards the loss input's class dim (the targets index it: not independent)."""
    i = _slots(call)["self"]
    p = s.inputs[i]
    return isinstance(p, Shard) and p.dim == _class_dim(call.inputs[i].ndim)


@register_axis_rule(NLL_FORWARD)
@with_strided(skip=_class_sharded)
def nll_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Batch dims with the target (sum: P; none: sharded; mean: R, the global sum over the global
    total weight, both reduced in one all-reduce);
    the class dim with the target replicated (P); a Partial input (P). Outputs: (loss, total_weight)."""
    slots = _slots(call)
    x = call.inputs[slots["self"]]
    reduction = int(_arg(call, 3, "reduction", MEAN))
    cdim = _class_dim(x.ndim)
    strategies = [_make(call, {}, [R, R])]
    if "target" in slots:
        for d in _dims(call, slots["self"], axis, [d for d in range(x.ndim) if d != cdim]):
            td = d - (d > cdim)
            loss = Shard(td) if reduction == NONE else R if reduction == MEAN else P_SUM
            strategies.append(_make(call, {"self": Shard(d), "target": Shard(td)}, [loss, P_SUM if reduction == SUM else R]))
    for d in _dims(call, slots["self"], axis, [cdim]):
        strategies.append(_make(call, {"self": Shard(d)}, [P_SUM, R]))
    strategies += [_make(call, {"self": Partial(t)}, [Partial(t), R]) for t in LINEAR]
    return strategies


@register_axis_rule(NLL_BACKWARD)
@with_strided(skip=_class_sharded)
def nll_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Mirrors the forward; grad_input takes the input's layout (or P for a Partial gradient).

    ``total_weight`` must be the global one for ``mean``; ``sum``/``none`` never read it, so it
    stays where it is.
    """
    slots = _slots(call)
    x = call.inputs[slots["self"]]
    reduction = int(_arg(call, 4, "reduction", MEAN))
    cdim = _class_dim(x.ndim)
    tw = slots.get("total_weight")
    base: dict[str, Placement] = {"total_weight": R if reduction == MEAN or tw is None else call.placements[tw][axis]}
    strategies = [_make(call, base, [R])]
    if "target" in slots:
        for d in _dims(call, slots["self"], axis, [d for d in range(x.ndim) if d != cdim]):
            td = d - (d > cdim)
            g = Shard(td) if reduction == NONE else R
            strategies.append(_make(call, {**base, "self": Shard(d), "target": Shard(td), "grad_output": g}, [Shard(d)]))
    for d in _dims(call, slots["self"], axis, [cdim]):
        strategies.append(_make(call, {**base, "self": Shard(d)}, [Shard(d)]))
    if "grad_output" in slots:
        strategies += [_make(call, {**base, "grad_output": Partial(t)}, [Partial(t)]) for t in LINEAR]
    return strategies


def nll_pick(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, classes: int, off: int, n: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight of each target, 0 where ignored; whether its class is local; its local class).

    A target outside ``[0, classes)`` that is not ``ignore_index`` fails as on one device, never
    read as an ignored target: ``check_in_range`` (every rank holding these targets fails alike)."""
    valid = target != ignore_index
    outside = valid & ((target < 0) | (target >= classes))
    check_in_range(outside, f"Target out of bounds: a target outside [0, {classes}) that is not ignore_index "
                   f"({ignore_index})")
    if weight is None:
        w_t = valid.to(dtype)
    else:
        w_t = torch.where(valid, weight[target.clamp(0, classes - 1)], 0).to(dtype)
    mine = valid & (target >= off) & (target < off + n)
    return w_t, mine, torch.where(outside, n, (target - off).clamp(0, max(n - 1, 0)))


def nll_layout(ctx: LocalContext) -> tuple[Any, int, int, int, tuple[int, ...]]:
    """(input spec, class dim, local class offset, local class count, axes sharding the target).
    Not cached on the context: that would keep every sequence length's call (its ``OpCall``,
    specs, metadata) after the decision cache let it go; what it reads is cached below it
    (``DistSpec.local_box``)."""
    assert ctx.coord is not None
    slots = _slots(ctx.call)
    spec = ctx.in_specs[slots["self"]]
    cdim = _class_dim(spec.ndim)
    off, n = spec.dim_box(ctx.coord, cdim)
    tspec = ctx.in_specs[slots["target"]] if "target" in slots else None
    batch_axes = () if tspec is None else tuple(
        a for a, p in enumerate(tspec.placements) if isinstance(p, (Shard, StridedShard)) and tspec.mesh.shape[a] > 1
    )
    return spec, cdim, off, n, batch_axes


@register_local_impl(NLL_BACKWARD)
def nll_backward_local(
    ctx: LocalContext, grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
    reduction: int, ignore_index: int, total_weight: torch.Tensor,
) -> torch.Tensor:
    """Class-sharded: write -w[t] * grad only where the target class is local. Each row's sum
    over all classes is then known on every rank (the one term its target's class holds, 0 where
    ignored) and noted on the shard (``autoparallel.known_sums``): ``log_softmax``'s backward
    takes it instead of all-reducing its pieces' sums."""
    spec, cdim, off, n, _ = nll_layout(ctx)
    classes = spec.shape[cdim]
    if not axes_sharding(spec, cdim):
        return ctx.call.op(grad, x, target, weight, reduction, ignore_index, total_weight)
    out = torch.zeros_like(x)
    w_t, mine, idx = nll_pick(target, weight, ignore_index, classes, off, n, x.dtype)
    g = grad / total_weight if reduction == MEAN else grad
    term = -w_t * g
    if n:
        out.scatter_(cdim, idx.unsqueeze(cdim), torch.where(mine, term, 0).to(x.dtype).unsqueeze(cdim))
    return known_sums.note(out, cdim, torch.where(target != ignore_index, term, 0).to(x.dtype).unsqueeze(cdim))


# ---- dropout -------------------------------------------------------------------------------
@register_axis_rule(aten.native_dropout_backward.default)
def dropout_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """grad * mask * scale: pointwise (both sharded alike); a Partial gradient with the mask replicated."""
    g = call.inputs[0]
    n = len(call.inputs)
    strategies = [AxisStrategy(tuple(R for _ in range(n)), (R,))]
    strategies += [AxisStrategy(tuple(Shard(d) for _ in range(n)), (Shard(d),)) for d in _dims(call, 0, axis, range(g.ndim))]
    strategies += [AxisStrategy((Partial(t),) + tuple(R for _ in range(n - 1)), (Partial(t),)) for t in LINEAR]
    return strategies
