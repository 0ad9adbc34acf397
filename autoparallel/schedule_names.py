"""Pipeline schedule names: the canonical ones and the spellings taken for them (a value table,
read by the schedules and by the Engine's strategy)."""

from __future__ import annotations

NAMES = ("FThenB", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV")
_ALIASES = {"gpipe": "FThenB", "fthenb": "FThenB", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B",
            "interleaved": "Interleaved1F1B", "vpp": "Interleaved1F1B", "zbh1": "ZBH1", "zerobubble": "ZBH1",
            "zbv": "ZBV", "zerobubblev": "ZBV", "zbvpp": "ZBV"}


class ScheduleError(ValueError):
    """A schedule that cannot run: bad sizes, deadlock, or misordered actions."""


def schedule_name(name: str) -> str:
    """Canonical schedule name for ``name`` (case-insensitive, ``-``/``_`` ignored; gpipe,
    interleaved, Paddle's vpp and zbvpp accepted)."""
    canon = _ALIASES.get(str(name).lower().replace("-", "").replace("_", ""))
    if canon is None:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of {list(NAMES)}")
    return canon
