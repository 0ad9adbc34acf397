"""Mixed precision: ``ap.MixedPrecision`` in ``shard_optimizer`` and ``ap.GradScaler``.

bf16 (4 gloo ranks): DP and ZeRO-1/2/3 train a small MLP like one process running the same
policy by hand (bf16 copies of fp32 masters for forward and backward, fp32 gradients, AdamW on
the masters). Tolerance ``BF16_RTOL = 2e-2``, normwise: bf16 keeps 8 mantissa bits (2^-9
relative rounding per op), and the two runs round different things -- each rank's gradient of
its batch shard is a bf16 product summed in fp32 across ranks, where one process rounds the
whole batch's product once -- so a gradient element differs by a few 2^-9; AdamW divides by
sqrt(v) and so carries that relative error into each update. Measured: 4.8e-3 after 3 steps
(the bf16 loss, one bf16 rounding step of 2^-8 relative; parameters closer), the same under
every strategy; an fp32 run would match to 1e-6 (checked: the outputs are bf16). Masters,
gradients and optimizer states stay fp32, in ``state_dict()`` and in a checkpoint. ZeRO-3
gathers the shards cast to bf16 (half the forward bytes of an fp32 ZeRO-3); ``reduce_dtype=bf16``
halves the gradient reduction's bytes (2 ranks, DP and ZeRO-3).

fp16 + ``ap.GradScaler`` (2 ranks, ZeRO-2): an inf in one rank's gradient shard makes every
rank skip the step and halve the scale (also with a plain torch optimizer, the inf in one
rank's Partial summand). ``ap.to_static`` (2 ranks, DP and ZeRO-3) captures the
mixed-precision step and replays it bitwise like eager. Bad policies raise on every rank.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Replicate, Shard

R, S0 = Replicate(), Shard(0)
BF16_RTOL = 2e-2
STEPS = 3
STAGES = {"dp": None, "zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2, "zero3": ap.ShardingStage3}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _ref_loss(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One process, the policy by hand: low-precision copies of the fp32 masters, input cast too."""
    copies = {n: p.to(dtype) for n, p in ref.named_parameters()}
    return F.cross_entropy(torch.func.functional_call(ref, copies, (x.to(dtype),)), y)


def _train(rank: int, strategy: str, path: str) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    ref = _mlp()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)  # built before the layout
    ap.shard_layer(model, mesh)  # swaps the parameters in place: the optimizer keeps them
    stage = STAGES[strategy]
    opt = ap.shard_optimizer(opt, stage(mesh) if stage else None, mixed_precision=ap.MixedPrecision(torch.bfloat16))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    worst, dtypes, fwd_bytes = 0.0, set(), []
    for x, y in _batches():
        with ap.CommDebugMode() as comm:
            out = model(ap.shard_tensor(x, mesh, [S0]))
        fwd_bytes.append(comm.bytes_received)
        dtypes.add(out.dtype)
        loss = F.cross_entropy(out, ap.shard_tensor(y, mesh, [S0]))
        loss.backward()
        dtypes |= {p.grad.dtype for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        ref_loss = _ref_loss(ref, x, y, torch.bfloat16)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, _rel(loss.detach().full_tensor(), ref_loss.detach()))
    for p, q in zip(model.parameters(), ref.parameters()):
        worst = max(worst, _rel(p.detach().full_tensor(), q.detach()))
    sd = model.state_dict()
    ap.save_state_dict(sd, os.path.join(path, strategy))
    fresh = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in sd.items()}  # one-process target
    ap.load_state_dict(fresh, os.path.join(path, strategy))
    same = all(torch.equal(fresh[k], v.detach().full_tensor()) for k, v in sd.items())
    states = {v.dtype for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()}
    return {
        "worst": worst, "out_grad": sorted(map(str, dtypes)), "params": sorted({str(p.dtype) for p in model.parameters()}),
        "state_dict": sorted({str(v.dtype) for v in sd.values()}), "states": sorted(map(str, states)),
        "checkpoint": same, "placements": sorted({str(p.placements) for p in model.parameters()}),
        "fwd_bytes": fwd_bytes[0],
    }


def _fp32_zero3_forward_bytes() -> int:
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    ap.shard_optimizer(torch.optim.AdamW(model.parameters()), ap.ShardingStage3(mesh))
    with ap.CommDebugMode() as comm:
        model(ap.shard_tensor(_batches(1)[0][0], mesh, [S0]))
    return comm.bytes_received


def _matrix(rank: int, path: str) -> dict[str, Any]:
    return {**{s: _train(rank, s, path) for s in STAGES}, "zero3_fp32_fwd_bytes": _fp32_zero3_forward_bytes()}


def test_bf16_matches_one_process_and_masters_stay_fp32(world4, tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = world4.run(_matrix, str(tmp_path), timeout=300)[0]
    fp32_gather = res.pop("zero3_fp32_fwd_bytes")
    assert res["zero3"]["fwd_bytes"] * 2 == fp32_gather > 0  # ZeRO-3 gathers the bf16 casts of the shards
    assert res["dp"]["fwd_bytes"] == 0
    for s, r in res.items():
        assert r["worst"] < BF16_RTOL, (s, r["worst"])
        assert r["out_grad"] == ["torch.bfloat16", "torch.float32"], (s, r)  # bf16 output, fp32 gradients
        assert r["params"] == r["state_dict"] == r["states"] == ["torch.float32"], (s, r)
        assert r["checkpoint"], s
    assert res["zero3"]["placements"] == ["(Shard(0),)"] and res["dp"]["placements"] == ["(Replicate(),)"]


def _reduced_in(rank: int, stage: str, reduce_dtype: torch.dtype) -> dict[str, Any]:
    """One bf16 step; the bytes of the gradient reductions (backward and step) and the parameters."""
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), STAGES[stage](mesh) if STAGES[stage] else None,
                             mixed_precision=ap.MixedPrecision(torch.bfloat16, reduce_dtype))
    x, y = _batches(1)[0]
    loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
    with ap.CommDebugMode() as comm:
        loss.backward()
        opt.step()
    reduced = sum(r.sent_bytes for r in comm.records if r.kind in ("all_reduce", "reduce_scatter"))
    return {"bytes": reduced, "params": [p.detach().full_tensor() for p in model.parameters()],
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


@pytest.mark.parametrize("stage", ["dp", "zero3"])
def test_reduce_dtype_bf16_halves_the_reduction(world2, stage: str) -> None:  # type: ignore[no-untyped-def]
    fp32, bf16 = world2.run(_reduced_in, stage, torch.float32)[0], world2.run(_reduced_in, stage, torch.bfloat16)[0]
    assert fp32["bytes"] == 2 * bf16["bytes"] > 0, (fp32["bytes"], bf16["bytes"])  # all-reduce / reduce-scatter
    assert fp32["dtypes"] == bf16["dtypes"] == ["torch.float32"]  # reduced in bf16, stored fp32
    for a, b in zip(fp32["params"], bf16["params"]):
        assert _rel(b, a) < BF16_RTOL


# ---- fp16 + GradScaler -----------------------------------------------------------------------
def _scaled(rank: int, inject: bool, wrapped: bool = True) -> dict[str, Any]:
    """ZeRO-2, fp16 compute, ap.GradScaler: one clean step, then one with an inf on rank 1 only.
    ``wrapped=False``: a plain AdamW over the DistTensor parameters (fp32, Partial gradients)."""
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=0.01)
    if wrapped:
        opt = ap.shard_optimizer(opt, ap.ShardingStage2(mesh), mixed_precision=ap.MixedPrecision(torch.float16))
    scaler = ap.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales, changed = [], []
    for k, (x, y) in enumerate(_batches(2)):
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
        scaler.scale(loss).backward()
        if k == 1 and inject:
            if wrapped:
                opt.reduce_gradients()  # ZeRO-2: each rank now holds its shard of every gradient
            if rank == 1:
                with torch.no_grad():
                    model[0].weight.grad.to_local().view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        changed.append(any(not torch.equal(p.detach().full_tensor(), q) for p, q in zip(model.parameters(), before)))
    steps = sorted({int(st["step"]) for st in opt.state.values()})
    return {"scales": scales, "changed": changed, "steps": steps}


@pytest.mark.parametrize("inject, wrapped", [(False, True), (True, True), (True, False)],
                         ids=["clean", "inf-zero2", "inf-plain-optimizer"])
def test_grad_scaler_inf_on_one_rank_skips_everywhere(world2, inject: bool, wrapped: bool) -> None:  # type: ignore[no-untyped-def]
    res = world2.run(_scaled, inject, wrapped)
    assert res[0] == res[1], res  # the ranks agree
    if inject:
        assert res[0]["scales"] == [2.0**10, 2.0**9] and res[0]["changed"] == [True, False] and res[0]["steps"] == [1], res
    else:
        assert res[0]["scales"] == [2.0**10, 2.0**10] and res[0]["changed"] == [True, True] and res[0]["steps"] == [2], res


# ---- static mode -----------------------------------------------------------------------------
def _eager_or_static(rank: int, stage: str, static: bool) -> dict[str, Any]:
    """4 AdamW steps of bf16 mixed precision, eager or captured by ``ap.to_static`` and replayed."""
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), STAGES[stage](mesh) if STAGES[stage] else None,
                             mixed_precision=ap.MixedPrecision(torch.bfloat16))
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if static else None
    losses = []
    for x, y in _batches(4):
        xs, ys = ap.shard_tensor(x, mesh, [S0]), ap.shard_tensor(y, mesh, [S0])
        if dm is not None:
            loss = dm(xs, ys)
        else:
            loss = F.cross_entropy(model(xs), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach().full_tensor()))
    programs = sorted(type(v).__name__ for v in dm._programs.values()) if dm is not None else []
    return {"losses": losses, "params": [p.detach().full_tensor() for p in model.parameters()], "programs": programs}


@pytest.mark.parametrize("stage", ["dp", "zero3"])
def test_static_replays_like_eager(world2, stage: str) -> None:  # type: ignore[no-untyped-def]
    eager, static = world2.run(_eager_or_static, stage, False)[0], world2.run(_eager_or_static, stage, True)[0]
    assert static["programs"] == ["_Program"]  # captured, and the later steps replayed it
    assert eager["losses"] == static["losses"]
    assert all(torch.equal(a, b) for a, b in zip(eager["params"], static["params"]))


# ---- bad policies ----------------------------------------------------------------------------
def _bad(rank: int, case: str) -> None:
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    if case == "int":
        ap.MixedPrecision(torch.int32)
    elif case == "reduce":
        ap.MixedPrecision(torch.bfloat16, reduce_dtype="float32")  # type: ignore[arg-type]
    elif case == "kind":
        model = ap.shard_layer(_mlp(), mesh)
        ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), mixed_precision="bf16")  # type: ignore[arg-type]
    else:  # plain parameters: there is nothing to cast on the mesh
        ap.shard_optimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), mixed_precision=ap.MixedPrecision())


@pytest.mark.parametrize("case, error, match", [
    ("int", ValueError, r"param_dtype=torch.int32 is not a floating dtype"),
    ("reduce", TypeError, r"reduce_dtype must be a torch.dtype, got str"),
    ("kind", TypeError, r"mixed_precision must be ap.MixedPrecision\(...\) or None, got str"),
    ("plain", TypeError, r"is a plain tensor.*mixed_precision casts DistTensor parameters"),
])
def test_bad_policy_raises_on_every_rank(world2, case: str, error: type, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        world2.run(_bad, case)
