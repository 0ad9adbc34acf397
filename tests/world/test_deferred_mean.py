"""The deferred batch mean (autoparallel.engine.deferred / autoparallel.engine.pending) and the reduction plan.

A cross-entropy mean over a batch split on a mesh axis starts one all-reduce of (sum, total
weight) in the forward and waits for it only when a value is needed. The backward runs on
unscaled gradients (no collective, no wait) and the optimizer scales each reduced bucket. Every
test compares with one process, with targets ignored unevenly across ranks (so the global
count differs from any per-rank count), and checks when values are pending and which
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
from autoparallel.engine.dtensor import PendingTensor
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
        facts["loss_pending"] = type(loss) is PendingTensor and loss.is_pending
        if read_early == "all" or (read_early == "rank0" and rank == 0):
            facts["early"] = float(loss.detach().full_tensor())  # waits for the started all-reduce only
        opt.zero_grad()
        with ap.CommDebugMode() as bwd:
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        facts["grads_pending"] = all(type(g) is PendingTensor and g.is_pending for g in grads)
        facts["grad_layouts"] = {tuple(g.placements) for g in grads}
        with ap.CommDebugMode() as step:
            opt.step()
        facts["reduced_layouts"] = {  # reduced gradients are plain values: nothing left pending
            (isinstance(p.grad, ap.DistTensor), getattr(p.grad, "is_pending", False), tuple(p.grad.placements))
            for p in model.parameters()
        }
        ref_loss = _ce(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):  # the reduced gradients, scaled
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    _assert_params_match(model, ref)
    facts["comm"] = (fwd.get_comm_counts(), bwd.get_comm_counts(), step.get_comm_counts())
    return facts


def test_data_parallel_mean_is_deferred_to_the_gradient_reduction(world4: Any) -> None:
    results = world4.run(_dp, "none")
    r = results[0]
    assert r["loss_pending"] and r["grads_pending"], r
    assert r["grad_layouts"] == {(Partial("sum"),)}
    # forward: the (sum, count) all-reduce, started; backward: nothing; step: the gradient bucket
    assert r["comm"] == ({"all_reduce": 1}, {}, {"all_reduce": 1}), r["comm"]
    assert r["reduced_layouts"] == {(True, False, (R,))}
    assert all(x["comm"] == r["comm"] for x in results)


@pytest.mark.parametrize("who", ["all", "rank0"])
def test_reading_the_loss_before_backward_waits_without_hanging(world4: Any, who: str) -> None:
    """A read on some ranks only waits for the all-reduce every rank started: no hang, and the
    gradients are still scaled in the optimizer on every rank (the same arithmetic everywhere)."""
    results = world4.run(_dp, who)
    assert all(r["grads_pending"] for r in results)
    assert ("early" in results[1]) == (who == "all") and "early" in results[0]


class TwoHeads(nn.Module):
    """Head ``a`` feeds the cross-entropy (pending gradients), head ``b`` a squared mean (not).
    Called piece by piece (``heads``): the ops run on DistTensors, so the pending gradient
    passes through the dispatcher's linear ops (mm, t, sum) rather than a local region."""

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
        pending = {n: type(p.grad) is PendingTensor and p.grad.is_pending for n, p in model.named_parameters()}
        with ap.CommDebugMode() as step:
            opt.step()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_params_match(model, ref)
    return {"pending": pending, "step": step.get_comm_counts()}


def test_pending_and_other_gradients_share_one_bucket(world4: Any) -> None:
    r = world4.run(_mixed)[0]
    assert r["pending"]["a.weight"] and r["pending"]["a.bias"], r["pending"]
    assert not r["pending"]["b.weight"] and not r["pending"]["trunk.weight"], r["pending"]
    assert r["step"] == {"all_reduce": 1}, r["step"]  # one bucket; only its pending members scaled


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
def test_zero_stages_scale_the_deferred_mean(world4: Any, stage: int) -> None:
    """Stage 2 scales the reduce-scattered bucket; stage 3 reduces inside the backward (each
    unit's gradients are resolved there); every stage matches one process."""
    world4.run(_zero, stage)


# ---- without shard_optimizer: the pending gradients resolve where they are used -------------------
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
            if extra == "penalty":  # a second term whose gradient is not pending
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
    return {"pending_left": any(type(p.grad) is PendingTensor and p.grad.is_pending for p in model.parameters())}


@pytest.mark.parametrize("extra", ["", "penalty", "clip"])
def test_accumulation_penalties_and_clipping_resolve_exactly(world4: Any, extra: str) -> None:
    results = world4.run(_plain_optimizer, extra)
    assert not any(r["pending_left"] for r in results)  # the optimizer's own ops resolved them


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
        return {"pending": type(loss) is PendingTensor}
    loss = _ce(model(xs), ys)
    ref_loss = _ce(ref(x), y)
    create_graph = case == "create_graph"
    loss.backward(create_graph=create_graph)
    ref_loss.backward(create_graph=create_graph)
    torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6, equal_nan=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    return {"pending": any(type(p.grad) is PendingTensor and p.grad.is_pending for p in model.parameters())}


def test_without_grad_the_loss_is_computed_at_once(world4: Any) -> None:
    assert not any(r["pending"] for r in world4.run(_edge, "no_grad"))


def test_every_target_ignored_gives_nan_loss_and_zero_gradients(world4: Any) -> None:
    world4.run(_edge, "all_ignored")  # one process: loss 0/0 = nan, gradients exactly zero


def test_create_graph_backward_scales_at_once(world4: Any) -> None:
    """A differentiable backward must not carry a pending scale through the graph it records."""
    results = world4.run(_edge, "create_graph")
    assert not any(r["pending"] for r in results)


# ---- the reduction plan (pure) ---------------------------------------------------------------------
def _spec(mesh: ap.ProcessMesh, placements: list[Any], shape: tuple[int, ...] = (8, 4)) -> DistSpec:
    return DistSpec(mesh, tuple(placements), shape, torch.float32)


@pytest.mark.pure  # single process, no world
def test_plan_buckets_pending_gradients_with_the_others() -> None:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    P = Partial("sum")
    specs = [_spec(mesh, [P, R]), _spec(mesh, [P, P]), _spec(mesh, [R, Shard(1)]), None, _spec(mesh, [P, R])]
    stats = [0, 0, 0, None, None]
    slots = [SlotLayout(None, None)] * 5
    plan = plan_reduction(specs, stats, slots, scatters=False, bucket_bytes=1 << 20)
    # axis 0: one bucket, filled from the last parameter (the backward's first gradients); pending
    # members (1, 0) are scaled after it, 4 is not pending; axis 1: member 1 again, scaled
    # already by its first collective
    assert [(op.axis, op.kind, op.members, op.stats) for op in plan] == [
        (0, "ar", (4, 1, 0), (None, 0, 0)), (1, "ar", (1,), (None,))]
    assert plan[0].stat is None and plan[1].stat is None
    assert plan[0].targets == (_spec(mesh, [R, R]), _spec(mesh, [R, P]), _spec(mesh, [R, R]))
    # the same inputs give the same plan (every rank plans alike); small buckets split it
    assert plan_reduction(specs, stats, slots, False, 1 << 20) == plan
    small = plan_reduction(specs, stats, slots, False, 8 * 4 * 4)
    assert [(op.members, op.stat) for op in small if op.axis == 0] == [((4,), None), ((1,), 0), ((0,), 0)]


@pytest.mark.pure  # single process, no world
def test_plan_scatters_the_data_parallel_axis_first_for_zero2() -> None:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    spec = _spec(mesh, [Partial("sum")])
    shard = _spec(mesh, [S0])
    plan = plan_reduction([spec, spec], [0, 0], [SlotLayout(0, shard)] * 2, scatters=True, bucket_bytes=1 << 20)
    assert [(op.kind, op.members, op.dims, op.stat) for op in plan] == [("rs", (1, 0), (0, 0), 0)]
    assert plan[0].targets == (shard, shard)


# ---- the table of ops a pending gradient passes through unscaled (pure) ----------------------------
def _samples() -> dict[Any, tuple[Any, ...]]:
    """One call per op of ``LINEAR``/``JOINT`` (float64 CPU tensors)."""
    a = torch.ops.aten
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, y = r(3, 4, 5), r(3, 4, 5)
    logits = r(6, 7)
    ln_x = r(6, 8)
    mean, rstd = ln_x.mean(1, keepdim=True), (ln_x.var(1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    q, k, v = r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)
    out, lse = a._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    return {
        a.view.default: (x, [12, 5]), a._unsafe_view.default: (x, [3, 20]), a.expand.default: (r(3, 1), [3, 4]),
        a.t.default: (r(3, 4),), a.transpose.int: (x, 0, 2), a.permute.default: (x, [2, 0, 1]),
        a.squeeze.default: (r(3, 1, 4),), a.squeeze.dim: (r(3, 1, 4), 1), a.squeeze.dims: (r(3, 1, 4), [1]),
        a.unsqueeze.default: (x, 1), a.slice.Tensor: (x, 1, 1, 3), a.select.int: (x, 2, 3), a.alias.default: (x,),
        a.detach.default: (x,), a.clone.default: (x,), a._to_copy.default: (x,), a.neg.default: (x,),
        a.mul.Scalar: (x, 2.5), a.div.Scalar: (x, 3.0), a.div.Tensor: (x, y.abs() + 1), a.sum.default: (x,),
        a.sum.dim_IntList: (x, [0, 2]),
        a._log_softmax_backward_data.default: (logits, torch.log_softmax(logits, 1), 1, torch.float64),
        a._softmax_backward_data.default: (logits, torch.softmax(logits, 1), 1, torch.float64),
        a.gelu_backward.default: (x, y), a.threshold_backward.default: (x, y, 0.0),
        a.native_dropout_backward.default: (x, y > 0, 2.0),
        a.embedding_dense_backward.default: (r(5, 3), torch.tensor([0, 2, 2, 4, 1]), 6, -1, True),
        a.native_layer_norm_backward.default: (r(6, 8), ln_x, [8], mean, rstd, r(8), r(8), [True, True, True]),
        a._scaled_dot_product_flash_attention_for_cpu_backward.default: (r(2, 2, 5, 4), q, k, v, out, lse, 0.0, False),
        a.mm.default: (r(3, 4), r(4, 5)), a.bmm.default: (r(2, 3, 4), r(2, 4, 5)), a.mul.Tensor: (x, y),
        a.add.Tensor: (x, y), a.sub.Tensor: (x, y),
    }


def _outs(o: Any) -> list[torch.Tensor]:
    return [t for t in (o if isinstance(o, (tuple, list)) else [o]) if isinstance(t, torch.Tensor)]


@pytest.mark.pure  # single process, no world
def test_every_listed_op_is_linear_in_its_listed_arguments() -> None:
    """op(.., s * x_k, ..) == s * op(.., x_k, ..) for each listed position (each alone for
    LINEAR; all together for JOINT): what lets a scale wait until the optimizer."""
    from autoparallel.engine.pending import JOINT, LINEAR

    samples = _samples()
    assert set(LINEAR) | set(JOINT) <= set(samples), set(LINEAR) | set(JOINT) - set(samples)
    for op in list(LINEAR) + list(JOINT):
        args = samples[op]
        groups = [[k] for k in LINEAR[op]] if op in LINEAR else [list(JOINT[op])]
        base = _outs(op(*args))
        for ks in groups:
            for s in (-1.7, 0.3):
                scaled = tuple(a * s if k in ks else a for k, a in enumerate(args))
                for got, want in zip(_outs(op(*scaled)), base):
                    torch.testing.assert_close(got, want * s, rtol=1e-9, atol=1e-12, msg=lambda m, op=op, ks=ks: f"{op} {ks}: {m}")
