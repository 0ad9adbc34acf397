"""Plain tensors meeting DistTensors are Replicate: the same full value on every rank
(docs/plain_tensors.md). A rank feeding its own plain batch (the DDP habit) used to train
silently wrong — each rank computed a different "replicated" gradient and the replicated
weights drifted apart. Now every rank raises the same ValueError naming the first differing
rank and what to use instead, in the default mode (the first calls of each op and module) and
with ``AUTOPARALLEL_CHECK=1`` (every call); equal plain tensors still train as before."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard


def _ddp_habit(rank: int, axis: str, every_call: bool, calls: int) -> dict[str, Any]:
    """``shard_layer`` a Linear (its parameters Replicate), feed each rank its own plain batch,
    take SGD steps. ``axis``: a mesh axis name of its own, so the set-up count starts afresh."""
    mesh = ap.ProcessMesh([0, 1], dim_names=[axis])
    torch.manual_seed(0)
    layer = ap.shard_layer(nn.Linear(4, 3), mesh)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    if every_call:
        os.environ["AUTOPARALLEL_CHECK"] = "1"
    error = ""
    steps = 0
    try:
        for step in range(calls):
            same = step < calls - 1  # the last call's batch is rank-dependent
            x = torch.full((2, 4), 1.0 if same else float(rank))
            loss = layer(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    except ValueError as e:
        error = str(e)
    finally:
        os.environ.pop("AUTOPARALLEL_CHECK", None)
    return {"error": error, "steps": steps, "weight": layer.weight.to_local().detach().clone()}


def test_a_per_rank_plain_batch_raises_the_same_error_on_every_rank(world2: Any) -> None:
    out = world2.run(_ddp_habit, "plain_first", False, 1)
    msgs = [o["error"] for o in out]
    assert msgs[0] and len(set(msgs)) == 1, msgs  # one error, the same on every rank
    assert "rank 0 has" in msgs[0] and "rank 1 has" in msgs[0], msgs[0]
    for fix in ("ap.shard_tensor(batch, mesh, [Shard(0)])", "ap.shard_dataloader", "ap.dtensor_from_local"):
        assert fix in msgs[0], msgs[0]
    assert torch.equal(out[0]["weight"], out[1]["weight"])  # nothing was stepped apart


def test_a_later_per_rank_batch_raises_on_a_module_that_runs_locally(world2: Any) -> None:
    """Calls 1-3 are equal (the Linear becomes a local region: later calls issue no op), call 4
    is rank-dependent: still caught, in the default mode as within the set-up calls."""
    out = world2.run(_ddp_habit, "plain_later", False, 4)
    assert [o["steps"] for o in out] == [3, 3]
    assert out[0]["error"] and out[0]["error"] == out[1]["error"], out
    assert "a plain argument of Linear" in out[0]["error"] or "aten." in out[0]["error"]
    assert torch.equal(out[0]["weight"], out[1]["weight"])


def test_every_call_is_checked_with_the_full_check(world2: Any) -> None:
    from autoparallel.runtime import agree

    calls = agree.SETUP_CALLS + 2  # past the set-up calls of this mesh
    out = world2.run(_ddp_habit, "plain_all", True, calls)
    assert [o["steps"] for o in out] == [calls - 1] * 2
    assert out[0]["error"] and out[0]["error"] == out[1]["error"]


def _same_values(rank: int) -> list[torch.Tensor]:
    """Equal plain tensors (an index, an addend) pass the check and compute as before."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["plain_same"])
    x = ap.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    y = x + torch.arange(8.0)
    z = y[torch.tensor([7, 0, 3])]
    w = ap.shard_tensor(torch.ones(4, 4), mesh, [Replicate()])
    big = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[:4, :4].contiguous()
    return [y.full_tensor(), z.full_tensor(), (w @ big).full_tensor()]


def test_equal_plain_tensors_compute_as_before(world2: Any) -> None:
    out = world2.run(_same_values)
    ref = [torch.arange(8.0) * 2, (torch.arange(8.0) * 2)[torch.tensor([7, 0, 3])],
           torch.ones(4, 4) @ torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[:4, :4]]
    for o in out:
        for got, want in zip(o, ref):
            assert torch.equal(got, want)


def _sampled(rank: int) -> tuple[str, str]:
    """A rank-dependent value deep inside a large plain tensor: the full check sees it."""
    from autoparallel.runtime import agree

    t = torch.zeros(100_000)
    t[12_345] = float(rank)
    return agree.checksum(t), agree.checksum(t, sample=True)


def test_the_full_check_reads_every_element(world2: Any) -> None:
    (full0, sampled0), (full1, sampled1) = world2.run(_sampled)
    assert full0 != full1  # AUTOPARALLEL_CHECK=1 compares every byte
    assert sampled0 == sampled1  # the default mode reads a sample (a per-rank batch differs everywhere)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _plain_parameter(rank: int, optim: str) -> dict[str, Any]:
    """Paddle code: fc1's weight is laid out by hand, fc2 stays plain; the optimizer is built
    before the forward. fc2's parameters become Replicate DistTensors at their first op, their
    gradients are the full ones, and training equals one process."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    model, ref = _TwoLayers(), _TwoLayers()
    ref.load_state_dict(model.state_dict())
    model.fc1.weight = ap.shard_tensor(model.fc1.weight, mesh, [Shard(0)])
    make = (lambda ps: torch.optim.AdamW(ps, lr=0.05)) if optim == "adamw" else (lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    losses = []
    for step in range(3):
        data = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        x = ap.shard_tensor(data, mesh, [Shard(0)])
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(data).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.full_tensor()), float(ref_loss)))
    laid = {n: (type(p).__name__, isinstance(p, nn.Parameter), list(p.placements)) for n, p in model.named_parameters()}
    diffs = {n: float((p.full_tensor() - dict(ref.named_parameters())[n]).abs().max())
             for n, p in model.named_parameters()}
    return {"losses": losses, "laid": laid, "diffs": diffs, "in_opt": all(isinstance(p, ap.DistTensor) for p in opt.param_groups[0]["params"])}


def test_a_plain_parameter_is_replicated_and_trains_as_one_process(world2: Any) -> None:
    for optim in ("sgd", "adamw"):
        for o in world2.run(_plain_parameter, optim):
            for got, want in o["losses"]:
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), o["losses"]
            assert max(o["diffs"].values()) < 1e-5, o["diffs"]
            assert o["laid"]["fc2.weight"] == ("DistTensor", True, [Replicate()])
            assert o["in_opt"]  # the optimizer holds the laid-out parameters


def _static_ddp_habit(rank: int, where: str) -> dict[str, Any]:
    """``ap.to_static`` of a laid-out Linear fed a per-rank plain batch: its first call captures
    the step on fake tensors, and the agreement check compares the real batches it was given."""
    mesh = ap.ProcessMesh([0, 1], dim_names=[f"static_{where}"])
    torch.manual_seed(0)
    layer = ap.shard_layer(nn.Linear(4, 3), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    dm = ap.to_static(layer, loss=lambda out, y: (out - y).square().mean(), optimizer=opt)
    x = torch.full((2, 4), float(rank)) if where == "input" else torch.ones(2, 4)
    y = torch.zeros(2, 3)
    error = ""
    try:
        dm(x, y)
    except ValueError as e:
        error = str(e)
    return {"error": error, "weight": layer.weight.to_local().detach().clone(), "programs": len(dm._programs)}


def test_a_per_rank_plain_batch_raises_in_a_static_capture(world2: Any) -> None:
    out = world2.run(_static_ddp_habit, "input")
    msgs = [o["error"] for o in out]
    assert msgs[0] and len(set(msgs)) == 1, msgs  # one error, the same on every rank, before any step
    assert "rank 0 has" in msgs[0] and "rank 1 has" in msgs[0] and "ap.shard_tensor" in msgs[0], msgs[0]
    assert torch.equal(out[0]["weight"], out[1]["weight"])


def test_an_equal_plain_batch_is_captured(world2: Any) -> None:
    out = world2.run(_static_ddp_habit, "same")
    assert [o["error"] for o in out] == ["", ""] and [o["programs"] for o in out] == [1, 1]
    assert torch.equal(out[0]["weight"], out[1]["weight"])
