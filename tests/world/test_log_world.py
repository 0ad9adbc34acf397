"""The library's INFO lines in a world (``autoparallel/log.py``): a static capture and an inductor
compile each say their phase and its time, planning says how many ops it decided and how long
that took, and the default handler shows INFO on rank 0 only (the rank read from the world)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Replicate, Shard, log
from autoparallel.engine import dispatch


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO:
            self.lines.append(record.getMessage())


def _phases(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    model = nn.Linear(7, 3)  # sizes no other test uses: every op is decided here
    for name in ("weight", "bias"):
        setattr(model, name, nn.Parameter(ap.shard_tensor(getattr(model, name).detach(), mesh, [Replicate()])))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lines = _Lines()
    compile_, least, every = torch.compile, dispatch._PLANNING.least, dispatch._PLANNING.every
    # inductor itself takes a minute here: a stand-in compiler, which the program runs through unchanged
    torch.compile = lambda gm, backend=None: (lambda *flat: gm(*flat))  # type: ignore[assignment]
    dispatch._PLANNING.least, dispatch._PLANNING.every = 0.0, 0.0  # every miss says its line
    log.logger.addHandler(lines)
    try:
        dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt, strategy=ap.Strategy(compile="inductor"))
        for _ in range(3):  # eager, captured, replayed (compiled at its first call)
            x = ap.shard_tensor(torch.randn(10, 7), mesh, [Shard(0)])
            y = ap.shard_tensor(torch.arange(10) % 3, mesh, [Shard(0)])
            dm(x, y)
    finally:
        log.logger.removeHandler(lines)
        torch.compile = compile_  # type: ignore[assignment]
        dispatch._PLANNING.least, dispatch._PLANNING.every = least, every
    record = logging.LogRecord("autoparallel", logging.INFO, __file__, 1, "x", None, None)
    default = log.RankFilter(logging.INFO, logging.WARNING, step_aside=False)
    return {"lines": lines.lines, "shown": default.filter(record), "rank": record.ap_rank}  # type: ignore[attr-defined]


def test_static_capture_compile_and_planning_say_their_time(world2: Any) -> None:
    for rank, got in enumerate(world2.run(_phases)):
        lines = got["lines"]
        captured = [ln for ln in lines if ln.startswith("static: captured the train step in ")]
        assert len(captured) == 1 and " s (a program of " in captured[0], lines
        compiling = [i for i, ln in enumerate(lines) if ln.startswith("static: compiling the train program with inductor")]
        compiled = [i for i, ln in enumerate(lines) if ln.startswith("static: compiled the train program with inductor in ")]
        assert len(compiling) == 1 and len(compiled) == 1 and compiling[0] < compiled[0], lines
        assert lines.index(captured[0]) < compiling[0], lines  # compiled at the first replay
        planned = [ln for ln in lines if ln.startswith("planning: decided ")]
        assert planned and all(" ops for new layouts or shapes in " in ln for ln in planned), lines
        assert got["rank"] == rank and got["shown"] == (rank == 0)
