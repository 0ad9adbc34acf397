"""op_db coverage: ours vs ``torch.distributed.tensor`` on the same conformance harness.

Run (spawns its own 4-rank gloo world: multiprocessing ``spawn``, a ``FileStore`` in a temp dir,
no port)::

    python benchmarks/op_coverage.py --variants shard0          # the whole op_db, Shard(0) only
    python benchmarks/op_coverage.py                            # every variant, both libraries
    python benchmarks/op_coverage.py --ops add,mm,cat --backends ours
    python benchmarks/op_coverage.py --limit 50 --json /tmp/cov.json
    python benchmarks/op_coverage.py --write-known-failures     # refresh the known-failures file

Every (op, variant, library) goes through ``tests/conformance/harness.py: run_op`` (see its docstring
for the verdicts). Printed: pass rates per variant and phase for both libraries (passes over
cases that ran: skips are left out), every ``WRONG`` (silently incorrect) result of ours with the
sample's shapes and the largest error, hangs, our failures that torch passes, and our failures
missing from ``tests/conformance/known_failures.py``. ``--json`` gets every record.
``--check`` exits 1 on any ``WRONG`` of ours, or on a pass rate below torch's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(_HERE)
if __name__ in ("__main__", "__mp_main__"):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    if sys.path[:1] != [REPO_ROOT]:
        sys.path.insert(0, REPO_ROOT)

from tests.conformance import harness as oc  # noqa: E402
from tests.world_harness import World  # noqa: E402

KNOWN_FAILURES_PATH = os.path.join(REPO_ROOT, "tests", "conformance", "known_failures.py")


def _rate(counts: dict[str, int]) -> str:
    ran = sum(v for k, v in counts.items() if k != "skip")
    if not ran:
        return "   -   "
    return f"{counts['pass']:4d}/{ran:<4d} {100.0 * counts['pass'] / ran:5.1f}%"


def format_table(records: list[dict[str, Any]], variants: list[str], backends: list[str]) -> str:
    table = oc.summarize(records)
    head = f"{'variant':<11} {'phase':<9}" + "".join(f" {b + ' pass/ran':>18}" for b in backends)
    head += "".join(f" {b + ' WRONG':>11} {b + ' err':>9} {b + ' hang':>9}" for b in backends)
    lines = [head, "-" * len(head)]
    for v in variants:
        for ph in oc.PHASES:
            row = f"{v:<11} {ph:<9}"
            counts = [table.get((b, v, ph), dict.fromkeys(oc.STATUS_ORDER, 0)) for b in backends]
            row += "".join(f" {_rate(c):>18}" for c in counts)
            row += "".join(f" {c['WRONG']:>11} {c['error']:>9} {c['hang']:>9}" for c in counts)
            lines.append(row)
    return "\n".join(lines)


def wrong_list(records: list[dict[str, Any]], backend: str) -> list[str]:
    out = []
    for r in records:
        if r["backend"] != backend:
            continue
        for ph in oc.PHASES:
            if r[ph] != "WRONG":
                continue
            for s in r["samples"]:
                if s[ph] == "WRONG":
                    err = s["max_err"]
                    out.append(f"{r['op']} [{r['variant']}, {ph}] sample {s['index']} {s['shapes']}: "
                               f"{s[ph + '_detail']}" + ("" if err != err else f"; max err {err:.3g}"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", help="comma-separated OpInfo names (default: all of op_db)")
    ap.add_argument("--limit", type=int, help="only the first N ops")
    ap.add_argument("--variants", default=",".join(oc.VARIANTS))
    ap.add_argument("--backends", default=",".join(oc.BACKENDS))
    ap.add_argument("--samples", type=int, default=oc.DEFAULT_SAMPLES)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per (op, variant, library)")
    ap.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "op_coverage.json"))
    ap.add_argument("--write-known-failures", nargs="?", const=KNOWN_FAILURES_PATH, default=None,
                    metavar="PATH", help="rewrite the known-failures file from ours' results "
                    "(entries of cases not run are kept)")
    ap.add_argument("--check", action="store_true", help="exit 1 on a WRONG of ours or a rate below torch's")
    ap.add_argument("--quiet", action="store_true", help="no per-op progress lines")
    ap.add_argument("--from-json", metavar="PATH", help="report (and --write-known-failures) from a saved run")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        args.samples, args.json = saved["samples"], args.from_json
        return report(args, saved["records"], saved["variants"], saved["backends"], saved["excluded"],
                      saved["elapsed_s"], saved.get("startup_s", 0.0), write_json=False)
    variants = [v for v in args.variants.split(",") if v]
    backends = [b for b in args.backends.split(",") if b]
    for v in variants:
        if v not in oc.VARIANTS:
            ap.error(f"unknown variant {v}; choose from {oc.VARIANTS}")
    for b in backends:
        if b not in oc.BACKENDS:
            ap.error(f"unknown backend {b}; choose from {oc.BACKENDS}")

    # SIGTERM (a killed run) unwinds like Ctrl-C, so the world's workers are shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    with World(oc.WORLD) as world:
        all_names = world.run(oc.worker_op_names, timeout=300)[0]
        t_ready = time.perf_counter()
        if args.ops:
            names = [n.strip() for n in args.ops.split(",") if n.strip()]
            unknown = [n for n in names if n not in all_names]
            if unknown:
                print(f"unknown op names: {unknown}", file=sys.stderr)
                return 2
        else:
            names = all_names
        all_excluded = oc.known_failures()[0]
        excluded = {n: all_excluded[n] for n in names if n in all_excluded}
        names = [n for n in names if n not in all_excluded]
        if args.limit:
            names = names[: args.limit]
        done = [0]
        total = len(names) * len(variants) * len(backends)

        def progress(rec: dict[str, Any]) -> None:
            done[0] += 1
            if not args.quiet and (rec["forward"] in ("WRONG", "hang") or rec["backward"] in ("WRONG", "hang")
                                   or done[0] % 200 == 0):
                print(f"[{done[0]}/{total} {time.perf_counter() - t_start:6.0f}s] {rec['op']} {rec['variant']} "
                      f"{rec['backend']}: fwd {rec['forward']} bwd {rec['backward']}", file=sys.stderr, flush=True)

        records = oc.run_ops(world, names, variants, backends, args.samples, args.timeout, progress)
    elapsed = time.perf_counter() - t_start
    return report(args, records, variants, backends, excluded, elapsed, t_ready - t_start)


def report(args: argparse.Namespace, records: list[dict[str, Any]], variants: list[str], backends: list[str],
           excluded: dict[str, str], elapsed: float, startup: float, write_json: bool = True) -> int:
    """Print the tables and lists; write the JSON (and the known failures when asked)."""
    names = sorted({r["op"] for r in records})

    print(f"\nop_db coverage: {len(names)} OpInfos x {len(variants)} variants x {backends}, "
          f"{args.samples} float32 samples each, {oc.WORLD} gloo ranks")
    print(f"time: {elapsed:.0f} s total ({startup:.0f} s start-up)\n")
    print(format_table(records, variants, backends))
    print("\npass rate = passes / cases that ran (skips excluded); a backward whose forward failed counts as failed")
    if excluded:
        print(f"\nexcluded ({len(excluded)}): " + "; ".join(f"{k}: {v}" for k, v in excluded.items()))

    failed_check = False
    if "ours" in backends:
        wrong = wrong_list(records, "ours")
        print(f"\nWRONG results of ours ({len(wrong)}): silently incorrect values")
        for w in wrong:
            print("  " + w)
        failed_check |= bool(wrong)
        hangs = [f"{r['op']} [{r['variant']}]: {r['forward_reason']}" for r in records
                 if r["backend"] == "ours" and r["forward"] == "hang"]
        if hangs:
            print(f"\nhangs of ours ({len(hangs)}):")
            for h in hangs:
                print("  " + h)
        divergent = sorted({f"{r['op']} [{r['variant']}, {ph}]: {r[ph + '_reason']}" for r in records
                            for ph in oc.PHASES if r["backend"] == "ours" and "only, the others went on" in r[ph + "_reason"]})
        print(f"\nfailures of ours on some ranks only (a hang risk in real programs): {len(divergent)}")
        for d in divergent:
            print("  " + d)
        causes: dict[str, int] = {}
        for r in records:
            for ph in oc.PHASES:
                if r["backend"] == "ours" and r[ph] in ("error", "hang") and oc.needs_entry(r, ph):
                    cause = re.sub(r"\((\d+, )*\d*,?\)", "(...)", r[ph + "_reason"].split(";")[0])[:110]
                    causes[cause] = causes.get(cause, 0) + 1
        print("\nmost common failure causes of ours (cases):")
        for cause, n in sorted(causes.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {n:4d}  {cause}")
        fallbacks = sorted({f for r in records if r["backend"] == "ours" for f in r.get("fallbacks", [])})
        print(f"\naten ops that ran through the replicate fallback (a pass, but unsharded): {len(fallbacks)}")
        if fallbacks:
            print("  " + ", ".join(fallbacks))
        unlisted = oc.unlisted(records)
        print(f"\nfailures of ours not in tests/conformance/known_failures.py: {len(unlisted)}")
        for key, why in unlisted[:50]:
            print(f"  {key}: {why}")
        if len(unlisted) > 50:
            print(f"  ... {len(unlisted) - 50} more")
        stale = oc.stale(records)
        print(f"stale known-failure entries (now pass): {len(stale)}")
        for key in stale[:50]:
            print(f"  {key}")
    if "ours" in backends and "torch" in backends:
        by = {(r["op"], r["variant"], r["backend"]): r for r in records}
        gap = sorted({r["op"] for r in records if r["backend"] == "torch" for ph in oc.PHASES
                      if r[ph] == "pass" and by[(r["op"], r["variant"], "ours")][ph] not in ("pass", "skip")})
        print(f"\nops that torch passes and ours does not (some variant/phase): {len(gap)}")
        print("  " + ", ".join(gap))
        table = oc.summarize(records)
        for v in variants:
            for ph in oc.PHASES:
                ours = oc.pass_rate(table.get(("ours", v, ph), dict.fromkeys(oc.STATUS_ORDER, 0)))
                theirs = oc.pass_rate(table.get(("torch", v, ph), dict.fromkeys(oc.STATUS_ORDER, 0)))
                if ours == ours and theirs == theirs and ours < theirs:
                    failed_check = True

    if write_json:
        with open(args.json, "w") as f:
            json.dump({"elapsed_s": elapsed, "startup_s": startup, "variants": variants, "backends": backends,
                       "samples": args.samples, "excluded": excluded, "records": records}, f, indent=1)
    print(f"\nrecords: {args.json}")
    if args.write_known_failures:
        oc.write_known_failures(args.write_known_failures, records)
        print(f"known failures written: {args.write_known_failures}")
    return 1 if args.check and failed_check else 0


if __name__ == "__main__":
    sys.exit(main())
