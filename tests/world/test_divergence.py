"""Ranks that stop running the same ops (2 gloo ranks, ``AUTOPARALLEL_TIMEOUT=3``): the rank left
waiting in a collective raises within the timeout, with a message that says what went wrong (the
ranks must run the same ops in the same order) instead of the backend's bare receive timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time

from tests.world_harness import SPAWN_ENV, environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 3.0


def _worker(rank: int, store_path: str, results: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ["AUTOPARALLEL_TIMEOUT"] = str(TIMEOUT_S)
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    import autoparallel as ap
    from autoparallel import runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=runtime.collective_timeout())
    mesh = ap.ProcessMesh([0, 1], ["x"])
    d = ap.shard_tensor(torch.arange(12.0).reshape(4, 3), mesh, [ap.Shard(0)])
    try:
        if rank == 0:  # a branch on the rank: rank 1 never joins this reshard
            ap.reshard(d, mesh, [ap.Replicate()])
            results.put((rank, "no error"))
        else:
            time.sleep(TIMEOUT_S + 3)
            results.put((rank, "slept"))
    except RuntimeError as e:
        results.put((rank, str(e)))
    results.close()
    results.join_thread()
    os._exit(0)  # no process-group teardown with a peer that went another way


def test_a_rank_left_waiting_is_told_why(tmp_path):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with environment(SPAWN_ENV):  # the children inherit it at start()
        procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), results), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
    got: dict[int, str] = {}
    deadline = time.monotonic() + 120
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, what = results.get(timeout=1)
            except queue.Empty:
                continue
            got[rank] = what
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert got.get(1) == "slept", got
    msg = got.get(0, "")
    assert "did not complete" in msg and "same ops on DistTensors in the same order" in msg, msg
    assert "AUTOPARALLEL_TIMEOUT=3s" in msg, msg
