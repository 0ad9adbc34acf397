"""examples/train_gpt.py --resume: a rank dies mid-training, the job restarts, the loss curve is unchanged.

Tiny GPT, 2 ranks under ``torchrun --standalone`` (dp=2 x tp=1), 6 steps, AdamW:

(a) an uninterrupted run writes its per-step losses (``--losses-out``);
(b) a run saving every 2 steps (``--ckpt --save-every 2``) loses rank 1 after step 3
    (``--die-at-step 3 --die-rank 1``: ``os._exit``): rank 0 fails with a "lost contact" error
    naming the timeout and the checkpoint to resume from, within ``AUTOPARALLEL_TIMEOUT``, and
    the job exits non-zero; the step-2 checkpoint is intact;
(c) ``--resume`` on the same layout recomputes steps 3..6: its losses equal (a) BITWISE (same
    sums in the same order, RNG and data position restored);
(d) ``--resume`` from the same step-2 checkpoint on another layout of the same world size
    (dp=1 x tp=2 + SP): steps 1-2 are the saved losses, steps 3..6 agree with (a) to rtol 1e-5.

(a) runs beside (b), and (c) beside (d), to keep the wall time down.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TIMEOUT_S = 5
STEPS = 6
TINY = ["--steps", str(STEPS), "--batch", "4", "--seq", "16", "--layers", "1", "--width", "32", "--heads", "2",
        "--no-check", "--no-progress"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", AUTOPARALLEL_TIMEOUT=str(TIMEOUT_S), TORCH_CPP_LOG_LEVEL="ERROR")
    return env


def _start(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *TINY, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _finish(p: subprocess.Popen, limit: float = 240) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"torchrun did not finish in {limit}s (a hang):\n{out[-2000:]}\n{err[-3000:]}")
    return p.returncode, out, err


def _losses(path: Any) -> list[float]:
    with open(path) as f:
        return [float(v) for v in json.load(f)]


def test_killed_rank_fails_the_others_and_resume_reproduces_the_loss_curve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt, straight = tmp_path / "ckpt", tmp_path / "straight.json"
    a = _start("--dp", "2", "--tp", "1", "--losses-out", str(straight))
    t0 = time.monotonic()
    b = _start("--dp", "2", "--tp", "1", "--ckpt", str(ckpt), "--save-every", "2",
               "--die-at-step", "3", "--die-rank", "1")
    rc, out, err = _finish(b)
    elapsed_b = time.monotonic() - t0
    rc_a, out_a, err_a = _finish(a)
    assert rc_a == 0, out_a[-2000:] + err_a[-3000:]
    expected = _losses(straight)
    assert len(expected) == STEPS

    # (b) rank 1 died after step 3; rank 0 noticed in its next collective, within the timeout, and said what to do
    assert rc != 0, out[-2000:] + err[-3000:]
    assert "rank 1: simulated fault (--die-at-step 3): exiting abruptly" in out, out[-2000:] + err[-3000:]
    # step 4 (or step 3, if rank 1's last message of step 3 was lost with it)
    m = re.search(r"rank 0: step [34] failed after ([0-9.]+)s: lost contact with the other ranks \(a rank died or "
                  rf"hung; collective timeout AUTOPARALLEL_TIMEOUT={TIMEOUT_S}s\)", err)
    assert m, err[-4000:]
    assert float(m.group(1)) < TIMEOUT_S + 10, m.group(0)
    assert f"the last checkpoint in {ckpt} is from step 2; restart the job with --resume" in err, err[-4000:]
    assert elapsed_b < 200, f"the faulty run took {elapsed_b:.0f}s"  # start-up + 3 steps + at most the timeout
    other = tmp_path / "ckpt-other-layout"
    shutil.copytree(ckpt, other)  # (c) overwrites ckpt with its own saves

    # (c) same layout: bitwise; (d) dp=1 x tp=2 + SP from the same checkpoint: rtol 1e-5
    resumed, moved = tmp_path / "resumed.json", tmp_path / "moved.json"
    c = _start("--dp", "2", "--tp", "1", "--ckpt", str(ckpt), "--save-every", "2", "--resume",
               "--losses-out", str(resumed))
    d = _start("--dp", "1", "--tp", "2", "--ckpt", str(other), "--resume", "--losses-out", str(moved))
    for p, name in ((c, "same layout"), (d, "dp=1 x tp=2")):
        rc, out, err = _finish(p)
        assert rc == 0, f"{name}:\n{out[-2000:]}\n{err[-3000:]}"
        assert f"resumed from the checkpoint in {ckpt if p is c else other} at step 2" in out, out
    assert _losses(resumed) == expected  # exact float equality, every step
    got = _losses(moved)
    assert got[:2] == expected[:2]       # the saved losses, as saved
    assert got[2:] == pytest.approx(expected[2:], rel=1e-5, abs=0)


@pytest.mark.parametrize("argv,message", [
    (["--resume"], "--resume needs --ckpt DIR"),
    (["--ckpt", "c", "--save-every", "-1"], "--save-every -1 must be >= 0"),
    (["--die-at-step", "40"], "--die-at-step 40 --die-rank 0: need 1 <= K < --steps 40"),
    (["--die-at-step", "2", "--die-rank", "4"], "and 0 <= R < world size 4"),
])
def test_bad_resume_or_fault_flags_are_refused_before_any_collective(argv: list[str], message: str) -> None:
    """The new flags are checked on metadata only, like the rest of the configuration."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt

    with pytest.raises(ValueError, match=re.escape(message)):
        train_gpt.check_config(train_gpt.parse_args(argv), 4, vocab=80)
