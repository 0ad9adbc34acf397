"""ZeRO-3 with parameters that get no gradient in a step, against one process.

World part (4 gloo ranks): a model whose forward takes one of two heads per step, skips a block
on some steps and never uses a spare layer trains 3 steps under ZeRO-3 (eager, ``overlap=True``,
and ``ap.to_static``) with SGD (momentum, weight decay) and AdamW. A parameter without a gradient
keeps ``grad`` None, as without ZeRO-3, so the optimizer leaves it alone (no weight decay, no
momentum): losses and every parameter match the one-process run (rtol 1e-5).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Shard

S0 = Shard(0)
STEPS = 3
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


class _Branchy(nn.Module):
    """``head`` picks one of two heads (the other gets no gradient); ``skip`` skips block 1 (a unit
    of its own, not gathered that step); ``spare`` is never used. ``body``, the heads and ``spare``
    share the model's own unit: used and unused parameters in one gather."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 12)
        self.blocks = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 12)])
        self.head0 = nn.Linear(12, 5)
        self.head1 = nn.Linear(12, 5)
        self.spare = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, head: int = 0, skip: bool = False) -> torch.Tensor:
        h = torch.relu(self.body(x))  # (8, 12)
        for k, block in enumerate(self.blocks):
            if not (skip and k == 1):
                h = torch.relu(block(h))
        return (self.head1 if head else self.head0)(h)  # (8, 5)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _unused(rank: int, opt_name: str, mode: str) -> dict[str, Any]:
    """Train STEPS steps under ZeRO-3 (``mode``: eager, overlap or static) and on one process;
    check equality; return which parameters had no gradient after each eager backward."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    ref = _Branchy()
    model = ap.shard_layer(copy.deepcopy(ref), mesh)
    opt = ap.shard_optimizer(OPTIMIZERS[opt_name](model.parameters()), ap.ShardingStage3(mesh, "dp", overlap=mode == "overlap"))
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    static = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if mode == "static" else None
    no_grad = []
    for k, (x, y) in enumerate(_batches()):
        head, skip = (0, False) if static is not None else (k % 2, k == 1)  # static: one path, one program
        xd, yd = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])
        if static is not None:
            loss = static(xd, yd)
        else:
            loss = F.cross_entropy(model(xd, head, skip), yd)
            loss.backward()
            no_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
            opt.step()
            opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x, head, skip), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _close(loss.detach().full_tensor(), ref_loss.detach(), f"{mode}/{opt_name} step {k} loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), f"{mode}/{opt_name} parameter {name}")
    return {"no_grad": no_grad, "params": sorted({str(p.placements) for p in model.parameters()})}


@pytest.mark.parametrize("mode", ["eager", "overlap", "static"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_zero3_leaves_parameters_without_gradients_alone(world4, opt_name: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    res = world4.run(_unused, opt_name, mode, timeout=300)[0]
    assert res["params"] == ["(Shard(0),)"]  # every parameter stored sharded
    if mode != "static":
        spare = ["spare.bias", "spare.weight"]
        block1 = ["blocks.1.bias", "blocks.1.weight"]
        assert res["no_grad"] == [
            sorted(["head1.bias", "head1.weight", *spare]),
            sorted(["head0.bias", "head0.weight", *block1, *spare]),
            sorted(["head1.bias", "head1.weight", *spare]),
        ], res["no_grad"]
