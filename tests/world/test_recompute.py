"""Activation recompute (``ap.recompute``, ``parallelize(recompute=...)``, torch's checkpoint) on
laid-out models: bitwise the losses and parameters of the same run without recompute.

World part (4 gloo ranks, the session world): the example GPT with dropout (so the recompute
must draw the masks of the first forward) trains 2 SGD steps under TP, TP + SP, DP x TP and
ZeRO-3, with full and selective recompute, in "math" attention (QK^T, softmax, dropout, AV as
separate ops) and SDPA; every loss and every parameter equals (``torch.equal``) the run with no
recompute. Under SP the backward redoes the forward's all-gathers, in the same order on every
rank. A 2-stage 1F1B pipeline (dp = 2 inside each stage, blocks with dropout) recomputing each
block trains bitwise like the same pipeline without. The meter sees the memory each policy
keeps. Pure part: bad policies are refused.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(vocab=32, seq=8, layers=2, width=32, heads=4, dropout=0.1, attention="math")
STEPS = 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g),
             torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g)) for _ in range(STEPS)]


def _train(rank: int, cfg: GPTConfig, layout: str, policy: str, zero: int = 0, how: str = "parallelize") -> dict[str, Any]:
    """Train ``STEPS`` SGD steps; losses, full parameters, and each step's backward collectives."""
    import train_gpt

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(cfg)
    dp, tp = {"tp": (1, 4), "tp_sp": (1, 4), "dp_tp": (2, 2), "zero3": (2, 2)}[layout]
    mesh = ap.ProcessMesh(torch.arange(4).reshape(dp, tp).tolist(), dim_names=["dp", "mp"])
    sp = layout in ("tp_sp", "zero3")
    if how == "parallelize":
        ap.parallelize(model, mesh, train_gpt.gpt_plan(sp), recompute=None if policy == "none" else {"blocks.*": policy})
    else:  # ap.recompute after the layout
        ap.parallelize(model, mesh, train_gpt.gpt_plan(sp))
        for block in model.blocks:
            ap.recompute(block, policy)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             ap.ShardingStage3(mesh, "dp") if zero == 3 else None)
    torch.manual_seed(7)  # the dropout masks
    losses, backward = [], []
    for x, y in _batches():
        xs = ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])
        ys = ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()])
        loss = lm_loss(model(xs), ys)
        with ap.CommDebugMode() as comm:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(train_gpt.scalar(loss))
        backward.append([(r.kind, r.axis, r.recv_bytes) for r in comm.records])
    return {"losses": losses, "params": train_gpt.full_params(model), "backward": backward,
            "rng": torch.get_rng_state()}


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), (what, name)
    assert torch.equal(a["rng"], b["rng"]), (what, "the generator ends elsewhere")


@pytest.mark.parametrize("layout", ["tp", "tp_sp", "dp_tp", "zero3"])
def test_recompute_is_bitwise_no_recompute(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    zero = 3 if layout == "zero3" else 0
    base = world4.run(_train, CFG, layout, "none", zero)
    for policy in ("full", "selective"):
        got = world4.run(_train, CFG, layout, policy, zero)
        for r in range(4):
            _same(base[r], got[r], f"{layout} {policy} rank {r}")
        # the recomputed backward issues the same collectives on every rank of a tp group
        assert got[0]["backward"] == got[1]["backward"] and got[2]["backward"] == got[3]["backward"]
        if layout in ("tp_sp", "zero3"):  # SP's two all-gathers per block are redone in the backward
            n = [sum(1 for k, a, _ in step if (k, a) == ("all_gather", 1)) for step in got[0]["backward"]]
            n0 = [sum(1 for k, a, _ in step if (k, a) == ("all_gather", 1)) for step in base[0]["backward"]]
            assert all(m >= m0 + 2 * CFG.layers for m, m0 in zip(n, n0)), (policy, n, n0)
        if layout == "zero3":  # the recompute's gather is ZeRO-3's backward gather: no extra unit gather on dp
            # (a block's parameters: the largest all-gathers on dp; the small ones the DistTensor
            # path adds inside recomputed regions are gradients of local-region candidates, see docs/memory.md)
            def units(res: dict[str, Any]) -> list[int]:
                step = [(k, a, b) for k, a, b in res["backward"][-1] if (k, a) == ("all_gather", 0)]
                big = max(b for _, _, b in step)
                return [b for _, _, b in step if b == big]
            assert units(got[0]) == units(base[0]), (policy, units(got[0]), units(base[0]))
            assert ([r for r in got[0]["backward"][-1] if r[:2] == ("reduce_scatter", 0)]
                    == [r for r in base[0]["backward"][-1] if r[:2] == ("reduce_scatter", 0)])


def test_ap_recompute_after_layout_and_sdpa(world4) -> None:  # type: ignore[no-untyped-def]
    cfg = GPTConfig(vocab=32, seq=8, layers=2, width=32, heads=4, dropout=0.1, attention="sdpa")
    base = world4.run(_train, cfg, "tp_sp", "none")
    for policy in ("full", "selective"):
        got = world4.run(_train, cfg, "tp_sp", policy, 0, "ap.recompute")
        for r in range(4):
            _same(base[r], got[r], f"sdpa {policy} rank {r}")


class _DropBlock(nn.Module):
    """x + fc2(dropout(tanh(fc1(x)))): a pipeline block whose recompute must redraw its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _pipelined(rank: int, policy: str, schedule: str = "1F1B") -> dict[str, Any]:
    """Two stages on [0, 1] and [2, 3] (dp inside), 1F1B (or ``schedule``) over 2 micro-batches, 2 SGD steps."""
    import warnings

    import autoparallel as ap
    from autoparallel.pipeline import Pipeline, split_sequential

    torch.manual_seed(0)
    model = nn.Sequential(*[_DropBlock() for _ in range(4)])
    if policy != "none":
        for block in model:
            ap.recompute(block, policy)
    calls = [0]
    for block in model:
        block.fc1.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    meshes = [ap.ProcessMesh([0, 1], dim_names=["dp"]), ap.ProcessMesh([2, 3], dim_names=["dp"])]
    pipe = Pipeline(split_sequential(model, meshes), lambda y, t: (y - t).square().mean(), num_microbatches=2, schedule=schedule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(7)  # the dropout masks
    losses, said = [], []
    for _ in range(STEPS):
        x, t = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = pipe.step(ap.shard_tensor(x, meshes[0], [ap.Shard(0)]), ap.shard_tensor(t, meshes[1], [ap.Shard(0)]))
        said += [str(w.message) for w in seen if "computes its weight gradients in B" in str(w.message)]
        opt.step()
        losses.append(float(loss.full_tensor()) if rank in meshes[1] else None)
    params = {n: p.full_tensor() for n, p in model.named_parameters() if rank in p.process_mesh}
    return {"losses": losses, "params": params, "rng": torch.get_rng_state(), "calls": calls[0], "said": said}


def test_pipeline_recompute_is_bitwise_no_recompute(world4) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_pipelined, "none")
    assert all(len(r["params"]) == 8 for r in base)  # each rank holds its stage's 2 blocks
    for policy in ("full", "selective"):
        got = world4.run(_pipelined, policy)
        # the backward ran each of this rank's 2 blocks' forward again, per micro-batch and step
        # (the base count also holds the runner's no-grad shape pass over every stage)
        assert [g["calls"] - b["calls"] for g, b in zip(got, base)] == [2 * 2 * STEPS] * 4
        for r in range(4):
            _same(base[r], got[r], f"pipeline {policy} rank {r}")


def test_pipeline_recompute_under_zero_bubble_is_bitwise_1f1b(world4) -> None:  # type: ignore[no-untyped-def]
    """ZBH1 splits each backward into B and W calls, and each call would recompute a checkpointed
    block again (a selective recompute replays its kept products in one backward only: it would
    fail): a stage with recomputed modules runs its whole backward in B, after one warning, and
    recomputes each block once per micro-batch, as under 1F1B. Both policies train bitwise as 1F1B."""
    base = world4.run(_pipelined, "none")
    for policy in ("full", "selective"):
        got = world4.run(_pipelined, policy, "ZBH1")
        assert [g["calls"] - b["calls"] for g, b in zip(got, base)] == [2 * 2 * STEPS] * 4
        for r in range(4):
            _same(base[r], got[r], f"ZBH1 {policy} rank {r}")
            assert len(got[r]["said"]) == 1 and "recomputed in backward" in got[r]["said"][0], got[r]["said"]


def _meter(rank: int, policy: str) -> dict[str, int]:
    import train_gpt

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq=16, layers=2, width=32, heads=4, attention="math"))
    mesh = ap.ProcessMesh([[0, 1, 2, 3]], dim_names=["dp", "mp"])
    ap.parallelize(model, mesh, train_gpt.gpt_plan(True), recompute=None if policy == "none" else {"blocks.*": policy})
    x = ap.shard_tensor(torch.randint(0, 32, (2, 16)), mesh, [ap.Shard(0), ap.Replicate()])
    meter = ap.LayerMeter(model, "blocks.*")
    with meter.track():
        loss = lm_loss(model(x), x)
    loss.backward()
    return meter.bytes


def test_meter_sees_what_each_policy_keeps(world4) -> None:  # type: ignore[no-untyped-def]
    none, sel, full = (world4.run(_meter, p)[0] for p in ("none", "selective", "full"))
    s, b, h, t = 16, 2, 32, 4
    sbh4 = s * b * h * 4 // t  # one fp32 activation of the block, sequence-split
    for name in ("blocks.0", "blocks.1"):
        assert full[name] == sbh4, full  # full recompute keeps the block's (SP-split) input only
        assert sel[name] == 8 * sbh4, sel  # input + qkv (3) + fc (4): the linear layers' kept products
        assert none[name] > 2 * sel[name], none


@pytest.mark.pure  # single process, no world
def test_bad_policies_are_refused() -> None:
    import autoparallel as ap

    with pytest.raises(ValueError, match="policy 'some' is none of"):
        ap.recompute(nn.Linear(2, 2), "some")
    model = GPT(GPTConfig(vocab=8, seq=4, layers=1, width=8, heads=2))
    mesh = ap.ProcessMesh([0], dim_names=["mp"])
    with pytest.raises(ValueError, match="recompute pattern 'block.*' matches no module"):
        ap.parallelize(model, mesh, {}, recompute={"block.*": "full"})
    assert not isinstance(model.blocks[0].ln1.weight, ap.DistTensor)  # refused before any layout
    m = ap.recompute(nn.Linear(2, 2), "full")
    assert type(m).__name__ == "Linear" and isinstance(m, nn.Linear)
    assert ap.memory.recomputation.policy_of(ap.recompute(m, "none")) is None


def _llama_with_cache(rank: int, policy: str) -> dict[str, Any]:
    """An unmodified tiny ``LlamaForCausalLM`` under ``ap.plans.llama`` (TP on 2 ranks), its decoder
    layers recomputed with ``policy``, 3 forward + backward passes with ``use_cache=True`` (the
    gradients accumulate): losses, full gradients, the warnings said, the returned caches' lengths."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    import autoparallel as ap
    from autoparallel.memory import recomputation

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=32, use_cache=True)
    model = LlamaForCausalLM(cfg)
    mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
    ap.parallelize(model, mesh, ap.plans.llama(model))
    if policy != "none":
        for layer in model.model.layers:
            ap.recompute(layer, policy)
    recomputation.forget_warnings()
    gen = torch.Generator().manual_seed(1)
    losses, lengths = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # (the decoder layers become local-region candidates between calls)
            x = ap.shard_tensor(torch.randint(0, 64, (4, 16), generator=gen), mesh, [ap.Replicate()])
            out = model(input_ids=x, labels=x, use_cache=True)
            out.loss.backward()
            losses.append(out.loss.full_tensor().item())
            lengths.append(out.past_key_values.get_seq_length())
    said = [str(w.message) for w in caught if "recompute" in str(w.message)]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "said": said, "lengths": lengths}


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_llama_layers_run_without_their_cache(world2, policy: str) -> None:  # type: ignore[no-untyped-def]
    """transformers' default ``use_cache=True`` in training: a recomputed decoder layer is given no
    cache (a recomputed forward would write into it again), after one warning; the losses and
    gradients are those without recompute (which fills the cache): bitwise under full recompute
    (the layer's program runs again); under selective recompute, whose modes watch every op, the
    layer runs op by op, not as its program: the same values, summed in another order."""
    pytest.importorskip("transformers")
    base = world2.run(_llama_with_cache, "none")
    got = world2.run(_llama_with_cache, policy)
    for r in range(2):
        if policy == "full":
            assert got[r]["losses"] == base[r]["losses"], (got[r]["losses"], base[r]["losses"])
        else:
            assert got[r]["losses"] == pytest.approx(base[r]["losses"], rel=1e-6), (got[r]["losses"], base[r]["losses"])
        for name, g in base[r]["grads"].items():
            if policy == "full":
                assert torch.equal(got[r]["grads"][name], g), name
            else:
                torch.testing.assert_close(got[r]["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
        assert base[r]["said"] == [] and base[r]["lengths"] == [16] * 3, base[r]
        assert len(got[r]["said"]) == 1, got[r]["said"]
        assert "LlamaDecoderLayer without its key/value cache (past_key_values=None)" in got[r]["said"][0]
        assert "model.config.use_cache = False" in got[r]["said"][0]
        assert got[r]["lengths"] == [0] * 3  # the layers were given no cache to write into


@pytest.mark.pure  # single process, no world
def test_cache_arguments_are_dropped_by_keyword_and_by_position() -> None:
    import warnings

    import autoparallel as ap
    from autoparallel.memory import recomputation

    class Block(nn.Module):  # GPT-2's order: the cache is the second positional argument
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, layer_past: Any = None, use_cache: bool = False) -> torch.Tensor:
            assert layer_past is None and not use_cache, (layer_past, use_cache)
            return self.fc(x)

    block = ap.recompute(Block())
    recomputation.forget_warnings()
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block(x, object(), True).sum().backward()
        block(x, layer_past=object(), use_cache=True).sum().backward()
        block(x).sum().backward()
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "Block without its key/value cache (layer_past=None, use_cache=False)" in said[0], said
    with torch.no_grad():  # not recomputed: the arguments reach the module as given
        with pytest.raises(AssertionError):
            block(x, object())
