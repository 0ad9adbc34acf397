"""``ap.auto_parallel``: search time, and the chosen plan's measured step against the hand plans.

    python benchmarks/auto_plan.py                       # search times + 4-rank plan quality
    python benchmarks/auto_plan.py --sizes 64x64 --rounds 2 --skip-search --skip-scale

1. Search time (one process, no world): the example GPT and an unmodified transformers Llama
   (a tiny config, and Llama-3 8B's and 70B's shapes built on the meta device) on simulated worlds.
   At scale (``--skip-scale`` to leave out): Llama-3 8B / 70B in bf16 on torchtitan's GPU counts
   and batches with the H100 profile, the chosen plan beside torchtitan's plan (both priced by
   the search, tokens/s per GPU) and torchtitan's published measurement.
2. Plan quality (one spawned gloo world of 4 ranks, ``OMP_NUM_THREADS=1``): for each GPT size
   (width x sequence; 2 blocks, batch 8, vocabulary 128, AdamW), the hand plans DP, ZeRO-1/2/3,
   TP (Megatron over 4) and DP2 x TP2 + SP, and the plan ``ap.auto_parallel`` returns, each
   trained from the same weights on the same batches, taking turns round by round; step time =
   median over rounds of the mean step of the slowest rank. Printed: every plan's measured and predicted time, auto / best hand,
   the largest loss difference of the auto plan from DP's, and the Spearman rank correlation
   between predicted and measured step times over all hand plans and sizes. Then, per size, the
   plan for a memory budget 10 % below plain DP's predicted peak: its predicted and measured
   peak per rank. With matplotlib installed, ``benchmarks/auto_plan.png``: every plan's
   predicted vs measured step.
3. Pipelines (same world; ``--skip-pipelines`` to leave out): an untied 4-block GPT (width 256,
   seq 64, 16 rows), the best plan on each of pp2 x dp2, pp4, pp2 x tp2, dp4 and dp2 x tp2 as
   the search prices it there, and the free search's choice with ``pipeline=True``: predicted and
   measured step, the Spearman rank correlation over the meshes, auto / best measured mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):  # ahead of benchmarks/ (its reshard.py would hide reshard/)
    if p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)

HAND = {  # hand plan -> (mesh shape, dims, tp plan sp or None, zero stage, the search's name of it)
    "dp": ((4,), ["dp"], None, 0, "dp4 x tp1"),
    "zero1": ((4,), ["dp"], None, 1, "dp4 x tp1 zero1"),
    "zero2": ((4,), ["dp"], None, 2, "dp4 x tp1 zero2"),
    "zero3": ((4,), ["dp"], None, 3, "dp4 x tp1 zero3"),
    "tp": ((4,), ["mp"], False, 0, "dp1 x tp4 megatron"),
    "dp2xtp2+sp": ((2, 2), ["dp", "mp"], True, 0, "dp2 x tp2 megatron+sp"),
}


LLAMA3 = {  # transformers' LlamaConfig of Llama-3 8B and 70B
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
}
# torchtitan's published runs (docs/performance.md, H100 96 GB, 2024-12): (size, GPUs, sequences per
# step, their plan as the search names it, their tokens/s per GPU, what they ran)
TORCHTITAN = [
    ("8B", 8, 16, "dp8 x tp1 zero3", 5762, "FSDP, selective AC"),
    ("8B", 128, 256, "dp128 x tp1 zero3", 5605, "FSDP, selective AC"),
    ("70B", 256, 512, "dp32 x tp8 llama+sp zero3", 829, "FSDP 32 x TP 8, full AC, torch.compile + Float8"),
]
SEQ = 8192  # torchtitan's sequence length for Llama-3


def _llama(size: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA3[size])).to(dtype)


def at_scale() -> list[tuple[str, int, str, float, float, str, float, float, int, str]]:
    """Llama-3 8B / 70B on torchtitan's GPU counts and batches, bf16, the H100 profile, 89 GiB per
    GPU: the chosen plan and torchtitan's plan, both priced by the search (tokens/s per GPU)."""
    import autoparallel as ap

    rows = []
    for size, n, seqs, theirs, published, how in TORCHTITAN:
        ids = torch.randint(0, 128256, (seqs, SEQ))
        t = time.perf_counter()
        plan = ap.auto_parallel(_llama(size, torch.bfloat16), world=n, example={"input_ids": ids, "labels": ids},
                                profile="h100", memory_budget="89GiB")
        seconds = time.perf_counter() - t
        best = plan.candidates[0]
        same = [c for c in plan.candidates if c.name in (theirs, theirs + " recompute")]
        them = min(same, key=lambda c: (not c.feasible, c.prediction.time_s))
        per_gpu = seqs * SEQ / n
        rows.append((size, n, best.name, per_gpu / best.prediction.time_s, best.prediction.memory_bytes / 2**30,
                     them.name, per_gpu / them.prediction.time_s, them.prediction.memory_bytes / 2**30, published, how))
        print(f"  at scale: Llama-3 {size} on {n}: {best.name} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    return rows


def search_times(worlds: list[int]) -> list[tuple[str, int, float, str]]:
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap

    rows = []
    gpt = GPT(GPTConfig(vocab=128, width=64, heads=4, layers=2, seq=64))
    x = torch.randint(0, 128, (8, 64))
    # (label, model, the example for a world, other arguments)
    cases: list[tuple[str, Any, Callable[[int], Any], dict[str, Any]]] = [
        ("example GPT", gpt, lambda w: (x, x), {"loss": lm_loss})]
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        tiny = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
        ids = torch.randint(0, 128, (8, 64))
        cases.append(("Llama tiny", tiny, lambda w: {"input_ids": ids, "labels": ids}, {}))
        def tokens(w: int) -> dict[str, Any]:  # one 2048-token sequence per rank (fake tensors: no memory)
            big_ids = torch.randint(0, 128256, (w, 2048))
            return {"input_ids": big_ids, "labels": big_ids}

        for size in ("8B", "70B"):
            big = _llama(size, torch.float32)
            cases.append((f"Llama-3 {size} shapes, H100 profile, 80 GiB", big, tokens,
                          {"profile": "h100", "memory_budget": "80GiB"}))
        for size in ("8B", "70B"):  # and with pipeline axes priced too (dp x tp x pp)
            cases.append((f"Llama-3 {size} shapes, H100 profile, 80 GiB, pipeline axes too", _llama(size, torch.float32),
                          tokens, {"profile": "h100", "memory_budget": "80GiB", "pipeline": True}))
    except ImportError:
        print("transformers is not installed: Llama cases skipped", file=sys.stderr)
    for label, model, example, kw in cases:
        for w in worlds:
            t = time.perf_counter()
            try:
                chosen = ap.auto_parallel(model, world=w, example=example(w), **kw).candidates[0].name
            except ValueError as e:  # no plan fits the budget: the message names the smallest
                chosen = str(e).split("; ")[-1]
            rows.append((label, w, time.perf_counter() - t, chosen))
            print(f"  search {label}, {w} ranks: {rows[-1][2]:.1f} s -> {chosen}", file=sys.stderr, flush=True)
    return rows


def _side(mesh_shape: tuple[int, ...], dims: list[str], sp: bool | None, zero: int, width: int, seq: int,
          n_batches: int, plan: Any = None) -> Callable[[int], float]:
    """One plan's training step on batch ``i`` (the same weights and batches for every plan)."""
    import train_gpt
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, width=width, heads=4, layers=2, seq=seq, dropout=0.0))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (8, seq), generator=g), torch.randint(0, 128, (8, seq), generator=g))
               for _ in range(n_batches)]
    if plan is not None:
        return _plan_step(plan, model, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = ap.ProcessMesh(torch.arange(4).reshape(mesh_shape).tolist(), dim_names=dims)
    ap.parallelize(model, mesh, {} if sp is None else train_gpt.gpt_plan(sp))
    stages = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}
    opt = ap.shard_optimizer(opt, stages[zero](mesh, "dp") if zero else None)
    layout = [ap.Shard(0) if n == "dp" else ap.Replicate() for n in mesh.dim_names]

    def step(i: int) -> float:
        x, y = batches[i]
        loss = lm_loss(model(ap.shard_tensor(x, mesh, layout)), ap.shard_tensor(y, mesh, layout))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return train_gpt.scalar(loss)

    return step


def _memory_check(model: Any, x: torch.Tensor, free: Any, world: int) -> dict[str, Any]:
    """The plan for a budget 10 % under plain DP's predicted peak: its predicted peak per rank and
    the measured one (parameters and optimizer states held, plus the highest rise of live tensor
    bytes during one step after three warm-up steps), the largest over the ranks."""
    import copy

    from gpt_model import lm_loss

    import autoparallel as ap
    from benchmarks.train_step import peak_rise

    dp = next(c for c in free.candidates if c.name == f"dp{world} x tp1")
    budget = int(0.9 * dp.prediction.memory_bytes)
    torch.manual_seed(0)
    fresh = copy.deepcopy(model)
    plan = ap.auto_parallel(fresh, world=world, example=(x, x), loss=lm_loss, optimizer="adamw", memory_budget=budget)
    fresh, opt = plan.apply(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    layout = [ap.Shard(0) if n == "dp" else ap.Replicate() for n in plan.mesh.dim_names]
    xs = ap.shard_tensor(x, plan.mesh, layout)

    def step() -> None:
        lm_loss(fresh(xs), xs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    measured = [ap.memory.held_bytes(fresh, opt) + peak_rise(step)]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, measured[0])
    return {"budget": budget, "dp_predicted": dp.prediction.memory_bytes, "name": plan.candidates[0].name,
            "predicted": plan.candidates[0].prediction.memory_bytes, "measured": max(everyone)}


# pipeline plans: an untied GPT (a pipeline cannot hold a weight tied across stages), each mesh's
# best plan as the search prices it on that mesh, measured
PIPE_MESHES = {"pp2 x dp2": ([2, 2], ["pp", "dp"]), "pp4": ([4], ["pp"]), "pp2 x tp2": ([2, 2], ["pp", "mp"]),
               "dp4": ([4], ["dp"]), "dp2 x tp2": ([2, 2], ["dp", "mp"])}


def _plan_step(plan: Any, model: Any, batches: list[Any]) -> Callable[[int], float]:
    """``plan`` applied to ``model``, AdamW; one training step on batch ``i`` (``pipe.step`` for a
    plan with a pipeline axis)."""
    import train_gpt
    from gpt_model import lm_loss

    import autoparallel as ap

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if plan.pipeline:
        pipe, opt = plan.apply(model, opt, loss=lm_loss)
        first, last = plan.stage_meshes[0], plan.stage_meshes[-1]
        lay = [ap.Shard(0) if n == "dp" else ap.Replicate() for n in first.dim_names]

        def step(i: int) -> float:
            x, y = batches[i]
            opt.zero_grad()
            loss = pipe.step(ap.shard_tensor(x, first, lay), ap.shard_tensor(y, last, lay))
            opt.step()
            mine = float(loss.detach().full_tensor()) if dist.get_rank() in last.process_ids else float("-inf")
            value = torch.tensor([mine])
            dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the last stage's loss on every rank
            return float(value)
        return step
    model, opt = plan.apply(model, opt)
    lay = [ap.Shard(0) if n == "dp" else ap.Replicate() for n in plan.mesh.dim_names]

    def plain(i: int) -> float:
        x, y = batches[i]
        loss = lm_loss(model(ap.shard_tensor(x, plan.mesh, lay)), ap.shard_tensor(y, plan.mesh, lay))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return train_gpt.scalar(loss)
    return plain


def _pipelines(world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Each mesh of ``PIPE_MESHES``' best plan and the free search's choice with ``pipeline=True``,
    on an untied 4-block GPT: predicted and measured step (median of the rounds, turns taken)."""
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap
    from benchmarks._spawn import timed_steps

    width, seq, rows = 256, 64, 16
    cfg = GPTConfig(vocab=128, width=width, heads=4, layers=4, seq=seq, tied=False, dropout=0.0)
    steps, rounds, warm = opts["steps"], opts["rounds"], 3
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (rows, seq), generator=g), torch.randint(0, 128, (rows, seq), generator=g))
               for _ in range(warm + steps * rounds)]
    plans = {}
    for label, (shape, names) in PIPE_MESHES.items():
        mesh = ap.ProcessMesh(torch.arange(world).reshape(shape).tolist(), dim_names=names)
        plans[label] = ap.auto_parallel(GPT(cfg), example=batches[0], loss=lm_loss, mesh=mesh, optimizer="adamw")
    plans["auto"] = ap.auto_parallel(GPT(cfg), example=batches[0], loss=lm_loss, optimizer="adamw", pipeline=True)
    sides = {}
    for label, plan in plans.items():
        torch.manual_seed(0)
        sides[label] = _plan_step(plan, GPT(cfg), batches)
    for step in sides.values():
        for i in range(warm):
            step(i)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for label in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            dt, _ = timed_steps(sides[label], warm + r * steps, steps)
            times[label].append(dt)
    return {label: {"name": plans[label].candidates[0].name, "predicted_s": plans[label].prediction.time_s,
                    "step_s": statistics.median(times[label])} for label in plans}


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out_path: str) -> None:
    from benchmarks._spawn import timed_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap

    results: dict[str, Any] = {}
    steps, rounds = opts["steps"], opts["rounds"]
    warm = 4  # warm-up steps (local regions prove their signatures in the first calls)
    n_batches = warm + steps * rounds
    for size in opts["sizes"]:
        width, seq = (int(v) for v in size.split("x"))
        model = GPT(GPTConfig(vocab=128, width=width, heads=4, layers=2, seq=seq))
        x = torch.randint(0, 128, (8, seq))
        t = time.perf_counter()
        plan = ap.auto_parallel(model, world=world, example=(x, x), loss=lm_loss, optimizer="adamw",
                                pipeline=opts.get("pipeline_axes", True))
        search_s = time.perf_counter() - t
        predicted = {c.name: c.prediction.time_s for c in plan.candidates}
        sides = {name: _side(shape, dims, sp, zero, width, seq, n_batches) for name, (shape, dims, sp, zero, _) in HAND.items()}
        sides["auto"] = _side((), [], None, 0, width, seq, n_batches, plan=plan)
        losses = {name: [step(i) for i in range(warm)] for name, step in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(rounds):  # the plans take turns, in reversed order every other round: a slow
            for name in (names if r % 2 == 0 else names[::-1]):  # moment of the machine hits each alike
                step = sides[name]
                dt, more = timed_steps(step, warm + r * steps, steps)
                times[name].append(dt)
                losses[name] += more
        row: dict[str, Any] = {"auto_name": plan.candidates[0].name, "search_s": search_s, "plans": {}}
        for name in sides:
            pred = plan.candidates[0].prediction.time_s if name == "auto" else predicted.get(HAND[name][4])
            row["plans"][name] = {"step_s": statistics.median(times[name]), "predicted_s": pred, "losses": losses[name]}
        row["memory"] = _memory_check(model, x, plan, world)
        results[size] = row
        del sides
        if rank == 0:
            print(f"  {size}: " + ", ".join(f"{n} {v['step_s'] * 1e3:.1f} ms" for n, v in row["plans"].items())
                  + f" (auto = {row['auto_name']})", file=sys.stderr, flush=True)
    if opts.get("pipelines", True):
        results["pipelines"] = _pipelines(world, opts)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else float("nan")


def report(search: list[tuple[str, int, float, str]], quality: dict[str, Any], scale: list[Any] | None = None) -> None:
    if scale:
        print("\n| model | GPUs | chosen | predicted tokens/s/GPU | memory GiB | torchtitan's plan | predicted tokens/s/GPU "
              "| memory GiB | torchtitan measured tokens/s/GPU |\n|---|---|---|---|---|---|---|---|---|")
        for size, n, name, tps, mem, theirs, their_tps, their_mem, published, how in scale:
            print(f"| Llama-3 {size} | {n} | {name} | {tps:,.0f} | {mem:.1f} | {theirs} | {their_tps:,.0f} | {their_mem:.1f} "
                  f"| {published:,} ({how}) |")
    if search:
        print("\n| model | simulated ranks | search s | chosen |\n|---|---|---|---|")
        for label, w, s, name in search:
            print(f"| {label} | {w} | {s:.1f} | {name} |")
    pipes = quality.pop("pipelines", None) if quality else None
    if pipes:
        print("\nPipelines (an untied 4-block GPT, width 256, seq 64, 16 rows, AdamW): each mesh's best plan as the "
              "search prices it, and the free search with pipeline=True\n\n| mesh | plan | predicted ms | measured ms |\n"
              "|---|---|---|---|")
        for label, v in pipes.items():
            print(f"| {label} | {v['name']} | {v['predicted_s'] * 1e3:.1f} | {v['step_s'] * 1e3:.1f} |")
        fixed = [v for k, v in pipes.items() if k != "auto"]
        best = min(v["step_s"] for v in fixed)
        print(f"\nSpearman(predicted, measured) over the meshes: "
              f"{spearman([v['predicted_s'] for v in fixed], [v['step_s'] for v in fixed]):.2f}; "
              f"auto / best measured mesh: {pipes['auto']['step_s'] / best:.2f}")
    if not quality:
        return
    print("\n| size (width x seq) | " + " | ".join(list(HAND) + ["auto"]) + " | auto / best hand | auto's plan | auto loss vs DP |")
    print("|---" * (len(HAND) + 5) + "|")
    pred, meas = [], []
    wins = same = 0
    for size, row in quality.items():
        plans = row["plans"]
        cells = []
        for name in list(HAND) + ["auto"]:
            v = plans[name]
            p = v["predicted_s"]
            cells.append(f"{v['step_s'] * 1e3:.1f} ({p * 1e3:.1f})" if p is not None else f"{v['step_s'] * 1e3:.1f}")
            if name != "auto" and p is not None:
                pred.append(p)
                meas.append(v["step_s"])
        best = min(plans[n]["step_s"] for n in HAND)
        ratio = plans["auto"]["step_s"] / best
        wins += ratio < 1.0
        same += ratio < 1.0 and any(h[4] == row["auto_name"] for h in HAND.values())
        ref = plans["dp"]["losses"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(plans["auto"]["losses"], ref))
        print(f"| {size} | " + " | ".join(cells) + f" | {ratio:.2f} | {row['auto_name']} | {diff:.1e} |")
    print(f"\nmeasured ms (predicted ms); Spearman(predicted, measured) over the hand plans: {spearman(pred, meas):.2f}")
    print(f"auto strictly faster than every hand plan on {wins} of {len(quality)} sizes"
          + (f" ({same} of them with a hand plan's own layout: there the difference is the machine's noise)" if same else ""))
    print("\nPeak memory per rank under a budget 10 % below plain DP's predicted peak (measured: the largest "
          "over the ranks)\n\n| size | budget MiB | chosen | predicted MiB | measured MiB | measured / predicted |\n"
          "|---|---|---|---|---|---|")
    for size, row in quality.items():
        m = row["memory"]
        print(f"| {size} | {m['budget'] / 2**20:.2f} | {m['name']} | {m['predicted'] / 2**20:.2f} | "
              f"{m['measured'] / 2**20:.2f} | {m['measured'] / m['predicted']:.2f} |")
    picture(quality)


def picture(quality: dict[str, Any], path: str = os.path.join(ROOT, "benchmarks", "auto_plan.png")) -> None:
    """Predicted vs measured step time of every plan at every size (log-log), the auto plan
    marked; written when matplotlib is installed (``pip install -e '.[plot]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no picture (pip install -e '.[plot]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 5))
    lo, hi = float("inf"), 0.0
    for k, (size, row) in enumerate(quality.items()):
        color = f"C{k}"
        for name, v in row["plans"].items():
            if v["predicted_s"] is None:
                continue
            x, y = v["predicted_s"] * 1e3, v["step_s"] * 1e3
            lo, hi = min(lo, x, y), max(hi, x, y)
            auto = name == "auto"
            ax.scatter([x], [y], color=color, marker="*" if auto else "o", s=160 if auto else 30,
                       label=f"{size}" if name == "dp" else None, zorder=3 if auto else 2)
            if not auto:
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--", label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms), 4 gloo ranks")
    ax.set_title("ap.auto_parallel: each plan predicted vs measured (star: chosen)", fontsize=10)
    ax.legend(fontsize=8, title="width x seq")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"picture: {path}", file=sys.stderr)


def main() -> int:
    ap_ = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap_.add_argument("--sizes", default="64x64,256x64,256x256,1024x64", help="width x sequence, comma separated")
    ap_.add_argument("--worlds", default="4,8,64,512", help="simulated worlds for the search times")
    ap_.add_argument("--steps", type=int, default=3)
    ap_.add_argument("--rounds", type=int, default=3)
    ap_.add_argument("--skip-search", action="store_true")
    ap_.add_argument("--skip-quality", action="store_true")
    ap_.add_argument("--skip-scale", action="store_true", help="skip the Llama-3 8B / 70B plans vs torchtitan's")
    ap_.add_argument("--skip-pipelines", action="store_true", help="skip the measured pipeline plans")
    args = ap_.parse_args()
    search = [] if args.skip_search else search_times([int(w) for w in args.worlds.split(",")])
    scale = [] if args.skip_scale else at_scale()
    quality: dict[str, Any] = {}
    if not args.skip_quality:
        from benchmarks._spawn import run_spawned
        opts = {"sizes": args.sizes.split(","), "steps": args.steps, "rounds": args.rounds,
                "pipelines": not args.skip_pipelines}
        quality = run_spawned(_worker, 4, opts, timeout=3600, prefix="autoplan_")
    report(search, quality, scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
