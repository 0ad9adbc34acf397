"""Parallel styles and plans on a 4-rank gloo world: training equals one process, and the
collectives issued per step are the ones each style stands for (Megatron TP / SP)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard
from autoparallel.nn.parallelize import match_plan, resolve_axis

R = Replicate()
STEPS = 5


# ---- models (single-device code, untouched by the parallel runs) ----------------------------
class Attention(nn.Module):
    """Causal self-attention; qkv rows are head-major ([heads, q|k|v, head_dim]) so that a
    column-parallel qkv (rows split over tp) gives every rank whole heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * d).split(d, dim=-1)  # [b, s, h, d] each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]: heads sharded on tp
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, c))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 15, seq: int = 4, dim: int = 8, heads: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


TP_PLAN: dict[str, Any] = {
    "attn.qkv": ap.ColWiseParallel(), "attn.proj": ap.RowWiseParallel(),
    "mlp.fc": ap.ColWiseParallel(), "mlp.proj": ap.RowWiseParallel(),
}


def gpt_plan(sp: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "": ap.PrepareLayerInput([[Shard(0), R]]),        # token ids: batch split on dp
        "wte": ap.VocabParallelEmbedding(),
        "wpe": ap.PrepareLayerInput([R]),                  # a plain arange -> Replicate
        **{f"blocks.*.{k}": v for k, v in TP_PLAN.items()},
        "head": ap.ColWiseParallel(gather_output=False),   # class-sharded logits: loss parallel
    }
    if sp:
        plan.update({"blocks.*.ln_*": ap.SequenceParallel(), "ln_f": ap.SequenceParallel()})
    return plan


# ---- helpers --------------------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _counts(comm: ap.CommDebugMode, mesh: ap.ProcessMesh) -> dict[str, int]:
    """Collectives by kind and mesh axis name, e.g. {"all_gather@tp": 2}."""
    return dict(Counter(f"{r.kind}@{mesh.dim_names[r.axis]}" for r in comm.records if r.axis is not None))


def _train(model: nn.Module, ref: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
           loss_fn: Any, to_dist: Any) -> list[tuple[dict[str, int], dict[str, int]]]:
    """5 SGD steps on ``model`` and ``ref``; checks loss and every parameter; returns per-step
    (forward+loss, backward) collective counts of the distributed run."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    mesh = next(iter(model.parameters())).process_mesh
    comms = []
    for x, t in batches:
        with ap.CommDebugMode() as fwd:
            loss = loss_fn(model(to_dist(x)), to_dist(t))
        opt.zero_grad()
        with ap.CommDebugMode() as bwd:
            loss.backward()
        opt.step()
        ref_loss = loss_fn(ref(x), t)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert _close(loss.detach().full_tensor(), ref_loss.detach()), (loss.full_tensor(), ref_loss)
        comms.append((_counts(fwd, mesh), _counts(bwd, mesh)))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, nn.Parameter) and isinstance(p, ap.DistTensor), name
        assert _close(p.detach().full_tensor(), q.detach()), (name, p.full_tensor(), q)
    return comms


def _clone(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    other = type(model)()
    other.load_state_dict(model.state_dict())
    return other


# ---- equivalence ----------------------------------------------------------------------------
def _tp_mlp(rank: int) -> list[Any]:
    torch.manual_seed(0)
    ref = MLP(6, 10)  # 10 hidden features over 4 ranks: uneven column/row shards
    model = MLP(6, 10)
    model.load_state_dict(ref.state_dict())
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["tp"])
    ap.parallelize(model, mesh, {"fc": ap.ColWiseParallel(), "proj": ap.RowWiseParallel()})
    assert list(model.fc.weight.placements) == [Shard(0)] and list(model.proj.weight.placements) == [Shard(1)]
    assert list(model.proj.bias.placements) == [R]
    batches = [(torch.randn(5, 6), torch.randn(5, 6)) for _ in range(STEPS)]
    return _train(model, ref, batches, lambda y, t: (y - t).square().mean(), lambda x: ap.shard_tensor(x, mesh, [R]))


def test_tp_mlp_trains_like_one_process(world4: Any) -> None:
    comms = world4.run(_tp_mlp)[0]
    fwd, bwd = comms[-1]
    # one all-reduce: the row-parallel output (P -> R); the loss's mean of R is local
    assert fwd == {"all_reduce@tp": 1}, fwd
    assert "all_gather@tp" not in bwd and "reduce_scatter@tp" not in bwd, bwd


def _tp_sp_block(rank: int, sp: bool) -> list[Any]:
    torch.manual_seed(0)
    ref = Block()
    model = _clone(ref)
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["tp"])
    plan = dict(TP_PLAN)
    if sp:
        plan.update({"ln_1": ap.SequenceParallel(), "ln_2": ap.SequenceParallel()})
    ap.parallelize(model, mesh, plan)
    batches = [(torch.randn(2, 4, 8), torch.randn(2, 4, 8)) for _ in range(STEPS)]

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if isinstance(y, ap.DistTensor):  # the target laid out like the output (a local slice)
            t = ap.reshard(t, mesh, list(y.placements))
        return (y - t).square().mean()

    # input replicated: the first SequenceParallel pre-hook slices the sequence locally
    return _train(model, ref, batches, loss_fn, lambda x: ap.shard_tensor(x, mesh, [R]))


def test_tp_sp_block_uses_all_gather_and_reduce_scatter(world4: Any) -> None:
    fwd, bwd = world4.run(_tp_sp_block, True)[0][-1]
    # Megatron-SP: per sub-block one all-gather entering the column-parallel region and one
    # reduce-scatter leaving the row-parallel region (the loss, a mean over a sequence-sharded
    # output, stays Partial until read). No all-reduce of activations in either direction.
    assert fwd == {"all_gather@tp": 2, "reduce_scatter@tp": 2}, fwd
    assert bwd == {"all_gather@tp": 2, "reduce_scatter@tp": 2}, bwd


def test_tp_block_without_sp_uses_all_reduce(world4: Any) -> None:
    fwd, bwd = world4.run(_tp_sp_block, False)[0][-1]
    assert fwd == {"all_reduce@tp": 2}, fwd  # one per row-parallel output
    assert set(bwd) <= {"all_reduce@tp"}, bwd


def _gpt(rank: int, sp: bool, tied: bool) -> list[Any]:
    torch.manual_seed(0)
    ref = GPT(tied=tied)
    model = GPT(tied=tied)
    model.load_state_dict(ref.state_dict())
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    ap.parallelize(model, mesh, gpt_plan(sp))
    if tied:
        assert model.head.weight is model.wte.weight
    assert list(model.wte.weight.placements) == [R, Shard(0)]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 15, (4, 5), generator=g) for _ in range(STEPS)]
    batches = [(d[:, :4], d[:, 1:]) for d in data]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, ap.DistTensor):  # loss parallel: the class dim stays sharded
            assert list(logits.placements) == [Shard(0), Shard(2)], logits.placements
            target = ap.shard_tensor(target, mesh, [Shard(0), R])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return _train(model, ref, batches, loss_fn, lambda x: x)


def test_dp_tp_gpt_vocab_parallel_and_loss_parallel(world4: Any) -> None:
    fwd, bwd = world4.run(_gpt, False, False)[0][-1]
    # forward: vocab-parallel lookup all-reduce + 2 per block; loss parallel: row max and row sum
    # of exponentials (tp) and the mean's token count (dp) — the logits are never gathered
    assert fwd == {"all_reduce@tp": 1 + 2 * 2 + 2, "all_reduce@dp": 1}, fwd
    assert "all_gather@tp" not in bwd and "all_gather@dp" not in bwd, bwd


def test_dp_tp_sp_gpt_tied_head(world4: Any) -> None:
    fwd, bwd = world4.run(_gpt, True, True)[0][-1]
    # reduce-scatter out of the embedding and of each row-parallel layer (1 + 2 * 2); all-gather
    # into each column-parallel region and the head (2 * 2 + 1); loss parallel as above
    assert fwd == {"reduce_scatter@tp": 5, "all_gather@tp": 5, "all_reduce@tp": 2, "all_reduce@dp": 1}, fwd
    assert bwd.get("reduce_scatter@tp") == 5 and bwd.get("all_gather@tp") == 5, bwd
