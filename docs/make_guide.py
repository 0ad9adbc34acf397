"""Fill the collectives table of docs/guide.md from what ``ap.CommDebugMode`` records.

    torchrun --standalone --nproc-per-node 4 docs/make_guide.py          # rewrite the table
    torchrun --standalone --nproc-per-node 4 docs/make_guide.py --check  # exit 1 if it is stale

Runs the SimpleNet of ``examples/simplenet.py`` under every strategy on 4 ranks (inner width
1024, batch 32), records the collectives of the second training step (the first one also
creates optimizer states) separately for forward, backward and the optimizer step, and writes
them, with the bytes rank 0 received, between the ``collectives`` markers of the guide.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from simplenet import STRATEGIES, SimpleNet, batches, setup  # noqa: E402

import autoparallel as ap  # noqa: E402

GUIDE = os.path.join(HERE, "guide.md")
BEGIN, END = "<!-- collectives:begin -->", "<!-- collectives:end -->"


def _counts(mode: ap.CommDebugMode) -> str:
    counts = mode.get_comm_counts()
    return ", ".join(f"{n}x {kind}" for kind, n in sorted(counts.items())) or "none"


def measure(strategy: str, inner: int = 1024, batch: int = 32) -> tuple[str, str, str, int]:
    """(forward, backward, optimizer step) collectives and bytes received on this rank, step 2."""
    torch.manual_seed(0)
    mesh, model, opt, placements = setup(strategy, SimpleNet(inner_size=inner), 0.1)
    for x, y in batches(2, batch, 1):
        with ap.CommDebugMode() as fwd:
            loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, placements)), ap.shard_tensor(y, mesh, placements))
        with ap.CommDebugMode() as bwd:
            loss.backward()
        with ap.CommDebugMode() as step:
            opt.step()
            opt.zero_grad()
    received = fwd.bytes_received + bwd.bytes_received + step.bytes_received
    return _counts(fwd), _counts(bwd), _counts(step), received


def table() -> str:
    rows = ["| strategy | forward | backward | optimizer step | KiB received per step (rank 0) |",
            "|---|---|---|---|---|"]
    for strategy in STRATEGIES:
        fwd, bwd, step, received = measure(strategy)
        rows.append(f"| `{strategy}` | {fwd} | {bwd} | {step} | {received / 1024:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the guide's table differs")
    args = parser.parse_args()
    if ap.get_world_size() != 4:
        raise SystemExit(f"run with 4 ranks: torchrun --standalone --nproc-per-node 4 {sys.argv[0]}")
    new = table()
    if ap.get_rank() != 0:
        return
    text = open(GUIDE, encoding="utf-8").read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n{new}\n{END}{tail}"
    print(new)
    if args.check:
        if updated != text:
            raise SystemExit("docs/guide.md: the collectives table is stale; rerun docs/make_guide.py")
        return
    with open(GUIDE, "w", encoding="utf-8") as f:
        f.write(updated)


if __name__ == "__main__":
    main()
