"""The world lifecycle in one world: the library's groups are created when a mesh enters,
released (caches dropped, groups destroyed newest first) and created again, 20 times over,
with correct collectives every round and nothing left behind. The exit-code side (scripts run
20 times under torchrun exit 0 every time) is `.ci/exits`."""

from __future__ import annotations

from typing import Any

import torch

import autoparallel as ap
from autoparallel import Shard


def _cycles(rank: int, rounds: int) -> list[Any]:
    from autoparallel.runtime import groups

    groups.release()  # start from nothing (earlier tests in this world made groups)
    out = []
    for i in range(rounds):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
        x = ap.shard_tensor(torch.arange(16.0).reshape(4, 4) + i, mesh, [Shard(0), Shard(1)])
        total = float((x * 2).sum().full_tensor())
        made = len(groups.created())
        groups.release()  # what interpreter exit (or the user's destroy_process_group) runs
        out.append((total, made, len(groups.created())))
    return out


def test_groups_are_released_and_recreated_twenty_times(world4: Any) -> None:
    for per_rank in world4.run(_cycles, 20, timeout=300):
        for i, (total, made, left) in enumerate(per_rank):
            assert total == 2 * float((torch.arange(16.0) + i).sum())
            assert made == 4 and left == 0  # two lines per axis made, none left after release
