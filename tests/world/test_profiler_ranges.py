"""torch.profiler shows the library's work as named ranges: planning on a decision-cache miss
(``autoparallel::plan <op>``), reshards (``autoparallel::reshard``) and each collective
(``autoparallel::all_gather`` ...), next to torch's own ops."""

from __future__ import annotations

from typing import Any

import torch

import autoparallel as ap
from autoparallel import Replicate, Shard


def _ranges(rank: int) -> list[str]:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x = ap.shard_tensor(torch.randn(8, 6), mesh, [Shard(0)])
        y = ap.reshard(x, mesh, [Replicate()])
        z = (x * 3.0).sum()  # a new op: planned here; its Partial result all-reduced below
        z.full_tensor()
        del y
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("autoparallel::")})


def test_planning_reshards_and_collectives_are_profiler_ranges(world4: Any) -> None:
    for names in world4.run(_ranges):
        assert "autoparallel::reshard" in names and "autoparallel::all_gather" in names, names
        assert "autoparallel::all_reduce" in names, names
        assert any(n.startswith("autoparallel::plan aten.mul") for n in names), names
