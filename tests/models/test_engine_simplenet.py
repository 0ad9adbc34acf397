"""examples/engine_simplenet.py: the primer's four Engine programs (dp, sharding, mp, pp) each
train like one process (losses, top-1/top-5 accuracy over the pass, parameters; rtol 1e-5), in
one 4-rank world (pp: 2 stages, each data parallel over 2 ranks); ``main()`` exits 0."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from examples.engine_simplenet import STRATEGIES


def _run(rank: int, strategy: str, schedule: str) -> dict[str, Any]:
    from examples import engine_simplenet

    res = engine_simplenet.run(strategy, steps=3, inner=64, schedule=schedule)
    return {"ok": res.ok, "worst": res.worst_loss, "param": res.worst_param, "logs": res.logs, "ref": res.reference}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_program_matches_one_process(world4: Any, strategy: str) -> None:
    got = world4.run(_run, strategy, "1F1B", timeout=300)
    for r, res in enumerate(got):
        assert res["ok"], (r, res)
        assert len(res["logs"]) == 3 and res["logs"] == got[0]["logs"]  # the same floats on every rank


def test_pipeline_program_fthenb(world4: Any) -> None:
    assert all(res["ok"] for res in world4.run(_run, "pp", "FThenB", timeout=300))


def _main(rank: int, argv: list[str]) -> int:
    from examples import engine_simplenet

    old, sys.argv = sys.argv, ["engine_simplenet.py", *argv]
    try:
        engine_simplenet.main()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = old
    return 0


def test_entry_point(world4: Any) -> None:
    assert world4.run(_main, ["--strategy", "pp", "--steps", "2", "--inner", "64"]) == [0] * 4
