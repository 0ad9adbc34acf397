"""Static mode: the GPT step captured once (``ap.to_static``) and replayed, vs eager, vs torch.

    python benchmarks/static_step.py                       # width 64, every layout
    python benchmarks/static_step.py --width 256 --layouts TP --inductor

One spawned world (4 gloo ranks, FileStore, OMP_NUM_THREADS=1) runs, per layout (DP, TP,
DPxTP+SP, ZeRO-3; the same models and optimizers as ``benchmarks/train_step.py``), in
alternating rounds of timed steps: ours eager, ours static, with ``--inductor`` ours static
compiled by inductor, and torch eager (DDP / parallelize_module / FSDP2). Printed: step times
(median over rounds of the mean step, slowest rank), eager/static speed-up, static/torch ratio,
the time of the capturing call (the slowest warm-up call), the set-up time (what the warm-up
calls took beyond as many steady steps: deciding and capturing), and whether static trains
exactly as eager (losses of every step, relative difference). ``--torch-compile`` adds torch.compile
of torch's parallelized model (step time, compile time; failures reported); ``--comm-share`` the share
of each side's step blocked in communication (issuing or waiting: not overlapped with compute).

Targets from the issue: static >= 3x faster than eager on TP at width 64; static <= 0.9x torch
eager on every layout. PASS/FAIL lines are measurements, printed as they come out.
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

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the repo root: benchmarks/reshard.py must not hide reshard/
import train_step as ts

WORLD = ts.WORLD


def measure(layout: str, cfg: Any, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    built = {"eager": ts.build_ours(layout, cfg, x, y), "static": ts.build_ours(layout, cfg, x, y, static="plain")}
    if args.inductor:
        built["inductor"] = ts.build_ours(layout, cfg, x, y, static="inductor")
    built["torch"] = ts.build_torch(layout, cfg, x, y)
    if args.torch_compile:
        built["torch.compile"] = ts.build_torch(layout, cfg, x, y, compiled=True)
    sides: dict[str, Any] = {name: b[2] for name, b in built.items()}
    out: dict[str, Any] = {name: {"losses": [], "times": []} for name in sides}
    for name, step in list(sides.items()):  # warm-up: a static side captures in its first call (ZeRO-3: again in its second)
        calls = []
        try:
            for _ in range(max(args.warmup, 4)):
                dist.barrier()
                t0 = time.perf_counter()
                out[name]["losses"].append(step())
                calls.append(ts._max_over_ranks(int((time.perf_counter() - t0) * 1e6)) / 1e6)
        except Exception as e:
            if name != "torch.compile":
                raise
            out[name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            del sides[name]
            continue
        # the capturing (compiling) call is the slowest: the first (eager's too: its decisions are made there)
        out[name]["capture_s"] = max(calls)
        # what the warm-up calls took beyond steady steps: deciding, capturing, compiling
        out[name]["setup_s"] = sum(calls) - len(calls) * min(calls)
    for _ in range(args.rounds):
        for name, step in sides.items():
            dt, losses = ts._timed(step, args.steps)
            out[name]["times"].append(dt)
            out[name]["losses"] += losses
    for name in sides:
        out[name]["step_s"] = statistics.median(out[name]["times"])
    for name, step in sides.items():
        out[name]["cpu_s"] = cpu_per_step(step, args.steps)
        model, opt, _ = built[name]
        # the step's peak: what the rank holds when a step starts + the highest rise while it runs
        # (eager keeps the last step's gradients until its zero_grad; the static step clears them)
        out[name]["peak_bytes"] = ts._max_over_ranks(ts.step_peak(step, model, opt))
    if args.comm_share:
        for name, step in sides.items():
            out[name]["comm_share"] = comm_share(step)
    if "inductor" in out:  # a failed compile replays the plain program: its warm-up is still timed
        out["inductor"]["capture_s"] = out["inductor"].get("capture_s", 0.0)
    for name in [n for n in sides if n not in ("eager", "torch")]:
        a, b = out[name]["losses"], out["eager"]["losses"]
        out[name]["rel_diff"] = max(abs(p - q) / abs(q) for p, q in zip(a, b))
    return out


# our collectives show as ``autoparallel::<collective>`` profiler ranges (runtime/comm.py): their
# waits are inside them; functional collectives (static, torch's DTensor) wait in ``wait_tensor``
COMM_EVENTS = ("wait_tensor", "c10d::", "gloo:", "_c10d_functional::", "autoparallel::all_", "autoparallel::reduce_scatter",
               "autoparallel::broadcast", "autoparallel::send_recv")


def cpu_per_step(step: Any, steps: int) -> float:
    """CPU seconds one rank's process uses per step (all its threads), mean over ranks: what a
    side costs the machine, apart from waiting. With 4 ranks on 2 cores the step time cannot
    fall below about 2x this."""
    dist.barrier()
    t0 = time.process_time()
    for _ in range(steps):
        step()
    cpu = torch.tensor([(time.process_time() - t0) / steps])
    dist.all_reduce(cpu)
    return float(cpu) / WORLD


def comm_share(step: Any, steps: int = 3) -> float:
    """The share of a step's wall time this rank spends blocked in communication (issuing or
    waiting for a collective: the part not overlapped with its own compute), mean over ranks:
    the profiler's self time of collective ops, functional waits and (ours eager) the ranges
    around our synchronous collectives. torch's DDP waits for its buckets inside the autograd
    engine, which the profiler does not show: its share is a lower bound. On 4 ranks sharing 2
    cores a wait also covers ranks that are not running."""
    dist.barrier()
    t0 = time.perf_counter()
    with ts.quiet_profiler(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    ours = [e for e in events if e.key.startswith("autoparallel::") and any(k in e.key for k in COMM_EVENTS)]
    # a range's total time covers the c10d op and its wait inside it; outside our ranges, self times
    blocked = sum(e.cpu_time_total for e in ours)
    blocked += sum(e.self_cpu_time_total for e in events if not e.key.startswith("autoparallel::")
                   and any(k in e.key for k in COMM_EVENTS))
    if ours:  # the c10d ops inside our ranges are counted by the ranges already
        blocked -= sum(e.self_cpu_time_total for e in events if e.key.startswith(("c10d::", "gloo:")))
    blocked /= 1e6
    share = torch.tensor([blocked / wall])
    dist.all_reduce(share)
    return float(share) / WORLD


def _worker(rank: int, path: str, args: argparse.Namespace, result_path: str) -> None:
    cfg, x, y = ts.start_worker(rank, path, args)
    results = {}
    for layout in args.layouts:
        results[layout] = measure(layout, cfg, x, y, args)
        if rank == 0:
            r = results[layout]
            print(f"  {layout}: " + ", ".join(f"{n} {r[n]['step_s'] * 1e3:.1f} ms" if "step_s" in r[n] else f"{n} {r[n]['failed']}"
                                          for n in r), file=sys.stderr, flush=True)
    ts.finish_worker(rank, results, result_path)


def report(results: dict[str, Any], args: argparse.Namespace) -> bool:
    print(f"GPT {args.layers} layers x width {args.width}, batch {args.batch} x seq {args.seq}, AdamW; "
          f"4 gloo ranks, {args.rounds} rounds x {args.steps} steps")
    compiled = "inductor" in next(iter(results.values()))
    head = f"{'layout':<10} | {'eager ms':>8} | {'static ms':>9} | " + (f"{'inductor ms':>11} | " if compiled else "")
    tc = "torch.compile" in next(iter(results.values()))
    head += f"{'torch ms':>8} | " + (f"{'t.compile ms':>12} | {'compile s':>9} | " if tc else "")
    print(head + f"{'eager/static':>12} | {'static/torch':>12} | {'capture s':>9} | {'set-up s':>8} | static vs eager")
    ok = True
    for layout, r in results.items():
        e, s, t = r["eager"]["step_s"], r["static"]["step_s"], r["torch"]["step_s"]
        row = f"{layout:<10} | {e * 1e3:>8.1f} | {s * 1e3:>9.1f} | "
        if compiled:
            row += f"{r['inductor']['step_s'] * 1e3:>11.1f} | "
        row += f"{t * 1e3:>8.1f} | "
        if tc:
            c = r["torch.compile"]
            row += (f"{c['step_s'] * 1e3:>12.1f} | {c['capture_s']:>9.1f} | " if "step_s" in c else f"{'failed':>12} | {'-':>9} | ")
        print(row + f"{e / s:>12.2f} | {s / t:>12.2f} | {r['static']['capture_s']:>9.2f} | {r['static']['setup_s']:>8.2f} | "
              f"{r['static']['rel_diff']:.1e}")
    for layout, r in results.items():
        s, t = r["static"]["step_s"], r["torch"]["step_s"]
        passed = s / t <= 0.9
        ok &= passed
        print(f"static {layout}: static/torch = {s / t:.2f} (target <= 0.9): {'PASS' if passed else 'FAIL'}")
    if "TP" in results and args.width == 64:
        r = results["TP"]
        speed = r["eager"]["step_s"] / r["static"]["step_s"]
        ok &= speed >= 3
        print(f"static TP speed-up over eager: {speed:.2f}x (target >= 3): {'PASS' if speed >= 3 else 'FAIL'}")
    for layout, r in results.items():
        tc = r.get("torch.compile")
        if tc is None:
            continue
        if "failed" in tc:
            print(f"torch.compile {layout}: failed ({tc['failed']})")
            continue
        best = min(r["static"]["step_s"], r.get("inductor", {}).get("step_s", float("inf")))
        passed = best <= tc["step_s"]
        fast = r["static"]["capture_s"] <= tc["capture_s"]
        ok &= passed and fast
        print(f"static {layout}: best static / torch.compile = {best / tc['step_s']:.2f} (target <= 1.0): "
              f"{'PASS' if passed else 'FAIL'}; capture {r['static']['capture_s']:.1f} s vs compile "
              f"{tc['capture_s']:.1f} s: {'PASS' if fast else 'FAIL'}")
    for layout, r in results.items():
        print(f"{layout}: CPU per rank per step: " + ", ".join(f"{n} {r[n]['cpu_s'] * 1e3:.1f} ms" for n in r if "cpu_s" in r[n])
              + f" (eager/static CPU {r['eager']['cpu_s'] / r['static']['cpu_s']:.2f}x)")
    for layout, r in results.items():
        print(f"{layout}: peak per rank: " + ", ".join(f"{n} {r[n]['peak_bytes'] / 1024:,.0f} KiB" for n in r if "peak_bytes" in r[n]))
        ratio = r["static"]["peak_bytes"] / r["eager"]["peak_bytes"]
        ok &= ratio <= 1.0
        print(f"static {layout}: peak static / eager = {ratio:.2f} (target <= 1.0): {'PASS' if ratio <= 1.0 else 'FAIL'}")
    if args.comm_share:
        for layout, r in results.items():
            print(f"{layout}: blocked in communication (share of the step): "
                  + ", ".join(f"{n} {r[n]['comm_share']:.0%}" for n in r if "comm_share" in r[n]))
    same = all(r["static"]["rel_diff"] <= 1e-5 for r in results.values())
    print(f"static trains as eager (loss rel. diff <= 1e-5 on every layout): {'PASS' if same else 'FAIL'}")
    return ok and same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ts.add_model_args(p)
    p.add_argument("--inductor", action="store_true", help="also time the static program compiled by inductor")
    p.add_argument("--comm-share", action="store_true",
                   help="also profile each side: the share of the step blocked in communication (not overlapped)")
    p.add_argument("--torch-compile", action="store_true",
                   help="also time torch.compile of torch's parallelized model (compiles for minutes on this machine)")
    args = p.parse_args()
    return 0 if report(ts.run_world(_worker, args), args) else 1


if __name__ == "__main__":
    sys.exit(main())
