"""Activation memory per layer per rank, measured, next to Megatron's table (arXiv 2205.05198).

    python benchmarks/memory.py                    # 4 gloo ranks, s=256 h=256 a=8 b=2, 2 layers
    python benchmarks/memory.py --seq 128 --json /tmp/memory.json --repeat 3

Spawns its own world (multiprocessing ``spawn``, gloo, a ``FileStore``). The model is the
example GPT (examples/gpt_model.py) with Megatron's layer: "math" attention (QK^T, softmax,
dropout, AV as separate ops) and the three dropouts (p=0.1), laid out by ``parallelize_gpt``'s
plan (examples/train_gpt.py) on a 1 x t mesh (t = 4). ``ap.LayerMeter`` measures, per block,
the bytes of the storages the forward leaves alive for the backward on each rank (largest over
ranks and blocks). Rows:

| row | layout | formula (bytes, 16-bit activations) |
|---|---|---|
| none | one process, plain tensors | ``sbh(34 + 5as/h)`` |
| tp | TP t=4 | ``sbh(10 + 24/t + 5as/(ht))`` |
| tp+sp | TP + SP | ``sbh/t (34 + 5as/h)`` |
| tp+sp+selective | TP + SP, ``recompute={"blocks.*": "selective"}`` | ``34 sbh/t`` |
| tp+full | TP, ``recompute={"blocks.*": "full"}`` | ``2 sbh`` |
| tp+sp+full | TP + SP, full recompute (not in the table) | ``2 sbh / t`` |

in fp32 (formula x 2: 4-byte elements, masks stay 1 byte -- see docs/memory.md) and under
``torch.autocast("cpu", torch.bfloat16)`` (formula as written). Then the step time (forward +
backward, median over ``--repeat`` after a warm-up, max over ranks) of TP + SP with no,
selective and full recompute. The table with the term-by-term explanation is in docs/memory.md.

    python benchmarks/memory.py --zero-bytes       # ZeRO-1/2/3 x fp32 / MixedPrecision(bf16), AdamW
    python benchmarks/memory.py --recompute-time   # recompute's compute overhead, one process

``--zero-bytes``: 4 gloo ranks, the same GPT data parallel (``ap.shard_layer``) under DP and
ZeRO-1/2/3 with AdamW, fp32 and ``ap.MixedPrecision(torch.bfloat16)``. Per rank, after a step:
parameter, gradient and optimizer-state bytes (local storages), and the bytes of the compute
copies a block's forward sees that are not the parameters themselves (ZeRO-3's gathered
parameters, mixed precision's casts), largest block; and the step's peak: those bytes plus the
highest rise of live tensor bytes during a profiled step after two warm-up steps, the least of three (activations,
gradients, communication buffers; torch.profiler's memory events, as ``benchmarks/train_step.py``
reads them). The same columns for torch's FSDP2 (``fully_shard`` per block and the root, fp32 and
``MixedPrecisionPolicy(param_dtype=bfloat16)``): ZeRO-3's peak against FSDP2's, same run.
``--recompute-time``: one process, plain
tensors (no communication, so the compute alone), forward + backward with no, selective and
full recompute of every block, median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):  # ahead of benchmarks/ (its reshard.py would hide reshard/)
    if p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)

from benchmarks._spawn import run_spawned  # noqa: E402

ROWS = [  # name, tp layout ("none" | "tp" | "tp_sp"), recompute policy
    ("none", "none", "none"), ("tp", "tp", "none"), ("tp+sp", "tp_sp", "none"),
    ("tp+sp+selective", "tp_sp", "selective"), ("tp+full", "tp", "full"), ("tp+sp+full", "tp_sp", "full"),
]


def formula(row: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Megatron's bytes per layer for 16-bit activations."""
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": sbh / t * (34 + 5 * a * s / h),
        "tp+sp+selective": 34 * sbh / t,
        "tp+full": 2 * sbh,
        "tp+sp+full": 2 * sbh / t,
    }[row]


def _model(opts: dict[str, Any], layout: str, policy: str, mesh: Any) -> torch.nn.Module:
    import train_gpt
    from gpt_model import GPT, GPTConfig

    import autoparallel as ap

    cfg = GPTConfig(vocab=opts["vocab"], seq=opts["seq"], layers=opts["layers"], width=opts["hidden"],
                    heads=opts["heads"], dropout=opts.get("dropout", 0.1), attention="math", tied=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    rec = None if policy == "none" else {"blocks.*": policy}
    if layout != "none":
        ap.parallelize(model, mesh, train_gpt.gpt_plan(layout == "tp_sp"), recompute=rec)
    elif rec:
        for blk in model.blocks:
            ap.recompute(blk, policy)
    return model


def _step(model: torch.nn.Module, x: Any, y: Any, bf16: bool, meter: Any = None) -> None:
    from gpt_model import lm_loss

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    # the meter outside autocast: autocast's cache of low-precision weight copies is gone when it counts
    with (meter.track() if meter is not None else nullcontext()), cast:
        loss = lm_loss(model(x), y)
    loss.backward()


def _worker(rank: int, world: int, path: str, opts: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    import autoparallel as ap

    torch.set_num_threads(1)
    mesh = ap.ProcessMesh([list(range(world))], dim_names=["dp", "mp"])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, opts["vocab"], (opts["batch"], opts["seq"]), generator=g)
    y = torch.randint(0, opts["vocab"], (opts["batch"], opts["seq"]), generator=g)
    result: dict[str, Any] = {"memory": {}, "time": {}}
    for bf16 in (False, True):
        for name, lay, policy in ROWS:
            if lay == "none" and rank != 0:
                continue  # one process: rank 0 alone, plain tensors
            model = _model(opts, lay, policy, mesh)
            xs, ys = (x, y) if lay == "none" else (
                ap.shard_tensor(x, mesh, [ap.Replicate(), ap.Replicate()]),
                ap.shard_tensor(y, mesh, [ap.Replicate(), ap.Replicate()]))
            _step(model, xs, ys, bf16)  # warm-up (decision caches, local regions' first calls)
            model.zero_grad(set_to_none=True)
            meter = ap.LayerMeter(model, "blocks.*")
            _step(model, xs, ys, bf16, meter)
            per_layer = max(v for k, v in meter.bytes.items() if k.startswith("blocks"))
            result["memory"][f"{name}|{'bf16' if bf16 else 'fp32'}"] = per_layer
            if rank == 0 and opts.get("detail"):
                print(name, bf16, sorted(meter.detail["blocks.1"], key=lambda d: -d[1]), flush=True)
            if bf16 or lay != "tp_sp" or policy not in ("none", "selective", "full"):
                continue
            times = []
            for _ in range(opts["repeat"]):
                model.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, xs, ys, bf16)
                times.append(time.perf_counter() - t0)
            result["time"][policy] = statistics.median(times)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        merged: dict[str, Any] = {"memory": {}, "time": {}}
        for r in gathered:
            for k, v in r["memory"].items():
                merged["memory"][k] = max(v, merged["memory"].get(k, 0))
            for k, v in r["time"].items():
                merged["time"][k] = max(v, merged["time"].get(k, 0.0))
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


def _zero_worker(rank: int, world: int, path: str, opts: dict[str, Any], out: str) -> None:
    """Bytes per rank under DP / ZeRO-1/2/3, fp32 and bf16 mixed precision (AdamW)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    from gpt_model import lm_loss

    import autoparallel as ap

    torch.set_num_threads(1)
    mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, opts["vocab"], (opts["batch"] * world, opts["seq"]), generator=g)
    stages = {"dp": None, "zero1": ap.ShardingStage1, "zero2": ap.ShardingStage2, "zero3": ap.ShardingStage3}
    result: dict[str, Any] = {}
    for name, stage in stages.items():
        for mp in (None, ap.MixedPrecision(torch.bfloat16)):
            model = ap.shard_layer(_model(opts, "none", "none", None), mesh)
            opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage(mesh) if stage else None,
                                     mixed_precision=mp)
            copies: dict[str, int] = {}

            def seen(m: torch.nn.Module, args: Any, out: Any, block: str) -> None:
                for k, p in m._parameters.items():  # what the attribute resolves to during forward
                    used = getattr(m, k)
                    if p is not None and used is not p:
                        copies[block] = copies.get(block, 0) + _bytes(used)

            hooks = [m.register_forward_hook(lambda m, a, o, b=f"blocks.{i}": seen(m, a, o, b))
                     for i, blk in enumerate(model.blocks) for m in blk.modules()]
            xs = ap.shard_tensor(x, mesh, [ap.Shard(0)])
            lm_loss(model(xs), xs).backward()
            opt.step()
            for h in hooks:
                h.remove()
            states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
            result[f"{name}|{'bf16' if mp else 'fp32'}"] = {
                "params": sum(_bytes(p) for p in model.parameters()),
                "grads": sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None),
                "states": sum(_bytes(v) for v in states),
                "copies": max(copies.values(), default=0),
                "peak": _peak(model, opt, lambda model=model, xs=xs: lm_loss(model(xs), xs)),
            }
    for bf16 in (False, True):  # torch's FSDP2 on the same model and batch
        result[f"FSDP2|{'bf16' if bf16 else 'fp32'}"] = _fsdp2(opts, x, rank, world, bf16)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        merged = {k: {f: max(r[k][f] for r in gathered) for f in v} for k, v in result.items()}
        with open(out, "w") as f:
            json.dump({"zero": merged}, f)
    dist.destroy_process_group()


def _peak(model: torch.nn.Module, opt: Any, loss_of: Any) -> int:
    """Parameter + optimizer-state bytes and the highest rise of live tensor bytes during one
    more step (``train_step.peak_rise``) after two warm-up steps (local regions prove their
    signatures in the first calls); ``.grad`` set to None first, as a training loop does. The
    least rise of three profiled steps: a gloo buffer freed on the backend's worker thread is
    never seen freed by the profiler, inflating the step it falls in."""
    from benchmarks.train_step import peak_rise

    opt.zero_grad(set_to_none=True)
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    held = sum(_bytes(p) for p in model.parameters()) + sum(_bytes(v) for v in states)

    def step() -> None:
        loss_of().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    return held + min(peak_rise(step) for _ in range(3))


def _fsdp2(opts: dict[str, Any], x: torch.Tensor, rank: int, world: int, bf16: bool) -> dict[str, int]:
    """The ``--zero-bytes`` columns for torch's FSDP2 (``fully_shard`` per block and the root)."""
    from gpt_model import lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(opts, "none", "none", None)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = x.shape[0] // world
    xs = x[rank * per:(rank + 1) * per]
    lm_loss(model(xs), xs).backward()
    opt.step()
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    out = {"params": sum(_bytes(p) for p in model.parameters()),
           "grads": sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None),
           "states": sum(_bytes(v) for v in states), "copies": 0}
    out["peak"] = _peak(model, opt, lambda: lm_loss(model(xs), xs))
    return out


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _time_worker(rank: int, world: int, path: str, opts: dict[str, Any], out: str) -> None:
    """Forward + backward of the plain model in one process: no, selective, full recompute."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, opts["vocab"], (opts["batch"], opts["seq"]), generator=g)
    times: dict[str, list[float]] = {p: [] for p in ("none", "selective", "full")}
    models = {p: _model(opts, "none", p, None) for p in times}
    for model in models.values():
        _step(model, x, x, False)  # warm-up
    for _ in range(opts["repeat"]):
        for p, model in models.items():  # interleaved: a busy machine slows every policy alike
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(model, x, x, False)
            times[p].append(time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({"time": {p: statistics.median(v) for p, v in times.items()}}, f)


def report_zero(res: dict[str, Any], o: dict[str, Any]) -> str:
    rows = [f"bytes per rank after an AdamW step, 4 ranks, GPT h={o['hidden']} layers={o['layers']} vocab={o['vocab']} "
            "(max over ranks; copies: compute copies of the largest block, during its forward)",
            "| strategy | precision | params | grads | optimizer states | params + grads + states | compute copies "
            "| step peak | peak / FSDP2's |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in res["zero"].items():
        name, prec = key.split("|")
        total = r["params"] + r["grads"] + r["states"]
        fsdp = res["zero"].get(f"FSDP2|{prec}", {}).get("peak")
        prec = "fp32" if prec == "fp32" else "MixedPrecision(bf16)"
        ratio = f"{r['peak'] / fsdp:.2f}" if fsdp else "-"
        rows.append(f"| {name} | {prec} | {r['params'] / 2**20:.2f} MiB | {r['grads'] / 2**20:.2f} MiB | "
                    f"{r['states'] / 2**20:.2f} MiB | {total / 2**20:.2f} MiB | {r['copies'] / 2**20:.2f} MiB | "
                    f"{r['peak'] / 2**20:.2f} MiB | {ratio} |")
    return "\n".join(rows)


def report_time(res: dict[str, Any], o: dict[str, Any]) -> str:
    tm = res["time"]
    return "\n".join([f"forward + backward, one process, plain tensors, fp32, s={o['seq']} b={o['batch']} h={o['hidden']} "
                      f"a={o['heads']} layers={o['layers']} dropout={o['dropout']}, median of {o['repeat']}:",
                      *(f"  {k:<10} {tm[k] * 1e3:8.1f} ms  ({(tm[k] / tm['none'] - 1) * 100:+.1f}%)" for k in tm)])


def report(res: dict[str, Any], o: dict[str, Any]) -> str:
    s, b, h, a, t = o["seq"], o["batch"], o["hidden"], o["heads"], 4
    rows = [f"activation bytes per layer per rank: s={s} b={b} h={h} a={a} t={t} (GPT, math attention, dropout 0.1)",
            "| row | formula (16-bit) | bf16 autocast | ratio | fp32 | formula x2 | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, _, _ in ROWS:
        f = formula(name, s, b, h, a, t)
        m16, m32 = res["memory"][f"{name}|bf16"], res["memory"][f"{name}|fp32"]
        rows.append(f"| {name} | {f / 2**20:.2f} MiB | {m16 / 2**20:.2f} MiB | {m16 / f:.2f} | "
                    f"{m32 / 2**20:.2f} MiB | {2 * f / 2**20:.2f} MiB | {m32 / (2 * f):.2f} |")
    tm = res["time"]
    rows += ["", "step time (forward + backward), TP + SP, fp32, median, max over ranks:",
             *(f"  {k:<10} {tm[k] * 1e3:8.1f} ms  ({(tm[k] / tm['none'] - 1) * 100:+.1f}%)" for k in ("none", "selective", "full"))]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--detail", action="store_true", help="rank 0 prints what each row keeps (op, local shape, dtype, bytes)")
    p.add_argument("--dropout", type=float, default=0.1, help="the model's dropout (Megatron's table assumes 0.1)")
    p.add_argument("--zero-bytes", action="store_true", help="parameter + gradient + optimizer bytes per rank, ZeRO-1/2/3 x fp32/bf16")
    p.add_argument("--recompute-time", action="store_true", help="recompute's compute overhead in one process")
    args = p.parse_args()
    opts = vars(args).copy()
    if args.zero_bytes:
        res = run_spawned(_zero_worker, 4, opts, timeout=1800, prefix="apmem")
        print(report_zero(res, opts))
    elif args.recompute_time:
        res = run_spawned(_time_worker, 1, opts, timeout=1800, prefix="apmem")
        print(report_time(res, opts))
    else:
        res = run_spawned(_worker, 4, opts, timeout=1800, prefix="apmem")
        print(report(res, opts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"opts": opts, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
