"""The library's logger: ``logging.getLogger("autoparallel")``.

User-facing warnings stay Python warnings (each said once: fallbacks, static-mode refusals).
The logger says what takes time and why:

- INFO: long phases and how long they took — a static capture of a step or a pipeline chunk
  (``static: captured the train step in 1.84 s ...``), an inductor compile (a line before, a
  line with the time after), and planning, when deciding ops for new layouts or shapes adds up
  to a second or more (``planning: decided 212 ops ... in 1.31 s``, at most one line every
  few seconds).
- DEBUG: the details — every decision-cache miss (an op planned for a new layout or shape), the
  world and the process groups the library creates, static refusals, local regions' verdicts.

Where the lines go (``configure_from_env``, run by ``import autoparallel``):

- ``AUTOPARALLEL_LOG`` unset: one stderr handler showing INFO on rank 0 and WARNING and above
  on the other ranks — unless the application configured logging itself (the root logger has a
  handler): then that handler steps aside and the records reach the application's handlers as
  any library's do (the logger's level is INFO).
- ``AUTOPARALLEL_LOG=debug`` (or ``info``, ``warning``, ``error``): one stderr handler at that
  level on every rank.

Lines name the rank: ``[autoparallel rank 1] DEBUG static: ...``. The rank is read when a line
is written: the default process group's rank once ``torch.distributed`` has one, else
torchrun's ``RANK``, else 0.
"""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger("autoparallel")
logger.addHandler(logging.NullHandler())
LOG_VAR = "AUTOPARALLEL_LOG"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "[autoparallel rank %(ap_rank)s] %(levelname)s %(message)s"


def current_rank() -> int:
    """This process's rank as a log line names it (see the module docstring)."""
    # torch.distributed is only asked when the program has loaded it: this module sits in the
    # values layer, which must not import it
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else 0


class RankFilter(logging.Filter):
    """Names the rank on each record; lets through ``rank0_level`` and above on rank 0 and
    ``others_level`` and above elsewhere; with ``step_aside``, nothing while the root logger has
    a handler (the application's own logging configuration)."""

    def __init__(self, rank0_level: int, others_level: int, step_aside: bool) -> None:
        super().__init__()
        self.rank0_level, self.others_level, self.step_aside = rank0_level, others_level, step_aside

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.ap_rank = rank
        if self.step_aside and logging.getLogger().handlers:
            return False
        return record.levelno >= (self.rank0_level if rank == 0 else self.others_level)


def ours() -> list[logging.Handler]:
    """The handlers ``configure_from_env`` added (at most one)."""
    return [h for h in logger.handlers if getattr(h, "_autoparallel", False)]


def configure_from_env() -> None:
    """Set up the library's stderr handler from ``AUTOPARALLEL_LOG`` (replacing one set up
    before); ``ValueError`` naming the variable and its value if the level is unknown."""
    value = os.environ.get(LOG_VAR, "").strip()
    level = value.upper()
    if level and level not in LEVELS:
        raise ValueError(f"{LOG_VAR}={value.lower()!r}: expected debug, info, warning or error (or unset: "
                         "info on rank 0, warnings elsewhere)")
    for h in ours():
        logger.removeHandler(h)
    handler = logging.StreamHandler()
    handler._autoparallel = True  # type: ignore[attr-defined]  # marks the one handler this function owns
    handler.setFormatter(logging.Formatter(FORMAT))
    if level:
        handler.addFilter(RankFilter(logging.DEBUG, logging.DEBUG, step_aside=False))
        logger.setLevel(level)
    else:
        handler.addFilter(RankFilter(logging.INFO, logging.WARNING, step_aside=True))
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)


class Tally:
    """The time of a phase that comes in many small pieces (deciding an op at a decision-cache
    miss), said at INFO once it adds up: a line when at least ``least`` seconds were spent since
    the last line and ``every`` seconds have passed since it. ``add`` costs a clock read and a
    comparison or two; nothing is counted where no piece comes (cache hits never call it).

    ``line``: the message, a %-format of the count, the seconds spent and the seconds passed
    since the first piece it counts."""

    __slots__ = ("line", "least", "every", "count", "seconds", "since", "said")

    def __init__(self, line: str, least: float = 1.0, every: float = 5.0) -> None:
        self.line, self.least, self.every = line, least, every
        self.count, self.seconds, self.since, self.said = 0, 0.0, 0.0, float("-inf")

    def add(self, start: float) -> None:
        """Count one piece that began at ``start`` (a ``time.perf_counter()`` reading) and ends
        now; say the tally if it is due."""
        now = time.perf_counter()
        if not self.count:
            self.since = start
        self.count += 1
        self.seconds += now - start
        if self.seconds >= self.least and now - self.said >= self.every:
            logger.info(self.line, self.count, self.seconds, now - self.since)
            self.count, self.seconds, self.said = 0, 0.0, now
