"""Autocast on DistTensors (one process, a mesh of one): the casts autocast inserts are sharded ops.

Under ``torch.autocast`` the backward casts gradients with ``_to_copy(..., device=<device>)``:
the decision is made on meta tensors, so a ``device`` argument must not send the fake run to a
real device (it did: "no meta kernel", and the op ran replicated with a warning).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Replicate, Shard


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def test_bf16_autocast_forward_and_backward_stay_sharded() -> None:
    torch.manual_seed(0)
    model = MLP()
    plain = copy.deepcopy(model)
    mesh = ap.ProcessMesh([[0]], dim_names=["dp", "mp"])
    ap.parallelize(model, mesh, {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op falls back to running replicated
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ap.shard_tensor(x, mesh, [Shard(0), Replicate()]))
            ref = plain(x)
        F.cross_entropy(out.float(), ap.shard_tensor(y, mesh, [Shard(0), Replicate()])).backward()
    F.cross_entropy(ref.float(), y).backward()
    assert out.dtype == torch.bfloat16 and out.placements == (Shard(0), Replicate())
    assert torch.equal(out.full_tensor(), ref)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad.full_tensor(), q.grad)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_to_with_a_device_keeps_the_layout(device: object) -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    x = ap.shard_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = x.to(device=device, dtype=torch.float64)
    assert y.placements == (Shard(1),) and y.dtype == torch.float64
    assert torch.equal(y.full_tensor(), x.full_tensor().double())
