"""Start a gloo world of spawned processes for a benchmark and collect what rank 0 wrote.

``run_spawned(worker, world, opts, timeout, prefix)`` starts ``world`` processes (``spawn``
context, ``OMP_NUM_THREADS=1``, loopback gloo) running ``worker(rank, world, store_path, opts,
out_path)``; each joins its process group through the ``FileStore`` at ``store_path`` (no
port). It waits up to ``timeout`` seconds, raises ``RuntimeError`` naming failed or hung ranks,
kills whatever is left, removes its temporary folder, and returns the JSON object the worker
wrote to ``out_path``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tests.world_harness import environment

Worker = Callable[[int, int, str, dict[str, Any], str], None]


def timed_steps(step: Callable[[int], Any], start: int, steps: int) -> tuple[float, list[Any]]:
    """Run ``step(start) .. step(start + steps - 1)`` after a barrier; (the slowest rank's mean
    seconds per step, the steps' results). Call on every rank of the started world."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    results = [step(start + k) for k in range(steps)]
    dt = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), results


def run_spawned(worker: Worker, world: int, opts: dict[str, Any], timeout: float, prefix: str) -> Any:
    """Run ``worker`` on ``world`` spawned ranks; return the JSON it wrote (see the module doc)."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix=prefix)
    store, out = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
    env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    procs = []
    with environment(env):  # the children inherit it at start
        for r in range(world):
            p = ctx.Process(target=worker, args=(r, world, store, {**opts, "workdir": tmp}, out), name=f"{prefix}{r}")
            p.start()
            procs.append(p)
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        failed = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
        if hung or failed:
            raise RuntimeError(f"world of {world}: ranks {failed} failed, {hung} still running after {timeout:.0f} s")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
