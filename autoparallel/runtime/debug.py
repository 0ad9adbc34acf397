"""``CommDebugMode``: record every collective ``autoparallel.runtime.comm`` issues on this rank."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_ACTIVE: list[CommDebugMode] = []


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as this rank saw it: kind, mesh axis (None for point-to-point), bytes."""

    kind: str
    mesh: Any
    axis: int | None
    group: tuple[int, ...]
    sent_bytes: int
    recv_bytes: int

    def __str__(self) -> str:
        where = f"axis {self.axis}" if self.axis is not None else "p2p"
        return f"{self.kind}({where}, ranks {list(self.group)}): sent {self.sent_bytes} B, received {self.recv_bytes} B"


class CommDebugMode:
    """Context manager recording the collectives issued by this rank.

    >>> with CommDebugMode() as comm:
    ...     y = reshard(x, mesh, [Replicate()])
    >>> comm.get_comm_counts()     # {'all_gather': 1}
    >>> comm.bytes_received        # bytes this rank received

    Nested modes each see every record.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommDebugMode:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def get_comm_counts(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.records))

    def get_total_counts(self) -> int:
        return len(self.records)

    @property
    def bytes_sent(self) -> int:
        return sum(r.sent_bytes for r in self.records)

    @property
    def bytes_received(self) -> int:
        return sum(r.recv_bytes for r in self.records)

    def summary(self) -> str:
        lines = [str(r) for r in self.records]
        lines.append(f"total: {len(self.records)} collectives, sent {self.bytes_sent} B, received {self.bytes_received} B")
        return "\n".join(lines)


_PAUSED = [0]  # > 0 while control messages run (``unrecorded``)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Collectives issued inside are control messages (the SPMD agreement checks), not the
    program's communication: ``CommDebugMode`` does not record them."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def record(kind: str, mesh: Any, axis: int | None, group: tuple[int, ...], sent: int, recv: int) -> None:
    if _ACTIVE and not _PAUSED[0]:
        rec = CommRecord(kind, mesh, axis, tuple(group), int(sent), int(recv))
        for mode in _ACTIVE:
            mode.records.append(rec)


def replay(records: list[CommRecord] | tuple[CommRecord, ...]) -> None:
    """Record again collectives a captured program issues when it replays (static mode)."""
    if _ACTIVE:
        for mode in _ACTIVE:
            mode.records.extend(records)
