"""ProcessMesh in a live world: sub-meshes, process groups made alike on every rank, world-of-one, torchrun start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import autoparallel as ap
from autoparallel import Replicate, Shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sub_meshes(rank: int) -> dict:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return {
        "dp": mesh["dp"].process_ids,
        "mp": mesh["mp"].process_ids,
        "pp1": mesh.get_mesh_with_dim("dp", 1).process_ids,
        "moved": mesh.get_mesh_with_dim("mp").dim_names,
    }


def test_sub_meshes_follow_the_rank(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_sub_meshes)
    assert [r["dp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["mp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["pp1"] == [2, 3] and r["moved"] == ["mp", "dp"] for r in res)


def _groups_at_entry(rank: int) -> dict:
    from autoparallel.runtime import groups

    before = groups.created()
    mesh = ap.ProcessMesh([[0, 3], [1, 2]], dim_names=["x", "y"])
    pair = ap.ProcessMesh([0, 3])
    sub = mesh["y"]  # the line through this rank: differs per rank
    built = groups.created()
    ap.shard_tensor(torch.ones(4), sub, [Shard(0)])  # every rank enters its own sub-mesh...
    ap.shard_tensor(torch.ones(4), pair, [Shard(0)])  # ... and a mesh of two ranks only
    return {"at_construction": built[len(before):], "before": before, "new": groups.created()[len(before):]}


def test_meshes_are_values_and_groups_are_created_alike_on_every_rank(world4):  # type: ignore[no-untyped-def]
    """Building a mesh creates no group; entering one creates every line of it (of the mesh a
    per-rank sub-mesh came from) on every rank in the same order, members or not."""
    res = world4.run(_groups_at_entry)
    assert all(r["at_construction"] == [] for r in res)
    assert all(r["new"] == res[0]["new"] and r["before"] == res[0]["before"] for r in res)
    made = set(res[0]["before"]) | set(res[0]["new"])
    assert {(0, 3), (1, 2), (0, 1), (2, 3)} <= made


def _mesh_with_permuted_ranks(rank: int) -> bool:
    mesh = ap.ProcessMesh([[3, 1], [2, 0]])  # group ranks are sorted; coordinates are not
    full = torch.arange(24.0).reshape(4, 6)
    x = ap.shard_tensor(full, mesh, [Shard(0), Shard(1)])
    y = ap.reshard(x, mesh, [Shard(1), Replicate()])
    return bool(torch.equal(y.full_tensor(), full) and torch.equal(x.full_tensor(), full))


def test_mesh_with_permuted_ranks(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_mesh_with_permuted_ranks))


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_plain_python_is_a_world_of_one() -> None:
    code = (
        "import torch, autoparallel as ap\n"
        "m = ap.ProcessMesh([0])\n"
        "x = ap.shard_tensor(torch.arange(6.0), m, [ap.Shard(0)])\n"
        "assert ap.get_world_size() == 1 and torch.equal((x * 2).full_tensor(), torch.arange(6.0) * 2)\n"
        "try:\n"
        "    ap.shard_tensor(torch.ones(2), ap.ProcessMesh([0, 1]), [ap.Shard(0)])\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "world of size 1" in out.stdout


@pytest.mark.models  # the example under torchrun
def test_main_job_runs_under_torchrun() -> None:
    """The README's main job (examples/train_gpt.py: dp=2 x tp=2 + SP) in a small size, its own check on."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    small = ["--steps", "3", "--batch", "8", "--seq", "16", "--layers", "1", "--width", "32", "--heads", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         os.path.join(ROOT, "examples", "train_gpt.py"), *small],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "mesh dp=2 x mp=2, sequence parallel on" in out.stdout
    assert "loss: max rel. diff" in out.stdout and "over 3 steps (rtol 1e-05): PASS" in out.stdout, out.stdout
    assert "(rtol 1e-05): PASS" in out.stdout.split("parameters:")[1], out.stdout
    assert "3/3" in out.stderr  # the progress bar (rank 0, stderr; tqdm's or the plain one)


LIFECYCLE = r"""
import sys, torch, torch.distributed as dist
import autoparallel as ap
from autoparallel.runtime import groups
mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])  # two of the three ranks: one group, made by all three
x = ap.shard_tensor(torch.arange(8.0).reshape(4, 2), mesh, [ap.Shard(0)])
y = (x * 2).full_tensor()
assert ap.get_rank() == 2 or torch.equal(y, torch.arange(8.0).reshape(4, 2) * 2)
made = groups.created()
assert made == [(0, 1)], made
if sys.argv[1] == "release":  # what interpreter exit does (atexit): our groups, then the world we made
    groups.release()
    assert not dist.is_initialized(), "the world the library initialised is destroyed"
    assert groups.created() == []
    # the groups are freed, not only unregistered: gloo's worker threads are joined now, so none
    # can release a collective's tensors while the interpreter finalises (that aborted at exit)
    if sys.platform == "linux":
        import os
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        assert not [n for n in names if "gloo" in n], names
print("OK", made)
"""


@pytest.mark.parametrize("how", ["exit", "release"])
def test_the_library_owns_its_groups_until_exit(tmp_path, how: str) -> None:  # type: ignore[no-untyped-def]
    """A script using only the public API exits 0: the groups the runtime created and the world
    it initialised from torchrun's environment are destroyed at exit, in order (``.ci/exits``
    repeats such runs 20 times: an exit that fails now and then shows there)."""
    script = tmp_path / "lifecycle.py"
    script.write_text(LIFECYCLE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script), how],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("OK") == 3, out.stdout
