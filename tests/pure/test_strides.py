"""autoparallel.strides: when a shard follows its wrapper's strides, and the copy when it does not.

The property behind it, checked by brute force: a shard that follows its wrapper's strides
admits every ``view`` the wrapper admits that the view rule keeps sharded (a sharded dim is
never merged with the dim outside it).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from autoparallel.strides import (
    conform,
    contiguous_strides,
    dense_strides,
    follows,
    nesting,
)


def test_dense_strides_nest_like_the_wrapper() -> None:
    assert dense_strides((2, 3, 4), (12, 4, 1)) == contiguous_strides((2, 3, 4)) == (12, 4, 1)
    # [B, H, S, D] stored as [B, S, H, D] (SDPA's output for a transposed query): a shard keeps that nesting
    assert dense_strides((1, 4, 16, 16), (1024, 16, 64, 1)) == (1024, 16, 64, 1)
    assert dense_strides((2, 2, 16, 16), (1024, 16, 64, 1)) == (512, 16, 32, 1)
    assert dense_strides((3, 5), (1, 4)) == (1, 3)  # column-major
    assert nesting((0, 4, 1)) == [1, 2, 0]  # an expanded (stride-0) dim nests innermost
    with pytest.raises(ValueError, match="different ranks"):
        dense_strides((2, 3), (1,))


def test_follows() -> None:
    assert follows((4, 4), (8, 1), (8, 1))            # a slice of the global layout (R -> S(1), no copy)
    assert follows((4, 4), (4, 1), (8, 1))            # dense, row-major like the wrapper
    assert not follows((4, 4), (1, 4), (8, 1))        # transposed under a row-major wrapper
    assert not follows((4, 6), (0, 0), (6, 1))        # an expanded gradient under a contiguous wrapper
    assert follows((4, 1, 6), (6, 99, 1), (6, 6, 1))  # a dim of size 1 has any stride
    assert follows((1, 4, 16, 16), (1024, 16, 64, 1), (1024, 16, 64, 1))
    assert not follows((1, 4, 16, 16), (1024, 256, 16, 1), (1024, 16, 64, 1))  # row-major: not [B, S, H, D]
    assert follows((0, 4), (1, 0), (4, 1))            # an empty shard: nothing to view
    assert not follows((4,), (1,), (4, 1))            # another rank


def test_conform_copies_only_what_does_not_follow() -> None:
    x = torch.arange(24.0).view(4, 6)
    assert conform(x, (6, 1)) is x
    piece = x[:, :3]                                      # a slice of the global layout
    assert conform(piece, (6, 1)) is piece
    t = x.t()                                             # [6, 4] column-major
    c = conform(t, (4, 1))                                # ... under a row-major wrapper: copied
    assert c.stride() == (4, 1) and torch.equal(c, t)
    e = torch.ones(()).expand(4, 6)
    c = conform(e, (6, 1), (6, 1))
    assert c.stride() == (6, 1) and torch.equal(c, e)
    c.mul_(2)  # writable: no element shares memory any more
    empty = torch.empty(0)
    assert conform(empty, (6, 1)) is empty                # off the mesh: another rank, left alone


def _views(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each merge of a run of adjacent dims: (new shape, the merged dims)."""
    out = []
    for i, j in itertools.combinations(range(len(shape) + 1), 2):
        if j - i >= 2:
            new = shape[:i] + (int(torch.tensor(shape[i:j]).prod()),) + shape[j:]
            out.append((new, tuple(range(i, j))))
    return out


@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_following_shard_takes_every_view_its_wrapper_takes(perm: tuple[int, ...], dim: int) -> None:
    """Brute force over storage orders and sharded dims: global [4, 6, 2] stored in order ``perm``;
    its shard of 2 pieces on ``dim`` either sliced (the wrapper's strides) or dense in the
    wrapper's nesting. Every merge the wrapper can view, and the view rule keeps sharded (``dim``
    outermost of the merged run, or not merged), the shard can view."""
    shape = (4, 6, 2)
    stored = torch.arange(48.0).view([shape[p] for p in perm]).permute(*[perm.index(d) for d in range(3)])
    assert tuple(stored.shape) == shape
    like = stored.stride()
    sliced = stored.chunk(2, dim)[1]
    dense = conform(sliced.clone(memory_format=torch.contiguous_format), like)
    for local in (sliced, dense):
        assert follows(local.shape, local.stride(), like)
        for new_global, merged in _views(shape):
            if dim in merged and merged[0] != dim:
                continue  # the view rule replicates first: never a view of the shard
            try:
                stored.view(new_global)
            except RuntimeError:
                continue  # the wrapper copies (reshape) or raises as one process would
            new_local = list(local.shape[:merged[0]]) + [-1] + list(local.shape[merged[-1] + 1:])
            local.view(new_local)  # must not raise
