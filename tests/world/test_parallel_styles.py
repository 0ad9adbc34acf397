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
from autoparallel import Partial, Replicate, Shard
from autoparallel.nn.parallelize import match_plan, resolve_axis

R = Replicate()
STEPS = 3


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
    """STEPS (3) SGD steps on ``model`` and ``ref``; checks loss and every parameter; returns per-step
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
    if sp:  # the attention input gathered once by its module (qkv's own hook then moves nothing)
        plan.update({"ln_1": ap.SequenceParallel(), "ln_2": ap.SequenceParallel(), "attn": ap.PrepareLayerInput([R])})
    else:  # the MLP's Partial output reduced by the MLP module instead of the row-parallel layer
        plan.update({"mlp.proj": ap.RowWiseParallel(output_layout=Partial()), "mlp": ap.PrepareLayerOutput([R])})
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
    assert set(bwd) == {"all_reduce@tp"}, bwd


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
    # forward: vocab-parallel lookup all-reduce + 2 per block; loss parallel: each piece's row max
    # and row sum of exponentials gathered (tp) and the mean's token count (dp) — the logits are
    # never gathered
    assert fwd == {"all_reduce@tp": 1 + 2 * 2, "all_gather@tp": 1, "all_reduce@dp": 1}, fwd
    assert set(bwd) == {"all_reduce@tp"}, bwd


def test_dp_tp_sp_gpt_tied_head(world4: Any) -> None:
    fwd, bwd = world4.run(_gpt, True, True)[0][-1]
    # reduce-scatter out of the embedding and of each row-parallel layer (1 + 2 * 2); all-gather
    # into each column-parallel region and the head (2 * 2 + 1); loss parallel as above
    assert fwd == {"reduce_scatter@tp": 5, "all_gather@tp": 5 + 1, "all_reduce@dp": 1}, fwd
    assert bwd.get("reduce_scatter@tp") == 5 and bwd.get("all_gather@tp") == 5, bwd


# ---- shard_layer ----------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(7, 4), nn.Linear(4, 6), nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.out(h) + (self.fc(h) * self.scale).sum(-1, keepdim=True)


def _shard_layer(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Tied()
    model = _clone(ref)
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["x"])
    seen: list[str] = []

    def shard_fn(name: str, layer: nn.Module, m: ap.ProcessMesh) -> None:
        seen.append(name)
        if name == "fc":
            layer.weight = ap.shard_tensor(layer.weight, m, [Shard(0)])

    ap.shard_layer(model, mesh, shard_fn,
                   input_fn=lambda inputs, m: tuple(ap.shard_tensor(x, m, [R]) for x in inputs),
                   output_fn=lambda out, m: out.full_tensor())
    assert seen == ["", "emb", "fc", "out"], seen
    assert model.out.weight is model.emb.weight  # tied parameters stay one Parameter
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, ap.DistTensor), name
    assert list(model.fc.weight.placements) == [Shard(0)] and list(model.fc.bias.placements) == [R]
    assert isinstance(model.scale, ap.DistTensor) and list(model.scale.placements) == [R]
    idx = torch.tensor([[1, 5, 6], [0, 2, 2]])
    out = model(idx)  # plain in (input_fn), plain out (output_fn)
    want = ref(idx)
    assert type(out) is torch.Tensor and _close(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _close(p.grad.full_tensor(), q.grad), name
    return {"params": len(list(model.parameters()))}


def test_shard_layer_shard_fn_hooks_buffers_and_ties(world4: Any) -> None:
    assert world4.run(_shard_layer)[0] == {"params": 3}


# ---- bad configurations ---------------------------------------------------------------------
def _error(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_configs(rank: int) -> dict[str, Any]:
    mesh2 = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    mesh1 = ap.ProcessMesh([0, 1, 2, 3], ["tp"])
    models: list[nn.Module] = []

    def fresh(cls: Any = Block) -> nn.Module:
        models.append(cls())
        return models[-1]

    errors = {
        "axis": _error(lambda: ap.parallelize(fresh(), mesh2, TP_PLAN, axis="tp")),
        "no_tp_name": _error(lambda: ap.parallelize(fresh(), ap.ProcessMesh([[0, 1], [2, 3]], ["a", "b"]), TP_PLAN)),
        "pattern": _error(lambda: ap.parallelize(fresh(), mesh1, {**TP_PLAN, "attn.qvk": ap.ColWiseParallel()})),
        "type": _error(lambda: ap.parallelize(fresh(), mesh1, {"ln_1": ap.ColWiseParallel()})),
        "class": _error(lambda: ap.parallelize(fresh(), mesh1, {"ln_1": ap.SequenceParallel})),
        "twice": _error(lambda: ap.parallelize(fresh(), mesh1, {"attn.*": ap.ColWiseParallel(), "attn.proj": ap.RowWiseParallel()})),
        "tied": _error(lambda: ap.parallelize(fresh(lambda: GPT(tied=True)), mesh1,
                                              {"wte": ap.VocabParallelEmbedding(), "head": ap.RowWiseParallel()})),
        "layout": _error(lambda: ap.parallelize(fresh(), mesh2, {"": ap.PrepareLayerInput([[Shard(0)]])})),
    }
    # every failed parallelize left its model untouched (all checks run before any conversion)
    untouched = all(not isinstance(p, ap.DistTensor) for m in models for p in m.parameters())
    # a sequence length (3) not dividing the tp degree (4): raised by the pre-hook of the first
    # SequenceParallel region, before any collective of the step
    model = ap.parallelize(Block(), mesh1, {**TP_PLAN, "ln_*": ap.SequenceParallel()})
    errors["seq"] = _error(lambda: model(ap.shard_tensor(torch.randn(2, 3, 8), mesh1, [R])))
    ok = model(ap.shard_tensor(torch.randn(2, 4, 8), mesh1, [R])).full_tensor().shape == (2, 4, 8)
    return {"errors": errors, "untouched": untouched, "healthy": ok}


def test_bad_configurations_raise_on_every_rank_and_world_survives(world4: Any) -> None:
    res = world4.run(_bad_configs)
    assert all(r == res[0] for r in res), res  # the same error on every rank
    e = res[0]["errors"]
    assert res[0]["untouched"] and res[0]["healthy"]
    assert e["axis"].startswith("ValueError") and "'tp'" in e["axis"] and "['dp', 'mp']" in e["axis"], e["axis"]
    assert e["no_tp_name"].startswith("ValueError") and "['a', 'b']" in e["no_tp_name"], e["no_tp_name"]
    assert e["pattern"].startswith("ValueError") and "'attn.qvk'" in e["pattern"], e["pattern"]
    assert e["type"].startswith("TypeError") and "LayerNorm" in e["type"] and "'ln_1'" in e["type"], e["type"]
    assert e["class"].startswith("TypeError") and "SequenceParallel()" in e["class"], e["class"]
    assert e["twice"].startswith("ValueError") and "'attn.proj'" in e["twice"], e["twice"]
    assert e["tied"].startswith("ValueError") and "head.weight" in e["tied"] and "wte.weight" in e["tied"], e["tied"]
    assert e["layout"].startswith("ValueError") and "2-d mesh" in e["layout"], e["layout"]
    assert e["seq"].startswith("ValueError") and "sequence length 3" in e["seq"] and "degree 4" in e["seq"], e["seq"]


# ---- pure: planning without processes -------------------------------------------------------
@pytest.mark.pure  # single process, no world
def test_resolve_axis_defaults_and_names() -> None:
    assert resolve_axis(ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), None) == 1
    assert resolve_axis(ap.ProcessMesh([[0, 1], [2, 3]], ["tp", "dp"]), None) == 0
    assert resolve_axis(ap.ProcessMesh([0, 1], ["x"]), None) == 0
    assert resolve_axis(ap.ProcessMesh([[0, 1], [2, 3]], ["a", "b"]), "b") == 1
    with pytest.raises(ValueError, match="tp.*mp"):
        resolve_axis(ap.ProcessMesh([[0, 1], [2, 3]], ["tp", "mp"]), None)


@pytest.mark.pure  # single process, no world
def test_match_plan_patterns_in_plan_order() -> None:
    model = GPT()
    plan = {"": ap.PrepareLayerInput([None]), "blocks.*.attn.qkv": ap.ColWiseParallel(), "*.mlp.fc": ap.ColWiseParallel()}
    names = [(pat, name) for pat, name, _, _ in match_plan(model, plan)]
    assert names == [("", ""), ("blocks.*.attn.qkv", "blocks.0.attn.qkv"), ("blocks.*.attn.qkv", "blocks.1.attn.qkv"),
                     ("*.mlp.fc", "blocks.0.mlp.fc"), ("*.mlp.fc", "blocks.1.mlp.fc")]
    # Prepare* styles stack on a module that a parameter style also covers
    assert len(match_plan(model, {"head": ap.ColWiseParallel(), "h*": ap.PrepareLayerOutput([R])})) == 2


@pytest.mark.pure  # single process, no world
def test_style_parameter_placements() -> None:
    lin, emb = nn.Linear(4, 6), nn.Embedding(9, 4)
    assert ap.ColWiseParallel().param_placements(lin) == {"weight": Shard(0), "bias": Shard(0)}
    assert ap.ColWiseParallel().param_placements(emb) == {"weight": Shard(1)}
    assert ap.RowWiseParallel().param_placements(lin) == {"weight": Shard(1), "bias": R}
    assert ap.VocabParallelEmbedding().param_placements(emb) == {"weight": Shard(0)}
    with pytest.raises(ValueError, match="max_norm"):
        ap.VocabParallelEmbedding().check("e", nn.Embedding(9, 4, max_norm=1.0), ap.ProcessMesh([0, 1]), 0)
    with pytest.raises(TypeError, match="gather_output"):
        ap.ColWiseParallel(gather_output=1)  # type: ignore[arg-type]
