"""No reference cycles from the library on the training path (2 ranks).

A closure that calls itself is a reference cycle: the function, its cell, and whatever else the
closure captured (DistTensors, a state dict) stay alive until Python's next *full* garbage
collection, and every such cycle made per step counts toward triggering one (a full collection
costs ~100-200 ms in a process that imported torch). Training steps — warm ones and first steps
at new sequence lengths, data and tensor parallel — and checkpoint flattening must leave no
cyclic garbage of ours: no function of autoparallel / spmd_rules / reshard, and no tensor.
torch's own helpers (``torch.utils._pytree``) may make some; they are not ours to fix.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import autoparallel as ap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

OURS = ("autoparallel", "spmd_rules", "reshard")


def _cyclic_garbage(run: Callable[[], Any]) -> list[str]:
    """What ``run()`` left as cyclic garbage that is ours (functions of our packages, tensors)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        found = []
        for o in gc.garbage:
            module = getattr(o, "__module__", None) or ""
            if callable(o) and type(o).__name__ == "function" and module.startswith(OURS):
                found.append(f"function {module}.{o.__qualname__}")
            elif isinstance(o, torch.Tensor):
                found.append(f"{type(o).__name__} {tuple(o.shape)}")
        return found
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


def _train(rank: int, layout: str) -> dict[str, list[str]]:
    import train_gpt
    from gpt_model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=96, seq=64, layers=1, width=32, heads=2))
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    if layout == "DP":
        ap.shard_layer(model, mesh)
        place: list[Any] = [ap.Shard(0)]
    else:
        train_gpt.parallelize_gpt(model, mesh, sp=False)
        place = [ap.Replicate()]
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))

    def step(t: int) -> None:
        x = torch.randint(0, 96, (4, t), generator=torch.Generator().manual_seed(t))
        loss = lm_loss(model(ap.shard_tensor(x, mesh, place)), ap.shard_tensor(x, mesh, place))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        train_gpt.scalar(loss)

    for t in (6, 8, 10, 12):  # proofs, families, stored choices
        step(t)
        step(t)
    return {"warm": _cyclic_garbage(lambda: [step(12) for _ in range(2)]),
            "new lengths": _cyclic_garbage(lambda: [step(t) for t in (14, 18, 22)])}


def test_training_steps_leave_no_cycles_of_ours(world2: Any) -> None:
    for layout in ("DP", "TP"):
        for found in world2.run(_train, layout):
            assert found == {"warm": [], "new lengths": []}, (layout, found)


def _static(rank: int) -> list[str]:
    """A captured step (``ap.to_static``), data parallel with a column/row-parallel pair: its
    replays leave no cycles either."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    model[0].weight = ap.shard_tensor(model[0].weight, mesh, [ap.Shard(0)])
    model[0].bias = ap.shard_tensor(model[0].bias, mesh, [ap.Shard(0)])
    model[2].weight = ap.shard_tensor(model[2].weight, mesh, [ap.Shard(1)])
    model[2].bias = ap.shard_tensor(model[2].bias, mesh, [ap.Replicate()])
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step = ap.to_static(model, loss=F.cross_entropy, optimizer=opt)
    x = ap.shard_tensor(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), mesh, [ap.Replicate()])
    y = ap.shard_tensor(torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(2)), mesh, [ap.Replicate()])
    for _ in range(3):  # warm, capture, replay
        step(x, y)
    return _cyclic_garbage(lambda: [step(x, y) for _ in range(2)])


def test_static_replays_leave_no_cycles_of_ours(world2: Any) -> None:
    assert world2.run(_static) == [[], []]


def test_checkpoint_flattening_leaves_no_cycles() -> None:
    from autoparallel.checkpoint.flat import flatten, replace_values

    state = {"model": {"w": torch.ones(3), "blocks": [torch.zeros(2), (torch.ones(1), 4)]}, "step": 3}

    def run() -> None:
        flat = flatten(state, "save")
        assert set(flat) == {"model.w", "model.blocks.0", "model.blocks.1.0", "model.blocks.1.1", "step"}
        replace_values(state, lambda key, leaf: leaf)

    assert _cyclic_garbage(run) == []
