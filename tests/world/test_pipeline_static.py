"""Static pipelines (``Pipeline(..., static=True)``): each chunk's forward and backward captured
once and replayed per micro-batch train exactly as the eager pipeline (4 gloo ranks, 2 stage
meshes of 2 ranks; data parallel or tensor parallel inside a stage; FThenB, 1F1B,
Interleaved1F1B, ZBH1 and ZBV; dropout draws eager's masks) and like one process."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel import Shard, compat
from autoparallel.pipeline import Pipeline, split_sequential
from autoparallel.static.chunk import _Programs

D, BATCH, STEPS = 8, 8, 3


class Block(nn.Module):
    def __init__(self, p: float = 0.0, item: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.drop = nn.Dropout(p)
        self.item = item

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.mul_(1.0)  # an in-place write on an activation stays in the forward program
        h = torch.tanh(h)
        if self.item and self.training and float(h.abs().sum()) > 1e9:  # data-dependent Python: never true, but read
            h = h * 0
        return x + self.drop(self.fc2(h))


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square().mean()


def _train(rank: int, static: bool, schedule: str, chunks: int, tp: bool, p: float, item: bool = False,
           zero3: bool = False, notes: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    ref = nn.Sequential(*[Block(p, item=item and i == 3) for i in range(4)])
    model = copy.deepcopy(ref)
    names = ["tp"] if tp else ["dp"]
    meshes = [ap.ProcessMesh([0, 1], dim_names=names), ap.ProcessMesh([2, 3], dim_names=names)]
    plan = {"*.fc1": ap.ColWiseParallel(), "*.fc2": ap.RowWiseParallel()} if tp else None
    stages = split_sequential(model, meshes, num_chunks=chunks, plan=plan, placement="v" if schedule == "ZBV" else "loop")
    pipe = Pipeline(stages, _mse, num_microbatches=4, schedule=schedule, static=static)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if zero3:  # parameters sharded along each stage's dp axis, gathered per chunk (inside its programs)
        opt = ap.shard_optimizer(opt, ap.ShardingStage3(ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"]), "dp"))
    place = [ap.Replicate()] if tp else [Shard(0)]
    losses, kinds = [], []
    torch.manual_seed(1)  # the dropout masks' stream
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            if notes:  # what a training loop may keep on the blocks, which no forward reads
                for block in model:
                    block.step = i
                    block.log = {"step": i, "seen": [i] * i}
            opt.zero_grad()
            loss = pipe.step(ap.shard_tensor(x, meshes[0], place), ap.shard_tensor(t, stages[-1].mesh, place))
            opt.step()
            losses.append(float(loss.full_tensor()) if rank in stages[-1].mesh else None)
            kinds.append(sorted(type(v).__name__ for c in pipe.programs.values() for v in c._programs.values()))
    params = {n: q.full_tensor().detach().clone() for n, q in model.named_parameters() if rank in q.process_mesh}
    return {"losses": losses, "params": params, "kinds": kinds, "global_hooks": compat.global_module_hooks(),
            "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)],
            "programs": sum(isinstance(v, _Programs) for c in pipe.programs.values() for v in c._programs.values()),
            "cut": sum(isinstance(v, _Programs) and v.input_grad is not None
                       for c in pipe.programs.values() for v in c._programs.values())}


def _reference(schedule: str, chunks: int, p: float) -> list[float]:
    torch.manual_seed(0)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    ref = nn.Sequential(*[Block(p) for _ in range(4)])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _mse(ref(x), t)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


_RUNS: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


def _trained(world4: Any, *args: Any) -> list[dict[str, Any]]:
    """``_train`` on every rank, each configuration run once per module (tests share results)."""
    if args not in _RUNS:
        _RUNS[args] = world4.run(_train, *args)
    return _RUNS[args]


@pytest.mark.parametrize("schedule, chunks, tp", [
    ("FThenB", 1, False), ("1F1B", 1, False), ("Interleaved1F1B", 2, False), ("1F1B", 1, True), ("ZBH1", 1, False),
    ("ZBV", 2, True),
], ids=["fthenb-dp", "1f1b-dp", "interleaved-dp", "1f1b-tp", "zbh1-dp", "zbv-tp"])
def test_static_pipeline_equals_eager_and_one_process(world4: Any, schedule: str, chunks: int, tp: bool) -> None:
    eager = _trained(world4, False, schedule, chunks, tp, 0.0)
    static = _trained(world4, True, schedule, chunks, tp, 0.0)
    ref = _reference(schedule, chunks, 0.0)
    for e, s in zip(eager, static):
        assert s["warnings"] == [], s["warnings"]
        assert s["losses"] == e["losses"]  # the same local ops: bitwise
        for name, v in e["params"].items():
            torch.testing.assert_close(s["params"][name], v, rtol=1e-6, atol=1e-7, msg=name)
        if s["losses"][0] is not None:  # the last stage's ranks (the first mesh's for a V)
            torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-7)
        # micro-batch 1 eager, micro-batch 2 captures, then replays: every chunk of this rank has a program
        assert s["programs"] == chunks and s["kinds"][-1] == ["_Programs"] * chunks


def test_zero_bubble_trains_bitwise_like_1f1b_eager_and_static_with_tp(world4: Any) -> None:
    """ZBH1 runs each backward as B then W (eager: two autograd calls; static: the captured
    backward cut in two): the same ops on the same values as 1F1B's one backward, and the
    weight gradients added in the same micro-batch order, so training is bitwise 1F1B's."""
    one = _trained(world4, False, "1F1B", 1, True, 0.0)
    eager = _trained(world4, False, "ZBH1", 1, True, 0.0)
    static = _trained(world4, True, "ZBH1", 1, True, 0.0)
    for rank, (o, e, s) in enumerate(zip(one, eager, static)):
        assert s["warnings"] == [] and e["losses"] == o["losses"] == s["losses"]
        for name, v in o["params"].items():
            assert torch.equal(e["params"][name], v) and torch.equal(s["params"][name], v), name
        assert s["cut"] == (1 if rank >= 2 else 0)  # the second stage's backward is cut into B and W


def test_static_pipeline_draws_the_eager_dropout_masks(world4: Any) -> None:
    eager = world4.run(_train, False, "1F1B", 1, False, 0.3)
    static = world4.run(_train, True, "1F1B", 1, False, 0.3)
    for e, s in zip(eager, static):
        assert s["losses"] == e["losses"]
        for name, v in e["params"].items():
            torch.testing.assert_close(s["params"][name], v, rtol=1e-6, atol=1e-7, msg=name)


def test_an_uncapturable_chunk_stays_eager_with_one_warning(world4: Any) -> None:
    eager = world4.run(_train, False, "1F1B", 1, False, 0.0, True)
    static = world4.run(_train, True, "1F1B", 1, False, 0.0, True)
    for rank, (e, s) in enumerate(zip(eager, static)):
        assert s["losses"] == e["losses"]
        if rank < 2:  # the first stage captures
            assert s["warnings"] == [] and s["programs"] == 1
        else:         # the last stage reads a Python value: one warning, eager from then on
            assert len(s["warnings"]) == 1 and "runs eagerly" in s["warnings"][0] and "Python value" in s["warnings"][0]
            assert s["programs"] == 0


def test_static_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="static must be a bool"):
        Pipeline([], _mse, num_microbatches=2, static="yes")  # type: ignore[arg-type]


def test_zero3_inside_static_stages_trains_bitwise_like_eager_with_one_capture_per_chunk(world4: Any) -> None:
    """ZeRO-3 inside the stages: each chunk's programs hold its unit's gathers, captured at the
    first micro-batch once (no second signature once the unit's hooks exist), and training is
    eager's, bit for bit. No process-wide module hook is left: a rank finds its own stage's
    modules, and never runs the other stage's (a hook left would follow every later model)."""
    eager = _trained(world4, False, "1F1B", 1, False, 0.0, False, True)
    static = _trained(world4, True, "1F1B", 1, False, 0.0, False, True)
    ref = _reference("1F1B", 1, 0.0)
    for e, s in zip(eager, static):
        assert s["warnings"] == [] and s["losses"] == e["losses"]
        for name, v in e["params"].items():
            assert torch.equal(s["params"][name], v), name
        if s["losses"][0] is not None:
            torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-7)
        assert all(k == ["_Programs"] for k in s["kinds"]) and s["programs"] == 1
        assert not e["global_hooks"] and not s["global_hooks"]


def _lengths(rank: int, static: bool, schedule: str, tp: bool) -> dict[str, Any]:
    """``Block``s over 2 stages trained on ``[8, S, D]`` batches whose length ``S`` changes every step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    names = ["tp"] if tp else ["dp"]
    meshes = [ap.ProcessMesh([0, 1], dim_names=names), ap.ProcessMesh([2, 3], dim_names=names)]
    plan = {"*.fc1": ap.ColWiseParallel(), "*.fc2": ap.RowWiseParallel()} if tp else None
    stages = split_sequential(model, meshes, num_chunks=1, plan=plan)
    pipe = Pipeline(stages, _mse, num_microbatches=2, schedule=schedule, static=static)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    place = [ap.Replicate()] if tp else [Shard(0)]
    g = torch.Generator().manual_seed(3)
    losses = []
    for length in (4, 6, 8, 10, 6):
        x, t = torch.randn(BATCH, length, D, generator=g), torch.randn(BATCH, length, D, generator=g)
        opt.zero_grad()
        loss = pipe.step(ap.shard_tensor(x, meshes[0], place), ap.shard_tensor(t, stages[-1].mesh, place))
        opt.step()
        losses.append(float(loss.full_tensor()) if rank in stages[-1].mesh else None)
    params = {n: q.full_tensor().detach().clone() for n, q in model.named_parameters() if rank in q.process_mesh}
    # distinct captured forward programs of this rank's chunks (a program of open sizes serves many lengths)
    programs = {id(v.forward) for c in pipe.programs.values() for v in c._programs.values() if isinstance(v, _Programs)}
    return {"losses": losses, "params": params, "programs": len(programs)}


@pytest.mark.parametrize("tp", [False, True], ids=["dp", "tp"])
def test_static_chunks_serve_new_lengths_with_open_sizes(world4: Any, tp: bool) -> None:  # type: ignore[no-untyped-def]
    # the first length is captured at its sizes, the second with them open: that program serves the rest
    eager = world4.run(_lengths, False, "1F1B", tp)
    static = world4.run(_lengths, True, "1F1B", tp)
    for e, s in zip(eager, static):
        for a, b in zip(e["losses"], s["losses"]):
            assert (a is None and b is None) or abs(a - b) <= 1e-5 * abs(a), (e["losses"], s["losses"])
        for name in e["params"]:
            torch.testing.assert_close(s["params"][name], e["params"][name], rtol=1e-5, atol=1e-6)
        assert s["programs"] == 2, s["programs"]


def test_attributes_no_forward_reads_keep_each_chunks_programs(world4: Any) -> None:
    """A counter and a log the loop writes on every block at every step: no forward reads them,
    so each chunk keeps the one program it captured."""
    eager = _trained(world4, False, "1F1B", 1, False, 0.0, False, False, True)
    static = _trained(world4, True, "1F1B", 1, False, 0.0, False, False, True)
    ref = _reference("1F1B", 1, 0.0)
    for e, s in zip(eager, static):
        assert s["warnings"] == [], s["warnings"]
        assert s["losses"] == e["losses"]
        if s["losses"][0] is not None:
            torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-7)
        assert s["programs"] == 1, s["kinds"]
