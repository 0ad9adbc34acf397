"""Kernels: local steps that need a collective, handed theirs by the engine.

A rule (``spmd_rules``) only says which layouts an op may take. For a few strategies the local
step is not the op on the shards: a softmax over a sharded dim ("loss parallel") needs the
global row max and row sum, and a mean NLL loss over batch shards the global (sum, count).
These steps live here, not in the rules package, and issue their collectives through the
``Collectives`` the engine puts in their ``LocalContext`` (``ctx.comm``), on the mesh of the op
they run. A kernel may also *defer* a statistic (``ctx.may_defer``): it starts the all-reduce
and returns ``Deferred`` values the engine turns into pending DistTensors.

``kernel_for(op)`` is the engine's lookup: a local implementation a user registered
(``ap.register_local_impl``) first, then these kernels, then the rules' own local
implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.engine.deferred import Deferred, Stat
from autoparallel.mesh import ProcessMesh
from autoparallel.runtime import agree, comm
from spmd_rules.base import LocalContext
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

    def start_sum(self, t: torch.Tensor, axis: int) -> Stat:
        """Start summing ``t`` over ``axis``; the ``Stat`` waits when its result is read."""
        agree.check_collective(self.mesh, axis, lambda: _describe("all_reduce_start", "sum", t))
        return Stat(*comm.all_reduce_start(t, self.mesh, axis))


def _describe(kind: str, reduce_type: str, t: torch.Tensor) -> str:
    """A kernel's statistic reduction as every member must issue it (``AUTOPARALLEL_CHECK=1``)."""
    return f"{kind}({reduce_type}) of a kernel statistic {list(t.shape)} {t.dtype}"


# ---- softmax over a sharded dim ----------------------------------------------------------
def softmax_local(ctx: LocalContext, x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Over a sharded dim: global row max and row sum of exponentials by all-reduce."""
    d = dim % max(x.ndim, 1)
    spec = ctx.in_specs[0]
    axes = axes_sharding(spec, d)
    if not axes:
        return ctx.call.op(x, dim, half_to_float)
    out_meta = ctx.call.out[0]
    assert out_meta is not None
    xf = x.to(compute_dtype(out_meta.dtype))
    if xf.shape[d]:
        local_max = xf.amax(d, keepdim=True)
    else:  # an empty piece of an uneven shard
        local_max = xf.new_full(xf.shape[:d] + (1,) + xf.shape[d + 1:], float("-inf"))
    shifted = xf - ctx.comm.all_reduce(local_max, axes, "max")
    e = shifted.exp()
    total = ctx.comm.all_reduce(e.sum(d, keepdim=True), axes, "sum")
    if ctx.call.op.overloadpacket is aten._log_softmax:
        return (shifted - total.log()).to(out_meta.dtype)
    return (e / total).to(out_meta.dtype)


def softmax_backward_local(
    ctx: LocalContext, grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype
) -> torch.Tensor:
    """Over a sharded dim: the row sum the gradient needs comes from an all-reduce."""
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
        res = g - y.exp() * ctx.comm.all_reduce(g.sum(d, keepdim=True), axes, "sum")
    else:
        res = y * (g - ctx.comm.all_reduce((g * y).sum(d, keepdim=True), axes, "sum"))
    return res.to(out_meta.dtype)


# ---- NLL loss: class-sharded, and the mean over batch shards ---------------------------------
def nll_forward_local(
    ctx: LocalContext, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
    reduction: int = MEAN, ignore_index: int = -100,
) -> tuple[Any, Any]:
    """Class-sharded: score only local classes. ``mean`` over batch shards: the sum and the total
    weight are all-reduced together (one collective) and divided: the loss is Replicate there."""
    spec, cdim, off, n, batch_axes = nll_layout(ctx)
    classes = spec.shape[cdim]
    op = ctx.call.op
    if n == classes:
        if reduction != MEAN or not batch_axes:
            return op(x, target, weight, reduction, ignore_index)
        s, tw = op(x, target, weight, SUM, ignore_index)
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
    both = torch.stack([s, tw.to(s.dtype)])  # (2,): sum, total weight
    if len(batch_axes) == 1 and ctx.may_defer:
        # Start the all-reduce and return at once: the loss and the total weight are computed
        # on first use; the backward runs unscaled and the optimizer scales the gradients.
        stat = ctx.comm.start_sum(both, batch_axes[0])
        dtype = tw.dtype
        return (Deferred(s.new_empty(()), stat, lambda _, st: st.result()[0] / st.result()[1]),
                Deferred(tw.new_empty(()), stat, lambda _, st: st.result()[1].to(dtype)))
    both = ctx.comm.all_reduce(both, batch_axes, "sum")
    return both[0] / both[1], both[1].to(tw.dtype)


KERNELS: dict[Any, Callable[..., Any]] = {
    **{op: softmax_local for op in SOFTMAX_OPS},
    **{op: softmax_backward_local for op in SOFTMAX_BACKWARD_OPS},
    **{op: nll_forward_local for op in NLL_FORWARD},
}
# kernels that may return ``Deferred`` values (when ``ctx.may_defer``)
DEFERRING = frozenset(NLL_FORWARD)


def kernel_for(op: Any) -> Callable[..., Any] | None:
    """The local step of ``op``: a registered local implementation, else a kernel here, else None."""
    return get_local_impl(op) or KERNELS.get(op) or KERNELS.get(getattr(op, "overloadpacket", None))
