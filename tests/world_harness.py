"""A persistent multi-process gloo "world" for tests.

Contract:

* ``World(n)`` spawns ``n`` workers (``multiprocessing`` "spawn" context). Each one
  joins a gloo process group through a ``FileStore`` in a fresh temp directory
  (no TCP port, no MASTER_ADDR/RANK/WORLD_SIZE env vars) and then serves calls.
* ``world.run(fn, *args, timeout=120, **kwargs)`` calls ``fn(rank, *args, **kwargs)``
  on every rank and returns the per-rank results in rank order. ``fn`` must be a
  module-level function (sent by module + qualname); args/results are pickled.
* A rank that raises stays alive. If every rank raised the same exception type,
  that type is re-raised with rank 0's message plus all tracebacks; otherwise a
  :class:`WorkerError` listing each failing rank is raised.
* A hang (no answer within ``timeout``) or a dead worker kills the whole world and
  raises ``TimeoutError`` / :class:`WorkerError`; the next ``run`` restarts it.
* ``close()`` (or leaving ``with World(n) as w:``) shuts the workers down.
* ``AP_WORLD_PROFILE=folder`` profiles each worker (``cProfile``, thread time) from start-up to
  ``close()`` and writes ``world{n}-rank{r}-{pid}.prof`` there: where a test module's time goes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STOP = "__stop__"
_READY = -1  # call id of the "process group is up" message


# what a hand-spawned gloo world's processes run with (one thread each, quiet, on loopback)
SPAWN_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block (processes started in it inherit it), then restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class RankFailure:
    """What one rank raised: exception type (module, qualname), message, traceback."""

    rank: int
    module: str
    qualname: str
    message: str
    traceback: str


class WorkerError(RuntimeError):
    """Some ranks failed (or died); ``failures`` maps rank -> :class:`RankFailure`."""

    def __init__(self, msg: str, failures: dict[int, RankFailure]) -> None:
        super().__init__(msg)
        self.failures = failures


def _format_failures(failures: dict[int, RankFailure]) -> str:
    return "\n".join(f"--- rank {r}: {f.qualname}: {f.message}\n{f.traceback}"
                     for r, f in sorted(failures.items()))


def _worker(rank: int, nprocs: int, store_path: str, tasks: Any, results: Any) -> None:
    """Worker main loop: join the gloo group, then serve ``(call_id, payload)`` tasks."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    # Silence torch.distributed's own warnings only; tested code's warnings stay visible.
    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, nprocs)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs)
    profiler = None
    if os.environ.get("AP_WORLD_PROFILE"):  # a folder: each rank's cProfile (thread time) at stop
        import cProfile
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
    results.put((rank, _READY, True, pickle.dumps(None)))
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        call_id, payload = task
        try:
            module, qualname, args, kwargs = pickle.loads(payload)
            fn = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
            out = (rank, call_id, True, pickle.dumps(fn(rank, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report everything, keep serving
            t = type(e)
            fail = RankFailure(rank, t.__module__, t.__qualname__, str(e), traceback.format_exc())
            out = (rank, call_id, False, pickle.dumps(fail))
        results.put(out)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(os.environ["AP_WORLD_PROFILE"], f"world{nprocs}-rank{rank}-{os.getpid()}.prof"))
    dist.destroy_process_group()
    # Skip the slow interpreter teardown (~1 s with torch loaded); flush what matters.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class World:
    """``nprocs`` persistent gloo worker processes; see the module docstring."""

    poll_s: float = 0.2  # how often to check for dead workers while waiting
    error_grace_s: float = 10.0  # after one rank raised, how long to wait for the rest
    startup_timeout_s: float = 180.0

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._tmpdir: str | None = None
        self._call_id = 0
        self._broken = True
        self._start()

    # ---------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="ap_world_")
        store_path = os.path.join(self._tmpdir, "store")
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.nprocs)]
        pp = os.environ.get("PYTHONPATH")
        env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
               "PYTHONPATH": REPO_ROOT + (os.pathsep + pp if pp else "")}
        if sys.platform.startswith("linux"):  # gloo on loopback: no hostname resolution
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        with environment(env):  # the children inherit the environment at start()
            self._procs = [self._ctx.Process(
                target=_worker, args=(r, self.nprocs, store_path, self._tasks[r], self._results),
                name=f"world{self.nprocs}-rank{r}", daemon=True) for r in range(self.nprocs)]
            for p in self._procs:
                p.start()
        self._broken = False
        try:
            self._collect(_READY, self.startup_timeout_s, what="start-up")
        except BaseException:
            self._kill()  # never leave half-started workers or temp dirs behind
            raise

    def _kill(self) -> None:
        """Kill all workers without asking; the world must be restarted afterwards."""
        self._broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._cleanup()

    def _cleanup(self) -> None:
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._tasks, self._results = [], [], None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def close(self, timeout: float = 10.0) -> None:
        """Send every worker the stop sentinel, join them, terminate stragglers."""
        if not self._broken:
            for q in self._tasks:
                q.put(_STOP)
            deadline = time.monotonic() + timeout
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._kill()  # anything still alive, or a broken world: SIGKILL and clean up

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- calls
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, *args, **kwargs)`` on every rank; return results in rank order."""
        module, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(f"{qualname} must be a module-level function to run on workers")
        if self._broken:  # never started, closed, or killed after a hang/crash
            self._start()
        self._call_id += 1
        payload = pickle.dumps((module, qualname, args, kwargs))
        for q in self._tasks:
            q.put((self._call_id, payload))
        return self._collect(self._call_id, timeout, what=qualname)

    def _collect(self, call_id: int, timeout: float, what: str) -> list[Any]:
        values: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) + len(failures) < self.nprocs:
                now = time.monotonic()
                if now >= deadline:
                    self._kill()
                    self._raise_incomplete(values, failures, what, timeout)
                try:
                    rank, cid, ok, data = self._results.get(timeout=min(self.poll_s, deadline - now))
                except queue.Empty:
                    dead = {r: p.exitcode for r, p in enumerate(self._procs)
                            if r not in values and r not in failures and p.exitcode is not None}
                    if dead:
                        self._kill()
                        raise WorkerError(
                            f"{what}: worker(s) died (rank: exitcode) {dead}; world will restart\n"
                            + _format_failures(failures), failures) from None
                    continue
                if cid != call_id:
                    continue  # stale answer; cannot happen with fresh queues, but be safe
                try:
                    if ok:
                        values[rank] = pickle.loads(data)
                        continue
                    failures[rank] = pickle.loads(data)
                except Exception as e:  # noqa: BLE001 - result not loadable in the parent
                    failures[rank] = RankFailure(rank, type(e).__module__, type(e).__qualname__,
                                                 f"unpickling result in parent: {e}", "")
                deadline = min(deadline, time.monotonic() + self.error_grace_s)
        except BaseException:
            if not self._broken and len(values) + len(failures) < self.nprocs:
                self._kill()  # interrupted mid-call: workers are in an unknown state
            raise
        if failures:
            self._raise_failures(failures, what)
        return [values[r] for r in range(self.nprocs)]

    def _raise_incomplete(self, values: dict[int, Any], failures: dict[int, RankFailure],
                          what: str, timeout: float) -> None:
        missing = [r for r in range(self.nprocs) if r not in values and r not in failures]
        if failures:
            raise WorkerError(
                f"{what}: rank(s) {sorted(failures)} raised and ranks {missing} did not answer within"
                f" {self.error_grace_s}s after that (blocked in a collective?); world killed, will"
                f" restart\n" + _format_failures(failures), failures)
        raise TimeoutError(f"{what}: ranks {missing} did not answer within {timeout}s;"
                           " world killed, will restart")

    def _raise_failures(self, failures: dict[int, RankFailure], what: str) -> None:
        kinds = {(f.module, f.qualname) for f in failures.values()}
        text = _format_failures(failures)
        if len(failures) == self.nprocs and len(kinds) == 1:
            module, qualname = kinds.pop()
            try:
                exc_type = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
                exc = exc_type(f"{failures[0].message}\n\n[all {self.nprocs} ranks raised]\n{text}")
            except Exception:  # noqa: BLE001 - type not importable/constructible
                exc = None
            if isinstance(exc, BaseException):
                exc.rank_failures = failures  # type: ignore[attr-defined]
                raise exc
        raise WorkerError(f"{what}: rank(s) {sorted(failures)} raised:\n{text}", failures)


def world_fixture(nprocs: int, scope: str = "module") -> Any:
    """Fixture factory: ``world4 = world_fixture(4)`` in a test module (one world per module).

    ``scope="session"`` (the shared ``world2/4/8`` of conftest.py) keeps one world for the whole
    run: starting a world costs seconds of CPU per rank, and most modules need the same sizes.
    """
    import pytest

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]  # scope is one of pytest's names
    def _world() -> Iterator[World]:
        w = World(nprocs)
        try:
            yield w
        finally:
            w.close()

    return _world
