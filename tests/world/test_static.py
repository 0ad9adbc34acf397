"""Static mode (``ap.to_static``): a captured step trains exactly as the eager step does.

World part (4 gloo ranks, one world): for DP (bucketed, SGD-momentum), DP x TP on a 2x2 mesh
(column/row-parallel MLP, AdamW, an LR scheduler changing lr every step), ZeRO-1 and ZeRO-3,
gradient merge, a batch-size change mid-training (a second program), eval/predict modes and a
state dict after static training, dropout (the program draws the eager masks): losses of every
step and every parameter equal the eager run (the same local ops run: bitwise here, checked at
rtol 1e-6), later calls replay a program (no dispatch) and issue the collectives eager issues.
A step reading a Python value stays eager, with one warning naming why, and still equals eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard

R, S0 = Replicate(), Shard(0)
STEPS = 5


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0, item: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 5)
        self.drop = nn.Dropout(dropout)
        self.item = item

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.item and float(h.sum()) > 1e9:  # data-dependent Python: never true, but read
            h = h * 0
        return self.fc2(self.drop(h))


def _data(n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def _build(kind: str, recompute: str | None = None,
           **model_kw: Any) -> tuple[nn.Module, Any, Any, Callable[[torch.Tensor, torch.Tensor], tuple[Any, Any]]]:
    """(model, optimizer, scheduler or None, batch layout) for layout ``kind``; ``recompute``: an
    ``ap.recompute`` policy for the whole model."""
    torch.manual_seed(0)
    model = MLP(**model_kw)
    if recompute is not None:
        ap.recompute(model, recompute)
    sched = None
    if kind == "dp_tp":
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        ap.parallelize(model, mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        placements = [S0, R]
    else:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        for m in (model.fc1, model.fc2):
            m.weight = ap.shard_tensor(m.weight, mesh, [R])
            m.bias = ap.shard_tensor(m.bias, mesh, [R])
        stage = {"dp": None, "dp_plain": None, "zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2,
                 "zero3": ap.ShardingStage3}[kind]
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        opt = inner if kind == "dp_plain" else ap.shard_optimizer(inner, stage(mesh) if stage is not None else None)
        placements = [S0]

    def lay(x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        return ap.shard_tensor(x, mesh, placements), ap.shard_tensor(y, mesh, placements)

    return model, opt, sched, lay


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _eager(kind: str, data: list[Any], accumulate: int = 1, bucket_bytes: int | None = None,
           **kw: Any) -> tuple[list[float], list[torch.Tensor], list[dict]]:
    model, opt, sched, lay = _build(kind, **kw)
    if bucket_bytes is not None:
        opt.bucket_bytes = bucket_bytes
    losses, comms = [], []
    for i, (x, y) in enumerate(data):
        xd, yd = lay(x, y)
        with ap.CommDebugMode() as c:
            loss = F.cross_entropy(model(xd), yd)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g if p.grad is None else p.grad + g
            if (i + 1) % accumulate == 0:
                if accumulate > 1:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.grad.div_(accumulate)
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
        losses.append(float(loss.detach().full_tensor()))
        comms.append(c.get_comm_counts())
    return losses, _full(model), comms


def _static(kind: str, data: list[Any], strategy: Any = None, **kw: Any) -> dict[str, Any]:
    model, opt, sched, lay = _build(kind, **kw)
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt, strategy=strategy)
    losses, comms, kinds = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            xd, yd = lay(x, y)
            with ap.CommDebugMode() as c:
                loss = dm(xd, yd)
                if sched is not None and dm._micro == 0:
                    sched.step()
            losses.append(float(loss.full_tensor()))
            comms.append(c.get_comm_counts())
            kinds.append(sorted(type(v).__name__ for v in dm._programs.values()))
    msgs = [str(w.message) for w in caught if "autoparallel" in str(w.message)]
    return {"losses": losses, "params": _full(model), "comms": comms, "kinds": kinds, "warnings": msgs,
            "lr": opt.param_groups[0]["lr"]}


def _compare(rank: int, kind: str) -> dict[str, Any]:
    data = _data(STEPS)
    el, ep, ec = _eager(kind, data)
    st = _static(kind, data)
    return {"eager": (el, ep, ec), "static": st}


def _assert_equal(eager: tuple[list[float], list[torch.Tensor], list[dict]], static: dict[str, Any],
                  merged: bool = False) -> None:
    el, ep, ec = eager
    torch.testing.assert_close(torch.tensor(static["losses"]), torch.tensor(el), rtol=1e-6, atol=0)
    for a, b in zip(static["params"], ep):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if not merged:
        assert static["comms"] == ec  # the replayed program issues what eager issues
    for a, b in zip(static["comms"], ec):  # merged all-reduces: the same kinds, never more
        assert set(a) == set(b) and all(a[k] <= b[k] for k in b), (static["comms"], ec)


@pytest.mark.parametrize("kind", ["dp", "dp_tp", "zero1", "zero2", "zero3"])
def test_static_training_equals_eager(world4: Any, kind: str) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, kind):
        st = res["static"]
        _assert_equal(res["eager"], st)
        assert st["warnings"] == [], st["warnings"]
        # the first call captures (on fake tensors) and runs the program, every later call runs it
        # (ZeRO-3's module hooks are in place before the first call: one signature)
        assert all(k == ["_Program"] for k in st["kinds"]), st["kinds"]


def test_a_torch_optimizer_gets_its_gradients_reduced_in_the_program(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """A plain torch optimizer (no shard_optimizer) on data parallel: eager reduces each Partial
    gradient at its first read in the step; the program reduces them all in one merged
    all-reduce (besides the cross-entropy's count), with the same values."""
    for res in world4.run(_compare, "dp_plain"):
        st, (_, _, ec) = res["static"], res["eager"]
        _assert_equal(res["eager"], st, merged=True)
        assert all(c == {"all_reduce": 5} for c in ec), ec  # the loss's count + 4 gradients
        assert all(c == {"all_reduce": 2} for c in st["comms"]), st["comms"]


def test_static_lr_scheduler_takes_effect(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, "dp_tp"):
        assert res["static"]["lr"] == pytest.approx(0.01 * 0.7 ** STEPS)  # read at every step, not baked


def _merge(rank: int) -> dict[str, Any]:
    data = _data(6)
    return {"eager": _eager("dp", data, accumulate=2), "static": _static("dp", data, ap.Strategy(accumulate_steps=2))}


def test_static_gradient_merge(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_merge):
        _assert_equal(res["eager"], res["static"])


def _batch_change(rank: int) -> dict[str, Any]:
    data = _data(3, batch=8) + _data(3, batch=4)
    return {"eager": _eager("dp_tp", data), "static": _static("dp_tp", data)}


def test_static_recaptures_a_new_batch_size(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_batch_change):
        _assert_equal(res["eager"], res["static"])
        assert res["static"]["kinds"][-1] == ["_Program", "_Program"]


def _refused(rank: int, what: str) -> dict[str, Any]:
    kw = {"item": True} if what == "item" else {"dropout": 0.2}
    data = _data(4)
    torch.manual_seed(5)
    eager = _eager("dp", data, **kw)
    torch.manual_seed(5)
    return {"eager": eager, "static": _static("dp", data, **kw)}


def test_uncapturable_steps_stay_eager_with_one_warning(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_refused, "item"):
        _assert_equal(res["eager"], res["static"])
        assert len(res["static"]["warnings"]) == 1, res["static"]["warnings"]
        assert "runs eagerly" in res["static"]["warnings"][0] and "reads a Python value" in res["static"]["warnings"][0]
        assert "test_static.py:40 (if self.item and float(h.sum()) > 1e9:" in res["static"]["warnings"][0]  # the line
        assert res["static"]["kinds"][-1] == ["str"]  # the signature is marked eager


def test_dropout_draws_the_eager_masks(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """The program draws from torch's generator as eager does: the same masks for the same seed."""
    for res in world4.run(_refused, "dropout"):
        _assert_equal(res["eager"], res["static"])
        assert res["static"]["warnings"] == []
        assert res["static"]["kinds"][-1] == ["_Program"]


def _modes(rank: int) -> dict[str, Any]:
    model, opt, _, lay = _build("dp_tp")
    data = _data(4)
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt)
    for x, y in data[:3]:
        dm(*lay(x, y))
    before = _full(model)
    xd, yd = lay(*data[3])
    dm.eval()
    losses = [float(dm(xd, yd).full_tensor()) for _ in range(3)]  # warm, capture, replay
    ref = float(F.cross_entropy(model(xd), yd).detach().full_tensor())
    dm.predict()
    outs = [dm(xd).full_tensor() for _ in range(3)]
    with torch.no_grad():
        want = model(xd).full_tensor()
    sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "ref": ref, "outs": outs, "want": want, "unchanged": all(
        torch.equal(a, b) for a, b in zip(before, _full(model))), "sd": sd, "params": _full(model)}


def test_static_eval_and_predict(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_modes):
        assert res["losses"] == [pytest.approx(res["ref"], rel=1e-6)] * 3
        for out in res["outs"]:
            torch.testing.assert_close(out, res["want"], rtol=1e-6, atol=1e-7)
        assert res["unchanged"]  # eval and predict never update
        for got, p in zip(res["sd"].values(), res["params"]):  # the model's own objects were trained
            assert torch.equal(got, p)


def _with_outputs(rank: int) -> dict[str, Any]:
    """The same training twice, one DistModel returning the model's outputs too: the outputs of
    each call equal the forward before it, and the training is the same bits."""
    data = _data(STEPS)
    runs: dict[str, Any] = {}
    for outputs in (False, True):
        model, opt, _, lay = _build("dp_tp")
        dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt, outputs=outputs)
        losses, seen, want, kinds = [], [], [], []
        for x, y in data:
            xd, yd = lay(x, y)
            with torch.no_grad():
                want.append(model(xd).full_tensor())
            got = dm(xd, yd)
            loss = got[0] if outputs else got
            if outputs:
                seen.append((got[1].full_tensor(), got[1].requires_grad))
            losses.append(float(loss.full_tensor()))
            kinds.append(sorted(type(v).__name__ for v in dm._programs.values()))
        dm.eval()
        evals = [dm(*lay(*data[0])) for _ in range(3)]  # eager, capture, replay
        runs[str(outputs)] = {"losses": losses, "params": _full(model), "seen": seen, "want": want, "kinds": kinds,
                              "evals": [(float(e[0].full_tensor()), e[1].full_tensor()) if outputs
                                        else float(e.full_tensor()) for e in evals]}
    return runs


def test_outputs_come_back_with_the_loss(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_with_outputs):
        plain, shown = res["False"], res["True"]
        assert shown["losses"] == plain["losses"]  # bitwise: the program computes the same step
        for a, b in zip(shown["params"], plain["params"]):
            assert torch.equal(a, b)
        assert shown["kinds"][-1] == ["_Program"]  # the later calls replay a program
        for (out, grad), want in zip(shown["seen"], shown["want"]):
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
            assert not grad
        for (loss, out), ref in zip(shown["evals"], plain["evals"]):
            assert loss == ref
            torch.testing.assert_close(out, shown["evals"][0][1], rtol=0, atol=0)


@pytest.mark.pure
def test_strategy_is_validated() -> None:
    with pytest.raises(ValueError, match="accumulate_steps"):
        ap.Strategy(accumulate_steps=0)
    with pytest.raises(ValueError, match="compile"):
        ap.Strategy(compile="tvm")
    with pytest.raises(TypeError, match="overlap"):
        ap.Strategy(overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        ap.to_static(lambda x: x)  # type: ignore[arg-type]


def _inductor(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    data = _data(4)
    out: dict[str, Any] = {}
    for comp in (None, "inductor"):
        torch.manual_seed(0)
        model = MLP()
        for m in (model.fc1, model.fc2):
            m.weight = ap.shard_tensor(m.weight, mesh, [R])
            m.bias = ap.shard_tensor(m.bias, mesh, [R])
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt, strategy=ap.Strategy(compile=comp))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [float(dm(ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])).full_tensor()) for x, y in data]
        out[str(comp)] = {"losses": losses, "params": _full(model),
                          "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}
    return out


@pytest.mark.inductor
def test_inductor_compiled_program_trains_as_the_plain_one(world2: Any) -> None:  # type: ignore[no-untyped-def]
    """compile='inductor' (a cold compile: tens of seconds here): the same losses and parameters."""
    for res in world2.run(_inductor, timeout=600):
        plain, comp = res["None"], res["inductor"]
        assert comp["warnings"] == [], comp["warnings"]  # it compiled (no fallback)
        torch.testing.assert_close(torch.tensor(comp["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
        for a, b in zip(comp["params"], plain["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _torch_compiled(rank: int) -> dict[str, Any]:
    import torch._dynamo

    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    data = _data(3)
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:  # records what Dynamo compiles
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    losses = []
    try:
        for x, y in data:
            loss = F.cross_entropy(compiled(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            want = F.cross_entropy(ref(x), y)
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append((float(loss.full_tensor()), float(want)))
    finally:
        torch._dynamo.reset()
    ours = ("/autoparallel/", "/spmd_rules/", "/reshard/")
    library = [str(n.meta.get("stack_trace", "")).strip().splitlines()[-2:] for g in graphs for n in g.graph.nodes
               if any(p in str(n.meta.get("stack_trace", "")) for p in ours)]
    return {"losses": losses, "params": [(p.full_tensor(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())],
            "library": library[:3]}


def test_torch_compile_of_a_model_on_dist_tensors_runs_their_ops_eagerly(world4: Any) -> None:  # type: ignore[no-untyped-def]
    # torch.compile (Dynamo) over DistTensors: the library's frames run as they are (none of its
    # planning is compiled into a graph: compiled, it failed in inductor), and training equals
    # one process
    for res in world4.run(_torch_compiled, timeout=300):
        assert res["library"] == [], res["library"]
        for got, want in res["losses"]:
            assert abs(got - want) <= 1e-5 * abs(want)
        for a, b in res["params"]:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _train(dm_or_model: Any, opt: Any, lay: Any, batches: list[Any], static: bool) -> list[float]:
    losses = []
    for x, y in batches:
        xd, yd = lay(x, y)
        if static:
            loss = dm_or_model(xd, yd)
        else:
            loss = F.cross_entropy(dm_or_model(xd), yd)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach().full_tensor()))
    return losses


def _resume(rank: int, folder: str, first_static: bool) -> dict[str, Any]:
    """Train 3 steps (static or eager), save model + optimizer, train 3 more; a fresh model and
    optimizer of the other mode load the checkpoint and train the same 3 steps."""
    data = _data(6)
    model, opt, _, lay = _build("dp")
    runner = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if first_static else model
    _train(runner, opt, lay, data[:3], first_static)
    ap.save_state_dict({"model": model.state_dict(), "optim": opt.state_dict()}, folder)
    cont = _train(runner, opt, lay, data[3:], first_static)
    fresh, fopt, _, _ = _build("dp")
    ap.checkpoint.init_optimizer_state(fopt)  # the moments exist (in their layout) to be filled
    sd = {"model": fresh.state_dict(), "optim": fopt.state_dict()}
    ap.load_state_dict(sd, folder)
    fresh.load_state_dict(sd["model"])
    fopt.load_state_dict(sd["optim"])
    other = ap.to_static(fresh, loss=F.cross_entropy, optimizer=fopt) if not first_static else fresh
    resumed = _train(other, fopt, lay, data[3:], not first_static)
    return {"cont": cont, "resumed": resumed, "params": (_full(model), _full(fresh))}


@pytest.mark.parametrize("first_static", [True, False])
def test_checkpoints_move_between_static_and_eager(world4: Any, tmp_path: Any, first_static: bool) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_resume, str(tmp_path / "ckpt"), first_static):
        torch.testing.assert_close(torch.tensor(res["resumed"]), torch.tensor(res["cont"]), rtol=1e-6, atol=0)
        for a, b in zip(*res["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _overlap(rank: int, kind: str) -> dict[str, Any]:
    data = _data(5)
    # small buckets: one reduction per gradient, each started inside the backward when overlapping
    return {flag: _static(kind, data, ap.Strategy(overlap=flag, bucket_bytes=64)) for flag in (False, True)}


@pytest.mark.parametrize("kind", ["dp_tp", "dp", "zero3"])
def test_overlap_keeps_the_values(world4: Any, kind: str) -> None:  # type: ignore[no-untyped-def]
    eager = world4.run(_compare_eager, kind)
    for res, ref in zip(world4.run(_overlap, kind), eager):
        off, on = res[False], res[True]
        assert on["losses"] == off["losses"]
        # a merged all-reduce may add an element's terms in another order on 4 ranks (the loss's
        # sum riding with a gradient bucket shifts the bucket's elements): the last bit
        for a, b in zip(on["params"], off["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # overlapping also merges all-reduces within bucket_bytes (and lets a Partial loss ride
        # along one): the same kinds, never more of them
        for a, b in zip(on["comms"], off["comms"]):
            assert set(a) == set(b) and all(a[k] <= b[k] for k in b), (on["comms"], off["comms"])
        _assert_equal(ref, on, merged=True)


def _compare_eager(rank: int, kind: str) -> Any:
    return _eager(kind, _data(5), bucket_bytes=64)


@pytest.mark.pure
def test_sink_waits_moves_a_wait_to_its_first_use_and_never_past_a_write() -> None:
    from autoparallel.static.passes import sink_waits

    fc, aten = torch.ops._c10d_functional, torch.ops.aten
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    started = g.call_function(fc.all_reduce.default, (x, "sum", "0"))
    done = g.call_function(fc.wait_tensor.default, (started,))
    other = g.call_function(aten.mul.Tensor, (x, 2))          # independent compute
    more = g.call_function(aten.add.Tensor, (other, 1))
    use = g.call_function(aten.add.Tensor, (done, more))      # first use of the result
    started2 = g.call_function(fc.all_reduce.default, (use, "sum", "0"))
    done2 = g.call_function(fc.wait_tensor.default, (started2,))
    write = g.call_function(aten.add_.Tensor, (buf, 1))       # an in-place write bounds the move
    use2 = g.call_function(aten.neg.default, (done2,))
    g.output((use2, write))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert sink_waits(gm) == 1
    order = [n.name for n in gm.graph.nodes]
    assert order.index(done.name) == order.index(use.name) - 1 and order.index(done.name) > order.index(more.name)
    assert order.index(done2.name) < order.index(write.name)  # stopped before the write


def _hooks(rank: int) -> dict[str, Any]:
    model, opt, _, lay = _build("dp")
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt)
    data = _data(6)
    for x, y in data[:3]:  # warm, capture, replay
        dm(*lay(x, y))
    seen: list[int] = []
    handle = model.fc2.register_forward_hook(lambda m, i, o: seen.append(1))
    for x, y in data[3:5]:  # a new signature: the hook runs in its capture; the program holds no Python
        dm(*lay(x, y))
    handle.remove()
    dm(*lay(*data[5]))  # back to the first program: the hook is gone
    return {"seen": len(seen), "programs": len(dm._programs)}


def test_a_hook_added_after_capture_runs(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_hooks):
        assert res["seen"] == 1 and res["programs"] == 2


def _recomputed(rank: int, dropout: float, policy: str) -> dict[str, Any]:
    """``_eager`` and ``_static`` of the DP x TP MLP under activation recompute."""
    data = _data(5)
    torch.manual_seed(3)
    eager = _eager("dp_tp", data, dropout=dropout, recompute=policy)
    torch.manual_seed(3)
    static = _static("dp_tp", data, dropout=dropout, recompute=policy)
    return {"eager": eager, "static": static}


@pytest.mark.parametrize("dropout, policy", [(0.0, "full"), (0.0, "selective"), (0.2, "full"), (0.2, "selective")])
def test_static_with_recompute_equals_eager_or_says_why(world4: Any, dropout: float, policy: str) -> None:
    """Recompute without random ops is captured and replays exactly; with dropout the recompute
    resets the generator (a Python call a program cannot hold): one warning, eager, equal. Under
    full recompute eager runs the model's region program again in the backward, the row-parallel
    output's all-reduce after its last saved value included; the static step's recompute keeps only
    what its backward reads: never more collectives than eager."""
    for res in world4.run(_recomputed, dropout, policy):
        st = res["static"]
        # (a refused capture ran nothing: every call issues what eager does)
        _assert_equal(res["eager"], st, merged=policy == "full")
        if dropout:  # (selective: torch's cache check trips on the trace first; the step runs eagerly)
            assert len(st["warnings"]) == 1, st["warnings"]
            assert "resets the random generator" in st["warnings"][0] or "tracing the step failed" in st["warnings"][0]
            assert st["kinds"][-1] == ["str"]
        else:
            assert st["warnings"] == [] and st["kinds"][-1] == ["_Program"]


@pytest.mark.pure
def test_outputs_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="outputs must be a bool"):
        ap.to_static(nn.Linear(2, 2), loss=F.mse_loss, outputs=1)  # type: ignore[arg-type]


def _megatron_step(rank: int) -> dict[str, Any]:
    """The example GPT, tensor-parallel on 4 ranks (Megatron's plan, vocabulary-parallel head),
    eager and captured: the collectives of one step and the loss read after it."""
    from examples.gpt_model import GPT, GPTConfig, lm_loss
    from examples.train_gpt import parallelize_gpt

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["mp"])
    g = torch.Generator().manual_seed(1)
    data = [tuple(ap.shard_tensor(torch.randint(0, 128, (4, 16), generator=g), mesh, [Replicate()]) for _ in range(2))
            for _ in range(3)]
    out: dict[str, Any] = {}
    for mode in ("eager", "static"):
        torch.manual_seed(0)
        model = parallelize_gpt(GPT(GPTConfig(vocab=128, seq=16, layers=2, width=32, heads=4)), mesh, sp=False)
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        dm = ap.to_static(model, loss=lm_loss, optimizer=opt)
        losses, comms, placements = [], [], []
        for x, y in data:
            with ap.CommDebugMode() as c:
                if mode == "static":
                    loss = dm(x, y)
                else:
                    loss = lm_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                placements.append(loss.placements)
                losses.append(float(loss.detach().full_tensor()))  # the read counts
            comms.append(c.get_comm_counts())
        out[mode] = {"losses": losses, "comms": comms, "placements": placements}
    return out


def test_static_megatron_step_merges_its_small_reductions(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_megatron_step):
        eager, static = res["eager"], res["static"]
        torch.testing.assert_close(torch.tensor(static["losses"]), torch.tensor(eager["losses"]), rtol=1e-6, atol=0)
        # eager: 6 forward (embedding, 2 per block, the loss's row statistics gathered), the loss
        # read, 5 backward (each LayerNorm's input gradient, reduced before its backward as
        # Megatron's f does, so the LayerNorm weights' gradients are whole and no bucket is left;
        # log_softmax's backward takes its row sums from the NLL backward): Megatron's 12
        assert eager["comms"] == [{"all_reduce": 11, "all_gather": 1}] * 3
        assert all(p == (Partial(),) for p in eager["placements"])
        # replayed (the third call): the loss rides along the first activation gradient's
        # all-reduce: one fewer than Megatron's 12, and the loss is Replicate
        assert static["comms"][2:] == [{"all_reduce": 10, "all_gather": 1}]
        assert static["placements"][2:] == [(Replicate(),)]


class _Normed(nn.Module):
    """A BatchNorm (running statistics: buffers the step writes) before a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(8), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(x))


def _train_call(dm: Any, model: nn.Module, opt: Any, xs: Any, ys: Any) -> Any:
    """One training call: through ``dm`` (``ap.to_static``), or eagerly when it is None."""
    if dm is not None:
        return dm(xs, ys)
    loss = F.cross_entropy(model(xs), ys)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _kinds(dm: Any) -> list[str]:
    """What ``dm`` keeps per signature: ``_Program`` (captured) or ``str`` (why eager)."""
    return sorted(type(v).__name__ for v in dm._programs.values()) if dm is not None else []


def _first_call(rank: int, static: bool) -> dict[str, Any]:
    """One training call: the capture runs nothing for real, the program runs the step once."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(_Normed(), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)[0]
    xs, ys = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if static else None
    with ap.CommDebugMode() as comm:
        loss = _train_call(dm, model, opt, xs, ys)
    return {"loss": float(loss.detach().full_tensor()), "comm": comm.get_comm_counts(),
            "state": {k: v.detach().full_tensor() for k, v in model.state_dict().items()},
            "kinds": _kinds(dm),
            "constants": [n.target for p in (dm._programs.values() if dm is not None else ())
                          for n in p.run.graph.nodes if n.op == "get_attr"]}


def test_the_first_call_runs_the_step_once(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """The capturing call updates the parameters and the running statistics once and issues the
    step's collectives once (the trace on fake tensors computes and sends nothing)."""
    for eager, static in zip(world4.run(_first_call, False), world4.run(_first_call, True)):
        assert static["loss"] == eager["loss"] and static["comm"] == eager["comm"], (static, eager)
        assert static["kinds"] == ["_Program"]  # captured (not refused) and run
        assert static["constants"] == []  # every parameter and buffer is a program input, none baked in
        assert int(static["state"]["bn.num_batches_tracked"]) == 1
        for k, v in eager["state"].items():
            assert torch.equal(static["state"][k], v), k


def _plain_weight(rank: int, static: bool) -> dict[str, Any]:
    """Paddle's habit: fc1's weight laid out by hand, the rest of the model left plain."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    torch.manual_seed(0)
    model = MLP()
    model.fc1.weight = ap.shard_tensor(model.fc1.weight, mesh, [R])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if static else None
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _data(3):
            xs, ys = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])
            losses.append(float(_train_call(dm, model, opt, xs, ys).detach().full_tensor()))
    return {"losses": losses, "params": _full(model), "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)],
            "kinds": _kinds(dm)}


def test_a_plain_trainable_parameter_is_laid_out_eagerly_then_captured(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for eager, static in zip(world4.run(_plain_weight, False), world4.run(_plain_weight, True)):
        assert static["losses"] == eager["losses"]
        # (the program reduces the torch optimizer's gradients in one merged all-reduce, eager one by
        # one: a backend may add an element's four terms in another order, the last bit of a float)
        for a, b in zip(static["params"], eager["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert len(static["warnings"]) == 1 and "'fc1.bias' is a plain tensor" in static["warnings"][0], static["warnings"]
        assert static["kinds"] == ["_Program", "str"]  # the first signature eager, the laid-out one captured


def _mean_loss_schedule(rank: int) -> dict[str, Any]:
    """A data-parallel step with a token-mean loss: where its program reduces the count and the sum."""
    aten, fc = torch.ops.aten, torch.ops._c10d_functional
    model, opt, _, lay = _build("dp")
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt)
    for x, y in _data(3):
        y[0] = -100  # (an ignored target: the count is not the batch size)
        dm(*lay(x, y))
    (program,) = dm._programs.values()
    nodes = list(program.run.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target is fc.all_reduce.default]
    waits = [n for n in nodes if n.target is fc.wait_tensor.default]
    first_matmul = min(at[n] for n in nodes if n.target in (aten.mm.default, aten.addmm.default))
    loss_value = nodes[-1].args[0][0]  # the program's first output: the loss
    return {"starts": [at[n] for n in starts], "waits": [at[n] for n in waits], "first_matmul": first_matmul,
            "loss": at[loss_value], "records": len(program.records)}


def test_a_mean_loss_does_not_stop_the_step_between_forward_and_backward(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """The count of a token-mean loss is reduced from the targets while the forward runs, its
    sum rides with the gradients and is waited for last: two collectives, as eager issues, and
    no wait for the loss between the forward and the backward (the values: the tests above)."""
    for res in world4.run(_mean_loss_schedule):
        count, rest = res["starts"]
        assert count < res["first_matmul"] < rest
        assert res["records"] == 2
        assert res["loss"] > max(res["starts"]) and res["loss"] > max(res["waits"])
