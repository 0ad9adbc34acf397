"""Docs that run: every ```python block of README.md and docs/*.md runs as written, or is
marked ```python fragment (an excerpt or one of several alternatives).

Per document, its runnable blocks run in order as one script (notebook style: a block may use
what an earlier block of the same document defined). Documents whose code builds a
``ProcessMesh`` run under one ``torchrun`` launch with 4 ranks, one after the other, each in a
fresh namespace (a launch costs ~10 s of start-up here, so they share it); the others run in one
process each.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^```python( fragment)?[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
DOCS = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))])

# Runs each document's script in order on every rank; writes {document: traceback or None} per rank.
_RUNNER = """
import json, os, sys, traceback
import torch.distributed as dist
done = {}
for name, path in json.load(open(sys.argv[1])):
    os.makedirs(path + ".d", exist_ok=True)
    os.chdir(path + ".d")  # each document in a folder of its own (files it writes stay apart)
    try:
        with open(path) as f:
            exec(compile(f.read(), name, "exec"), {"__name__": "__main__"})
        done[name] = None
    except BaseException:
        done[name] = traceback.format_exc()[-4000:]
    if dist.is_initialized():
        dist.barrier()
with open(os.path.join(sys.argv[2], "rank%s.json" % os.environ.get("RANK", "0")), "w") as f:
    json.dump(done, f)
"""


def blocks(path: str) -> list[tuple[bool, str]]:
    """(runs, code) for every python block of ``path``, in order."""
    with open(path) as f:
        return [(m.group(1) is None, m.group(2)) for m in FENCE.finditer(f.read())]


def _script(path: str) -> str:
    return "\n\n".join(code for runs, code in blocks(path) if runs)


def _runnable() -> list[str]:
    return [p for p in DOCS if any(runs for runs, _ in blocks(p))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=ROOT, AUTOPARALLEL_TIMEOUT="60")
    return env


@pytest.fixture(scope="module")
def mesh_docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 4-rank launch running every document that builds a ProcessMesh: per document, each
    rank's traceback (None: it ran), or the launch's output when a rank wrote nothing."""
    tmp = str(tmp_path_factory.mktemp("docs"))
    docs = []
    for path in _runnable():
        script = _script(path)
        if "ProcessMesh" in script:
            name = os.path.relpath(path, ROOT)
            file = os.path.join(tmp, name.replace(os.sep, "_") + ".py")
            with open(file, "w") as f:
                f.write(script)
            docs.append((name, file))
    with open(os.path.join(tmp, "docs.json"), "w") as f:
        json.dump(docs, f)
    runner = os.path.join(tmp, "runner.py")
    with open(runner, "w") as f:
        f.write(_RUNNER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           runner, os.path.join(tmp, "docs.json"), tmp]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp, check=False)
    ranks = []
    for r in range(4):
        out = os.path.join(tmp, f"rank{r}.json")
        if os.path.exists(out):
            with open(out) as f:
                ranks.append(json.load(f))
    return {"ranks": ranks, "log": f"rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"}


def test_every_python_block_is_found() -> None:
    """The fence parser sees every python fence (a typo in a marker would hide a block)."""
    for path in DOCS:
        with open(path) as f:
            fences = len(re.findall(r"^```python", f.read(), re.MULTILINE))
        assert fences == len(blocks(path)), path


@pytest.mark.parametrize("path", _runnable(), ids=lambda p: os.path.relpath(p, ROOT))
def test_the_documents_python_runs(path: str, tmp_path, request) -> None:  # type: ignore[no-untyped-def]
    name = os.path.relpath(path, ROOT)
    script = _script(path)
    if "ProcessMesh" in script:
        got = request.getfixturevalue("mesh_docs")
        assert len(got["ranks"]) == 4, f"{name}: a rank wrote no results\n{got['log']}"
        failed = {r: ranks[name] for r, ranks in enumerate(got["ranks"]) if ranks.get(name, "(not run)") is not None}
        assert not failed, f"{name}:\n" + "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
        return
    file = os.path.join(str(tmp_path), "doc.py")
    with open(file, "w") as f:
        f.write(script)
    p = subprocess.run([sys.executable, file], capture_output=True, text=True, env=_env(), timeout=300,
                       cwd=str(tmp_path), check=False)
    assert p.returncode == 0, f"{name}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
