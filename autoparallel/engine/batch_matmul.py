"""``torch.matmul`` of batched DistTensors with a sharded inner batch dim: that dim first.

``torch.matmul`` of two ``[b, h, s, d]`` tensors is composite: it flattens the batch dims to
``[b*h, s, d]`` and calls ``bmm``, below Python. With the heads ``h`` sharded (eager attention
under tensor parallelism: BERT, GPT-2, ViT) the flattened dim would be sharded on its inner
factor, which no placement expresses, so the reshape gathered both operands on every attention
matmul (found by the model zoo). Moving the sharded batch dims to the front first
(``[h, b, s, d]``) makes the flatten keep the shard (``Shard(0)``); the products are the same
numbers (one ``bmm`` per batch element either way) and the result is permuted back and made
contiguous, as ``matmul`` returns it.

Where both operands are laid out alike on their batch dims only (each mesh axis shards the same
batch dim of both, or neither), every rank's batch elements are its own: ``matmul`` runs on the
shards and its result is laid out as they are (``per_shard``; differentiable through ``to_local``
and the engine's ``from_local``, each operand's gradient coming back in its own layout). That is
tried first: it moves nothing, where the permutation's contiguous result and the copy the
permuted operands' flatten makes (saved for the backward) each cost an activation (data
parallel attention as ``[h, b, s, s]``, the batch sharded). Two batch dims sharded on two mesh
axes (DP x TP: the batch on ``dp``, the heads on ``tp``) merge into no placement whatever their
order: there only ``per_shard`` applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec

MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
LINEARS = frozenset({torch.nn.functional.linear})


def _sharded_dims(t: Any, batch: int) -> set[int]:
    dims = set()
    for p in t._spec.placements:
        if isinstance(p, Shard):
            d = p.dim % t.dim()
            if d < batch:
                dims.add(d)
    return dims


def batch_first_matmul(cls: Any, func: Any, args: tuple[Any, ...], kwargs: Any,
                       from_local: Callable[[torch.Tensor, DistSpec], Any]) -> Any:
    """``func(a, b)`` with the sharded batch dims moved first (or, for two of them, on the
    shards: ``per_shard``), or ``NotImplemented`` when it does not apply.

    Applies to two DistTensors of one rank >= 3 with equal batch shapes (no broadcasting) where
    some batch dim other than the first is sharded. ``from_local``: the engine's differentiable
    shard -> DistTensor.
    """
    if func in LINEARS:
        return linear_on_shards(cls, args, kwargs or {}, from_local)
    if func not in MATMULS or kwargs or len(args) != 2:
        return NotImplemented
    a, b = args
    if not (isinstance(a, cls) and isinstance(b, cls)) or a.dim() != b.dim() or a.dim() < 3:
        return NotImplemented
    batch = a.dim() - 2
    if tuple(a.shape[:batch]) != tuple(b.shape[:batch]):
        return NotImplemented
    sharded = sorted(_sharded_dims(a, batch) | _sharded_dims(b, batch))
    if not sharded or sharded == [0]:
        return NotImplemented  # the outermost dim alone: the flatten keeps it
    out = per_shard(a, b, batch, from_local)
    if out is not NotImplemented:
        return out
    if sharded == list(range(len(sharded))):
        return NotImplemented  # already outermost
    perm = sharded + [d for d in range(a.dim()) if d not in sharded]
    inverse = [perm.index(d) for d in range(a.dim())]
    out = torch.matmul(a.permute(perm), b.permute(perm))  # [sharded..., other batch..., m, n]
    return out.permute(inverse).contiguous()


def per_shard(a: Any, b: Any, batch: int, from_local: Callable[[torch.Tensor, DistSpec], Any]) -> Any:
    """``matmul(a, b)`` on the shards where both are laid out alike on batch dims only (each
    mesh axis shards one batch dim of both, or replicates both; one dtype): the result's batch
    dims keep that layout. Else ``NotImplemented``."""
    sa, sb = a._spec, b._spec
    if sa.mesh != sb.mesh or sa.placements != sb.placements or sa.shard_order != sb.shard_order or sa.dtype != sb.dtype:
        return NotImplemented
    for p in sa.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % a.dim() < batch)):
            return NotImplemented  # Partial, or a matrix dim sharded: the products need more
    placements = tuple(Shard(p.dim % a.dim()) if isinstance(p, Shard) else p for p in sa.placements)
    spec = DistSpec(sa.mesh, placements, (*sa.shape[:batch], sa.shape[-2], sb.shape[-1]), sa.dtype, sa.shard_order)
    return from_local(_on_shards(torch.matmul, sa, a.to_local(), b.to_local()), spec)


def _on_shards(fn: Callable[..., torch.Tensor], spec: DistSpec, *locals_: torch.Tensor) -> torch.Tensor:
    """``fn`` of the shards; outside the mesh an empty shard that depends on them (ranks off the
    mesh take the same path, so every rank derives the same layouts: a pipeline's shape pass
    runs every stage on every rank)."""
    if spec.mesh.coordinate_of(runtime.get_rank()) is None:
        out = locals_[0][:0]
        for t in locals_[1:]:
            out = out + t[:0]
        return out
    return fn(*locals_)


def _linear_axis(px: Any, pw: Any, last: int, ndim: int) -> tuple[Any, Any, Any] | None:
    """On one mesh axis, (output, input gradient, weight gradient) placements of ``F.linear`` run
    on the shards, for input placement ``px`` and weight placement ``pw``; None: not on shards."""
    if isinstance(px, Shard) and px.dim % ndim < last and isinstance(pw, Replicate):
        return Shard(px.dim % ndim), Shard(px.dim % ndim), Partial()  # rows: the weight's gradient sums
    if isinstance(px, Replicate) and isinstance(pw, Replicate):
        return Replicate(), Replicate(), Replicate()
    if isinstance(px, Replicate) and pw == Shard(0):
        return Shard(last), Partial(), Shard(0)  # out-features: the input's gradient sums
    if isinstance(px, Shard) and px.dim % ndim == last and pw == Shard(1):
        return Partial(), Shard(last), Shard(1)  # in-features: the output sums
    return None


def linear_on_shards(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     from_local: Callable[[torch.Tensor, DistSpec], Any]) -> Any:
    """``F.linear(x, w, bias)`` on the shards where ``x`` is sharded on a token dim that is not
    its first (a sequence-sharded ``[B, S, W]`` activation: context or sequence parallelism).

    ``F.linear`` flattens ``x`` to ``[B*S, W]`` below Python: ``S`` sharded is the inner factor of
    that dim, which no placement expresses, so the engine would gather ``x``. Each token's output
    depends on that token alone, so the linear runs on the shards instead, per mesh axis as
    ``_linear_axis`` says (tokens sharded with the weight replicated: the weight's gradient is
    Partial there, reduced as data parallelism reduces it; Megatron's column/row layouts on
    another axis). The bias is added on DistTensors (once, whatever the layout).
    ``NotImplemented`` elsewhere: the engine's op path."""
    x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not (isinstance(x, cls) and isinstance(w, cls)) or x.dim() < 3 or w.dim() != 2:
        return NotImplemented
    if bias is not None and not isinstance(bias, cls):
        return NotImplemented
    sx, sw = x._spec, w._spec
    last = x.dim() - 1
    if not any(isinstance(p, Shard) and 0 < p.dim % x.dim() < last for p in sx.placements):
        return NotImplemented  # the flatten keeps the layout: the op path
    if sx.mesh != sw.mesh or sx.dtype != sw.dtype or sx.shard_order or sw.shard_order:
        return NotImplemented
    per_axis = [_linear_axis(px, pw, last, x.dim()) for px, pw in zip(sx.placements, sw.placements)]
    if any(a is None for a in per_axis):
        return NotImplemented
    out_p, x_grad, w_grad = (tuple(a[k] for a in per_axis if a is not None) for k in range(3))
    if sum(p == Shard(last) for p in out_p) > 1:
        return NotImplemented  # out-features split by two axes: the op path orders them
    spec = DistSpec(sx.mesh, out_p, (*sx.shape[:-1], sw.shape[0]), sx.dtype)
    local = _on_shards(torch.nn.functional.linear, sx, x.to_local(grad_placements=x_grad), w.to_local(grad_placements=w_grad))
    out = from_local(local, spec)
    return out if bias is None else out + bias


__all__ = ["LINEARS", "batch_first_matmul", "linear_on_shards", "per_shard"]
