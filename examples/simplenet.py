"""Paddle's auto-parallel guide's SimpleNet under every data/tensor-parallel strategy, checked against one process.

    torchrun --standalone --nproc-per-node 4 examples/simplenet.py --strategy zero3
    torchrun --standalone --nproc-per-node 2 examples/simplenet.py --strategy dp

SimpleNet is ``Linear(256, inner) -> Linear(inner, 256) -> Linear(256, 10) -> ReLU`` trained with
SGD (momentum 0.9, weight decay 1e-4) on cross-entropy, on synthetic data from a fixed seed.
What each strategy changes in the single-device script:

=========  ==================================================================================
dp         mesh ``[0..n-1]`` named ``dp``; parameters Replicate (``ap.shard_layer``); the batch
           ``Shard(0)``; ``ap.shard_optimizer(opt)`` reduces the gradients once per step, bucketed
zero1/2/3  as dp, with ``ap.shard_optimizer(opt, ap.ShardingStage1/2/3(mesh))``
tp         mesh named ``mp``; ``ap.parallelize``: linear1 column-, linear2 row-parallel;
           linear3 replicated (as in the seed); the batch Replicate
dp_tp      4 ranks, mesh ``[[0, 1], [2, 3]]`` named ``dp, mp``: tp on ``mp``, dp on ``dp``
=========  ==================================================================================

Every rank prints nothing but rank 0: the loss and the collectives of each step (from
``ap.CommDebugMode``), the parameter + optimizer-state bytes per rank against the replicated
figure, and whether loss and every parameter equal the single-process run (exit 1 if not).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoparallel as ap  # noqa: E402

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "dp_tp")
CLASSES = 10


class SimpleNet(nn.Module):
    """Paddle's guide's model: three Linears and a final ReLU."""

    def __init__(self, input_size: int = 256, inner_size: int = 1024, output_size: int = CLASSES) -> None:
        super().__init__()
        self.linear1 = nn.Linear(input_size, inner_size)
        self.linear2 = nn.Linear(inner_size, input_size)
        self.linear3 = nn.Linear(input_size, output_size)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear3(self.linear2(self.linear1(x))))


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)


def batches(steps: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic images and labels, the same on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 256, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)) for _ in range(steps)]


def setup(strategy: str, reference: nn.Module, lr: float) -> tuple[ap.ProcessMesh, nn.Module, Any, list[ap.Placement]]:
    """(mesh, distributed model, optimizer, input placements) for ``strategy``."""
    world = ap.get_world_size()
    model = copy.deepcopy(reference)
    if strategy == "dp_tp":
        if world != 4:
            raise SystemExit(f"--strategy dp_tp needs 4 ranks (a 2x2 mesh), got a world of {world}")
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    else:
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["mp" if strategy == "tp" else "dp"])
    if strategy in ("tp", "dp_tp"):
        plan = {"linear1": ap.ColWiseParallel(), "linear2": ap.RowWiseParallel()}
        ap.parallelize(model, mesh, plan)  # linear3: Replicate
    else:
        ap.shard_layer(model, mesh)
    opt = make_optimizer(model.parameters(), lr)
    stage = {"zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2, "zero3": ap.ShardingStage3}.get(strategy)
    if strategy != "tp":
        opt = ap.shard_optimizer(opt, stage(mesh) if stage else None)
    data = [ap.Shard(0)] if strategy != "tp" else [ap.Replicate()]
    if strategy == "dp_tp":
        data = [ap.Shard(0), ap.Replicate()]
    return mesh, model, opt, data


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    comms: list[dict[str, int]] = field(default_factory=list)
    bytes_per_rank: list[int] = field(default_factory=list)  # parameters + optimizer states
    replicated_bytes: int = 0
    worst_loss: float = 0.0
    worst_param: str = ""
    ok: bool = False


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local if isinstance(t, ap.DistTensor) else t


def state_bytes(model: nn.Module, opt: Any) -> int:
    """Bytes this rank holds for parameters and optimizer states (each storage counted once)."""
    seen: dict[int, int] = {}
    tensors = [_local(p) for p in model.parameters()]
    tensors += [_local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def run(strategy: str, steps: int = 10, inner: int = 1024, batch: int = 32, lr: float = 0.1, seed: int = 0) -> Result:
    """Train ``strategy`` and the single-process reference side by side; compare them."""
    torch.manual_seed(seed)
    reference = SimpleNet(inner_size=inner)
    ref_opt = make_optimizer(reference.parameters(), lr)
    mesh, model, opt, data_pl = setup(strategy, reference, lr)
    res = Result()
    for x, y in batches(steps, batch, seed + 1):
        with ap.CommDebugMode() as comm:
            loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, data_pl)), ap.shard_tensor(y, mesh, data_pl))
            loss.backward()
            opt.step()
            opt.zero_grad()
        res.comms.append(comm.get_comm_counts())
        res.losses.append(float(loss.detach().full_tensor()))
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        res.ref_losses.append(ref_loss.item())
    res.worst_loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(res.losses, res.ref_losses))
    ok_params = True
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6):
            ok_params, res.worst_param = False, name
    everyone = ap.ProcessMesh(list(range(ap.get_world_size())))
    mine = torch.tensor([state_bytes(model, opt)])
    res.bytes_per_rank = ap.dtensor_from_local(mine, everyone, [ap.Shard(0)]).full_tensor().tolist()
    res.replicated_bytes = state_bytes(reference, ref_opt)
    res.ok = ok_params and res.worst_loss <= 1e-5
    return res


def report(strategy: str, res: Result) -> None:
    for step, (loss, ref, comm) in enumerate(zip(res.losses, res.ref_losses, res.comms)):
        print(f"step {step:3d}  loss {loss:.6f}  (single process {ref:.6f})  collectives {comm}")
    n = len(res.bytes_per_rank)
    worst = max(res.bytes_per_rank)
    print(f"parameters + optimizer states per rank: {res.bytes_per_rank} B; replicated {res.replicated_bytes} B; "
          f"largest rank / replicated = {worst / res.replicated_bytes:.4f} (1/{n} = {1 / n:.4f})")
    verdict = "match" if res.ok else f"DIFFER (parameter {res.worst_param or '-'})"
    print(f"{strategy}: max relative loss difference {res.worst_loss:.2e}; loss and parameters {verdict} the single-process run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, default="dp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=1024, help="inner width (the seed uses 102400)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    res = run(args.strategy, args.steps, args.inner, args.batch, args.lr, args.seed)
    if ap.get_rank() == 0:
        report(args.strategy, res)
    if not res.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
