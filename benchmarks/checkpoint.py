"""Checkpoint benchmark: ``ap.save_state_dict``/``ap.load_state_dict`` vs ``torch.distributed.checkpoint``.

Run (spawns its own gloo world: a ``FileStore`` in a temp dir, no port, ``OMP_NUM_THREADS=1``)::

    python benchmarks/checkpoint.py                # ~200 MB state dict on 4 ranks, 7 repeats
    python benchmarks/checkpoint.py --mb 50        # smaller, for a loaded machine
    python benchmarks/checkpoint.py --no-fsync     # neither library fsyncs its files
    torchrun --nproc-per-node 4 benchmarks/checkpoint.py   # torchrun's world instead

The state dict: 8 fp32 tensors of ``(rows, 1024)`` totalling ``--mb`` MB. Saved on a
``dp=2 x tp=2`` mesh: four tensors ``[Replicate, Shard(0)]`` (each piece held by two ranks, so
written once by one of them), four ``[Shard(0), Shard(1)]``. Loaded into a different layout on a
1-d ``tp=4`` mesh: the first four ``[Shard(1)]``, the others ``[Shard(0)]``. torch runs the same
with ``DTensor``s on ``DeviceMesh("cpu", ...)`` and ``dcp.save`` / ``dcp.load`` (its defaults:
one file per rank, ``sync_files=True``; ``--no-fsync`` sets ``sync_files=False``). Ours uses
its defaults (``fsync=True``; a CRC-32 of every byte written; every block read is verified by
one of the ranks reading it).

Reported per library, the median over ``--repeat`` runs after one untimed warm-up run. Each run
uses a fresh folder, and all folders are deleted only at the end. Times are the wall time
between two barriers, so the slowest rank counts: save seconds, load seconds (into the other
layout), and bytes written (all files of the folder). Both loads are checked against the values
saved. The two sides run back to back in every repeat, alternating which goes first. The ratio
reported is the median over repeats of ours/torch within the same repeat, which cancels most
of the drift of a machine shared with other jobs; the ratio of the medians is printed too.
Targets: ours <= 1.0 x torch's time for save and for load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

COLS = 1024
N_TENSORS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- values: known without materialising the full tensors ------------------------------------
def _values(box: tuple[tuple[int, int], ...], rows: int, seed: int) -> Any:
    """Tensor ``seed``'s values on the global region ``box``: a cheap function of the position."""
    import torch

    (r0, nr), (c0, nc) = box
    r = torch.arange(r0, r0 + nr, dtype=torch.float32).unsqueeze(1)
    c = torch.arange(c0, c0 + nc, dtype=torch.float32).unsqueeze(0)
    return (r * 7.0 + c * 0.5 + seed) % 1000.0


def _box(rows: int, placements: list[tuple[str, int]], mesh_shape: tuple[int, ...],
         coord: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global box of a (rows, COLS) tensor at ``coord`` (even splits; placements as ("S", d)/("R", 0))."""
    off, size = [0, 0], [rows, COLS]
    for axis, (kind, d) in enumerate(placements):
        if kind == "S":
            size[d] //= mesh_shape[axis]
            off[d] += coord[axis] * size[d]
    return ((off[0], size[0]), (off[1], size[1]))


SAVE = [[("R", 0), ("S", 0)]] * 4 + [[("S", 0), ("S", 1)]] * 4  # on dp x tp
LOAD = [[("S", 1)]] * 4 + [[("S", 0)]] * 4  # on tp = 4


def _coords(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (rank // 2, rank % 2) if len(shape) == 2 else (rank,)


# ---- one side -----------------------------------------------------------------------------------
def _ours(rows: int, save: bool) -> dict[str, Any]:
    import autoparallel as ap
    from autoparallel import Replicate, Shard

    rank = ap.get_rank()
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]) if save else ap.ProcessMesh([0, 1, 2, 3], ["tp"])
    layouts = SAVE if save else LOAD
    out = {}
    for i, pl in enumerate(layouts):
        box = _box(rows, pl, tuple(mesh.shape), _coords(rank, tuple(mesh.shape)))
        local = _values(box, rows, i) if save else _values(box, rows, i).zero_()
        placements = [Replicate() if k == "R" else Shard(d) for k, d in pl]
        out[f"layer{i}.weight"] = ap.dtensor_from_local(local, mesh, placements, shape=(rows, COLS))
    return out


def _torch(rows: int, save: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")) if save else DeviceMesh("cpu", [0, 1, 2, 3])
    layouts = SAVE if save else LOAD
    out = {}
    for i, pl in enumerate(layouts):
        box = _box(rows, pl, tuple(mesh.shape), _coords(rank, tuple(mesh.shape)))
        local = _values(box, rows, i) if save else _values(box, rows, i).zero_()
        placements = [Replicate() if k == "R" else Shard(d) for k, d in pl]
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, placements, run_check=False, shape=(rows, COLS),
                                                     stride=(COLS, 1))
    return out


def _check(sd: dict[str, Any], rows: int, rank: int) -> bool:
    for i, pl in enumerate(LOAD):
        t = sd[f"layer{i}.weight"]
        local = t.to_local() if hasattr(t, "to_local") else t
        box = _box(rows, pl, (4,), (rank,))
        if not bool((local == _values(box, rows, i)).all()):
            return False
    return True


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def run_rank(mb: float, repeat: int, fsync: bool, workdir: str) -> dict[str, Any] | None:
    """Every rank runs this; rank 0 returns the figures."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import autoparallel as ap

    rank = dist.get_rank()
    rows = max(4, int(mb * 2**20 / (4 * COLS * N_TENSORS)) // 4 * 4)
    res: dict[str, list[float]] = {k: [] for k in ("ours_save", "ours_load", "torch_save", "torch_load")}
    written = {"ours": 0, "torch": 0}
    ok = {"ours": True, "torch": True}
    for r in range(-1, repeat):  # run -1 warms up both sides (process groups, page cache) untimed
        for side in (("ours", "torch") if r % 2 == 0 else ("torch", "ours")):
            folder = os.path.join(workdir, f"{side}-{r}")
            if side == "ours":
                sd = _ours(rows, save=True)
                res["ours_save"].append(_timed(lambda: ap.save_state_dict(sd, folder, fsync=fsync)))  # noqa: F821  (called before the del below)
                target = _ours(rows, save=False)
                res["ours_load"].append(_timed(lambda: ap.load_state_dict(target, folder)))  # noqa: F821  (called before the del below)
            else:
                sd = _torch(rows, save=True)
                writer = dcp.FileSystemWriter(folder, sync_files=fsync)
                res["torch_save"].append(_timed(lambda: dcp.save(sd, storage_writer=writer)))  # noqa: F821  (called before the del below)
                target = _torch(rows, save=False)
                res["torch_load"].append(_timed(lambda: dcp.load(target, checkpoint_id=folder)))  # noqa: F821  (called before the del below)
            ok[side] &= _check(target, rows, rank)
            if r < 0:
                res[f"{side}_save"].pop()
                res[f"{side}_load"].pop()
            del sd, target
            if rank == 0:
                written[side] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            dist.barrier()
    dist.barrier()
    if rank == 0:  # deleted only now: deleting (and the disk discards it triggers) would disturb later runs
        for name in os.listdir(workdir):
            if name.startswith(("ours-", "torch-")):
                shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    oks = [None] * dist.get_world_size()
    dist.all_gather_object(oks, ok)
    if rank != 0:
        return None
    return {"mb": rows * COLS * 4 * N_TENSORS / 2**20, "repeat": repeat, "fsync": fsync,
            "median_s": {k: statistics.median(v) for k, v in res.items()}, "all_s": res, "bytes": written,
            "correct": {s: all(o[s] for o in oks) for s in ("ours", "torch")}}


def report(fig: dict[str, Any]) -> bool:
    m = fig["median_s"]
    print(f"\n=== checkpoint: {fig['mb']:.0f} MB fp32 state dict, 4 gloo ranks, save dp=2 x tp=2 -> load tp=4, "
          f"median of {fig['repeat']}, fsync={'on' if fig['fsync'] else 'off'} ===")
    print(f"{'':8}{'save s':>10}{'load s':>10}{'written MB':>12}{'correct':>9}")
    for side in ("ours", "torch"):
        print(f"{side:8}{m[side + '_save']:>10.3f}{m[side + '_load']:>10.3f}"
              f"{fig['bytes'][side] / 2**20:>12.1f}{str(fig['correct'][side]):>9}")
    print("every run (s): " + ", ".join(f"{k} {[round(x, 3) for x in v]}" for k, v in fig["all_s"].items()))
    ok = True
    for what in ("save", "load"):
        ratio = statistics.median(a / b for a, b in zip(fig["all_s"][f"ours_{what}"], fig["all_s"][f"torch_{what}"]))
        good = ratio <= 1.0 and fig["correct"]["ours"]
        ok &= good
        print(f"{what}: ours/torch = {ratio:.2f}x (median of the per-run ratios; ratio of medians "
              f"{m[f'ours_{what}'] / m[f'torch_{what}']:.2f}x)  target <= 1.0x  {'PASS' if good else 'FAIL'}")
    return ok


# ---- launching ----------------------------------------------------------------------------------
def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out: str) -> None:
    if sys.path[:1] != [ROOT]:  # ahead of benchmarks/ (its reshard.py would hide reshard/)
        sys.path.insert(0, ROOT)
    _quiet()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    fig = run_rank(**opts)
    if fig is not None:
        with open(out, "w") as f:
            json.dump(fig, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn(opts: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the benchmark on 4 spawned gloo ranks (their files in a temporary folder); the figures."""
    if sys.path[:1] != [ROOT]:  # ahead of benchmarks/ (its reshard.py would hide reshard/)
        sys.path.insert(0, ROOT)
    from benchmarks._spawn import run_spawned

    return run_spawned(_worker, 4, opts, timeout, prefix="ap_ckpt_bench_")  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="state dict size in MB (default 200)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per side (median reported)")
    parser.add_argument("--no-fsync", action="store_true", help="neither library fsyncs (page cache only)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    opts = {"mb": args.mb, "repeat": max(1, args.repeat), "fsync": not args.no_fsync}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        _quiet()
        dist.init_process_group("gloo")
        if dist.get_world_size() != 4:
            raise SystemExit("benchmarks/checkpoint.py needs 4 ranks")
        tmp = tempfile.mkdtemp(prefix="ap_ckpt_bench_") if dist.get_rank() == 0 else ""
        box = [tmp]
        dist.broadcast_object_list(box)
        fig = run_rank(**opts, workdir=box[0])
        dist.barrier()
        dist.destroy_process_group()
        if fig is None:
            return 0
        shutil.rmtree(box[0], ignore_errors=True)
    else:
        fig = spawn(opts, args.timeout)
    ok = report(fig)
    return 1 if (args.check and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
