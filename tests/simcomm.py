"""Simulated collectives for pure tests of kernels (``engine.kernels``): every mesh coordinate
runs the kernel, in turn, or in threads meeting at a barrier once a collective shows up."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Collective(Exception):
    """Raised by the first collective of a sequential run: rerun the ranks in threads."""


class SimComm:
    """Stands in for the engine's ``Collectives`` (``ctx.comm`` of a kernel): threads meet at a
    barrier and reduce over axis lines."""

    def __init__(self, coords: list[tuple[int, ...]]) -> None:
        self.coords = coords
        self.barrier = threading.Barrier(len(coords), timeout=30)
        self.slots: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.tls = threading.local()

    def all_reduce(self, t: torch.Tensor, axes: Any, reduce_type: str) -> torch.Tensor:
        for axis in axes:
            t = self._reduce(t, axis, reduce_type)
        return t

    def all_gather(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """Every member's ``t`` along ``axis``, stacked in coordinate order."""
        return self._meet(t, axis)

    def _reduce(self, t: torch.Tensor, axis: int, reduce_type: str) -> torch.Tensor:
        stacked = self._meet(t, axis)
        return {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}[reduce_type](stacked, 0)

    def _meet(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        if not self.threaded:
            raise _Collective
        me, k = self.tls.coord, self.tls.step
        self.tls.step += 1
        self.slots[(k, me)] = t.clone()
        self.barrier.wait()
        line = [c for c in self.coords if all(c[b] == me[b] for b in range(len(me)) if b != axis)]
        line.sort(key=lambda c: c[axis])
        stacked = torch.stack([self.slots[(k, c)] for c in line])
        self.barrier.wait()
        return stacked

    def exchange(self, axis: int, sends: Any, recv_shapes: Any) -> list[list[torch.Tensor]]:
        """Point-to-point along ``axis``: ``sends[c]`` go to the member at coordinate ``c``."""
        if not self.threaded:
            raise _Collective
        me, k = self.tls.coord, self.tls.step
        self.tls.step += 1
        for c, ts in enumerate(sends):
            dst = tuple(c if b == axis else me[b] for b in range(len(me)))
            self.slots[(k, (me, dst))] = [t.clone() for t in ts]  # type: ignore[index]
        self.barrier.wait()
        got = []
        for c, shapes in enumerate(recv_shapes):
            src = tuple(c if b == axis else me[b] for b in range(len(me)))
            ts = self.slots[(k, (src, me))]  # type: ignore[index]
            assert [tuple(t.shape) for t in ts] == [tuple(s) for s in shapes], (ts, shapes)
            got.append(ts)
        self.barrier.wait()
        return got

    def run(self, fn: Callable[[tuple[int, ...]], Any]) -> dict[tuple[int, ...], Any]:
        """``fn`` at every coordinate: in turn, or in threads once a collective shows up."""
        self.threaded = False
        try:
            return {c: fn(c) for c in self.coords}
        except _Collective:
            self.threaded = True
        results: dict[tuple[int, ...], Any] = {}
        errors: list[BaseException] = []

        def body(c: tuple[int, ...]) -> None:
            self.tls.coord, self.tls.step = c, 0
            try:
                results[c] = fn(c)
            except BaseException as e:  # noqa: BLE001  (re-raised below)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(c,)) for c in self.coords]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results
