"""Shape-generic pieces of a decision: what a call at a new shape (a new sequence length) can
take from a call of the same signature at another shape, without deciding afresh.

Two things, each exact where it is used and nowhere else:

* **the choice** (``choice_key``, ``stored_choice``/``store_choice``): the strategy the rule and
  the cost comparison picked. The signature keeps every size that is not a multiple (>= 2) of
  the mesh's size exactly, and replaces each size that is by its rank among all sizes of the
  call, so every comparison and equality between sizes, divisibility by any product of mesh
  axes, evenness of every piece and size-1 broadcasting read the same; with it the op, the
  non-tensor arguments exactly (``view``'s sizes: a new length is a new signature), dtypes,
  placements, shard orders and mesh shape. A choice is stored only when it compared no costs:
  the one strategy taking every input as it is (the lexicographic cost puts it first at any
  size; several such strategies, or none, compare bytes that scale with sizes and are decided
  afresh). Calls that write an input, or whose arguments name one of the generic sizes, are
  not stored — except a view, whose size is its output's shape: its key holds instead where
  its dims regroup (the prefix products both shapes share), all its rule reads beyond ranks.
* **the output's metadata** (``known_out``/``learn_out``): for ops whose output shape follows
  from their definition — pointwise ops (``torch.Tag.pointwise``) and softmax on inputs of one
  shape, ``mm``/``addmm``/``bmm`` (any strides), ``view`` (the size with -1 resolved), ``nll_loss``,
  ``layer_norm`` and their backwards — on contiguous inputs, the outputs are contiguous tensors of those shapes, and only
  their dtypes (a function of the dtypes and the non-tensor arguments; a view's size aside) are
  learned from one meta run. The meta kernel then runs once per dtype signature, not per shape.

``tests/pure/test_generic_choice.py`` checks both against fresh decisions over random shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.spec import DistSpec
from spmd_rules.base import OpCall, Strategy, TensorMeta

_aten = torch.ops.aten
MAX_ENTRIES = 16384
_CHOICES: dict[Any, Strategy] = {}
_OUT_DTYPES: dict[Any, tuple[torch.dtype, ...]] = {}
# Ops whose one output has the shape of their tensor inputs (all of one shape), besides pointwise ones.
_SAME_SHAPE = frozenset({
    _aten._softmax.default, _aten._log_softmax.default,
    _aten._softmax_backward_data.default, _aten._log_softmax_backward_data.default,
})
_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default})
# ops returning a tuple: (output, total_weight), (output, mean, rstd), the gradients asked for
_TUPLE = frozenset({_aten.nll_loss_forward.default, _aten.native_layer_norm.default,
                    _aten.native_layer_norm_backward.default})


def forget() -> None:
    """Forget every shape-generic choice and output dtype (with a cleared decision cache)."""
    _CHOICES.clear()
    _OUT_DTYPES.clear()


# ---- the choice ------------------------------------------------------------------------------
def choice_key(call: OpCall, specs: Sequence[DistSpec]) -> Any:
    """The signature a choice for ``call`` is stored under (module docstring), or None."""
    n = 1
    for a in call.mesh_shape:
        n *= a
    sizes = sorted({s for m in (*call.inputs, *call.out) if m is not None for s in m.shape})
    rank = {s: i for i, s in enumerate(sizes)}

    def meta(m: TensorMeta | None) -> Any:
        if m is None:
            return None
        return tuple(("g", rank[s]) if s >= 2 and s % n == 0 else s for s in m.shape), m.dtype

    generic = {s for s in sizes if s >= 2 and s % n == 0}
    named: list[bool] = []
    args: tuple[Any, ...] = call.args
    extra: tuple[tuple[int, int], ...] = ()
    if call.op in _VIEWS and len(call.inputs) == 1 and call.out and call.out[0] is not None:
        # a view's size is its output's shape (in the key); what its rule reads of the sizes
        # beyond their ranks is which dims group together: the prefix products both sides share
        args, extra = call.args[:1], _groups(call.inputs[0].shape, call.out[0].shape)

    def arg(a: Any) -> Any:
        if isinstance(a, TensorMeta):
            return meta(a)
        if isinstance(a, (list, tuple)):
            return type(a).__name__, tuple(arg(x) for x in a)
        if type(a) is int and a in generic:
            named.append(True)
        return a

    key = (call.op, call.mesh_shape, call.placements, tuple(s.shard_order for s in specs),
           tuple(meta(m) for m in call.inputs), tuple(meta(m) for m in call.out), arg(args),
           tuple((k, arg(v)) for k, v in call.kwargs.items()), extra)
    if named:  # an argument names a size (``view``'s lengths): no other shape has this key
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _groups(src: Sequence[int], dst: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Every ``(i, j)`` with ``prod(src[:i]) == prod(dst[:j])``: where a view's dims regroup."""
    pre_dst: dict[int, list[int]] = {}
    p = 1
    for j in range(len(dst) + 1):
        pre_dst.setdefault(p, []).append(j)
        if j < len(dst):
            p *= dst[j]
    out = []
    p = 1
    for i in range(len(src) + 1):
        out += [(i, j) for j in pre_dst.get(p, ())]
        if i < len(src):
            p *= src[i]
    return tuple(out)


def stored_choice(key: Any) -> Strategy | None:
    return _CHOICES.get(key) if key is not None else None


def store_choice(key: Any, best: Strategy) -> None:
    if len(_CHOICES) >= MAX_ENTRIES:
        _CHOICES.clear()
    _CHOICES[key] = best


# ---- the output's metadata -------------------------------------------------------------------
def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` as torch gives a new contiguous tensor (size 0/1 dims: 1)."""
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


def out_shape(func: Any, inputs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
              args: Sequence[Any] = ()) -> tuple[int, ...] | None:
    """The output shape ``func`` has by definition on these DistTensor inputs ((shape, stride)
    each, in argument order), where it is one contiguous tensor; None where that is not known.
    ``args``: the call's arguments (a view's size, a loss's reduction)."""
    shapes = _out_shapes(func, inputs, args)
    return shapes[0] if shapes is not None and func not in _TUPLE else None


def _out_shapes(func: Any, inputs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                args: Sequence[Any]) -> tuple[tuple[int, ...], ...] | None:
    """Every output's shape (each a new contiguous tensor, or a view of a contiguous input with
    contiguous strides), or None."""
    shapes = [s for s, _ in inputs]
    # products and losses: new contiguous tensors whatever their inputs' strides
    if func is _aten.mm.default and len(shapes) == 2 and all(len(s) == 2 for s in shapes):
        return ((shapes[0][0], shapes[1][1]),)
    if func is _aten.addmm.default and len(shapes) == 3 and all(len(s) == 2 for s in shapes[1:]):
        return ((shapes[1][0], shapes[2][1]),)
    if func is _aten.bmm.default and len(shapes) == 2 and all(len(s) == 3 for s in shapes):
        return ((shapes[0][0], shapes[0][1], shapes[1][2]),)
    if any(stride != contiguous_strides(shape) for shape, stride in inputs):
        return None  # the rest: their outputs follow their inputs' strides
    if func is _aten.native_layer_norm.default and len(args) >= 2 and _is_tensor(args[0]) and _sizes(args[1]):
        x, axis = tuple(args[0].shape), args[0].dim() - len(args[1])
        stat = x[:axis] + (1,) * len(args[1])
        return (x, stat, stat) if axis >= 0 and x[axis:] == tuple(args[1]) else None
    if (func is _aten.native_layer_norm_backward.default and len(args) == 8 and all(_is_tensor(a) for a in args[5:7])
            and _is_tensor(args[1]) and list(args[7]) == [True, True, True]):  # all three gradients asked for
        return tuple(tuple(a.shape) for a in (args[1], args[5], args[6]))
    if func in _VIEWS and len(shapes) == 1 and len(args) >= 2:
        size = _view_size(shapes[0], args[1])
        return None if size is None else (size,)
    if func is _aten.nll_loss_forward.default and len(args) >= 4 and _is_tensor(args[0]) and args[0].dim() in (1, 2):
        out = (args[0].shape[0],) if args[3] == 0 and args[0].dim() == 2 else ()  # reduction none: one per row
        return tuple(out), ()
    if func is _aten.nll_loss_backward.default and len(args) >= 2 and _is_tensor(args[1]):
        return (tuple(args[1].shape),)
    if shapes and (func in _SAME_SHAPE or torch.Tag.pointwise in getattr(func, "tags", ())):
        return (shapes[0],) if all(s == shapes[0] for s in shapes[1:]) else None
    return None


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _sizes(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(type(s) is int for s in x)


def _view_size(shape: tuple[int, ...], size: Any) -> tuple[int, ...] | None:
    """``view(size)`` of a contiguous tensor of ``shape``: ``size`` with -1 resolved; None where
    it is not a valid view (the meta kernel then says why)."""
    if not isinstance(size, (list, tuple)) or not all(type(s) is int for s in size):
        return None
    numel = 1
    for s in shape:
        numel *= s
    known, free = 1, [k for k, s in enumerate(size) if s == -1]
    for s in size:
        if s != -1:
            if s < 0:
                return None
            known *= s
    if len(free) > 1:
        return None
    out = list(size)
    if free:
        if known == 0 or numel % known:
            return None
        out[free[0]] = numel // known
    elif known != numel:
        return None
    return tuple(out)


def out_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_dist: Any) -> Any:
    """What an ``out_shape`` op's output dtype depends on: the op, each tensor's dtype (and
    rank), every other argument exactly (a view's size aside: a view keeps its input's dtype);
    None if unhashable."""
    def arg(a: Any) -> Any:
        if is_dist(a):
            return "dist", a.dtype, a.dim()
        if isinstance(a, torch.Tensor):
            return "tensor", a.dtype, a.dim()
        if isinstance(a, (list, tuple)):
            return type(a).__name__, tuple(arg(x) for x in a)
        return a

    if func in _VIEWS:
        args = args[:1]
    key = (func, arg(args), tuple((k, arg(v)) for k, v in kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def known_out(func: Any, key: Any, inputs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
              args: Sequence[Any] = ()) -> Any:
    """The output (a meta tensor, or a tuple of them) of an ``out_shape`` op whose dtypes were
    learned, else None."""
    dtypes = _OUT_DTYPES.get(key) if key is not None else None
    if dtypes is None:
        return None
    shapes = _out_shapes(func, inputs, args)
    if shapes is None or len(shapes) != len(dtypes):
        return None
    outs = tuple(torch.empty_strided(s, contiguous_strides(s), dtype=d, device="meta") for s, d in zip(shapes, dtypes))
    return outs if func in _TUPLE else outs[0]


def learn_out(func: Any, key: Any, inputs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], fake_out: Any,
              args: Sequence[Any] = ()) -> None:
    """Store the output dtypes of an ``out_shape`` op where its meta kernel agreed with it."""
    if key is None:
        return
    outs = tuple(fake_out) if func in _TUPLE and isinstance(fake_out, (tuple, list)) else (fake_out,)
    shapes = _out_shapes(func, inputs, args)
    if shapes is None or len(shapes) != len(outs):
        return
    for o, s in zip(outs, shapes):
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != s or tuple(o.stride()) != contiguous_strides(s):
            return
    if len(_OUT_DTYPES) >= MAX_ENTRIES:
        _OUT_DTYPES.clear()
    _OUT_DTYPES[key] = tuple(o.dtype for o in outs)


__all__ = ["choice_key", "contiguous_strides", "forget", "known_out", "learn_out", "out_key", "out_shape",
           "store_choice", "stored_choice"]
