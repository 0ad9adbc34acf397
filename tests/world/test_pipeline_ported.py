"""Pipelines whose stages pass several tensors, ported in spirit from torch.distributed.pipelining's tests.

torch's ``test_stage.py`` and ``test_schedule_multiproc.py`` run stages that return tuples and
take several arguments (the next stage gets the tuple's tensors as its arguments). Here, on a
4-rank gloo world: a ``split_sequential`` model whose blocks hand a tuple to the next block across
a stage boundary, stages of the user's own with ``forward(x, y)``, a tuple of inputs to
``Pipeline.step``, an integer tensor (indices, no gradient) crossing a boundary alone or in a
tuple, a last stage returning a tuple to the loss, and a stage writing its input in place
(``nn.ReLU(inplace=True)`` first) — under 1F1B, a zero-bubble and an interleaved schedule, eager
and ``static=True``. Each trains two SGD steps and compares every loss and parameter with the
same training in one process (fp32, rtol 1e-5).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard
from autoparallel.pipeline import Pipeline, Stage, split_sequential

D, BATCH, STEPS = 4, 8, 2
DP = [[0, 1], [2, 3]]  # two stage meshes of two data-parallel ranks
ONES = [[0], [1]]  # one-rank stage meshes (their modules run on local tensors); ranks 2, 3 idle


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square().mean()


def _pair_mse(y: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    return _mse(y[0], t) + _mse(y[1], t)


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Fork(nn.Module):
    """x -> (fc(x), 2 tanh(fc(x))): a tuple for the next block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, torch.tanh(y) * 2


class Carry(nn.Module):
    """(a, b) -> (tanh(fc(a)) + b, b): both tensors cross the next boundary too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ab
        return torch.tanh(self.fc(a)) + b, b


class Join(nn.Module):
    """(a, b) -> fc(a) * b."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, ab: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = ab
        return self.fc(a) * b


class WithIndex(nn.Module):
    """x -> (fc(x), (fc(x) > 0) as int64): an integer tensor crosses the boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, (h.detach() > 0).long()


class UseIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(2, D), nn.Linear(D, D)

    def forward(self, hi: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, i = hi
        return self.fc(h) + self.emb(i).sum(-2)


class Quantize(nn.Module):
    """x -> (fc(x) > 0) as int64: the stage's one output is an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) > 0).long()


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(2, D)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.emb(i).sum(-2)


MODELS = {
    "tuple-crosses": lambda: nn.Sequential(Lin(), Fork(), Carry(), Join()),
    "last-returns-tuple": lambda: nn.Sequential(Lin(), Lin(), Lin(), Fork()),
    "int-crosses": lambda: nn.Sequential(Lin(), WithIndex(), UseIndex(), Lin()),
    "only-int-crosses": lambda: nn.Sequential(Lin(), Quantize(), Embed(), Lin()),  # (no gradient crosses back)
    # the second stage starts by writing its input in place (a received input is autograd's leaf)
    "writes-its-input": lambda: nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.ReLU(inplace=True), nn.Linear(D, D)),
}


def _train_sequential(rank: int, kind: str, groups: list[list[int]], schedule: str, static: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = MODELS[kind]()
    model = copy.deepcopy(ref)
    torch.manual_seed(1)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    loss_fn = _pair_mse if kind == "last-returns-tuple" else _mse
    with torch.no_grad():
        ref_eval = loss_fn(ref(x.clone()), t).item()
    ref_opt, ref_losses = torch.optim.SGD(ref.parameters(), lr=0.1), []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), t)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    meshes = [ap.ProcessMesh(g, dim_names=["dp"]) for g in groups]
    chunks = 2 if schedule in ("Interleaved1F1B", "ZBV") else 1
    stages = split_sequential(model, meshes, None if chunks == 2 else ["2"], num_chunks=chunks,
                              placement="v" if schedule == "ZBV" else "loop")
    pipe = Pipeline(stages, loss_fn, num_microbatches=2, schedule=schedule, static=static)
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (static: the chunks passing several tensors run eagerly, and say so)
        with torch.inference_mode():  # an evaluation first (its layouts are cached for training too)
            evaluated = pipe.step(ap.shard_tensor(x.clone(), meshes[0], [Shard(0)]),
                                  ap.shard_tensor(t, stages[-1].mesh, [Shard(0)]))
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(pipe.step(ap.shard_tensor(x, meshes[0], [Shard(0)]),
                                    ap.shard_tensor(t, stages[-1].mesh, [Shard(0)])))
            opt.step()
    out = _compare(rank, model, ref, [evaluated, *losses], [ref_eval, *ref_losses])
    out["checked_losses"] -= 1 if out["checked_losses"] else 0
    return out


def _compare(rank: int, model: nn.Module, ref: nn.Module, losses: list[Any], ref_losses: list[float]) -> dict[str, Any]:
    bad = [name for (name, p), q in zip(model.named_parameters(), ref.parameters())
           if rank in p.process_mesh and not torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6)]
    mine = [float(v.full_tensor()) for v in losses if v.to_local().numel()]
    ok = len(mine) in (0, len(ref_losses)) and all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(mine, ref_losses))
    return {"bad_params": bad, "losses_ok": ok, "checked_losses": len(mine)}


def _check(results: list[dict[str, Any]], loss_ranks: list[int]) -> None:
    assert all(not r["bad_params"] for r in results), [r["bad_params"] for r in results]
    assert all(r["losses_ok"] for r in results)
    assert [r["checked_losses"] for r in results] == [STEPS if i in loss_ranks else 0 for i in range(4)]


@pytest.mark.parametrize("kind, groups, schedule, static", [
    ("tuple-crosses", DP, "1F1B", False),
    ("tuple-crosses", DP, "ZBV", False),
    ("tuple-crosses", ONES, "Interleaved1F1B", True),
    ("last-returns-tuple", ONES, "ZBH1", True),
    ("int-crosses", DP, "1F1B", True),
    ("only-int-crosses", ONES, "1F1B", False),
    ("writes-its-input", DP, "ZBH1", True),
    ("writes-its-input", ONES, "1F1B", False),
])
def test_stages_passing_tuples_match_single_process(world4, kind, groups, schedule, static):  # type: ignore[no-untyped-def]
    loss_ranks = groups[0] if schedule == "ZBV" else groups[-1]
    _check(world4.run(_train_sequential, kind, groups, schedule, static), loss_ranks)


# ---- stages of the user's own: forward(x, y) -> (a, b), a tuple of inputs to step ------------
class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x) + y, y * 2


class TwoIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(a) * b


def _train_own_stages(rank: int, schedule: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.ModuleList([TwoInTwoOut(), TwoIn()])
    model = copy.deepcopy(ref)
    torch.manual_seed(1)
    x, y, t = torch.randn(BATCH, D), torch.randn(BATCH, D), torch.randn(BATCH, D)
    ref_opt, ref_losses = torch.optim.SGD(ref.parameters(), lr=0.1), []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = _mse(ref[1](*ref[0](x, y)), t)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    meshes = [ap.ProcessMesh(g, dim_names=["dp"]) for g in DP]
    for block, mesh in zip(model, meshes):
        ap.shard_layer(block, mesh)
    stages = [Stage(model[0], meshes[0], name="first"), Stage(model[1], meshes[1], name="second")]
    pipe = Pipeline(stages, _mse, num_microbatches=2, schedule=schedule)
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
    for _ in range(STEPS):
        opt.zero_grad()
        inputs = (ap.shard_tensor(x, meshes[0], [Shard(0)]), ap.shard_tensor(y, meshes[0], [Shard(0)]))
        losses.append(pipe.step(inputs, ap.shard_tensor(t, meshes[1], [Shard(0)])))
        opt.step()
    return _compare(rank, model, ref, losses, ref_losses)


@pytest.mark.parametrize("schedule", ["FThenB", "ZBH1"])
def test_own_stages_with_several_arguments_match_single_process(world4, schedule):  # type: ignore[no-untyped-def]
    _check(world4.run(_train_own_stages, schedule), DP[-1])


# ---- a stage returning something that is not a tensor: the same error on every rank --------
class HalfTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(x), None


def _non_tensor_output(rank: int) -> None:
    meshes = [ap.ProcessMesh(g, dim_names=["dp"]) for g in DP]
    model = nn.Sequential(HalfTensor(), nn.Linear(D, D))
    pipe = Pipeline(split_sequential(model, meshes), _mse, num_microbatches=2)
    pipe.step(ap.shard_tensor(torch.zeros(BATCH, D), meshes[0], [Replicate()]),
              ap.shard_tensor(torch.zeros(BATCH, D), meshes[1], [Replicate()]))


def test_stage_returning_a_non_tensor_names_the_item(world4):  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match=r"stage 0 \(0\) must return DistTensors .* got NoneType in its output tuple \(item 1\)"):
        world4.run(_non_tensor_output, timeout=60)
