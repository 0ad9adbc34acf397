"""``as_strided`` that only re-reads a whole tensor in another order: a view and a permute.

Kernels and autograd formulas use ``as_strided`` where a reshape would do (``adaptive_avg_pool2d``
to 1 x 1 restrides its output channels-last; ``as_strided``'s backward re-reads a flat zero
storage as the input's and the output's geometry). ``as_strided`` has no SPMD rule — it addresses
storage, which a sharded tensor does not have as one piece — but when the input is contiguous
and the asked geometry covers every element exactly once (dense, non-overlapping, offset 0), it
is ``x.view(sizes sorted by stride).permute(...)``, two ops with rules. Pure metadata here; the
dispatcher runs the two ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def as_view_permute(shape: Sequence[int], strides: Sequence[int], size: Sequence[int], stride: Sequence[int],
                    offset: int | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(view_shape, perm)`` with ``x.view(view_shape).permute(perm) == x.as_strided(size, stride,
    offset)`` for ``x`` of this shape and strides, or None where no such pair exists (a strided
    input, a window, overlapping or gapped strides)."""
    if offset not in (None, 0) or len(size) != len(stride) or not _contiguous(shape, strides):
        return None
    if math.prod(size) != math.prod(shape) or math.prod(size) == 0:
        return None
    order = sorted(range(len(size)), key=lambda d: (-int(stride[d]), d))
    expected = 1
    for d in reversed(order):
        if size[d] == 1:
            continue  # a size-1 dim's stride addresses nothing
        if int(stride[d]) != expected:
            return None
        expected *= int(size[d])
    return tuple(int(size[d]) for d in order), tuple(order.index(i) for i in range(len(size)))
