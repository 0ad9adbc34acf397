"""Mixed precision on CUDA: an NCCL world of one process on one GPU (a mesh of 1).

Self-contained: each test spawns one process that starts its own NCCL process group through a
``FileStore`` in a temp dir (world size 1), so the pytest process keeps no process group. Checks
(the CPU versions are in tests/world/test_mixed_precision.py):

* bf16 autocast + ``ap.MixedPrecision(bfloat16)`` under ZeRO-3 and DP trains like one process
  running the same policy by hand, within ``BF16_RTOL`` (normwise; why: that module's docstring);
  masters and AdamW states stay fp32.
* fp16 + ``ap.GradScaler("cuda")``: a clean step steps and keeps the scale; an inf gradient
  makes the step skip (parameters unchanged) and halves the scale.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.gpu
BF16_RTOL = 2e-2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).cuda()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g).cuda(), torch.randint(0, 10, (16,), generator=g).cuda()) for _ in range(n)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _autocast_bf16(stage: str) -> None:
    import autoparallel as ap

    mesh = ap.ProcessMesh([0], ["dp"])
    ref = _mlp()
    model = ap.shard_layer(_mlp(), mesh)
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ap.ShardingStage3(mesh) if stage == "zero3" else None,
                             mixed_precision=ap.MixedPrecision(torch.bfloat16, cast_inputs=False))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for x, y in _batches(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
            loss = F.cross_entropy(out, ap.shard_tensor(y, mesh, [ap.Shard(0)]))
        assert out.dtype == torch.bfloat16 and out.to_local().is_cuda
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            copies = {n: p.to(torch.bfloat16) for n, p in ref.named_parameters()}
            ref_loss = F.cross_entropy(torch.func.functional_call(ref, copies, (x,)), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert _rel(loss.detach().full_tensor(), ref_loss.detach()) < BF16_RTOL
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and _rel(p.detach().full_tensor(), q.detach()) < BF16_RTOL
    assert {v.dtype for st in opt.state.values() for v in st.values() if v.dim()} == {torch.float32}


def _fp16_scaler(stage: str) -> None:
    import autoparallel as ap

    mesh = ap.ProcessMesh([0], ["dp"])
    model = ap.shard_layer(_mlp(), mesh)
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ap.ShardingStage2(mesh) if stage == "zero2" else None,
                             mixed_precision=ap.MixedPrecision(torch.float16))
    scaler = ap.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000)
    for k, (x, y) in enumerate(_batches(2)):
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        out = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
        assert out.dtype == torch.float16
        scaler.scale(F.cross_entropy(out.float(), ap.shard_tensor(y, mesh, [ap.Shard(0)]))).backward()
        if k == 1:
            opt.reduce_gradients()
            with torch.no_grad():
                model[2].bias.grad.to_local()[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(p.detach().full_tensor(), q) for p, q in zip(model.parameters(), before))
        assert changed == (k == 0) and scaler.get_scale() == (2.0**10 if k == 0 else 2.0**9), (k, changed, scaler.get_scale())


def _worker(rank: int, path: str, fn: Any, stage: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1)
    try:
        fn(stage)
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, stage: str) -> None:
    path = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(_worker, args=(path, fn, stage), nprocs=1)


@pytest.mark.parametrize("stage", ["dp", "zero3"])
def test_cuda_bf16_autocast_with_mixed_precision(stage: str) -> None:
    _spawn(_autocast_bf16, stage)


@pytest.mark.parametrize("stage", ["dp", "zero2"])
def test_cuda_fp16_grad_scaler_skips_inf(stage: str) -> None:
    _spawn(_fp16_scaler, stage)
