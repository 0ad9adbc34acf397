"""Local regions (autoparallel.regions) and the optimizer's local step (autoparallel.optim.local_step).

A module call runs as its captured program on the local shards, collectives included, unless the
capture refuses it. Each test compares the region run with the DistTensor run (regions disabled)
and, where the layout allows it, with one process: values, gradients and their layouts, the
report and its reasons, and the collectives.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.regions import disable_local_regions, enable_local_regions, local_regions_report, objects

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

R, S0 = Replicate(), Shard(0)


# ---- modules ------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GlobalSize(MLP):
    """Scales by the batch size read from the input: global on DistTensors, local on shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1.0 / x.shape[0])


class ScaledByParameter(MLP):
    """Scales by a Python float read from a replicated parameter (the same value on a shard,
    but ``item()`` is decided as a fallback, whatever the layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float(self.scale)


class ScaledByPeak(MLP):
    """Scales by a Python float read from the batch: the whole batch's on DistTensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / float(x.abs().amax())


class BatchCentred(MLP):
    """Subtracts the batch mean: needs the whole batch (a reduction across shards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h - h.mean(0))


class WithDropout(MLP):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x))


class TwoOutputs(MLP):
    """A sharded output beside a replicated one (the bias norm)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), self.fc2.bias * 2


class PosAdd(nn.Module):
    """x + a learned position table: the table's region output is Replicate, its gradient
    arrives Partial (summed over the batch shards) or sharded (sequence shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.pos(torch.arange(x.shape[1])))


class RotaryTables(nn.Module):
    """Cosine and sine tables of the positions, as transformers' rotary embeddings make them:
    the hidden state is an argument only for its dtype (no op reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1, 0.01]), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Rotated(nn.Module):
    """A projection rotated by position (rotary tables from a batch-sharded hidden state), centred
    over the batch: the root needs the whole batch, the tables are a region of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.rot, self.proj = RotaryTables(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rot(x, torch.arange(x.shape[1]))
        h = self.proj(x)
        y = h * cos + h.flip(-1) * sin
        return y - y.mean(0)


# ---- helpers ------------------------------------------------------------------------------------
class SeqNet(nn.Module):
    """Tokens [b, t] -> embedding, attention-like mixing over t, a head; any length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(11, 8), nn.Linear(8, 24), nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        q, k, v = self.qkv(self.emb(x)).split(8, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / 8 ** 0.5, dim=-1)
        return self.out((a @ v).reshape(b * t, 8))


class LengthBranch(SeqNet):
    """Past 9 tokens it centres over the batch: with the batch sharded, no longer a region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y - y.mean(0, keepdim=True) if x.shape[1] > 9 else y


class RMSNormed(MLP):
    """An RMS norm written as Llama's (``x.pow(2).mean(-1, keepdim=True)``) after the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return self.gain * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])


def _run(model: nn.Module, x: torch.Tensor, placements: list[Any], local: bool, steps: int = 3) -> dict[str, Any]:
    """SGD steps on the DistTensor model; returns outputs, grads (with layouts), params, report."""
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    torch.manual_seed(1)  # dropout masks: the same draws on both runs
    if not local:
        disable_local_regions(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    out: dict[str, Any] = {"losses": [], "grad_layouts": {}, "comm": []}
    for _ in range(steps):
        xs = ap.shard_tensor(x, mesh, placements)
        with ap.CommDebugMode() as fwd:
            y = model(xs)
        y = y[0] if isinstance(y, tuple) else y
        loss = (y * y).mean()
        opt.zero_grad()
        with ap.CommDebugMode() as bwd:
            loss.backward()
        out["grad_layouts"] = {n: list(p.grad.placements) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        out["losses"].append(float(loss.detach().full_tensor()))
        out["comm"].append((fwd.get_comm_counts(), bwd.get_comm_counts()))
    out["params"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    out["report"] = local_regions_report(model)
    return out


def _compare(rank: int, cls: Any, x_shape: tuple[int, ...], placements: list[Any], *args: Any) -> dict[str, Any]:
    """The same training with and without regions; returns the region run's report and facts."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*x_shape, generator=g)
    torch.manual_seed(0)
    a = cls(*args)
    torch.manual_seed(0)
    b = cls(*args)
    plain, local = _run(a, x, placements, local=False), _run(b, x, placements, local=True)
    assert local["losses"] == pytest.approx(plain["losses"], rel=1e-6), (local["losses"], plain["losses"])
    for n, p in plain["params"].items():
        torch.testing.assert_close(local["params"][n], p, rtol=1e-6, atol=1e-7)
    return {"report": local["report"], "grad_layouts": local["grad_layouts"], "plain_grad_layouts": plain["grad_layouts"],
            "comm": local["comm"], "plain_comm": plain["comm"]}


# ---- verdicts -----------------------------------------------------------------------------------
def test_batch_parallel_mlp_runs_locally(world4: Any) -> None:
    results = world4.run(_compare, MLP, (8, 6), [S0])
    r = results[0]
    assert r["report"] == {"<root>": ["local"]}
    assert all(x["report"] == r["report"] for x in results)  # every rank reached the same verdict
    # the replicated parameters' gradients arrive Partial over the batch shards, as on DistTensors
    assert r["grad_layouts"] == r["plain_grad_layouts"] == {n: [Partial("sum")] for n in r["grad_layouts"]}
    assert r["comm"][-1][0] == {}  # forward: nothing moved


def test_a_mean_over_whole_rows_runs_locally(world4: Any) -> None:
    # the mean over an unsplit dim is the op itself on the shard (the plain run's aten call):
    # an RMS norm on batch-sharded rows is a region (the global-count division, where a reduced
    # dim is split, stays for batch means)
    r = world4.run(_compare, RMSNormed, (8, 6), [S0])[0]
    assert r["report"] == {"<root>": ["local"]}, r["report"]


@pytest.mark.parametrize("cls, args", [
    (GlobalSize, ()),       # x.shape[0] is the global batch: the program holds the number
    (BatchCentred, ()),     # the batch mean needs every shard: its all-reduce is in the program
    (WithDropout, (0.5,)),  # the single-device mask, drawn as on DistTensors
    (TwoOutputs, ()),       # a sharded output beside a replicated one
    (Rotated, ()),          # rotary tables from an input read for its dtype only, then a batch mean
])
def test_modules_that_move_data_or_read_global_sizes_are_captured_with_it(world4: Any, cls: Any,
                                                                          args: tuple[Any, ...]) -> None:
    results = world4.run(_compare, cls, (8, 5, 6) if cls is Rotated else (8, 6), [S0], *args)  # (equal: in _compare)
    assert results[0]["report"] == {"<root>": ["local"]}, results[0]["report"]
    assert all(x["report"] == results[0]["report"] for x in results)
    if cls is BatchCentred:  # the mean's all-reduce, in the forward and in the backward, as op by op
        assert results[0]["comm"] == results[0]["plain_comm"], (results[0]["comm"], results[0]["plain_comm"])


@pytest.mark.parametrize("cls", [ScaledByPeak, ScaledByParameter])
def test_a_python_value_read_from_a_tensor_refuses_the_module(world4: Any, cls: Any) -> None:
    # a value read from the whole batch, or from a replicated parameter: a program cannot hold it
    results = world4.run(_compare, cls, (8, 6), [S0])
    report = results[0]["report"]
    assert len(report["<root>"]) == 1 and report["<root>"][0].startswith("refused"), report
    assert "reads a Python value" in report["<root>"][0], report
    assert all(x["report"] == report for x in results)


def test_children_of_a_refused_module_become_regions(world4: Any) -> None:
    report = world4.run(_compare, ScaledByPeak, (8, 6), [S0])[0]["report"]
    assert report["fc1"] == ["local"] and report["fc2"] == ["local"], report


def test_dropout_without_probability_is_local(world4: Any) -> None:
    assert world4.run(_compare, WithDropout, (8, 6), [S0], 0.0)[0]["report"]["<root>"] == ["local"]


def test_uneven_batch_is_refused(world4: Any) -> None:
    report = world4.run(_compare, MLP, (7, 6), [S0])[0]["report"]
    assert "split unevenly" in report["<root>"][0], report


def test_replicated_input_is_a_region_and_trains(world4: Any) -> None:
    # Replicate everywhere: a region (the same computation on every rank), equal to op by op (in
    # _compare). Its backward takes the output's gradient as a summand (what a value replicated
    # along an axis most often gets back from work split along it: a position table's), so the
    # parameters' gradients are Partial(sum), reduced by the optimizer, where op by op they are whole
    r = world4.run(_compare, MLP, (8, 6), [R])[0]
    assert r["report"] == {"<root>": ["local"]}
    assert r["plain_grad_layouts"] == {n: [R] for n in r["plain_grad_layouts"]}, r["plain_grad_layouts"]
    assert r["grad_layouts"] == {n: [Partial("sum")] for n in r["grad_layouts"]}, r["grad_layouts"]


def test_replicated_output_gradient_stays_partial(world4: Any) -> None:
    # The position table is computed replicated; its gradient is a sum over the batch shards.
    # The region backward runs on the summands (Partial) instead of all-reducing them.
    r = world4.run(_compare, PosAdd, (8, 8, 4), [S0])[0]
    assert r["report"]["<root>"] == ["local"], r["report"]
    assert r["grad_layouts"]["pos.weight"] == [Partial("sum")], r["grad_layouts"]
    assert r["comm"][-1][1] == {}, r["comm"][-1]  # backward: no collective


def test_sequence_sharded_positions_slice_the_table_without_a_gather(world4: Any) -> None:
    # Sequence shards: the position table (replicated) is added to a sequence-sharded input; the
    # program slices it, and the table's gradient is a zero-padded summand: no gather
    r = world4.run(_compare, PosAdd, (2, 8, 4), [Shard(1)])[0]
    assert r["report"]["<root>"] == ["local"], r["report"]
    assert "all_gather" not in r["comm"][-1][1], r["comm"][-1]


# ---- signatures ---------------------------------------------------------------------------------
def _signatures(rank: int) -> dict[str, list[str]]:
    mesh = _mesh()
    torch.manual_seed(0)
    model = ap.shard_layer(MLP(), mesh)
    x = torch.randn(8, 6)
    for placements in ([S0], [S0], [R]):
        model(ap.shard_tensor(x, mesh, placements))
    model.eval()
    with torch.no_grad():
        model(ap.shard_tensor(x, mesh, [S0]))
    return local_regions_report(model)


def test_each_signature_is_checked_once(world4: Any) -> None:
    report = world4.run(_signatures)[0]
    # train/S(0), train/R, eval+no_grad/S(0): three verdicts for four calls
    assert report == {"<root>": ["local", "local", "local"]}, report


@pytest.mark.pure  # single process, no world
def test_switches() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    model = ap.shard_layer(MLP(), mesh)
    assert "forward" in model.__dict__
    disable_local_regions(model)
    assert "forward" not in model.__dict__ and local_regions_report(model) == {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPARALLEL_LOCAL_REGIONS", "0")
        enable_local_regions(model)
        assert "forward" not in model.__dict__
    with pytest.raises(TypeError, match="nn.Module"):
        enable_local_regions(torch.zeros(1))  # type: ignore[arg-type]


# ---- GPT: data parallel and ZeRO-3 -------------------------------------------------------------
def _gpt(rank: int, stage3: bool) -> dict[str, Any]:
    from gpt_model import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab=16, seq=8, layers=2, width=16, heads=2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 16, (8, 9), generator=g) for _ in range(3)]
    torch.manual_seed(0)
    ref, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(ref.state_dict())
    mesh = _mesh()
    ap.shard_layer(model, mesh)
    # SGD: AdamW would turn the summation-order rounding of near-zero embedding gradients into
    # lr-sized steps (see examples/train_gpt.py --help); the local AdamW step is checked below
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             ap.ShardingStage3(mesh, "dp") if stage3 else None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    comms = []
    for d in data:
        x, y = d[:, :-1], d[:, 1:]
        with ap.CommDebugMode() as comm:
            loss = lm_loss(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        comms.append(comm.get_comm_counts())
        ref_loss = lm_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    return {"report": local_regions_report(model), "comm": comms[-1], "local_step": opt.stepped_locally}


def test_data_parallel_gpt_is_one_region_and_matches_one_process(world4: Any) -> None:
    r = world4.run(_gpt, False)[0]
    assert r["report"] == {"<root>": ["local"]}, r["report"]
    assert r["local_step"]
    # the loss's sum and token count (one all-reduce), the gradient bucket (one all-reduce)
    assert r["comm"] == {"all_reduce": 2}, r["comm"]


def test_zero3_gpt_gathers_per_block(world4: Any) -> None:
    r = world4.run(_gpt, True)[0]
    report = r["report"]
    assert "ZeRO-3" in report["<root>"][0] and report["blocks.0"] == report["blocks.1"] == ["local"], report
    # three units (root, two blocks): one all-gather each in forward and, for the blocks, again
    # in backward (the root keeps its own for its backward); one reduce-scatter each; the loss's
    # all-reduce
    assert r["comm"] == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 1}, r["comm"]
    assert r["local_step"]


# ---- the optimizer's local step ------------------------------------------------------------------
class MySGD(torch.optim.SGD):
    """A subclass: its step could read whole tensors, so it steps on DistTensors."""


class MyAdamW(torch.optim.AdamW):
    """As MySGD."""


def _local_step(rank: int, cls: Any) -> tuple[bool, list[float]]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    torch.manual_seed(0)
    model = ap.parallelize(MLP(), mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
    kw = {"momentum": 0.9} if issubclass(cls, torch.optim.SGD) else {"weight_decay": 0.1}
    opt = ap.shard_optimizer(cls(model.parameters(), lr=0.1, **kw), ap.ShardingStage1(mesh, "dp"))
    x = ap.shard_tensor(torch.randn(8, 6, generator=torch.Generator().manual_seed(2)), mesh, [S0, R])
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return opt.stepped_locally, [float(p.detach().full_tensor().sum()) for p in model.parameters()]


@pytest.mark.parametrize("cls, subclass", [(torch.optim.SGD, MySGD), (torch.optim.AdamW, MyAdamW)])
def test_elementwise_optimizer_steps_locally_with_the_same_result(world4: Any, cls: Any, subclass: Any) -> None:
    local, ref = world4.run(_local_step, cls)[0], world4.run(_local_step, subclass)[0]
    assert local[0] and not ref[0]
    assert local[1] == pytest.approx(ref[1], rel=1e-6)



@pytest.mark.pure  # single process, no world
def test_autocast_is_part_of_the_signature() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(MLP(), mesh)
    x = ap.shard_tensor(torch.randn(4, 6), mesh, [S0])
    assert model(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    disable_local_regions(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(y.full_tensor(), ref.full_tensor())


class Counting(MLP):
    """Writes in place: a buffer counting calls, and the input (scaled in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x.mul_(2))


@pytest.mark.pure  # single process, no world
def test_in_place_writes_happen_once_per_call() -> None:
    # a forward that writes its argument in place is refused (the capture ran nothing for real):
    # the buffer and the input are written once per call, as without regions
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(Counting(), mesh)
    x = ap.shard_tensor(torch.ones(4, 6), mesh, [S0])
    with torch.no_grad():
        for _ in range(3):
            model(x)
    report = local_regions_report(model)
    assert report["<root>"] == ["refused: the forward writes one of its arguments in place"], report
    assert float(model.calls.full_tensor()) == 3.0
    assert torch.equal(x.full_tensor(), torch.full((4, 6), 8.0))


class KVCache:
    """A key/value cache as ``transformers`` passes one: an object a module appends to."""

    def __init__(self) -> None:
        self.entries: list[torch.Tensor] = []

    def update(self, x: torch.Tensor) -> torch.Tensor:
        self.entries.append(x)
        return torch.cat(self.entries, dim=1)


class CacheUser(MLP):
    """Appends its hidden state to the cache it is given and reads the whole cache back."""

    def forward(self, x: torch.Tensor, cache: KVCache, scale: float = 1.0) -> torch.Tensor:
        h = super().forward(x) * scale
        return cache.update(h).sum(dim=1, keepdim=True) + h


@pytest.mark.pure  # single process, no world
def test_a_cache_argument_is_changed_once_per_call() -> None:
    # what the module writes into an object argument is undone after the capture
    # (``regions.objects``) and put back by the program's run: appended to once per call. The
    # entries it holds are the program's inputs, the one it appends an output, put back as a
    # DistTensor; each call is a new signature (the list is longer)
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(CacheUser(), mesh)
    ref = CacheUser()
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    cache, ref_cache = KVCache(), KVCache()
    for step in range(4):
        x = torch.randn(4, 6)
        y = model(ap.shard_tensor(x, mesh, [S0]), cache, scale=0.5)
        torch.testing.assert_close(y.full_tensor(), ref(x, ref_cache, scale=0.5))
        assert len(cache.entries) == step + 1 and all(isinstance(e, ap.DistTensor) for e in cache.entries)
        torch.testing.assert_close(cache.entries[-1].full_tensor(), ref_cache.entries[-1])
    report = local_regions_report(model)["<root>"]
    assert report == ["local"] * 4, report
    # values stay part of the signature: a module given a number, a dtype or a function is a region
    assert not objects.is_object(0.5) and not objects.is_object(torch.float32) and not objects.is_object(F.gelu)
    assert objects.is_object(KVCache()) and objects.is_object(torch.Generator())


class Growing(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.extra(out) if hasattr(self, "extra") else out


@pytest.mark.pure  # single process, no world
def test_a_submodule_added_later_is_seen() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(Growing(), mesh)
    x = ap.shard_tensor(torch.randn(4, 6), mesh, [S0])
    model(x)
    model.extra = ap.shard_layer(nn.Linear(3, 3), mesh)  # after the first call
    y = model(x)
    disable_local_regions(model)
    torch.testing.assert_close(y.full_tensor(), model(x).full_tensor())
    y.sum().backward()
    assert model.extra.weight.grad is not None


@pytest.mark.pure  # single process, no world
def test_disabling_restores_an_instance_forward() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    model = nn.Linear(3, 3)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 7

    model.forward = scaled  # type: ignore[method-assign]
    ap.shard_layer(model, mesh)
    x = ap.shard_tensor(torch.ones(2, 3), mesh, [S0])
    assert torch.equal(model(x).full_tensor(), torch.full((2, 3), 7.0))
    disable_local_regions(model)
    assert model.forward is scaled


# ---- region parameters and autograd -------------------------------------------------------------
def _twins() -> tuple[nn.Module, nn.Module, Any]:
    """The same MLP as a region and on DistTensors (regions disabled), and an input."""
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    region = ap.shard_layer(MLP(), mesh)
    torch.manual_seed(0)
    plain = ap.shard_layer(MLP(), mesh)
    disable_local_regions(plain)
    x = ap.shard_tensor(torch.randn(4, 6), mesh, [S0])
    region(x)  # the first call traces
    assert local_regions_report(region) == {"<root>": ["local"]}
    return region, plain, x


def _grads(model: nn.Module) -> dict[str, Any]:
    return {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, Any], b: dict[str, Any], rtol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), n
        if a[n] is not None:
            torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=rtol / 10)


@pytest.mark.pure  # single process, no world
def test_region_parameters_get_gradients_as_autograd_gives_them() -> None:
    """A region hands its parameters' gradients to them directly where autograd's accumulation
    would store them as they are; everywhere else autograd's own semantics hold."""
    region, plain, x = _twins()
    # autograd.grad: the gradients come back and no .grad is written
    g1 = torch.autograd.grad(region(x).square().sum(), list(region.parameters()))
    g2 = torch.autograd.grad(plain(x).square().sum(), list(plain.parameters()))
    assert all(p.grad is None for p in region.parameters())
    for u, v in zip(g1, g2):
        torch.testing.assert_close(u.full_tensor(), v.full_tensor())
    # backward(inputs=...): only the listed parameter gets a gradient
    for m in (region, plain):
        m(x).square().sum().backward(inputs=[m.fc1.weight])
    _assert_same(_grads(region), _grads(plain))
    assert region.fc2.weight.grad is None
    # a second backward accumulates; a use outside the region adds to the same gradient
    for m in (region, plain):
        m.zero_grad(set_to_none=True)
        m(x).square().sum().backward()
        (m(x).sum() + (m.fc2.bias * 3).sum()).backward()
    _assert_same(_grads(region), _grads(plain))
    # tensor hooks see (and may change) the gradient; post-accumulate hooks see the result
    seen: dict[str, list[Any]] = {"region": [], "plain": []}
    for name, m in (("region", region), ("plain", plain)):
        m.zero_grad(set_to_none=True)
        m.fc1.weight.register_hook(lambda g: g * 2)
        m.fc2.weight.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.grad.full_tensor()))
        m(x).square().sum().backward()
    _assert_same(_grads(region), _grads(plain))
    assert len(seen["region"]) == len(seen["plain"]) == 1
    torch.testing.assert_close(seen["region"][0], seen["plain"][0])
    # create_graph: the gradients are differentiable (a gradient penalty trains the same; a region
    # runs its call again op by op for that backward)
    for m in (region, plain):
        m.zero_grad(set_to_none=True)
        gs = torch.autograd.grad(m(x).square().sum(), list(m.parameters()), create_graph=True)
        assert all(g.requires_grad for g in gs)
        sum(g.square().sum() for g in gs).backward()
    _assert_same(_grads(region), _grads(plain), rtol=1e-5)  # (another backward path: the same values, rounded alike to 1e-5)
    assert all(p.grad is not None for p in region.parameters())


@pytest.mark.pure  # single process, no world
def test_sharded_optimizer_step_runs_step_hooks_once() -> None:
    """ShardedOptimizer.step is not wrapped a second time by torch.optim (its profiler range
    is the inner optimizer's): its own and the global step hooks still run, once, in order,
    and a pre-hook may replace the arguments."""
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(MLP(), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = ap.shard_tensor(torch.randn(4, 6), mesh, [S0])
    calls: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(f"global pre {type(o).__name__}")),
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(f"global post {type(o).__name__}")),
    ]
    model(x).square().sum().backward()
    opt.step()
    for h in handles:
        h.remove()
    assert calls == ["global pre ShardedOptimizer", "pre", "global pre SGD", "global post SGD", "post",
                     "global post ShardedOptimizer"], calls
    # a pre-hook may swap in a closure; the step returns what the closure returned
    handle = opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": lambda: torch.tensor(7.0)}))
    assert float(opt.step()) == 7.0
    handle.remove()
    # an LR scheduler sees the steps (no "lr_scheduler.step() before optimizer.step()" warning)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(x).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


# ---- new lengths: served by a program of open sizes -----------------------------------------------
def _train_lengths(cls: Any, lengths: list[int | tuple[int, int]], mode: str) -> dict[str, Any]:
    """SGD over batches of these lengths (or (batch, length) pairs): ``plain`` (one process,
    whole batch), ``dist`` (DistTensors, no regions) or ``local`` (regions)."""
    mesh = _mesh()
    torch.manual_seed(0)
    model = cls()
    if mode != "plain":
        ap.shard_layer(model, mesh)
        if mode == "dist":
            disable_local_regions(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for item in lengths:
        b, t = item if isinstance(item, tuple) else (8, item)
        x = torch.randint(0, 11, (b, t), generator=torch.Generator().manual_seed(t))
        y = model(x if mode == "plain" else ap.shard_tensor(x, mesh, [S0]))
        loss = (y * y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach() if mode == "plain" else loss.detach().full_tensor()))
    params = {n: (p.detach() if mode == "plain" else p.detach().full_tensor()) for n, p in model.named_parameters()}
    region = model.__dict__.get("_ap_region")
    return {"losses": losses, "params": params, "report": local_regions_report(model) if mode == "local" else {},
            "captures": region.calls.captures if region is not None else 0,
            "state": sorted((k, type(v).__name__) for k, v in vars(model).items() if isinstance(v, torch.Tensor))}


def _lengths(rank: int, cls: Any, lengths: list[int]) -> dict[str, Any]:
    runs = {mode: _train_lengths(cls, lengths, mode) for mode in ("plain", "dist", "local")}
    for mode in ("dist", "local"):
        assert runs[mode]["losses"] == pytest.approx(runs["plain"]["losses"], rel=1e-5), (mode, runs[mode]["losses"])
        for n, p in runs["plain"]["params"].items():
            torch.testing.assert_close(runs[mode]["params"][n], p, rtol=1e-5, atol=1e-6)
    local = runs["local"]
    return {k: local[k] for k in ("report", "captures", "state")}


def test_new_lengths_run_as_the_program_of_open_sizes(world4: Any) -> None:
    results = world4.run(_lengths, SeqNet, [5, 6, 7, 9, 10, 13, 15, 7, 9])
    r = results[0]
    assert all(x == r for x in results)  # every rank took the same path
    root = r["report"]["<root>"]
    # 5 is captured at its sizes, 6 with them open: that program serves 7, 9, 10, 13, 15
    assert root == ["local", "local"] + ["local (open sizes)"] * 5, root
    assert r["captures"] == 2, r


def test_a_length_that_takes_another_branch_is_captured_again(world4: Any) -> None:
    # past 9 the forward centres over the batch: the open program's guard (t <= 9) excludes 10,
    # captured with its sizes open again (the other branch, the mean's all-reduce included),
    # which serves 11 and 12
    results = world4.run(_lengths, LengthBranch, [5, 6, 7, 10, 11, 12])
    r = results[0]
    assert all(x == r for x in results)
    root = r["report"]["<root>"]
    assert root == ["local", "local", "local (open sizes)", "local", "local (open sizes)", "local (open sizes)"], root
    assert r["captures"] == 3, r


class Caching(SeqNet):
    """Keeps its last output and length as attributes, as a cache would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = super().forward(x)
        self.length = x.shape[1]
        return self.last


class Noted(SeqNet):
    """A submodule with a forward hook that keeps what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.qkv.register_forward_hook(lambda m, i, o: self.calls.append(o.shape[1]))


def test_a_capture_leaves_no_trace(world4: Any) -> None:
    # a forward that assigns module state is refused, and what the capture assigned is undone (the
    # DistTensor runs' assignments stand); a submodule's hook would run at the capture only: refused
    results = world4.run(_lengths, Caching, [5, 6, 7])
    r = results[0]
    assert r["state"] == [("last", "DistTensor")], r
    assert all(v.startswith("refused: the forward assigns the tensor attribute Caching.last") for v in r["report"]["<root>"]), r
    assert r["report"]["qkv"] == ["local", "local", "local (open sizes)"], r  # (its children are regions)
    results = world4.run(_lengths, Noted, [5, 6, 7])
    r = results[0]
    assert all(v == "refused: a submodule has a forward hook" for v in r["report"]["<root>"]), r


def test_an_uneven_batch_is_not_served_by_the_open_program(world4: Any) -> None:
    # batches 8 and 16 make a program of open batch size; 10 rows split 3/3/3/1 over 4 ranks: the
    # ranks would run programs of different shapes, so it is refused (on every rank); 24 rows are
    # even again
    results = world4.run(_lengths, SeqNet, [(8, 5), (16, 5), (10, 5), (24, 5)])
    r = results[0]
    assert all(x == r for x in results)
    root = r["report"]["<root>"]
    assert root[2].startswith("refused") and "unevenly" in root[2], root
    assert root[3] == "local (open sizes)", root
