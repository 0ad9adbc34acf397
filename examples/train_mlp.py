"""Train an MLP with data parallel x tensor parallel on a 2x2 mesh, and check it against one process.

    torchrun --standalone --nproc-per-node 4 examples/train_mlp.py

The mesh is ``[[0, 1], [2, 3]]`` with axes ``dp`` and ``mp``. The first Linear is column-
parallel (weight ``Shard(0)`` on ``mp``), the second row-parallel (weight ``Shard(1)``), the
batch is ``Shard(0)`` on ``dp``. Nothing else changes from the single-device script: the
framework inserts the all-reduces (row-parallel output, data-parallel gradients). At the end
every rank compares the losses and parameters with the same training run on one process.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data import spirals  # noqa: E402

import autoparallel as ap  # noqa: E402


class MLP(nn.Module):
    def __init__(self, hidden: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def mse_onehot(logits: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    return ((logits - onehot) ** 2).mean()


def train(model: nn.Module, x: torch.Tensor, onehot: torch.Tensor, steps: int, lr: float, batch: int, shard) -> list[float]:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    losses = []
    n = x.shape[0]
    for step in range(steps):
        lo = (step * batch) % n
        xb, yb = shard(x[lo:lo + batch]), shard(onehot[lo:lo + batch])
        loss = mse_onehot(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach()
        value = value.full_tensor() if isinstance(value, ap.DistTensor) else value
        losses.append(float(value))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    rank, world = ap.get_rank(), ap.get_world_size()
    if world != 4:
        raise SystemExit(f"run with 4 ranks: torchrun --nproc-per-node 4 {sys.argv[0]} (got a world of {world})")
    torch.manual_seed(0)
    x, y = spirals()
    onehot = F.one_hot(y, 3).float()
    reference = MLP(args.hidden)
    model = copy.deepcopy(reference)

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    R, S = ap.Replicate(), ap.Shard
    model.fc1.weight = ap.shard_tensor(model.fc1.weight, mesh, [R, S(0)])  # column-parallel
    model.fc1.bias = ap.shard_tensor(model.fc1.bias, mesh, [R, S(0)])
    model.fc2.weight = ap.shard_tensor(model.fc2.weight, mesh, [R, S(1)])  # row-parallel
    model.fc2.bias = ap.shard_tensor(model.fc2.bias, mesh, [R, R])

    t0 = time.perf_counter()
    with ap.CommDebugMode() as comm:
        losses = train(model, x, onehot, args.steps, args.lr, args.batch, lambda t: ap.shard_tensor(t, mesh, [S(0), R]))
    elapsed = time.perf_counter() - t0
    ref_losses = train(reference, x, onehot, args.steps, args.lr, args.batch, lambda t: t)

    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    params_ok = all(
        torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters())
    )
    if rank == 0:
        for step in range(0, args.steps, max(1, args.steps // 10)):
            print(f"step {step:4d}  loss {losses[step]:.6f}  (single process {ref_losses[step]:.6f})")
        counts = {k: v // args.steps for k, v in comm.get_comm_counts().items()}
        print(f"collectives per step on rank 0: {counts}; {comm.bytes_received / args.steps / 1024:.1f} KiB received per step")
        print(f"{args.steps} steps in {elapsed:.2f}s; final loss {losses[-1]:.6f}; "
              f"max relative loss difference vs single process {worst:.2e}; parameters match: {params_ok}")
    if worst > 1e-5 or not params_ok:
        raise SystemExit(f"rank {rank}: distributed run differs from the single-process run")


if __name__ == "__main__":
    main()
