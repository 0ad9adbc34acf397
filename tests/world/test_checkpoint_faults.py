"""A rank that dies or hangs during a save: the others fail within the timeout, nothing is lost.

Three fresh gloo processes (FileStore rendezvous, collective timeout from
``AUTOPARALLEL_TIMEOUT`` via ``autoparallel.runtime.collective_timeout``) save a checkpoint,
then save again while rank 2 dies (or hangs) after writing its data and before the commit.
Ranks 0 and 1 must raise ``CheckpointError`` ("lost contact") within the timeout plus a margin,
and the first checkpoint must still load (here, in this test process: a world of one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time

import torch

from tests.world_harness import SPAWN_ENV, environment

TIMEOUT_S = 4.0
FAULTS = ("dies", "hangs")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _value(version: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(6, 2) * version


def _worker(rank: int, store_path: str, folder: str, fault: str, results: mp.Queue) -> None:
    os.environ["AUTOPARALLEL_TIMEOUT"] = str(TIMEOUT_S)
    sys.path.insert(0, ROOT)
    import torch.distributed as dist

    import autoparallel as ap
    from autoparallel import runtime
    from autoparallel.checkpoint import CheckpointError
    from autoparallel.checkpoint import save as save_mod

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3,
                            timeout=runtime.collective_timeout())
    mesh = ap.ProcessMesh([0, 1, 2], ["x"])
    ap.save_state_dict({"w": ap.shard_tensor(_value(1), mesh, [ap.Shard(0)]), "step": 1}, folder)
    orig = save_mod.write_owned

    def write_then_fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig(*args, **kwargs)
        if rank == 2:
            if fault == "dies":
                os._exit(3)
            time.sleep(600)  # hangs; the test kills it
        return out

    save_mod.write_owned = write_then_fail
    results.put((fault, rank, "started", time.monotonic()))
    try:
        ap.save_state_dict({"w": ap.shard_tensor(_value(2), mesh, [ap.Shard(0)]), "step": 2}, folder)
        results.put((fault, rank, "no error", 0.0))
    except CheckpointError as e:
        results.put((fault, rank, str(e), time.monotonic()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((fault, rank, f"wrong type {type(e).__name__}: {e}", time.monotonic()))
    results.close()
    results.join_thread()  # flush the message: os._exit would drop the queue's feeder thread
    os._exit(0)  # skip process-group teardown with a dead peer


def _spawn(ctx, folder: str, store: str, fault: str, results) -> list:  # type: ignore[no-untyped-def]
    procs = [ctx.Process(target=_worker, args=(r, store, folder, fault, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    return procs


def _collect(results, n: int, deadline: float) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    started: dict = {}
    ended: dict = {}
    while sum(len(v) for v in ended.values()) < n and time.monotonic() < deadline:
        try:
            fault, rank, what, t = results.get(timeout=1)
        except queue.Empty:
            continue
        if what == "started":
            started.setdefault(fault, {})[rank] = t
        else:
            ended.setdefault(fault, {})[rank] = (what, t)
    return started, ended


def test_rank_that_dies_or_hangs_during_save_fails_the_others_within_timeout(tmp_path):  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    with environment(SPAWN_ENV):  # two independent 3-rank worlds at once: rank 2 dies in one, hangs in the other
        for fault in FAULTS:
            procs += _spawn(ctx, str(tmp_path / fault), str(tmp_path / f"store-{fault}"), fault, results)
    try:
        started, ended = _collect(results, 2 * len(FAULTS), time.monotonic() + 300)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    import autoparallel as ap

    for fault in FAULTS:
        assert sorted(ended.get(fault, {})) == [0, 1], (fault, started, ended)
        for rank, (msg, t) in ended[fault].items():
            assert "lost contact with the other ranks" in msg and "AUTOPARALLEL_TIMEOUT=4s" in msg, msg
            took = t - started[fault][rank]
            assert took < TIMEOUT_S + 20, f"{fault}: rank {rank} took {took:.1f}s to fail"
        target = {"w": torch.zeros(6, 2), "step": 0}
        ap.load_state_dict(target, str(tmp_path / fault))  # the previous checkpoint is intact
        assert torch.equal(target["w"], _value(1)) and target["step"] == 1
