"""Reshard benchmark: bytes moved per rank by ``ap.reshard`` vs ``torch.distributed.tensor``.

Run (spawns its own gloo world; no port, a ``FileStore`` in a temp dir, ``OMP_NUM_THREADS=1``)::

    python benchmarks/reshard.py                 # 4 ranks, then 8 ranks
    python -m benchmarks.reshard                 # the same, from the repository root
    python benchmarks/reshard.py --nprocs 4 --quick
    python benchmarks/reshard.py --nprocs 8 --repeat 50 --json /tmp/reshard.json
    torchrun --nproc-per-node 4 benchmarks/reshard.py    # uses torchrun's world instead

The cases, the placement tokens, the lower bound and our expected plan live in
``benchmarks/reshard_cases.py``; the torch byte meter and the DTensor calls in
``benchmarks/reshard_meter.py``. For every case ``(mesh, shape, src placements -> dst
placements)`` it reports, on rank 0:

``plan``
    which plan ``ap.reshard`` ran: ``reshard.plan_best(src, dst)`` is a same-mesh ``Plan`` of
    collectives (``coll``; ``local`` when it communicates nothing) or a point-to-point
    ``CrossMeshPlan`` (``p2p``), whichever the busiest rank receives less from. The case
    fails if the collectives ``ap.CommDebugMode`` recorded do not match that kind.
``ours B``
    bytes this rank *received* during ``ap.reshard(x, mesh, dst)``, as recorded by
    ``ap.CommDebugMode`` (``autoparallel.runtime.comm`` prices every collective it issues with the
    formulas of ``autoparallel/cost.py``; point-to-point transfers count their buffers). Max
    over ranks. Each rank's figure must equal what ``plan_best(...).bytes_per_rank`` promised.
``torch B``
    bytes received during ``DTensor.redistribute(mesh, dst)`` on a ``DeviceMesh("cpu", ...)``
    over the same ranks, measured with a subclass of
    ``torch.distributed.tensor.debug.CommDebugMode`` that prices each functional collective it
    sees with the same ``cost.py`` formulas (see ``reshard_meter.py``; sizes are the tensors
    actually handed to the collective, so torch's padding of uneven shards is counted; on
    CPU/gloo DTensor's ``Shard(i) -> Shard(j)`` falls back to all-gather + chunk, which is what
    gets counted). Any other c10d collective seen makes the case fail loudly. ``R -> P`` goes
    through ``redistribute_local_tensor`` (what ``redistribute`` wraps), since the public
    method refuses a new Partial target. Max over ranks.
``bound B``
    a lower bound under the same model (bytes received), max over ranks: the target bytes a
    rank does not already hold, or, when ``m > 1`` summands must be reduced, the larger of its
    target size and the mesh-wide average of the least total traffic (the ring cost on one
    axis). The average is not reachable on an uneven split: there the busiest rank of a
    reduce-scatter still receives ``(n-1) x`` its largest piece. Details in
    ``reshard_cases.py``.
``ms``
    median wall time of the reshard over ``--repeat`` runs (``dist.barrier()`` before each),
    max over ranks of each rank's median. ``--repeat`` defaults to 20, and to 10 on worlds of
    more than 4 ranks, so that the default run (4 then 8 ranks) takes about 3 minutes on 2 cores.

``--torch-a2a`` lets DTensor use its real all-to-all op for ``Shard(i) -> Shard(j)`` (the path
it takes on GPUs; gloo runs it) instead of its CPU all-gather fallback: the fairer comparison
with an NCCL world.

"single-axis" cases are those on a 1-d mesh (all ranks); "multi-axis" cases are on 2-d/3-d
meshes. Targets checked: ours == bound on every single-axis case; ours <= torch on every case;
multi-axis total of ours <= 0.9 x torch's total. Every case also checks ``full_tensor()`` of
both results against the reference (values are small integers, so sums are exact) and that the
two libraries produced the same local shard.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(_HERE)
# This file is named like the ``reshard`` package: run as a script, its own folder must not
# shadow the package, and the repository root must come first. Its sibling modules are
# therefore imported as ``benchmarks.reshard_*``, which works as a script, under torchrun, in
# spawned workers and with ``python -m benchmarks.reshard``.
if __name__ in ("__main__", "__mp_main__"):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    if sys.path[:1] != [REPO_ROOT]:
        sys.path.insert(0, REPO_ROOT)

from benchmarks.reshard_cases import (  # noqa: E402 - after the sys.path fix above
    Case,
    ap_placement,
    ap_plan,
    ap_plan_bytes,
    enumerate_cases,
    lower_bound_bytes,
    no_partial,
    plan_kind,
    torch_placement,
)
from benchmarks.reshard_meter import make_torch_meter, torch_redistribute, use_torch_alltoall  # noqa: E402

# --------------------------------------------------------------------------------------------
# the per-rank benchmark
# --------------------------------------------------------------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("torch.distributed", "torch.distributed.tensor"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _reference(case: Case, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, case.shape, generator=g).to(torch.float32)


def _summand_weight(case: Case, coord: Sequence[int]) -> int:
    """Integer weight of this rank's summand: ``k + 1`` for the k-th combination of Partial-axis
    coordinates (k >= 1) and whatever makes them add up to 1 for k = 0, so the summands
    ``weight x reference`` add up to the reference exactly and a lost, doubled or misplaced
    summand changes the result."""
    p_axes = [a for a, t in enumerate(case.src) if t == "P"]
    sizes = [case.mesh_shape[a] for a in p_axes]
    m = math.prod(sizes)
    k = 0
    for a, size in zip(p_axes, sizes):
        k = k * size + coord[a]
    return k + 1 if k else 1 - sum(j + 1 for j in range(1, m))


def _timed(fn: Any, repeat: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_case(case: Case, seed: int, repeat: int, ap_mesh: Any, dmesh: Any, meter_cls: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    import autoparallel as ap
    from autoparallel.spec import DistSpec

    rank = dist.get_rank()
    full = _reference(case, seed)
    src_ap = [ap_placement(t) for t in case.src]
    dst_ap = [ap_placement(t) for t in case.dst]
    src_t = [torch_placement(t) for t in case.src]
    dst_t = [torch_placement(t) for t in case.dst]
    src_spec = DistSpec(ap_mesh, tuple(src_ap), case.shape, full.dtype)
    dst_spec = DistSpec(ap_mesh, tuple(dst_ap), case.shape, full.dtype)
    coord = ap_mesh.coordinate_of(rank)
    res: dict[str, Any] = {"errors": []}

    bound = lower_bound_bytes(src_spec, dst_spec)
    res["bound"] = bound[rank]

    # --- inputs
    if "P" in case.src:
        local = full
        for d, (o, n) in enumerate(no_partial(src_spec).local_box(coord)):
            local = local.narrow(d, o, n)
        local = (local * _summand_weight(case, coord)).contiguous()
        x = ap.dtensor_from_local(local.clone(), ap_mesh, src_ap, shape=case.shape)
        xt = DTensor.from_local(
            local.clone(), dmesh, src_t, run_check=False, shape=torch.Size(case.shape), stride=full.stride()
        )
    else:
        x = ap.shard_tensor(full, ap_mesh, src_ap)
        xt = distribute_tensor(full, dmesh, src_t, src_data_rank=None)

    # --- ours: bytes (one metered run), correctness, time
    y = yt = None
    try:
        with ap.CommDebugMode() as cm:
            y = ap.reshard(x, ap_mesh, dst_ap)
        res["ours_recv"], res["ours_sent"] = cm.bytes_received, cm.bytes_sent
        res["ours_ops"] = [r.kind for r in cm.records]
        if not torch.equal(y.full_tensor(), full):
            res["errors"].append("ours: full_tensor() differs from the reference")
        res["ours_ms"] = _timed(lambda: ap.reshard(x, ap_mesh, dst_ap), repeat)
    except Exception as e:  # noqa: BLE001 - report, keep going
        res["errors"].append(f"ours raised {type(e).__name__}: {e}")
        res["ours_trace"] = traceback.format_exc()

    # --- torch: the same
    try:
        with meter_cls() as tm:
            yt = torch_redistribute(xt, dmesh, dst_t)
        res["torch_recv"], res["torch_sent"] = tm.received, tm.sent
        res["torch_ops"] = tm.ops
        if tm.unpriced:
            res["errors"].append(f"torch: unpriced collectives {tm.unpriced}")
        if not torch.equal(yt.full_tensor(), full):
            res["errors"].append("torch: full_tensor() differs from the reference")
        res["torch_ms"] = _timed(lambda: torch_redistribute(xt, dmesh, dst_t), repeat)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"torch raised {type(e).__name__}: {e}")
        res["torch_recv"] = None

    if y is not None and yt is not None and "P" not in case.dst:
        if not torch.equal(y.to_local(), yt.to_local()):
            res["errors"].append(
                f"local shards differ: ours {tuple(y.to_local().shape)} vs torch {tuple(yt.to_local().shape)}"
            )
    promised = ap_plan_bytes(src_spec, dst_spec, rank)
    if "ours_recv" in res and res["ours_recv"] != promised:
        res["errors"].append(
            f"ours: CommDebugMode recorded {res['ours_recv']} B but plan_best promised {promised} B"
        )
    return res


def run_world(repeat: int, quick: bool, only: str | None = None, torch_a2a: bool = False) -> list[dict[str, Any]] | None:
    """Run every case on the current world; rank 0 returns the rows, other ranks None."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import autoparallel as ap
    from autoparallel.spec import DistSpec

    _quiet()
    torch.set_num_threads(1)
    if torch_a2a:
        use_torch_alltoall()
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = enumerate_cases(world, quick)
    if only:
        cases = [c for c in cases if c.name in only.split(",")]
    meter_cls = make_torch_meter()
    meshes: dict[tuple[int, ...], tuple[Any, Any]] = {}
    for c in cases:  # every rank builds every mesh in the same order
        if c.mesh_shape not in meshes:
            arr = np.arange(world).reshape(c.mesh_shape)
            meshes[c.mesh_shape] = (ap.ProcessMesh(arr), DeviceMesh("cpu", torch.tensor(arr)))
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases):
        ap_mesh, dmesh = meshes[case.mesh_shape]
        res = bench_case(case, seed=1 + i, repeat=repeat, ap_mesh=ap_mesh, dmesh=dmesh, meter_cls=meter_cls)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res)
        if rank != 0:
            continue
        src_spec = DistSpec(ap_mesh, tuple(ap_placement(t) for t in case.src), case.shape, torch.float32)
        dst_spec = DistSpec(ap_mesh, tuple(ap_placement(t) for t in case.dst), case.shape, torch.float32)

        def mx(key: str) -> Any:
            vals = [g.get(key) for g in gathered]
            return None if any(v is None for v in vals) else max(vals)

        errors = _dedupe_rank_errors([(r, e) for r, g in enumerate(gathered) for e in g["errors"]])
        plan = ap_plan(src_spec, dst_spec)
        kind = plan_kind(plan)
        ran = _ran_kind([g.get("ours_ops") for g in gathered])
        if ran is not None and ran != kind:
            errors.append(f"plan_best chose {kind} but ap.CommDebugMode recorded {ran}")
        row = {
            "world": world,
            "case": case.name,
            "kind": case.kind,
            "mesh": "x".join(map(str, case.mesh_shape)),
            "shape": list(case.shape),
            "src": list(case.src),
            "dst": list(case.dst),
            "transition": case.transition,
            "ours_B": mx("ours_recv"),
            "torch_B": mx("torch_recv"),
            "bound_B": mx("bound"),
            "ours_sent_B": mx("ours_sent"),
            "torch_sent_B": mx("torch_sent"),
            "ours_ms": mx("ours_ms"),
            "torch_ms": mx("torch_ms"),
            "ours_ops": gathered[0].get("ours_ops"),
            "torch_ops": gathered[0].get("torch_ops"),
            "plan_kind": kind,
            "plan": str(plan),
            "errors": errors,
        }
        rows.append(row)
    return rows if rank == 0 else None


def _ran_kind(ops_per_rank: list[list[str] | None]) -> str | None:
    """The kind of plan the recorded ops show: ``p2p``, ``coll`` or ``local``; None if a rank
    raised before recording."""
    if any(ops is None for ops in ops_per_rank):
        return None
    kinds = {k for ops in ops_per_rank for k in ops or []}
    if "send_recv" in kinds:
        return "p2p"
    return "coll" if kinds else "local"


def _dedupe_rank_errors(items: list[tuple[int, str]]) -> list[str]:
    by_msg: dict[str, list[int]] = {}
    for r, e in items:
        by_msg.setdefault(e, []).append(r)
    return [f"ranks {rs}: {e}" for e, rs in by_msg.items()]


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None:
        return "n/a"
    if b == 0:
        return "1.000" if a == 0 else "inf"
    return f"{a / b:.3f}"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:,}"


def _ms(v: Any) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_report(rows: list[dict[str, Any]]) -> tuple[str, bool]:
    """The table, totals and PASS/FAIL lines; returns (text, all targets passed)."""
    head = ["case", "mesh", "shape", "src->dst", "plan", "ours B", "torch B", "bound B",
            "ours/torch", "ours/bound", "ours ms", "torch ms", ""]
    body = []
    for r in rows:
        flags = []
        if r["ours_B"] is not None and r["torch_B"] is not None and r["ours_B"] > r["torch_B"]:
            flags.append(">torch")
        if r["ours_B"] is not None and r["ours_B"] > r["bound_B"]:
            flags.append(">bound")
        if r["ours_B"] is not None and r["ours_B"] < r["bound_B"]:
            flags.append("<bound?")
        if r["errors"]:
            flags.append("ERROR")
        body.append([
            f"{r['case']}@{r['world']}", r["mesh"], "x".join(map(str, r["shape"])), r["transition"], r["plan_kind"],
            _num(r["ours_B"]), _num(r["torch_B"]), _num(r["bound_B"]),
            _ratio(r["ours_B"], r["torch_B"]), _ratio(r["ours_B"], r["bound_B"]),
            _ms(r["ours_ms"]), _ms(r["torch_ms"]), " ".join(flags),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    right = {5, 6, 7, 8, 9, 10, 11}

    def line(cells: list[str]) -> str:
        return " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [
        "bytes = max over ranks of the bytes a rank RECEIVED during the reshard "
        "(ours: ap.CommDebugMode; torch: CommDebugMode ops priced with autoparallel/cost.py; "
        "bound: see benchmarks/reshard_cases.py); ms = max over ranks of the median over --repeat runs",
        line(head),
        "-+-".join("-" * w for w in widths),
    ]
    out += [line(b) for b in body]
    out.append("")

    def total(kind: str, key: str) -> int | None:
        vals = [r[key] for r in rows if r["kind"] == kind]
        return None if any(v is None for v in vals) else sum(vals)

    for kind in ("single", "multi"):
        n = sum(r["kind"] == kind for r in rows)
        if not n:
            continue
        o, t, b = total(kind, "ours_B"), total(kind, "torch_B"), total(kind, "bound_B")
        tm_o = sum(r["ours_ms"] or 0 for r in rows if r["kind"] == kind)
        tm_t = sum(r["torch_ms"] or 0 for r in rows if r["kind"] == kind)
        plans = {k: sum(r["kind"] == kind and r["plan_kind"] == k for r in rows) for k in ("coll", "p2p", "local")}
        out.append(
            f"total {kind}-axis ({n} cases): ours {_num(o)} B | torch {_num(t)} B | bound {_num(b)} B | "
            f"ours/torch {_ratio(o, t)} | ours/bound {_ratio(o, b)} | ours {tm_o:.1f} ms | torch {tm_t:.1f} ms | "
            f"plans {plans['coll']} coll, {plans['p2p']} p2p, {plans['local']} local"
        )
    o_all = sum(r["ours_B"] or 0 for r in rows)
    t_all = sum(r["torch_B"] or 0 for r in rows)
    out.append(f"total all ({len(rows)} cases): ours {o_all:,} B | torch {t_all:,} B | ours/torch {_ratio(o_all, t_all)}")
    out.append("")

    single = [r for r in rows if r["kind"] == "single"]
    bad1 = [r for r in single if r["ours_B"] != r["bound_B"]]
    bad2 = [r for r in rows if r["ours_B"] is None or (r["torch_B"] is not None and r["ours_B"] > r["torch_B"])]
    mo, mt = total("multi", "ours_B"), total("multi", "torch_B")
    ok3 = mo is not None and mt is not None and mo <= 0.9 * mt
    errs = [r for r in rows if r["errors"]]

    def names(rs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['case']}@{r['world']}" for r in rs)

    multi = [r for r in rows if r["kind"] == "multi"]
    if not multi:
        ok3 = True
    ok = not bad1 and not bad2 and ok3 and not errs

    def verdict(good: bool, any_rows: bool) -> str:
        return "SKIP" if not any_rows else ("PASS" if good else "FAIL")

    out.append(
        f"{verdict(not bad1, bool(single))}: ours == bound on every single-axis case "
        f"({len(single) - len(bad1)}/{len(single)})" + (f"; off: {names(bad1)}" if bad1 else "")
    )
    out.append(
        f"{'PASS' if not bad2 else 'FAIL'}: ours <= torch on every case "
        f"({len(rows) - len(bad2)}/{len(rows)})" + (f"; above: {names(bad2)}" if bad2 else "")
    )
    out.append(
        f"{verdict(ok3, bool(multi))}: multi-axis total ours <= 0.9 x torch "
        f"(ours {_num(mo)} B, 0.9 x torch {_num(None if mt is None else int(0.9 * mt))} B, ratio {_ratio(mo, mt)})"
    )
    out.append(f"{'PASS' if not errs else 'FAIL'}: correctness (full_tensor() == reference, same local shards) on every case"
               + (f"; errors in: {names(errs)}" if errs else ""))

    worse = [r for r in rows if r["ours_B"] is not None and (
        (r["torch_B"] is not None and r["ours_B"] > r["torch_B"]) or r["ours_B"] > r["bound_B"])]
    if worse:
        out.append("")
        out.append("cases where ours > torch or ours > bound (plan = str(reshard.plan_best(src, dst))):")
        for r in worse:
            out.append(
                f"  {r['case']}@{r['world']} mesh {r['mesh']} shape {tuple(r['shape'])} {r['transition']} [{r['plan_kind']}]: "
                f"ours {r['ours_B']:,} B, torch {_num(r['torch_B'])} B, bound {r['bound_B']:,} B"
            )
            out.append(f"      ours : {r['plan']}")
            out.append(f"      torch: {' + '.join(r['torch_ops'] or []) or 'no collectives'}")
    below = [r for r in rows if r["ours_B"] is not None and r["ours_B"] < r["bound_B"]]
    if below:
        out.append("")
        out.append("cases where ours < bound (the bound or a meter is wrong):")
        for r in below:
            out.append(f"  {r['case']}@{r['world']} {r['transition']} {tuple(r['shape'])}: ours {r['ours_B']:,} B, bound {r['bound_B']:,} B")
    if errs:
        out.append("")
        out.append("errors:")
        for r in errs:
            for e in r["errors"]:
                out.append(f"  {r['case']}@{r['world']} {r['transition']} {tuple(r['shape'])}: {e}")
    return "\n".join(out), ok


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------


def default_repeat(world: int, quick: bool) -> int:
    """20 timed runs per side, 10 on worlds above 4 ranks (they share the machine's cores)."""
    return 3 if quick else (20 if world <= 4 else 10)


def _worker(rank: int, world: int, store_path: str, opts: dict[str, Any], out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    _quiet()
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    code = 0
    try:
        repeat = opts["repeat"] or default_repeat(world, opts["quick"])
        rows = run_world(repeat, opts["quick"], opts.get("only"), opts.get("torch_a2a", False))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"repeat": repeat, "rows": rows}, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - print it, exit non-zero
        traceback.print_exc()
        code = 1
    # Skip the slow interpreter teardown (about a second per rank with torch loaded).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_world(world: int, opts: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the cases on a spawned gloo world of ``world`` ranks; rank 0's rows."""
    from benchmarks._spawn import run_spawned

    return run_spawned(_worker, world, opts, timeout, prefix="ap_reshard_bench_")  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap_.add_argument("--nprocs", type=int, action="append", help="world size (repeatable); default: 4 then 8")
    ap_.add_argument("--repeat", type=int, default=None,
                     help="timed runs per side per case (default 20; 10 on 8 ranks; 3 with --quick)")
    ap_.add_argument("--quick", action="store_true", help="a small subset of cases, few repeats")
    ap_.add_argument("--json", metavar="PATH", help="write every row (all worlds) as JSON")
    ap_.add_argument("--only", metavar="CASES", help="comma-separated case names (e.g. s01,m40)")
    ap_.add_argument("--torch-a2a", action="store_true",
                     help="let torch use its real all-to-all for Shard(i)->Shard(j) (as on GPUs) "
                          "instead of its CPU all-gather fallback")
    ap_.add_argument("--check", action="store_true", help="exit 1 when a target is not met (errors always exit 1)")
    ap_.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned world")
    args = ap_.parse_args(argv)
    opts = {"repeat": max(1, args.repeat) if args.repeat else None, "quick": args.quick, "only": args.only, "torch_a2a": args.torch_a2a}

    worlds: dict[int, dict[str, Any]] = {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        _quiet()
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        n = dist.get_world_size()
        repeat = opts["repeat"] or default_repeat(n, args.quick)
        rows = run_world(repeat, args.quick, args.only, args.torch_a2a)
        dist.barrier()
        dist.destroy_process_group()
        if rows is None:
            return 0
        worlds[n] = {"repeat": repeat, "rows": rows}
    else:
        for n in args.nprocs or [4, 8]:
            t0 = time.monotonic()
            worlds[n] = spawn_world(n, opts, args.timeout)
            print(f"[world of {n} gloo ranks: {len(worlds[n]['rows'])} cases in {time.monotonic() - t0:.1f} s]", flush=True)

    ok_all, errors = True, False
    all_rows: list[dict[str, Any]] = []
    for n, res in worlds.items():
        rows = res["rows"]
        text, ok = format_report(rows)
        a2a = ", torch with --torch-a2a" if args.torch_a2a else ""
        print(f"\n=== {n} ranks (gloo, CPU), repeat {res['repeat']}{' --quick' if args.quick else ''}{a2a} ===")
        print(text, flush=True)
        ok_all &= ok
        errors |= any(r["errors"] for r in rows)
        all_rows += rows
    if len(worlds) > 1:
        text, ok = format_report(all_rows)
        print("\n=== all worlds together: totals and targets ===")
        print(text[text.index("total "):].split("\ncases where")[0].split("\nerrors:")[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    if errors:
        return 1
    return 1 if (args.check and not ok_all) else 0


if __name__ == "__main__":
    sys.exit(main())
