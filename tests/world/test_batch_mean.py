"""The global mean of a loss over a sharded batch, and the optimizer's reduction plan.

A cross-entropy mean over a batch split on a mesh axis divides the global sum by the global
count of counted targets (``ignore_index`` and class weights make that count data-dependent):
the forward all-reduces (sum, count) in one collective and the loss is Replicate from there; the
backward needs no collective (its scale, ``1 / count``, is known) and the optimizer reduces the
Partial gradients in buckets. Every test compares with one process, with targets ignored
unevenly across ranks (so the global count differs from any per-rank count), and checks which
collectives ran where.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.optim.reduction import SlotLayout, plan_reduction
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

R, S0 = Replicate(), Shard(0)


def _batches(n: int, vocab: int = 16, ignore_all: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets) of 8 sequences; rank 0's quarter of the targets has many ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        d = torch.randint(0, vocab, (8, 9), generator=g)
        x, y = d[:, :-1].clone(), d[:, 1:].clone()
        y[:2, 1:] = -100          # the first dp rank's rows: mostly ignored
        y[5, ::3] = -100
        if ignore_all:
            y[:] = -100
        out.append((x, y))
    return out


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    from gpt_model import GPT, GPTConfig

    cfg = GPTConfig(vocab=16, seq=8, layers=1, width=16, heads=2)
    torch.manual_seed(seed)
    ref, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _assert_params_match(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---- data parallel with shard_optimizer ------------------------------------------------------------
def _dp(rank: int, read_early: str) -> dict[str, Any]:
    ref, model = _pair()
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    facts: dict[str, Any] = {}
    for x, y in _batches(3):
        with ap.CommDebugMode() as fwd:
            loss = _ce(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
        facts["loss_layout"] = tuple(loss.placements)
        if read_early == "all" or (read_early == "rank0" and rank == 0):
            with ap.CommDebugMode() as read:
                facts["early"] = float(loss.detach().full_tensor())  # Replicate already: no collective
            facts["read_comm"] = read.get_comm_counts()
        opt.zero_grad()
        with ap.CommDebugMode() as bwd:
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        facts["grad_layouts"] = {tuple(g.placements) for g in grads}
        with ap.CommDebugMode() as step:
            opt.step()
        facts["reduced_layouts"] = {(type(p.grad).__name__, tuple(p.grad.placements)) for p in model.parameters()}
        ref_loss = _ce(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):  # the reduced gradients
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    _assert_params_match(model, ref)
    facts["comm"] = (fwd.get_comm_counts(), bwd.get_comm_counts(), step.get_comm_counts())
    return facts


def test_data_parallel_mean_is_reduced_once_in_the_forward(world4: Any) -> None:
    results = world4.run(_dp, "none")
    r = results[0]
    assert r["loss_layout"] == (R,), r
    assert r["grad_layouts"] == {(Partial("sum"),)}
    # forward: the (sum, count) all-reduce; backward: nothing; step: the gradient bucket
    assert r["comm"] == ({"all_reduce": 1}, {}, {"all_reduce": 1}), r["comm"]
    assert r["reduced_layouts"] == {("DistTensor", (R,))}
    assert all(x["comm"] == r["comm"] for x in results)


@pytest.mark.parametrize("who", ["all", "rank0"])
def test_reading_the_loss_on_some_ranks_issues_nothing(world4: Any, who: str) -> None:
    """The loss is Replicate after the forward: reading it on some ranks only issues no
    collective (nothing to hang on), and the training matches one process on every rank."""
    results = world4.run(_dp, who)
    assert ("early" in results[1]) == (who == "all") and "early" in results[0]
    assert all(r["read_comm"] == {} for r in results if "early" in r)


class TwoHeads(nn.Module):
    """Head ``a`` feeds the cross-entropy, head ``b`` a squared mean. Called piece by piece
    (``heads``): the ops run on DistTensors through the dispatcher, not as a local region."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5), nn.Linear(8, 3)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


def _mixed(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref, model = TwoHeads(), TwoHeads()
    model.load_state_dict(ref.state_dict())
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
        y[:3] = -100
        a, b = model.heads(ap.shard_tensor(x, mesh, [S0]))
        loss = F.cross_entropy(a, ap.shard_tensor(y, mesh, [S0])) + (b * b).mean()
        ra, rb = ref.heads(x)
        ref_loss = F.cross_entropy(ra, y) + (rb * rb).mean()
        opt.zero_grad()
        loss.backward()
        with ap.CommDebugMode() as step:
            opt.step()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_params_match(model, ref)
    return {"step": step.get_comm_counts()}


def test_two_losses_gradients_share_one_bucket(world4: Any) -> None:
    r = world4.run(_mixed)[0]
    assert r["step"] == {"all_reduce": 1}, r["step"]  # one bucket for every parameter


def _zero(rank: int, stage: int) -> dict[str, Any]:
    ref, model = _pair(3)
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    shard_fn = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}[stage](mesh, "dp")
    # SGD: AdamW turns the summation-order rounding of near-zero gradients into lr-sized steps
    # (examples/train_gpt.py --help), which an elementwise comparison would flag
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4), shard_fn)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for x, y in _batches(3):
        loss = _ce(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = _ce(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_params_match(model, ref)
    return {}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_one_process_on_the_global_mean(world4: Any, stage: int) -> None:
    world4.run(_zero, stage)


# ---- without shard_optimizer ----------------------------------------------------------------------
def _plain_optimizer(rank: int, extra: str) -> dict[str, Any]:
    ref, model = _pair(1)
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = _batches(4)
    for k in range(0, 4, 2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for x, y in batches[k:k + 2]:  # two micro-batches accumulate before each step
            loss = _ce(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
            ref_loss = _ce(ref(x), y)
            if extra == "penalty":  # a second term on the replicated parameters
                loss = loss + 0.01 * sum((p * p).sum() for p in model.parameters())
                ref_loss = ref_loss + 0.01 * sum((p * p).sum() for p in ref.parameters())
            loss.backward()
            ref_loss.backward()
        if extra == "clip":
            n = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05)
            ref_n = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
            torch.testing.assert_close(n.full_tensor(), ref_n, rtol=1e-5, atol=1e-7)
        opt.step()
        ref_opt.step()
    _assert_params_match(model, ref)
    return {}


@pytest.mark.parametrize("extra", ["", "penalty", "clip"])
def test_accumulation_penalties_and_clipping_match_one_process(world4: Any, extra: str) -> None:
    world4.run(_plain_optimizer, extra)


# ---- edge cases ------------------------------------------------------------------------------------
def _edge(rank: int, case: str) -> dict[str, Any]:
    ref, model = _pair(2)
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    x, y = _batches(1, ignore_all=case == "all_ignored")[0]
    xs, ys = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])
    if case == "no_grad":
        with torch.no_grad():
            loss = _ce(model(xs), ys)
        ref_loss = _ce(ref(x), y)
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        return {"layout": tuple(loss.placements)}
    loss = _ce(model(xs), ys)
    ref_loss = _ce(ref(x), y)
    create_graph = case == "create_graph"
    loss.backward(create_graph=create_graph)
    ref_loss.backward(create_graph=create_graph)
    torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6, equal_nan=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    return {"layout": tuple(loss.placements)}


def test_without_grad_the_loss_is_the_same_replicated_mean(world4: Any) -> None:
    assert all(r["layout"] == (R,) for r in world4.run(_edge, "no_grad"))


def test_every_target_ignored_gives_nan_loss_and_zero_gradients(world4: Any) -> None:
    world4.run(_edge, "all_ignored")  # one process: loss 0/0 = nan, gradients exactly zero


def test_create_graph_backward_matches_one_process(world4: Any) -> None:
    world4.run(_edge, "create_graph")


# ---- the reduction plan (pure) ---------------------------------------------------------------------
def _spec(mesh: ap.ProcessMesh, placements: list[Any], shape: tuple[int, ...] = (8, 4)) -> DistSpec:
    return DistSpec(mesh, tuple(placements), shape, torch.float32)


@pytest.mark.pure  # single process, no world
def test_plan_buckets_each_axis_from_the_last_parameter() -> None:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    P = Partial("sum")
    specs = [_spec(mesh, [P, R]), _spec(mesh, [P, P]), _spec(mesh, [R, Shard(1)]), None, _spec(mesh, [P, R])]
    slots = [SlotLayout(None, None)] * 5
    plan = plan_reduction(specs, slots, scatters=False, bucket_bytes=1 << 20)
    # axis 0: one bucket, filled from the last parameter (the backward's first gradients);
    # axis 1: member 1, the one still Partial there
    assert [(op.axis, op.kind, op.members) for op in plan] == [(0, "ar", (4, 1, 0)), (1, "ar", (1,))]
    assert plan[0].targets == (_spec(mesh, [R, R]), _spec(mesh, [R, P]), _spec(mesh, [R, R]))
    # the same inputs give the same plan (every rank plans alike); small buckets split it
    assert plan_reduction(specs, slots, False, 1 << 20) == plan
    small = plan_reduction(specs, slots, False, 8 * 4 * 4)
    assert [op.members for op in small if op.axis == 0] == [(4,), (1,), (0,)]


@pytest.mark.pure  # single process, no world
def test_plan_scatters_the_data_parallel_axis_first_for_zero2() -> None:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    spec = _spec(mesh, [Partial("sum")])
    shard = _spec(mesh, [S0])
    plan = plan_reduction([spec, spec], [SlotLayout(0, shard)] * 2, scatters=True, bucket_bytes=1 << 20)
    assert [(op.kind, op.members, op.dims) for op in plan] == [("rs", (1, 0), (0, 0))]
    assert plan[0].targets == (shard, shard)
