"""The tensor-parallel GPT step against the same plan written by hand on plain tensors.

    python benchmarks/hand_limit.py                          # widths 64 and 256, 2 and 4 ranks
    python benchmarks/hand_limit.py --widths 64 --worlds 2 --rounds 3
    python benchmarks/hand_limit.py --local-regions 0         # eager op by op (no local regions)

The limit a framework can reach: Megatron's tensor parallelism written per rank with plain
tensors and ``torch.distributed`` (the vocabulary-parallel embedding tied to the LM head, the
column/row-parallel pairs with their f/g all-reduces, the vocabulary-parallel cross-entropy
reducing its max and its (sum of exponentials, target logit) pair), SGD on the local shards.
Ours: the example's GPT, one device's code, laid out by ``ap.parallelize(gpt_plan(sp=False))``
with ``ap.shard_optimizer(SGD)``, run eagerly and as ``ap.to_static``'s captured step. The three
start from the same weights and train on the same batches; their losses are compared.

One spawned gloo world per rank count (FileStore, ``OMP_NUM_THREADS=1``) runs, per width,
alternating rounds of timed steps of each side. Printed: step time (median over rounds of the
mean step, slowest rank), ours/hand ratios, the collectives per step on each side (how many,
and bytes received per rank), and the largest loss difference relative to the hand program.
Targets: static <= 1.15x hand, eager <= 1.5x hand, collectives per step no more than the hand
program's. PASS/FAIL lines are measurements, printed as they come out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples")):  # ahead of benchmarks/ (its reshard.py would hide reshard/)
    if p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)

VOCAB, LR = 128, 0.1


# ---- the hand-written program ----------------------------------------------------------------
class _Count:
    """Collectives the hand program issues: (kind, bytes received per rank)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []

    def all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(t, op=op)
        n = dist.get_world_size()
        self.records.append(("all_reduce", t.numel() * t.element_size() * 2 * (n - 1) // n))
        return t


COUNT = _Count()


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return COUNT.all_reduce(g.contiguous().clone())


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return COUNT.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class HandGPT(nn.Module):
    """This rank's part of ``gpt_model.GPT`` under Megatron TP, from the full model's weights."""

    def __init__(self, full: nn.Module, rank: int, n: int) -> None:
        super().__init__()
        cfg = full.cfg
        self.cfg, self.rank, self.n = cfg, rank, n
        self.head_dim = cfg.width // cfg.heads

        def rows(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().chunk(n, 0)[rank].clone())

        def cols(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().chunk(n, 1)[rank].clone())

        def whole(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().clone())

        self.tok = rows(full.tok.weight)  # tied: the LM head's shard too
        self.pos = whole(full.pos.weight)
        self.blocks = nn.ModuleList()
        for b in full.blocks:
            m = nn.Module()
            m.ln1, m.ln2 = _ln(b.ln1), _ln(b.ln2)
            m.qkv = rows(b.attn.qkv.weight)  # head-major: whole heads per rank
            m.proj_w, m.proj_b = cols(b.attn.proj.weight), whole(b.attn.proj.bias)
            m.fc_w, m.fc_b = rows(b.mlp.fc.weight), rows(b.mlp.fc.bias)
            m.out_w, m.out_b = cols(b.mlp.proj.weight), whole(b.mlp.proj.bias)
            self.blocks.append(m)
        self.ln_f = _ln(full.ln_f)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        vn = self.tok.shape[0]
        lo = self.rank * vn
        out = (idx < lo) | (idx >= lo + vn)
        e = F.embedding((idx - lo).masked_fill(out, 0), self.tok).masked_fill(out[..., None], 0.0)
        x = _G.apply(e) + self.pos[:t]
        d = self.head_dim
        for m in self.blocks:
            h = _F.apply(m.ln1(x))
            qkv = (h @ m.qkv.t()).view(b, t, -1, 3 * d)
            q, k, v = (z.transpose(1, 2) for z in qkv.split(d, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + _G.apply(y @ m.proj_w.t()) + m.proj_b
            h = _F.apply(m.ln2(x))
            x = x + _G.apply(F.gelu(h @ m.fc_w.t() + m.fc_b) @ m.out_w.t()) + m.out_b
        logits = (_F.apply(self.ln_f(x)) @ self.tok.t()).flatten(0, 1)  # (B*T, V/n)
        return _vocab_parallel_ce(logits, targets.flatten(), lo)


def _ln(src: nn.LayerNorm) -> nn.LayerNorm:
    ln = nn.LayerNorm(src.normalized_shape, eps=src.eps)
    ln.load_state_dict(src.state_dict())
    return ln


def _vocab_parallel_ce(logits: torch.Tensor, targets: torch.Tensor, lo: int) -> torch.Tensor:
    """Mean cross-entropy of class-split logits: the max, then (sum of exponentials, target
    logit) reduced as one tensor."""
    mx = COUNT.all_reduce(logits.detach().max(-1).values, op=dist.ReduceOp.MAX)
    z = logits - mx[:, None]
    out = (targets < lo) | (targets >= lo + logits.shape[1])
    pick = z.gather(1, (targets - lo).masked_fill(out, 0)[:, None]).squeeze(1).masked_fill(out, 0.0)
    se, tgt = _G.apply(torch.stack([z.exp().sum(-1), pick]))
    return (se.log() - tgt).mean()


# ---- one world ---------------------------------------------------------------------------------
def _batches(steps: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
            for _ in range(steps)]


def _sides(width: int, args: argparse.Namespace, rank: int, n: int) -> dict[str, Any]:
    import train_gpt
    from gpt_model import GPT, GPTConfig, lm_loss

    import autoparallel as ap

    cfg = GPTConfig(vocab=VOCAB, seq=args.seq, layers=args.layers, width=width, heads=args.heads)
    data = _batches(4, args.batch, args.seq)
    mesh = ap.ProcessMesh(list(range(n)), dim_names=["mp"])
    placed = [tuple(ap.shard_tensor(t, mesh, [ap.Replicate()]) for t in xy) for xy in data]
    sides: dict[str, Any] = {}
    for name in ("eager", "static"):
        torch.manual_seed(0)
        model = GPT(cfg)
        train_gpt.parallelize_gpt(model, mesh, sp=False)
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        if name == "static":
            dm = ap.to_static(model, loss=lm_loss, optimizer=opt)

            def step(i: int, dm: Any = dm) -> float:
                return float(dm(*placed[i % len(placed)]).full_tensor())
        else:
            def step(i: int, model: nn.Module = model, opt: Any = opt) -> float:
                loss = lm_loss(model(placed[i % len(placed)][0]), placed[i % len(placed)][1])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return float(loss.full_tensor())
        sides[name] = step
    torch.manual_seed(0)
    hand = HandGPT(GPT(cfg), rank, n)
    hopt = torch.optim.SGD(hand.parameters(), lr=LR)

    def hand_step(i: int) -> float:
        x, y = data[i % len(data)]
        loss = hand(x, y)
        hopt.zero_grad(set_to_none=True)
        loss.backward()
        hopt.step()
        return float(loss)
    sides["hand"] = hand_step
    return sides


def _collectives(name: str, step: Any, i: int) -> list[tuple[str, int]]:
    import autoparallel as ap

    if name == "hand":
        COUNT.records.clear()
        step(i)
        return list(COUNT.records)
    with ap.CommDebugMode() as comm:
        step(i)
    return [(r.kind, int(r.recv_bytes)) for r in comm.records]


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out_path: str) -> None:
    from benchmarks._spawn import timed_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    args = argparse.Namespace(**opts)
    results: dict[str, Any] = {}
    for width in args.widths:
        sides = _sides(width, args, rank, world)
        # the same 4 warm-up steps on every side (the static one captures in its first call),
        # their losses compared; then each side's collectives in one more step
        losses = {name: [step(i) for i in range(4)] for name, step in sides.items()}
        counts = {name: _collectives(name, step, 4) for name, step in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        i = 5
        for _ in range(args.rounds):
            for name, step in sides.items():
                dt, _ = timed_steps(step, i, args.steps)
                times[name].append(dt)
            i += args.steps
        ref = losses["hand"]
        results[str(width)] = {
            name: {"step_s": statistics.median(times[name]),
                   "collectives": len(counts[name]), "kinds": dict(Counter(k for k, _ in counts[name])),
                   "bytes": sum(b for _, b in counts[name]),
                   "losses": losses[name], "rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses[name], ref))}
            for name in sides}
        if rank == 0:
            r = results[str(width)]
            print(f"  {world} ranks, width {width}: " + ", ".join(f"{n} {r[n]['step_s'] * 1e3:.1f} ms" for n in r),
                  file=sys.stderr, flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def report(all_results: dict[int, dict[str, Any]], args: argparse.Namespace) -> bool:
    print(f"GPT {args.layers} layers, {args.heads} heads, batch {args.batch} x seq {args.seq}, vocab {VOCAB}, SGD; "
          f"tensor-parallel; {args.rounds} rounds x {args.steps} steps")
    print(f"{'ranks':>5} | {'width':>5} | {'hand ms':>7} | {'eager ms':>8} | {'static ms':>9} | {'eager/hand':>10} | "
          f"{'static/hand':>11} | {'collectives hand/eager/static':>29} | {'KiB hand/eager/static':>23} | loss diff")
    ok = True
    for world, results in all_results.items():
        for width, r in results.items():
            h, e, s = r["hand"], r["eager"], r["static"]
            print(f"{world:>5} | {width:>5} | {h['step_s'] * 1e3:>7.1f} | {e['step_s'] * 1e3:>8.1f} | {s['step_s'] * 1e3:>9.1f} | "
                  f"{e['step_s'] / h['step_s']:>10.2f} | {s['step_s'] / h['step_s']:>11.2f} | "
                  f"{h['collectives']:>9} / {e['collectives']:>5} / {s['collectives']:>6} | "
                  f"{h['bytes'] / 1024:>7.1f} / {e['bytes'] / 1024:>5.1f} / {s['bytes'] / 1024:>5.1f} | "
                  f"{max(e['rel_diff'], s['rel_diff']):.1e}")
    for world, results in all_results.items():
        for width, r in results.items():
            h, e, s = r["hand"], r["eager"], r["static"]
            for name, ratio, target in (("static", s["step_s"] / h["step_s"], 1.15), ("eager", e["step_s"] / h["step_s"], 1.5)):
                good = ratio <= target
                ok &= good
                print(f"{'PASS' if good else 'FAIL'}: {world} ranks, width {width}: {name} step {ratio:.2f}x hand (target <= {target})")
            for name in ("eager", "static"):
                good = r[name]["collectives"] <= h["collectives"]
                ok &= good
                print(f"{'PASS' if good else 'FAIL'}: {world} ranks, width {width}: {name} issues {r[name]['collectives']} "
                      f"collectives per step, hand {h['collectives']} ({r[name]['kinds']} vs {h['kinds']})")
            good = max(e["rel_diff"], s["rel_diff"]) < 1e-5
            ok &= good
            print(f"{'PASS' if good else 'FAIL'}: {world} ranks, width {width}: losses equal the hand program's "
                  f"(largest relative difference {max(e['rel_diff'], s['rel_diff']):.1e})")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--local-regions", default=None, choices=("1", "0"),
                   help="AUTOPARALLEL_LOCAL_REGIONS for the ranks (0: every op on DistTensors)")
    args = p.parse_args()
    from benchmarks._spawn import run_spawned

    if args.local_regions is not None:  # (the spawned ranks inherit it)
        os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = args.local_regions

    opts = {k: v for k, v in vars(args).items() if k not in ("json", "local_regions")}
    results = {w: run_spawned(_worker, w, opts, timeout=1800, prefix=f"hand{w}_") for w in args.worlds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if report(results, args) else 1


if __name__ == "__main__":
    sys.exit(main())
