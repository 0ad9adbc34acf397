"""A shard's strides next to its DistTensor's: the wrapper's strides decide, the shard must follow.

Torch decides from a tensor's strides whether ``reshape`` may be a view, whether
``.contiguous()`` copies, whether autograd's accumulation keeps a gradient as it is. On a
DistTensor those questions are answered by the *wrapper's* (global) strides, and the answer is
then acted on with the *shard*: a ``view`` the wrapper allows must be a view of the shard too.
So every shard **follows** its wrapper's strides, in one of two ways:

- it has exactly the wrapper's strides (a slice of a tensor laid out like the global one: the
  shard an ``R -> S`` plan cuts without copying), or
- it is dense with its dims nested in the wrapper's order (outermost = largest stride; dims
  of size 1 do not count): what a kernel, a collective or a copy writes.

Either way every pair of dims the wrapper can merge into one view dim the shard can merge too
(the view rule never merges a sharded dim with the dim outside it), and a contiguous wrapper
has a contiguous dense shard. A shard that follows neither (a collective's row-major result
standing for a transposed tensor, a kernel choosing another memory layout on the local sizes,
an expanded stride-0 gradient under a contiguous wrapper) is copied by ``conform``.

Pure metadata except ``conform`` (whose copy keeps what ``known_sums`` noted on the shard).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autoparallel import known_sums
from autoparallel.compat import metadata_cache


# (the strides memos are keyed by exact shapes: a new sequence length adds ~20 entries to
# each, a miss costs a microsecond or two: they hold a few steps' worth, not every length seen)
@metadata_cache(256)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (cached: every wrapper without explicit strides asks)."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def channels_last_like(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether torch suggests a channels-last memory format for a tensor of ``shape``/``stride``
    (``Tensor.suggest_memory_format``; what ``cat`` and ``constant_pad_nd`` lay their output out
    by): 4-d (NHWC) or 5-d (NDHWC) only, its dims visited from the channels outwards (C, the
    spatial dims from the last, then N), none empty, each stride at least the extent of the dims
    visited before it (a dim's stride, times its size where that is above 1); ambiguous cases
    are contiguous: a channel stride of 0, or N's stride equal to that extent where it is C's stride."""
    n = len(shape)
    if n not in (4, 5) or stride[1] == 0:
        return False
    bound = 0
    for d in (1, 3, 2, 0) if n == 4 else (1, 4, 3, 2, 0):
        if shape[d] == 0 or stride[d] < bound or (d == 0 and bound == stride[1]):
            return False
        bound = stride[d] * shape[d] if shape[d] > 1 else stride[d]
    return True


def nesting(like: Sequence[int]) -> list[int]:
    """Dims outermost first by stride in ``like`` (ties: the earlier dim outside, as row-major)."""
    return sorted(range(len(like)), key=lambda d: (-like[d], d))


@metadata_cache(256)
def dense_strides(shape: tuple[int, ...], like: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides of ``shape`` with its dims nested as in strides ``like`` (same rank).

    ``dense_strides((1, 4, 16, 16), (1024, 16, 64, 1)) == (1024, 16, 64, 1)``: a shard of
    ``[B, H, S, D]`` stored as ``[B, S, H, D]``, like its global tensor.
    """
    if len(shape) != len(like):
        raise ValueError(f"dense_strides: shape {tuple(shape)} and strides {tuple(like)} have different ranks")
    return dense_in(shape, nesting(like))


def dense_in(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Dense strides of ``shape`` with its dims nested in ``order`` (outermost first)."""
    out = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        out[d] = acc
        acc = acc * shape[d] if isinstance(shape[d], torch.SymInt) else acc * max(shape[d], 1)
    return tuple(out)


def follows(shape: Sequence[int], stride: Sequence[int], like: Sequence[int]) -> bool:
    """Whether a shard of ``shape``/``stride`` follows wrapper strides ``like`` (module docstring):
    exactly ``like``, or dense in ``like``'s nesting with dims of size 1 ignored. An empty
    shard follows anything (nothing to view)."""
    if len(shape) != len(like):
        return False
    if tuple(stride) == tuple(like) or 0 in shape:
        return True
    expected = 1
    for d in reversed(nesting(like)):
        if shape[d] == 1:
            continue
        if stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def conform(local: torch.Tensor, like: tuple[int, ...], dense: tuple[int, ...] | None = None) -> torch.Tensor:
    """``local`` if it follows wrapper strides ``like``, else a copy dense in ``like``'s nesting.

    ``dense``: ``dense_strides(local.shape, like)`` when the caller has it (a cached decision),
    so the usual case — the shard is exactly that — costs one tuple comparison. A shard of
    another rank than ``like`` (an empty shard off the mesh) is returned as it is.
    """
    if local.layout != torch.strided or local.ndim != len(like):
        return local
    stride = local.stride()
    if stride == dense or follows(local.shape, stride, like):
        return local
    shape = tuple(local.shape)
    out = torch.empty_strided(shape, dense or dense_strides(shape, like), dtype=local.dtype, device=local.device)
    return known_sums.carry(local, out.copy_(local))


__all__ = ["conform", "contiguous_strides", "dense_in", "dense_strides", "follows", "nesting"]
