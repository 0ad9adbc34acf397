"""No silent non-parallelism: a data-parallel axis that splits no batch warns once on rank 0;
parameters on meshes that leave ranks of the world out, or a model never laid out, warn once
(shard_optimizer; to_static names it too); a
rank outside every mesh raises a clear error where it reads a value; under torchrun the first
mesh starts the default process group (``dist.get_rank()`` works right after it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import torch
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard
from tests.world_harness import REPO_ROOT


def _dp_batch(rank: int, split: bool, how: str) -> list[str]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if how == "shard_layer":
        model = ap.shard_layer(model, mesh)
    else:
        model = ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            x = ap.shard_tensor(torch.ones(4, 4), mesh, [Shard(0) if split else Replicate(), Replicate()])
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen if "data parallelism" in str(w.message)]


def test_a_replicated_batch_on_the_data_parallel_axis_warns_once_on_rank_0(world4: Any) -> None:
    for how in ("shard_layer", "parallelize"):
        r0, *rest = world4.run(_dp_batch, False, how)
        assert len(r0) == 1 and not any(rest), (r0, rest)
        assert "'dp'" in r0[0] and "ap.shard_dataloader" in r0[0] and "every rank computes the whole batch" in r0[0]
        assert world4.run(_dp_batch, True, how) == [[]] * 4  # a split batch: nothing to say


def _idle(rank: int, ranks: list[list[int]]) -> list[str]:
    """Two stages' parameters on the meshes ``ranks``: rank 0 warns where they leave ranks out."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for layer, ids in zip(model, ranks):
        ap.shard_layer(layer, ap.ProcessMesh(ids, dim_names=["dp"]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return [str(w.message) for w in seen if "compute nothing" in str(w.message)]


def test_parameters_on_meshes_smaller_than_the_world_warn_once_on_rank_0(world4: Any) -> None:
    r0, *rest = world4.run(_idle, [[0, 1], [0, 1]])
    assert len(r0) == 1 and not any(rest), (r0, rest)
    assert "ranks [2, 3] of the world of 4" in r0[0] and "launch 2 processes" in r0[0], r0
    assert world4.run(_idle, [[0, 1], [2, 3]]) == [[]] * 4  # two stages covering the world: nothing to say


def _not_laid_out(rank: int) -> list[str]:
    """A model never laid out, on a world of 4: shard_optimizer and to_static say so (rank 0 for
    the first), where every rank would train its own copy."""
    model = nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ap.to_static(model, loss=lambda y, t: ((y - t) ** 2).mean(), optimizer=opt)(torch.ones(3, 4), torch.zeros(3, 2))
    return [str(w.message) for w in seen if "DistTensor" in str(w.message)]


def test_a_model_never_laid_out_warns(world4: Any) -> None:
    r0, *rest = world4.run(_not_laid_out)
    assert len(r0) == 2 and "each of the 4 ranks trains its own copy" in r0[0], r0
    assert "the model is not laid out" in r0[1], r0
    assert all(len(r) == 1 and "the model is not laid out" in r[0] for r in rest), rest


def _torch_module_habits(rank: int) -> bool:
    """``torch.inference_mode`` (composite ops such as ``linear`` reach the library undecomposed:
    decomposed, not run replicated), ``model.to(dtype)`` / ``.double()`` (the shards and layouts
    follow the wrapper's dtype) and ``p.data = full value`` on a tensor-parallel MLP, against one
    process."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8))
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "3": ap.RowWiseParallel()})
    x0 = torch.randn(4, 8)
    x = ap.shard_tensor(x0, mesh, [Replicate()])
    model.eval()
    ref.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op runs replicated
        with torch.inference_mode():
            y = model(x)
    torch.testing.assert_close(y.full_tensor(), ref(x0))
    model.double()
    ref.double()
    w = model[0].weight
    assert w.dtype == torch.float64 and w.to_local().dtype == torch.float64 and w.placements == (Shard(0),)
    torch.testing.assert_close(model(x.double()).full_tensor(), ref(x0.double()))
    with torch.no_grad():
        full = torch.arange(128.0, dtype=torch.float64).reshape(16, 8) / 100
        model[0].weight.data = full  # the global value, laid out as the weight is
        ref[0].weight.data = full.clone()
    assert model[0].weight.placements == (Shard(0),)
    torch.testing.assert_close(model(x.double()).full_tensor(), ref(x0.double()))
    try:
        model[0].weight.data = torch.zeros(3, 3, dtype=torch.float64)
    except ValueError as e:
        assert "global value (shape (16, 8))" in str(e)
    else:
        raise AssertionError("a plain value of another shape must raise")
    return True


def test_inference_mode_module_to_dtype_and_data_assignment(world4: Any) -> None:
    assert all(world4.run(_torch_module_habits))


def _outside(rank: int) -> str:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    x = ap.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    loss = (x * 2).sum()
    try:
        return f"value {loss.item()}"
    except ValueError as e:
        return str(e)


def test_a_rank_outside_the_mesh_that_reads_a_value_gets_a_clear_error(world4: Any) -> None:
    out = world4.run(_outside)
    assert out[:2] == ["value 56.0", "value 56.0"]
    for r in (2, 3):
        assert f"rank {r} is outside ProcessMesh([0, 1]" in out[r] and "--nproc-per-node 2" in out[r], out[r]


_SCRIPT = """
import torch, torch.distributed as dist, autoparallel as ap
assert not dist.is_initialized()
mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)                     # a user collective right after the first mesh
sampler = torch.utils.data.DistributedSampler(range(8))
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {float(t)}, {len(list(sampler))} samples")
"""


def test_the_first_mesh_starts_the_default_process_group_under_torchrun(tmp_path: Any) -> None:
    script = tmp_path / "first_mesh.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2: sum 3.0, 4 samples" in done.stdout and "rank 1 of 2: sum 3.0, 4 samples" in done.stdout


def _slice_is_its_own(rank: int) -> list[float]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["cp"])
    x = ap.shard_tensor(torch.zeros(2, 4, 3), mesh, [Replicate()])
    y = ap.reshard(x, mesh, [Shard(1)])  # a slice of what every rank holds
    y.add_(1)
    return [float(x.to_local().abs().sum()), float(y.to_local().sum())]


def test_a_reshard_to_shards_does_not_write_through_to_its_source(world2: Any) -> None:
    """``ap.reshard`` from Replicate to Shard takes this rank's piece: a new tensor, as torch's
    DTensor makes it, so an in-place op on it leaves the replicated source whole (it used to be a
    view of it: the source's piece changed on each rank, no longer replicated)."""
    for source, written in world2.run(_slice_is_its_own):
        assert source == 0.0 and written == 12.0, (source, written)


def _plain_norms(rank: int) -> list[str]:
    """Plain norm layers (their weight and bias reach the op as keywords: ``F.layer_norm(x,
    shape, weight=..., bias=...)``) on a row-sharded input: laid out as Replicate in place, as a
    positional plain parameter is, and equal to one process, gradients included."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    x0 = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    bad = []
    for make in (lambda: nn.LayerNorm(6), lambda: nn.GroupNorm(2, 6), lambda: nn.RMSNorm(6)):
        torch.manual_seed(0)
        mod, ref = make(), make()
        ref.load_state_dict(mod.state_dict())
        with torch.no_grad():
            for p, q in zip(mod.parameters(), ref.parameters()):
                p.uniform_(0.5, 1.5)
                q.copy_(p)
        x = ap.shard_tensor(x0, mesh, [Shard(0)])
        (mod(x) ** 2).sum().backward()
        (ref(x0) ** 2).sum().backward()
        for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
            if not isinstance(p, ap.DistTensor) or not torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5):
                bad.append(f"{type(mod).__name__}.{name}")
    return bad


def test_plain_parameters_given_as_keywords_are_laid_out(world4: Any) -> None:
    assert world4.run(_plain_norms) == [[]] * 4


def _whole_reads(rank: int) -> bool:
    """``y.backward(plain full gradient)`` leaves DistTensor gradients in the leaf's layout;
    ``tolist()`` and ``numpy()`` read the whole value, as ``item()`` does."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    x = torch.arange(24.0).reshape(4, 6)
    xd = ap.shard_tensor(x, mesh, [Shard(0)]).detach().requires_grad_(True)
    (xd * 3).backward(torch.ones(4, 6))
    (xd * 1).sum().backward()
    assert isinstance(xd.grad, ap.DistTensor) and xd.grad.placements == (Shard(0),)
    assert xd.grad.tolist() == [[4.0] * 6] * 4
    assert (xd.detach().numpy() == x.numpy()).all() and xd[1:3].tolist() == x[1:3].tolist()
    try:
        xd.numpy()
    except RuntimeError as e:
        assert "requires grad" in str(e)
    else:
        raise AssertionError("numpy() of a tensor that requires grad must raise, as torch's does")
    return True


def test_plain_backward_gradient_and_whole_value_reads(world4: Any) -> None:
    assert all(world4.run(_whole_reads))
