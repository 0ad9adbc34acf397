"""op_db conformance, part 3: the two libraries under test, and ranks agreeing on every step.

A backend turns a plain tensor into a distributed one (``Replicate`` or ``Shard(dim)`` on a
4-rank mesh) and back (``full_tensor``), and checks that a result's local shard fits its layout.
``"ours"`` is ``autoparallel``; ``"torch"`` is ``torch.distributed.tensor`` (only this harness and
``benchmarks/op_coverage.py`` import it). ``_step(fn)`` runs ``fn`` on every rank and makes all
ranks agree on the outcome, so a failure on some ranks only can never leave the others waiting
in a collective.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.conformance.compare import _error_text
from tests.conformance.samples import BACKENDS, WORLD, _map_tensors, _tensors


# ---- backends ----------------------------------------------------------------------------
class RankFailed(Exception):
    """Some rank failed a step: raised on every rank after ``agree``, so all stay in step."""


LAYOUT_MARK = "LAYOUT: "


class LayoutMismatch(Exception):
    """A distributed result's local shard does not fit its own layout: a silent corruption."""

    def __str__(self) -> str:
        return LAYOUT_MARK + super().__str__()


class _Backend:
    """Converts plain tensors to distributed ones and back, for one library."""

    name = ""

    def distribute(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        raise NotImplementedError

    def is_dist(self, t: Any) -> bool:
        raise NotImplementedError

    def full(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layout_error(self, t: torch.Tensor) -> str | None:
        """Why ``t``'s local shard does not fit its layout on this rank (None: it fits)."""
        raise NotImplementedError


class _Ours(_Backend):
    name = "ours"

    def __init__(self) -> None:
        import autoparallel as ap

        self.ap = ap
        self.mesh = ap.ProcessMesh(list(range(WORLD)), ["x"])

    def distribute(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        pl = self.ap.Replicate() if dim is None else self.ap.Shard(dim)
        return self.ap.shard_tensor(t.detach(), self.mesh, [pl])

    def is_dist(self, t: Any) -> bool:
        return isinstance(t, self.ap.DistTensor)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor()  # type: ignore[attr-defined,no-any-return]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Check every top-level DistTensor op on all ranks as it returns (see ``_guarded``)."""
        import autoparallel.engine.dtensor as dt

        original = dt.dispatch
        dt.dispatch = functools.partial(_guarded, original, self)  # type: ignore[assignment]
        try:
            yield
        finally:
            dt.dispatch = original  # type: ignore[assignment]

    def layout_error(self, t: torch.Tensor) -> str | None:
        spec, local = t._spec, t._local  # type: ignore[attr-defined]
        coord = spec.mesh.coordinate_of(self.ap.get_rank())
        want = tuple(spec.local_shape(coord))
        if coord is not None and tuple(local.shape) != want:
            return (f"local shard {tuple(local.shape)} does not match its layout {list(spec.placements)} "
                    f"of global {tuple(spec.shape)} (expected {want} at mesh coordinate {coord})")
        if local.dtype != spec.dtype:
            return f"local shard dtype {local.dtype} != global dtype {spec.dtype}"
        return None


class _Torch(_Backend):
    name = "torch"

    def __init__(self) -> None:
        import logging

        logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # "no alltoall on CPU"...
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        self.DTensor, self.Replicate, self.Shard = DTensor, Replicate, Shard
        self.distribute_tensor = distribute_tensor
        self.mesh = DeviceMesh("cpu", list(range(WORLD)))

    def distribute(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        pl = self.Replicate() if dim is None else self.Shard(dim)
        return self.distribute_tensor(t.detach(), self.mesh, [pl])  # type: ignore[no-any-return]

    def is_dist(self, t: Any) -> bool:
        return isinstance(t, self.DTensor)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor()  # type: ignore[attr-defined,no-any-return]

    def layout_error(self, t: torch.Tensor) -> str | None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t._local_tensor  # type: ignore[attr-defined]
        want, _ = compute_local_shape_and_global_offset(t.shape, self.mesh, t.placements)  # type: ignore[attr-defined]
        if tuple(local.shape) != tuple(want):
            return (f"local shard {tuple(local.shape)} does not match its layout {list(t.placements)} "  # type: ignore[attr-defined]
                    f"of global {tuple(t.shape)} (expected {tuple(want)})")
        return None


_DEPTH = [0]


def _guarded(original: Callable[..., Any], backend: _Ours, cls: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """``autoparallel.engine.dispatch.dispatch`` plus a check agreed by all ranks after each op.

    An op that raised on some ranks only, or whose output shard contradicts its layout on some
    rank, would leave the ranks out of step (the next collective hangs or mixes up data); here
    every rank learns it at once and raises: ``RankFailed`` naming the op and the ranks, or
    ``LayoutMismatch``. An op that raised on every rank re-raises its own exception.
    """
    if _DEPTH[0]:
        return original(cls, func, args, kwargs)
    import torch.distributed as dist

    _DEPTH[0] += 1
    out, err = None, None
    try:
        out = original(cls, func, args, kwargs)
    except Exception as e:  # noqa: BLE001 - agreed on below
        err = e
    finally:
        _DEPTH[0] -= 1
    msg = None if err is None else f"{func}: {_error_text(err)}"
    if err is None:
        bad = next((b for b in (backend.layout_error(t) for t in _tensors(out) if backend.is_dist(t)) if b), None)
        msg = None if bad is None else f"{LAYOUT_MARK}{func}: {bad}"
    flag = torch.tensor([0 if msg is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return out
    msgs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    failed = [r for r, m in enumerate(msgs) if m is not None]
    layout = [r for r in failed if msgs[r].startswith(LAYOUT_MARK)]
    if layout:
        raise LayoutMismatch(f"on rank(s) {layout}: {msgs[layout[0]][len(LAYOUT_MARK):]}")
    if err is not None and len(failed) == len(msgs):
        raise err
    raise RankFailed(f"raised on rank(s) {failed} only, the others went on: {msgs[failed[0]]}")


_BACKENDS: dict[str, _Backend] = {}


def backend_of(name: str) -> _Backend:
    if name not in _BACKENDS:
        if name == "ours":
            _BACKENDS[name] = _Ours()
        elif name == "torch":
            _BACKENDS[name] = _Torch()
        else:
            raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    return _BACKENDS[name]


def agree(error: str | None) -> None:
    """Every rank learns whether any rank failed a step; raise ``RankFailed`` on all if so.

    A failure on only some ranks is named as such: the other ranks went on, which in a real
    program would leave them waiting in the next collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise RankFailed(error)
        return
    flag = torch.tensor([0 if error is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # cheap; the messages only when some rank failed
    if not int(flag.item()):
        return
    msgs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, error)
    failed = [r for r, m in enumerate(msgs) if m is not None]
    if len(failed) == len(msgs):
        raise RankFailed(error)
    layout = [r for r in failed if str(msgs[r]).startswith(LAYOUT_MARK)]
    if layout:  # a per-rank check, not a divergence
        raise RankFailed(f"{LAYOUT_MARK}on rank(s) {layout}: {str(msgs[layout[0]])[len(LAYOUT_MARK):]}")
    raise RankFailed(f"raised on rank(s) {failed} only, the others went on: {msgs[failed[0]]}")


def _step(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank and ``agree`` on the outcome (RankFailed / LayoutMismatch)."""
    error: str | None = None
    out = None
    try:
        out = fn()
    except (RankFailed, LayoutMismatch):
        raise  # raised by ``_guarded`` after all ranks agreed: every rank is here already
    except Exception as e:  # noqa: BLE001
        # Exceptions raised inside autograd may come back re-wrapped: keep the marker's text.
        text = str(e)
        error = text[text.index(LAYOUT_MARK):] if LAYOUT_MARK in text else _error_text(e)
    try:
        agree(error)
    except RankFailed as e:
        msg = str(e)
        if msg.startswith(LAYOUT_MARK):
            raise LayoutMismatch(msg[len(LAYOUT_MARK):].splitlines()[0]) from None
        raise
    return out


def _fulls(backend: _Backend, out: Any) -> Any:
    """Distributed tensors in ``out`` -> their full values (detached), after checking that every
    rank's shard fits its layout (checked on all ranks first, so a bad shard cannot hang the
    gathers)."""
    dts = [t for t in _tensors(out) if backend.is_dist(t)]
    bad = next((e for e in (backend.layout_error(t) for t in dts) if e is not None), None)
    _step(lambda: _raise_layout(bad))
    return _step(lambda: _map_tensors(out, lambda t: (backend.full(t) if backend.is_dist(t) else t).detach()))


def _raise_layout(bad: str | None) -> None:
    """This rank's own finding, not yet agreed: a plain exception carrying the marker."""
    if bad is not None:
        raise RuntimeError(f"{LAYOUT_MARK}output: {bad}")
