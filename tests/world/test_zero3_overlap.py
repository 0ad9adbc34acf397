"""ZeRO-3 with ``overlap=True`` (4 gloo ranks): the same training, bit for bit, as without.

A stack of blocks (each an ``nn.ModuleList`` child: a unit, and the root another) trains under
``ShardingStage3(mesh, overlap=True)`` and under the default (every collective waited for where it
is issued): losses and parameters are bitwise equal and match one process; a steady step issues
the same collectives, and each unit's gather after the first starts one unit ahead (forward: after
the unit before it gathered; backward: after the unit regathered before it). Also: a step that
takes another path through the model (a block skipped: the learned order guesses wrong), gradient
accumulation (a pending reduction's gradient accumulated into the last one's), blocks recomputed
in backward, mixed precision (gradients reduced in bf16, waited for and cast to fp32), and the
static capture (``ap.to_static``: its program holds the collectives, which its own passes
schedule), which trains as the eager step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Shard

PREFETCH = "autoparallel::zero3_prefetch"
VOCAB, WIDTH, BLOCKS = 13, 16, 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # (no bias on qkv: the key's bias has a zero gradient, whose rounding noise AdamW amplifies)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj, self.up = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).split(WIDTH, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / WIDTH ** 0.5, dim=-1)
        h = h + self.proj(a @ v)
        return h + self.down(F.gelu(self.up(h)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.blocks = nn.ModuleList([_Block() for _ in range(BLOCKS)])
        self.skip: int | None = None  # a block this step leaves out (the same on every rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for k, block in enumerate(self.blocks):
            if k != self.skip:
                h = block(h)
        return self.out(h)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (8, 6), generator=g), torch.randint(0, VOCAB, (8, 6), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # the global batch mean


# steps: (block skipped, micro-batches)
PLAN = [(None, 1), (None, 1), (1, 1), (None, 2), (None, 1)]


def _run(overlap: bool, recompute: bool = False, bf16: bool = False, steps: int = len(PLAN)) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(_Stack(), mesh)
    if recompute:
        for block in model.blocks:
            ap.recompute(block)
    mp = ap.MixedPrecision(torch.bfloat16) if bf16 else None
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ap.ShardingStage3(mesh, overlap=overlap),
                             mixed_precision=mp)
    losses, comms, prefetches = [], [], []
    for k, (skip, micro) in enumerate(PLAN[:steps]):
        model.skip = skip
        watch = k in (1, 2, steps - 1)  # (the profiler costs ~0.5 s a step here: a few steps only)
        with ap.CommDebugMode() as c, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if not watch:
                prof.stop()
            for m in range(micro):
                x, y = _data(10 * k + m)
                loss = _loss(model(ap.shard_tensor(x, mesh, [Shard(0)])), ap.shard_tensor(y, mesh, [Shard(0)]))
                loss.backward()
                losses.append(loss.detach().full_tensor())
            opt.step()
            opt.zero_grad()
        comms.append(c.get_comm_counts())
        prefetches.append(sum(e.count for e in prof.key_averages() if e.key == PREFETCH) if watch else None)
    return {"losses": torch.stack(losses), "params": [p.detach().full_tensor() for p in model.parameters()],
            "comms": comms, "prefetches": prefetches}


def _reference(steps: int = len(PLAN)) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for k, (skip, micro) in enumerate(PLAN[:steps]):
        model.skip = skip
        for m in range(micro):
            x, y = _data(10 * k + m)
            loss = _loss(model(x), y)  # each micro-batch's own mean, gradients summed (as above)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return {"losses": torch.stack(losses), "params": [p.detach() for p in model.parameters()]}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["losses"], b["losses"]) and all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


def _overlap(rank: int) -> dict[str, Any]:
    ref = _reference()
    out: dict[str, Any] = {}
    for name, kw in (("plain", {}), ("recompute", {"recompute": True, "steps": 2}), ("bf16", {"bf16": True, "steps": 2})):
        off, on = _run(False, **kw), _run(True, **kw)
        out[name] = {"bitwise": _same(off, on), "comms": (off["comms"], on["comms"]),
                     "prefetches": (off["prefetches"], on["prefetches"])}
        if name == "plain":
            torch.testing.assert_close(on["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
            for p, q in zip(on["params"], ref["params"]):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return out


def test_zero3_overlap_trains_bitwise_as_without(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_overlap)
    assert all(r == res[0] for r in res[1:]), "ranks disagree"
    r = res[0]
    for name in ("plain", "recompute", "bf16"):
        assert r[name]["bitwise"], name
        off, on = r[name]["comms"]
        for (skip, _), a, b in zip(PLAN, off, on):
            if skip is None or name == "recompute":
                assert a == b, (name, off, on)  # the same collectives, started earlier
            else:  # the learned order guessed the skipped block: one gather started in vain
                assert b == {**a, "all_gather": a["all_gather"] + 1}, (name, off, on)
        assert not any(r[name]["prefetches"][0]), name
    # the first step learns the order; from the second on, forward: each block's gather starts
    # when the unit before it has gathered (3), backward: the blocks' regathers, one ahead (3)
    on = r["plain"]["prefetches"][1]
    assert on[1] == 6 and on[-1] == 6, on
    # recomputed blocks gather in their recomputation: no gather runs ahead of a recomputed one
    assert r["recompute"]["prefetches"][1][1] < 6, r["recompute"]["prefetches"]


def _static(rank: int) -> bool:
    """``to_static`` of an overlapping ZeRO-3 step trains as the eager step does."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    results = []
    for static in (False, True):
        torch.manual_seed(0)
        model = ap.shard_layer(_Stack(), mesh)
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ap.ShardingStage3(mesh, overlap=True))
        dm = ap.to_static(model, loss=_loss, optimizer=opt) if static else None
        losses = []
        for k in range(4):
            x, y = (ap.shard_tensor(t, mesh, [Shard(0)]) for t in _data(k))
            if dm is not None:
                losses.append(torch.as_tensor(dm(x, y)).float())
                continue
            loss = _loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().full_tensor())
        results.append((torch.stack(losses), [p.detach().full_tensor() for p in model.parameters()]))
    (l0, p0), (l1, p1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return True


def test_zero3_overlap_static_trains_as_eager(world4):  # type: ignore[no-untyped-def]
    assert world4.run(_static) == [True] * 4


@pytest.mark.pure  # single process, no world
def test_overlap_is_validated() -> None:
    mesh = ap.ProcessMesh.simulated([4])
    assert ap.ShardingStage3(mesh).overlap is False
    assert "overlap=True" in repr(ap.ShardingStage3(mesh, overlap=True))
    with pytest.raises(TypeError, match="overlap must be True or False"):
        ap.ShardingStage3(mesh, overlap=1)  # type: ignore[arg-type]


class _SPBlock(nn.Module):
    """LayerNorms on sequence shards (their weights' gradients are Partial over the tp axis)
    around a Megatron MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2, self.ln_f = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x + self.fc2(F.gelu(self.fc1(self.ln(x)))))


def _sequence_parallel(rank: int, overlap: bool) -> dict[str, Any]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    torch.manual_seed(0)
    model = ap.parallelize(_SPBlock(), mesh, {"ln": ap.SequenceParallel(), "fc1": ap.ColWiseParallel(),
                                              "fc2": ap.RowWiseParallel(), "ln_f": ap.SequenceParallel()})
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh, "dp", overlap=overlap))
    g = torch.Generator().manual_seed(1)
    losses, comms = [], []
    for _ in range(3):
        x, y = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 8, generator=g)
        place = [Shard(0), Shard(1)]
        with ap.CommDebugMode() as c:
            loss = F.mse_loss(model(ap.shard_tensor(x, mesh, place)), ap.shard_tensor(y, mesh, place))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().full_tensor())
        comms.append(c.get_comm_counts())
    return {"losses": torch.stack(losses), "params": [p.detach().full_tensor() for p in model.parameters()], "comms": comms}


def test_zero3_overlap_reduces_sequence_parallel_weights_bucketed(world4):  # type: ignore[no-untyped-def]
    """The LayerNorm weights' Partial tp sums are reduced in one bucketed all-reduce with
    ``overlap=True`` too (it reduced each parameter alone, full size): the same collectives and
    values as without."""
    for off, on in zip(world4.run(_sequence_parallel, False), world4.run(_sequence_parallel, True)):
        assert on["comms"] == off["comms"], (off["comms"], on["comms"])
        torch.testing.assert_close(on["losses"], off["losses"], rtol=1e-6, atol=1e-7)
        for p, q in zip(on["params"], off["params"]):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
