"""The op path: ``__torch_dispatch__`` -> cached decision -> local step.

A *decision* (``autoparallel.engine.decision``: chosen input layouts, their reshard plans, the
local function, output specs and strides) is a pure function of the op, the inputs' specs and
strides, and the non-tensor arguments, so it is cached on exactly that key (``keys.call_key``)
and every rank reaches the same one. Deciding lives in ``decide``, running a decision in
``execute``; this module keys the call, keeps the cache, and is the engine's door for an
observer of the op path (``observed_by``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from time import perf_counter
from typing import Any

import torch

from autoparallel import compat
from autoparallel.engine import generic
from autoparallel.engine.decide import decide, forget_warnings
from autoparallel.engine.decision import Decision
from autoparallel.engine.execute import execute
from autoparallel.engine.keys import adopt_plain, call_key
from autoparallel.engine.restride import as_view_permute
from autoparallel.log import Tally, logger
from autoparallel.runtime import comm
from autoparallel.runtime.comm import profiled

_CACHE: dict[Any, Decision] = {}
MAX_CACHED_DECISIONS = 65536
# Decisions filled in from a template (``decide``: the same decision at another shape), and the
# one made afresh that became the template, are kept for the MAX_SHAPES_PER_TEMPLATE shapes
# decided last, per template: with sequence lengths that keep changing, what a new length adds is
# bounded (an older length's decisions go; coming back to it fills them in again, at a new
# length's cost; the template itself stays). Template key -> its shapes' cache keys.
# All templates together keep at most MAX_FILLED_DECISIONS (``_FILLED_ALL``, oldest first): a
# model fills in ~10-120 decisions per new length (measured, ``benchmarks/varying_shapes.py``),
# so that is the latest ~8-100 lengths' worth, and once it is
# reached a new length keeps nothing more (each template's own bound alone is reached only once
# its size ordering has recurred 16 times: a length crossing another size keys differently).


class _Shapes(deque[Any]):
    """One template's kept cache keys, oldest first, and the template key it is kept under (the
    first one seen: each call's own key is a new equal tuple, not to be kept once per shape)."""

    __slots__ = ("template",)

    def __init__(self, template: Any) -> None:
        super().__init__()
        self.template = template


_FILLED: dict[Any, _Shapes] = {}
_FILLED_ALL: OrderedDict[Any, _Shapes] = OrderedDict()  # cache key -> its template's shapes
MAX_SHAPES_PER_TEMPLATE = 16
MAX_FILLED_DECISIONS = 1024
_DETACH = torch.ops.aten.detach.default
_NOTHING = nullcontext()
_AS_STRIDED = torch.ops.aten.as_strided.default
# The observers of the op path, innermost last: entered and left only through ``observed_by``.
_OBSERVERS: list[Any] = []
# Time spent deciding at cache misses, said at INFO once it adds up to a second (the first step)
_PLANNING = Tally("planning: decided %d ops for new layouts or shapes in %.2f s (over the last %.1f s; "
                  "each decision is cached)")


def dispatch(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DistTensors of class ``cls`` (the body of ``__torch_dispatch__``)."""
    if func is _DETACH and not _OBSERVERS and not kwargs and len(args) == 1 and type(args[0]) is cls:
        x = args[0]  # autograd detaches every gradient it accumulates: same layout, no decision
        return cls._wrap(x._local.detach(), x._spec, x._stride)
    if func is _AS_STRIDED and type(args[0]) is cls:
        out = _as_strided(cls, args, kwargs)
        if out is not None:
            return out
    dts: list[Any] = []
    plain: list[torch.Tensor] = []
    key = (func, call_key(cls, args, dts, plain), call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    if not dts:
        return func(*args, **kwargs)
    if plain:  # rare: adopt them as Replicate, then key the call again
        args, kwargs = adopt_plain(cls, func, args, kwargs, dts, plain)
        dts, plain = [], []
        key = (func, call_key(cls, args, dts, plain), call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    decision = _CACHE.get(key)
    if decision is None:
        filled: list[Any] = []
        start = perf_counter()
        # a cache miss: rules and reshard plans, from metadata (in a capture, outside its trace:
        # the meta computations of a decision are not the step's ops)
        with profiled("autoparallel::plan", func), compat.outside_trace() if comm.capturing() else _NOTHING:
            decision = decide(cls, func, args, kwargs, dts, filled)
        _PLANNING.add(start)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("dispatch: planned %s for inputs %s", func, [str(d._spec) for d in dts])
        if len(_CACHE) >= MAX_CACHED_DECISIONS:  # e.g. a changing Python scalar in the key
            _CACHE.clear()
            _FILLED.clear()
            _FILLED_ALL.clear()
        _CACHE[key] = decision
        if filled:
            _keep_filled(filled[0], key)
    if _OBSERVERS:  # an observer watches the op path (a local region's trace: autoparallel.regions)
        return _OBSERVERS[-1].observe(
            func, decision, args, kwargs,
            lambda moves=None: execute(cls, func, args, kwargs, dts, decision, dispatch, moves),
        )
    return execute(cls, func, args, kwargs, dts, decision, dispatch)


def _keep_filled(template: Any, key: Any) -> None:
    """Note a decision's cache key under its template; drop the oldest beyond the
    template's bound and beyond the bound of all (the key is new: it missed the cache)."""
    keys = _FILLED.get(template)
    if keys is None:
        keys = _FILLED[template] = _Shapes(template)
    keys.append(key)
    _FILLED_ALL[key] = keys
    if len(keys) > MAX_SHAPES_PER_TEMPLATE:
        old = keys.popleft()
        _CACHE.pop(old, None)
        _FILLED_ALL.pop(old, None)
    if len(_FILLED_ALL) > MAX_FILLED_DECISIONS:
        old, of = _FILLED_ALL.popitem(last=False)
        of.remove(old)  # (the oldest of all is the oldest of its template: its deque's first)
        if not of:
            del _FILLED[of.template]
        _CACHE.pop(old, None)


def _as_strided(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``as_strided`` re-reading the whole contiguous input as a view and a permute
    (``autoparallel.engine.restride``), run as those two ops; None: decide it as itself."""
    x = args[0]
    bound = dict(zip(("size", "stride", "storage_offset"), args[1:]), **kwargs)
    found = as_view_permute(x._spec.shape, x._stride, bound["size"], bound["stride"], bound.get("storage_offset"))
    if found is None:
        return None
    shape, perm = found
    aten = torch.ops.aten
    v = dispatch(cls, aten.view.default, (x, list(shape)), {})
    return v if perm == tuple(range(len(perm))) else dispatch(cls, aten.permute.default, (v, list(perm)), {})


def clear_cache() -> None:
    """Forget every cached decision and shape-generic choice (and which ops warned that they run replicated)."""
    _CACHE.clear()
    _FILLED.clear()
    _FILLED_ALL.clear()
    generic.forget()
    forget_warnings()


@contextmanager
def observed_by(observer: Any) -> Iterator[Any]:
    """The engine's door for an observer of the op path (a local region's trace).

    Inside the block every DistTensor op calls ``observer.observe(func, decision, args, kwargs,
    run)`` instead of running: ``run()`` executes the op's local step; ``run(moves)`` moves the
    inputs inside the context manager ``moves`` (a local region's trace records the op's own
    local calls apart from its inputs' moves). Kernels may not defer
    statistics while an observer watches (what it records must run again as it ran).
    """
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.pop()


__all__ = ["clear_cache", "dispatch", "observed_by"]
