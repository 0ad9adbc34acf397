"""The library logger (``autoparallel/log.py``): unset, one stderr handler shows INFO on rank 0
and warnings elsewhere, stepping aside for an application's own logging; AUTOPARALLEL_LOG adds
one stderr handler at the asked level on every rank; a bad level is refused with the variable's
name; lines name the rank; a ``Tally`` says a phase's time at INFO once it adds up, rate-limited."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from autoparallel import log


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("autoparallel", level, __file__, 1, "static: captured", None, None)


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The logger as ``import autoparallel`` left it, put back after the test."""
    level, handlers = log.logger.level, list(log.logger.handlers)
    yield monkeypatch
    for h in log.ours():
        log.logger.removeHandler(h)
    for h in handlers:
        if h not in log.logger.handlers:
            log.logger.addHandler(h)
    log.logger.setLevel(level)


def _passes(handler: logging.Handler, level: int, rank: str, monkeypatch: pytest.MonkeyPatch,
            root_handlers: list[logging.Handler] | None = None) -> bool:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(logging.getLogger(), "handlers", root_handlers or [])
    record = _record(level)
    return handler.level <= level and bool(handler.filter(record)) and record.ap_rank == int(rank)  # type: ignore[attr-defined]


def test_unset_shows_info_on_rank_0_and_warnings_elsewhere(restored: pytest.MonkeyPatch) -> None:
    mp = restored
    assert logging.getLogger("autoparallel") is log.logger
    assert any(isinstance(h, logging.NullHandler) for h in log.logger.handlers)
    mp.delenv("AUTOPARALLEL_LOG", raising=False)
    log.configure_from_env()
    log.configure_from_env()  # once only
    (handler,) = log.ours()
    assert log.logger.level == logging.INFO and log.logger.isEnabledFor(logging.INFO)
    assert not log.logger.isEnabledFor(logging.DEBUG)
    assert _passes(handler, logging.INFO, "0", mp) and _passes(handler, logging.WARNING, "0", mp)
    assert not _passes(handler, logging.INFO, "1", mp) and _passes(handler, logging.WARNING, "1", mp)
    assert _passes(handler, logging.ERROR, "3", mp)
    # an application that configured logging (a root handler) gets the records there, not twice
    assert not _passes(handler, logging.INFO, "0", mp, [logging.NullHandler()])
    assert not _passes(handler, logging.WARNING, "1", mp, [logging.NullHandler()])


def test_env_adds_one_handler_at_the_level_on_every_rank(restored: pytest.MonkeyPatch) -> None:
    mp = restored
    mp.setenv("AUTOPARALLEL_LOG", "debug")
    log.configure_from_env()
    log.configure_from_env()  # once only
    (handler,) = log.ours()
    assert log.logger.level == logging.DEBUG
    assert _passes(handler, logging.DEBUG, "0", mp) and _passes(handler, logging.DEBUG, "2", mp)
    assert _passes(handler, logging.DEBUG, "1", mp, [logging.NullHandler()])  # asked for: shown regardless
    mp.setenv("AUTOPARALLEL_LOG", "warning")
    log.configure_from_env()
    assert len(log.ours()) == 1 and log.logger.level == logging.WARNING
    assert not log.logger.isEnabledFor(logging.INFO)
    mp.setenv("AUTOPARALLEL_LOG", "loud")
    with pytest.raises(ValueError, match="AUTOPARALLEL_LOG='loud'"):
        log.configure_from_env()


def test_lines_name_the_rank(restored: pytest.MonkeyPatch) -> None:
    mp = restored
    mp.setenv("AUTOPARALLEL_LOG", "info")
    log.configure_from_env()
    (handler,) = log.ours()
    mp.setenv("RANK", "3")
    record = _record(logging.INFO)
    assert handler.filter(record)
    assert handler.format(record) == "[autoparallel rank 3] INFO static: captured"
    mp.delenv("RANK")
    assert log.current_rank() == 0  # no world in this process, no torchrun


def test_a_tally_says_its_time_once_it_adds_up(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    tally = log.Tally("planning: decided %d ops in %.2f s (over the last %.1f s)", least=1.0, every=5.0)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, logger="autoparallel"):
        mp.setattr(log.time, "perf_counter", lambda: clock[0])
        for _ in range(3):  # 0.4 s each: the third makes 1.2 s
            start = clock[0]
            clock[0] += 0.4
            tally.add(start)
        clock[0] += 1.0
        for _ in range(4):  # 2 s more, but within 5 s of the last line: not yet
            start = clock[0]
            clock[0] += 0.5
            tally.add(start)
        clock[0] += 3.0
        start = clock[0]
        clock[0] += 0.1
        tally.add(start)  # 5.1 s after the first line
    lines = [r.getMessage() for r in caplog.records if r.name == "autoparallel"]
    assert lines == ["planning: decided 3 ops in 1.20 s (over the last 1.2 s)",
                     "planning: decided 5 ops in 2.10 s (over the last 5.1 s)"], lines
    assert all(r.levelno == logging.INFO for r in caplog.records)
