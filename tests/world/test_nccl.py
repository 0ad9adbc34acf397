"""NCCL path: the same reshard and op checks on CUDA tensors (skipped without 2 GPUs)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu


def _worker(rank: int, world: int, path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(path, world), rank=rank, world_size=world)
    try:
        import autoparallel as ap

        mesh = ap.ProcessMesh(list(range(world)))
        full = torch.arange(48.0).reshape(8, 6)
        x = ap.shard_tensor(full, mesh, [ap.Shard(0)])
        assert x.to_local().is_cuda
        for dst in ([ap.Replicate()], [ap.Shard(1)], [ap.Partial()]):
            assert torch.equal(ap.reshard(x, mesh, dst).full_tensor().cpu(), full)
        w = ap.shard_tensor(torch.ones(6, 4), mesh, [ap.Shard(0)])
        y = ap.reshard(x, mesh, [ap.Shard(1)]) @ w
        assert torch.allclose(y.full_tensor().cpu(), full @ torch.ones(6, 4))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_reshard_and_matmul() -> None:
    world = min(torch.cuda.device_count(), 4)
    path = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(_worker, args=(world, path), nprocs=world)
