"""Elementwise losses under data parallelism equal one process, without gathering the batch.

``F.mse_loss``, ``F.binary_cross_entropy_with_logits``, ``F.smooth_l1_loss`` (and the others of
``spmd_rules.losses``) had no rule: they ran replicated (the batch-sharded prediction and target
gathered, a warning), forward and backward. Now each rank sums its own terms (the mean over the
global count): the loss is Partial(sum), reduced when it is read.
"""

from __future__ import annotations

from typing import Any

import pytest


def _train(rank: int, loss_name: str) -> dict[str, Any]:
    import warnings

    import torch
    import torch.nn.functional as F

    import autoparallel as ap

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Softplus(), torch.nn.Linear(16, 3))

    def loss_fn(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if loss_name == "mse":
            return F.mse_loss(pred, y)
        if loss_name == "bce":
            return F.binary_cross_entropy_with_logits(pred, (y > 0).to(pred.dtype), pos_weight=torch.tensor([1.0, 2.0, 0.5]))
        if loss_name == "smooth_l1_sum":
            return F.smooth_l1_loss(pred, y, reduction="sum", beta=0.5)
        return F.logsigmoid(pred * y).mean().neg()  # a DPO-style loss

    model, ref = build(), build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before the layout, as users do
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    ours, theirs, comms = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            with ap.CommDebugMode() as comm:
                loss = loss_fn(model(ap.shard_tensor(x, mesh, [ap.Shard(0)])), ap.shard_tensor(y, mesh, [ap.Shard(0)]))
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
            ref_loss = loss_fn(ref(x), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            ref_sched.step()
            ours.append(float(loss.full_tensor()))
            theirs.append(float(ref_loss))
            comms.append(comm.get_comm_counts())
    err = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"ours": ours, "theirs": theirs, "err": err, "comms": comms,
            "warnings": [str(w.message) for w in caught if "replicated" in str(w.message)]}


@pytest.mark.parametrize("loss_name", ["mse", "bce", "smooth_l1_sum", "logsigmoid"])
def test_elementwise_losses_train_as_one_process_on_batch_shards(world2, loss_name: str) -> None:  # type: ignore[no-untyped-def]
    for res in world2.run(_train, loss_name):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["ours"], res["theirs"])), res
        assert res["err"] < 1e-5, res["err"]
        assert not res["warnings"], res["warnings"]
        # the gradient bucket's all-reduce alone: the batch never gathered, and the loss stays
        # Partial(sum) (its backward needs no sum) until it is read (``full_tensor``, outside)
        assert res["comms"][-1] == {"all_reduce": 1}, res["comms"]
