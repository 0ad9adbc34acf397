"""``torch.matmul`` of batched DistTensors with a sharded inner batch dim: that dim first.

``torch.matmul`` of two ``[b, h, s, d]`` tensors is composite: it flattens the batch dims to
``[b*h, s, d]`` and calls ``bmm``, below Python. With the heads ``h`` sharded (eager attention
under tensor parallelism: BERT, GPT-2, ViT) the flattened dim would be sharded on its inner
factor, which no placement expresses, so the reshape gathered both operands on every attention
matmul (found by the model zoo). Moving the sharded batch dims to the front first
(``[h, b, s, d]``) makes the flatten keep the shard (``Shard(0)``); the products are the same
numbers (one ``bmm`` per batch element either way) and the result is permuted back and made
contiguous, as ``matmul`` returns it.
"""

from __future__ import annotations

from typing import Any

import torch

from autoparallel.placement import Shard

MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})


def _sharded_dims(t: Any, batch: int) -> set[int]:
    dims = set()
    for p in t._spec.placements:
        if isinstance(p, Shard):
            d = p.dim % t.dim()
            if d < batch:
                dims.add(d)
    return dims


def batch_first_matmul(cls: Any, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    """``func(a, b)`` with the sharded batch dims moved first, or ``NotImplemented`` when it does not apply.

    Applies to two DistTensors of one rank >= 3 with equal batch shapes (no broadcasting) where
    some batch dim other than the first is sharded.
    """
    if func not in MATMULS or kwargs or len(args) != 2:
        return NotImplemented
    a, b = args
    if not (isinstance(a, cls) and isinstance(b, cls)) or a.dim() != b.dim() or a.dim() < 3:
        return NotImplemented
    batch = a.dim() - 2
    if tuple(a.shape[:batch]) != tuple(b.shape[:batch]):
        return NotImplemented
    sharded = sorted(_sharded_dims(a, batch) | _sharded_dims(b, batch))
    if not sharded or sharded == list(range(len(sharded))):
        return NotImplemented  # already outermost: the flatten keeps it
    perm = sharded + [d for d in range(a.dim()) if d not in sharded]
    inverse = [perm.index(d) for d in range(a.dim())]
    out = torch.matmul(a.permute(perm), b.permute(perm))  # [sharded..., other batch..., m, n]
    return out.permute(inverse).contiguous()


__all__ = ["batch_first_matmul"]
