"""examples/simplenet.py: every strategy equals the single-process run; its entry point works.

In-process (4 gloo ranks, one world): ``simplenet.run`` for dp, zero1/2/3, tp and dp_tp, a few
steps on a narrow SimpleNet; the ZeRO-3 parameter + optimizer-state bytes per rank stay within
1/N of the replicated figure + 5%; ``main()`` (what torchrun runs) prints and exits 0.
"""

from __future__ import annotations

import sys

import pytest

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "dp_tp")


def _run(rank: int, strategy: str) -> dict[str, object]:
    from examples import simplenet

    res = simplenet.run(strategy, steps=3, inner=64, batch=8)
    return {"ok": res.ok, "worst": res.worst_loss, "param": res.worst_param, "comms": res.comms,
            "bytes": res.bytes_per_rank, "replicated": res.replicated_bytes}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_one_process(world4, strategy: str) -> None:  # type: ignore[no-untyped-def]
    res = world4.run(_run, strategy, timeout=300)[0]
    assert res["ok"], res
    comms = res["comms"]
    if strategy == "zero2":
        assert all(c.get("reduce_scatter") == 1 and c.get("all_gather") == 1 for c in comms), comms
    if strategy == "zero3":
        # SimpleNet is one ZeRO-3 unit (no block list), the model's own: one gather of all its
        # parameters in forward, kept for its backward (which would gather them again at once),
        # one reduce-scatter of the gradients
        assert all(c.get("all_gather") == 1 and c.get("reduce_scatter") == 1 for c in comms), comms
        assert max(res["bytes"]) <= 1.05 * res["replicated"] / 4, res  # ZeRO-3 memory target


def _main(rank: int, argv: list[str]) -> tuple[int, str]:
    """``simplenet.main()`` as torchrun would run it (the world already exists): exit code, stdout."""
    import contextlib
    import io

    from examples import simplenet

    out, code = io.StringIO(), 0
    old, sys.argv = sys.argv, ["simplenet.py", *argv]
    try:
        with contextlib.redirect_stdout(out):
            simplenet.main()
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = old
    return code, out.getvalue()


def test_entry_point(world4):  # type: ignore[no-untyped-def]
    (code, out), *rest = world4.run(_main, ["--strategy", "zero3", "--steps", "2", "--inner", "64"])
    assert code == 0 and all(c == 0 and o == "" for c, o in rest), (code, out, rest)  # rank 0 prints
    assert "zero3: max relative loss difference" in out and "match the single-process run" in out, out
    assert "collectives {'all_gather': 1" in out and "largest rank / replicated = 0.25" in out, out
