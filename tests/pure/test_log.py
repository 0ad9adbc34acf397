"""The library logger (``autoparallel/log.py``): silent by default, AUTOPARALLEL_LOG adds one
stderr handler at the asked level, a bad level is refused with the variable's name."""

from __future__ import annotations

import logging

import pytest

from autoparallel import log


def _ours() -> list[logging.Handler]:
    return [h for h in log.logger.handlers if getattr(h, "_autoparallel", False)]


def test_logger_is_silent_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert logging.getLogger("autoparallel") is log.logger
    assert any(isinstance(h, logging.NullHandler) for h in log.logger.handlers)
    monkeypatch.delenv("AUTOPARALLEL_LOG", raising=False)
    before = list(log.logger.handlers)
    log.configure_from_env()
    assert log.logger.handlers == before


def test_env_adds_one_handler_at_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    level = log.logger.level
    monkeypatch.setenv("AUTOPARALLEL_LOG", "debug")
    try:
        log.configure_from_env()
        log.configure_from_env()  # once only
        assert len(_ours()) == 1 and log.logger.level == logging.DEBUG
    finally:
        for h in _ours():
            log.logger.removeHandler(h)
        log.logger.setLevel(level)
    monkeypatch.setenv("AUTOPARALLEL_LOG", "loud")
    with pytest.raises(ValueError, match="AUTOPARALLEL_LOG='loud'"):
        log.configure_from_env()
