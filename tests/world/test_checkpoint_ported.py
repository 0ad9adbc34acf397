"""Checkpoint cases ported in spirit from torch.distributed.checkpoint's tests (resharding, the
save/load API, optimizer state, file-system checkpoints) and Paddle's auto-parallel save/load
tests, in a 2-rank gloo world: each one is a way a user's checkpoint went wrong.
"""

from __future__ import annotations

import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard

R = Replicate()


def _dp_model(stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, ap.ProcessMesh]:
    """A replicated MLP whose first bias is frozen, AdamW under ZeRO ``stage`` over dp = both ranks."""
    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], ["dp"])
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    for lin in (m[0], m[2]):
        assert isinstance(lin, torch.nn.Linear)
        lin.weight = torch.nn.Parameter(ap.shard_tensor(lin.weight.detach(), mesh, [R]))
        lin.bias = torch.nn.Parameter(ap.shard_tensor(lin.bias.detach(), mesh, [R]))
    m[0].bias.requires_grad_(False)
    stages = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}
    opt = ap.shard_optimizer(torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1), stages[stage](mesh))
    return m, opt, mesh


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, mesh: ap.ProcessMesh, start: int, steps: int) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(s))
        loss = m(ap.shard_tensor(x, mesh, [Shard(0)])).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.full_tensor().item())
    return losses


def _resume_with_frozen_param(rank: int, folder: str, stage: int) -> tuple[list, list, list, list]:
    """Train 2 steps, save, train 2 more; a fresh model and optimizer resume from the save."""
    m, opt, mesh = _dp_model(stage)
    _train(m, opt, mesh, 0, 2)
    saved_keys = sorted(opt.state_dict()["state"])
    ap.save_state_dict({"model": m.state_dict(), "optim": opt.state_dict()}, folder)
    straight = _train(m, opt, mesh, 2, 2)
    m2, opt2, _ = _dp_model(stage)
    ap.checkpoint.init_optimizer_state(opt2)
    target_keys = sorted(opt2.state_dict()["state"])
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    ap.load_state_dict(sd, folder)  # strict: the frozen bias has no state in either
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    return saved_keys, target_keys, straight, _train(m2, opt2, mesh, 2, 2)


def test_init_optimizer_state_gives_frozen_params_no_state_under_zero(world2, tmp_path):  # type: ignore[no-untyped-def]
    """ZeRO-1/2 step shards that never require grad: a frozen parameter's shard got Adam state
    from ``init_optimizer_state``, which a trained optimizer never has, so the strict load of a
    resumed run failed with "3 key(s) of the target ... are not in the checkpoint"."""
    for stage in (1, 3):
        saved, target, straight, resumed = world2.run(_resume_with_frozen_param, str(tmp_path / str(stage)), stage)[0]
        assert saved == target == [0, 2, 3], (stage, saved, target)
        assert resumed == straight, (stage, straight, resumed)


def _in_rank_order(rank: int, folder: str) -> dict[str, bool]:
    """Rank 1 builds its state dict in the other key order (as from a set of names)."""
    mesh = ap.ProcessMesh([0, 1], ["x"])
    values = {"a": torch.arange(6.0).reshape(2, 3), "b": 100 + torch.arange(6.0).reshape(2, 3)}
    keys = ["a", "b"] if rank == 0 else ["b", "a"]
    # Partial(sum) summands: rank 0 holds the value, rank 1 zeros (reduced before saving)
    sd = {k: ap.dtensor_from_local(values[k].clone() if rank == 0 else torch.zeros(2, 3), mesh, [Partial()])
          for k in keys}
    ap.save_state_dict(sd, folder + "/ckpt")
    target = {k: torch.zeros(2, 3) for k in "ab"}
    ap.load_state_dict(target, folder + "/ckpt")
    out = {f"load {k}": torch.equal(target[k], values[k]) for k in "ab"}
    ap.checkpoint.export_state_dict({k: ap.shard_tensor(values[k], mesh, [Shard(0)]) for k in keys},
                                    folder + "/model.pt")
    exported = torch.load(folder + "/model.pt", weights_only=True)
    out.update({f"export {k}": torch.equal(exported[k], values[k]) for k in "ab"})
    return out


def test_state_dicts_in_another_key_order_per_rank(world2, tmp_path):  # type: ignore[no-untyped-def]
    """Reducing a Partial (save) and gathering a DistTensor (export) are collectives: they ran in
    each rank's own dict order, so 'b' on rank 0 was reduced with 'a' on rank 1 and saved wrong."""
    for got in world2.run(_in_rank_order, str(tmp_path)):
        assert all(got.values()), got


def _load_into_unwritable(rank: int, folder: str) -> str:
    """Rank 0 holds a target it cannot write (an inference tensor, on a mesh of rank 0 only, that
    needs a cast); rank 1 holds nothing of it. Both must raise the same error, not hang."""
    ap.save_state_dict({"w": torch.arange(3.0, dtype=torch.float64)}, folder)
    with torch.inference_mode():
        w = ap.shard_tensor(torch.zeros(3), ap.ProcessMesh([0], ["x"]), [R])
    try:
        ap.load_state_dict({"w": w}, folder)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_a_target_one_rank_cannot_write_fails_every_rank(world2, tmp_path):  # type: ignore[no-untyped-def]
    """Only checksum errors were exchanged after reading: rank 0's RuntimeError left rank 1
    waiting in the exchange until the collective timeout ("lost contact")."""
    for msg in world2.run(_load_into_unwritable, str(tmp_path), timeout=30):
        assert "[rank(s) [0]] cannot write the values of 'w' into the target: RuntimeError" in msg, msg


@pytest.mark.pure  # single process, no world
def test_conjugate_views_save_and_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A lazily conjugated view (``z.conj()``) has no byte view: its save failed on the writing
    rank ("torch.Tensor.view is not supported for conjugate view tensors"), and so did a load into one."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ap.save_state_dict({"c": z.conj(), "z": z}, str(tmp_path))
    base = torch.zeros(2, dtype=torch.complex64)
    target = {"c": torch.zeros(2, dtype=torch.complex64), "z": base.conj()}
    ap.load_state_dict(target, str(tmp_path))
    assert torch.equal(target["c"], z.conj()) and torch.equal(target["z"], z)


def _unsupported_value(rank: int, folder: str) -> list[str]:
    class Thing:
        pass

    out = []
    for call in (ap.save_state_dict, ap.load_state_dict):
        try:
            call({"x": Thing()}, folder)
        except TypeError as e:  # a TypeError stays one, on every rank, named once
            out.append(str(e))
    return out


def test_an_unsupported_value_raises_the_same_type_error_on_every_rank(world2, tmp_path):  # type: ignore[no-untyped-def]
    for msgs in world2.run(_unsupported_value, str(tmp_path)):
        assert len(msgs) == 2, msgs
        for m, name in zip(msgs, ("save_state_dict", "load_state_dict")):
            assert m.startswith(f"{name}: 'x' is a Thing") and m.count(name) == 1, m
