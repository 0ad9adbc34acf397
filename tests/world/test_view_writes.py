"""In-place writes through chains of views of a DistTensor (4 ranks), against plain torch.

A view whose layout had to change (slicing a sharded dim, flattening a dim-1 shard) holds a
moved copy of the shard, not a window onto it: the engine marks it detached, and a write through
it is carried back into the original (the view's scatter and a copy), through every detached view
of a chain (``x[1:4][1:2].fill_(-1)`` on a ``Shard(0)`` ``x`` was once a silent no-op, then an
error). The view is taken again before a write that reads it, so writes to the original made since
are seen. Gradients through such writes equal plain torch's. A detached view taken by an op whose
write cannot be carried back (``unbind``, a view reshaped in place) raises on every rank. Chains
whose views all keep the shard write through as plain torch does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import autoparallel as ap

Chain = Callable[[torch.Tensor], Any]

# each: (name, shape, 2-D mesh?, placements, the chain)
_CARRIED: list[tuple[str, tuple[int, ...], bool, tuple[str, ...], Chain]] = [
    ("slice_slice", (4, 4), False, ("S0",), lambda x: x[1:4][1:2].fill_(-1)),
    ("flat_slice", (5, 3), False, ("S0",), lambda x: x.view(-1)[2:5].fill_(-1)),
    ("reshape_slice_mul", (5, 3), False, ("S0",), lambda x: x.reshape(-1)[1:4].mul_(2)),
    ("view_view_select", (5, 3), False, ("S0",), lambda x: x.view(-1).view(x.shape)[0].fill_(-1)),
    ("slice_detach", (4, 4), False, ("S0",), lambda x: x[1:3].detach()[0].fill_(-1)),
    ("slice_slice_2d", (5, 4), True, ("R", "S0"), lambda x: x[1:4][1:2].fill_(-1)),
    ("flat_slice_2d", (5, 4), True, ("S0", "S0"), lambda x: x.view(-1)[2:5].fill_(-1)),
    ("s1_setitem", (4, 8), False, ("S1",), lambda x: x.__setitem__((slice(None), slice(2, 5)), -3.0)),
    ("s0_select_add", (5, 4), False, ("S0",), lambda x: x[3].add_(7)),
    ("s1_t_select", (4, 6), False, ("S1",), lambda x: x.t()[3].mul_(-2)),
    ("s1_diagonal", (5, 5), False, ("S1",), lambda x: x.diagonal().zero_()),
    ("s1_permute_slice", (2, 3, 8), False, ("S2",), lambda x: x.permute(2, 0, 1)[1:6].add_(1)),
    ("s0_setitem_2d", (6, 4), True, ("S0", "S1"), lambda x: x.__setitem__(slice(1, 4), 0.5)),
]
_RAISES: list[tuple[str, tuple[int, ...], bool, tuple[str, ...], Chain]] = [
    ("unbind", (4, 4), False, ("S0",), lambda x: x.unbind(0)[1].fill_(-1)),
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
    places = {"R": ap.Replicate(), "S0": ap.Shard(0), "S1": ap.Shard(1), "S2": ap.Shard(2)}
    t = torch.arange(float(torch.tensor(shape).prod())).reshape(shape) + 1
    return t, ap.shard_tensor(t.clone(), mesh, [places[n] for n in names])


def _write_carried(rank: int, i: int) -> None:
    _kept_write_reaches(rank, i, _CARRIED)


def _stale_view_written(rank: int) -> None:
    """The original written after the view was taken, then the view: both writes land."""
    for names in (("S0",), ("S1",)):
        t, x = _setup((4, 6), False, names)
        ref = t.clone()
        v, rv = x[1:3, 2:5], ref[1:3, 2:5]
        x.add_(1)
        ref.add_(1)
        v.mul_(3)
        rv.mul_(3)
        assert torch.equal(x.full_tensor(), ref)


def _gradient_through_carried_write(rank: int) -> None:
    """``h[:, 2:5] = b * 3`` on a column-sharded activation: the gradients of the input and of ``b``."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    torch.manual_seed(0)
    full, b = torch.randn(4, 8), torch.randn(4, 3)
    for place in (ap.Shard(1), ap.Shard(0)):
        w = ap.shard_tensor(full.clone(), mesh, [place]).requires_grad_()
        rw = full.clone().requires_grad_()
        bd, rb = b.clone().requires_grad_(), b.clone().requires_grad_()
        h, rh = w * 2, rw * 2
        h[:, 2:5] = bd * 3
        rh[:, 2:5] = rb * 3
        h.sin().sum().backward()
        rh.sin().sum().backward()
        torch.testing.assert_close(w.grad.full_tensor(), rw.grad)
        assert bd.grad is not None and rb.grad is not None
        torch.testing.assert_close(bd.grad, rb.grad)


def _lost_write_raises(rank: int, i: int) -> None:
    _, shape, two_d, names, chain = _RAISES[i]
    t, x = _setup(shape, two_d, names)
    with pytest.raises(RuntimeError, match="in-place write to a view of a DistTensor whose layout had to change"):
        chain(x)
    assert torch.equal(x.full_tensor(), t)  # nothing written, on any rank


def _kept_write_reaches(rank: int, i: int, cases: Any = None) -> None:
    _, shape, two_d, names, chain = (cases or _KEPT)[i]
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


@pytest.mark.parametrize("i", range(len(_CARRIED)), ids=[c[0] for c in _CARRIED])
def test_a_write_through_a_detached_view_is_carried_back(world4, i: int) -> None:  # type: ignore[no-untyped-def]
    world4.run(_write_carried, i)


def test_a_detached_view_is_taken_again_before_a_write(world4) -> None:  # type: ignore[no-untyped-def]
    world4.run(_stale_view_written)


def test_gradients_through_a_carried_write_equal_plain_torch(world4) -> None:  # type: ignore[no-untyped-def]
    world4.run(_gradient_through_carried_write)


@pytest.mark.parametrize("i", range(len(_RAISES)), ids=[c[0] for c in _RAISES])
def test_a_write_that_cannot_be_carried_back_raises(world4, i: int) -> None:  # type: ignore[no-untyped-def]
    world4.run(_lost_write_raises, i)


@pytest.mark.parametrize("i", range(len(_KEPT)), ids=[c[0] for c in _KEPT])
def test_a_write_through_views_that_keep_the_shard_reaches_the_tensor(world4, i: int) -> None:  # type: ignore[no-untyped-def]
    world4.run(_kept_write_reaches, i)


def test_an_in_place_view_of_a_detached_view(world4) -> None:  # type: ignore[no-untyped-def]
    world4.run(_in_place_view_of_detached_view)
