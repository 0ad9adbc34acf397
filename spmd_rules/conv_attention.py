"""Vision/attention ops: SDPA (CPU flash), convolution, pooling, batch norm, group norm.

Per mesh axis (the registry takes the product over axes); every strategy is exact for uneven
shards. Always offered: everything Replicate.

- ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward): q, k, v (and out, logsumexp,
  grad_out in the backward) sharded alike on the batch dim 0 or the heads dim 1; an
  ``attn_mask`` follows where it has that dim (not broadcast), else stays Replicate. Attention
  is linear in ``value``: a Partial value with q/k replicated gives a Partial output (logsumexp
  replicated). The backward is linear in ``grad_out``. Self-attention may also be sharded on
  the sequence dim 2 in equal pieces (every operand and output alike, a mask by its rows):
  context parallelism, whose local step is the engine's ring kernel
  (``autoparallel.engine.ring_attention``), not the op on the shards. With ``dropout_p > 0``
  (random) no strategy is offered (fallback).
- ``convolution`` (+ ``convolution_backward``): batch-sharded input with replicated weight ->
  output ``S(0)`` (grad_weight/grad_bias ``P(sum)``). For ``groups == 1`` and not transposed:
  weight/bias ``S(0)`` -> output ``S(1)`` (out-channel parallel; grad_input ``P(sum)``), and
  input ``S(1)`` with weight ``S(1)`` and bias Partial -> output ``P(sum)`` (in-channel
  parallel; the bias counted once). The op is linear in input (and in weight), with the bias
  Partial alike; the backward is linear in grad_output and each gradient in its operand.
- ``max_pool2d_with_indices``/``avg_pool2d``/``_adaptive_avg_pool2d`` (+ backward; 3d too):
  the leading (batch, channel) dims may be sharded, the pooled dims stay Replicate. Average
  pooling and every pooling backward are linear (Partial passes); max pooling is not (its
  indices would differ).
- ``native_batch_norm``/``_native_batch_norm_legit*`` (+ ``native_batch_norm_backward``): the
  channel dim 1 sharded with per-channel weight/bias/running stats ``S(0)``; or a batch or
  spatial dim sharded. In eval mode the op is per channel only (parameter gradients
  ``P(sum)``); in training mode it reduces over those dims, so its local step (the engine's
  ``batch_norm_local`` kernel, as data-parallel "SyncBatchNorm") all-reduces the per-channel
  statistics — one ``(2, C)`` all-reduce forward, one backward — and the statistics, running
  statistics and parameter gradients come out Replicate. The backward is linear in grad_out.
- ``native_group_norm`` (+ backward): batch dim 0 sharded (per sample) with a local
  implementation passing the local ``N``; channels stay Replicate (groups are not checked for
  shard alignment). The backward is linear in grad_out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import P_SUM, AxisStrategy, LocalContext, OpCall, R, Strategy, TensorMeta, broadcast_dim, divides
from spmd_rules.base import input_slots as _slots
from spmd_rules.base import named_strategy as _make
from spmd_rules.registry import product_of_axes, register_axis_rule, register_local_impl, register_out_shapes, register_rule

aten = torch.ops.aten

LINEAR = ("sum", "avg")  # Partial types a linear map passes


# ---- helpers --------------------------------------------------------------------------------
def _arg(call: OpCall, name: str, default: Any = None) -> Any:
    """Argument ``name`` of the call, by schema position or keyword."""
    names = [a.name for a in call.op._schema.arguments]
    i = names.index(name) if name in names else -1
    if 0 <= i < len(call.args):
        return call.args[i]
    return call.kwargs.get(name, default)


def _worth(call: OpCall, name: str, axis: int, dims: Sequence[int]) -> list[int]:
    """Of ``dims`` of input ``name``: those worth sharding (2+ elements, or sharded there now)."""
    i = _slots(call)[name]
    m, cur = call.inputs[i], call.placements[i][axis]
    return [d for d in dims if m.shape[d] >= 2 or cur == Shard(d)]


def _replicate(call: OpCall) -> AxisStrategy:
    return _make(call, {}, [R] * len(call.out))


# ---- scaled dot product attention (CPU flash kernel) ----------------------------------------
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _gqa_heads_split(q: TensorMeta, k: TensorMeta, v: TensorMeta, size: int) -> bool:
    """Grouped-query attention (q heads a multiple of k/v heads) may be split on the heads dim
    of one axis of ``size`` ranks when the key/value heads divide by it.

    Query head ``j`` reads key/value head ``j // g`` (``g = Hq / Hkv``). An even split of the
    heads over ``n`` ranks (one axis, or several nested) gives each rank query heads
    ``[r Hq/n, (r+1) Hq/n)`` and key/value heads ``[r Hkv/n, (r+1) Hkv/n)``: exactly the ones
    they read, and the local kernel does GQA alike. Whether the axes that split the heads
    together divide ``Hkv`` is a property of the whole strategy: :func:`_heads_divide`.
    """
    hq, hkv = q.shape[1], k.shape[1]
    return v.shape[1] == hkv and hkv > 0 and hq % hkv == 0 and hkv % size == 0


def _heads_divide(call: OpCall, strategy: Strategy) -> bool:
    """Grouped heads split on several axes: their product divides the key/value heads."""
    slots = _slots(call)
    hq, hkv = call.inputs[slots["query"]].shape[1], call.inputs[slots["key"]].shape[1]
    if hq == hkv:
        return True
    ranks = 1
    for size, p in zip(call.mesh_shape, strategy.inputs[slots["query"]]):
        if p == Shard(1):
            ranks *= size
    return hkv % ranks == 0


def _sequence_split(call: OpCall, q: TensorMeta, k: TensorMeta, v: TensorMeta, size: int,
                    slots: dict[str, int]) -> dict[str, Placement] | None:
    """The sequence-sharded strategy's inputs, or None where it does not apply: self-attention
    (one sequence length) in equal pieces on the axis, grouped heads dividing. Every operand is
    sharded on the sequence; a mask tensor follows the queries' rows (``Shard`` of its query
    dim, or Replicate where that dim is broadcast; its key dim is never split: the local step,
    the engine's ring kernel, reads the columns of each key piece it meets)."""
    length = q.shape[2]
    if not (length == k.shape[2] == v.shape[2] and divides(size, length) and k.shape[1] == v.shape[1]
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
        return None
    placed: dict[str, Placement] = {n: Shard(2) for n in slots if n != "attn_mask"}
    if "attn_mask" in slots:
        mask = call.inputs[slots["attn_mask"]]
        if mask.ndim < 2 or mask.ndim > 4 or mask.shape[-1] not in (1, length):
            return None
        md = broadcast_dim(4, mask.shape, q.shape[:3] + (length,), 2)
        placed["attn_mask"] = R if md is None else Shard(md)
    return placed


@register_rule([SDPA, SDPA_BACKWARD])
def sdpa_rule(call: OpCall) -> list[Strategy]:
    """The product of ``sdpa_axis_rule`` over the mesh axes, with the sequence sharded on one axis
    at most (the ring runs along one axis; nested sequence pieces are left to the other strategies)
    and grouped heads split only where the axes splitting them together divide them."""
    q = _slots(call)["query"]
    return [s for s in product_of_axes(call, sdpa_axis_rule)
            if sum(p == Shard(2) for p in s.inputs[q]) <= 1 and _heads_divide(call, s)]


def sdpa_axis_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """[B, H, S, D] tensors sharded alike on dim 0 or 1 (mask follows unless broadcast); linear in v / grad_out."""
    if _arg(call, "dropout_p", 0.0):
        return []  # random: left to the fallback
    slots = _slots(call)
    q, k, v = (call.inputs[slots[n]] for n in ("query", "key", "value"))
    scores = q.shape[:3] + k.shape[2:3]  # [B, H, L, S], the shape the mask broadcasts to
    strategies = [_replicate(call)]
    alike = [d for d in (0, 1) if q.shape[d] == k.shape[d] == v.shape[d] or (d == 1 and _gqa_heads_split(q, k, v, size))]
    for d in _worth(call, "query", axis, alike):
        placed: dict[str, Placement] = {n: Shard(d) for n in slots if n != "attn_mask"}
        if "attn_mask" in slots:
            mask = call.inputs[slots["attn_mask"]]
            md = broadcast_dim(4, mask.shape, scores, d)
            placed["attn_mask"] = R if md is None else Shard(md)
        strategies.append(_make(call, placed, [Shard(d)] * len(call.out)))
    seq = _sequence_split(call, q, k, v, size, slots)
    if seq is not None:
        for _ in _worth(call, "query", axis, (2,)):  # context parallelism: the engine's ring kernel
            strategies.append(_make(call, seq, [Shard(2)] * len(call.out)))
    for t in LINEAR:
        if call.op is SDPA:  # out = softmax(q k^T) v: linear in v; logsumexp depends on q, k only
            strategies.append(_make(call, {"value": Partial(t)}, [Partial(t), R]))
        else:  # every gradient is linear in grad_out (out, logsumexp fixed)
            strategies.append(_make(call, {"grad_out": Partial(t)}, [Partial(t)] * 3))
    return strategies


def sdpa_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """The op on batch/heads shards (the engine's kernel, ``autoparallel.engine.ring_attention``,
    calls it where the sequence is not sharded); an empty shard gives empty outputs (the CPU
    kernel divides by zero on one)."""
    q = args[1 if ctx.call.op is SDPA_BACKWARD else 0]
    if q.shape[0] and q.shape[1]:
        return ctx.call.op(*args, **kwargs)
    return tuple(None if s is None else q.new_zeros(s) for s in ctx.out_shapes)


# ---- convolution ----------------------------------------------------------------------------
def _channel_parallel_ok(call: OpCall) -> bool:
    return not _arg(call, "transposed") and _arg(call, "groups", 1) == 1


@register_axis_rule(aten.convolution.default)
def convolution_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Batch S(0); out-channel weight/bias S(0) -> S(1); in-channel input/weight S(1) + bias P -> P."""
    strategies = [_replicate(call)]
    for _ in _worth(call, "input", axis, (0,)):
        strategies.append(_make(call, {"input": Shard(0)}, [Shard(0)]))
    if _channel_parallel_ok(call):
        for _ in _worth(call, "weight", axis, (0,)):
            strategies.append(_make(call, {"weight": Shard(0), "bias": Shard(0)}, [Shard(1)]))
        for _ in _worth(call, "input", axis, (1,)):
            strategies.append(_make(call, {"input": Shard(1), "weight": Shard(1), "bias": P_SUM}, [P_SUM]))
    for t in LINEAR:  # linear in input and in weight; the bias is summed alike
        strategies.append(_make(call, {"input": Partial(t), "bias": Partial(t)}, [Partial(t)]))
        strategies.append(_make(call, {"weight": Partial(t), "bias": Partial(t)}, [Partial(t)]))
    return strategies


@register_axis_rule(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Mirrors ``convolution``: (grad_input, grad_weight, grad_bias) per forward strategy; linear in grad_output."""
    strategies = [_replicate(call)]
    for _ in _worth(call, "input", axis, (0,)):
        strategies.append(_make(call, {"grad_output": Shard(0), "input": Shard(0)}, [Shard(0), P_SUM, P_SUM]))
    if _channel_parallel_ok(call):
        for _ in _worth(call, "weight", axis, (0,)):
            strategies.append(_make(call, {"grad_output": Shard(1), "weight": Shard(0)}, [P_SUM, Shard(0), Shard(0)]))
        for _ in _worth(call, "input", axis, (1,)):
            strategies.append(_make(call, {"input": Shard(1), "weight": Shard(1)}, [Shard(1), Shard(1), R]))
    for t in LINEAR:
        p = Partial(t)
        strategies.append(_make(call, {"grad_output": p}, [p, p, p]))
        # grad_input depends on weight only, grad_weight on input only
        strategies.append(_make(call, {"input": p}, [R, p, R]))
        strategies.append(_make(call, {"weight": p}, [p, R, R]))
    return strategies


def _bias_view(bias: torch.Tensor, ndim: int) -> torch.Tensor:
    return bias.reshape((1, -1) + (1,) * (ndim - 2))


@register_local_impl(aten.convolution.default)
def convolution_local(ctx: LocalContext, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An empty shard (no samples, or no in/out channels: the kernel rejects or mis-sizes them) sums to bias only."""
    if input.numel() and weight.numel():
        return aten.convolution.default(input, weight, *args, **kwargs)
    shape = ctx.out_shapes[0]
    assert shape is not None
    out = input.new_zeros(shape)
    bias = args[0] if args else kwargs.get("bias")
    return out if bias is None else out + _bias_view(bias, out.ndim)


@register_local_impl(aten.convolution_backward.default)
def convolution_backward_local(
    ctx: LocalContext, grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor | None, ...]:
    """An empty shard: grad_input/grad_weight are empty sums (zeros); grad_bias still sums grad_output."""
    if input.numel() and weight.numel():
        return aten.convolution_backward.default(grad_output, input, weight, *args, **kwargs)
    gi, gw, gb = (None if s is None else input.new_zeros(s) for s in ctx.out_shapes)
    if gb is not None:
        gb = grad_output.sum([d for d in range(grad_output.ndim) if d != 1])
    return gi, gw, gb


# ---- pooling --------------------------------------------------------------------------------
# op -> (number of pooled trailing dims, linear in its first input)
POOL_OPS = {
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool2d_with_indices_backward.default: (2, True),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.max_pool3d_with_indices_backward.default: (3, True),
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool2d_backward.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten.avg_pool3d_backward.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool2d_backward.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool3d_backward.default: (3, True),
}


@register_axis_rule(list(POOL_OPS))
def pool_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Leading (batch/channel) dims sharded alike on every tensor; pooled dims Replicate; linear ones pass Partial."""
    spatial, linear = POOL_OPS[call.op]
    x = call.inputs[0]
    lead = x.ndim - spatial
    strategies = [_replicate(call)]
    for d in range(lead):
        if x.shape[d] >= 2 or call.placements[0][axis] == Shard(d):
            strategies.append(AxisStrategy(tuple(Shard(d) for _ in call.inputs), tuple(Shard(d) for _ in call.out)))
    if linear:  # Partial first input (grad_output in a backward), the rest Replicate
        for t in LINEAR:
            ins = (Partial(t),) + tuple(R for _ in call.inputs[1:])
            strategies.append(AxisStrategy(ins, tuple(Partial(t) for _ in call.out)))
    return strategies


@register_local_impl(list(POOL_OPS))
def pool_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """An empty batch/channel shard gives empty outputs (the kernels reject a 0-length channel dim)."""
    spatial, _ = POOL_OPS[ctx.call.op]
    x = args[0]
    if 0 not in x.shape[: x.ndim - spatial]:
        return ctx.call.op(*args, **kwargs)
    outs = tuple(
        None if s is None or m is None else x.new_zeros(s, dtype=m.dtype) for s, m in zip(ctx.out_shapes, ctx.call.out)
    )
    return outs if len(outs) > 1 else outs[0]


# ---- batch norm -----------------------------------------------------------------------------
BATCH_NORM_OPS = [
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
]


def _training(call: OpCall) -> bool:
    return bool(_arg(call, "training", _arg(call, "train", False)))


def _channel_placed(call: OpCall, x: TensorMeta, d: int, data: Sequence[str]) -> dict[str, Placement]:
    """``data`` tensors Shard(d); per-channel vectors (length C) Shard(0) if d is the channel dim, else R."""
    placed: dict[str, Placement] = {}
    for name, i in _slots(call).items():
        m = call.inputs[i]
        if name in data:
            placed[name] = Shard(d)
        elif d == 1 and m.ndim == 1 and m.shape[0] == x.shape[1]:
            placed[name] = Shard(0)
    return placed


@register_axis_rule(BATCH_NORM_OPS)
def batch_norm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Channel dim sharded (stats S(0)), or a batch/spatial dim (in training, the kernel
    all-reduces the statistics). Outputs: y, mean, invstd."""
    x = call.inputs[0]
    strategies = [_replicate(call)]
    for d in _worth(call, "input", axis, range(x.ndim)):
        outs = [Shard(d)] + [Shard(0) if d == 1 and o is not None and o.shape == (x.shape[1],) else R for o in call.out[1:]]
        strategies.append(_make(call, _channel_placed(call, x, d, ("input",)), outs))
    return strategies


@register_out_shapes(BATCH_NORM_OPS)
def batch_norm_out_shapes(call: OpCall) -> tuple[tuple[int, ...] | None, ...] | None:
    """Eval mode: the kernel returns empty saved statistics (its meta kernel says (C,))."""
    return None if _training(call) else (None, (0,), (0,))


@register_axis_rule(aten.native_batch_norm_backward.default)
def batch_norm_backward_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Channel dim sharded -> (S(1), S(0), S(0)); batch/spatial -> (S(d), P, P) in eval mode,
    (S(d), R, R) in training (the kernel all-reduces the sums); linear in grad_out."""
    x = call.inputs[_slots(call)["input"]]
    strategies = [_replicate(call)]
    sums: list[Placement] = [R, R] if _training(call) else [P_SUM, P_SUM]
    for d in _worth(call, "input", axis, range(x.ndim)):
        outs = [Shard(d)] + ([Shard(0), Shard(0)] if d == 1 else sums)
        strategies.append(_make(call, _channel_placed(call, x, d, ("grad_out", "input")), outs))
    for t in LINEAR:
        strategies.append(_make(call, {"grad_out": Partial(t)}, [Partial(t)] * 3))
    return strategies


def batch_norm_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """The op on a shard of the channels (or, in eval mode, of a batch/spatial dim): an empty
    shard (no channels here) gives empty outputs / zero sums (the kernel rejects empty input).
    The local step of these ops is the engine's ``batch_norm_local`` kernel, which calls this
    one where no statistic crosses ranks."""
    x = args[_slots(ctx.call)["input"]]
    if x.numel():
        return ctx.call.op(*args, **kwargs)
    return tuple(None if s is None or m is None else x.new_zeros(s, dtype=m.dtype) for s, m in zip(ctx.out_shapes, ctx.call.out))


# ---- group norm -----------------------------------------------------------------------------
GROUP_NORM = aten.native_group_norm.default
GROUP_NORM_BACKWARD = aten.native_group_norm_backward.default


@register_axis_rule([GROUP_NORM, GROUP_NORM_BACKWARD])
def group_norm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """Batch dim 0 sharded on every per-sample tensor (weight R); backward: param grads P(sum), linear in grad_out."""
    strategies = [_replicate(call)]
    per_sample = ("input", "grad_out", "mean", "rstd")
    for _ in _worth(call, "input", axis, (0,)):
        placed: dict[str, Placement] = {n: Shard(0) for n in _slots(call) if n in per_sample}
        outs: list[Placement] = [Shard(0)] * 3 if call.op is GROUP_NORM else [Shard(0), P_SUM, P_SUM]
        strategies.append(_make(call, placed, outs))
    if call.op is GROUP_NORM_BACKWARD:
        for t in LINEAR:
            strategies.append(_make(call, {"grad_out": Partial(t)}, [Partial(t)] * 3))
    return strategies


@register_local_impl([GROUP_NORM, GROUP_NORM_BACKWARD])
def group_norm_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """Run with this rank's batch size ``N`` (the call carries the global one)."""
    names = [a.name for a in ctx.call.op._schema.arguments]
    i = names.index("N")
    x = args[names.index("input")] if len(args) > names.index("input") else kwargs["input"]
    if len(args) > i:
        args = args[:i] + (x.shape[0],) + args[i + 1:]
    else:
        kwargs["N"] = x.shape[0]
    return ctx.call.op(*args, **kwargs)
