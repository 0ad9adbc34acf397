"""Executing a decision: move the inputs, run the local function on the shards, wrap the outputs.

Eager mode runs this for every op as it comes. In-place and ``out=`` ops keep the written
tensors' identity and layout (a written input that had to move is copied back into its own
shard).

A view whose input had to move to take it (``x[:, 2:5]`` on a ``Shard(1)`` ``x``: the slice is
taken of a gathered copy) is *detached*: its shard is no part of ``x``'s. A write through it is
carried back (``_write_through``): the view is taken again from its input (so it sees writes made
to the input since), written, and put back with the view's scatter (``slice_scatter``,
``select_scatter``, ``diagonal_scatter``; a reshape, transpose or permute undone) and an in-place
copy into the input, through as many detached views as the chain has. Reading a detached view
after its input changed still reads the value it was taken with (as a gathered copy would).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoparallel import compat, known_sums, runtime
from autoparallel.engine.decide import (
    Decision,
    InplaceViewDecision,
    LocalStep,
    OutKind,
    ValueDecision,
    flatten_out,
    map_args,
    place_locals,
)
from autoparallel.placement import Replicate
from autoparallel.runtime import comm, debug
from autoparallel.spec import DistSpec
from autoparallel.strides import conform, follows, nesting
from reshard.executor import run_any
from spmd_rules.random_ops import draw_outside, draws_random


def execute(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], d: Decision,
            redispatch: Callable[..., Any]) -> Any:
    """Run decision ``d`` for this call: move the inputs, run the local function, wrap the outputs
    (``redispatch``: the dispatcher, for an in-place view's out-of-place op and the writes carried
    back through detached views)."""
    if debug.active() and not debug.attributing(func):  # a CommDebugMode records: collectives name this op
        with debug.attributed(func):
            return execute(cls, func, args, kwargs, dts, d, redispatch)
    if type(d) is LocalStep and d.mutated:
        views = _written_views(func, dts, d.mutated)
        if views:
            return _write_through(cls, func, args, kwargs, dts, d, redispatch, views)
    return _run(cls, func, args, kwargs, dts, d, redispatch)


def _run(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], d: Decision,
         redispatch: Callable[..., Any]) -> Any:
    if type(d) is not LocalStep:
        if type(d) is ValueDecision:
            return d.value
        assert type(d) is InplaceViewDecision
        return _inplace_view(cls, func, d.view_op, args, kwargs, redispatch)
    member = d.coord is not None
    if member:
        locs = _moved(dts, d)
        if d.slots is not None:
            largs = place_locals(list(args), d.slots[0], locs)
            lkwargs = place_locals(dict(kwargs), d.slots[1], locs) if d.slots[1] else kwargs
        else:
            moved = {id(t): loc for t, loc in zip(dts, locs)}
            largs = map_args(cls, args, lambda t: moved[id(t)] if isinstance(t, cls) else t)
            lkwargs = map_args(cls, kwargs, lambda t: moved[id(t)] if isinstance(t, cls) else t)
        if d.local_fn is None:
            fn = compat.open_size_impl(func, largs) if func in compat.OPEN_SIZE_OPS else func
            out = fn(*largs, **lkwargs)
            if d.simple and isinstance(out, torch.Tensor):
                w = cls._wrap(_follow(out, d, 0), d.out_specs[0], d.out_strides[0])
                return _inherit_detached(w, dts, func, args, kwargs) if d.view_out else w
        else:
            assert d.context is not None
            out = d.local_fn(d.context, *largs, **lkwargs)
            if d.simple and isinstance(out, torch.Tensor):
                w = _bound(cls._wrap(_follow(out, d, 0), d.out_specs[0], d.out_strides[0]))
                return _inherit_detached(w, dts, func, args, kwargs) if d.view_out else w
    else:
        out = None
        if draws_random(func, args, kwargs):  # the mesh's ranks draw: this generator advances alike
            with torch.no_grad(), compat.no_dispatch():
                draw_outside(func, [t._spec for t in dts], args, kwargs, dts[0]._local.device)
    if d.fallback and member and not d.mutated:  # the kernel's outputs, whatever meta said
        return _wrap_unknown(cls, out, d, dts)
    if d.out_kind is OutKind.UNKNOWN and not d.mutated:
        raise outside(func, dts[0]._spec.mesh)
    if d.mutated:
        # Written tensors keep their identity and their layout. A written input that had to move
        # is copied back INTO its own shard: views of it (and what it is a view of) see the write.
        for i, back in zip(d.mutated, d.restore):
            if member and back is not None:
                dts[i]._local.copy_(run_any(locs[i], back))
        unknown = d.out_kind is OutKind.UNKNOWN
        kind = flatten_out(out)[0] if unknown and member else OutKind.TENSOR if unknown else d.out_kind
        if kind is OutKind.NONE or kind is OutKind.VALUE:
            return None if kind is OutKind.NONE else d.meta_value
        if unknown or all(a is not None for a in d.out_alias):
            written = [dts[i] for i in (d.mutated if unknown else d.out_alias) if i is not None]
            return written[0] if kind is OutKind.TENSOR else written if kind is OutKind.LIST else tuple(written)
    if member:
        _, louts = flatten_out(out)
        louts = [lo if lo is None else _follow(lo, d, k) for k, lo in enumerate(louts)]
    else:
        louts = [None if s is None else torch.empty((0,), dtype=s.dtype, device=dts[0]._local.device) for s in d.out_specs]
    # (an output the local step leaves undefined where meta gives a tensor: a gradient the
    # backward was not asked for, as ``native_batch_norm_backward``'s by its ``output_mask``)
    wrapped = [
        None if s is None or lo is None else cls._wrap(lo, s, st)
        for lo, s, st in zip(louts, d.out_specs, d.out_strides)
    ]
    if member and d.local_fn is not None:  # a kernel's notes on its shards (known_sums)
        for w in wrapped:
            if w is not None:
                _bound(w)
    if d.detached_view or (d.view_out and _any_detached(dts)):
        for w in wrapped:
            if w is not None:
                w._detached_view = True
        if len(wrapped) == 1 and wrapped[0] is not None and d.out_kind is OutKind.TENSOR:
            _mark_origin(wrapped[0], func, args, kwargs)
    if d.mutated:  # new outputs next to written inputs: the written ones are returned as themselves
        wrapped = [w if a is None else dts[a] for w, a in zip(wrapped, d.out_alias)]
    if d.out_kind is OutKind.TENSOR:
        return wrapped[0]
    if d.out_kind is OutKind.NONE:
        return None
    return tuple(wrapped) if d.out_kind is OutKind.TUPLE else wrapped


def _moved(dts: list[Any], d: LocalStep) -> list[torch.Tensor]:
    """Each DistTensor input's shard as the op takes it: moved by its plan, a copied shard made to
    follow its wrapper's strides."""
    locs = [t._local if p is None else run_any(t._local, p) for t, p in zip(dts, d.plans)]
    for t, loc in zip(dts, locs):
        known_sums.check(loc, t)  # a shard's note holds only while its DistTensor was not written
    for i, like, dense in d.in_conform:
        locs[i] = conform(locs[i], like, dense)
    return locs


def _bound(wrapped: Any) -> Any:
    """``wrapped``, its shard's note (``known_sums``) bound to it."""
    known_sums.bind(wrapped._local, wrapped)
    return wrapped


def _follow(local: torch.Tensor, d: LocalStep, k: int) -> torch.Tensor:
    """Output ``k``'s shard, made to follow the strides its wrapper advertises (a kernel may pick
    another memory layout on the local sizes or the moved inputs than the meta kernel did on the
    global ones: ``autoparallel.strides``); a view or written input is returned as it is."""
    dense = d.out_dense[k]
    if dense is None:
        return local
    like = d.out_strides[k]
    assert like is not None
    if comm.capturing() and any(isinstance(n, torch.SymInt) for n in dense):
        return _follow_open(local, like)
    if local.stride() == dense:
        return local
    return conform(local, like, dense)


def _follow_open(local: torch.Tensor, like: tuple[int, ...]) -> torch.Tensor:
    """``_follow`` in a capture of open sizes: the decision's symbolic strides were made outside
    the trace, so they are compared outside it (as guards), and a copy's strides are computed from
    the traced shard's sizes."""
    with compat.outside_trace(keep_fake=True):
        if follows(local.shape, local.stride(), like):
            return local
        order = nesting(like)
    # dense in ``like``'s nesting, out of place (a program's backward keeps no in-place copy)
    back = sorted(range(len(order)), key=order.__getitem__)
    return known_sums.carry(local, local.permute(order).contiguous().permute(back))


def _any_detached(dts: list[Any]) -> bool:
    return any(getattr(t, "_detached_view", False) for t in dts)


def _inherit_detached(w: Any, dts: list[Any], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``w``, a view of the inputs ``dts``, marked detached where one of them is: a view of a view
    whose layout had to change shares that view's shard, not the original's (``x[1:3][0]`` on a
    ``Shard(0)`` ``x``), so a write through it is carried back through that view too. The mark is
    metadata (every rank sets it alike)."""
    if _any_detached(dts):
        w._detached_view = True
        _mark_origin(w, func, args, kwargs)
    return w


# ---- writes through detached views ---------------------------------------------------------------
_aten = torch.ops.aten
# view op -> its scatter: ``scatter(input, view, *the view's arguments)`` is the input with the view written
_SCATTERS = {_aten.slice.Tensor: _aten.slice_scatter.default, _aten.select.int: _aten.select_scatter.default,
             _aten.diagonal.default: _aten.diagonal_scatter.default}
# views that only regroup or reorder dims: undone by the inverse order and a reshape to the input's shape
_REGROUPS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten._reshape_alias.default,
                       _aten.alias.default, _aten.detach.default, _aten.unsqueeze.default, _aten.squeeze.default,
                       _aten.squeeze.dim, _aten.squeeze.dims, _aten.transpose.int, _aten.t.default,
                       _aten.permute.default})
# writes that replace every element: the view need not be taken again first
_OVERWRITES = frozenset({_aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default})


def _mark_origin(w: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Note on the detached view ``w`` how it was taken (``func`` of ``args[0]``), where a write
    through it can be carried back; a view taken otherwise keeps no note (a write raises)."""
    if (func in _SCATTERS or func in _REGROUPS) and args and isinstance(args[0], type(w)):
        w._view_origin = (func, args, kwargs)


def mark_detached_alias(out: Any, x: Any) -> None:
    """``out``, sharing the shard of the detached view ``x`` (``x.detach()``): detached too, its
    writes carried back through ``x``."""
    out._detached_view = True
    out._view_origin = (_aten.alias.default, (x,), {})


def _written_views(func: Any, dts: list[Any], mutated: tuple[int, ...]) -> list[Any]:
    """The detached views ``func`` writes (each to be carried back); raises, on every rank alike,
    where one was taken by an op whose write cannot be carried back."""
    views: list[Any] = []
    for i in mutated:
        t = dts[i]
        if not getattr(t, "_detached_view", False):
            continue
        if not _carried(t):
            raise RuntimeError(
                f"{func}: in-place write to a view of a DistTensor whose layout had to change to "
                "take the view (by an op whose write cannot be carried back to the original); the write "
                "would not reach the original tensor. Reshard the original first (e.g. to Replicate on "
                "that dim) or write out of place.")
        if all(v is not t for v in views):
            views.append(t)
    return views


def _carried(t: Any) -> bool:
    """Whether a write to ``t`` reaches, view by view, a tensor that is no detached view."""
    while getattr(t, "_detached_view", False):
        origin = getattr(t, "_view_origin", None)
        if origin is None:
            return False
        t = origin[1][0]
    return True


def _write_through(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], d: LocalStep,
                   redispatch: Callable[..., Any], views: list[Any]) -> Any:
    """Run the write ``func`` on detached views and carry it back to what they view."""
    if func not in _OVERWRITES:
        for v in views:
            _take_again(cls, v, redispatch)
    out = _run(cls, func, args, kwargs, dts, d, redispatch)
    for v in views:
        _put_back(cls, v, redispatch)
    return out


def _take_again(cls: Any, v: Any, redispatch: Callable[..., Any]) -> None:
    """Refresh the detached view ``v`` from its input (which may have been written since)."""
    func, args, kwargs = v._view_origin
    base = args[0]
    if getattr(base, "_detached_view", False):
        _take_again(cls, base, redispatch)
    fresh = redispatch(cls, func, args, kwargs)
    if fresh._spec != v._spec:  # (the same decision on the same layouts: equal on every rank)
        raise RuntimeError(f"{func}: the view's input changed layout since the view was taken; take the view again")
    lf, lv = fresh._local, v._local
    if not (lf.data_ptr() == lv.data_ptr() and lf.stride() == lv.stride() and lf.shape == lv.shape):
        with torch.no_grad():
            v._local.copy_(lf)


def _put_back(cls: Any, v: Any, redispatch: Callable[..., Any]) -> None:
    """Write the detached view ``v`` into its input (and on, where that is a detached view too)."""
    func, args, kwargs = v._view_origin
    base = args[0]
    if func in _SCATTERS:
        whole = redispatch(cls, _SCATTERS[func], (base, v, *args[1:]), dict(kwargs))
    else:
        whole = _undo_regroup(cls, func, v, args, redispatch)
        whole = redispatch(cls, _aten.view.default, (whole, list(base.shape)), {})
    redispatch(cls, _aten.copy_.default, (base, whole), {})


def _undo_regroup(cls: Any, func: Any, v: Any, args: tuple[Any, ...], redispatch: Callable[..., Any]) -> Any:
    """``v`` in the dim order of the view's input, contiguous (a view to the input's shape follows)."""
    x = args[0]
    if func is _aten.transpose.int:
        v = redispatch(cls, _aten.transpose.int, (v, args[1], args[2]), {})
    elif func is _aten.t.default and x.dim() == 2:
        v = redispatch(cls, _aten.t.default, (v,), {})
    elif func is _aten.permute.default:
        order = [d % x.dim() for d in args[1]]
        v = redispatch(cls, _aten.permute.default, (v, sorted(range(len(order)), key=order.__getitem__)), {})
    return redispatch(cls, _aten.clone.default, (v,), {"memory_format": torch.contiguous_format})


def _inplace_view(cls: Any, func: Any, view_op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  redispatch: Callable[..., Any]) -> Any:
    """``x.squeeze_()`` and kin: ``x`` becomes the out-of-place view ``view_op(x)`` (its shard, a
    view of the old one, and its layout), and the wrapper's own sizes and strides follow."""
    x = args[0]
    out = redispatch(cls, view_op, args, kwargs)
    if getattr(out, "_detached_view", False) and not getattr(x, "_detached_view", False):
        raise RuntimeError(
            f"{func}: the layout of the DistTensor had to change to take this view in place; "
            f"reshard it first (e.g. to Replicate) or use the out-of-place {view_op}"
        )
    x._local, x._spec, x._stride = out._local, out._spec, out._stride
    x.__dict__.pop("_view_origin", None)  # (a detached view reshaped in place: its writes are not carried back)
    # Change the wrapper's metadata by running the op's meta kernel on it, dispatching nowhere
    # else (as torch.utils._python_dispatch.return_and_correct_aliasing does).
    with compat.no_dispatch(), compat.meta_in_tls():
        func(*args, **kwargs)
    assert tuple(x.shape) == x._spec.shape, (func, tuple(x.shape), x._spec)
    return x


def _wrap_unknown(cls: Any, out: Any, d: LocalStep, dts: list[Any]) -> Any:
    """Replicate DistTensors of exactly what a replicated (fallback) kernel returned (in a tuple
    mixing tensors and values, the tensors; the values pass through)."""
    kind, outs = flatten_out(out)
    if kind is OutKind.VALUE and isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        items = [_wrap_unknown(cls, o, d, dts) if isinstance(o, torch.Tensor) else o for o in out]
        return tuple(items) if isinstance(out, tuple) else items
    if kind is OutKind.VALUE or kind is OutKind.NONE:
        return out
    rep = tuple(Replicate() for _ in range(d.mesh.ndim))
    wrapped: list[Any] = []
    for o in outs:
        if o is None:
            wrapped.append(None)
            continue
        if o.is_conj() or o.is_neg():  # the wrapper cannot carry the lazy bit: materialise it
            o = o.resolve_conj().resolve_neg()
        stride = tuple(o.stride()) if o.layout == torch.strided else None
        w = cls._wrap(o, DistSpec(d.mesh, rep, tuple(o.shape), o.dtype), stride)
        if d.detached_view or (d.view_out and _any_detached(dts)):
            w._detached_view = True
        wrapped.append(w)
    if kind is OutKind.TENSOR:
        return wrapped[0]
    return tuple(wrapped) if kind is OutKind.TUPLE else wrapped


def outside(func: Any, mesh: Any) -> Exception:
    """The error of a rank outside ``mesh`` asked for a value only the mesh's ranks hold (``x.item()``,
    an op with no meta kernel): it has none to give."""
    rank, world = runtime.get_rank(), runtime.get_world_size()
    return ValueError(
        f"{func}: rank {rank} is outside {mesh!r} and holds no part of its tensors, so it has no value to "
        f"read here. Every process of the world ({world} ranks) runs the script: launch as many processes "
        f"as the meshes cover (torchrun --nproc-per-node {mesh.size} for this mesh), build the mesh over the "
        f"whole world, or read values on the mesh's ranks only (`if ap.get_rank() in mesh: ...`)")
