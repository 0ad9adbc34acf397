"""Pipeline benchmark: our schedules vs ``torch.distributed.pipelining`` on 4 gloo ranks.

    python benchmarks/pipeline.py                       # 4 ranks, 4 stages, 8 micro-batches
    python benchmarks/pipeline.py --hidden 256 --batch 128 --repeat 3
    python benchmarks/pipeline.py --json /tmp/pipeline.json --timeline /tmp/1f1b.svg

Spawns its own world (multiprocessing ``spawn``, gloo, a ``FileStore`` in a temp dir, one
thread per rank). The model is 8 MLP blocks (Linear H->4H, GELU, Linear 4H->H, residual); with
one chunk per rank each stage holds 2 blocks, interleaved runs 2 chunks of 1 block per rank.
Every schedule runs the same weights and micro-batches through

* ours: ``ap.pipeline.split_sequential`` + ``ap.pipeline.Pipeline`` (DistTensor parameters on
  1-rank stage meshes), schedules FThenB, 1F1B, Interleaved1F1B, ZBH1 and ZBV (zero bubble);
* torch: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
  ``ScheduleZBVZeroBubble`` (ZBH1, which torch has not for one chunk per rank, is timed against
  torch's 1F1B).

It also prints the schedules on paper (``ap.pipeline.simulate`` with equal F, B and W costs, the
compute-bound case the zero-bubble schedule is built for): idle fraction and the most micro-batches
whose activations a stage holds, at p = 4 and m = 8 and 16.

Per schedule it reports the step time (forward + backward of all micro-batches; max over
ranks, median over ``--repeat`` steps after one warm-up step), the peak activation memory per
rank (bytes autograd saved for backward, measured with ``ap.pipeline.ActivationMeter`` on both
libraries; parameters and the input batch excluded), and, for ours, the measured bubble (idle
share of the common span, from the executed timeline) next to the ideal ``(p-1)/(v*m+p-1)``.
It also checks that both libraries compute the same loss.

Targets: 1F1B peak activation memory on the first stage <= 0.65 x FThenB's; measured bubble
<= 1.2 x the ideal; step time <= 1.1 x torch's (GPipe and 1F1B); on paper, ZBH1's bubble <= 0.45 x
1F1B's, ZBV's <= 0.2 x; ZBH1's peak activation memory on its highest rank <= 1F1B's. On a machine with fewer
cores than ranks the stages do not run in parallel and the timing figures say so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (ours, torch's schedule it is timed against, chunks per rank); torch has no one-chunk zero-bubble
# schedule, so ZBH1 is timed against its 1F1B (the schedule it improves on)
SCHEDULES = [("FThenB", "ScheduleGPipe", 1), ("1F1B", "Schedule1F1B", 1), ("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
             ("ZBH1", "Schedule1F1B", 1), ("ZBV", "ScheduleZBVZeroBubble", 2)]


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square().mean()


def _paired(steps: list[Any], repeat: int) -> list[list[tuple[float, float]]]:
    """(wall, CPU) seconds of each step function, alternating them so load hits all alike.

    One warm-up call each first (shape inference, plan caches); the last timed call records.
    """
    for fn in steps:
        dist.barrier()
        fn(False)
    times: list[list[tuple[float, float]]] = [[] for _ in steps]
    for i in range(repeat):
        for k, fn in enumerate(steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(i == repeat - 1)
            times[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def make_ours(rank: int, blocks: list[Block], x: torch.Tensor, t: torch.Tensor, name: str, chunks: int, opts: dict[str, Any]) -> tuple[Any, Any]:
    import autoparallel as ap
    from autoparallel.pipeline import ActivationMeter, Pipeline, split_sequential

    world = dist.get_world_size()
    meshes = [ap.ProcessMesh([r], ["dp"]) for r in range(world)]
    model = nn.Sequential(*copy.deepcopy(blocks))
    stages = split_sequential(model, meshes, num_chunks=chunks, placement="v" if name == "ZBV" else "loop")
    pipe = Pipeline(stages, mse, num_microbatches=opts["microbatches"], schedule=name)
    xd = ap.shard_tensor(x, meshes[0], [ap.Replicate()])
    td = ap.shard_tensor(t, stages[-1].mesh, [ap.Replicate()])
    pipe.meter = ActivationMeter(exclude=[*model.parameters(), xd, td])
    out: dict[str, Any] = {}

    def step(last: bool) -> None:
        model.zero_grad()
        pipe.meter.reset_peak()  # type: ignore[union-attr]
        loss = pipe.step(xd, td, record=last)
        if rank in stages[-1].mesh:
            out["loss"] = float(loss.to_local())

    def finish() -> dict[str, Any]:
        out["peak"] = pipe.meter.peak  # type: ignore[union-attr]
        out["events"] = [(e.rank, e.stage, e.kind, e.microbatch, e.chunk, e.start, e.end) for e in pipe.events]
        return out

    return step, finish


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``hook`` (marks when a stage's backward starts)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Any, copy: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.hook = hook
        return x.clone() if copy else x.view_as(x)  # (torch's zero-bubble stages detach outputs in place: no view)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.hook()
        return grad, None, None


class Timed(nn.Module):
    """Wraps a torch stage module and records forward and backward intervals on this rank.

    Forward: the module call. Backward: from the output's gradient arriving (``_Mark``) to the
    last parameter gradient accumulated (``register_post_accumulate_grad_hook``).
    """

    def __init__(self, inner: nn.Module, rank: int, stage: int, log: list[tuple], copy: bool = False) -> None:
        super().__init__()
        self.inner, self.rank, self.stage, self.log, self.copy = inner, rank, stage, log, copy
        self.open: list[float] = []
        for prm in inner.parameters():
            prm.register_post_accumulate_grad_hook(self._grad_done)

    def _grad_done(self, _: torch.Tensor) -> None:
        if self.open:
            self.log[self.open[0]] = self.log[self.open[0]][:-1] + (time.perf_counter(),)

    def _b_start(self) -> None:
        now = time.perf_counter()
        self.log.append((self.rank, self.rank, "B", 0, self.stage, now, now))
        self.open[:] = [len(self.log) - 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.inner(x)
        self.log.append((self.rank, self.rank, "F", 0, self.stage, t0, time.perf_counter()))
        return _Mark.apply(y, self._b_start, self.copy)


def make_torch(rank: int, blocks: list[Block], x: torch.Tensor, t: torch.Tensor, cls_name: str, chunks: int, opts: dict[str, Any]) -> tuple[Any, Any]:
    from torch.distributed import pipelining

    from autoparallel.pipeline import ActivationMeter

    world = dist.get_world_size()
    n = world * chunks
    log: list[tuple] = []
    v_shape = cls_name == "ScheduleZBVZeroBubble"  # chunk c on rank c, then back up: 2 * world - 1 - c
    pieces = [Timed(nn.Sequential(*copy.deepcopy(blocks[c * len(blocks) // n:(c + 1) * len(blocks) // n])), rank, c, log,
                    copy=v_shape) for c in range(n)]
    mine = [c for c in range(n) if (c if c < world or not v_shape else n - 1 - c) % world == rank]
    stages = [pipelining.PipelineStage(pieces[c], c, n, torch.device("cpu")) for c in mine]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if chunks > 1 else stages[0], n_microbatches=opts["microbatches"], loss_fn=mse)
    meter = ActivationMeter(exclude=[p for c in mine for p in pieces[c].parameters()] + [x, t])
    out: dict[str, Any] = {}

    def step(last: bool) -> None:
        if last:
            log.clear()
        for c in mine:
            pieces[c].zero_grad()
        meter.reset_peak()
        with meter.track():
            losses: list[torch.Tensor] = []
            if 0 in mine and n - 1 in mine:  # a V: the first and the last chunk on rank 0
                sched.step(x, target=t, losses=losses)
            elif 0 in mine:
                sched.step(x)
            elif n - 1 in mine:
                sched.step(target=t, losses=losses)
            else:
                sched.step()
            if losses:
                out["loss"] = float(torch.stack(losses).detach().mean())

    def finish() -> dict[str, Any]:
        out["peak"] = meter.peak
        out["events"] = list(log)
        return out

    return step, finish


def _worker(rank: int, world: int, path: str, opts: dict[str, Any], result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    blocks = [Block(opts["hidden"]) for _ in range(8)]
    x, t = torch.randn(opts["batch"], opts["hidden"]), torch.randn(opts["batch"], opts["hidden"])
    rows = []
    for name, torch_cls, chunks in SCHEDULES:
        if opts["only"] and name not in opts["only"]:
            continue
        ours_step, ours_done = make_ours(rank, blocks, x, t, name, chunks, opts)
        torch_step, torch_done = make_torch(rank, blocks, x, t, torch_cls, chunks, opts)
        times = _paired([ours_step, torch_step], opts["repeat"])
        ours, theirs = ours_done(), torch_done()
        ours["times"], theirs["times"] = [w for w, _ in times[0]], [w for w, _ in times[1]]
        ours["cpu"], theirs["cpu"] = [c for _, c in times[0]], [c for _, c in times[1]]
        rows.append({"schedule": name, "torch": torch_cls, "chunks": chunks, "ours": ours, "theirs": theirs})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def _median_max(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's time for that step (ms)."""
    return 1000 * statistics.median(max(ts) for ts in zip(*per_rank))


def report(gathered: list[list[dict[str, Any]]], opts: dict[str, Any]) -> tuple[list[str], bool, dict[str, Any]]:
    from autoparallel.pipeline import Event, bubble_fraction, theoretical_bubble

    p, m = len(gathered), opts["microbatches"]
    lines = [f"{p} gloo ranks, {p} stage meshes, {m} micro-batches, batch {opts['batch']} x hidden {opts['hidden']}, "
             f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; step = forward+backward of all micro-batches "
             f"(median of {opts['repeat']} alternating with torch's, max over ranks); ratio = median over those pairs of "
             f"ours / torch; cpu ratio = CPU seconds ours / torch, all ranks",
             f"{'schedule':<16}{'ours ms':>9}{'torch ms':>10}{'ratio':>7}{'cpu ratio':>10}  {'peak activation MiB per rank (ours | torch)':<46}"
             f"{'bubble':>8}{'torch':>7}{'ideal':>7}{'ratio':>7}"]
    summary: dict[str, Any] = {}
    for i, row in enumerate(gathered[0]):
        name, chunks = row["schedule"], row["chunks"]
        ours_ms = _median_max([g[i]["ours"]["times"] for g in gathered])
        torch_ms = _median_max([g[i]["theirs"]["times"] for g in gathered])
        ours_steps = [max(ts) for ts in zip(*[g[i]["ours"]["times"] for g in gathered])]
        torch_steps = [max(ts) for ts in zip(*[g[i]["theirs"]["times"] for g in gathered])]
        ratio = statistics.median(a / b for a, b in zip(ours_steps, torch_steps))  # pairs ran back to back
        cpu = sum(sum(g[i]["ours"]["cpu"]) for g in gathered) / sum(sum(g[i]["theirs"]["cpu"]) for g in gathered)
        peaks = [g[i]["ours"]["peak"] / 2**20 for g in gathered]
        tpeaks = [g[i]["theirs"]["peak"] / 2**20 for g in gathered]
        events = [Event(*e) for g in gathered for e in g[i]["ours"]["events"]]
        bubble, ideal = bubble_fraction(events), theoretical_bubble(name, p, m, chunks)
        torch_bubble = bubble_fraction([Event(*e) for g in gathered for e in g[i]["theirs"]["events"]])
        # (the rank of the last chunk: the last rank, or the first for a V)
        loss_ours = next(g[i]["ours"]["loss"] for g in gathered if "loss" in g[i]["ours"])
        loss_torch = next(g[i]["theirs"]["loss"] for g in gathered if "loss" in g[i]["theirs"])
        tevents = [Event(*e) for g in gathered for e in g[i]["theirs"]["events"]]
        summary[name] = {"ours_ms": ours_ms, "torch_ms": torch_ms, "ratio": ratio, "cpu_ratio": cpu, "peaks": peaks, "torch_peaks": tpeaks, "tevents": tevents,
                         "bubble": bubble, "ideal": ideal, "loss": (loss_ours, loss_torch), "events": events}
        mem = " ".join(f"{v:.2f}" for v in peaks) + " | " + " ".join(f"{v:.2f}" for v in tpeaks)
        lines.append(f"{name:<16}{ours_ms:>9.1f}{torch_ms:>10.1f}{ratio:>7.2f}{cpu:>10.2f}  {mem:<46}"
                     f"{bubble:>8.3f}{torch_bubble:>7.3f}{ideal:>7.3f}{bubble / ideal:>7.2f}")
    lines.append("ours, where each rank's last step went (ms): compute/recv wait/send/other (torch's compute)")
    for name, s in summary.items():
        parts = []
        for r in range(p):
            evs = [e for e in s["events"] if e.rank == r]
            span = max(e.end for e in s["events"]) - min(e.start for e in s["events"])
            f = {k: 1000 * sum(e.end - e.start for e in evs if e.kind in ks)
                 for k, ks in (("c", ("F", "B", "W")), ("r", ("RECV_F", "RECV_B")), ("s", ("SEND_F", "SEND_B")))}
            tc = 1000 * sum(e.end - e.start for e in s["tevents"] if e.rank == r)
            parts.append(f"r{r} {f['c']:.0f}/{f['r']:.0f}/{f['s']:.0f}/{1000 * span - sum(f.values()):.0f} ({tc:.0f})")
        lines.append(f"  {name:<16}" + "  ".join(parts))
    ok = True
    checks = []
    if "1F1B" in summary and "FThenB" in summary:
        mem_ratio = summary["1F1B"]["peaks"][0] / summary["FThenB"]["peaks"][0]
        checks.append((f"1F1B / FThenB peak activation memory on stage 0: {mem_ratio:.3f} (target <= 0.65)", mem_ratio <= 0.65))
    for name, s in summary.items():
        r = s["bubble"] / s["ideal"]
        zb = name in ("ZBH1", "ZBV")  # the ideal assumes equal F, B and W costs, which these stages do not have
        checks.append((f"{name} bubble measured / ideal: {s['bubble']:.3f} / {s['ideal']:.3f} = {r:.2f}"
                       + (" (ideal for equal F/B/W costs)" if zb else " (target <= 1.2)"), None if zb else r <= 1.2))
    if "ZBH1" in summary and "1F1B" in summary:
        held = max(summary["ZBH1"]["peaks"]) / max(summary["1F1B"]["peaks"])  # (B drops what only it reads)
        checks.append((f"ZBH1 / 1F1B peak activation memory, the highest rank: {held:.3f} (target <= 1)", held <= 1.0 + 1e-9))
    if "ZBV" in summary and "1F1B" in summary:  # (the first stage's input is the excluded batch: 1F1B's peak there
        held = max(summary["ZBV"]["peaks"]) / max(summary["1F1B"]["peaks"])  # lacks it, a V's middle ranks do not)
        checks.append((f"ZBV / 1F1B peak activation memory, the highest rank: {held:.2f}", None))
    for name in summary:
        s = summary[name]
        r = s["ratio"]
        tgt = name in ("FThenB", "1F1B")
        checks.append((f"{name} step time ours / torch: {r:.2f}" + (" (target <= 1.1)" if tgt else " (no target)"), r <= 1.1 if tgt else None))
    for name, s in summary.items():
        a, b = s["loss"]
        checks.append((f"{name} loss ours {a:.6f} vs torch {b:.6f}", abs(a - b) <= 1e-5 * abs(b)))
    lines.append("on paper (equal F, B, W costs; free communication): idle fraction, most micro-batches held per stage")
    checks += on_paper(lines)
    for text, passed in checks:
        lines.append(f"  {text}: {'PASS' if passed else 'info' if passed is None else 'FAIL'}")
        ok = ok and passed is not False
    return lines, ok, summary


def on_paper(lines: list[str], p: int = 4) -> list[tuple[str, bool | None]]:
    """The schedules simulated at ``p`` stages with equal costs; ZBH1's bubble target."""
    from autoparallel.pipeline import build_schedule, simulate

    checks: list[tuple[str, bool | None]] = []
    for m in (8, 16):
        # a chunk of a two-chunk schedule is half a stage: its passes cost half
        sims = {name: simulate(build_schedule(name, p, m, v), 2 / v, 2 / v, 0, 2 / v)
                for name, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBH1", 1), ("ZBV", 2))}
        lines.append(f"  p={p} m={m}: " + "; ".join(f"{n} {r.bubble:.3f} held {list(r.peak_held)}" for n, r in sims.items()))
        for name, target in (("ZBH1", 0.45), ("ZBV", 0.2)):
            r = sims[name].bubble / sims["1F1B"].bubble
            checks.append((f"on paper p={p} m={m}: {name} / 1F1B bubble {r:.3f} (target <= {target})", r <= target))
        # activations held, in whole stages (a ZBV chunk is half a stage)
        held = max(sims["ZBV"].peak_held) / 2 / max(sims["1F1B"].peak_held)
        checks.append((f"on paper p={p} m={m}: ZBV / 1F1B most activations held on a rank {held:.2f} (target <= 1)", held <= 1))
    return checks


def write_paper_timelines(folder: str, p: int = 4, m: int = 8) -> None:
    """The ideal timelines of 1F1B, ZBH1 and ZBV side by side in cost (a stage pass = 2 units)."""
    from autoparallel.pipeline import build_schedule, events_from_simulation, simulate, timeline_svg

    os.makedirs(folder, exist_ok=True)
    for name, v in (("1F1B", 1), ("ZBH1", 1), ("ZBV", 2)):
        sim = simulate(build_schedule(name, p, m, v), 2 / v, 2 / v, 0, 2 / v)
        title = f"{name} on paper: {p} stages, {m} micro-batches, F = B = W (idle {sim.bubble:.1%})"
        path = os.path.join(folder, f"schedule_{name.lower()}.svg")
        with open(path, "w") as f:
            f.write(timeline_svg(events_from_simulation(sim), title, unit="step"))
        print("wrote", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated schedules to run (default: all three)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--timeline", default=None, help="write our executed 1F1B step as an SVG timeline")
    parser.add_argument("--paper-timelines", default=None, metavar="DIR",
                        help="write the simulated 1F1B, ZBH1 and ZBV timelines (p=4, m=8, equal F/B/W costs) as SVGs into DIR")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    opts = {"microbatches": args.microbatches, "batch": args.batch, "hidden": args.hidden, "repeat": args.repeat,
            "only": [n for n in args.only.split(",") if n]}
    tmp = tempfile.mkdtemp()
    result_path = os.path.join(tmp, "result.json")
    mp.spawn(_worker, args=(args.nprocs, os.path.join(tmp, "store"), opts, result_path), nprocs=args.nprocs)
    with open(result_path) as f:
        gathered = json.load(f)
    lines, ok, summary = report(gathered, opts)
    print("\n".join(lines))
    if args.timeline:
        from autoparallel.pipeline import write_timeline

        s = summary.get("1F1B") or next(iter(summary.values()))
        write_timeline(args.timeline, s["events"], f"ours, 1F1B, {args.nprocs} stages, {args.microbatches} micro-batches: "
                       f"idle {s['bubble']:.1%} (ideal {s['ideal']:.1%})")
    if args.paper_timelines:
        write_paper_timelines(args.paper_timelines)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk not in ("events", "tevents")} for k, v in summary.items()}, f, indent=1)
    print("overall:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
