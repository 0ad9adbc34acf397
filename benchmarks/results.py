"""Regenerate ``benchmarks/RESULTS.md`` from the benchmarks' own runs.

    python -m benchmarks.results                        # rebuild RESULTS.md from the stored runs
    python -m benchmarks.results --run train_step       # run one benchmark (as registered), then rebuild
    python -m benchmarks.results --run all              # every benchmark, one after the other
    python -m benchmarks.results --list                 # the registered benchmarks and their commands

Every benchmark is registered below with the command that measures it. ``--run NAME`` runs that
command from the repository root (``OMP_NUM_THREADS=1``), and stores what it printed, with the
machine, the date, the code's version and the wall time, in ``benchmarks/runs/NAME.json``.
RESULTS.md is rendered from those records alone, in the registry's order: each section says
what the benchmark measures, the command, where and when it ran, and what it printed. A failed
run is stored too (its exit status and the last lines of its stderr: a benchmark exits non-zero
when a target line says FAIL), so a regeneration never hides one. Rendering is pure: the same records give the same file (``tests/test_results.py`` checks
that the file in the repository is the records' rendering).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "benchmarks", "runs")
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


@dataclass(frozen=True)
class Bench:
    """One registered benchmark: its name (the record's file), section title, the command's
    arguments after ``python``, what it measures, how long a run may take, and how many of the
    last printed lines the section keeps (0: all)."""

    name: str
    title: str
    argv: tuple[str, ...]
    about: str
    timeout_s: int = 1800
    tail: int = 0

    @property
    def command(self) -> str:
        if self.argv[:2] == tuple(TORCHRUN[:2]):
            return "torchrun " + " ".join(self.argv[2:])
        return "python " + " ".join(self.argv)


REGISTRY: tuple[Bench, ...] = (
    Bench("main_job", "The main job", (*TORCHRUN, "examples/train_gpt.py"),
          "The README's training example: a GPT on the shipped corpus, dp 2 x tp 2 with sequence "
          "parallelism, AdamW, compared at the end with the same training in one process "
          "(loss and parameters within 1e-5 relative).", timeout_s=900),
    Bench("train_step", "The training step against torch", ("benchmarks/train_step.py",),
          "One GPT training step per layout (DP, TP, DP x TP + SP, ZeRO-3), ours eager against torch "
          "(DDP, parallelize_module, FSDP2) on the same ranks: step time, parameter + optimizer "
          "bytes, peak, collectives, losses compared. Target: DP at most 1.1x DDP."),
    Bench("static_step", "Static mode", ("benchmarks/static_step.py",),
          "The same steps captured once with `ap.to_static` and replayed, against eager and torch: "
          "step times, the capturing call, the set-up time (deciding and capturing), and whether "
          "static trains exactly as eager."),
    Bench("static_sizes", "Static mode on changing sequence lengths", (*TORCHRUN, "benchmarks/static_sizes.py"),
          "The GPT step under `ap.to_static` over eight sequence lengths (DP, TP, TP + SP, DP x TP on 4 "
          "ranks), with open sizes (one program for every length its guards admit) against a capture "
          "per length: captures, the capturing call, first and warm calls, the whole pass, and whether "
          "both train alike. Target: at most half the lengths captured (the first at its sizes, the next with them open, one more where a length breaks a guard).", timeout_s=1200),
    Bench("hand_limit", "The tensor-parallel step against the same plan written by hand",
          ("benchmarks/hand_limit.py",),
          "Megatron's tensor-parallel GPT step written per rank on plain tensors (f/g all-reduces, "
          "vocabulary-parallel loss) against ours eager and static, widths 64 and 256 on 2 and 4 "
          "ranks: step ratios and collectives per step. Targets: static within 1.15x, eager within "
          "1.5x of the hand step."),
    Bench("varying_shapes", "Variable sequence lengths", ("benchmarks/varying_shapes.py",),
          "Training on batches of changing sequence length (DP, TP, TP + SP on 2 ranks): the first "
          "pass over the lengths against a warm one. Target: first/warm at most 1.25."),
    Bench("reshard", "Reshard bytes against torch.distributed.tensor and the lower bound",
          ("benchmarks/reshard.py", "--nprocs", "4", "--quick"),
          "Bytes each rank receives when moving between layouts, ours against DTensor's "
          "`redistribute` and a lower bound, on a 4-rank world (the quick set of cases)."),
    Bench("op_coverage", "Op coverage against torch.distributed.tensor",
          ("benchmarks/op_coverage.py", "--variants", "shard0", "--quiet"),
          "Every op of torch's op_db run on a batch-sharded input through the conformance harness, "
          "ours against DTensor: pass rates per phase, and any silently wrong result.", timeout_s=3600),
    Bench("dispatch", "Per-op overhead", ("benchmarks/dispatch.py",),
          "Microseconds per op of a warm DistTensor op against torch's DTensor and a plain tensor."),
    Bench("recompute", "Activation recompute", ("benchmarks/memory.py", "--recompute-time"),
          "The compute overhead of recomputing activations (`ap.recompute`) in one process."),
    Bench("zero_bytes", "ZeRO-1/2/3 bytes and step peak against FSDP2", ("benchmarks/memory.py", "--zero-bytes"),
          "Parameter, gradient and optimizer bytes per rank and the step's peak, ZeRO-1/2/3 against "
          "FSDP2."),
    Bench("activation_memory", "Activation memory against Megatron's formulas", ("benchmarks/memory.py",),
          "Activation bytes a layer keeps for its backward per layout, against the formulas of "
          "Megatron's sequence-parallelism paper."),
    Bench("zero3_peak", "ZeRO-3 peak memory against FSDP2", ("benchmarks/zero3_peak.py",),
          "The ZeRO-3 step's peak memory and what is alive at it, against FSDP2, widths 256 and 1024."),
    Bench("zero3_overlap", "ZeRO-3 with overlap", ("benchmarks/train_step.py", "--layouts", "ZeRO-3", "ZeRO-3/overlap"),
          "The ZeRO-3 step with `ShardingStage3(mesh, overlap=True)` (the next unit's all-gather and "
          "the reduce-scatters started beside compute) against the default and FSDP2."),
    Bench("pipeline", "Pipeline schedules", ("benchmarks/pipeline.py",),
          "Pipeline schedules (GPipe, 1F1B, interleaved, zero bubble) on 4 stages: step time, peak "
          "activations, bubble."),
    Bench("context_parallel", "Context parallelism", ("benchmarks/context_parallel.py",),
          "Ring attention over a context-parallel axis: memory, bytes and the longest sequence that "
          "fits a budget, against attention on the whole sequence."),
    Bench("checkpoint", "Distributed checkpoints", ("benchmarks/checkpoint.py", "--mb", "50"),
          "Saving and loading a sharded state dict against torch.distributed.checkpoint."),
    Bench("auto_plan", "Full-auto parallel: search time and plan quality", ("benchmarks/auto_plan.py",),
          "`ap.auto_parallel`'s search time per world size and its plans' measured step time against "
          "the hand plans."),
    Bench("hf_llama", "A transformers Llama against torch", ("-m", "benchmarks.hf_llama"),
          "Step time of an unmodified transformers Llama, ours against torch's tensor parallelism."),
)
BY_NAME = {b.name: b for b in REGISTRY}


def machine() -> str:
    """The machine in words: CPU model and cores, memory, torch and Python versions (and a GPU)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        with open("/proc/meminfo") as f:
            mem = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal")) / 2**20
        memory = f", {mem:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = ""
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} cores ({model}){memory}{gpu}; torch {torch.__version__}, Python {platform.python_version()}"


def version() -> str:
    """The code measured: the commit, marked when the library, rules, planner, benchmarks or
    examples differ from it."""
    def git(*args: str) -> str:  # (not stripped: a status line starts with a space)
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    status = git("status", "--porcelain", "--untracked-files=no", "--",
                 "autoparallel", "spmd_rules", "reshard", "benchmarks", "examples")
    return commit + (" with local changes" if measured_changes(status) else "")


def measured_changes(status: str) -> bool:
    """Whether ``git status --porcelain`` output names a changed file other than the results
    themselves (the stored runs and RESULTS.md change as benchmarks run)."""
    return any(ln[3:] and not ln[3:].startswith(("benchmarks/runs/", "benchmarks/RESULTS.md"))
               for ln in status.splitlines())


def run(bench: Bench) -> dict[str, Any]:
    """Run ``bench``'s command from the repository root; the record stored for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"[results] {bench.name}: {bench.command}", flush=True)
    measured = version()  # before the run: files may change while it runs
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *bench.argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=bench.timeout_s)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        rc = -1
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = f"timed out after {bench.timeout_s} s"
    wall = time.perf_counter() - t0
    print(f"[results] {bench.name}: exit {rc} in {wall:.0f} s", flush=True)
    return {"name": bench.name, "command": bench.command, "date": datetime.date.today().isoformat(),
            "machine": machine(), "version": measured, "wall_s": round(wall, 1), "rc": rc,
            "output": out.rstrip("\n"), "error": "" if rc == 0 else "\n".join(err.strip().splitlines()[-15:])}


def load() -> dict[str, dict[str, Any]]:
    """The stored records, by benchmark name (registered ones only)."""
    records = {}
    for b in REGISTRY:
        path = os.path.join(RUNS, f"{b.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                records[b.name] = json.load(f)
    return records


def save(record: dict[str, Any]) -> None:
    os.makedirs(RUNS, exist_ok=True)
    with open(os.path.join(RUNS, f"{record['name']}.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")


def render(records: dict[str, dict[str, Any]]) -> str:
    """RESULTS.md for ``records`` (pure)."""
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.results` from the stored runs in `benchmarks/runs/`: do not",
        "edit by hand. Each section says what the benchmark measures, the command that ran, the machine,",
        "the date and the version of the code, and what the command printed. Rerun one with",
        "`python -m benchmarks.results --run NAME` (`--list` names them). On a shared machine with few",
        "cores, ratios measured within one run compare; absolute times move between runs.",
        "",
    ]
    for b in REGISTRY:
        lines += [f"## {b.title}", "", b.about, ""]
        rec = records.get(b.name)
        if rec is None:
            lines += [f"Not run yet: `python -m benchmarks.results --run {b.name}`.", ""]
            continue
        lines += [f"`{rec['command']}` on {rec['date']}, {rec['machine']}; code {rec['version']}; "
                  f"{rec['wall_s']:.0f} s.", ""]
        out = rec["output"].splitlines()
        kept = out[-b.tail:] if b.tail and len(out) > b.tail else out
        if kept:
            if len(kept) < len(out):
                lines += [f"(the last {len(kept)} of {len(out)} lines printed)", ""]
            lines += ["```text", *(ln.rstrip() for ln in kept), "```", ""]
        if rec["rc"] != 0:  # a target missed (a FAIL line above) or an error: its last lines on stderr
            lines += [f"**Exit status {rec['rc']}** (a target line above says FAIL, or the run failed); the last "
                      "lines it wrote to stderr:", "", "```text", rec["error"], "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(records: dict[str, dict[str, Any]]) -> None:
    with open(RESULTS, "w") as f:
        f.write(render(records))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs="+", metavar="NAME", default=[], help="run these benchmarks first ('all': every one)")
    p.add_argument("--list", action="store_true", help="print the registered benchmarks and their commands")
    args = p.parse_args(argv)
    if args.list:
        for b in REGISTRY:
            print(f"{b.name:18} {b.command}")
        return 0
    names = [b.name for b in REGISTRY] if args.run == ["all"] else args.run
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; registered: {', '.join(BY_NAME)}")
    failed = []
    for name in names:
        record = run(BY_NAME[name])
        save(record)
        if record["rc"] != 0:
            failed.append(name)
        write(load())  # after each run: an interrupted --run all keeps what finished
    write(load())
    print(f"[results] wrote {os.path.relpath(RESULTS)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
