"""SPMD agreement checks (``autoparallel/runtime/agree.py``): ranks passing different metadata
to ``shard_tensor`` / ``dtensor_from_local`` / ``reshard`` all raise the same ValueError, naming
the first differing rank and both values, before any data moves — never a hang, never a wrong
result; the world stays healthy afterwards. ``AUTOPARALLEL_CHECK=1`` also compares the values
given to ``shard_tensor``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import autoparallel as ap
from autoparallel import Replicate, Shard


def _mismatch(rank: int, what: str) -> str:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    odd = rank == 2
    # every call checked: this world's earlier tests may have used up the set-up calls of this mesh
    os.environ["AUTOPARALLEL_CHECK"] = "1"
    try:
        if what == "shape":
            ap.shard_tensor(torch.zeros(8, 5 if odd else 4), mesh, [Shard(0)])
        elif what == "dtype":
            ap.shard_tensor(torch.zeros(8, 4, dtype=torch.float64 if odd else torch.float32), mesh, [Shard(0)])
        elif what == "placements":  # Shard(0) vs Shard(1) on a square tensor: silently wrong before
            ap.shard_tensor(torch.zeros(4, 4), mesh, [Shard(1) if odd else Shard(0)])
        elif what == "from_local":
            ap.dtensor_from_local(torch.zeros(2, 3), mesh, [Replicate() if odd else Shard(0)])
        elif what == "local_shape":  # one rank's shard does not fit the global shape
            ap.dtensor_from_local(torch.zeros(3 if odd else 2, 4), mesh, [Shard(0)], shape=(8, 4))
        elif what == "reshard":
            x = ap.shard_tensor(torch.zeros(8, 8), mesh, [Shard(0)])
            ap.reshard(x, mesh, [Shard(1) if odd else Replicate()])
        elif what == "values":
            ap.shard_tensor(torch.full((4, 4), 2.0 if odd else 1.0), mesh, [Replicate()])
    except ValueError as e:
        return str(e)
    finally:
        del os.environ["AUTOPARALLEL_CHECK"]
    return ""


@pytest.mark.parametrize("what, first, other", [
    ("shape", "shape [8, 4]", "shape [8, 5]"),
    ("dtype", "torch.float32", "torch.float64"),
    ("placements", "[Shard(0)]", "[Shard(1)]"),
    ("from_local", "[Shard(0)]", "[Replicate()]"),
    ("local_shape", "[Shard(0)]", "local shape (3, 4) where mesh coordinate (2,) should hold (2, 4)"),
    ("reshard", "-> [Replicate()]", "-> [Shard(1)]"),
    ("values", "values checksum", "values checksum"),
])
def test_ranks_that_disagree_all_raise_the_same_error(world4: Any, what: str, first: str, other: str) -> None:
    messages = world4.run(_mismatch, what, timeout=60)
    assert len(set(messages)) == 1 and messages[0], messages  # the same error on every rank
    msg = messages[0]
    assert "disagree" in msg and "rank 0 passed" in msg and "rank 2 passed" in msg, msg
    assert first in msg.split("rank 2 passed")[0] and other in msg.split("rank 2 passed")[1], msg
    assert all(world4.run(_healthy))


def _healthy(rank: int) -> bool:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    x = ap.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    return bool(torch.equal(x.full_tensor(), torch.arange(8.0)))


def _setup_only(rank: int) -> tuple[int, int]:
    """The first SETUP_CALLS calls per entry point and mesh are checked; later ones are not."""
    from autoparallel.runtime import agree

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["agree_a", "agree_b"])  # a mesh of its own: a fresh count
    calls = []
    real = agree.comm.all_reduce

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(a[2])
        return real(*a, **k)

    agree.comm.all_reduce = counted  # type: ignore[assignment]
    try:
        with ap.CommDebugMode() as seen:
            ap.shard_tensor(torch.zeros(4, 4), mesh, [Shard(0), Replicate()])
        first = len(calls)
        for _ in range(agree.SETUP_CALLS):
            ap.shard_tensor(torch.zeros(4, 4), mesh, [Shard(0), Replicate()])
        before = len(calls)
        ap.shard_tensor(torch.zeros(4, 4), mesh, [Shard(0), Replicate()])
    finally:
        agree.comm.all_reduce = real  # type: ignore[assignment]
    return first, len(calls) - before, len(seen.records)


def test_checks_are_a_setup_cost(world4: Any) -> None:
    for first, late, recorded in world4.run(_setup_only):
        assert first == 2 and late == 0  # one tiny all-reduce per mesh axis, then nothing
        assert recorded == 0  # control messages: not the program's communication


def _diverging_plan(rank: int) -> str:
    """A rank-dependent layout past the entry points (as a rank-dependent bug would make it):
    rank 2 holds its [4, 4] tensor as Shard(1), the others as Shard(0), so an op gathering it
    plans a different all-gather on rank 2. ``AUTOPARALLEL_CHECK=1`` compares the planned
    collectives before any data moves."""
    from autoparallel.engine.dtensor import DistTensor
    from autoparallel.spec import DistSpec

    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    odd = rank == 2
    spec = DistSpec(mesh, (Shard(1) if odd else Shard(0),), (4, 4), torch.float32)
    x = DistTensor._wrap(torch.zeros((4, 1) if odd else (1, 4)), spec, (4, 1))
    os.environ["AUTOPARALLEL_CHECK"] = "1"
    try:
        torch.equal(x, x)  # a value op: gathers its inputs to Replicate
    except ValueError as e:
        return str(e)
    finally:
        del os.environ["AUTOPARALLEL_CHECK"]
    return ""


def test_full_check_compares_every_planned_collective(world4: Any) -> None:
    messages = world4.run(_diverging_plan, timeout=60)
    assert len(set(messages)) == 1 and messages[0], messages  # the same error on every rank
    msg = messages[0]
    assert "planned different collectives" in msg and "rank 0 planned all_gather" in msg, msg
    first, other = msg.split("rank 2 planned")
    assert "[Shard(0)] -> [Replicate()]" in first and "[Shard(1)] -> [Replicate()]" in other, msg
    assert all(world4.run(_healthy))
