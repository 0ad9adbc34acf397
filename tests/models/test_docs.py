"""Docs that run: every ```python block of README.md and docs/*.md runs as written, or is
marked ```python fragment (an excerpt or one of several alternatives).

Per document, its runnable blocks run in order as one script (notebook style: a block may use
what an earlier block of the same document defined) — under ``torchrun`` with 4 ranks when the
code builds a ``ProcessMesh``, else in one process.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE = re.compile(r"^```python( fragment)?[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
DOCS = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))])


def blocks(path: str) -> list[tuple[bool, str]]:
    """(runs, code) for every python block of ``path``, in order."""
    with open(path) as f:
        return [(m.group(1) is None, m.group(2)) for m in FENCE.finditer(f.read())]


def _runnable() -> list[str]:
    return [p for p in DOCS if any(runs for runs, _ in blocks(p))]


def test_every_python_block_is_found() -> None:
    """The fence parser sees every python fence (a typo in a marker would hide a block)."""
    for path in DOCS:
        with open(path) as f:
            fences = len(re.findall(r"^```python", f.read(), re.MULTILINE))
        assert fences == len(blocks(path)), path


@pytest.mark.parametrize("path", _runnable(), ids=lambda p: os.path.relpath(p, ROOT))
def test_the_documents_python_runs(path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = "\n\n".join(code for runs, code in blocks(path) if runs)
    file = os.path.join(str(tmp_path), "doc.py")
    with open(file, "w") as f:
        f.write(script)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=ROOT, AUTOPARALLEL_TIMEOUT="60")
    if "ProcessMesh" in script:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", file]
    else:
        cmd = [sys.executable, file]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path), check=False)
    assert p.returncode == 0, f"{os.path.relpath(path, ROOT)}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
