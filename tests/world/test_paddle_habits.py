"""Paddle's conventions where ours differed only by ceremony, each written as Paddle code would
be: a placement list shorter than the mesh is padded with Replicate; a leaf's ``.grad`` has the
leaf's own layout; ``unshard_dtensor`` of a parameter is a parameter; ``ShardingStage1(axis,
mesh)`` in Paddle's order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard


def _short_placements(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    a = ap.shard_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])  # y: Replicate
    b = ap.reshard(a, mesh, [Replicate()])
    c = ap.dtensor_from_local(torch.ones(2, 4), mesh, [Shard(0)])
    d = ap.ones([4, 4], mesh=mesh, placements=[Shard(1)])
    try:
        ap.shard_tensor(torch.zeros(4), mesh, [Shard(0), Replicate(), Replicate()])
        error = ""
    except ValueError as e:
        error = str(e)
    return {"a": list(a.placements), "b": list(b.placements), "c": list(c.placements), "d": list(d.placements),
            "full": a.full_tensor(), "error": error}


def test_a_short_placement_list_is_padded_with_replicate(world4: Any) -> None:
    for o in world4.run(_short_placements):
        assert o["a"] == [Shard(0), Replicate()] and o["b"] == [Replicate(), Replicate()]
        assert o["c"] == [Shard(0), Replicate()] and len(o["d"]) == 2
        assert torch.equal(o["full"], torch.arange(16.0).reshape(4, 4))
        assert "3 placements" in o["error"] and "2-d mesh" in o["error"], o["error"]


def _leaf_grads(rank: int, how: str) -> dict[str, Any]:
    """x (Replicate) @ w (column-sharded): x's gradient sums over the sharded columns, so each rank
    holds a summand (Partial); read back, ``x.grad`` is Replicate and the full gradient."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    torch.manual_seed(0)
    data, wd = torch.randn(4, 4), torch.randn(4, 8)
    if how == "stop_gradient":
        x = ap.shard_tensor(data, mesh, [Replicate()], stop_gradient=False)
    else:
        x = ap.shard_tensor(data, mesh, [Replicate()])
        x.requires_grad_()
    w = ap.shard_tensor(wd, mesh, [Shard(1)])
    (x @ w).square().sum().backward()
    ref = data.clone().requires_grad_()
    (ref @ wd).square().sum().backward()
    assert x.grad is not None and ref.grad is not None
    return {"placements": list(x.grad.placements), "local": x.grad.to_local().clone(), "ref": ref.grad}


@pytest.mark.parametrize("how", ["stop_gradient", "requires_grad_"])
def test_a_leaf_gradient_reads_back_in_the_leaf_layout(world2: Any, how: str) -> None:
    for o in world2.run(_leaf_grads, how):
        assert o["placements"] == [Replicate()]
        torch.testing.assert_close(o["local"], o["ref"])  # every rank holds the whole gradient


def _unshard_parameter(rank: int) -> tuple[bool, bool, bool, torch.Tensor]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    lin = nn.Linear(4, 6)
    full = lin.weight.detach().clone()
    lin.weight = ap.shard_tensor(lin.weight, mesh, [Shard(0)])
    back = ap.unshard_dtensor(lin.weight)
    return isinstance(back, nn.Parameter), isinstance(back, ap.DistTensor), back.requires_grad, back.detach() - full


def test_unshard_dtensor_of_a_parameter_is_a_parameter(world2: Any) -> None:
    for is_param, is_dist, grad, diff in world2.run(_unshard_parameter):
        assert is_param and not is_dist and grad and not diff.abs().max()
