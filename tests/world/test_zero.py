"""shard_optimizer: data parallel (bucketed reduction) and ZeRO 1/2/3 against one process.

Pure part: bucket planning and shard layouts. World part (4 gloo ranks, one world): a small MLP
(uneven and empty shards: 5 output rows over 4 ranks) trains 3 steps under DP, ZeRO-1/2/3 with
unmodified SGD (momentum, weight decay), Adam, AdamW and Adagrad (whose constructor makes its
states) in default and foreach modes; loss and
every parameter match the single-process run (rtol 1e-5); the collectives of each step are the
ones the strategy promises; state dicts round-trip (also from a single-process optimizer);
gradient clipping; DP x TP on a 2x2 mesh with ZeRO on dp; ZeRO-3 memory and hooks owned by the
model; bad configurations; ZeRO-3 at changing sequence lengths (local regions answered through a
fake run warn nothing).
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from autoparallel.optim import plan_buckets, shard_layout, zero3

R, S0, S1 = Replicate(), Shard(0), Shard(1)
STEPS = 3
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **kw),
    # its constructor makes its states (``sum``, ``step`` 0): wrapped before its first step all the same
    "adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, weight_decay=1e-2, **kw),
}
STAGES = {"dp": None, "zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2, "zero3": ap.ShardingStage3}


# ---- pure --------------------------------------------------------------------------------
@pytest.mark.pure  # single process, no world
def test_plan_buckets() -> None:
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([10, 1, 1], 8) == [[0], [1, 2]]  # an oversized item gets its own bucket
    assert plan_buckets([], 8) == []
    assert plan_buckets([1] * 5, 100) == [[0, 1, 2, 3, 4]]


@pytest.mark.pure  # single process, no world
def test_shard_layout_picks_a_local_slice() -> None:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    spec = ap.DistSpec(mesh, (R, R), (5, 3), torch.float32)
    assert shard_layout(spec, 0).placements == (S0, R)  # type: ignore[union-attr]
    # column-parallel weight (dim 0 on mp, axis 1 > dp axis 0): dp takes dim 1 instead
    assert shard_layout(spec.with_placements((R, S0)), 0).placements == (S1, S0)  # type: ignore[union-attr]
    # ... and a 1-d column-parallel bias is split by dp inside its mp piece (mp outer, dp inner:
    # a chunk of the rank's current shard; mp piece 1 of [0, 8) is [4, 8), its dp halves [4, 6), [6, 8))
    bias = shard_layout(ap.DistSpec(mesh, (R, S0), (8,), torch.float32), 0)
    assert bias is not None and bias.placements == (S0, S0) and bias.shard_order == ((0, (1, 0)),)
    assert bias.local_box((0, 1)) == ((4, 2),) and bias.local_box((1, 1)) == ((6, 2),)
    # dp as the inner axis (mesh ["mp", "dp"]): it may split dim 0 after mp
    assert shard_layout(spec.with_placements((S0, R)), 1).placements == (S0, S0)  # type: ignore[union-attr]
    assert shard_layout(ap.DistSpec(mesh, (R, R), (), torch.float32), 0) is None  # 0-d
    assert shard_layout(spec.with_placements((S1, R)), 0) is None  # already sharded on dp
    with pytest.raises(ValueError, match="Partial"):
        shard_layout(spec.with_placements((Partial(), R)), 0)


@pytest.mark.pure  # single process, no world
def test_stage_values_validate() -> None:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    with pytest.raises(ValueError, match=r"has 2 axes and none is named 'dp': name the data-parallel axis"):
        ap.ShardingStage1(mesh)  # a model-parallel axis is never guessed as the data-parallel one
    assert ap.ShardingStage1(ap.ProcessMesh([0, 1], ["x"])).axis_name == "x"  # the only axis
    assert ap.ShardingStage2("y", mesh).axis_name == "y"  # Paddle's order: (axis, mesh)
    assert ap.ShardingStage2(mesh, 1).axis_name == "y"
    with pytest.raises(ValueError, match=r"'dp' is not in the mesh's axes \['x', 'y'\]"):
        ap.ShardingStage3(mesh, "dp")
    with pytest.raises(ValueError, match="mesh axis 2 does not exist"):
        ap.ShardingStage1(mesh, 2)
    with pytest.raises(TypeError, match="ProcessMesh"):
        ap.ShardingStage1([0, 1])  # type: ignore[arg-type]


# ---- world helpers -----------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _dist_model(ref: nn.Module, mesh: ap.ProcessMesh, tp: bool) -> nn.Module:
    model = copy.deepcopy(ref)
    if tp:
        return ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
    return ap.shard_layer(model, mesh)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ap.DistTensor) else t


def _train(
    rank: int, strategy: str, opt_name: str, foreach: bool | None, *, tp: bool = False, bucket_bytes: int | None = None,
    clip: bool = False, wrap: bool = True, grid: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Train STEPS steps distributed and on one process; check equality; return the collectives."""
    mesh = ap.ProcessMesh(grid or [[0, 1], [2, 3]], ["dp", "mp"]) if tp else ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    ref = _mlp()
    model = _dist_model(ref, mesh, tp)
    kw = {} if foreach is None else {"foreach": foreach}
    opt: Any = OPTIMIZERS[opt_name](model.parameters(), **kw)
    if wrap:
        extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        stage = STAGES[strategy]
        opt = ap.shard_optimizer(opt, stage(mesh) if stage else None, **extra)
    ref_opt = OPTIMIZERS[opt_name](ref.parameters(), **kw)
    data_pl = [S0, R] if tp else [S0]
    fwd, step = [], []
    for k, (x, y) in enumerate(_batches()):
        with ap.CommDebugMode() as c:
            loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, data_pl)), ap.shard_tensor(y, mesh, data_pl))
            loss.backward()
        fwd.append(c.get_comm_counts())
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        if clip:
            if wrap:
                opt.reduce_gradients()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            _close(_full(norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), f"step {k} grad norm")
        with ap.CommDebugMode() as c:
            opt.step()
        step.append(c.get_comm_counts())
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        _close(loss.detach().full_tensor(), ref_loss.detach(), f"{strategy}/{opt_name} step {k} loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), f"{strategy}/{opt_name}/{foreach} parameter {name}")
    states = [str(v.placements) for st in opt.state.values() for v in st.values() if isinstance(v, ap.DistTensor)]
    return {"fwd": fwd, "step": step, "params": [str(p.placements) for p in model.parameters()], "states": states}


# ---- equivalence -------------------------------------------------------------------------
def _matrix(rank: int, opt_name: str) -> dict[str, Any]:
    """Every strategy with ``opt_name``; default mode for DP/ZeRO-2, foreach for ZeRO-1/3."""
    return {s: _train(rank, s, opt_name, True if s in ("zero1", "zero3") else None) for s in STAGES}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_strategies_match_one_process(world4, opt_name: str) -> None:  # type: ignore[no-untyped-def]
    res = world4.run(_matrix, opt_name, timeout=300)[0]
    for s in ("zero1", "zero2", "zero3"):
        assert set(res[s]["states"]) == {"(Shard(0),)"}, (s, res[s]["states"])  # states sharded on dp
    assert set(res["dp"]["states"]) == {"(Replicate(),)"}
    assert set(res["zero3"]["params"]) == {"(Shard(0),)"} and set(res["zero1"]["params"]) == {"(Replicate(),)"}
    # one bucket (default 25 MB): DP one all-reduce per step; ZeRO-1 + one all-gather; ZeRO-2
    # reduce-scatters instead of all-reducing; ZeRO-3 steps without communicating: the MLP is
    # one unit (no block list), the model's own, gathered once in forward and kept until its
    # backward (which would gather it again at once), its gradients reduce-scattered once
    assert all(c == {"all_reduce": 1} for c in res["dp"]["step"]), res["dp"]["step"]
    assert all(c == {"all_reduce": 1, "all_gather": 1} for c in res["zero1"]["step"]), res["zero1"]["step"]
    assert all(c == {"reduce_scatter": 1, "all_gather": 1} for c in res["zero2"]["step"]), res["zero2"]["step"]
    assert all(c == {} for c in res["zero3"]["step"]), res["zero3"]["step"]
    for f, f_dp in zip(res["zero3"]["fwd"], res["dp"]["fwd"]):
        assert f.get("all_gather", 0) - f_dp.get("all_gather", 0) == 1
        assert f.get("reduce_scatter", 0) - f_dp.get("reduce_scatter", 0) == 1


def _constructor_states(rank: int) -> dict[str, list[tuple[str, int, int]]]:
    """Per stage, each parameter's Adagrad ``sum`` after wrapping: (placements, local numel, numel
    of its storage): made full-size by Adagrad's constructor, each becomes a shard of its own."""
    from autoparallel.engine import layout

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    out = {}
    for name, stage in STAGES.items():
        model = _dist_model(_mlp(), mesh, False)
        opt = ap.shard_optimizer(OPTIMIZERS["adagrad"](model.parameters()), stage(mesh) if stage else None)
        sums = [opt.state[p]["sum"] for group in opt.param_groups for p in group["params"]]
        out[name] = [(str(t.placements), layout.local_of(t).numel(), layout.local_of(t).untyped_storage().nbytes() // 4)
                     for t in sums]
    return out


def test_states_made_by_the_constructor_are_sharded(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_constructor_states)[1]
    # rank 1's shards of the MLP's (12, 8), (12,), (5, 12), (5,): 3 rows, 3, 2 rows, 2 (torch.chunk)
    assert res["dp"] == [("(Replicate(),)", n, n) for n in (96, 12, 60, 5)], res["dp"]
    for s in ("zero1", "zero2", "zero3"):
        assert res[s] == [("(Shard(0),)", n, n) for n in (24, 3, 24, 2)], (s, res[s])


def _param_groups(rank: int) -> list[str]:
    """Two groups (the second added after wrapping, its own lr) under ZeRO-2, and an LR scheduler."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    ref = _mlp()
    model = _dist_model(ref, mesh, False)
    opts = []
    for m, wrap in ((model, True), (ref, False)):
        opt: Any = torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9)
        if wrap:
            opt = ap.shard_optimizer(opt, ap.ShardingStage2(mesh))
        opt.add_param_group({"params": m[2].parameters(), "lr": 0.05})
        opts.append((opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)))
    for x, y in _batches(3):
        F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0])).backward()
        F.cross_entropy(ref(x), y).backward()
        for opt, sched in opts:
            opt.step()
            opt.zero_grad()
            sched.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), "param groups")
    return [str(v.placements) for st in opts[0][0].state.values() for v in st.values()]


def _buckets_and_plain(rank: int) -> dict[str, Any]:
    # 4 parameters of 384, 48, 240 and 20 bytes: a 400-byte limit gives buckets [w0], [b0, w2, b2]
    small = _train(rank, "dp", "sgd", None, bucket_bytes=400)
    plain = _train(rank, "dp", "sgd", True, wrap=False)  # no shard_optimizer: Partial grads reduced lazily
    return {"small": small["step"], "plain": plain["states"], "groups": _param_groups(rank)}


def test_dp_one_all_reduce_per_bucket_and_plain_optimizer(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_buckets_and_plain)[0]
    assert plan_buckets([384, 48, 240, 20], 400) == [[0], [1, 2, 3]]
    assert all(c == {"all_reduce": 2} for c in res["small"]), res["small"]
    assert res["plain"], "the plain optimizer created states"
    assert res["groups"] == ["(Shard(0),)"] * 4, res["groups"]  # momentum of all 4 params, sharded


def _clip_and_tp(rank: int) -> dict[str, Any]:
    out = {s: _train(rank, s, "adamw", None, clip=True)["step"] for s in ("dp", "zero2")}
    out["tp-zero2"] = _train(rank, "zero2", "sgd", None, tp=True)
    out["tp-zero3"] = _train(rank, "zero3", "adam", True, tp=True)
    out["dp1-zero2"] = _train(rank, "zero2", "sgd", None, tp=True, grid=[[0, 1, 2, 3]])  # dp axis of size 1
    return out


def test_clipping_and_dp_x_tp(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_clip_and_tp, timeout=300)[0]
    assert all(c == {} for c in res["dp"]), res["dp"]  # reduce_gradients() ran before clipping
    tp2 = res["tp-zero2"]
    # column weight sharded on dp by dim 1, row weight by dim 0, row bias too; the column bias by
    # dp within its mp piece
    assert tp2["params"] == ["(Replicate(), Shard(0))"] * 2 + ["(Replicate(), Shard(1))", "(Replicate(), Replicate())"]
    assert sorted(set(tp2["states"])) == ["(Shard(0), Replicate())", "(Shard(0), Shard(0))",
                                           "(Shard(0), Shard(1))", "(Shard(1), Shard(0))"]
    # one reduce-scatter (every gradient, the column bias too) + one all-gather
    assert all(c == {"reduce_scatter": 1, "all_gather": 1} for c in tp2["step"]), tp2["step"]
    assert set(res["tp-zero3"]["params"]) >= {"(Shard(1), Shard(0))", "(Shard(0), Shard(1))"}
    # a size-1 dp axis: the Partial over it is already the value, nothing moves for it
    assert all("reduce_scatter" not in c and "all_gather" not in c for c in res["dp1-zero2"]["step"]), res["dp1-zero2"]


def _freed(rank: int) -> dict[str, Any]:
    """ZeRO-3: a block's gathered weight dies when its forward ends, before backward; the model's
    own unit (the outermost: embedding and head) keeps its gathered weights until its backward,
    which would gather them again at once (FSDP2 leaves its root unsharded likewise), then drops
    them."""
    from autoparallel.engine import layout

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    model = ap.shard_layer(_Stack(), mesh)
    ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh))
    seen: dict[str, Any] = {}

    def watch(name: str, weight: Callable[[nn.Module], torch.Tensor]) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any) -> None:
            seen.setdefault(name, (str(weight(m).placements), weakref.ref(layout.local_of(weight(m)))))
        return hook

    model.register_forward_pre_hook(watch("root", lambda m: m.out.weight))
    model.blocks[0].register_forward_pre_hook(watch("block", lambda m: m.qkv.weight))
    x = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(0))
    with ap.CommDebugMode() as comm:
        loss = model(ap.shard_tensor(x, mesh, [S0])).square().mean()
        before = {name: ref() is not None for name, (_, ref) in seen.items()}
        loss.backward()
    after = {name: ref() is not None for name, (_, ref) in seen.items()}
    return {"used": {name: used for name, (used, _) in seen.items()}, "before_backward": before, "after": after,
            "weight": str(model.out.weight.placements), "grad": str(model.out.weight.grad.placements),
            "comm": comm.get_comm_counts()}


def test_zero3_frees_gathered_parameters(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_freed)[0]
    assert res["used"] == {"root": "(Replicate(),)", "block": "(Replicate(),)"}, res
    assert res["before_backward"] == {"root": True, "block": False}, res
    assert res["after"] == {"root": False, "block": False}, res
    assert res["weight"] == res["grad"] == "(Shard(0),)", res
    # the root gathered once, each block in forward and again in backward
    assert res["comm"]["all_gather"] == 5, res


def _accumulated(rank: int) -> dict[str, Any]:
    """Two micro-batches, in the order accumulation takes (F B F B) and in a pipeline's (F F B B):
    the model's own unit keeps the latest forward's gathered parameters for its backward; another
    forward, or another forward's backward, gathering first drops them (that backward gathers
    again). One SGD step on the summed gradients gives one process's parameters either way."""
    from autoparallel.engine import layout

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    xs = [torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    out: dict[str, Any] = {}
    for order in ("FBFB", "FFBB"):
        torch.manual_seed(0)
        ref = _Stack()
        model = ap.shard_layer(copy.deepcopy(ref), mesh)
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh))
        kept: list[Any] = []
        model.register_forward_pre_hook(lambda m, a: kept.append(weakref.ref(layout.local_of(m.out.weight))))
        alive = []
        with ap.CommDebugMode() as comm:
            losses: list[torch.Tensor] = []
            for k, step in enumerate(order):
                if step == "F":
                    x = xs[order[:k].count("F")]
                    losses.append(model(ap.shard_tensor(x, mesh, [S0])).square().mean())
                else:
                    losses.pop(0).backward()
                alive.append([r() is not None for r in kept])
        opt.step()
        out[order] = {"alive": alive, "all_gather": comm.get_comm_counts()["all_gather"]}
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for x in xs:
            ref(x).square().mean().backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(p.detach().full_tensor(), q.detach(), f"{order} {name}")
    return out


def test_zero3_keeps_the_models_own_unit_for_one_backward(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_accumulated)
    assert all(r == res[0] for r in res[1:])
    r = res[0]
    # F B F B: each forward's copy is kept until its own backward: the root gathers once per
    # micro-batch, the blocks in forward and backward (4 per micro-batch)
    assert r["FBFB"]["alive"] == [[True], [False], [False, True], [False, False]], r
    assert r["FBFB"]["all_gather"] == 2 * (1 + 4), r
    # F F B B: the second forward drops the first's copy, the first's backward (regathering)
    # the second's: the root gathers in both forwards and both backwards, as without keeping
    assert r["FFBB"]["alive"] == [[True], [False, True], [False, False], [False, False]], r
    assert r["FFBB"]["all_gather"] == 2 * (2 + 4), r


# ---- state dicts -------------------------------------------------------------------------
def _clone_sd(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _clone_sd(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone_sd(v) for v in sd]
    return sd


def _resume(rank: int, src: str, dst: str, opt_name: str) -> list[str]:
    """Train 3 steps under ``src`` ("single": one process), save, load under ``dst``, train 2 more."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    ref = _mlp()
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    data = _batches()

    def make(strategy: str, start: nn.Module) -> tuple[nn.Module, Any]:
        model = _dist_model(start, mesh, False)
        stage = STAGES[strategy]
        return model, ap.shard_optimizer(OPTIMIZERS[opt_name](model.parameters()), stage(mesh) if stage else None)

    def step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().full_tensor()

    def ref_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.detach()

    if src == "single":
        for x, y in data[:3]:
            ref_step(x, y)
        saved, start = _clone_sd(ref_opt.state_dict()), copy.deepcopy(ref)
    else:
        model, opt = make(src, ref)
        for x, y in data[:3]:
            step(model, opt, x, y)
            ref_step(x, y)
        saved, start = _clone_sd(opt.state_dict()), copy.deepcopy(ref)
        for p, q in zip(start.parameters(), model.parameters()):
            p.data.copy_(q.detach().full_tensor())
    model, opt = make(dst, start)
    opt.load_state_dict(saved)
    layouts = sorted({str(v.placements) for st in opt.state.values() for v in st.values() if isinstance(v, ap.DistTensor)})
    for k, (x, y) in enumerate(data[3:]):
        _close(step(model, opt, x, y), ref_step(x, y), f"{src}->{dst} resumed step {k} loss")
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), f"{src}->{dst} parameter after resuming")
    return layouts


def _resumes(rank: int) -> dict[str, list[str]]:
    cases = [("zero1", "zero1", "sgd"), ("zero3", "zero3", "adam"), ("single", "zero2", "adamw"), ("zero2", "dp", "adam")]
    return {f"{a}->{b}": _resume(rank, a, b, o) for a, b, o in cases}


def test_state_dict_round_trips(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_resumes, timeout=300)[0]
    assert res["zero1->zero1"] == ["(Shard(0),)"] and res["zero3->zero3"] == ["(Shard(0),)"]
    assert res["single->zero2"] == ["(Shard(0),)"]  # full plain states were sliced into shards
    assert res["zero2->dp"] == ["(Replicate(),)"]  # sharded states gathered for plain DP


# ---- bad configurations ------------------------------------------------------------------
def _bad(rank: int, case: str) -> None:
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "axis":
        ap.shard_optimizer(opt, ap.ShardingStage1(mesh, "data"))
    elif case == "not_contained":
        ap.shard_optimizer(opt, ap.ShardingStage2(ap.ProcessMesh([0, 1], ["dp"])))
    elif case == "axis_missing_in_param_mesh":
        grid = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        other = ap.shard_layer(_mlp(), ap.ProcessMesh([0, 1, 2, 3], ["x"]))
        ap.shard_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), ap.ShardingStage3(grid))
    elif case == "plain":
        ap.shard_optimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), ap.ShardingStage1(mesh))
    elif case == "stepped":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).step()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.step()
        ap.shard_optimizer(opt, ap.ShardingStage1(mesh))
    elif case == "stepped_adagrad":  # its constructor made states; a step counts in them
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = OPTIMIZERS["adagrad"](model.parameters())
        opt.step()
        ap.shard_optimizer(opt, ap.ShardingStage3(mesh))
    elif case == "shard_fn":
        ap.shard_optimizer(opt, "stage1")  # type: ignore[arg-type]
    elif case == "bucket":
        ap.shard_optimizer(opt, bucket_bytes=0)


def _healthy(rank: int) -> float:
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    return float(ap.shard_tensor(torch.ones(4), mesh, [S0]).sum().full_tensor())


BAD = [
    ("axis", ValueError, r"mesh axis name 'data' is not in the mesh's axes \['dp'\]"),
    ("not_contained", ValueError, r"ranks \[2, 3\] are not in the sharding mesh"),
    ("axis_missing_in_param_mesh", ValueError, r"no mesh axis named 'dp' \(its axes are \['x'\]\)"),
    ("plain", TypeError, r"parameter 0 of shape \(12, 8\) is a plain tensor"),
    ("stepped", ValueError, r"before its first step \(the state of a parameter of shape \(12, 8\) has states \['momentum_buffer'\] and no 'step'"),
    ("stepped_adagrad", ValueError, r"before its first step \(the state of a parameter of shape \(12, 8\) has step 1\.0;"),
    ("shard_fn", TypeError, "ShardingStage1/2/3.*got str"),
    ("bucket", ValueError, "bucket_bytes must be a positive int, got 0"),
]


def test_bad_configurations_raise_everywhere(world4):  # type: ignore[no-untyped-def]
    for case, exc, msg in BAD:
        with pytest.raises(exc, match=msg):
            world4.run(_bad, case)
    assert world4.run(_healthy) == [4.0] * 4


def _late_sharding(rank: int) -> list[dict[str, int]]:
    """A model that ran forwards before ZeRO-3 sharded it (while another model's ZeRO-3 hooks were
    already installed) still gathers per unit afterwards, and trains like one process."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    other = _dist_model(_mlp(), mesh, False)
    ap.shard_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), ap.ShardingStage3(mesh, "dp"))
    ref = _mlp()
    model = _dist_model(ref, mesh, False)
    x, _ = _batches(1)[0]
    model(ap.shard_tensor(x, mesh, [Shard(0)]))  # a forward before sharding
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh, "dp"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    comms = []
    for x, y in _batches():
        with ap.CommDebugMode() as comm:
            loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [Shard(0)])), ap.shard_tensor(y, mesh, [Shard(0)]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        comms.append(comm.get_comm_counts())
        ref_loss = F.cross_entropy(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        _close(loss.detach().full_tensor(), ref_loss.detach(), "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), name)
    return comms


def test_zero3_units_follow_sharding_done_after_a_forward(world4):  # type: ignore[no-untyped-def]
    for comms in world4.run(_late_sharding):
        # one unit, the model's own: a gather in forward kept for its backward, one reduce-scatter;
        # the loss's all-reduce
        assert all(c == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1} for c in comms), comms


def _ours(table: dict[Any, Any]) -> list[Any]:
    """The hooks in a torch hook table that belong to ZeRO-3."""
    return [h for h in table.values() if getattr(h, "__module__", None) == zero3.__name__]


def _global_zero3_hooks() -> int:
    from torch.nn.modules import module as mm

    return len(_ours(mm._global_forward_pre_hooks)) + len(_ours(mm._global_forward_hooks))


def _zero3_calls(fn: Callable[[], Any]) -> list[str]:
    """The functions of autoparallel.optim.zero3 that ``fn`` runs (on this thread)."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == zero3.__file__:
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def _hook_ownership(rank: int) -> dict[str, Any]:
    """ZeRO-3's hooks belong to its parameters' model, not to the process."""
    gc.collect()  # earlier tests' models (and the hooks they own) are gone
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    out: dict[str, Any] = {"start": _global_zero3_hooks()}
    model = _dist_model(_mlp(), mesh, False)
    other = _dist_model(_mlp(), mesh, False)  # plain data parallel
    plain = nn.Linear(8, 3)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh))
    owner = weakref.ref(opt._zero3)
    out["finding"] = _global_zero3_hooks()  # until a forward reaches the model
    x, y = _batches(1)[0]
    xs, ys = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])

    def train() -> dict[str, int]:
        with ap.CommDebugMode() as c:
            F.cross_entropy(model(xs), ys).backward()  # noqa: F821  (train() runs before the dels below)
        opt.step()  # noqa: F821
        opt.zero_grad()  # noqa: F821
        return c.get_comm_counts()

    out["first"] = train()
    out["found"] = _global_zero3_hooks()
    out["plain_calls"] = _zero3_calls(lambda: plain(x)) + _zero3_calls(lambda: other(xs))
    out["other_hooked"] = any(_ours(m._forward_pre_hooks) or _ours(m._forward_hooks) for m in [plain, *other.modules()])
    out["second"] = train()
    del opt
    gc.collect()
    with ap.CommDebugMode() as c:  # the optimizer is gone, the parameters stay sharded: still gathered
        F.cross_entropy(model(xs), ys).backward()
    out["without_optimizer"] = c.get_comm_counts()
    del model
    gc.collect()
    out["owner_alive"] = owner() is not None
    # a model that never ran forward: its finder goes with its parameters
    unused = _dist_model(_mlp(), mesh, False)
    opt = ap.shard_optimizer(torch.optim.SGD(unused.parameters(), lr=0.1), ap.ShardingStage3(mesh))
    out["unused_finding"] = _global_zero3_hooks()
    del opt, unused
    gc.collect()
    out["end"] = _global_zero3_hooks()
    return out


def test_zero3_hooks_are_owned_by_the_model(world4):  # type: ignore[no-untyped-def]
    """The hooks belong to the model: the process-wide finder goes once the model is found, other
    models run no ZeRO-3 code, the optimizer's death changes nothing, the model's death (or its
    parameters') removes every hook."""
    for res in world4.run(_hook_ownership):
        # the finder (one process-wide pre-hook) only until a forward reaches the model; none after
        start = res["start"]  # hooks of other tests' live ZeRO-3 models, if any (none expected)
        assert res["finding"] == start + 1 and res["found"] == start, res
        # one unit, the model's own: a gather in forward kept for its backward, one reduce-scatter;
        # the loss's all-reduce
        assert res["first"] == res["second"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}, res
        assert res["plain_calls"] == [] and not res["other_hooked"], res
        assert res["without_optimizer"] == res["first"], res
        assert not res["owner_alive"] and res["unused_finding"] == start + 1 and res["end"] == start, res


# ---- ZeRO-3 at changing sequence lengths ---------------------------------------------------
class _MixBlock(nn.Module):
    """Attention-like mixing over the length: any length."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).split(8, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / 8 ** 0.5, dim=-1)
        return h + self.proj(a @ v)


class _Stack(nn.Module):
    """Blocks in a ``ModuleList`` (each a ZeRO-3 unit); the root centres its output over the
    (sharded) batch, so it is no local region and its blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(11, 8), nn.Linear(8, 11)
        self.blocks = nn.ModuleList([_MixBlock(), _MixBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        y = self.out(h)
        return y - y.mean(0, keepdim=True)


def _zero3_lengths(rank: int) -> dict[str, Any]:
    import warnings

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    torch.manual_seed(0)
    ref = _Stack()
    model = ap.shard_layer(copy.deepcopy(ref), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ap.ShardingStage3(mesh))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (5, 6, 7, 9, 10, 13):
            x = torch.randint(0, 11, (8, t), generator=torch.Generator().manual_seed(t))
            loss = model(ap.shard_tensor(x, mesh, [S0])).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = ref(x).square().mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            _close(loss.detach().full_tensor(), ref_loss.detach(), f"length {t} loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach().full_tensor(), q.detach(), f"parameter {name}")
    return {"warnings": [str(w.message)[:120] for w in caught], "report": ap.local_regions_report(model)}


def test_zero3_at_new_lengths_warns_nothing(world4):  # type: ignore[no-untyped-def]
    # new lengths are served by the blocks' programs of open sizes (docs/local_regions.md), captured
    # on fake tensors while the block's unit holds its gathered parameters: ZeRO-3's saved-tensor
    # hook, which reads the storage address of what autograd saves, must leave fake tensors alone
    # (torch warns on reading one's)
    res = world4.run(_zero3_lengths)
    r = res[0]
    assert all(x == r for x in res)
    assert "local (open sizes)" in r["report"]["blocks.0"], r["report"]
    assert r["warnings"] == [], r["warnings"]
