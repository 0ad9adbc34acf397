"""Tests of the multi-process World harness itself."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.world_harness import WorkerError, World


def _all_reduce(rank: int, scale: int = 1) -> float:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t.item()


def _raise_value_error(rank: int) -> None:
    raise ValueError(f"bad value on rank {rank}")


def _raise_on_rank1(rank: int) -> int:
    if rank == 1:
        raise KeyError("only rank one")
    return rank


def _hang_on_rank0(rank: int) -> int:
    if rank == 0:
        dist.barrier()  # nobody else joins -> hangs
    return rank


def _info(rank: int) -> tuple[int, int, int, str]:
    return rank, dist.get_rank(), dist.get_world_size(), dist.get_backend()


def _warn(rank: int) -> list[str]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warnings.warn(f"user warning {rank}", UserWarning, stacklevel=1)
    return [str(w.message) for w in rec]


def _tensor_roundtrip(rank: int, t: torch.Tensor) -> torch.Tensor:
    return t * (rank + 1)


def _exit(rank: int) -> None:
    import os

    if rank == 1:
        os._exit(3)
    time.sleep(30)


def test_all_reduce(world4: World) -> None:
    assert world4.run(_all_reduce) == [10.0] * 4
    assert world4.run(_all_reduce, 2) == [20.0] * 4
    assert world4.run(_all_reduce, scale=3) == [30.0] * 4


def test_process_group_info_and_tensors(world4: World) -> None:
    assert world4.run(_info) == [(r, r, 4, "gloo") for r in range(4)]
    outs = world4.run(_tensor_roundtrip, torch.arange(3.0))
    for r, o in enumerate(outs):
        torch.testing.assert_close(o, torch.arange(3.0) * (r + 1))


def test_user_warnings_visible(world4: World) -> None:
    assert world4.run(_warn) == [[f"user warning {r}"] for r in range(4)]


def test_same_error_on_all_ranks(world4: World) -> None:
    with pytest.raises(ValueError, match="bad value on rank 0") as ei:
        world4.run(_raise_value_error)
    assert "rank 3" in str(ei.value) and "Traceback" in str(ei.value)
    assert world4.run(_all_reduce) == [10.0] * 4


def test_error_on_one_rank(world4: World) -> None:
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\]") as ei:
        world4.run(_raise_on_rank1)
    assert list(ei.value.failures) == [1]
    f = ei.value.failures[1]
    assert f.qualname == "KeyError" and "only rank one" in f.message and "Traceback" in f.traceback
    assert world4.run(_all_reduce) == [10.0] * 4


def test_timeout_and_restart(world4: World) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not answer"):
        world4.run(_hang_on_rank0, timeout=2)
    assert time.monotonic() - t0 < 15
    assert world4.run(_all_reduce) == [10.0] * 4


def test_local_function_rejected(world4: World) -> None:
    def local(rank: int) -> int:
        return rank

    with pytest.raises(ValueError, match="module-level"):
        world4.run(local)


def test_dead_worker_detected_and_context_manager() -> None:
    with World(2) as w:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"died .*\{1: 3\}"):
            w.run(_exit, timeout=60)
        assert time.monotonic() - t0 < 10
        assert w.run(_all_reduce) == [3.0, 3.0]
        procs = list(w._procs)
    assert w._procs == [] and all(p.exitcode == 0 for p in procs)
