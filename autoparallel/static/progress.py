"""Progress and summaries for ``ap.Engine``'s loops: a tqdm bar on rank 0 (log lines without tqdm)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from autoparallel import runtime


def progress(items: Iterable[Any], total: int, desc: str, verbose: int) -> Iterator[Any]:
    """``items``, with a bar (or a line every tenth of ``total``) on rank 0 when ``verbose``."""
    if not verbose or runtime.get_rank() != 0:
        yield from items
        return
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        every = max(1, total // 10)
        for i, item in enumerate(items):
            yield item
            if (i + 1) % every == 0 or i + 1 == total:
                print(f"{desc}: step {i + 1}/{total}", file=sys.stderr, flush=True)
        return
    yield from tqdm(items, total=total, desc=desc, leave=False, file=sys.stderr)


class Summary:
    """Per-step logs folded into one dict: means, except names whose last value is the total."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.steps = 0

    def add(self, logs: dict[str, float]) -> None:
        self.steps += 1
        for k, v in logs.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.last[k] = v

    def result(self, accumulated: set[str]) -> dict[str, float]:
        """Each value's mean over the steps; for names in ``accumulated`` (metrics that count over
        the steps themselves) the last value."""
        return {k: self.last[k] if k in accumulated else s / self.steps for k, s in self.sums.items()}


__all__ = ["Summary", "progress"]
