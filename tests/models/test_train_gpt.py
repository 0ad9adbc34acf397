"""The GPT main job: corpus, tokenizer, resumable sampler, model, the parallel plan, and the torchrun run.

Pure tests run in this process. The plan test trains the example's model in the shared 4-rank
world under DP x TP + SP + ZeRO-3 and compares the losses and every parameter with the same
training in this process. The torchrun run of the example itself is the main-job test in tests/world/test_mesh_world.py.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from gpt_data import CharTokenizer, ResumableSampler, TokenWindows, load_corpus  # noqa: E402
from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402


def test_corpus_is_shipped_and_round_trips_through_the_tokenizer() -> None:
    text = load_corpus()
    assert 100_000 <= len(text.encode()) <= 300_000
    tok = CharTokenizer(text, multiple_of=8)
    assert tok.vocab_size % 8 == 0 and len(tok.chars) <= tok.vocab_size < len(tok.chars) + 8
    ids = tok.encode(text[:500])
    assert ids.dtype == torch.long and tok.decode(ids) == text[:500]
    with pytest.raises(KeyError, match="character '~' is not in the vocabulary"):
        tok.encode("~")


def test_windows_are_shifted_pairs() -> None:
    ids = torch.arange(50)
    data = TokenWindows(ids, seq=8)
    assert len(data) == 6
    x, y = data[2]
    assert torch.equal(x, torch.arange(16, 24)) and torch.equal(y, torch.arange(17, 25))
    with pytest.raises(IndexError, match="index 6 out of range for 6 windows"):
        data[6]


def test_sampler_state_resumes_the_exact_stream() -> None:
    """Stopping after k batches and restoring the state continues with the same indices."""
    data = TokenWindows(torch.arange(200), seq=4)  # 49 windows: several epochs below
    full = ResumableSampler(len(data), seed=3)
    stream = [b[0] for b in _batches(data, full, 40)]
    first = ResumableSampler(len(data), seed=3)
    head = [b[0] for b in _batches(data, first, 15)]
    resumed = ResumableSampler(len(data), seed=3)
    resumed.load_state_dict(first.state_dict())
    tail = [b[0] for b in _batches(data, resumed, 25)]
    assert all(torch.equal(a, b) for a, b in zip(stream, head + tail))
    assert first.state_dict()["index"] == 15 * 6 % 49 and first.state_dict()["epoch"] == 15 * 6 // 49
    with pytest.raises(ValueError, match="does not fit n=49, seed=4"):
        ResumableSampler(49, seed=4).load_state_dict(first.state_dict())


def _batches(data: TokenWindows, sampler: ResumableSampler, count: int) -> list[Any]:
    it = iter(DataLoader(data, batch_size=6, sampler=sampler, drop_last=True))
    return [next(it) for _ in range(count)]


def test_model_shapes_tied_head_and_causality() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=24, seq=8, layers=2, width=16, heads=4))
    assert model.head.weight is model.tok.weight
    assert GPT(GPTConfig(vocab=24, seq=8, tied=False, width=16, heads=4)).head.weight is not None
    idx = torch.randint(0, 24, (3, 8))
    logits = model(idx)
    assert logits.shape == (3, 8, 24)
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 24
    assert torch.allclose(model(changed)[:, :5], logits[:, :5])  # positions < 5 never see later tokens
    assert not torch.allclose(model(changed)[:, 5:], logits[:, 5:])
    with pytest.raises(ValueError, match="width 10 is not a multiple of heads 4"):
        GPTConfig(vocab=8, width=10, heads=4)
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's seq 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def _train_parallel(rank: int, cfg: GPTConfig, batches: list[tuple[torch.Tensor, torch.Tensor]], zero: int,
                    sp: bool, optim: str, static: bool = False,
                    cp: bool = False) -> tuple[list[float], dict[str, torch.Tensor], dict[tuple[str, Any], int]]:
    """Train the example's plan on a 2 x 2 mesh: losses, full parameters, collectives per step by (kind, axis).
    ``static``: through ``ap.to_static`` (step 1 eager, step 2 captured, step 3 replayed); ``cp``:
    dp 2 x cp 2 (x mp 1), the example's ``--cp 2``."""
    import train_gpt

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(cfg)
    if cp:
        mesh = ap.ProcessMesh([[[0], [1]], [[2], [3]]], dim_names=["dp", "cp", "mp"])
    else:
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    train_gpt.parallelize_gpt(model, mesh, sp=sp, cp="ring" if cp else None)
    opt = train_gpt.wrap_optimizer(train_gpt.make_optimizer(model, train_gpt.parse_args(["--optim", optim])), mesh, zero)
    losses = []
    step = ap.to_static(model, loss=lm_loss, optimizer=opt) if static else train_gpt.eager_step(model, opt)
    batch = [ap.Shard(0)] + [ap.Replicate()] * (mesh.ndim - 1)
    with ap.CommDebugMode() as comm:
        for x, y in batches:
            xs = ap.shard_tensor(x, mesh, batch)
            ys = ap.shard_tensor(y, mesh, batch)
            loss = step(xs, ys)
            losses.append(train_gpt.scalar(loss))
    counts = Counter((r.kind, r.axis) for r in comm.records)
    assert opt.stepped_locally, "every gradient reached its parameter's layout: the optimizer steps local shards"
    return losses, train_gpt.full_params(model), dict(counts)


@pytest.mark.parametrize("zero,sp,optim,static,cp", [
    (3, True, "adamw", False, False), (0, False, "sgd", False, False), (3, True, "adamw", True, False),
    (0, False, "sgd", True, False), (0, False, "sgd", False, True),
])
def test_plan_trains_like_one_process(world4, zero: int, sp: bool, optim: str, static: bool, cp: bool) -> None:  # type: ignore[no-untyped-def]
    """DP x TP (+SP, ZeRO-3), eager and static, and DP x CP: the loss at every step and every
    parameter equal one process.

    SGD parameters are compared elementwise; AdamW parameters per tensor in norm (the reason
    is measured in train_gpt.py's docstring, ELEMENTWISE), both at rtol 1e-5.
    """
    import train_gpt

    cfg = GPTConfig(vocab=24, seq=8, layers=1, width=16, heads=2, tied=True)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 24, (4, 8), generator=g), torch.randint(0, 24, (4, 8), generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    reference = GPT(cfg)
    opt = train_gpt.make_optimizer(reference, train_gpt.parse_args(["--optim", optim]))
    ref_losses = []
    for x, y in batches:
        loss = lm_loss(reference(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    for losses, params, counts in world4.run(_train_parallel, cfg, batches, zero, sp, optim, static, cp):
        ok, rows = train_gpt.loss_table(losses, ref_losses)
        assert ok, "\n".join(rows)
        ok, rows = train_gpt.param_report(params, ref_params)
        assert ok, "\n".join(rows)
        if optim == "sgd":
            for name, q in ref_params.items():
                torch.testing.assert_close(params[name], q, rtol=1e-5, atol=1e-6, msg=name)
        per_step = {k: v // len(batches) for k, v in counts.items()}
        if cp:  # ring attention on "cp" (axis 1), balanced (seq 8 = 2 x 2 halves): 3 forward, 4 backward
            assert per_step.get(("all_to_all", 1), 0) >= 7, sorted(per_step.items())
        elif sp:  # Megatron SP on "mp" (axis 1): per block an all-gather before qkv and fc, a reduce-scatter after each projection
            assert per_step.get(("all_gather", 1), 0) >= 2 and per_step.get(("reduce_scatter", 1), 0) >= 2, per_step
        else:   # plain TP: the projections' outputs are all-reduced on "mp"
            assert per_step.get(("all_reduce", 1), 0) >= 2 and ("reduce_scatter", 1) not in per_step, per_step


@pytest.mark.parametrize("argv,world,message", [
    ([], 1, "--dp 2 x --tp 2 = 4 ranks, but the world has 1"),
    (["--dp", "3", "--tp", "1"], 4, "--dp 3 x --tp 1 = 3 ranks, but the world has 4"),
    (["--batch", "9"], 4, "--batch 9 is not divisible by --dp 2"),
    (["--heads", "3", "--width", "48", "--dp", "1", "--tp", "4"], 4, "--tp 4 must divide --heads 3"),
    (["--seq", "15"], 4, "--sp needs --seq 15 divisible by --tp 2"),
    (["--dp", "1", "--tp", "4", "--zero", "2"], 4, "--zero 2 shards over 'dp' and needs --dp > 1"),
    (["--cp", "2"], 4, "--dp 2 x --cp 2 x --tp 2 = 8 ranks, but the world has 4"),
    (["--dp", "1", "--cp", "2"], 4, "--cp splits the sequence everywhere; use it with --no-sp"),
    (["--dp", "1", "--cp", "3", "--tp", "1", "--no-sp", "--seq", "64"], 3, "--cp 3 must divide --seq 64"),
    (["--dp", "1", "--cp", "4", "--tp", "1", "--cp-comm", "all_to_all", "--heads", "2", "--width", "32"], 4,
     "--cp-comm all_to_all splits the heads: --cp 4 x --tp 1 must divide --heads 2"),
])
def test_bad_configuration_is_refused_before_any_collective(argv: list[str], world: int, message: str) -> None:
    """check_config runs on metadata only (same ValueError on every rank, before the mesh exists)."""
    import train_gpt

    with pytest.raises(ValueError, match=message.replace("+", "\\+")):
        train_gpt.check_config(train_gpt.parse_args(argv), world, vocab=80)
    train_gpt.check_config(train_gpt.parse_args([]), 4, vocab=80)  # the default is fine on 4 ranks


def test_bf16_parameters_are_judged_model_wide() -> None:
    """A tiny bias off by 20% of its norm (bf16 + AdamW's sign-like first steps) fails the
    per-tensor verdict but not the model-wide one the --bf16 check uses; a real error fails both."""
    import train_gpt

    ref = {"w": torch.ones(64, 64), "b": torch.full((64,), 1e-3)}
    noisy = {"w": ref["w"] * (1 + 1e-3), "b": ref["b"] * 1.2}
    assert not train_gpt.param_report(noisy, ref, train_gpt.BF16_RTOL)[0]
    ok, rows = train_gpt.param_report(noisy, ref, train_gpt.BF16_RTOL, model_wide=True)
    assert ok and "model-wide" in rows[1]
    wrong = {"w": ref["w"] * 1.1, "b": ref["b"]}
    assert not train_gpt.param_report(wrong, ref, train_gpt.BF16_RTOL, model_wide=True)[0]


def test_the_last_line_says_pass_or_fail_for_every_figure() -> None:
    """``compare``'s table ends with one line: the verdict overall, then each checked figure
    (the loss's max relative difference, the parameters' normwise one) with its bound and verdict."""
    import train_gpt

    ref = {"w": torch.ones(4, 4)}
    near = {"w": ref["w"] * (1 + 2 ** -19)}  # 1.9e-6, exact in float32
    ok, table = train_gpt.compare([2.0, 1.0], [2.0, 1.0 + 1e-7], near, ref)
    assert ok and table.splitlines()[-1] == (
        "PASS: loss max rel diff 1.0e-07 <= 1e-05 PASS; parameters max rel diff 1.9e-06 <= 1e-05 PASS"), table
    ok, table = train_gpt.compare([2.0, 1.1], [2.0, 1.0], near, ref)
    assert not ok and table.splitlines()[-1] == (
        "FAIL: loss max rel diff 1.0e-01 > 1e-05 FAIL; parameters max rel diff 1.9e-06 <= 1e-05 PASS"), table
    ok, table = train_gpt.compare([2.0], [2.0], {"w": ref["w"] * 1.1}, ref, train_gpt.BF16_RTOL, model_wide=True)
    assert not ok and table.splitlines()[-1].startswith("FAIL: loss max rel diff 0.0e+00 <= ")
    assert table.splitlines()[-1].endswith(f"PASS; parameters model-wide rel diff 1.0e-01 > {train_gpt.BF16_RTOL:g} FAIL")
