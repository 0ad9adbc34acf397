"""``ap.to_static`` with open sizes: one captured program serves every batch size and sequence
length its guards admit, and trains as eager does at each of them.

A small GPT under data, tensor, sequence and DP x TP parallelism is trained on batches of
changing batch size and sequence length, statically and eagerly from the same start; losses and
parameters must agree. The first call of a signature is captured at its sizes, the first call at
another size with its sizes open: two captures for every size (and one more per guard that a new
size breaks)."""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import autoparallel as ap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

R, S0 = ap.Replicate(), ap.Shard(0)
SIZES = [(8, 8), (8, 12), (12, 8), (8, 16), (8, 8)]  # (batch, sequence length), per step: 2+ rows a rank


def _build(kind: str) -> tuple[nn.Module, Any, ap.ProcessMesh, list[Any]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq=32, layers=1, width=32, heads=2))
    if kind in ("dp", "zero3"):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        placements = [S0]
        stage = ap.ShardingStage3(mesh) if kind == "zero3" else None
        return model, ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), stage), mesh, placements
    else:
        shape = {"tp": [[0, 1, 2, 3]], "tp_sp": [[0, 1, 2, 3]], "dp_tp": [[0, 1], [2, 3]], "dp_1": [[0], [1], [2], [3]]}[kind]
        mesh = ap.ProcessMesh(shape, dim_names=["dp", "mp"])
        plan: dict[str, Any] = {"tok": ap.VocabParallelEmbedding(), "blocks.*.attn.qkv": ap.ColWiseParallel(),
                                "blocks.*.attn.proj": ap.RowWiseParallel(), "blocks.*.mlp.fc": ap.ColWiseParallel(),
                                "blocks.*.mlp.proj": ap.RowWiseParallel(), "head": ap.ColWiseParallel()}
        if kind == "tp_sp":
            plan.update({"blocks.*.ln1": ap.SequenceParallel(), "blocks.*.ln2": ap.SequenceParallel(),
                         "ln_f": ap.SequenceParallel()})
        ap.parallelize(model, mesh, plan)
        placements = [S0, R]
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, opt, mesh, placements


def _batches(sizes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 32, (b, t), generator=g), torch.randint(0, 32, (b, t), generator=g)) for b, t in sizes]


def _step(dm: Any, model: nn.Module, opt: Any, loss_fn: Any, x: Any, y: Any) -> float:
    """One training step, static (``dm``) or eager (``dm`` None); its loss."""
    if dm is not None:
        loss = dm(x, y)
    else:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach().full_tensor())


def _train(rank: int, kind: str, sizes: list[tuple[int, int]]) -> dict[str, Any]:
    data = _batches(sizes)
    out: dict[str, Any] = {}
    for static in (False, True):
        model, opt, mesh, placements = _build(kind)
        if not static:  # the reference: eager op by op (its captured regions equal it: test_regions_capture.py)
            ap.disable_local_regions(model)
        dm = ap.to_static(model, loss=lm_loss, optimizer=opt) if static else None
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in data:
                xd, yd = ap.shard_tensor(x, mesh, placements), ap.shard_tensor(y, mesh, placements)
                losses.append(_step(dm, model, opt, lm_loss, xd, yd))
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        out["static" if static else "eager"] = {
            "losses": losses, "params": params, "captures": dm.captures if dm is not None else 0,
            "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}
    return out


def _assert_trains_as_eager(res: dict[str, Any]) -> None:
    e, s = res["eager"], res["static"]
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(e["losses"]), rtol=1e-5, atol=1e-6)
    for a, b in zip(s["params"], e["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert s["warnings"] == [], s["warnings"]


@pytest.mark.parametrize("kind", ["dp", "tp", "tp_sp", "dp_tp", "zero3"])
def test_two_captures_serve_every_batch_size_and_length(world4: Any, kind: str) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_train, kind, SIZES):
        _assert_trains_as_eager(res)
        assert res["static"]["captures"] == 2, res["static"]["captures"]


def test_a_batch_split_unevenly_is_captured_at_its_size(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # 6 rows over 4 ranks: pieces of 2, 2, 2, 0 -- per-rank sizes, so that dim stays fixed: a
    # signature of its own, captured at its sizes; 8 rows at a new length: the open capture
    for res in world4.run(_train, "dp", [(8, 8), (6, 8), (8, 12), (8, 16)]):
        _assert_trains_as_eager(res)
        assert res["static"]["captures"] == 3, res["static"]["captures"]


def test_a_mesh_axis_of_one_rank_needs_no_group(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # tensor parallelism over an axis of one rank: the loss is Partial over it, with nothing to sum
    for res in world4.run(_train, "dp_1", [(4, 8), (8, 12)]):
        _assert_trains_as_eager(res)


class _Branchy(nn.Module):
    """Takes another branch past 12 tokens: a guard on the length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if x.shape[1] > 12:
            h = h * 0.5
        return self.out(h)


def _root_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, y) * y.shape[1] ** 0.5  # (a float of a size: a symbolic float in the capture)


def _log_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, y) / math.log(y.shape[1])  # (a size made a Python number: fixed by a guard)


def _small(rank: int, sizes: list[tuple[int, int]], same: bool = False, scaled: str = "") -> dict[str, Any]:
    """``_Branchy`` trained eagerly and statically on batches of ``sizes``; ``same``: the input
    passed as its own label (one tensor, two arguments); ``scaled``: the loss times a size's root
    ("root") or over its log ("log")."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    data = _batches(sizes)
    loss_fn = {"root": _root_loss, "log": _log_loss}.get(scaled, lm_loss)
    opened = 0
    out: dict[str, Any] = {}
    for static in (False, True):
        torch.manual_seed(0)
        model = _Branchy()
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        dm = ap.to_static(model, loss=loss_fn, optimizer=opt) if static else None
        losses = []
        for x, y in data:
            xd = ap.shard_tensor(x, mesh, [S0])
            losses.append(_step(dm, model, opt, loss_fn, xd, xd if same else ap.shard_tensor(y, mesh, [S0])))
        if dm is not None:
            opened = sum(len(kept) for kept in dm._sizes.open.values())
        out["static" if static else "eager"] = {
            "losses": losses, "params": [p.full_tensor().detach().clone() for p in model.parameters()],
            "captures": dm.captures if dm is not None else 0, "warnings": [], "opened": opened}
    return out


def test_a_size_the_step_branches_on_is_a_guard(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # 8 is captured at its sizes; 16 opens them (its program holds past 12 tokens: 20 too), 10
    # breaks that guard: captured again, for 12 tokens and fewer
    for res in world4.run(_small, [(8, 8), (8, 16), (8, 10), (8, 20)]):
        _assert_trains_as_eager(res)
        assert res["static"]["captures"] == 3, res["static"]["captures"]


def test_one_tensor_passed_as_two_arguments(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # the input as its own label: both arguments' fakes are one, with one symbol per size
    for res in world4.run(_small, [(8, 8), (8, 16), (8, 20)], True):
        _assert_trains_as_eager(res)
        assert res["static"]["captures"] == 2, res["static"]["captures"]


def test_a_loss_scaled_by_a_float_of_a_size(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_small, [(8, 8), (8, 10), (8, 16)], False, "root"):
        _assert_trains_as_eager(res)


def test_sizes_a_guard_fixes_are_captured_at_their_sizes(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # the log of the length is a Python number: the open capture (at 12) serves 12 only, so 16
    # and 20 are captured at their sizes (the cheaper capture), not with open sizes again
    for res in world4.run(_small, [(8, 8), (8, 12), (8, 16), (8, 20)], False, "log"):
        _assert_trains_as_eager(res)
        assert res["static"]["captures"] == 4, res["static"]["captures"]
        assert res["static"]["opened"] == 1, res["static"]["opened"]
