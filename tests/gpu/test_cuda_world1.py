"""CUDA + NCCL, a world of one (the lent GPU machines have one GPU).

Every collective a 1-rank mesh plans still goes through NCCL (group of one), local shards live
on the current CUDA device, and training on a 1 x 1 ``dp x mp`` mesh (DP x TP plan, AdamW), under
ZeRO-3, captured by ``ap.to_static``, and under CUDA bf16 autocast equals plain torch on the same
GPU (fp32: rtol 1e-5 with TF32 off; bf16: the same kernels run, so equal to bf16 rounding).
Skipped without CUDA.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_world1")]

R, S0, S1 = Replicate(), Shard(0), Shard(1)
STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g).cuda(), torch.randint(0, 8, (8,), generator=g).cuda())
            for _ in range(STEPS)]


@pytest.mark.parametrize("dims", [1, 2])
def test_reshard_every_pair_on_nccl(dims: int) -> None:
    mesh = ap.ProcessMesh([0] if dims == 1 else [[0]])
    full = torch.arange(48.0).reshape(8, 6).cuda()
    choices = [R, S0, S1, Partial()]
    for src in choices:
        for dst in choices:
            x = ap.shard_tensor(full, mesh, [src] * dims) if not isinstance(src, Partial) else \
                ap.dtensor_from_local(full.clone(), mesh, [src] * dims)
            y = ap.reshard(x, mesh, [dst] * dims)
            assert y.to_local().is_cuda, (src, dst)
            torch.testing.assert_close(y.full_tensor(), full, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_every_dtype_moves_on_nccl(dtype: torch.dtype) -> None:
    mesh = ap.ProcessMesh([0])
    full = (torch.arange(24).reshape(4, 6) % 2 if dtype is torch.bool else torch.arange(24).reshape(4, 6)).to(dtype).cuda()
    x = ap.shard_tensor(full, mesh, [S0])
    for dst in ([R], [S1]):
        y = ap.reshard(x, mesh, dst)
        assert y.dtype == dtype and y.to_local().dtype == dtype and y.to_local().is_cuda
        assert torch.equal(y.full_tensor(), full)
    if dtype is not torch.bool:
        p = ap.dtensor_from_local(full.clone(), mesh, [Partial()])
        assert torch.equal(ap.reshard(p, mesh, [R]).full_tensor(), full)


def _train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any],
           lay: Callable[[torch.Tensor], Any], full: Callable[[Any], torch.Tensor]) -> list[float]:
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(lay(x)), lay(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(full(loss.detach())))
    return losses


def _reference(model: nn.Module, data: list[Any]) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = _train(model, opt, data, lambda t: t, lambda t: t)
    return losses, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["dp_tp", "zero3"])
def test_training_equals_plain_cuda(kind: str) -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    ref_losses, ref_params = _reference(copy.deepcopy(model), _data())
    if kind == "dp_tp":
        mesh = ap.ProcessMesh([[0]], dim_names=["dp", "mp"])
        ap.parallelize(model, mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
        placements: list[Any] = [S0, R]
    else:
        mesh = ap.ProcessMesh([0], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                                 ap.ShardingStage3(mesh))
        placements = [S0]
    losses = _train(model, opt, _data(), lambda t: ap.shard_tensor(t, mesh, placements), lambda t: t.full_tensor())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for p, ref in zip(model.parameters(), ref_params):
        assert p.to_local().is_cuda
        torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-5, atol=1e-6)


def test_static_equals_eager_cuda() -> None:
    mesh = ap.ProcessMesh([[0]], dim_names=["dp", "mp"])

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = MLP().cuda()
        ap.parallelize(model, mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
        return model, ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))

    model, opt = build()
    eager = _train(model, opt, _data(), lambda t: ap.shard_tensor(t, mesh, [S0, R]), lambda t: t.full_tensor())
    smodel, sopt = build()
    dm = ap.to_static(smodel, loss=F.cross_entropy, optimizer=sopt)
    static = [float(dm(ap.shard_tensor(x, mesh, [S0, R]), ap.shard_tensor(y, mesh, [S0, R])).full_tensor())
              for x, y in _data()]
    torch.testing.assert_close(torch.tensor(static), torch.tensor(eager), rtol=1e-6, atol=0)
    for p, q in zip(smodel.parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-6, atol=0)


def test_bf16_autocast_cuda() -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    plain = copy.deepcopy(model)
    mesh = ap.ProcessMesh([[0]], dim_names=["dp", "mp"])
    ap.parallelize(model, mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
    x, y = _data()[0]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ap.shard_tensor(x, mesh, [S0, R]))
        ref = plain(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.full_tensor(), ref)
    F.cross_entropy(out.float(), ap.shard_tensor(y, mesh, [S0, R])).backward()
    F.cross_entropy(ref.float(), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-2, atol=1e-3)


def test_shard_dataloader_yields_cuda_shards() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    mesh = ap.ProcessMesh([[0]], dim_names=["dp", "mp"])
    data = TensorDataset(torch.arange(32).reshape(8, 4), torch.arange(8))
    loader = ap.shard_dataloader(DataLoader(data, batch_size=4, pin_memory=True), mesh, shard_dims="dp")
    seen = 0
    for x, y in loader:
        assert x.to_local().is_cuda and y.to_local().is_cuda
        assert x.placements == (S0, R)
        assert torch.equal(x.full_tensor().cpu(), data.tensors[0][seen: seen + 4])
        seen += 4
    assert seen == 8


class _Tokens(nn.Module):
    """Token sequences of any length: embedding, attention over t, a head (data parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(11, 16), nn.Linear(16, 48), nn.Linear(16, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(x)).split(16, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_new_lengths_answered_by_their_family_cuda() -> None:
    """Varying sequence lengths under data parallelism: after two captured lengths the region runs
    new ones as its program of open sizes, and training equals plain torch."""
    lengths = [5, 6, 7, 9, 11, 13, 7]
    data = [torch.randint(0, 11, (4, t), generator=torch.Generator().manual_seed(t)).cuda() for t in lengths]
    torch.manual_seed(0)
    model = _Tokens().cuda()
    ref = copy.deepcopy(model)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x in data:
        loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])).flatten(0, 1), ap.shard_tensor(x, mesh, [S0]).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = F.cross_entropy(ref(x).flatten(0, 1), x.flatten())
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(loss.full_tensor(), rloss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    report = ap.local_regions_report(model)["<root>"]
    assert report.count("local (open sizes)") >= 3, report
