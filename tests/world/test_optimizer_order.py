"""An optimizer built before the layout trains the laid-out model (parameters swap in place).

``torch.optim.AdamW(model.parameters())`` before ``ap.shard_layer`` / ``ap.parallelize`` (or a
``shard_fn`` calling ``ap.shard_tensor``) holds the model's Parameter objects; the layout turns
each of those very objects into its DistTensor (``torch.utils.swap_tensors``), so the optimizer,
and ``ap.shard_optimizer`` built from it, train the distributed model — equal to one process.
Where the swap would be unsound (the optimizer already has state for the plain parameter, or the
parameter has weak references) every rank raises the same ``ValueError`` before anything moves.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(rank: int, how: str, steps: int = 3) -> float:
    model = _model()
    ref = copy.deepcopy(model)
    held = list(model.parameters())  # a reference the user kept (e.g. for gradient clipping)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # BEFORE the layout
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if how == "dp":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(opt)  # from the pre-layout optimizer
        batch = [ap.Shard(0)]
    elif how == "tp":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
        ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
        batch = [ap.Replicate()]
    else:  # shard_fn replacing parameters with ap.shard_tensor, ZeRO-3 from the pre-layout optimizer
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])

        def shard_fn(name: str, sub: nn.Module, m: ap.ProcessMesh) -> None:
            if isinstance(sub, nn.Linear):
                sub.weight = ap.shard_tensor(sub.weight, m, [ap.Replicate()])

        ap.shard_layer(model, mesh, shard_fn)
        opt = ap.shard_optimizer(opt, ap.ShardingStage3(mesh, "dp"))
        batch = [ap.Shard(0)]
    assert [p for g in opt.param_groups for p in g["params"]] == held or how != "tp"
    assert all(isinstance(p, ap.DistTensor) for p in held), [type(p) for p in held]
    assert all(a is b for a, b in zip(held, model.parameters()))
    worst = 0.0
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(ap.shard_tensor(x, mesh, batch)), ap.shard_tensor(y, mesh, batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(held, 1e9)  # the pre-layout list is the model's parameters
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.full_tensor().item() - ref_loss.item()) / abs(ref_loss.item()))
    for p, q in zip(model.parameters(), ref.parameters()):
        full = p.detach().full_tensor()
        worst = max(worst, ((full - q.detach()).norm() / q.detach().norm()).item())
    return worst


@pytest.mark.parametrize("how", ["dp", "tp", "shard_fn_zero3"])
def test_optimizer_built_before_the_layout_trains(world4: Any, how: str) -> None:
    assert max(world4.run(_train, how)) < 1e-5


def _unsound(rank: int, case: str) -> str:
    model = _model()
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    keep: Any = None
    if case == "state":
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # the optimizer has full-size moments for the plain parameters
        keep = opt
    else:
        keep = weakref.ref(model[0].weight)
    try:
        ap.shard_layer(model, mesh)
    except ValueError as e:
        plain = not any(isinstance(p, ap.DistTensor) for p in model.parameters())
        return f"{plain} {e}"
    finally:
        del keep
    return "no error"


@pytest.mark.parametrize("case, words", [("state", "already holds state"), ("weakref", "weak references")])
def test_unsound_swaps_raise_before_anything_moves(world4: Any, case: str, words: str) -> None:
    out = world4.run(_unsound, case)
    assert len(set(out)) == 1, out  # the same message on every rank
    assert out[0].startswith("True 0.weight: ") and words in out[0], out[0]
