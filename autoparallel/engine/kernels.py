"""Kernels: local steps that need a collective, handed theirs by the engine.

A rule (``spmd_rules``) only says which layouts an op may take. For a few strategies the local
step is not the op on the shards: a softmax over a sharded dim ("loss parallel") needs the
global row max and row sum, and a mean NLL loss over batch shards the global (sum, count).
These steps live here, not in the rules package, and issue their collectives through the
``Collectives`` the engine puts in their ``LocalContext`` (``ctx.comm``), on the mesh of the op
they run. Every output is computed before the kernel returns (a statistic's all-reduce is waited
for at once; a captured program moves that wait to the value's first use).

``kernel_for(op)`` is the engine's lookup: a local implementation a user registered
(``ap.register_local_impl``) first, then these kernels, then the rules' own local
implementations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import known_sums
from autoparallel.engine.ring_attention import KERNELS as ATTENTION_KERNELS
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Shard
from autoparallel.runtime import agree, comm
from spmd_rules.base import LocalContext, bound_args
from spmd_rules.conv_attention import BATCH_NORM_OPS
from spmd_rules.conv_attention import batch_norm_local as rules_batch_norm_local
from spmd_rules.nn import (
    MEAN,
    NLL_FORWARD,
    NONE,
    SOFTMAX_BACKWARD_OPS,
    SOFTMAX_OPS,
    SUM,
    axes_sharding,
    compute_dtype,
    nll_layout,
    nll_pick,
)
from spmd_rules.registry import get_local_impl

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Collectives:
    """The collectives a kernel may issue: over axes of the mesh of the op it runs (every
    member of the mesh runs the same kernel, so every member issues the same collectives)."""

    mesh: ProcessMesh

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], reduce_type: str) -> torch.Tensor:
        """``t`` reduced over each of ``axes`` in turn (blocking)."""
        for a in axes:
            agree.check_collective(self.mesh, a, lambda: _describe("all_reduce", reduce_type, t))
            t = comm.all_reduce(t, self.mesh, a, reduce_type)
        return t

    def all_gather(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """Every member's ``t`` (the same shape on each), stacked along a new leading dim in
        coordinate order (blocking)."""
        n = self.mesh.shape[axis]
        agree.check_collective(self.mesh, axis, lambda: _describe("all_gather", "stack", t))
        return comm.all_gather(t.unsqueeze(0), self.mesh, axis, 0, [1] * n)

    def exchange(self, axis: int, sends: Sequence[Sequence[torch.Tensor]],
                 recv_shapes: Sequence[Sequence[Sequence[int]]]) -> list[list[torch.Tensor]]:
        """Point-to-point along ``axis`` (``comm.exchange``: one all-to-all; ``sends[c]`` go to
        coordinate ``c``, ``recv_shapes[c]`` come from it)."""
        agree.check_collective(self.mesh, axis, lambda: _describe_exchange(sends, recv_shapes))
        return comm.exchange(sends, recv_shapes, self.mesh, axis)


def _describe_exchange(sends: Sequence[Sequence[torch.Tensor]], recv_shapes: Sequence[Sequence[Sequence[int]]]) -> str:
    """An exchange as every member issues it: the number of members and the dtype (the pairs
    themselves differ by member)."""
    dtype = next((t.dtype for ts in sends for t in ts), None)
    return f"exchange of a kernel over {len(sends)} members {dtype}"


def _describe(kind: str, reduce_type: str, t: torch.Tensor) -> str:
    """A kernel's statistic reduction as every member must issue it (``AUTOPARALLEL_CHECK=1``)."""
    return f"{kind}({reduce_type}) of a kernel statistic {list(t.shape)} {t.dtype}"


# ---- softmax over a sharded dim ----------------------------------------------------------
def softmax_local(ctx: LocalContext, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Over a sharded dim: the global row max and row sum of exponentials from one all-gather per
    sharding axis of each piece's (max, sum of exponentials below it), merged as online softmax
    merges blocks: ``M = max m_r``, ``S = sum s_r exp(m_r - M)``."""
    d = dim % max(x.ndim, 1)
    spec = ctx.in_specs[0]
    axes = axes_sharding(spec, d)
    if not axes:
        return ctx.call.op(x, dim, half_to_float)
    out_meta = ctx.call.out[0]
    assert out_meta is not None
    xf = x.to(compute_dtype(out_meta.dtype))
    if xf.shape[d]:
        m = xf.amax(d, keepdim=True)
    else:  # an empty piece of an uneven shard
        m = xf.new_full(xf.shape[:d] + (1,) + xf.shape[d + 1:], float("-inf"))
    s = _exp_below(xf, m).sum(d, keepdim=True)
    for a in axes:  # (max, sum) of every member along the axis, merged
        stats = ctx.comm.all_gather(torch.stack([m, s]), a)  # [members, 2, ...]
        ms, ss = stats[:, 0], stats[:, 1]
        m = ms.amax(0)
        s = (ss * _exp_below(ms, m)).sum(0)
    shifted = xf - m
    if ctx.call.op.overloadpacket is aten._log_softmax:
        return (shifted - s.log()).to(out_meta.dtype)
    return (shifted.exp() / s).to(out_meta.dtype)


def _exp_below(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(x - m)``, 0 where the maximum ``m`` is -inf (a row of -inf or an empty piece)."""
    return torch.where(m == float("-inf"), 0.0, (x - m).exp())


def softmax_backward_local(
    ctx: LocalContext, grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """Over a sharded dim: the row sum the gradient needs comes from an all-reduce — or, for
    ``log_softmax``, from the gradient's shard where the step that wrote it knew the sums
    (``autoparallel.known_sums``: the NLL loss's backward)."""
    d = dim % max(out.ndim, 1)
    spec = ctx.in_specs[1]
    axes = axes_sharding(spec, d)
    if not axes:
        return ctx.call.op(grad, out, dim, input_dtype)
    out_meta = ctx.call.out[0]
    assert out_meta is not None
    ct = compute_dtype(out_meta.dtype)
    g, y = grad.to(ct), out.to(ct)
    if ctx.call.op.overloadpacket is aten._log_softmax_backward_data:
        sums = known_sums.known(grad, d)
        total = sums.to(ct) if sums is not None else ctx.comm.all_reduce(g.sum(d, keepdim=True), axes, "sum")
        res = g - y.exp() * total
    else:
        res = y * (g - ctx.comm.all_reduce((g * y).sum(d, keepdim=True), axes, "sum"))
    return res.to(out_meta.dtype)


# ---- NLL loss: class-sharded, and the mean over batch shards ---------------------------------
def nll_forward_local(
    ctx: LocalContext, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
    reduction: int = MEAN, ignore_index: int = -100,
) -> tuple[Any, Any]:
    """Class-sharded: score only local classes. ``mean`` over batch shards: the sum and the total
    weight are all-reduced together (one collective) and divided: the loss is Replicate there.
    In a captured step (``comm.reduce_apart``) they are reduced apart, the total weight computed
    from the targets alone: its reduction can start before the forward runs and the sum's wait
    where the loss is read, so the step does not stop between its forward and its backward
    (``static.passes``)."""
    spec, cdim, off, n, batch_axes = nll_layout(ctx)
    classes = spec.shape[cdim]
    op = ctx.call.op
    if n == classes:
        if reduction != MEAN or not batch_axes:
            return op(x, target, weight, reduction, ignore_index)
        s, tw = op(x, target, weight, SUM, ignore_index)
        if weight is None and comm.reduce_apart():  # (a count: exact whichever way it is summed)
            return _mean_apart(ctx, s, (target != ignore_index).sum().to(tw.dtype), batch_axes)
    else:
        w_t, mine, idx = nll_pick(target, weight, ignore_index, classes, off, n, x.dtype)
        loss = torch.zeros_like(w_t)
        if n:
            picked = x.gather(cdim, idx.unsqueeze(cdim)).squeeze(cdim)
            loss = torch.where(mine, -w_t * picked, 0)
        if reduction == NONE:
            return loss, x.new_zeros(())
        s, tw = loss.sum(), w_t.sum()
        if reduction == SUM:
            return s, tw
        if comm.reduce_apart():
            return _mean_apart(ctx, s, tw, batch_axes)
    both = ctx.comm.all_reduce(torch.stack([s, tw.to(s.dtype)]), batch_axes, "sum")  # (sum, total weight)
    return both[0] / both[1], both[1].to(tw.dtype)


def _mean_apart(ctx: LocalContext, s: torch.Tensor, tw: torch.Tensor, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """The mean loss from the local sum and total weight reduced by two collectives, the total
    weight's first (its value only needs the targets)."""
    total = ctx.comm.all_reduce(tw.to(s.dtype), axes, "sum")
    return ctx.comm.all_reduce(s, axes, "sum") / total, total.to(tw.dtype)


# ---- batch norm in training over a sharded batch/spatial dim ("SyncBatchNorm") ---------------
def _stat_axes(spec: Any) -> tuple[int, ...]:
    """The mesh axes that shard a batch or spatial dim (any dim but the channels, 1) of ``spec``."""
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim != 1)


def _per_channel(spec: Any, x: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """(how many values each channel's statistics reduce over: the global numel over the
    channels, the dims of ``x`` they reduce, the shape a per-channel vector broadcasts as)."""
    n = math.prod(size for d, size in enumerate(spec.shape) if d != 1)
    return n, [d for d in range(x.ndim) if d != 1], [1, -1] + [1] * (x.ndim - 2)


def batch_norm_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """Training batch norm on batch (or spatial) shards: each channel's mean and variance over
    the whole batch come from one all-reduce of ``(2, C)`` float64 sums; the shards are
    normalised with them and every rank updates its replicated running statistics alike.
    Elsewhere (channel shards, eval mode): the op on the shards
    (``spmd_rules.conv_attention.batch_norm_local``)."""
    op = ctx.call.op
    b = bound_args(op, args, kwargs)
    axes = _stat_axes(ctx.in_specs[0])
    if not axes or not b.get("training", False):
        return rules_batch_norm_local(ctx, *args, **kwargs)
    x, w, bias = b["input"], b.get("weight"), b.get("bias")
    mean_, var_ = b.get("running_mean"), b.get("running_var")
    momentum, eps = b["momentum"], b["eps"]
    n, dims, shape = _per_channel(ctx.in_specs[0], x)
    xd = x.to(torch.float64)
    # one all-reduce of the sums of x - K and of its squares, K the running mean where there is
    # one (replicated, near the batch mean: the variance E[(x-K)^2] - (mean-K)^2 loses nothing
    # to cancellation at float64 unless the batch mean is ~1e5 standard deviations off it)
    shift = mean_.to(torch.float64) if mean_ is not None else xd.new_zeros(x.shape[1])
    xs = xd - shift.view(shape)
    sums = ctx.comm.all_reduce(torch.stack([xs.sum(dims), (xs * xs).sum(dims)]), axes, "sum") / n
    var = (sums[1] - sums[0] * sums[0]).clamp_min(0)
    mean = sums[0] + shift
    centred = xd - mean.view(shape)
    invstd = (var + eps).rsqrt()
    out_meta, mean_meta, invstd_meta = ctx.call.out[:3]
    assert out_meta is not None
    y = (centred * invstd.view(shape)).to(compute_dtype(out_meta.dtype))
    if w is not None:
        y = y * w.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if mean_ is not None and var_ is not None:
        with torch.no_grad():  # in place, as the op writes them (its schema does not say so)
            mean_.mul_(1 - momentum).add_((mean * momentum).to(mean_.dtype))
            var_.mul_(1 - momentum).add_((var * (momentum * n / max(n - 1, 1))).to(var_.dtype))
    return (y.to(out_meta.dtype), mean.to(mean_meta.dtype if mean_meta is not None else x.dtype),
            invstd.to(invstd_meta.dtype if invstd_meta is not None else x.dtype))


def batch_norm_backward_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """The training backward on batch (or spatial) shards: the per-channel sums of the
    gradient and of gradient x normalised input, one all-reduce of ``(2, C)``; the parameter
    gradients are those sums (Replicate). Elsewhere: the op on the shards."""
    op = ctx.call.op
    b = bound_args(op, args, kwargs)
    axes = _stat_axes(ctx.in_specs[1])
    if not axes or not b.get("train", False):
        return rules_batch_norm_local(ctx, *args, **kwargs)
    dy, x, w = b["grad_out"], b["input"], b.get("weight")
    mean, invstd, mask = b["save_mean"], b["save_invstd"], list(b["output_mask"])
    n, dims, shape = _per_channel(ctx.in_specs[1], x)
    dyd = dy.to(torch.float64)
    xhat = (x.to(torch.float64) - mean.to(torch.float64).view(shape)) * invstd.to(torch.float64).view(shape)
    sums = ctx.comm.all_reduce(torch.stack([dyd.sum(dims), (dyd * xhat).sum(dims)]), axes, "sum")
    metas = ctx.call.out[:3]
    gi = gw = gb = None
    if mask[0]:
        scale = invstd.to(torch.float64) if w is None else invstd.to(torch.float64) * w.to(torch.float64)
        gi = ((dyd - (sums[0] / n).view(shape) - xhat * (sums[1] / n).view(shape)) * scale.view(shape))
        gi = gi.to(metas[0].dtype if metas[0] is not None else x.dtype)
    if mask[1] and metas[1] is not None:
        gw = sums[1].to(metas[1].dtype)
    if mask[2] and metas[2] is not None:
        gb = sums[0].to(metas[2].dtype)
    return gi, gw, gb


KERNELS: dict[Any, Callable[..., Any]] = {
    **{op: softmax_local for op in SOFTMAX_OPS},
    **{op: softmax_backward_local for op in SOFTMAX_BACKWARD_OPS},
    **{op: nll_forward_local for op in NLL_FORWARD},
    **{op: batch_norm_local for op in BATCH_NORM_OPS},
    aten.native_batch_norm_backward.default: batch_norm_backward_local,
    **ATTENTION_KERNELS,  # SDPA on a sequence-sharded layout: the ring (context parallelism)
}


def kernel_for(op: Any) -> Callable[..., Any] | None:
    """The local step of ``op``: a registered local implementation, else a kernel here, else None."""
    return get_local_impl(op) or KERNELS.get(op) or KERNELS.get(getattr(op, "overloadpacket", None))
