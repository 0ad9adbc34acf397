"""What a new sequence length costs: first step at a new shape vs a warm step, and RSS per shape.

    python benchmarks/varying_shapes.py                       # DP, TP, TP+SP on 2 gloo ranks
    python benchmarks/varying_shapes.py --shapes 60 --layouts TP+SP --profile
    python benchmarks/varying_shapes.py --model llama --step 1 --layouts DP,TP   # transformers' Llama
    python benchmarks/varying_shapes.py --model llama --step 1 --layouts DP,TP --no-kv-cache
    python benchmarks/varying_shapes.py --local-regions 0         # op by op (no local regions)

Each rank trains the example GPT (width 64, 2 layers, vocab 96, batch 4; AdamW through
``shard_optimizer``) laid out one way, with the sequence length changing between steps: after
a warm-up at six shorter lengths (``14, 12, .., 4``: the one-time setup, timed as ``setup s``:
the captures of the regions, at fixed and at open sizes), every one of ``--shapes`` lengths (``16, 18, ..`` in a shuffled
order: even, as sequence parallelism needs equal pieces) runs one *first* step
and then ``--warm`` more steps at that length. Printed per layout, on rank 0 (medians over the
lengths; every rank's figure is its own, the slowest rank's shown):

* warm step (ms), first step at a new length (ms), and their ratio (target <= 1.2), the median
  of the per-length ratios and (``means``) the ratio of the means: pauses that hit some lengths
  only, as Python's full garbage collections, show in the second; ``cpu f/w``: the same median
  ratio of the process's CPU time (what a new length costs the rank itself, without the waits
  for its peers that the wall time shares with warm steps); ``late f/w``: the median ratio over
  the second half of the lengths only (the first half also pays for what recurs once per size
  ordering: a length crossing a width keys its ops' templates anew); ``revisit``: afterwards,
  ``--revisits`` steps at lengths drawn from those measured, their mean over the warm step (what
  training with varying lengths pays once every length has come: what the bounded caches let
  go is decided again); ``GC ms/shape``: the time
  spent in full (generation 2) collections over the measured steps, per new length;
* RSS growth per new length per rank (KB): ``/proc/self/statm`` after the last length minus
  after the warm-up, over the number of lengths (target: a few KB; the allocator makes it
  noisy, +-200 KB between runs even for plain torch), and the Python heap's growth in
  allocated blocks (``sys.getallocatedblocks``, after ``gc.collect()``): what Python keeps
  per length (decisions, caches), a steadier figure; ``late objs``: the same over the second
  half of the lengths only (the caches that keep a bounded number of shapes fill up in the
  first: this is what a new length adds once they are full);
* the same model on plain tensors, one process per rank at the same time (``plain``): how much
  of the first-step cost is torch's own (kernels and autograd at a new shape).

``--profile`` adds, for rank 0, the functions with the most cumulative time over the first
steps (cProfile) and the allocation sites that grew most (tracemalloc), to see where a new
shape's time and memory go.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

LAYOUTS = ("DP", "TP", "TP+SP")
BATCH, WIDTH, VOCAB, LAYERS, FIRST_LEN = 4, 64, 96, 2, 16
WARMUP = tuple(range(FIRST_LEN - 2, 2, -2))  # 14, 12, .., 4


def _rss_kb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def _build_llama(layout: str, world: int, max_len: int,
                 use_cache: bool = True) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """``--model llama``: transformers' Llama (hidden 64, 2 layers, 8 heads, 4 key/value heads,
    MLP 128, vocabulary 96), unmodified, laid out by ``ap.plans.llama`` (TP, TP+SP) or
    ``shard_layer`` (DP); (ours step at length t, plain step at length t). ``use_cache``: the
    config's (transformers' default True: every forward fills a ``DynamicCache``, even in
    training; fine-tuning scripts often set it False)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoparallel as ap

    cfg = LlamaConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=2 * WIDTH, vocab_size=VOCAB, max_position_embeddings=max_len,
                      attn_implementation="sdpa", use_cache=use_cache)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    plain = LlamaForCausalLM(cfg)
    plain.load_state_dict(model.state_dict())
    if layout == "DP":
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        ap.shard_layer(model, mesh)
        place = [ap.Shard(0)]
    else:
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["tp"])
        ap.parallelize(model, mesh, ap.plans.llama(model, sp=layout == "TP+SP"))
        place = [ap.Replicate()]
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(1)

    def ours(t: int) -> None:
        x = ap.shard_tensor(torch.randint(0, VOCAB, (BATCH, t), generator=gen), mesh, place)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        float(loss.detach().full_tensor())

    def theirs(t: int) -> None:
        x = torch.randint(0, VOCAB, (BATCH, t), generator=gen)
        loss = plain(input_ids=x, labels=x).loss
        popt.zero_grad(set_to_none=True)
        loss.backward()
        popt.step()
        float(loss.detach())

    return ours, theirs


def _build(layout: str, world: int, max_len: int) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """(ours step at length t, plain step at length t)."""
    import train_gpt
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap

    cfg = GPTConfig(vocab=VOCAB, seq=max_len, layers=LAYERS, width=WIDTH, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    plain = GPT(cfg)
    plain.load_state_dict(model.state_dict())
    R, S = ap.Replicate(), ap.Shard
    if layout == "DP":
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        ap.shard_layer(model, mesh)
        place = [S(0)]
    else:
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["mp"])
        train_gpt.parallelize_gpt(model, mesh, sp=layout == "TP+SP")
        place = [R]
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(1)

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, VOCAB, (BATCH, t + 1), generator=gen)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def ours(t: int) -> None:
        x, y = batch(t)
        xs, ys = ap.shard_tensor(x, mesh, place), ap.shard_tensor(y, mesh, place)
        loss = lm_loss(model(xs), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        train_gpt.scalar(loss)

    def theirs(t: int) -> None:
        x, y = batch(t)
        loss = lm_loss(plain(x), y)
        popt.zero_grad(set_to_none=True)
        loss.backward()
        popt.step()
        float(loss.detach())

    return ours, theirs


def _timed(fn: Callable[[int], None], t: int, cpu: list[float]) -> float:
    """Wall ms of one step started together on every rank; its process CPU ms appended to ``cpu``."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn(t)
    cpu.append((time.process_time() - c0) * 1e3)
    return (time.perf_counter() - t0) * 1e3


def _run(step: Callable[[int], None], lengths: list[int], warm: int, synced: bool,
         warmup: tuple[int, ...] = WARMUP, revisits: int = 0) -> dict[str, float]:
    timer = _timed if synced else _plain_timed
    # warm-up lengths (not measured, timed as one-time setup): two proofs make a region's model,
    # a third length builds its symbolic certificate (once per model); more lengths where
    # sizes coincide at some (a proof there makes no model)
    began = time.perf_counter()
    for t in warmup:
        for _ in range(2):
            step(t)
    setup_s = time.perf_counter() - began
    gc.collect()
    rss0, blocks0 = _rss_kb(), sys.getallocatedblocks()
    firsts, warms = [], []
    collecting = [0.0, 0.0]  # (when the current collection started, ms spent in full collections)

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        elif info["generation"] == 2:
            collecting[1] += (time.perf_counter() - collecting[0]) * 1e3

    cpu_firsts: list[float] = []
    cpu_warms: list[float] = []
    half = len(lengths) // 2
    blocks_half = 0
    gc.callbacks.append(watch)
    try:
        for k, t in enumerate(lengths):
            if k == half:  # (not a pause of the steps: out of the GC figure)
                gc.callbacks.remove(watch)
                gc.collect()
                blocks_half = sys.getallocatedblocks()
                gc.callbacks.append(watch)
            firsts.append(timer(step, t, cpu_firsts))
            cpu: list[float] = []
            warms.append(statistics.median(timer(step, t, cpu) for _ in range(warm)))
            cpu_warms.append(statistics.median(cpu))
    finally:
        gc.callbacks.remove(watch)
    gc.collect()
    rss1, blocks1 = _rss_kb(), sys.getallocatedblocks()
    first, warm_ms = statistics.median(firsts), statistics.median(warms)
    ratios = [f / w for f, w in zip(firsts, warms)]
    # steps at lengths drawn from those seen (the same draw on every rank), as training with
    # varying lengths runs once every length has come: a length back after many others finds
    # some of what it kept evicted (the bounded caches), and pays for it again
    draw = random.Random(2)
    again = [timer(step, draw.choice(lengths), []) for _ in range(revisits)]
    return {"warm_ms": warm_ms, "first_ms": first, "ratio": statistics.median(ratios),
            "late_ratio": statistics.median(ratios[half:]),
            "revisit_ratio": statistics.mean(again) / warm_ms if again else float("nan"),
            "mean_ratio": statistics.mean(firsts) / statistics.mean(warms), "gc_ms_per_shape": collecting[1] / len(lengths),
            "cpu_ratio": statistics.median(f / w for f, w in zip(cpu_firsts, cpu_warms)),
            "rss_kb_per_shape": (rss1 - rss0) / len(lengths), "blocks_per_shape": (blocks1 - blocks0) / len(lengths),
            "blocks_per_shape_late": (blocks1 - blocks_half) / (len(lengths) - half),
            "setup_s": setup_s}


def _plain_timed(fn: Callable[[int], None], t: int, cpu: list[float]) -> float:
    t0, c0 = time.perf_counter(), time.process_time()
    fn(t)
    cpu.append((time.process_time() - c0) * 1e3)
    return (time.perf_counter() - t0) * 1e3


def _profile(step: Callable[[int], None], lengths: list[int]) -> str:
    tracemalloc.start(8)
    snap0 = tracemalloc.take_snapshot()
    prof = cProfile.Profile()
    prof.enable()
    for t in lengths:
        step(t)
    prof.disable()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    stats.print_stats(40)
    if os.environ.get("VARYING_CALLEES"):  # e.g. "_decide|_finish|dispatch.py.*dispatch"
        stats.print_callees(os.environ["VARYING_CALLEES"])
    out.write(f"\ntracemalloc: growth over {len(lengths)} new lengths, top sites\n")
    for s in snap1.compare_to(snap0, "lineno")[:25]:
        out.write(f"  {s.size_diff / 1024:9.1f} KB  {s.count_diff:7d} blocks  {s.traceback}\n")
    return out.getvalue()


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    by = opts["step"]
    lengths = list(range(FIRST_LEN, FIRST_LEN + by * opts["shapes"], by))
    random.Random(0).shuffle(lengths)
    warmup = tuple(range(FIRST_LEN - by, 2, -by))
    max_len = FIRST_LEN + by * (opts["shapes"] + opts["profile_shapes"])
    results: dict[str, Any] = {}
    for layout in opts["layouts"]:
        if opts["model"] == "llama":
            ours, theirs = _build_llama(layout, world, max_len, use_cache=not opts["no_kv_cache"])
        else:
            ours, theirs = _build(layout, world, max_len)
        mine = {"ours": _run(ours, lengths, opts["warm"], True, warmup, opts["revisits"]),
                "plain": _run(theirs, lengths, opts["warm"], False, warmup, opts["revisits"])}
        if opts["profile"]:
            extra = list(range(FIRST_LEN + by * opts["shapes"], max_len, by))
            text = _profile(ours, extra)
            if rank == 0:
                mine["profile"] = text
        got: list[Any] = [None] * world
        dist.all_gather_object(got, mine)
        results[layout] = got
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--shapes", type=int, default=40, help="new sequence lengths measured per layout")
    parser.add_argument("--warm", type=int, default=2, help="warm steps timed after each first step")
    parser.add_argument("--revisits", type=int, default=200,
                        help="steps afterwards at lengths drawn from those measured (0: none)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                        help="gpt: the example GPT; llama: transformers' Llama, unmodified (needs transformers)")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="--model llama with use_cache=False (no DynamicCache argument: the attention "
                             "can be a local region)")
    parser.add_argument("--step", type=int, default=2, choices=(1, 2),
                        help="2: even lengths (sequence parallelism needs equal pieces); 1: every length "
                             "(DP and TP), odd ones included")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--local-regions", default=None, choices=("1", "0"),
                        help="AUTOPARALLEL_LOCAL_REGIONS for the ranks (0: every op on DistTensors)")
    args = parser.parse_args()
    from benchmarks._spawn import run_spawned

    if args.local_regions is not None:  # (the spawned ranks inherit it)
        os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = args.local_regions

    if args.step == 1 and "TP+SP" in args.layouts.split(","):
        parser.error("--step 1 gives odd lengths, which sequence parallelism cannot split evenly: "
                     "use --layouts DP,TP")
    opts = {"model": args.model, "no_kv_cache": args.no_kv_cache, "step": args.step, "shapes": args.shapes, "warm": args.warm, "revisits": args.revisits, "layouts": args.layouts.split(","), "profile": args.profile,
            "profile_shapes": 12 if args.profile else 0}
    res = run_spawned(_worker, args.nprocs, opts, timeout=3000, prefix="varying")
    name = "transformers' Llama" if args.model == "llama" else "GPT"
    print(f"{name} (width {WIDTH}, {LAYERS} layers, batch {BATCH}) on {args.nprocs} gloo ranks, "
          f"{args.shapes} new sequence lengths each ({'every length' if args.step == 1 else 'even lengths'}), "
          "medians; slowest rank")
    print(f"{'layout':<8}{'side':<7}{'warm ms':>9}{'first ms':>10}{'first/warm':>12}{'means':>7}{'cpu f/w':>9}"
          f"{'late f/w':>10}{'revisit':>9}{'GC ms/shape':>13}{'RSS KB/shape':>14}{'objs/shape':>12}{'late objs':>11}{'setup s':>9}")
    for layout, per_rank in res.items():
        for side in ("ours", "plain"):
            rows = [r[side] for r in per_rank]
            worst = max(rows, key=lambda r: r["ratio"])
            rss = max(r["rss_kb_per_shape"] for r in rows)
            objs = max(r["blocks_per_shape"] for r in rows)
            means = max(r["mean_ratio"] for r in rows)
            collected = max(r["gc_ms_per_shape"] for r in rows)
            setup = max(r["setup_s"] for r in rows)
            cpu = max(r["cpu_ratio"] for r in rows)
            late = max(r["blocks_per_shape_late"] for r in rows)
            late_ratio = max(r.get("late_ratio", 0.0) for r in rows)
            revisit = max(r.get("revisit_ratio", 0.0) for r in rows)
            print(f"{layout:<8}{side:<7}{worst['warm_ms']:>9.1f}{worst['first_ms']:>10.1f}{worst['ratio']:>12.2f}"
                  f"{means:>7.2f}{cpu:>9.2f}{late_ratio:>10.2f}{revisit:>9.2f}{collected:>13.2f}{rss:>14.1f}{objs:>12.0f}{late:>11.0f}{setup:>9.2f}")
        if "profile" in per_rank[0]:
            print(per_rank[0]["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
