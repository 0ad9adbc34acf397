"""ZeRO-3's peak memory per rank, ours vs torch's FSDP2, broken down by what is alive at the peak.

    python benchmarks/zero3_peak.py                    # widths 256 and 1024
    python benchmarks/zero3_peak.py --width 64 --json /tmp/z3.json

One spawned world (4 gloo ranks, as ``benchmarks/train_step.py``) builds, per width, the example
GPT under ``shard_optimizer(ShardingStage3)`` (ours) and under ``fully_shard`` per block and the
root (FSDP2), runs a few warm-up steps of ``train_step``'s step (forward, ``zero_grad``, backward,
AdamW step), one profiled step it does not measure (so that what the next steps free was made
under the profiler: the profiler reports no free of a tensor it did not see made), then profiles
three steps with torch.profiler's memory events and reports the one with the least peak. "Peak"
is the measure ``train_step.py`` prints (``train_step.step_peak``): what the rank holds when the
step starts (parameter + optimizer bytes, and the gradients the loop keeps from the last step
until its ``zero_grad``; the static step clears them at its end) plus the highest rise of live
tensor bytes during the step, with one correction (``unseen frees`` below): a buffer freed on
gloo's worker thread is counted freed when its collective's range ends. The uncorrected figure is
the row "peak as the profiler counts it".

Every allocation of the profiled step is attributed from the profiler's op stack at the moment it
was made and the moment it was freed:

* phase: forward (before the first autograd node runs), backward, step (after the last one);
* ``gathered parameters``: made inside a parameter all-gather (ours ``autoparallel::zero3_gather``
  / ``zero3_regather``, FSDP2 ``FSDP::all_gather*`` / ``FSDP::pre_forward`` / ``pre_backward``);
* ``full-size gradients``: made in backward and freed by the unit's gradient reduction (ours:
  the gather's backward node, FSDP2: ``FSDP::post_backward*``);
* ``reduce-scatter buffers``: made in the reduction and freed before the step ends; what it made
  and the step keeps is ``sharded gradients``;
* ``saved activations``: other forward allocations (alive at a backward peak: what autograd saved);
* ``other backward``: activation gradients and backward temporaries;
* ``optimizer``: made by the optimizer's step (states on the first step, temporaries after);
* ``unseen frees``: a collective's buffer the profiler never sees freed. A gloo collective's
  worker thread still holds its tensors for a few milliseconds after the call returns; when the
  caller drops them first, the free happens on that thread, which the profiler does not record,
  so for the rest of the step the buffer counts as live (``train_step.py``'s peak includes it
  too). It is freed in fact (a weak reference to the storage is dead when the step ends); which
  buffer, if any, is hit varies between runs;
* ``before the step`` (negative): tensors alive when the step started and freed by the peak
  (the last step's gradients, which ``zero_grad`` drops before the backward).

For each side the table lists, at that side's peak (the rank with the highest peak), the live
bytes per category, and each phase's own peak rise; ``--phases`` adds the categories at each
phase's own peak, ``--top`` the largest allocations alive at the peak with where each was made
and freed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step  # noqa: E402  (the benchmarks folder, put on the path above)

CATEGORIES = ("gathered parameters", "full-size gradients", "reduce-scatter buffers", "sharded gradients",
              "saved activations", "other backward", "optimizer", "unseen frees", "before the step")
PHASES = ("forward", "backward", "step")
GATHER = ("autoparallel::zero3_gather", "autoparallel::zero3_regather", "autoparallel::zero3_prefetch", "FSDP::all_gather", "FSDP::pre_forward",
          "FSDP::pre_backward", "FSDP::root_pre_forward")
REDUCE = ("autoparallel::zero3_reduce_scatter", "FSDP::post_backward")
TOP = 12  # the largest allocations alive at the peak, listed with --top
PROFILED = 3  # profiled steps per side; the one with the least peak is reported
UNIT_BACKWARD = ("_GatherParamsBackward", "FSDP::post_backward")


@dataclass
class _Alloc:
    made: tuple[int, int]       # (time, event order) of the allocation
    size: int
    chain: tuple[str, ...]      # op stack when made
    phase: str
    settle: int                 # end of the outermost collective range it was made in (0: none)
    freed: tuple[int, int] | None = None  # of the free (None: not seen freed in the step)
    free_chain: tuple[str, ...] | None = None

    @property
    def unseen(self) -> bool:
        """Never seen freed, yet a collective's buffer: freed on gloo's worker thread."""
        return self.freed is None and (_has(self.chain, GATHER) or any(c.startswith("c10d::") for c in self.chain))


def _backend(a: _Alloc) -> bool:
    """An allocation the communication backend makes for itself (gloo's copy of a collective's
    input or output, inside a ``c10d::`` op or on gloo's worker thread): NCCL makes none."""
    return any(c.startswith("c10d::") for c in a.chain) or (bool(a.chain) and a.chain[-1].startswith("gloo:"))


def _has(chain: tuple[str, ...] | None, names: tuple[str, ...]) -> bool:
    return chain is not None and any(c.startswith(n) or n in c for c in chain for n in names)


def _category(a: _Alloc) -> str:
    if a.unseen:
        return "unseen frees"
    if _has(a.chain, GATHER):
        return "gathered parameters"
    if _has(a.chain, REDUCE):
        return "sharded gradients" if a.freed is None else "reduce-scatter buffers"
    if a.phase == "forward":
        return "saved activations"
    if a.phase == "backward":
        return "full-size gradients" if _has(a.free_chain, UNIT_BACKWARD) else "other backward"
    return "optimizer"


_Event = tuple[int, int, int, tuple[str, ...], int]  # time, address, signed bytes, op stack, settle


def _events(prof: Any) -> tuple[list[_Event], int, int]:
    """Every CPU allocation and free, sorted by time; the start and end of the backward (first
    and last autograd node)."""
    from torch._C._profiler import _EventType

    out: list[_Event] = []
    bwd = [sys.maxsize, 0]
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            ef = node.extra_fields
            if ef.device.type != "cpu":
                continue
            chain, settle = [], 0
            p = node.parent
            while p is not None:
                chain.append(p.name)
                if p.name.startswith("c10d::") or _has((p.name,), GATHER + REDUCE):
                    settle = p.end_time_ns  # the outermost such range wins (walking outwards)
                p = p.parent
            out.append((node.start_time_ns, ef.ptr, ef.alloc_size, tuple(chain), settle))
        elif node.name.startswith("autograd::engine::evaluate_function"):
            bwd[0] = min(bwd[0], node.start_time_ns)
            bwd[1] = max(bwd[1], node.end_time_ns)
    out.sort(key=lambda e: e[0])
    return out, bwd[0], bwd[1]


def _sweep(allocs: list[_Alloc], before: list[tuple[tuple[int, int], int]], phase: Any,
           place_unseen: bool) -> dict[str, Any]:
    """Live bytes over the step: the highest rise overall and per phase, and what is alive there
    by category. ``place_unseen``: an unseen free happens when its collective range ends."""
    timeline: list[tuple[tuple[int, int], int, _Alloc | None]] = [(k, size, None) for k, size in before]
    for a in allocs:
        timeline.append((a.made, a.size, a))
        if a.freed is not None:
            timeline.append((a.freed, -a.size, a))
        elif place_unseen and a.unseen:
            timeline.append(((max(a.settle, a.made[0]), sys.maxsize), -a.size, a))
    timeline.sort(key=lambda e: e[0])
    total = 0
    peaks = {ph: (0, (-1, -1)) for ph in ("all", *PHASES)}  # phase -> (highest rise, when)
    for when, size, _ in timeline:
        total += size
        for ph in ("all", phase(when[0])):
            if total > peaks[ph][0]:
                peaks[ph] = (total, when)

    def alive_at(when: tuple[int, int]) -> tuple[dict[str, int], list[tuple[int, str, str, str]]]:
        by = dict.fromkeys(CATEGORIES, 0)
        top: list[tuple[int, str, str, str]] = []
        for a in allocs:
            end = a.freed or ((max(a.settle, a.made[0]), sys.maxsize) if place_unseen and a.unseen else None)
            if a.made <= when and (end is None or end > when):
                cat = _category(a)
                by[cat] += a.size
                top.append((a.size, cat, " < ".join(a.chain[:4]), " < ".join((a.free_chain or ())[:3])))
        by["before the step"] = sum(size for k, size in before if k <= when)
        top.sort(reverse=True)
        return by, top[:TOP]

    peak, when = peaks["all"]
    by, top = alive_at(when)
    assert sum(by.values()) == peak, (by, peak)
    return {"peak_rise": peak, "by": by, "top": top, "peak_phase": phase(when[0]) if when[0] >= 0 else "forward",
            "phase_peak": {ph: peaks[ph][0] for ph in PHASES},
            "phase_by": {ph: alive_at(peaks[ph][1])[0] for ph in PHASES}}


def breakdown(prof: Any) -> dict[str, Any]:
    """The step's allocations matched with their frees, swept twice: as the profiler counts
    (``train_step.py``'s measure) and with unseen frees placed where their collective ends."""
    events, b0, b1 = _events(prof)

    def phase(t: int) -> str:
        return "forward" if t < b0 else "backward" if t <= b1 else "step"

    open_: dict[int, _Alloc] = {}
    allocs: list[_Alloc] = []
    before: list[tuple[tuple[int, int], int]] = []  # frees of tensors the step did not make
    for i, (t, ptr, size, chain, settle) in enumerate(events):
        if size > 0:
            a = open_[ptr] = _Alloc((t, i), size, chain, phase(t), settle)
            allocs.append(a)
        else:
            found = open_.pop(ptr, None)
            if found is None:
                before.append(((t, i), size))
            else:
                found.freed, found.free_chain = (t, i), chain
    seen = _sweep(allocs, before, phase, place_unseen=False)
    out = _sweep(allocs, before, phase, place_unseen=True)
    out["seen_peak_rise"] = seen["peak_rise"]
    ours = [a for a in allocs if not _backend(a)]
    out["own_peak_rise"] = _sweep(ours, before, phase, place_unseen=True)["peak_rise"]
    out["unseen"] = sum(a.size for a in allocs if a.unseen)
    out["kept"] = sorted(((a.size, " < ".join(a.chain[:4])) for a in allocs if a.freed is None), reverse=True)[:TOP]
    return out


def _profile_step(step: Any) -> Any:
    from torch.profiler import ProfilerActivity, profile

    with train_step.quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return prof


def measure(cfg: Any, x: torch.Tensor, y: torch.Tensor, warmup: int) -> dict[str, Any]:
    """Both sides at one width: this rank's breakdowns, then the rank with the highest peak's."""
    mine: dict[str, Any] = {}
    static = functools.partial(train_step.build_ours, static="plain")
    sides = (("ours", "ZeRO-3", train_step.build_ours), ("ours/overlap", "ZeRO-3/overlap", train_step.build_ours),
             ("ours static", "ZeRO-3", static), ("torch", "ZeRO-3", train_step.build_torch))
    for side, layout, build in sides:
        model, opt, step = build(layout, cfg, x, y)
        for _ in range(max(warmup, 4) if side == "ours static" else warmup):  # (it captures in its third call)
            step()
        _profile_step(step)  # unmeasured: what the measured steps free (the last gradients) is made under the profiler
        runs = []
        for _ in range(PROFILED):
            dist.barrier()
            kept = train_step.grad_bytes(model)
            r = breakdown(_profile_step(step))
            r["param_opt"] = train_step.param_opt_bytes(model, opt)
            r["kept_grads"] = kept
            for key in ("", "seen_", "own_"):
                r[f"{key}peak"] = r["param_opt"] + kept + r[f"{key}peak_rise"]
            runs.append(r)
        mine[side] = min(runs, key=lambda r: r["peak"])
        del model, opt, step
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {side: max((e[side] for e in every), key=lambda r: r["peak"]) for side in mine}


def _worker(rank: int, path: str, args: argparse.Namespace, result_path: str) -> None:
    import dataclasses

    cfg, x, y = train_step.start_worker(rank, path, args)
    cfg = dataclasses.replace(cfg, attention=args.attention, dropout=args.dropout)
    results = {str(w): measure(dataclasses.replace(cfg, width=w), x, y, args.warmup) for w in args.widths}
    train_step.finish_worker(rank, results, result_path)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"GPT {args.layers} layers, batch {args.batch} x seq {args.seq}, {args.heads} heads, AdamW; 4 gloo ranks; "
          "ZeRO-3 (ours: shard_optimizer(ShardingStage3)) vs FSDP2 (fully_shard per block and the root)")
    print("KiB per rank, the rank with the highest peak; categories: live at that side's peak")
    for width, r in results.items():
        o, q, t, st = r["ours"], r["ours/overlap"], r["torch"], r["ours static"]
        print(f"\nwidth {width}: peak ours {o['peak'] / 1024:,.0f} KiB ({o['peak_phase']}), "
              f"FSDP2 {t['peak'] / 1024:,.0f} KiB ({t['peak_phase']}): ratio {o['peak'] / t['peak']:.2f} "
              f"(as the profiler counts: {o['seen_peak'] / t['seen_peak']:.2f}); "
              f"overlap=True {q['peak'] / 1024:,.0f} KiB: ratio {q['peak'] / t['peak']:.2f} "
              f"(as counted: {q['seen_peak'] / t['seen_peak']:.2f})")
        print(f"static (ap.to_static) {st['peak'] / 1024:,.0f} KiB: static / eager {st['peak'] / o['peak']:.2f} "
              f"(as counted: {st['seen_peak'] / o['seen_peak']:.2f}; without gloo's own copies: "
              f"{st['own_peak'] / o['own_peak']:.2f}); without gloo's own copies, ours / FSDP2 "
              f"{o['own_peak'] / t['own_peak']:.2f}, overlap=True / FSDP2 {q['own_peak'] / t['own_peak']:.2f}")
        print(f"{'':<32} | {'ours':>9} | {'overlap':>9} | {'static':>9} | {'FSDP2':>9} | {'ours-FSDP2':>10}")
        cols = (o, q, st, t)
        rows = [("parameters + optimizer states", *(c["param_opt"] for c in cols)),
                ("gradients kept from the last step", *(c["kept_grads"] for c in cols))]
        rows += [(cat, *(c["by"][cat] for c in cols)) for cat in CATEGORIES]
        rows += [("peak", *(c["peak"] for c in cols))]
        rows += [("peak as the profiler counts it", *(c["seen_peak"] for c in cols))]
        rows += [("peak without gloo's own copies", *(c["own_peak"] for c in cols))]
        rows += [(f"{ph} phase: highest rise", *(c["phase_peak"][ph] for c in cols)) for ph in PHASES]
        for name, a, m, z, b in rows:
            print(f"{name:<32} | {a / 1024:>9,.0f} | {m / 1024:>9,.0f} | {z / 1024:>9,.0f} | {b / 1024:>9,.0f} | {(a - b) / 1024:>+10,.0f}")
        if args.phases:
            for ph in PHASES:
                print(f"at the {ph} phase's own peak (ours | FSDP2): " + ", ".join(
                    f"{c} {o['phase_by'][ph][c] / 1024:,.0f} | {t['phase_by'][ph][c] / 1024:,.0f}"
                    for c in CATEGORIES if o['phase_by'][ph][c] or t['phase_by'][ph][c]))
        if args.top:
            for side, res in (("ours", o), ("ours, overlap=True", q), ("ours static", st), ("FSDP2", t)):
                print(f"{side}: made in the step and not seen freed: "
                      + "; ".join(f"{size / 1024:,.0f} {made}" for size, made in res["kept"]))
                print(f"largest allocations alive at the peak, {side} (KiB, category, made in < ..., freed in < ...):")
                for size, cat, made, freed in res["top"]:
                    print(f"  {size / 1024:>8,.0f}  {cat:<22}  {made}  |  {freed or '(kept)'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, nargs="+", dest="widths", default=[256, 1024])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0, help="the GPT's three dropouts (Megatron's layer)")
    p.add_argument("--attention", choices=("sdpa", "math"), default="sdpa",
                   help="math: QK^T, softmax and AV as separate ops (activation-heavy at long sequences)")
    p.add_argument("--phases", action="store_true", help="the categories at each phase's own peak too")
    p.add_argument("--top", action="store_true", help=f"list the {TOP} largest allocations alive at each peak")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args()
    args.width = args.widths[0]  # train_step.start_worker's model config; each width replaces it
    report(train_step.run_world(_worker, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
