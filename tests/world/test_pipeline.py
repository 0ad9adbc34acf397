"""Pipelines on an 8-rank gloo world: every schedule trains like one process; bad input fails clean.

Configurations (stage meshes are disjoint slices of the 8 ranks, data parallel inside each):
naive (annotations + reshard only) on 2 and 4 stages; FThenB, 1F1B, Interleaved1F1B, ZBH1, ZBV on
2 and 4 stage meshes; and the 3-D hybrid dp=2 x tp=2 x pp=2 fed by ``shard_dataloader``. Each trains
a few SGD-momentum steps and compares the loss of every step and every parameter with the
same training on one process (fp32, rtol 1e-5).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard
from autoparallel.pipeline import Pipeline, ScheduleError, Stage, split_sequential, stages_from_annotations

D, BATCH, STEPS = 8, 16, 2
R = Replicate()


class Block(nn.Module):
    """x + fc2(tanh(fc1(x))): the Megatron MLP pair (fc1 column-, fc2 row-parallel under TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor, nn.Sequential]:
    torch.manual_seed(0)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    return x, t, nn.Sequential(*[Block() for _ in range(8)])


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square().mean()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)


def _reference(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> list[float]:
    opt, losses = _sgd(model), []
    for _ in range(STEPS):
        loss = _mse(model(x), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _meshes(groups: list[list[int]]) -> list[ap.ProcessMesh]:
    return [ap.ProcessMesh(g, dim_names=["dp"]) for g in groups]


def _compare(rank: int, model: nn.Module, ref: nn.Module, losses: list[Any], ref_losses: list[float]) -> dict[str, Any]:
    """Every parameter (on the ranks of its mesh) and every loss (on the last mesh) vs the reference."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if rank in p.process_mesh and not torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6):
            bad.append(name)
    mine = [float(v.full_tensor()) for v in losses if v.to_local().numel()] if losses else []
    ok = all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(mine, ref_losses))
    return {"bad_params": bad, "losses_ok": ok, "checked_losses": len(mine)}


# ---- naive: annotations only (shard_tensor parameters, reshard activations) ----------------
def _naive(rank: int, groups: list[list[int]]) -> dict[str, Any]:
    x, t, ref = _data()
    model = copy.deepcopy(ref)
    ref_losses = _reference(ref, x, t)
    meshes = _meshes(groups)
    per = len(model) // len(meshes)
    for i, block in enumerate(model):  # Paddle style: each layer's parameters on its stage mesh
        mesh = meshes[i // per]
        for mod in (block.fc1, block.fc2):
            mod.weight = ap.shard_tensor(mod.weight, mesh, [R])
            mod.bias = ap.shard_tensor(mod.bias, mesh, [R])
    stages = stages_from_annotations(model, meshes)
    assert [s.mesh for s in stages] == meshes and all(len(s.module) == per for s in stages)
    opt, losses = _sgd(model), []
    for _ in range(STEPS):
        h = ap.shard_tensor(x, meshes[0], [Shard(0)])
        for i, block in enumerate(model):
            if i and i % per == 0:
                h = ap.reshard(h, meshes[i // per], [Shard(0)])  # send to the next stage
            h = block(h)
        loss = _mse(h, ap.shard_tensor(t, meshes[-1], [Shard(0)]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return _compare(rank, model, ref, losses, ref_losses)


# ---- scheduled: split_sequential + Pipeline ------------------------------------------------
def _scheduled(rank: int, groups: list[list[int]], schedule: str, m: int, chunks: int) -> dict[str, Any]:
    x, t, ref = _data()
    model = copy.deepcopy(ref)
    ref_losses = _reference(ref, x, t)
    meshes = _meshes(groups)
    stages = split_sequential(model, meshes, num_chunks=chunks, placement="v" if schedule == "ZBV" else "loop")
    pipe = Pipeline(stages, _mse, num_microbatches=m, schedule=schedule)
    opt, losses = _sgd(model), []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pipe.step(ap.shard_tensor(x, meshes[0], [Shard(0)]), ap.shard_tensor(t, stages[-1].mesh, [Shard(0)]))
        opt.step()
        losses.append(loss)
    return _compare(rank, model, ref, losses, ref_losses)


# ---- stage meshes that split the batch differently -----------------------------------------
def _mixed(rank: int, groups: list[list[int]], names: list[str], m: int) -> dict[str, Any]:
    # the inputs are split over the first mesh's data-parallel shards, the targets over the
    # last's: each shard cuts its own rows, so with different shard counts a micro-batch's
    # targets are other rows than its inputs unless the targets are reordered to match
    x, t, ref = _data()
    model = copy.deepcopy(ref)
    ref_losses = _reference(ref, x, t)
    meshes = [ap.ProcessMesh(g, dim_names=[n]) for g, n in zip(groups, names)]
    pipe = Pipeline(split_sequential(model, meshes), _mse, num_microbatches=m, schedule="1F1B")

    def batch(mesh: ap.ProcessMesh) -> list[Any]:
        return [Shard(0) if mesh.dim_names[0] == "dp" else R]

    opt, losses = _sgd(model), []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pipe.step(ap.shard_tensor(x, meshes[0], batch(meshes[0])),
                                ap.shard_tensor(t, meshes[-1], batch(meshes[-1]))))
        opt.step()
    return _compare(rank, model, ref, losses, ref_losses)


@pytest.mark.parametrize("groups, names, m", [
    ([[0, 1, 2, 3], [4, 5]], ["dp", "dp"], 2),      # 4 shards in, 2 out
    ([[0], [1, 2, 3, 4]], ["dp", "dp"], 4),         # 1 in, 4 out
    ([[0, 1], [2, 3]], ["dp", "tp"], 2),            # sharded in, replicated out
])
def test_stage_meshes_splitting_the_batch_differently_match_single_process(world8, groups, names, m):  # type: ignore[no-untyped-def]
    results = world8.run(_mixed, groups, names, m)
    _check(results, groups[-1])


# ---- clipping by the global norm: every stage's gradients ----------------------------------
MAX_NORM = 0.05  # below the gradients' norm: every step clips


def _clipped(rank: int, norm_type: float) -> dict[str, Any]:
    # torch.nn.utils.clip_grad_norm_ on a pipeline rank sees only its stage's gradients (the
    # other stages' backward never ran there): each stage would be clipped by its own norm.
    # ap.clip_grad_norm_ takes every stage's parameters, the same list on every rank.
    x, t, ref = _data()
    model = copy.deepcopy(ref)
    ref_opt, ref_losses, ref_norms = _sgd(ref), [], []
    for _ in range(STEPS):
        loss = _mse(ref(x), t)
        ref_opt.zero_grad()
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)))
        ref_opt.step()
        ref_losses.append(loss.item())
    meshes = _meshes(TWO)
    pipe = Pipeline(split_sequential(model, meshes), _mse, num_microbatches=2, schedule="1F1B")
    opt, losses, norms = _sgd(model), [], []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pipe.step(ap.shard_tensor(x, meshes[0], [Shard(0)]), ap.shard_tensor(t, meshes[-1], [Shard(0)])))
        norms.append(float(ap.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    out = _compare(rank, model, ref, losses, ref_losses)
    out["norms_ok"] = all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)) and min(ref_norms) > MAX_NORM
    return out


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_over_every_stage_matches_single_process(world8, norm_type):  # type: ignore[no-untyped-def]
    results = world8.run(_clipped, norm_type)
    _check(results, TWO[-1])
    assert all(r["norms_ok"] for r in results)


def _check(results: list[dict[str, Any]], last_mesh: list[int]) -> None:
    assert all(not r["bad_params"] for r in results), [r["bad_params"] for r in results]
    assert all(r["losses_ok"] for r in results)
    assert [r["checked_losses"] for r in results] == [STEPS if i in last_mesh else 0 for i in range(8)]


TWO = [[0, 1, 2, 3], [4, 5, 6, 7]]
FOUR = [[0, 1], [2, 3], [4, 5], [6, 7]]
ONES = [[0], [1], [2], [3]]  # one-rank stage meshes run modules on local tensors; ranks 4-7 idle


@pytest.mark.parametrize("groups", [TWO, FOUR], ids=["2stages", "4stages"])
def test_naive_pipeline_matches_single_process(world8, groups):  # type: ignore[no-untyped-def]
    _check(world8.run(_naive, groups), groups[-1])


@pytest.mark.parametrize("groups, schedule, m, chunks", [
    (TWO, "FThenB", 2, 1),
    (FOUR, "FThenB", 4, 1),
    (TWO, "1F1B", 4, 1),
    (FOUR, "1F1B", 4, 1),
    (TWO, "Interleaved1F1B", 4, 2),
    (FOUR, "Interleaved1F1B", 4, 2),
    (ONES, "Interleaved1F1B", 8, 2),
    (FOUR, "ZBH1", 8, 1),
    (ONES, "ZBH1", 8, 1),
    (FOUR, "ZBV", 8, 2),
    (ONES, "ZBV", 4, 2),
], ids=["fthenb-2", "fthenb-4", "1f1b-2", "1f1b-4", "interleaved-2x2", "interleaved-4x2", "interleaved-4x2-one-rank-stages",
        "zbh1-4", "zbh1-4-one-rank-stages", "zbv-4x2", "zbv-4x2-one-rank-stages"])
def test_scheduled_pipeline_matches_single_process(world8, groups, schedule, m, chunks):  # type: ignore[no-untyped-def]
    # (a V's last chunk, and so the loss, is on the first mesh)
    _check(world8.run(_scheduled, groups, schedule, m, chunks), groups[0] if schedule == "ZBV" else groups[-1])


# ---- activation memory: ZBH1 within 1F1B's peak --------------------------------------------
class GeluBlock(nn.Module):
    """x + fc2(gelu(fc1(x))): GELU reads its input in the backward, which W never needs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _activation_peaks(rank: int, schedule: str) -> int | None:
    from autoparallel.pipeline import ActivationMeter

    torch.manual_seed(0)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    model = nn.Sequential(*[GeluBlock() for _ in range(8)])
    meshes = _meshes(ONES)
    pipe = Pipeline(split_sequential(model, meshes), _mse, num_microbatches=8, schedule=schedule)
    xd, td = ap.shard_tensor(x, meshes[0], [R]), ap.shard_tensor(t, meshes[-1], [R])
    pipe.meter = ActivationMeter(exclude=[*model.parameters(), xd, td])
    pipe.step(xd, td)
    return pipe.meter.peak if rank < len(ONES) else None


def test_zero_bubble_h1_holds_no_more_activation_memory_than_1f1b(world8):  # type: ignore[no-untyped-def]
    """ZBH1 holds ``p`` micro-batches on every stage until their ``W`` (1F1B: ``p - s``), but ``B``
    drops what only it reads (here the GELUs' inputs): no rank exceeds 1F1B's peak, which is its
    first stage's, and the first stage holds what it holds under 1F1B."""
    one, zb = world8.run(_activation_peaks, "1F1B")[:4], world8.run(_activation_peaks, "ZBH1")[:4]
    assert zb[0] == one[0] == max(one), (one, zb)
    assert max(zb) <= max(one) and all(z > o for z, o in zip(zb[2:], one[2:])), (one, zb)


# ---- 3-D hybrid: dp=2 x tp=2 inside each stage mesh, pp=2 across them ----------------------
def _hybrid(rank: int, schedule: str, chunks: int, zero: int = 0) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    xs, ts = torch.randn(3 * BATCH, D), torch.randn(3 * BATCH, D)
    ref = nn.Sequential(*[Block() for _ in range(8)])
    model = copy.deepcopy(ref)
    mesh0 = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    mesh1 = ap.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "tp"])
    plan = {"*.fc1": ap.ColWiseParallel(), "*.fc2": ap.RowWiseParallel()}
    stages = split_sequential(model, [mesh0, mesh1], num_chunks=chunks, plan=plan)
    assert list(stages[0].module[0].fc1.weight.placements) == [R, Shard(0)]
    pipe = Pipeline(stages, _mse, num_microbatches=2, schedule=schedule)
    loader = ap.shard_dataloader(DataLoader(TensorDataset(xs, ts), batch_size=BATCH), [mesh0, mesh1], shard_dims="dp")
    opt, ref_opt, losses, ref_losses = _sgd(model), _sgd(ref), [], []
    if zero:  # ZeRO inside every stage: states (grads for 2, parameters for 3) sharded along each stage's dp axis
        world = ap.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["pp", "dp", "tp"])
        opt = ap.shard_optimizer(opt, {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}[zero](world, "dp"))
    for (xb, tb), k in zip(loader, range(STEPS)):
        opt.zero_grad()
        losses.append(pipe.step(xb, tb))
        opt.step()
        ref_loss = _mse(ref(xs[k * BATCH:(k + 1) * BATCH]), ts[k * BATCH:(k + 1) * BATCH])
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    return _compare(rank, model, ref, losses, ref_losses)


@pytest.mark.parametrize("schedule, chunks, zero", [("1F1B", 1, 0), ("Interleaved1F1B", 2, 2), ("ZBH1", 1, 3)],
                         ids=["1f1b", "interleaved-zero2", "zbh1-zero3"])
def test_3d_hybrid_dp_tp_pp_matches_single_process(world8, schedule, chunks, zero):  # type: ignore[no-untyped-def]
    _check(world8.run(_hybrid, schedule, chunks, zero), [4, 5, 6, 7])


# ---- bad input: the same clear error on every rank before any transfer; world stays healthy --
def _stages(groups: list[list[int]], chunks: int = 1) -> list[Stage]:
    return split_sequential(_data()[2], _meshes(groups), num_chunks=chunks)


def _bad_microbatches(rank: int) -> None:
    pipe = Pipeline(_stages(TWO), _mse, num_microbatches=3, schedule="1F1B")
    x, t, _ = _data()
    pipe.step(ap.shard_tensor(x, pipe.meshes[0], [Shard(0)]), ap.shard_tensor(t, pipe.meshes[-1], [Shard(0)]))


def _bad_overlap(rank: int) -> None:
    split_sequential(_data()[2], [ap.ProcessMesh([0, 1, 2, 3], ["dp"]), ap.ProcessMesh([2, 3, 4, 5], ["dp"])])


def _bad_unassigned_annotation(rank: int) -> None:
    model = _data()[2]
    meshes = _meshes(TWO)
    for i, block in enumerate(model):
        if i != 5:  # block 5 forgotten
            for mod in (block.fc1, block.fc2):
                mod.weight = ap.shard_tensor(mod.weight, meshes[i // 4], [R])
                mod.bias = ap.shard_tensor(mod.bias, meshes[i // 4], [R])
    stages_from_annotations(model, meshes)


def _bad_stage_mesh(rank: int) -> None:
    model = _data()[2]
    meshes = _meshes(TWO)
    fc = model[5].fc1  # block 5 goes to the second stage: laid out on the first stage's mesh
    fc.weight = ap.shard_tensor(fc.weight, meshes[0], [R])
    split_sequential(model, meshes)


def _bad_unassigned_stage(rank: int) -> None:
    stages = _stages(TWO)
    stages[1].module.add_module("extra", nn.Linear(D, D))  # a layer no one placed
    Pipeline(stages, _mse, num_microbatches=2)


def _bad_schedule(rank: int) -> None:
    Pipeline(_stages(FOUR, chunks=2), _mse, num_microbatches=2, schedule="Interleaved1F1B")


def _bad_zero_bubble_stage(rank: int) -> None:
    stages = _stages(TWO)
    for prm in stages[1].module.parameters():
        prm.requires_grad_(False)  # a frozen stage: no weight gradients for W
    Pipeline(stages, _mse, num_microbatches=2, schedule="ZBH1")


def _bad_zero_bubble_hook(rank: int) -> None:
    stages = _stages(TWO)
    pipe = Pipeline(stages, _mse, num_microbatches=2, schedule="ZBH1")
    stages[0].module[0].fc1.weight.register_post_accumulate_grad_hook(lambda p: None)  # after the pipeline
    x, t, _ = _data()
    pipe.step(ap.shard_tensor(x, pipe.meshes[0], [Shard(0)]), ap.shard_tensor(t, pipe.meshes[-1], [Shard(0)]))


def _bad_zbv_order(rank: int) -> None:
    Pipeline(_stages(TWO, chunks=2), _mse, num_microbatches=4, schedule="ZBV")  # round robin, not a V


def _no_reduction(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square()  # forgot .mean()


def _bad_loss(rank: int) -> None:
    pipe = Pipeline(_stages(FOUR), _no_reduction, num_microbatches=2, schedule="FThenB")
    x, t, _ = _data()
    pipe.step(ap.shard_tensor(x, pipe.meshes[0], [Shard(0)]), ap.shard_tensor(t, pipe.meshes[-1], [Shard(0)]))


def _healthy(rank: int) -> bool:
    x = ap.shard_tensor(torch.arange(16.0), ap.ProcessMesh(list(range(8))), [Shard(0)])
    return bool(torch.equal(x.full_tensor(), torch.arange(16.0)))


@pytest.mark.parametrize("fn, error, match", [
    (_bad_microbatches, ValueError, r"3 micro-batches do not divide the inputs batch of 16 samples split over 4 data-parallel shards"),
    (_bad_overlap, ValueError, r"stage meshes 0 \[0, 1, 2, 3\] and 1 \[2, 3, 4, 5\] overlap on ranks \[2, 3\]"),
    (_bad_unassigned_annotation, ValueError, r"layer '5' is not assigned to a stage: parameter 5.fc1.weight is a plain tensor"),
    (_bad_stage_mesh, ValueError, r"split_sequential: parameter 5.fc1.weight of stage 1 is already on ProcessMesh\(\[0, 1, 2, 3\].*"
                                  r"but stage 1 runs on ProcessMesh\(\[4, 5, 6, 7\]"),
    (_bad_unassigned_stage, ValueError, r"parameter 'extra.weight' of stage 1 \(4..7\) is a plain tensor"),
    (_bad_schedule, ScheduleError, r"Interleaved1F1B needs the micro-batch count to be a multiple of the 4 stage meshes.*got 2"),
    (_bad_loss, TypeError, r"loss_fn must return a one-element DistTensor, got DistTensor \(8, 8\)"),
    (_bad_zero_bubble_stage, ValueError, r"ZBH1 splits each backward into input and weight gradients, but stage 1 \(4..7\) has no "
                                         r"parameters that train"),
    (_bad_zero_bubble_hook, ValueError, r"ZBH1 adds weight gradients into .grad outside autograd's accumulation, so gradient "
                                        r"hooks on stage 0's parameters \['0.fc1.weight'\] would not run"),
    (_bad_zbv_order, ValueError, r"ZBV needs the stages to visit the 2 stage meshes in a V .*placement='v'.*got mesh "
                                 r"order \[0, 1, 0, 1\], expected \[0, 1, 1, 0\]"),
], ids=["microbatches", "overlap", "unassigned-annotation", "stage-mesh", "unassigned-stage", "schedule-needs-more", "loss-not-scalar",
        "zero-bubble-frozen-stage", "zero-bubble-hook", "zbv-not-a-v"])
def test_bad_input_same_error_on_every_rank(world8, fn, error, match):  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match) as info:
        world8.run(fn, timeout=60)
    assert "[all 8 ranks raised]" in str(info.value)
    assert all(world8.run(_healthy))
