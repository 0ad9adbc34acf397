"""ZeRO-3's gradient reduction makes one full-size buffer per unit (4 gloo ranks).

A unit's gradients are packed straight into the reduce-scatter's one buffer: no per-member
segment copies, no reordered copy inside ``comm`` when the group's ranks are in mesh order.
What a whole step holds at its peak, against torch's FSDP2:
``benchmarks/zero3_peak.py`` (docs/memory.md, "ZeRO-3 memory at its peak").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Shard

REDUCE = "autoparallel::zero3_reduce_scatter"


def _reduction_allocations(rank: int) -> list[int]:
    """Bytes of every allocation the unit's reduction makes itself (a collective's own
    internals excluded), in one profiled step after a warm-up step."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1, 2, 3], ["dp"])
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ap.ShardingStage3(mesh, "dp"))
    x = ap.shard_tensor(torch.randn(32, 64), mesh, [Shard(0)])
    y = ap.shard_tensor(torch.randint(0, 8, (32,)), mesh, [Shard(0)])

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes: list[int] = []
    stack: list[Any] = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag != _EventType.Allocation or node.extra_fields.alloc_size <= 64:
            continue
        chain, p = [], node.parent
        while p is not None:
            chain.append(p.name)
            p = p.parent
        if any(c.startswith(REDUCE) for c in chain) and not any(c.startswith("c10d::") for c in chain):
            sizes.append(node.extra_fields.alloc_size)
    return sorted(sizes)


def test_zero3_reduction_makes_one_buffer_and_the_shard(world4):  # type: ignore[no-untyped-def]
    # one unit (the Sequential); per rank, chunks along dim 0: weights (256, 64) -> 64 rows,
    # (8, 256) -> 2 rows; biases 256 -> 64, 8 -> 2 elements
    width = 64 * 64 + 64 + 2 * 256 + 2
    for sizes in world4.run(_reduction_allocations):
        assert sizes == [4 * width, 4 * 4 * width], sizes  # the shard, the buffer: nothing else
