"""The op path: ``__torch_dispatch__`` -> cached decision -> local step.

A *decision* (``autoparallel.engine.decide``: chosen input layouts, their reshard plans, the
local function, output specs and strides) is a pure function of the op, the inputs' specs and
strides, and the non-tensor arguments, so it is cached on exactly that key (``call_key``) and
every rank reaches the same one. Deciding lives in ``decide``, running a decision in
``execute``; this module keys the call, adopts the plain tensors a call mixes with DistTensors
(as Replicate, docs/plain_tensors.md), keeps the cache, and is the engine's door for an
observer of the op path (``observed_by``).

``as_strided`` that only re-reads a whole tensor in another order is run as a view and a
permute (``as_view_permute``): kernels and autograd formulas use ``as_strided`` where a reshape
would do (``adaptive_avg_pool2d`` to 1 x 1 restrides its output channels-last; ``as_strided``'s
backward re-reads a flat zero storage as the input's and the output's geometry). It has no SPMD
rule — it addresses storage, which a sharded tensor does not have as one piece — but when the
input is contiguous and the asked geometry covers every element exactly once (dense,
non-overlapping, offset 0), it is ``x.view(sizes sorted by stride).permute(...)``, two ops with
rules.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from time import perf_counter
from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.engine import generic
from autoparallel.engine.decide import Decision, DecomposeDecision, decide, forget_warnings, mesh_coord, written_args
from autoparallel.engine.execute import execute, mark_detached_alias
from autoparallel.log import Tally, logger
from autoparallel.placement import Replicate
from autoparallel.runtime import agree, comm
from autoparallel.runtime.comm import profiled
from autoparallel.spec import DistSpec, shape_key


# ---- keys: the hashable description of a call, and the plain tensors it mixes in -----------------
def call_key(cls: Any, items: tuple[Any, ...], dts: list[Any], plain: list[torch.Tensor]) -> tuple[Any, ...]:
    """Hashable description of the arguments; collects DistTensors into ``dts`` in order, and
    plain tensors of one or more dims into ``plain`` (0-dim ones count as scalars)."""
    out: list[Any] = []
    for a in items:
        if isinstance(a, cls):
            dts.append(a)
            out.append((a._spec, shape_key(a._stride) if a._spec.symbolic else a._stride))
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                plain.append(a)
            out.append(("scalar_tensor", a.dtype))
        elif isinstance(a, (list, tuple)):
            out.append((type(a).__name__, call_key(cls, tuple(a), dts, plain)))
        elif isinstance(a, torch.SymInt):
            out.append(shape_key((a,)))  # type: ignore[arg-type]
        else:
            out.append(a)
    return tuple(out)


def adopt_plain(
    cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], plain: list[torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with every plain tensor of one or more dims made a Replicate DistTensor.

    The policy (docs/plain_tensors.md): a plain tensor mixed with DistTensors in one op is the
    same full value on every rank, like a Python scalar, so it is Replicate on the DistTensors'
    mesh. Torch itself makes such tensors inside decompositions and backward formulas (zeros,
    ones, index tensors), and user code indexes with them (``x[idx]``). A plain tensor is refused
    (TypeError, before any collective) when it requires grad (its gradient would have to be a
    plain tensor; above autograd, ``DistTensor.__torch_function__`` has made such tensors
    DistTensors where the mesh is the whole world), when the op writes it and the mesh is not the whole world (ranks outside the
    mesh would not write it; inside, the adopted tensor's shard IS the plain tensor, so the full
    result lands in it), or when the DistTensors live on several meshes (no mesh to replicate on).
    Plain tensors whose values differ across the mesh's ranks raise a ``ValueError`` on every rank
    (``agree.check_plain``: the first calls of each op, every call with ``AUTOPARALLEL_CHECK=1``).
    """
    what = f"{func}: cannot mix a DistTensor with a plain tensor of shape {tuple(plain[0].shape)}"
    meshes = list(dict.fromkeys(d._spec.mesh for d in dts))
    if len(meshes) > 1:
        raise TypeError(f"{what}: the DistTensors live on {len(meshes)} meshes, so it has no mesh to be "
                        "replicated on; make it a DistTensor first (ap.shard_tensor)")
    grad = next((t for t in plain if t.requires_grad), None)
    if grad is not None:
        raise TypeError(f"{func}: cannot mix a DistTensor with a plain tensor of shape {tuple(grad.shape)} "
                        "that requires grad (its gradient would be a plain tensor on every rank); make it a "
                        "DistTensor first (ap.shard_tensor)")
    mesh = meshes[0]
    written = {id(t) for t in written_args(func, args, kwargs)}
    hit = next((t for t in plain if id(t) in written), None)
    if hit is not None and mesh.size != runtime.get_world_size():
        raise TypeError(f"{func}: cannot write a DistTensor result into a plain tensor of shape "
                        f"{tuple(hit.shape)}: the ranks outside mesh {mesh} would not write it; "
                        "make it a DistTensor first (ap.shard_tensor)")
    member = mesh_coord(mesh) is not None
    agree.check_plain(str(func), mesh, plain)  # the same value on every rank, or one error everywhere
    adopted: dict[int, Any] = {}

    def adopt(t: torch.Tensor) -> Any:
        if id(t) not in adopted:
            adopted[id(t)] = adopt_one(cls, t, mesh, member)
        return adopted[id(t)]

    return _adopted(cls, args, adopt), {k: _adopted(cls, v, adopt) for k, v in kwargs.items()}


def adopt_one(cls: Any, t: torch.Tensor, mesh: Any, member: bool | None = None) -> Any:
    """The plain tensor ``t`` as the Replicate DistTensor on ``mesh`` an op adopts it as: its
    shard is ``t`` itself on the mesh's ranks (an empty tensor elsewhere). ``member``: whether
    this rank is on the mesh, if known."""
    if member is None:
        member = mesh_coord(mesh) is not None
    local = t if member else t.new_empty((0,))
    stride = tuple(t.stride()) if t.layout == torch.strided else None
    return cls._wrap(local, DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(t.shape), t.dtype), stride)


def _adopted(cls: Any, a: Any, adopt: Any) -> Any:
    """``a`` with every plain tensor of one or more dims as ``adopt`` makes it (a module function:
    a closure calling itself is a reference cycle holding the tensors until a full collection)."""
    if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.dim() != 0:
        return adopt(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_adopted(cls, x, adopt) for x in a)
    return a


# Python-level names of the in-place methods that write their first argument besides ``*_``.
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def is_in_place_name(name: str) -> bool:
    """Whether a torch function named ``name`` writes its first argument (``add_``, ``__setitem__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


def adopt_written_plain(cls: Any, name: str, args: tuple[Any, ...]) -> None:
    """Make a plain tensor that an in-place op writes with a value that requires grad a Replicate
    DistTensor, in place (``torch.utils.swap_tensors``), before autograd sees the op.

    Models build buffers with factories and fill them in place with computed values: Mixtral's
    MoE ``final = torch.zeros(...)`` then ``final.index_add_(0, idx, expert_out)`` per expert.
    With ``expert_out`` a DistTensor, written into the plain ``final`` below autograd, the plain
    tensor would carry a gradient path autograd cannot take (a plain gradient for a DistTensor),
    and the next write was refused. Made a DistTensor first, it is an ordinary written
    DistTensor: autograd records on it, later ops see one layout. The policy is
    ``adopt_plain``'s (docs/plain_tensors.md): the plain value is the same on every rank, the
    DistTensors share one mesh of the whole world; otherwise nothing changes here and the op
    raises as before. Called from ``DistTensor.__torch_function__`` (above autograd).
    """
    if not is_in_place_name(name):
        return
    if not args or type(args[0]) is not torch.Tensor or args[0].requires_grad or args[0].dim() == 0:
        return
    dts = [a for a in args[1:] if isinstance(a, cls)]
    if not dts or not torch.is_grad_enabled() or not any(d.requires_grad for d in dts):
        return
    meshes = {d._spec.mesh for d in dts}
    if len(meshes) != 1:
        return
    mesh = meshes.pop()
    if mesh.size != runtime.get_world_size():
        return
    plain = args[0]
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    stride = tuple(plain.stride()) if plain.layout == torch.strided else None
    new = cls._wrap(plain.detach(), DistSpec(mesh, rep, tuple(plain.shape), plain.dtype), stride)
    try:
        torch.utils.swap_tensors(plain, new)
    except RuntimeError:  # weak references or other holders: leave it; the op raises as before
        return


def whole_world_mesh(cls: Any, items: tuple[Any, ...]) -> Any:
    """The one mesh the DistTensors among ``items`` live on, if it spans the whole world (None:
    several meshes, or ranks outside it): where a plain tensor that requires grad can join them
    as Replicate, every rank holding its value."""
    meshes = {a._spec.mesh for a in items if isinstance(a, cls)}
    if len(meshes) != 1:
        return None
    mesh = meshes.pop()
    return mesh if mesh.size == runtime.get_world_size() else None


def adopt_plain_leaves(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Lay out, in place, every plain leaf that requires grad (a parameter left plain) that an op
    mixes with DistTensors: it becomes a Replicate DistTensor (a Parameter stays a Parameter;
    ``torch.utils.swap_tensors``, so a module or an optimizer holding it holds the DistTensor).

    Paddle's convention: a plain parameter meeting distributed tensors is replicated, and its
    gradient is the full gradient, so any optimizer keeps it in sync. Its values must agree
    across the mesh (``agree.check_plain``: the same value on every rank, or one error
    everywhere). Called from ``DistTensor.__torch_function__`` (above autograd, so autograd
    records the op on the DistTensor). Nothing changes — and the op raises its ``TypeError`` —
    for a non-leaf, when the DistTensors live on several meshes, or when the mesh is not the
    whole world (ranks outside it would hold no value of the parameter).
    """
    leaves = [a for a in (*args, *kwargs.values())
              if type(a) in (torch.Tensor, torch.nn.Parameter) and a.requires_grad and a.is_leaf and a.dim() != 0]
    if not leaves:
        return
    mesh = whole_world_mesh(cls, (*args, *kwargs.values()))
    if mesh is None:
        return
    agree.check_plain(f"a plain parameter in {getattr(func, '__name__', func)}", mesh, leaves)
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    for t in dict.fromkeys(leaves):  # (one tensor passed twice is laid out once)
        stride = tuple(t.stride()) if t.layout == torch.strided else None
        new = cls._wrap(t.detach(), DistSpec(mesh, rep, tuple(t.shape), t.dtype), stride, True)
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new)
        try:
            torch.utils.swap_tensors(t, new)
        except RuntimeError:  # weak references or other holders: leave it; the op raises as before
            continue


# ---- as_strided as a view and a permute (pure metadata) ------------------------------------------
def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def as_view_permute(shape: Sequence[int], strides: Sequence[int], size: Sequence[int], stride: Sequence[int],
                    offset: int | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(view_shape, perm)`` with ``x.view(view_shape).permute(perm) == x.as_strided(size, stride,
    offset)`` for ``x`` of this shape and strides, or None where no such pair exists (a strided
    input, a window, overlapping or gapped strides)."""
    if offset not in (None, 0) or len(size) != len(stride) or not _contiguous(shape, strides):
        return None
    if math.prod(size) != math.prod(shape) or math.prod(size) == 0:
        return None
    order = sorted(range(len(size)), key=lambda d: (-int(stride[d]), d))
    expected = 1
    for d in reversed(order):
        if size[d] == 1:
            continue  # a size-1 dim's stride addresses nothing
        if int(stride[d]) != expected:
            return None
        expected *= int(size[d])
    return tuple(int(size[d]) for d in order), tuple(order.index(i) for i in range(len(size)))


# ---- the op path ---------------------------------------------------------------------------------
_CACHE: dict[Any, Decision] = {}
_SYMBOLIC: list[dict[Any, Decision]] = []  # a symbolic capture's own decisions (``symbolic_decisions``)
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
        out = cls._wrap(x._local.detach(), x._spec, x._stride)
        if getattr(x, "_detached_view", False):  # shares a detached view's shard: detached too
            mark_detached_alias(out, x)
        return out
    if func is _AS_STRIDED and type(args[0]) is cls:
        out = _as_strided(cls, args, kwargs)
        if out is not None:
            return out
    dts: list[Any] = []
    plain: list[torch.Tensor] = []
    key: tuple[Any, ...] = (func, call_key(cls, args, dts, plain),
                            call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    if not dts:
        return func(*args, **kwargs)
    if plain:  # rare: adopt them as Replicate, then key the call again
        args, kwargs = adopt_plain(cls, func, args, kwargs, dts, plain)
        dts, plain = [], []
        key = (func, call_key(cls, args, dts, plain), call_key(cls, tuple(kwargs.items()), dts, plain) if kwargs else ())
    target = _grad_target(cls)
    if target is not None:  # in a backward, making a laid-out parameter's gradient
        key += (target,)
    symbolic = bool(_SYMBOLIC) and _symbolic(dts, key)
    cache = _SYMBOLIC[-1] if symbolic else _CACHE
    decision = cache.get(key)
    if decision is None:
        filled: list[Any] = []
        start = perf_counter()
        # a cache miss: rules and reshard plans, from metadata (in a capture, outside its trace:
        # the meta computations of a decision are not the step's ops)
        with profiled("autoparallel::plan", func), compat.outside_trace(symbolic) if comm.capturing() else _NOTHING:
            decision = decide(cls, func, args, kwargs, dts, filled, target, symbolic)
        _PLANNING.add(start)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("dispatch: planned %s for inputs %s", func, [str(d._spec) for d in dts])
        if len(cache) >= MAX_CACHED_DECISIONS:  # e.g. a changing Python scalar in the key
            cache.clear()
            _FILLED.clear()
            _FILLED_ALL.clear()
        cache[key] = decision
        if filled:
            _keep_filled(filled[0], key)
    if type(decision) is DecomposeDecision:  # its ops are decided (and observed) one by one
        return func.decompose(*args, **kwargs)
    if _OBSERVERS:  # an observer watches the op path (a capture: autoparallel.static.capture)
        return _OBSERVERS[-1].observe(func, decision, args, kwargs,
                                      lambda: execute(cls, func, args, kwargs, dts, decision, dispatch))
    return execute(cls, func, args, kwargs, dts, decision, dispatch)


def _grad_target(cls: Any) -> DistSpec | None:
    """The layout of the parameter whose gradient the running backward node makes (its only
    successor accumulates into it: ``compat.accumulated_leaf``); None elsewhere. Where a rule's
    strategies tie, the op's output takes this layout rather than one the optimizer must move
    (a replicated position table's gradient is not row-sharded only to be gathered back)."""
    leaf = compat.accumulated_leaf()
    return leaf._spec if isinstance(leaf, cls) else None


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
    (``as_view_permute``, above), run as those two ops; None: decide it as itself."""
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


def _symbolic(dts: list[Any], key: Any) -> bool:
    """Whether a call's key holds a size a symbolic capture leaves open (a ``torch.SymInt``)."""
    return any(d._spec.symbolic for d in dts) or _holds_symbol(key)


def _holds_symbol(key: Any) -> bool:
    if isinstance(key, tuple):
        if len(key) == 3 and key[0] == "sym":
            return True
        return any(_holds_symbol(k) for k in key)
    return False


@contextmanager
def symbolic_decisions() -> Iterator[None]:
    """The decisions of calls on open sizes (a symbolic capture's ``torch.SymInt`` sizes) are kept
    for the block only: they hold its shape environment's symbols, which mean nothing after it."""
    _SYMBOLIC.append({})
    try:
        yield
    finally:
        _SYMBOLIC.pop()


@contextmanager
def observed_by(observer: Any) -> Iterator[Any]:
    """The engine's door for an observer of the op path (a capture's: ``static.capture``).

    Inside the block every DistTensor op calls ``observer.observe(func, decision, args, kwargs,
    run)`` instead of running: ``run()`` executes the op's local step. Kernels may not defer
    statistics while an observer watches (what it records must run again as it ran).
    """
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.pop()


__all__ = ["adopt_plain", "adopt_plain_leaves", "adopt_written_plain", "as_view_permute", "call_key", "clear_cache", "dispatch", "is_in_place_name", "observed_by", "symbolic_decisions", "whole_world_mesh"]
