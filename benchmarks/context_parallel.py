"""Context parallelism: activation memory per rank, bytes moved, longest sequence in a budget.

    python benchmarks/context_parallel.py [--seqs 512 1024 2048 4096] [--budget-seq 1024]

Our GPT (causal SDPA, learned positions; ``--layers``, ``--width``, ``--heads``), one sequence per
step, its sequence sharded on a ``cp`` mesh axis of 1, 2 and 4 gloo ranks (one world each, every
rank on the mesh) with ``ap.ContextParallel`` on every attention module, ring and all-to-all.
Per rank and sequence length it measures:

- **activation bytes**: what the blocks' forward leaves alive for the backward
  (``ap.LayerMeter`` over ``blocks.*``, this rank's shards): must fall ~1/cp;
- **bytes sent** by attention's collectives (every all-to-all of the step: the model's only ones)
  in one forward + backward (``ap.CommDebugMode``, per rank) against the formulas (the ring's rotations and balancing moves; Ulysses'
  all-to-alls of q, k, v and the output), which the measured figure must equal;
- **the longest sequence that fits a budget**: the budget is cp 1's activation bytes at
  ``--budget-seq``; for each cp the longest measured length within it (must grow ~cp x).

Prints a table per figure (markdown, for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._spawn import run_spawned  # noqa: E402

F32 = 4


def ring_bytes(n: int, me: int, seq: int, heads: int, head_dim: int) -> int:
    """Bytes member ``me`` of ``n`` sends in one layer's ring attention, forward + backward."""
    if n == 1:
        return 0
    piece = heads * (seq // n) * head_dim * F32  # one of q, k, v, out, dq, ... on this rank
    lse = heads * (seq // n) * F32
    rotations = (n - 1) * 2 * piece + (n - 1) * 4 * piece + 2 * piece  # fwd k, v; bwd k, v, dk, dv; home
    moves = 0
    if seq % (2 * n) == 0:  # causal and balanced: half-pieces that leave this rank
        def holder(half: int) -> int:
            return half if half < n else 2 * n - 1 - half
        leave_in = sum(holder(h) != me for h in (2 * me, 2 * me + 1))   # contiguous -> balanced
        leave_out = sum(h // 2 != me for h in (me, 2 * n - 1 - me))      # balanced -> contiguous
        half, half_lse = piece // 2, lse // 2
        moves = (leave_in * (3 * half)             # forward in: q, k, v
                 + leave_out * (half + half_lse)   # forward out: out, lse
                 + leave_in * (5 * half + half_lse)  # backward in: dout, q, k, v, out, lse
                 + leave_out * (3 * half))         # backward out: dq, dk, dv
    return rotations + moves


def ulysses_bytes(n: int, seq: int, heads: int, head_dim: int) -> int:
    """Bytes a rank sends in one layer's all-to-alls (q, k, v in, the output back; x2 backward)."""
    local = (seq // n) * heads * head_dim * F32
    return 2 * 4 * local * (n - 1) // n


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    import autoparallel as ap
    from examples.gpt_model import GPT, GPTConfig, lm_loss

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = ap.ProcessMesh(list(range(world)), dim_names=["cp"])
    results: dict[str, Any] = {}
    for comm in (("ring", "all_to_all") if world > 1 else ("none",)):
        for seq in opts["seqs"]:
            cfg = GPTConfig(vocab=128, seq=seq, width=opts["width"], heads=opts["heads"], layers=opts["layers"],
                            dropout=0.0)
            model = GPT(cfg)
            if world > 1:
                ap.parallelize(model, mesh, {"blocks.*.attn": ap.ContextParallel(comm=comm)})
            else:
                ap.shard_layer(model, mesh)
            x = ap.shard_tensor(torch.randint(0, 128, (1, seq)), mesh, [ap.Shard(1)] if world > 1 else [ap.Replicate()])
            for _ in range(2):  # a warm-up, then the measured step
                meter = ap.LayerMeter(model, "blocks.*")
                with ap.CommDebugMode() as cm:
                    with meter.track():
                        loss = lm_loss(model(x), x)
                    loss.backward()
                model.zero_grad(set_to_none=True)
            sent = sum(r.sent_bytes for r in cm.records if r.kind == "all_to_all")  # attention's, nothing else
            mine = {"act": sum(v for k, v in meter.bytes.items() if k.startswith("blocks.")), "sent": sent}
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            results[f"{comm}/{seq}"] = every
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--budget-seq", type=int, default=1024)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    opts = {"seqs": args.seqs, "width": args.width, "heads": args.heads, "layers": args.layers}
    runs = {cp: run_spawned(_worker, cp, opts, 1800, f"ap_cp{cp}_") for cp in args.cps}
    head_dim = args.width // args.heads
    print(f"GPT {args.layers} layers, width {args.width}, {args.heads} heads, one sequence per step, causal; "
          f"cp ranks = the world (gloo); per rank, the largest over ranks\n")
    print("| seq | cp 1 activation MiB | " + " | ".join(f"cp {cp} {c} MiB (x cp 1)" for cp in args.cps if cp > 1
                                                       for c in ("ring", "all_to_all")) + " |")
    print("|---" * (1 + 2 * sum(cp > 1 for cp in args.cps) + 1) + "|")
    base = {seq: max(e["act"] for e in runs[1]["none/" + str(seq)]) for seq in args.seqs} if 1 in runs else {}
    for seq in args.seqs:
        cells = [f"{base[seq] / 2**20:.2f}" if base else "-"]
        for cp in args.cps:
            if cp == 1:
                continue
            for c in ("ring", "all_to_all"):
                act = max(e["act"] for e in runs[cp][f"{c}/{seq}"])
                cells.append(f"{act / 2**20:.2f} ({act / base[seq]:.2f})" if base else f"{act / 2**20:.2f}")
        print(f"| {seq} | " + " | ".join(cells) + " |")
    print("\nbytes sent by attention per step (forward + backward), largest rank, measured / formula:\n")
    print("| seq | " + " | ".join(f"cp {cp} {c}" for cp in args.cps if cp > 1 for c in ("ring", "all_to_all")) + " |")
    print("|---" * (1 + 2 * sum(cp > 1 for cp in args.cps)) + "|")
    for seq in args.seqs:
        cells = []
        for cp in args.cps:
            if cp == 1:
                continue
            ring = runs[cp][f"ring/{seq}"]
            want_ring = [args.layers * ring_bytes(cp, r, seq, args.heads, head_dim) for r in range(cp)]
            got_ring = [e["sent"] for e in ring]
            uly = runs[cp][f"all_to_all/{seq}"]
            want_uly = args.layers * ulysses_bytes(cp, seq, args.heads, head_dim)
            got_uly = max(e["sent"] for e in uly)
            ok = "=" if got_ring == want_ring else "!="
            cells.append(f"{max(got_ring) / 2**20:.2f} MiB {ok} formula")
            cells.append(f"{got_uly / 2**20:.2f} MiB {'=' if got_uly == want_uly else '!='} formula")
        print(f"| {seq} | " + " | ".join(cells) + " |")
    if 1 in runs and args.budget_seq in base:
        budget = base[args.budget_seq]
        print(f"\nlongest measured sequence within cp 1's activation bytes at {args.budget_seq} "
              f"({budget / 2**20:.2f} MiB per rank):\n")
        for cp in args.cps:
            for c in (("none",) if cp == 1 else ("ring", "all_to_all")):
                acts = {seq: max(e["act"] for e in runs[cp][f"{c}/{seq}"]) for seq in args.seqs}
                fits = [seq for seq in args.seqs if acts[seq] <= budget]
                longest = max(args.seqs)
                linear = int(budget / (acts[longest] / longest))  # bytes grow linearly with the length
                print(f"- cp {cp} {c}: {max(fits) if fits else '-'} measured; {linear} from the measured bytes per "
                      f"token at {longest} ({linear / args.budget_seq:.2f} x cp 1's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
