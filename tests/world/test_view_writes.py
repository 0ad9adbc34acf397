"""In-place writes through chains of views of a DistTensor (4 ranks).

A view whose layout had to change (slicing a sharded dim, flattening a dim-1 shard) holds a
moved copy of the shard, not a window onto it: the engine marks it detached and a write through
it raises. A view of such a view shares the copy, so it is detached too: a write through any chain
raises on every rank (``x[1:4][1:2].fill_(-1)`` on a ``Shard(0)`` ``x`` used to be a silent no-op).
Chains whose views all keep the shard write through as plain torch does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import autoparallel as ap

Chain = Callable[[torch.Tensor], Any]

# each: (name, shape, 2-D mesh?, placements, the chain)
_LOST: list[tuple[str, tuple[int, ...], bool, tuple[str, ...], Chain]] = [
    ("slice_slice", (4, 4), False, ("S0",), lambda x: x[1:4][1:2].fill_(-1)),
    ("flat_slice", (5, 3), False, ("S0",), lambda x: x.view(-1)[2:5].fill_(-1)),
    ("reshape_slice_mul", (5, 3), False, ("S0",), lambda x: x.reshape(-1)[1:4].mul_(2)),
    ("view_view_select", (5, 3), False, ("S0",), lambda x: x.view(-1).view(x.shape)[0].fill_(-1)),
    ("slice_detach", (4, 4), False, ("S0",), lambda x: x[1:3].detach()[0].fill_(-1)),
    ("slice_slice_2d", (5, 4), True, ("R", "S0"), lambda x: x[1:4][1:2].fill_(-1)),
    ("flat_slice_2d", (5, 4), True, ("S0", "S0"), lambda x: x.view(-1)[2:5].fill_(-1)),
]

_KEPT: list[tuple[str, tuple[int, ...], bool, tuple[str, ...], Chain]] = [
    ("replicate_slice_slice", (4, 4), False, ("R",), lambda x: x[1:4][1:2].fill_(-1)),
    ("replicate_flat_slice", (5, 3), False, ("R",), lambda x: x.view(-1)[2:5].fill_(-1)),
    ("s1_slice_select", (4, 4), False, ("S1",), lambda x: x[1:3][0].fill_(-1)),
    ("s0_cols_select", (4, 4), False, ("S0",), lambda x: x[:, 1:3][:, 0].mul_(3)),
    ("s0_unsqueeze_select", (4, 4), False, ("S0",), lambda x: x.unsqueeze(0)[0][:, 1].fill_(-1)),
    ("s1_slice_slice_2d", (5, 4), True, ("R", "S1"), lambda x: x[1:4][1:2].fill_(-1)),
]


def _setup(shape: tuple[int, ...], two_d: bool, names: tuple[str, ...]) -> tuple[torch.Tensor, Any]:
    mesh = (ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]) if two_d
            else ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"]))
    places = {"R": ap.Replicate(), "S0": ap.Shard(0), "S1": ap.Shard(1)}
    t = torch.arange(float(torch.tensor(shape).prod())).reshape(shape) + 1
    return t, ap.shard_tensor(t.clone(), mesh, [places[n] for n in names])


def _lost_write_raises(rank: int, i: int) -> None:
    _, shape, two_d, names, chain = _LOST[i]
    t, x = _setup(shape, two_d, names)
    with pytest.raises(RuntimeError, match="in-place write to a view of a DistTensor whose layout had to change"):
        chain(x)
    assert torch.equal(x.full_tensor(), t)  # nothing written, on any rank


def _kept_write_reaches(rank: int, i: int) -> None:
    _, shape, two_d, names, chain = _KEPT[i]
    t, x = _setup(shape, two_d, names)
    ref = t.clone()
    chain(ref)
    assert not torch.equal(ref, t)
    chain(x)
    assert torch.equal(x.full_tensor(), ref)


def _in_place_view_of_detached_view(rank: int) -> None:
    """``unsqueeze_`` of a detached view stays a view of that view (no new move): allowed, and
    the result stays detached."""
    _, x = _setup((4, 4), False, ("S0",))
    v = x[1:3]
    v.unsqueeze_(0)
    assert tuple(v.shape) == (1, 2, 4)
    with pytest.raises(RuntimeError, match="in-place write to a view"):
        v.fill_(-1)


@pytest.mark.parametrize("i", range(len(_LOST)), ids=[c[0] for c in _LOST])
def test_a_write_through_a_view_of_a_detached_view_raises(world4, i: int) -> None:  # type: ignore[no-untyped-def]
    world4.run(_lost_write_raises, i)


@pytest.mark.parametrize("i", range(len(_KEPT)), ids=[c[0] for c in _KEPT])
def test_a_write_through_views_that_keep_the_shard_reaches_the_tensor(world4, i: int) -> None:  # type: ignore[no-untyped-def]
    world4.run(_kept_write_reaches, i)


def test_an_in_place_view_of_a_detached_view(world4) -> None:  # type: ignore[no-untyped-def]
    world4.run(_in_place_view_of_detached_view)
