"""One clear message per user error under torchrun (``autoparallel/runtime/errors.py``).

A script whose every rank raises the same ValueError from the library (a mesh larger than the
world) prints the message once, without tracebacks, and every rank exits non-zero; with
``AUTOPARALLEL_DEBUG=1`` each rank's traceback is back. An error only one rank raises is still
printed by that rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import sys
import autoparallel as ap
if sys.argv[1] == "all":
    ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])   # 4 ranks in a world of 2: every rank raises
elif ap.get_rank() == 1:
    raise TypeError("only rank 1 sees this")
"""


def _run(tmp_path: object, which: str, debug: bool = False) -> tuple[int, str]:
    path = os.path.join(str(tmp_path), "script.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AUTOPARALLEL_DEBUG")}
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=ROOT)
    if debug:
        env["AUTOPARALLEL_DEBUG"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", path, which]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    return p.returncode, p.stdout + p.stderr


def test_an_error_every_rank_raises_is_printed_once_without_tracebacks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, out = _run(tmp_path, "all")
    assert code != 0
    lines = [ln for ln in out.splitlines() if "autoparallel: rank" in ln]
    assert len(lines) == 1 and "ValueError" in lines[0] and "rank 0" in lines[0], out
    assert "script.py" not in out.split("ChildFailedError")[0], out  # no per-rank traceback
    assert "exitcode  : 0" not in out  # no rank exits cleanly


def test_debug_restores_every_ranks_traceback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, out = _run(tmp_path, "all", debug=True)
    assert code != 0
    assert out.count("Traceback (most recent call last)") >= 2 and "autoparallel: rank" not in out, out


def test_an_error_one_rank_raises_is_printed_by_that_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, out = _run(tmp_path, "one")
    assert code != 0
    lines = [ln for ln in out.splitlines() if "autoparallel: rank" in ln]
    assert len(lines) == 1 and "rank 1" in lines[0] and "only rank 1 sees this" in lines[0], out
