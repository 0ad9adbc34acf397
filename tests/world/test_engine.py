"""``ap.Engine`` and ``ap.Strategy``: the primer's static semi-auto programs on the dynamic API.

Data parallel (default Strategy, 4 ranks), group sharded (sharding stage 1/2/3, degree 4),
model parallel (SimpleNet with dims mappings in forward on a mesh ["mp"], 2 ranks), recompute,
gradient merge: each trained with ``engine.run`` over ``engine.dataloader`` equals one process
(loss and parameters within 1e-5 relative), top-1/top-5 accuracy counts the global batch as one
process does, the Engine equals the same layout written with the dynamic API (fp32 and bf16
mixed precision), checkpoints round-trip, and bad configurations raise the same clear error on
every rank.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import autoparallel as ap

STEPS, BATCH, IN, INNER, OUT = 3, 8, 16, 32, 10


class SimpleNet(nn.Module):
    """The primer's SimpleNet; with a mesh, its model-parallel program (dims mappings in forward)."""

    def __init__(self, mesh: ap.ProcessMesh | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.linear1 = nn.Linear(IN, INNER)
        self.linear2 = nn.Linear(INNER, IN)
        self.linear3 = nn.Linear(IN, OUT)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            ap.shard_tensor(self.linear1.weight, self.mesh, ["mp", None])  # column-parallel
            ap.shard_tensor(self.linear1.bias, self.mesh, ["mp"])
            ap.shard_tensor(self.linear2.weight, self.mesh, [None, "mp"])  # row-parallel
        return self.relu(self.linear3(self.linear2(self.linear1(x))))


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, ap.DistTensor) else t).detach().clone()


def _reference(batch: int = BATCH, steps: int = STEPS) -> dict[str, Any]:
    """One process: losses, accuracies (over the pass so far) and parameters."""
    torch.manual_seed(0)
    model = SimpleNet()
    opt = _optimizer(model)
    ds = _dataset(batch * steps)
    losses, accs, hits, seen = [], [], torch.zeros(2), 0
    for i in range(steps):
        x, y = ds[i * batch:(i + 1) * batch]
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        top = out.detach().topk(5, dim=1).indices
        hits += torch.stack([(top[:, :1] == y[:, None]).sum(), (top == y[:, None]).sum()]).float()
        seen += batch
        losses.append(float(loss.detach()))
        accs.append((float(hits[0]) / seen, float(hits[1]) / seen))
    return {"losses": losses, "accs": accs, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _strategy(kind: str) -> ap.Strategy:
    s = ap.Strategy()
    if kind.startswith(("zero", "hybrid")):
        s.sharding.enable = True
        s.sharding.stage = int(kind[-1])
        s.sharding.degree = 4 if kind.startswith("zero") else 2  # hybrid: 2 groups of 2 share the states
    if kind == "recompute":
        s.recompute.enable = True
    if kind == "merge":
        s.gradient_merge.enable = True
        s.gradient_merge.k_steps = 2
    if kind == "full":  # ap.auto_parallel chooses the layout
        s.auto_mode = "full"
    return s


def _engine_program(rank: int, kind: str) -> dict[str, Any]:
    """The primer's program: Engine, prepare, dataloader, run per batch."""
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"]) if kind == "mp" else None
    torch.manual_seed(0)
    model = SimpleNet(mesh)
    engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model),
                       metrics=ap.metrics.Accuracy(topk=(1, 5)), strategy=_strategy(kind))
    engine.prepare(inputs_spec=ap.InputSpec([None, IN], torch.float32, "img"),
                   labels_spec=ap.InputSpec([None], torch.int64, "label"), mode="train")
    batch = BATCH // 2 if kind == "merge" else BATCH    # gradient merge: two half batches per step
    steps = STEPS * 2 if kind == "merge" else STEPS
    loader = engine.dataloader(_dataset(batch * steps), batch_size=batch, epochs=1, mode="train")
    outs = [engine.run(data, mode="train") for data in loader()]
    return {
        "outs": outs,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "placements": {n: list(p.placements) for n, p in model.named_parameters()},
        "optimizer": type(engine.optimizer).__name__,
        "state": sorted({str(list(v.placements)) for st in engine.optimizer.state.values() for v in st.values()
                         if isinstance(v, ap.DistTensor) and v.dim() > 0}),
    }


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-5 * max(abs(want), 1e-6)


def _check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for n, w in want.items():
        rel = float((got[n] - w).norm() / w.norm())
        assert rel <= 1e-5, (n, rel)


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3", "hybrid1", "hybrid3", "recompute", "full"])
def test_programs_train_like_one_process(world4: Any, kind: str) -> None:
    ref = _reference()
    for o in world4.run(_engine_program, kind):
        assert [set(d) for d in o["outs"]] == [{"loss", "acc_top1", "acc_top5"}] * STEPS
        losses = [d["loss"] for d in o["outs"]]
        assert all(_close(g, w) for g, w in zip(losses, ref["losses"], strict=True)), (losses, ref["losses"])
        accs = [(d["acc_top1"], d["acc_top5"]) for d in o["outs"]]
        assert accs == pytest.approx(ref["accs"], abs=1e-9)  # the global batch, counted once
        _check_params(o["params"], ref["params"])
        assert o["optimizer"] == "ShardedOptimizer"
        if kind.startswith("hybrid"):  # momentum split within each group of 2, replicated across groups
            assert o["state"] == ["[Replicate(), Shard(0)]"], o["state"]


def test_model_parallel_program_keeps_its_layout(world2: Any) -> None:
    ref = _reference()
    for o in world2.run(_engine_program, "mp"):
        losses = [d["loss"] for d in o["outs"]]
        assert all(_close(g, w) for g, w in zip(losses, ref["losses"], strict=True)), (losses, ref["losses"])
        assert [(d["acc_top1"], d["acc_top5"]) for d in o["outs"]] == pytest.approx(ref["accs"], abs=1e-9)
        _check_params(o["params"], ref["params"])
        assert o["placements"]["linear1.weight"] == [ap.Shard(0)]
        assert o["placements"]["linear2.weight"] == [ap.Shard(1)]
        assert o["placements"]["linear3.weight"] == [ap.Replicate()]


def test_gradient_merge_equals_the_doubled_batch(world4: Any) -> None:
    ref = _reference(batch=BATCH, steps=STEPS)  # k_steps=2 of half batches: one step of the whole batch
    for o in world4.run(_engine_program, "merge"):
        _check_params(o["params"], ref["params"])
        halves = [d["loss"] for d in o["outs"]]
        assert len(halves) == 2 * STEPS


def _engine_vs_dynamic(rank: int, amp: bool) -> dict[str, Any]:
    ds = _dataset(BATCH * STEPS)
    torch.manual_seed(0)
    model = SimpleNet()
    strategy = ap.Strategy()
    strategy.amp.enable = amp
    engine = ap.Engine(model, F.cross_entropy, _optimizer(model), strategy=strategy)
    engine_losses = [engine.run(d)["loss"] for d in engine.dataloader(ds, batch_size=BATCH)()]

    replayed = [type(v).__name__ for v in engine._program._programs.values()] if engine._program else []

    def dynamic(static: bool) -> list[float]:
        torch.manual_seed(0)
        model = SimpleNet()
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(_optimizer(model), mixed_precision=ap.MixedPrecision(torch.bfloat16) if amp else None)
        loader = ap.shard_dataloader(torch.utils.data.DataLoader(ds, batch_size=BATCH, drop_last=True), mesh,
                                     shard_dims="dp")
        step = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if static else None
        losses = []
        for x, y in loader:
            if step is not None:
                loss = step(x, y)
            else:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.full_tensor()))
        return losses

    return {"engine": engine_losses, "dynamic": dynamic(False), "to_static": dynamic(True), "replayed": replayed}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_engine_equals_the_dynamic_api(world4: Any, amp: bool) -> None:
    """The Engine's step is the dynamic API's ``to_static`` step (bitwise), and here also the eager
    one's; after its first two runs (eager, captured) it replays the program."""
    for o in world4.run(_engine_vs_dynamic, amp):
        assert o["engine"] == o["to_static"]
        assert o["engine"] == o["dynamic"]
        assert o["replayed"] == ["_Program"]


def _fit_save_load(rank: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SimpleNet()
    engine = ap.Engine(model, F.cross_entropy, _optimizer(model), metrics=ap.metrics.Accuracy())
    history = engine.fit(_dataset(BATCH * STEPS), batch_size=BATCH, epochs=2, verbose=0)
    evaluated = engine.evaluate(_dataset(BATCH * 2), batch_size=BATCH, verbose=0)
    preds = engine.predict(_dataset(BATCH * 2), batch_size=BATCH, verbose=0)
    engine.save(folder)
    saved = {n: _full(p) for n, p in model.named_parameters()}
    torch.manual_seed(1)
    other = SimpleNet()
    again = ap.Engine(other, F.cross_entropy, _optimizer(other), metrics=ap.metrics.Accuracy())
    again.prepare(ap.InputSpec([None, IN]), ap.InputSpec([None], "int64"))
    again.load(folder)
    # the model alone from a checkpoint with the optimizer, and the default load of a model-only one
    third = SimpleNet()
    alone = ap.Engine(third, F.cross_entropy, _optimizer(third))
    alone.prepare(ap.InputSpec([None, IN]), ap.InputSpec([None], "int64"))
    alone.load(folder, load_optimizer=False)
    engine.save(folder + "-model", training=False)
    with pytest.warns(UserWarning, match="holds no optimizer state"):
        alone.load(folder + "-model")
    return {"history": history, "eval": evaluated, "again": again.evaluate(_dataset(BATCH * 2), batch_size=BATCH, verbose=0),
            "preds": [tuple(p.shape) for p in preds],
            "loaded": all(torch.equal(saved[n], _full(p)) and torch.equal(saved[n], _full(q))
                          for (n, p), q in zip(other.named_parameters(), third.parameters()))}


def test_fit_evaluate_predict_save_load(world4: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        outs = world4.run(_fit_save_load, os.path.join(d, "ckpt"))
    for o in outs:
        assert [set(h) for h in o["history"]] == [{"loss", "acc"}] * 2
        assert o["history"][1]["loss"] < o["history"][0]["loss"]
        assert o["preds"] == [(BATCH, OUT)] * 2 and o["loaded"]
        assert o["again"] == pytest.approx(o["eval"], rel=1e-6)
    assert all(o["history"] == outs[0]["history"] for o in outs)  # the same numbers on every rank


# ---- bad configurations: clear errors, the same on every rank ------------------------------------
@pytest.mark.pure
def test_strategy_refuses_unknown_names_and_bad_values() -> None:
    s = ap.Strategy()
    with pytest.raises(AttributeError, match="'shardin'.*sharding, pipeline, amp"):
        s.shardin.enable = True  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="'enabel'.*enable, stage, degree"):
        s.sharding.enabel = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"stage must be one of \(1, 2, 3\), got 4"):
        s.sharding.stage = 4
    with pytest.raises(ValueError, match="dtype must be one of.*'float8'"):
        s.amp.dtype = "float8"
    with pytest.raises(ValueError, match="auto_mode"):
        s.auto_mode = "auto"
    with pytest.raises(ValueError, match="init_loss_scaling must be a number > 0, got 0"):
        s.amp.init_loss_scaling = 0
    assert s.amp.init_loss_scaling == 32768.0 and s.amp.use_dynamic_loss_scaling is True  # Paddle's defaults
    assert ap.Strategy({"sharding": {"enable": True, "stage": 2}}).sharding.stage == 2
    s.pipeline.schedule_mode = "VPP"  # Paddle's names are taken, and kept canonical
    assert s.pipeline.schedule_mode == "Interleaved1F1B"
    s.pipeline.schedule_mode = "zbh1"
    assert s.pipeline.schedule_mode == "ZBH1"
    with pytest.raises(ValueError, match=r"ZBV places two chunks per stage mesh in a V.*placement='v'"):
        s.pipeline.schedule_mode = "ZBVPP"
    with pytest.raises(ValueError, match=r"schedule_mode must be one of .*got 'GPipe2'"):
        s.pipeline.schedule_mode = "GPipe2"


def _engine_with(rank: int, setting: str) -> None:
    s = ap.Strategy()
    if setting == "degree":
        s.sharding.enable, s.sharding.degree = True, 3
    elif setting == "degree_not_dp":
        s.sharding.enable, s.sharding.degree = True, 2
    elif setting == "pipeline":
        s.pipeline.enable = True
    elif setting == "full":
        s.auto_mode = "full"
        s.pipeline.enable = True
    model = SimpleNet()
    if setting == "degree_not_dp":  # laid out by the user on a "dp" mesh: hybrid sharding is the Engine's own layout's
        ap.shard_layer(model, ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]))
    engine = ap.Engine(model, F.cross_entropy, _optimizer(model), strategy=s)
    engine.prepare(ap.InputSpec([None, IN]), ap.InputSpec([None], torch.int64))
    engine.run((torch.zeros(BATCH, IN), torch.zeros(BATCH, 1, dtype=torch.int64)))


@pytest.mark.parametrize("setting,exc,text", [
    ("degree", ValueError, "degree 3 does not divide the world of 4 processes"),
    ("degree_not_dp", ValueError, "degree 2 differs from the data-parallel degree 4"),  # (hybrid: the Engine's layout only)
    ("pipeline", ValueError, "the forward assigns nothing to a stage mesh"),
    ("full", NotImplementedError, "auto_mode='full' does not search pipeline splits"),
    ("bad_label", ValueError, "shape (8, 1) does not fit InputSpec([None], torch.int64)"),
])
def test_bad_configurations_raise_on_every_rank(world4: Any, setting: str, exc: type, text: str) -> None:
    with pytest.raises(exc) as info:
        world4.run(_engine_with, setting, timeout=60)
    assert text in str(info.value)


# ---- pipelines by mesh assignment (the primer's fourth program) ----------------------------------
class PipeNet(nn.Module):
    """SimpleNet with its layers assigned to pipeline stages by ``shard_op`` sub-meshes."""

    def __init__(self, mesh: ap.ProcessMesh, order: str = "in order") -> None:
        super().__init__()
        self.mesh, self.order = mesh, order
        self.linear1 = nn.Linear(IN, INNER)
        self.linear2 = nn.Linear(INNER, IN)
        self.linear3 = nn.Linear(IN, OUT)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ap.shard_op(self.linear1, self.mesh[0])(x)
        x = self.linear2(x)                                  # follows its input: stage 0
        x = ap.shard_op(self.linear3, self.mesh[1])(x)
        if self.order == "back":                             # returns to the first stage's mesh
            x = ap.shard_op(self.relu, self.mesh[0])(x)
        return self.relu(x)


def _pipeline_program(rank: int, schedule: str, micro: int = BATCH // 2) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["pp"])
    torch.manual_seed(0)
    model = PipeNet(mesh)
    s = ap.Strategy()
    s.pipeline.enable = True
    s.pipeline.micro_batch_size = micro
    s.pipeline.accumulate_steps = BATCH // micro
    s.pipeline.schedule_mode = schedule
    engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model),
                       metrics=ap.metrics.Accuracy(topk=(1, 5)), strategy=s)
    engine.prepare(inputs_spec=ap.InputSpec([BATCH, IN], torch.float32, "img"),
                   labels_spec=ap.InputSpec([BATCH], torch.int64, "label"), mode="train")
    loader = engine.dataloader(_dataset(BATCH * STEPS), batch_size=BATCH, epochs=1, mode="train")
    outs = [engine.run(data, mode="train") for data in loader()]
    ev = engine.evaluate(_dataset(BATCH * 2), batch_size=BATCH, verbose=0)
    pred = engine.predict(_dataset(BATCH), batch_size=BATCH, verbose=0)
    return {"outs": outs, "eval": ev, "pred": pred[0],
            "params": {n: _full(p) for n, p in model.named_parameters() if rank in p.process_mesh},
            "meshes": {n: p.process_mesh.process_ids for n, p in model.named_parameters()}}


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "ZBH1"])
def test_pipeline_by_shard_op_meshes_trains_like_one_process(world2: Any, schedule: str) -> None:
    ref = _reference()
    got = world2.run(_pipeline_program, schedule)
    for r, o in enumerate(got):
        # linear1 and linear2 (which follows its input) on stage 0, linear3 on stage 1
        assert o["meshes"] == {"linear1.weight": (0,), "linear1.bias": (0,), "linear2.weight": (0,),
                               "linear2.bias": (0,), "linear3.weight": (1,), "linear3.bias": (1,)}
        losses = [d["loss"] for d in o["outs"]]  # on every rank, not only the last stage's
        assert all(_close(g, w) for g, w in zip(losses, ref["losses"], strict=True)), (r, losses, ref["losses"])
        accs = [(d["acc_top1"], d["acc_top5"]) for d in o["outs"]]
        assert accs == pytest.approx(ref["accs"], abs=1e-9)
        _check_params(o["params"], {n: p for n, p in ref["params"].items() if n in o["params"]})
        assert set(o["eval"]) == {"loss", "acc_top1", "acc_top5"}
        assert tuple(o["pred"].shape) == (BATCH, OUT)
    assert got[0]["eval"] == got[1]["eval"]
    assert torch.equal(got[0]["pred"], got[1]["pred"])


def _pipeline_bad(rank: int, what: str) -> None:
    mesh = ap.ProcessMesh([0, 1], dim_names=["pp"])
    model = PipeNet(mesh, order="back" if what == "order" else "in order")
    s = ap.Strategy()
    s.pipeline.enable = True
    s.pipeline.micro_batch_size = 3 if what == "micro" else BATCH // 2
    s.pipeline.accumulate_steps = 2
    engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), strategy=s)
    engine.prepare(ap.InputSpec([None, IN]), ap.InputSpec([None], torch.int64))
    engine.run((torch.zeros(BATCH, IN), torch.zeros(BATCH, dtype=torch.int64)))


@pytest.mark.parametrize("what,text", [
    ("order", "sub-mesh stages must cover the model in order"),
    ("micro", "make batch_size = micro_batch_size x accumulate_steps"),
])
def test_bad_pipeline_strategies_raise_on_every_rank(world2: Any, what: str, text: str) -> None:
    with pytest.raises(ValueError) as info:
        world2.run(_pipeline_bad, what, timeout=60)
    assert text in str(info.value)


class PipeTPNet(SimpleNet):
    """Tensor parallelism inside a pipeline stage, written in forward: on ``grid[0]`` linear1 is
    column-parallel and linear2 row-parallel by dims mappings; linear3 runs on ``grid[1]`` through
    ``shard_op`` with mappings (its input and output replicated). ``wrong``: ``"mesh"``, linear2's
    weight annotated on the other stage's mesh; ``"axis"``, linear3's input mapping names an axis
    the mesh lacks."""

    def __init__(self, grid: ap.ProcessMesh, wrong: str | None = None) -> None:
        super().__init__()
        self.grid, self.wrong = grid, wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m0, m1 = self.grid[0], self.grid[1]
        ap.shard_tensor(self.linear1.weight, m0, ["mp", None])
        ap.shard_tensor(self.linear1.bias, m0, ["mp"])
        ap.shard_tensor(self.linear2.weight, m1 if self.wrong == "mesh" else m0, [None, "mp"])
        x = ap.shard_op(self.linear1, m0)(x)
        x = self.linear2(x)
        x = ap.shard_op(self.linear3, m1, [[None, "tp" if self.wrong == "axis" else None]], [[None, None]])(x)
        return self.relu(x)


def _pipeline_tp(rank: int, wrong: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = PipeTPNet(ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"]), wrong)
    s = ap.Strategy()
    s.pipeline.enable = True
    s.pipeline.micro_batch_size = BATCH // 2
    s.pipeline.accumulate_steps = 2
    engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), strategy=s)
    loader = engine.dataloader(_dataset(BATCH * STEPS), batch_size=BATCH, mode="train")
    losses = [engine.run(data, mode="train")["loss"] for data in loader()]
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters() if rank in p.process_mesh},
            "layout": {n: (p.process_mesh.process_ids, list(p.placements)) for n, p in model.named_parameters()}}


def test_dims_mappings_inside_a_pipelined_forward_train_like_one_process(world4: Any) -> None:
    ref = _reference()
    S0, S1, R = ap.Shard(0), ap.Shard(1), ap.Replicate()
    for r, o in enumerate(world4.run(_pipeline_tp)):
        assert o["layout"] == {"linear1.weight": ((0, 1), [S0]), "linear1.bias": ((0, 1), [S0]),
                               "linear2.weight": ((0, 1), [S1]), "linear2.bias": ((0, 1), [R]),
                               "linear3.weight": ((2, 3), [R]), "linear3.bias": ((2, 3), [R])}
        assert all(_close(g, w) for g, w in zip(o["losses"], ref["losses"], strict=True)), (r, o["losses"])
        _check_params(o["params"], {n: p for n, p in ref["params"].items() if n in o["params"]})


@pytest.mark.parametrize("wrong,text", [
    ("mesh", "'linear2.weight' is laid out on .* but used by stage 0"),
    ("axis", "names mesh axis 'tp', which mesh .* lacks"),
])
def test_bad_layouts_in_a_pipelined_forward_raise_on_every_rank(world4: Any, wrong: str, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        world4.run(_pipeline_tp, wrong, timeout=60)


def _pipeline_dynamic(rank: int) -> dict[str, Any]:
    """The Engine's pipeline program written with the dynamic API."""
    from torch.utils.data import DataLoader

    from autoparallel.pipeline import Pipeline, split_by_meshes

    mesh = ap.ProcessMesh([0, 1], dim_names=["pp"])
    torch.manual_seed(0)
    model = PipeNet(mesh)
    pipe = Pipeline(split_by_meshes(model), nn.CrossEntropyLoss(), num_microbatches=2, schedule="1F1B")
    opt = ap.shard_optimizer(_optimizer(model))
    loader = ap.shard_dataloader(DataLoader(_dataset(BATCH * STEPS), batch_size=BATCH, drop_last=True),
                                 [mesh[0], mesh[1]])
    losses = []
    for x, y in loader:
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor()) if rank in mesh[1] else None)
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters() if rank in p.process_mesh}}


def test_engine_pipeline_is_the_dynamic_pipeline(world2: Any) -> None:
    engine = world2.run(_pipeline_program, "1F1B")
    dynamic = world2.run(_pipeline_dynamic)
    assert [d["loss"] for d in engine[1]["outs"]] == dynamic[1]["losses"]  # bitwise (the last stage's ranks)
    for r in range(2):
        assert engine[r]["params"].keys() == dynamic[r]["params"].keys()
        for n, p in engine[r]["params"].items():
            assert torch.equal(p, dynamic[r]["params"][n]), (r, n)


# ---- float16 with loss scaling --------------------------------------------------------------------
def _fp16(rank: int, how: str) -> dict[str, Any]:
    """SimpleNet data parallel in float16 with a scaled loss: the Engine, or the dynamic API."""
    torch.manual_seed(0)
    model = SimpleNet()
    data = _dataset(BATCH * STEPS)
    if how == "engine":
        s = ap.Strategy()
        s.amp.enable, s.amp.dtype, s.amp.init_loss_scaling = True, "float16", 1024.0
        engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), strategy=s)
        loader = engine.dataloader(data, batch_size=BATCH, mode="train")
        losses = [engine.run(batch, mode="train")["loss"] for batch in loader()]
        scale = float(engine.scaler.get_scale()) if engine.scaler is not None else None
    else:
        from torch.utils.data import DataLoader

        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(_optimizer(model), mixed_precision=ap.MixedPrecision(torch.float16))
        scaler = ap.GradScaler("cpu", init_scale=1024.0)
        losses = []
        for x, y in ap.shard_dataloader(DataLoader(data, batch_size=BATCH, drop_last=True), mesh, shard_dims="dp"):
            loss = nn.CrossEntropyLoss()(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss.detach().full_tensor()))
        scale = float(scaler.get_scale())
    return {"losses": losses, "scale": scale, "params": {n: _full(p) for n, p in model.named_parameters()}}


def test_float16_scales_the_loss_as_the_dynamic_api_does(world4: Any) -> None:
    engine, dynamic = world4.run(_fp16, "engine")[0], world4.run(_fp16, "dynamic")[0]
    assert engine["scale"] == dynamic["scale"] == 1024.0  # no overflow here: the scale holds (growth after 2000)
    assert engine["losses"] == dynamic["losses"]
    for n, p in engine["params"].items():
        assert torch.equal(p, dynamic["params"][n]), n
    ref = _reference()
    assert all(abs(g - w) <= 2e-2 * abs(w) for g, w in zip(engine["losses"], ref["losses"], strict=True))


class _FourNet(nn.Module):
    """Four Linears visiting two stage meshes round robin: two chunks per mesh (interleaved)."""

    def __init__(self, mesh: ap.ProcessMesh | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.layers = nn.ModuleList([nn.Linear(IN, INNER), nn.Linear(INNER, IN), nn.Linear(IN, INNER), nn.Linear(INNER, OUT)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = torch.tanh(layer(x) if self.mesh is None else ap.shard_op(layer, self.mesh[k % 2])(x))
        return x


def _interleaved(rank: int, distributed: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], dim_names=["pp"])
    model = _FourNet(mesh if distributed else None)
    data = _dataset(BATCH * STEPS)
    if not distributed:
        opt = _optimizer(model)
        losses = []
        for i in range(STEPS):
            loss = nn.CrossEntropyLoss()(model(data.tensors[0][i * BATCH:(i + 1) * BATCH]),
                                         data.tensors[1][i * BATCH:(i + 1) * BATCH])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}
    s = ap.Strategy()
    s.pipeline.enable, s.pipeline.micro_batch_size, s.pipeline.accumulate_steps = True, BATCH // 2, 2
    s.pipeline.schedule_mode = "Interleaved1F1B"
    engine = ap.Engine(model, nn.CrossEntropyLoss(), _optimizer(model), strategy=s)
    loader = engine.dataloader(data, batch_size=BATCH, mode="train")
    losses = [engine.run(batch, mode="train")["loss"] for batch in loader()]
    chunks = [list(st.mesh.process_ids) for st in engine._stages or []]
    return {"losses": losses, "chunks": chunks,
            "params": {n: _full(p) for n, p in model.named_parameters() if rank in p.process_mesh}}


def test_interleaved_pipeline_by_meshes_visited_round_robin(world2: Any) -> None:
    ref = world2.run(_interleaved, False)[0]
    for r, got in enumerate(world2.run(_interleaved, True)):
        assert got["chunks"] == [[0], [1], [0], [1]]  # two chunks per stage mesh
        assert all(_close(g, w) for g, w in zip(got["losses"], ref["losses"], strict=True)), (r, got["losses"], ref["losses"])
        _check_params(got["params"], {n: p for n, p in ref["params"].items() if n in got["params"]})


# ---- a transformers model: its outputs are a ModelOutput -----------------------------------------
def _hf_engine(rank: int, use_cache: bool) -> dict[str, Any]:
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64, use_cache=use_cache))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))

    engine = ap.Engine(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [engine.run(d)["loss"] for d in data]
    kinds = [type(v).__name__ for v in engine._program._programs.values()] if engine._program else []
    return {"losses": losses, "kinds": kinds,
            "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}


def test_a_transformers_model_runs_captured_or_says_why(world2: Any) -> None:
    """A ModelOutput reaches the loss and the metrics; with ``use_cache`` its DynamicCache keeps the
    step eager (one warning naming it), without it the step is captured; both train alike."""
    pytest.importorskip("transformers")
    cached = world2.run(_hf_engine, True)
    plain = world2.run(_hf_engine, False)
    for c, p in zip(cached, plain):
        assert c["losses"] == pytest.approx(p["losses"], rel=1e-6)
        assert len(c["warnings"]) == 1 and "DynamicCache" in c["warnings"][0] and "use_cache" in c["warnings"][0]
        assert c["kinds"] == ["str"]  # the signature runs eagerly, and says why once
        assert p["warnings"] == [] and p["kinds"] == ["_Program"]


def _two_labels(rank: int) -> dict[str, Any]:
    import warnings

    torch.manual_seed(0)
    model = SimpleNet()

    def loss_fn(out: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (F.cross_entropy(out, y, reduction="none") * weight).mean()

    engine = ap.Engine(model, loss_fn, _optimizer(model))
    engine.prepare(ap.InputSpec([None, IN]), [ap.InputSpec([None], torch.int64), ap.InputSpec([None])])
    ds = _dataset(BATCH * STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [engine.run((*ds[i * BATCH:(i + 1) * BATCH], torch.ones(BATCH)))["loss"] for i in range(STEPS)]
    return {"losses": losses, "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}


def test_a_batch_with_two_labels_runs_eagerly_and_says_so_once(world4: Any) -> None:
    ref = _reference()
    for o in world4.run(_two_labels):
        assert all(_close(g, w) for g, w in zip(o["losses"], ref["losses"], strict=True)), o["losses"]
        assert len(o["warnings"]) == 1 and "2 label tensors runs eagerly" in o["warnings"][0]
