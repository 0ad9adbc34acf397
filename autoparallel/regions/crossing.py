"""Crossing between a region's DistTensors and the plain shards it runs on, as autograd nodes:
one node for every input that needs a gradient, one per output. See ``autoparallel.regions``."""

from __future__ import annotations

from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.placement import Partial, Replicate, Shard, chunk_bounds
from autoparallel.spec import DistSpec
from reshard.choice import REDUCE_LATENCY_BYTES, pending_price


def _localize(items: list[tuple[DistTensor, DistSpec | None]], grad: bool, call: _Call | None) -> dict[int, torch.Tensor]:
    """id of each DistTensor -> its shard; those needing a gradient go through one autograd node.
    ``call`` None (a replay): detached copies, so an in-place write in the module (a counter
    buffer, an input) does not happen twice."""
    out: dict[int, torch.Tensor] = {}
    with compat.attribute_access():
        needs = [(t, g) for t, g in items if needs_grad(t, g, grad)]
    local_of = layout.local_of
    if call is None:
        for t, _ in items:
            out[id(t)] = local_of(t).detach().clone()
        for t, _ in needs:
            out[id(t)].requires_grad_(True)
        return out
    for t, _ in items:
        out[id(t)] = local_of(t)
    call.grad_specs = tuple(g for _, g in needs if g is not None)
    if needs:
        locs = _Localize.apply(call, tuple(g for _, g in needs), *[t for t, _ in needs])
        for (t, _), loc in zip(needs, locs):
            out[id(t)] = loc
    return out


def needs_grad(t: DistTensor, grad_spec: DistSpec | None, grad_enabled: bool) -> bool:
    """Whether a region's local run gives ``t``'s shard a gradient (through ``_Localize``):
    grad mode on, ``t`` requires one and the verdict gives it a gradient layout."""
    return grad_enabled and t.requires_grad and grad_spec is not None


class _Call:
    """One local run of a region, shared by its input and output autograd nodes.

    ``partial``: mesh axes on which the region's (single) output is Replicate but its gradient
    arrived Partial(sum), and the backward runs on the summands: it is linear in that gradient,
    so the inputs' gradients are Partial(sum) there too. The gradient is carried so where the
    DistTensor path's cost would carry it (``reshard.choice``): where the reductions it leaves
    pending (the inputs' and parameters' gradients) cost no more than the one it owes; else it
    is reduced before the backward (a layer norm's: Megatron's ``f``). ``grad_specs``: the
    gradient layouts of the inputs and parameters the local run differentiates.
    """

    def __init__(self, single: bool) -> None:
        self.single = single
        self.partial: tuple[int, ...] = ()
        self.grad_specs: tuple[DistSpec, ...] = ()


class _Localize(torch.autograd.Function):
    """DistTensors -> their local shards, as one autograd node.

    Backward: each shard's gradient becomes a DistTensor in the layout the region's
    classification gave it (a Replicate input used on a sharded axis: Partial(sum) there; on
    the ``call.partial`` axes, Partial(sum)). Unused outputs get no gradient (not zeros): an
    unused parameter keeps ``grad is None``.
    """

    @staticmethod
    def forward(ctx: Any, call: _Call, specs: tuple[DistSpec, ...], *xs: DistTensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.call, ctx.specs = call, specs
        ctx.set_materialize_grads(False)
        # new tensors on the shards' storage (not the shards: this node would become their
        # history); ``detach`` rather than ``view_as`` spares autograd's view bookkeeping
        local_of = layout.local_of
        return tuple(local_of(x).detach() for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        specs = ctx.specs if not ctx.call.partial else tuple(with_partial(s, ctx.call.partial) for s in ctx.specs)
        if torch.is_grad_enabled():  # create_graph: the gradients stay differentiable
            return (None, None, *[None if g is None else layout.from_local(g.contiguous(), s) for g, s in zip(grads, specs)])
        out = [None if g is None else layout.wrap(g if g.is_contiguous() else g.contiguous(), s)
               for g, s in zip(grads, specs)]
        give_directly(ctx, out)
        return (None, None, *out)


def give_directly(ctx: Any, grads: list[DistTensor | None]) -> None:
    """Give each parameter without a gradient its gradient directly, in place of autograd's
    accumulation node (whose ``detach`` of a DistTensor gradient costs a trip through
    ``__torch_dispatch__`` per parameter per step). The node then receives no gradient.

    Only where the node would store the gradient as it is: this ``backward()`` runs the node
    (not ``autograd.grad``, which captures gradients instead, nor ``backward(inputs=...)``
    without this parameter), the parameter has no gradient yet (accumulating into one is the
    node's job) and no tensor hook (hooks see the gradient on its way to the node). Hooks
    registered on the node object itself are not visible from Python: they are called with
    None in place of the gradient (docs/local_regions.md).
    """
    with compat.attribute_access():
        for k, ((node, _), g) in enumerate(zip(ctx.next_functions, grads)):
            leaf = getattr(node, "variable", None)  # set on accumulation nodes only: a parameter's
            if g is None or leaf is None or leaf.grad is not None or compat.has_tensor_hooks(leaf):
                continue
            try:
                if not _will_run(node):
                    continue
            except RuntimeError:  # autograd.grad(): it asks nothing of leaves (they are captured)
                continue
            leaf.grad = g
            grads[k] = None


_will_run = compat.will_engine_execute_node


class _Out(torch.autograd.Function):
    """A region's local output -> its DistTensor. Backward: the gradient in the output's layout
    (a Partial(sum) gradient on an axis where the output is Replicate stays Partial for a
    single-output region: see ``_Call``), then its shard. The gradient of a Partial(sum) output
    (each rank's local output is a summand) is the whole gradient of the sum: Replicate there."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DistSpec, call: _Call) -> DistTensor:  # type: ignore[override]
        ctx.spec, ctx.call = spec, call
        return layout.wrap(local.view_as(local) if local.is_contiguous() else local.contiguous(), spec)

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        target: DistSpec = ctx.spec
        # with create_graph, differentiable: the backward of this backward reaches ``grad``
        local = grad.to_local() if torch.is_grad_enabled() else layout.local_of(grad)
        spec = layout.spec_of(grad)
        summed = target.has_partial  # the output is a summand on these axes: its gradient is whole
        if summed:
            target = target.without_partial()
        if ctx.call.single:
            keep = []
            coord = spec.mesh.coordinate_of(runtime.get_rank())
            for a, (p, q) in enumerate(zip(spec.placements, target.placements)):
                if not isinstance(q, Replicate) or coord is None or (summed and isinstance(ctx.spec.placements[a], Partial)):
                    continue
                if p == Partial("sum"):
                    keep.append(a)
                elif isinstance(p, Shard) and spec.axes_of_dim(p.dim) == (a,):
                    # a shard of the gradient of a replicated output: zero-padded to the whole
                    # dim it is a summand (Partial(sum)) of that gradient — no all-gather
                    local = _zero_pad(local, p.dim, spec.shape[p.dim], spec.mesh.shape[a], coord[a])
                    spec = spec.with_placements([Partial("sum") if b == a else x for b, x in enumerate(spec.placements)],
                                                spec.shard_order)
                    keep.append(a)
            if keep and any(spec.placements[a] == Partial("sum") for a in keep) and not _carried(spec, keep, ctx.call):
                keep = []  # reduced on every axis now, the shards' zero-padding undone by the move
                local, spec = layout.local_of(grad), layout.spec_of(grad)
            if keep:
                ctx.call.partial = tuple(keep)
                target = with_partial(target, ctx.call.partial)
        return layout.move(local, spec, target), None, None


def _carried(grad: DistSpec, axes: list[int], call: _Call) -> bool:
    """Whether a Partial(sum) gradient on ``axes`` is carried into the backward rather than
    reduced first, as ``reshard.choice.cheapest`` decides for an op: carried where it becomes
    one Partial gradient; where it would become several, carried only if the reductions they
    leave pending cost less than the one the gradient owes plus a collective's start-up."""
    if len(call.grad_specs) <= 1:
        return True
    on = tuple(axes)
    pending = sum(pending_price(with_partial(s, on), on) for s in call.grad_specs)
    return pending - pending_price(grad, on) < REDUCE_LATENCY_BYTES


def _zero_pad(local: torch.Tensor, dim: int, size: int, parts: int, index: int) -> torch.Tensor:
    """``local`` (piece ``index`` of ``parts`` along ``dim``) inside zeros of the whole ``size``."""
    off, length = chunk_bounds(size, parts, index)
    shape = list(local.shape)
    shape[dim] = size
    full = local.new_zeros(shape)
    full.narrow(dim, off, length).copy_(local)
    return full


def with_partial(spec: DistSpec, axes: tuple[int, ...]) -> DistSpec:
    """``spec`` with Replicate made Partial(sum) on ``axes`` (a gradient summed over them)."""
    pl = [Partial("sum") if a in axes and isinstance(p, Replicate) else p for a, p in enumerate(spec.placements)]
    return spec.with_placements(pl, spec.shard_order)


def _wrap_out(local: torch.Tensor, spec: DistSpec, call: _Call) -> DistTensor:
    if local.requires_grad:
        return _Out.apply(local, spec, call)  # type: ignore[no-any-return]
    return layout.wrap(local if local.is_contiguous() else local.contiguous(), spec)
