"""3-D parallel training (dp x tp x pp) with pipeline schedules, checked against one process.

    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --schedule FThenB --timeline out.svg
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --pp 2 --chunks 2 --schedule Interleaved1F1B
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --pp 2 --chunks 2 --schedule ZBV
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --dp 1 --tp 2 --pp 4 --microbatches 8
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --schedule naive
    torchrun --standalone --nproc-per-node 8 examples/train_pipeline.py --zero 2

The Paddle auto-parallel guide's section 4.4 example, rewritten for autoparallel: two stage
meshes ``[[0, 1], [2, 3]]`` and ``[[4, 5], [6, 7]]`` with axes ``dp`` (data parallel) and ``tp``
(tensor parallel); the first Linear of each pair is column-parallel on its stage mesh, the
second row-parallel on the next one, and the column-sharded activation ``[Shard(0), Shard(2)]``
crosses meshes between them (Paddle's ``dist.reshard(y, mesh1, [Shard(0), Shard(2)])``).
``shard_dataloader`` sends inputs to the first stage mesh and labels to the last.

``--schedule naive`` runs exactly that: parameters annotated with ``shard_tensor``, the forward
calling ``reshard`` between meshes, ``loss.backward()``. The other schedules cut the same model
with ``ap.pipeline.split_sequential`` and run micro-batches with ``ap.pipeline.Pipeline``.
Every rank also trains the model on one process and compares losses and parameters at the end.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoparallel as ap  # noqa: E402
from autoparallel import Replicate, Shard  # noqa: E402
from autoparallel.pipeline import Pipeline, bubble_fraction, split_sequential, theoretical_bubble, write_timeline  # noqa: E402


class RandomDataset(Dataset):
    """Sample ``i``: an input and a label of shape ``[seq_len, hidden]`` (seeded by ``i``)."""

    def __init__(self, seq_len: int, hidden: int, num_samples: int) -> None:
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(index)
        x = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return x, (np.sin(3 * x) + 0.1 * rng.standard_normal(x.shape)).astype("float32")

    def __len__(self) -> int:
        return self.num_samples


def make_model(pairs: int, hidden: int, ffn: int) -> nn.Sequential:
    """``pairs`` x (up: Linear hidden->ffn, GELU, down: Linear ffn->hidden)."""
    layers: list[tuple[str, nn.Module]] = []
    for k in range(pairs):
        layers += [(f"up{k}", nn.Linear(hidden, ffn)), (f"act{k}", nn.GELU()), (f"down{k}", nn.Linear(ffn, hidden))]
    return nn.Sequential(OrderedDict(layers))


def mse(y: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (y - label).square().mean()


def naive_forward(model: nn.Sequential, meshes: list[ap.ProcessMesh], x: torch.Tensor) -> torch.Tensor:
    """Paddle's 4.4 forward: each down-projection starts the next stage; reshard before it."""
    stage = 0
    for name, layer in model.named_children():
        if name.startswith("down") and stage + 1 < len(meshes):
            stage += 1
            x = ap.reshard(x, meshes[stage], [Shard(0), Shard(2)])  # pipeline: cross-mesh send
        x = layer(x)
    return x


def annotate(model: nn.Sequential, meshes: list[ap.ProcessMesh]) -> None:
    """Paddle-style annotations: w0 column-parallel on its mesh, w1 row-parallel on the next."""
    stage = 0
    for name, layer in model.named_children():
        if not isinstance(layer, nn.Linear):
            continue
        if name.startswith("down") and stage + 1 < len(meshes):
            stage += 1
        mesh, col = meshes[stage], name.startswith("up")
        layer.weight = ap.shard_tensor(layer.weight, mesh, [Replicate(), Shard(0 if col else 1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [Replicate(), Shard(0) if col else Replicate()])


def parse() -> argparse.Namespace:
    ap_ = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap_.add_argument("--dp", type=int, default=2)
    ap_.add_argument("--tp", type=int, default=2)
    ap_.add_argument("--pp", type=int, default=2, help="stage meshes")
    ap_.add_argument("--chunks", type=int, default=1, help="model chunks per stage mesh (Interleaved1F1B; 2 for ZBV)")
    ap_.add_argument("--schedule", default="1F1B", help="naive, FThenB, 1F1B, Interleaved1F1B, ZBH1 or ZBV")
    ap_.add_argument("--microbatches", type=int, default=4)
    ap_.add_argument("--batch", type=int, default=16)
    ap_.add_argument("--seq", type=int, default=8)
    ap_.add_argument("--hidden", type=int, default=64)
    ap_.add_argument("--steps", type=int, default=5)
    ap_.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage inside each stage mesh (dp axis)")
    ap_.add_argument("--timeline", default=None, help="write the last step's executed schedule as SVG")
    return ap_.parse_args()


def main() -> None:
    args = parse()
    rank, world = ap.get_rank(), ap.get_world_size()
    if args.dp * args.tp * args.pp != world:
        raise SystemExit(f"dp {args.dp} x tp {args.tp} x pp {args.pp} != world size {world}")
    naive = args.schedule.lower() == "naive"
    if naive and args.chunks != 1:
        raise SystemExit("--schedule naive runs one chunk per stage mesh")
    per = args.dp * args.tp
    meshes = [ap.ProcessMesh(np.arange(s * per, (s + 1) * per).reshape(args.dp, args.tp), dim_names=["dp", "tp"])
              for s in range(args.pp)]
    stages_n = args.pp * args.chunks
    torch.manual_seed(0)
    reference = make_model(stages_n, args.hidden, 4 * args.hidden)
    model = copy.deepcopy(reference)
    if naive:
        annotate(model, meshes)
    else:
        split = [f"down{k}" for k in range(stages_n - 1)]  # Paddle's cut: between up/act and down
        plan = {"up*": ap.ColWiseParallel(), "down*": ap.RowWiseParallel()}
        placement = "v" if args.schedule.upper() == "ZBV" else "loop"  # ZBV: two chunks per mesh, in a V
        stages = split_sequential(model, meshes, split, num_chunks=args.chunks, plan=plan, placement=placement)
        pipe = Pipeline(stages, mse, num_microbatches=args.microbatches, schedule=args.schedule)
        if rank == 0:
            print(pipe.schedule)
    data = RandomDataset(args.seq, args.hidden, args.batch * args.steps)
    last_mesh = meshes[-1] if naive else stages[-1].mesh  # where the loss is (the first mesh again for a V)
    loader = ap.shard_dataloader(DataLoader(data, batch_size=args.batch), meshes=[meshes[0], last_mesh], shard_dims="dp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if args.zero:  # one sharding mesh over all stages; each parameter shards along its own stage's dp axis
        world_mesh = ap.ProcessMesh(np.arange(world).reshape(args.pp, args.dp, args.tp), dim_names=["pp", "dp", "tp"])
        stage_cls = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}[args.zero]
        opt = ap.shard_optimizer(opt, stage_cls(world_mesh, "dp"))

    losses, t0 = [], time.perf_counter()
    for step, (x, label) in enumerate(loader):
        opt.zero_grad()
        if naive:
            loss = mse(naive_forward(model, meshes, x), label)
            loss.backward()
        else:
            loss = pipe.step(x, label, record=step == args.steps - 1)
        opt.step()
        losses.append(loss.detach())
    elapsed = time.perf_counter() - t0

    ref_opt, ref_losses = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False), []
    for x, label in DataLoader(data, batch_size=args.batch):
        loss = mse(reference(x), label)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    last = last_mesh.process_ids[0]
    worst = 0.0
    if rank in last_mesh:
        got = [float(v.full_tensor()) for v in losses]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses))
        if rank == last:
            for step, (a, b) in enumerate(zip(got, ref_losses)):
                print(f"step {step}  loss {a:.6f}  (single process {b:.6f})")
    bad = [n for (n, p), q in zip(model.named_parameters(), reference.parameters())
           if rank in p.process_mesh and not torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6)]
    if not naive and args.timeline:
        gathered: list[list] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, pipe.events)
        events = [e for evs in gathered for e in evs]
        if rank == 0:
            theory = theoretical_bubble(pipe.schedule.name, args.pp, args.microbatches, args.chunks)
            measured = bubble_fraction(events)
            title = (f"{pipe.schedule.name}: dp={args.dp} tp={args.tp} pp={args.pp} chunks={args.chunks}, "
                     f"{args.microbatches} micro-batches — idle {measured:.1%} (ideal {theory:.1%})")
            write_timeline(args.timeline, events, title)
            print(f"timeline written to {args.timeline}: measured bubble {measured:.3f}, ideal {theory:.3f}")
    if rank == last:
        print(f"{args.steps} steps in {elapsed:.2f}s; max relative loss difference vs single process {worst:.2e}")
    if worst > 1e-5 or bad:
        raise SystemExit(f"rank {rank}: differs from the single-process run (loss {worst:.2e}, parameters {bad})")
    if rank == last:
        print("losses and parameters match the single-process run")


if __name__ == "__main__":
    main()
