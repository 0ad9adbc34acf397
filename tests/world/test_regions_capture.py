"""Local regions as captured programs (``AUTOPARALLEL_LOCAL_REGIONS=capture``, ``regions.program``).

The example GPT (dropout on) on 4 gloo ranks: a region is the module's forward and backward captured
once per signature on fake tensors and run as one autograd node, collectives included, so under
every layout the whole model is one region. Two SGD steps train bitwise as op by op
(``AUTOPARALLEL_LOCAL_REGIONS=0``) under DP, TP, TP + SP, DP x TP and ZeRO-3, with and without
``torch.utils.checkpoint`` around each block (non-reentrant: bitwise; reentrant: within rounding),
and every call of a signature — the first, later ones and a checkpoint's recomputation — runs the
same program. New sequence lengths: the second length of a signature is captured with its sizes
open, and that program serves the lengths after it (two captures for five lengths), equal to op
by op.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.world.test_torch_checkpoint import MESHES, _bitwise, _close, _gpt


def _with(mode: str, fn: Any, *args: Any) -> Any:
    old = os.environ.get("AUTOPARALLEL_LOCAL_REGIONS")
    os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = mode
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["AUTOPARALLEL_LOCAL_REGIONS"]
        else:
            os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = old


def _run(rank: int, mode: str, layout: str, how: str) -> dict[str, Any]:
    return _with(mode, _gpt, rank, layout, how)


@pytest.mark.parametrize("layout", list(MESHES))
def test_captured_regions_train_bitwise_as_op_by_op(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_run, "0", layout, "none")
    got = world4.run(_run, "capture", layout, "none")
    for r in range(4):
        _bitwise(base[r], got[r], f"{layout} captured rank {r}")
    got = world4.run(_run, "capture", layout, "nonreentrant")
    for r in range(4):
        _bitwise(base[r], got[r], f"{layout} captured, checkpointed blocks, rank {r}")
    if layout in ("tp", "dp_tp"):
        got = world4.run(_run, "capture", layout, "reentrant")
        for r in range(4):
            _close(base[r], got[r], f"{layout} captured, reentrant checkpoint, rank {r}")


def _report(rank: int, layout: str) -> dict[str, Any]:
    import autoparallel as ap
    from tests.world.test_torch_checkpoint import CFG, GPT, lm_loss

    def run() -> dict[str, Any]:
        import train_gpt

        torch.manual_seed(0)
        model = GPT(CFG)
        dp, tp = MESHES[layout]
        mesh = ap.ProcessMesh(torch.arange(4).reshape(dp, tp).tolist(), dim_names=["dp", "mp"])
        ap.parallelize(model, mesh, {} if layout == "dp" else train_gpt.gpt_plan(layout == "tp_sp"))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = (torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g) for _ in range(2))
            with ap.CommDebugMode() as comm:
                loss = lm_loss(model(ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])),
                               ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()]))
                loss.backward()
            model.zero_grad(set_to_none=True)
        return {"report": ap.local_regions_report(model), "comms": comm.get_comm_counts()}

    return _with("capture", run)


@pytest.mark.parametrize("layout", ["dp", "tp", "dp_tp"])
def test_the_whole_model_is_one_region_collectives_included(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    for got in world4.run(_report, layout):
        assert got["report"] == {"<root>": ["local"]}, got["report"]
        if layout == "dp":  # the gradients' reduction is the optimizer's: a step of the model alone issues
            assert set(got["comms"]) <= {"all_reduce"}, got["comms"]  # the loss's mean count only
        else:
            assert got["comms"].get("all_reduce", 0) > 0, got["comms"]


def _lengths(rank: int, mode: str) -> dict[str, Any]:
    import autoparallel as ap
    from tests.world.test_torch_checkpoint import CFG, GPT, lm_loss

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        model = GPT(CFG)
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.parallelize(model, mesh, {})
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(7)
        g = torch.Generator().manual_seed(1)
        losses = []
        for seq in (8, 6, 4, 7, 5, 8):
            x, y = (torch.randint(0, CFG.vocab, (8, seq), generator=g) for _ in range(2))
            loss = lm_loss(model(ap.shard_tensor(x, mesh, [ap.Shard(0)])), ap.shard_tensor(y, mesh, [ap.Shard(0)]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.full_tensor().item())
        region = model.__dict__.get("_ap_region")
        return {"losses": losses, "captures": None if region is None else region.calls.captures}

    return _with(mode, run)


def test_new_lengths_are_served_by_a_program_of_open_sizes(world4) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_lengths, "0")
    got = world4.run(_lengths, "capture")
    for r in range(4):
        torch.testing.assert_close(got[r]["losses"], base[r]["losses"], rtol=1e-5, atol=0)
        assert got[r]["captures"] == 2, got[r]["captures"]  # lengths 8 and 6; 4, 7, 5 by the open program
