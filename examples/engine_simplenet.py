"""The primer's four static semi-auto programs with ``ap.Engine``, each checked against one process.

    torchrun --standalone --nproc-per-node 2 examples/engine_simplenet.py --strategy pp
    torchrun --standalone --nproc-per-node 4 examples/engine_simplenet.py --strategy all

SimpleNet (``Linear(256, inner) -> Linear(inner, 256) -> Linear(256, 10) -> ReLU``), SGD with
momentum 0.9 and weight decay 1e-4, cross-entropy, ``Accuracy(topk=(1, 5))``, batches of 32
synthetic samples. What each program adds to the single-device script (docs/engine.md):

========  ==========================================================================================
dp        nothing: the default ``ap.Strategy()`` is data parallel over the whole world
sharding  ``strategy.sharding``: optimizer states split over the ranks (stage 1; ``--stage`` 2, 3)
mp        ``forward`` marks layouts with dims mappings on a mesh ``["mp"]``: linear1 column-parallel,
          linear2 row-parallel, the last product through ``ap.shard_op`` (replicated)
pp        ``forward`` assigns layers to stages with ``ap.shard_op(layer, world_mesh[k])``;
          ``strategy.pipeline``: 2 micro-batches of 16, 1F1B (``--schedule`` FThenB)
========  ==========================================================================================

Rank 0 prints each step's loss and accuracies next to the single-process run's, and whether
every loss and parameter matches (rtol 1e-5); the exit code is 1 if one does not.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoparallel as ap  # noqa: E402

STRATEGIES = ("dp", "sharding", "mp", "pp")
CLASSES, FEATURES, BATCH = 10, 256, 32


class RandomDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic images and labels from a fixed seed (the same on every rank)."""

    def __init__(self, num_samples: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(num_samples, FEATURES, generator=g)
        self.labels = torch.randint(0, CLASSES, (num_samples,), generator=g)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[idx], self.labels[idx]

    def __len__(self) -> int:
        return len(self.images)


class SimpleNet(nn.Module):
    """The single-device model."""

    def __init__(self, inner: int = 1024) -> None:
        super().__init__()
        self.linear1 = nn.Linear(FEATURES, inner)
        self.linear2 = nn.Linear(inner, FEATURES)
        self.linear3 = nn.Linear(FEATURES, CLASSES)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear3(self.linear2(self.linear1(x))))


class MPSimpleNet(SimpleNet):
    """Model parallel: dims mappings in ``forward`` (torch's Linear weight is ``(out, in)``)."""

    def __init__(self, inner: int, mesh: ap.ProcessMesh) -> None:
        super().__init__(inner)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ap.shard_tensor(self.linear1.weight, self.mesh, ["mp", None])   # column-parallel
        ap.shard_tensor(self.linear1.bias, self.mesh, ["mp"])
        ap.shard_tensor(self.linear2.weight, self.mesh, [None, "mp"])   # row-parallel
        x = self.linear2(self.linear1(x))
        matmul = ap.shard_op(torch.matmul, self.mesh, [[None, None], [None, None]])
        return self.relu(matmul(x, self.linear3.weight.t()) + self.linear3.bias)


class PPSimpleNet(SimpleNet):
    """Pipeline: each layer's stage is the mesh ``shard_op`` gives it; linear2 follows its input."""

    def __init__(self, inner: int, mesh: ap.ProcessMesh) -> None:
        super().__init__(inner)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ap.shard_op(self.linear1, self.mesh[0])(x)
        x = self.linear2(x)
        x = ap.shard_op(self.linear3, self.mesh[1])(x)
        return self.relu(x)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def program(strategy: str, inner: int, stage: int = 1, schedule: str = "1F1B") -> tuple[nn.Module, ap.Strategy]:
    """The model and ``ap.Strategy`` of one of the four programs."""
    world = ap.get_world_size()
    s = ap.Strategy()
    if strategy == "dp":
        return SimpleNet(inner), s
    if strategy == "sharding":
        s.sharding.enable, s.sharding.stage, s.sharding.degree = True, stage, world
        return SimpleNet(inner), s
    if strategy == "mp":
        return MPSimpleNet(inner, ap.ProcessMesh(list(range(world)), dim_names=["mp"])), s
    if world % 2:
        raise SystemExit(f"--strategy pp needs an even number of ranks (2 stages), got a world of {world}")
    # 2 stages; with 4 ranks each stage is data parallel over 2
    mesh = ap.ProcessMesh(torch.arange(world).reshape(2, world // 2).tolist(), dim_names=["pp", "dp"])
    s.pipeline.enable = True
    s.pipeline.micro_batch_size = BATCH // 2
    s.pipeline.accumulate_steps = 2
    s.pipeline.schedule_mode = schedule
    return PPSimpleNet(inner, mesh), s


@dataclass
class Result:
    logs: list[dict[str, float]] = field(default_factory=list)
    reference: list[dict[str, float]] = field(default_factory=list)
    worst_loss: float = 0.0
    worst_param: str = ""
    ok: bool = False


def _reference(inner: int, data: RandomDataset, steps: int) -> tuple[list[dict[str, float]], nn.Module]:
    """One process: the same model, optimizer and batches."""
    torch.manual_seed(0)
    model = SimpleNet(inner)
    opt = make_optimizer(model)
    logs, hits, seen = [], torch.zeros(2), 0
    for i in range(steps):
        x, y = data.images[i * BATCH:(i + 1) * BATCH], data.labels[i * BATCH:(i + 1) * BATCH]
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        top = out.detach().topk(5, dim=1).indices
        hits += torch.stack([(top[:, :1] == y[:, None]).sum(), (top == y[:, None]).sum()]).float()
        seen += BATCH
        logs.append({"loss": float(loss.detach()), "acc_top1": float(hits[0]) / seen, "acc_top5": float(hits[1]) / seen})
    return logs, model


def run(strategy: str, steps: int = 4, inner: int = 1024, stage: int = 1, schedule: str = "1F1B") -> Result:
    """Train one program with ``ap.Engine`` and the single-process reference; compare them."""
    data = RandomDataset(BATCH * steps)
    torch.manual_seed(0)
    model, strategy_ = program(strategy, inner, stage, schedule)
    engine = ap.Engine(model, nn.CrossEntropyLoss(), make_optimizer(model),
                       metrics=ap.metrics.Accuracy(topk=(1, 5)), strategy=strategy_)
    engine.prepare(inputs_spec=ap.InputSpec([None, FEATURES], torch.float32, "img"),
                   labels_spec=ap.InputSpec([None], torch.int64, "label"), mode="train")
    loader = engine.dataloader(data, batch_size=BATCH, epochs=1, mode="train")
    res = Result(logs=[engine.run(batch, mode="train") for batch in loader()])
    res.reference, ref_model = _reference(inner, data, steps)
    res.worst_loss = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(res.logs, res.reference, strict=True))
    same_acc = all(abs(a[k] - b[k]) < 1e-9 for a, b in zip(res.logs, res.reference, strict=True) for k in ("acc_top1", "acc_top5"))
    ok_params = True
    rank = ap.get_rank()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if isinstance(p, ap.DistTensor) and rank not in p.process_mesh:
            continue  # another stage's parameter: its ranks check it
        full = p.detach().full_tensor() if isinstance(p, ap.DistTensor) else p.detach()
        if not torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-6):
            ok_params, res.worst_param = False, name
    res.ok = ok_params and same_acc and res.worst_loss <= 1e-5
    return res


def report(strategy: str, res: Result) -> None:
    for step, (got, want) in enumerate(zip(res.logs, res.reference, strict=True)):
        print(f"{strategy} step {step}: loss {got['loss']:.6f} (single process {want['loss']:.6f})  "
              f"acc1 {got['acc_top1']:.3f} acc5 {got['acc_top5']:.3f} "
              f"(single process {want['acc_top1']:.3f} {want['acc_top5']:.3f})")
    verdict = "match" if res.ok else f"DIFFER (parameter {res.worst_param or '-'})"
    print(f"{strategy}: max relative loss difference {res.worst_loss:.2e}; loss, accuracy and parameters "
          f"{verdict} the single-process run")


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank's check passed (a pipeline rank checks its own stage's parameters)."""
    mine = ap.dtensor_from_local(torch.tensor([float(ok)]), ap.ProcessMesh(list(range(ap.get_world_size()))),
                                 [ap.Partial("min")])
    assert isinstance(mine, ap.DistTensor)
    return bool(mine.full_tensor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=(*STRATEGIES, "all"), default="dp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--inner", type=int, default=1024, help="inner width (the primer uses 102400)")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=1, help="sharding stage")
    parser.add_argument("--schedule", choices=("FThenB", "1F1B"), default="1F1B", help="pipeline schedule")
    args = parser.parse_args()
    ok = True
    for strategy in STRATEGIES if args.strategy == "all" else (args.strategy,):
        res = run(strategy, args.steps, args.inner, args.stage, args.schedule)
        ok &= all_ranks_ok(res.ok)
        if ap.get_rank() == 0:
            report(strategy, res)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
