"""GPT training step on 4 gloo ranks: ours vs torch.distributed (DTensor TP, DDP, FSDP2), same run.

    python benchmarks/train_step.py                 # the main job's model (examples/train_gpt.py defaults)
    python benchmarks/train_step.py --width 128 --layers 4 --rounds 5 --json /tmp/ts.json

One spawned world (gloo, FileStore, OMP_NUM_THREADS=1) runs, for each layout, the example's GPT
(same seed, same batch, unmodified AdamW) parallelised two ways, alternating rounds of timed steps:

=============  =========================================  =============================================
layout         ours                                       torch
=============  =========================================  =============================================
DP (dp=4)      shard_layer (Replicate) + shard_optimizer  DistributedDataParallel
TP (tp=4)      parallelize(gpt_plan(sp=False))            parallelize_module (Colwise/Rowwise, vocab-
                                                          parallel embedding, loss_parallel)
DPxTP+SP 2x2   parallelize(gpt_plan(sp=True)) +           parallelize_module with SequenceParallel on
               shard_optimizer over "dp"                  "tp" + replicate() (FSDP2-style DDP) on "dp"
ZeRO-3 (dp=4)  shard_optimizer(ShardingStage3): one unit   fully_shard per block and the root
               per block and the root
=============  =========================================  =============================================

Printed per layout: step time (median over rounds of the mean step, slowest rank), the ratio
ours/torch (target <= 1.1), parameter + optimizer-state bytes per rank (largest rank; local
shards, tied weights once) and the step's peak tensor memory per rank (``step_peak``: what the
rank holds when a step starts, those bytes and the last step's gradients, plus the highest
live-allocation rise during a profiled step: activations, gradients, communication buffers;
the CPU allocator has no peak counter, so it is read from torch.profiler's memory events;
buffers allocated before the profiled steps and kept, such as DDP's gradient buckets, are
not in it). Then the ZeRO-3 target: ours' parameter + optimizer bytes per rank <= (1/4 + 5%) of
the replicated (DP) figure. Both sides' losses are checked against each other (they compute
the same training). PASS/FAIL lines are measurements, printed as they come out.

Figures, with the machine and the date they were measured on: ``benchmarks/RESULTS.md``. DDP
averages per-rank means, which equals one device only when every rank counts the same number of
tokens; ours divides the global sum by the global count (one 8-byte all-reduce in the forward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

LAYOUTS = ("DP", "TP", "DPxTP+SP", "ZeRO-3")
WORLD = 4


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with torch's default (per-parameter) implementation on both sides: torch's TP leaves
    the LayerNorm parameters plain tensors beside DTensors, which its foreach and fused kernels
    refuse ("got mixed torch.Tensor and DTensor")."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``t``: ours' local shard, DTensor's local tensor, or ``t``."""
    for attr in ("_local", "_local_tensor"):
        if hasattr(t, attr):
            return getattr(t, attr)
    return t


def param_opt_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank stores for parameters (tied once) and optimizer states."""
    tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Silence the profiler's own C++ log lines (``USDT: ... profiler_start``), which this torch
    build writes to the process's stderr at every start and stop: file descriptor 2 points at
    /dev/null meanwhile (Python-level errors still raise normally)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_rise(fn: Callable[[], Any]) -> int:
    """Highest rise of live CPU tensor bytes while ``fn`` runs (``ap.memory.peak_rise``, the
    profiler's own log lines silenced)."""
    from autoparallel.memory import peak_rise as rise

    with quiet_profiler():
        return rise(fn)


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients this rank holds now (local shards; tied parameters once)."""
    return sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in model.parameters() if p.grad is not None)


def step_peak(step: Callable[[], Any], model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> int:
    """The step's peak bytes on this rank: what it holds when the step starts (parameters,
    optimizer states, and the gradients a loop that zeroes them mid-step keeps between steps)
    plus the highest rise of live bytes, the least over ``steps`` profiled steps.

    One profiled step runs first, unmeasured: the profiler reports the free of a tensor only when
    it saw the allocation, so the last step's gradients (freed by the next ``zero_grad``) must
    have been made under it, or a loop that keeps them would count them twice. The least of
    several steps: a gloo buffer the backend's worker thread frees is never seen freed,
    inflating the step it falls in."""
    peak_rise(step)
    best = []
    for _ in range(steps):
        dist.barrier()
        held = param_opt_bytes(model, opt) + grad_bytes(model)
        best.append(held + peak_rise(step))
    return min(best)


# ---- ours ------------------------------------------------------------------------------------
def build_ours(layout: str, cfg: Any, x: torch.Tensor, y: torch.Tensor,
               static: str | None = None) -> tuple[nn.Module, Any, Callable[[], float]]:
    """Ours for ``layout``; ``static`` ("plain" or "inductor"): the step runs through ``ap.to_static``."""
    import train_gpt
    from gpt_model import GPT, lm_loss

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(cfg)
    R, S = ap.Replicate(), ap.Shard
    opt: torch.optim.Optimizer
    if layout == "TP":
        mesh = ap.ProcessMesh(list(range(WORLD)), dim_names=["mp"])
        train_gpt.parallelize_gpt(model, mesh, sp=False)
        xs, ys = (ap.shard_tensor(t, mesh, [R]) for t in (x, y))
        opt = ap.shard_optimizer(_adamw(model))
    elif layout == "DPxTP+SP":
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        train_gpt.parallelize_gpt(model, mesh, sp=True)
        xs, ys = (ap.shard_tensor(t, mesh, [S(0), R]) for t in (x, y))
        opt = train_gpt.wrap_optimizer(_adamw(model), mesh, 0)
    else:
        mesh = ap.ProcessMesh(list(range(WORLD)), dim_names=["dp"])
        ap.shard_layer(model, mesh)
        xs, ys = (ap.shard_tensor(t, mesh, [S(0)]) for t in (x, y))
        stage = ap.ShardingStage3(mesh, "dp", overlap=layout == "ZeRO-3/overlap") if layout.startswith("ZeRO-3") else None
        opt = ap.shard_optimizer(_adamw(model), stage)

    def step() -> float:
        loss = lm_loss(model(xs), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return train_gpt.scalar(loss)

    if static is not None:
        dm = ap.to_static(model, loss=lm_loss, optimizer=opt,
                          strategy=ap.Strategy(compile=None if static == "plain" else static))

        def step() -> float:
            return train_gpt.scalar(dm(xs, ys))

    return model, opt, step


# ---- torch -----------------------------------------------------------------------------------
def _torch_tp_plan(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sp:
        return {"tok": RowwiseParallel(input_layouts=Replicate()),
                "blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
                "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    # The residual stream stays a DTensor Shard(1) (x + pos + block outputs), as in ours.
    seq_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel(),
            "blocks.*.attn": seq_in, "blocks.*.mlp": seq_in,
            "blocks.*.attn.qkv": ColwiseParallel(),
            "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "blocks.*.mlp.fc": ColwiseParallel(),
            "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def _torch_tp(model: Any, tp_mesh: Any, sp: bool) -> None:
    """parallelize_module with the GPT plan; re-tie the head; pos embedding Replicate under SP."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, _torch_tp_plan(sp))
    if model.cfg.tied:
        model.head.weight = model.tok.weight  # both Shard(0) on tp
    if sp:
        model.pos.weight = nn.Parameter(distribute_tensor(model.pos.weight.data, tp_mesh, [Replicate()]))


def build_torch(layout: str, cfg: Any, x: torch.Tensor, y: torch.Tensor,
                compiled: bool = False) -> tuple[nn.Module, Any, Callable[[], float]]:
    """torch's own parallelization of the GPT for ``layout``; ``compiled``: its forward under
    ``torch.compile`` (inductor; the backward is compiled through AOT autograd)."""
    from gpt_model import GPT, lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    model: nn.Module = GPT(cfg)
    rank = dist.get_rank()
    per = x.shape[0] // WORLD
    parallel_loss = False
    if layout == "DP":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    elif layout == "TP":
        _torch_tp(model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)), sp=False)
        xs, ys, parallel_loss = x, y, True
    elif layout == "DPxTP+SP":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _torch_tp(model, mesh["tp"], sp=True)
        replicate(model, mesh=mesh["dp"])
        half = x.shape[0] // 2
        lo = mesh["dp"].get_local_rank() * half
        xs, ys, parallel_loss = x[lo:lo + half], y[lo:lo + half], True
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    opt = _adamw(model)
    run = torch.compile(model) if compiled else model

    def step() -> float:
        if parallel_loss:
            with loss_parallel():
                loss = lm_loss(run(xs), ys)
                opt.zero_grad(set_to_none=True)
                loss.backward()
        else:
            loss = lm_loss(run(xs), ys)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        value = loss.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        value = value.clone()  # each dp rank holds its slice's mean (tp ranks agree): average
        dist.all_reduce(value)
        return float(value) / WORLD

    return model, opt, step


# ---- measuring -------------------------------------------------------------------------------
def _timed(step: Callable[[], float], steps: int) -> tuple[float, list[float]]:
    """Seconds per step on the slowest rank, and the losses."""
    dist.barrier()
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    dt = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), losses


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def measure(layout: str, cfg: Any, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Both sides of one layout: warm-up, alternating timed rounds, memory, losses."""
    sides = {"ours": build_ours(layout, cfg, x, y), "torch": build_torch(layout, cfg, x, y)}
    out: dict[str, Any] = {}
    for name, (_, _, step) in sides.items():
        out[name] = {"losses": [step() for _ in range(args.warmup)], "times": []}
    for _ in range(args.rounds):
        for name, (_, _, step) in sides.items():
            dt, losses = _timed(step, args.steps)
            out[name]["times"].append(dt)
            out[name]["losses"] += losses
    for name, (model, opt, step) in sides.items():
        persistent = param_opt_bytes(model, opt)
        out[name]["param_opt_bytes"] = _max_over_ranks(persistent)
        out[name]["peak_bytes"] = _max_over_ranks(step_peak(step, model, opt))
        out[name]["step_s"] = statistics.median(out[name]["times"])
    import autoparallel as ap

    with ap.CommDebugMode() as comm:  # ours' collectives in one step (rank 0's view)
        sides["ours"][2]()
    out["ours"]["collectives"] = comm.get_comm_counts()
    a, b = out["ours"]["losses"], out["torch"]["losses"][:len(out["ours"]["losses"])]
    out["loss_rel_diff"] = max(abs(p - q) / abs(q) for p, q in zip(a, b))
    return out


def start_worker(rank: int, path: str, args: argparse.Namespace) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Join the spawned world; the GPT config and one batch (x, y) from the shipped corpus."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, WORLD), rank=rank, world_size=WORLD)
    from gpt_data import CharTokenizer, load_corpus
    from gpt_model import GPTConfig

    text = load_corpus()
    tok = CharTokenizer(text, multiple_of=8)
    cfg = GPTConfig(vocab=tok.vocab_size, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    ids = tok.encode(text[: args.batch * (args.seq + 1)])
    x = ids[: args.batch * args.seq].view(args.batch, args.seq)
    y = ids[1: args.batch * args.seq + 1].view(args.batch, args.seq)
    return cfg, x, y


def _worker(rank: int, path: str, args: argparse.Namespace, result_path: str) -> None:
    cfg, x, y = start_worker(rank, path, args)
    results = {}
    for layout in args.layouts:
        results[layout] = measure(layout, cfg, x, y, args)
        if rank == 0:
            r = results[layout]
            print(f"  {layout}: ours {r['ours']['step_s'] * 1e3:.1f} ms, torch {r['torch']['step_s'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
    finish_worker(rank, results, result_path)


def finish_worker(rank: int, results: dict[str, Any], result_path: str) -> None:
    """Rank 0 writes the results; every rank leaves the world."""
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def report(results: dict[str, Any], args: argparse.Namespace) -> bool:
    """Print the table and the PASS/FAIL lines; True when every target is met."""
    print(f"GPT {args.layers} layers x width {args.width}, batch {args.batch} x seq {args.seq}, AdamW; "
          f"4 gloo ranks, {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps")
    print(f"{'layout':<10} | {'ours ms':>8} | {'torch ms':>8} | {'ratio':>5} | {'ours P+O KiB':>12} | "
          f"{'torch P+O KiB':>13} | {'ours peak KiB':>13} | {'torch peak KiB':>14} | loss diff")
    ok = True
    for layout, r in results.items():
        o, t = r["ours"], r["torch"]
        ratio = o["step_s"] / t["step_s"]
        print(f"{layout:<10} | {o['step_s'] * 1e3:>8.1f} | {t['step_s'] * 1e3:>8.1f} | {ratio:>5.2f} | "
              f"{o['param_opt_bytes'] / 1024:>12.1f} | {t['param_opt_bytes'] / 1024:>13.1f} | "
              f"{o['peak_bytes'] / 1024:>13.1f} | {t['peak_bytes'] / 1024:>14.1f} | {r['loss_rel_diff']:.1e}")
    for layout, r in results.items():
        print(f"ours' collectives per step, {layout}: {r['ours']['collectives']}")
    for layout, r in results.items():
        ratio = r["ours"]["step_s"] / r["torch"]["step_s"]
        passed = ratio <= 1.1
        ok &= passed
        print(f"step time {layout}: ours/torch = {ratio:.2f} (target <= 1.1): {'PASS' if passed else 'FAIL'}")
    if "DP" in results and "ZeRO-3" in results:
        for side in ("ours", "torch"):
            frac = results["ZeRO-3"][side]["param_opt_bytes"] / results["DP"][side]["param_opt_bytes"]
            passed = frac <= 1 / WORLD + 0.05
            if side == "ours":
                ok &= passed
            print(f"ZeRO-3 parameter+optimizer bytes per rank / replicated, {side}: {frac:.3f} "
                  f"(target <= {1 / WORLD + 0.05:.3f}): {'PASS' if passed else 'FAIL'}")
    same = all(r["loss_rel_diff"] <= 1e-5 for r in results.values())
    print(f"ours and torch train the same model (loss rel. diff <= 1e-5 on every layout): {'PASS' if same else 'FAIL'}")
    return ok and same


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, batch and timing options both step benchmarks take."""
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS + ("ZeRO-3/overlap",), default=list(LAYOUTS),
                   help="ZeRO-3/overlap: ZeRO-3 with overlap=True (prefetch one unit ahead, reductions not waited for)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--json", help="write the raw results here")


def run_world(worker: Callable[..., None], args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the 4-rank world running ``worker(rank, store, args, result_path)``; rank 0's results."""
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        store, result_path = os.path.join(tmp, "store"), os.path.join(tmp, "results.json")
        mp.start_processes(worker, args=(store, args, result_path), nprocs=WORLD, start_method="spawn")
        with open(result_path) as f:
            results: dict[str, Any] = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    args = p.parse_args()
    return 0 if report(run_world(_worker, args), args) else 1


if __name__ == "__main__":
    sys.exit(main())
