"""Writes stay where they are made: a resharded tensor is a new tensor on every rank (writing it
leaves its source alone, for every target layout), and a 0-d value written into a DistTensor
(``x[0, 1] = 7.0``, ``x.copy_(torch.tensor(3.))``) lands as in one process."""

from __future__ import annotations

from typing import Any

import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard


def _reshard_then_write(rank: int) -> list[str]:
    wrong = []
    m1 = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    m2 = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    t = torch.arange(16.0).reshape(4, 4)
    cases = [(m1, [Replicate()], [Partial(r)]) for r in ("sum", "avg", "max", "min")]
    cases += [(m1, [Replicate()], [Shard(0)]), (m2, [Replicate(), Replicate()], [Partial(), Replicate()]),
              (m2, [Shard(0), Replicate()], [Shard(0), Partial()]), (m2, [Replicate(), Replicate()], [Shard(1), Partial("max")])]
    for mesh, src, dst in cases:
        x = ap.shard_tensor(t, mesh, src)
        y = ap.reshard(x, mesh, dst)
        y.mul_(3)
        if not torch.equal(x.full_tensor(), t):
            wrong.append(f"{src} -> {dst}")
    return wrong


def test_a_resharded_tensor_is_written_apart_from_its_source(world4: Any) -> None:
    assert world4.run(_reshard_then_write) == [[]] * 4


def _zero_d_writes(rank: int) -> bool:
    m1 = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    # (indices that keep each layout's shard: a write through a slice of a sharded dim raises)
    for placements, row, col in (([Replicate()], 0, 1), ([Shard(0)], slice(None), 1), ([Shard(1)], 2, slice(None))):
        x = ap.shard_tensor(torch.zeros(4, 4), m1, placements)
        want = torch.zeros(4, 4)
        x[row, col] = 7.0
        want[row, col] = 7.0
        assert torch.equal(x.full_tensor(), want), (placements, x.full_tensor())
        x[row, col] = torch.tensor(2.0)
        want[row, col] = 2.0
        assert torch.equal(x.full_tensor(), want), (placements, x.full_tensor())
        x.copy_(torch.tensor(3.0))
        assert torch.equal(x.full_tensor(), torch.full((4, 4), 3.0)), placements
        assert list(x.placements) == placements
    return True


def test_a_zero_d_value_is_written_as_in_one_process(world4: Any) -> None:
    assert all(world4.run(_zero_d_writes))
