"""Static mode on batches of changing sequence length: open sizes (one capture) against fixed sizes
(a capture per length).

    torchrun --standalone --nproc-per-node 4 benchmarks/static_sizes.py
    torchrun --standalone --nproc-per-node 4 benchmarks/static_sizes.py --lengths 12 --layouts TP

Each rank trains the example GPT (width 64, 2 layers, 4 heads, vocab 96, batch 8; AdamW through
``shard_optimizer``) with ``ap.to_static``, laid out one way (DP over 4 ranks, TP over 4, TP + SP
over 4, DP 2 x TP 2), over ``--lengths`` sequence lengths (16, 20, 24, ..: each one first call,
then one warm call), twice from the same start: with open sizes (the default) and with
``AUTOPARALLEL_OPEN_SIZES=0`` (every new length captured at its sizes). Printed per layout, from
rank 0 (times are the slowest rank's):

* ``captures``: steps captured over the pass (with open sizes: the first length at its sizes, the
  second with them open, and one more wherever a length breaks a guard of the programs so far, as
  a strategy whose price turns with the size; target: at most half the lengths captured);
* ``capture s``: the first call (it captures, then runs);
* ``first ms``: the median first call at a length after the first one;
* ``warm ms``: the median warm call;
* ``pass s``: the whole pass over the lengths, first and warm calls;
* ``loss diff``: the largest relative difference between the two runs' losses (the same
  programs but for how they get their sizes: 0 expected).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# the repository root first, this folder not at all (benchmarks/reshard.py must not hide reshard/)
sys.path[:] = [ROOT, os.path.join(ROOT, "examples")] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

import autoparallel as ap  # noqa: E402

LAYOUTS = ("DP", "TP", "TP+SP", "DPxTP")


def build(layout: str) -> tuple[Any, ap.ProcessMesh, list[Any]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=96, seq=128, layers=2, width=64, heads=4))
    world = dist.get_world_size()
    if layout == "DP":
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        ap.shard_layer(model, mesh)
        placements = [ap.Shard(0)]
    else:
        shape = [list(range(world))] if layout != "DPxTP" else torch.arange(world).reshape(2, world // 2).tolist()
        mesh = ap.ProcessMesh(shape, dim_names=["dp", "mp"])
        plan: dict[str, Any] = {"tok": ap.VocabParallelEmbedding(), "blocks.*.attn.qkv": ap.ColWiseParallel(),
                                "blocks.*.attn.proj": ap.RowWiseParallel(), "blocks.*.mlp.fc": ap.ColWiseParallel(),
                                "blocks.*.mlp.proj": ap.RowWiseParallel(), "head": ap.ColWiseParallel()}
        if layout == "TP+SP":
            plan.update({"blocks.*.ln1": ap.SequenceParallel(), "blocks.*.ln2": ap.SequenceParallel(),
                         "ln_f": ap.SequenceParallel()})
        ap.parallelize(model, mesh, plan)
        placements = [ap.Shard(0), ap.Replicate()]
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return ap.to_static(model, loss=lm_loss, optimizer=opt), mesh, placements


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(layout: str, lengths: list[int], open_sizes: bool) -> dict[str, Any]:
    os.environ["AUTOPARALLEL_OPEN_SIZES"] = "1" if open_sizes else "0"
    dm, mesh, placements = build(layout)
    g = torch.Generator().manual_seed(1)
    firsts, warms, losses = [], [], []
    start = time.perf_counter()
    for t in lengths:
        x = torch.randint(0, 96, (8, t), generator=g)
        y = torch.randint(0, 96, (8, t), generator=g)
        xd, yd = ap.shard_tensor(x, mesh, placements), ap.shard_tensor(y, mesh, placements)
        for warm in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            loss = dm(xd, yd)
            seconds = slowest(time.perf_counter() - t0)
            (warms if warm else firsts).append(seconds)
            losses.append(float(loss.full_tensor()))
    total = slowest(time.perf_counter() - start)
    return {"captures": dm.captures, "capture": firsts[0], "first": statistics.median(firsts[1:]) * 1e3,
            "warm": statistics.median(warms) * 1e3, "pass": total, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=8, help="sequence lengths in the pass (16, 20, ..)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    lengths = [16 + 4 * k for k in range(args.lengths)]
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{dist.get_world_size()} gloo ranks, GPT width 64, 2 layers, batch 8, lengths {lengths}, "
              f"torch {torch.__version__}")
        print(f"{'layout':8} {'sizes':6} {'captures':>8} {'capture s':>9} {'first ms':>9} {'warm ms':>8} {'pass s':>7} {'loss diff':>9}")
    for layout in args.layouts.split(","):
        fixed = run(layout, lengths, open_sizes=False)
        opened = run(layout, lengths, open_sizes=True)
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(opened["losses"], fixed["losses"]))
        if rank0:
            for name, r in (("open", opened), ("fixed", fixed)):
                print(f"{layout:8} {name:6} {r['captures']:8d} {r['capture']:9.2f} {r['first']:9.1f} {r['warm']:8.1f} "
                      f"{r['pass']:7.2f} {diff if name == 'open' else 0.0:9.1e}")
            print(f"{layout:8} open sizes: {opened['captures']} capture(s) for {len(lengths)} lengths "
                  f"({'PASS' if opened['captures'] <= len(lengths) // 2 else 'FAIL'}: at most {len(lengths) // 2}); pass {fixed['pass'] / opened['pass']:.1f}x "
                  f"faster than with a capture per length; first call at a new length {opened['first'] / opened['warm']:.2f}x "
                  "a warm one", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
