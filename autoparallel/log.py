"""The library's logger: ``logging.getLogger("autoparallel")``.

User-facing warnings stay Python warnings (each said once: fallbacks, static-mode refusals);
the logger carries diagnostics at DEBUG level: the world and the process groups the library
creates, static captures, refusals and recaptures, decision-cache misses (an op planned for a
new layout or shape). It has a ``NullHandler``: configure ``logging`` as usual, or set
``AUTOPARALLEL_LOG=debug`` (or ``info``, ``warning``) to get a stderr handler whose lines name
the rank: ``[autoparallel rank 1] DEBUG static: captured ...``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("autoparallel")
logger.addHandler(logging.NullHandler())
LOG_VAR = "AUTOPARALLEL_LOG"


def configure_from_env() -> None:
    """Add a stderr handler at ``AUTOPARALLEL_LOG``'s level (once); nothing when unset."""
    level = os.environ.get(LOG_VAR, "").strip().upper()
    if not level or any(getattr(h, "_autoparallel", False) for h in logger.handlers):
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"{LOG_VAR}={level.lower()!r}: expected debug, info, warning or error")
    handler = logging.StreamHandler()
    handler._autoparallel = True  # type: ignore[attr-defined]
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter(f"[autoparallel rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
