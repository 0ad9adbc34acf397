"""Deciding: rule -> strategy choice -> reshard plans, for one op call (pure metadata, cached by
the dispatcher), and what a decision is.

The rule for the op (``spmd_rules``) offers strategies; the cheapest (bytes moved, inputs
changed, local output size: lexicographic) wins; the planner (``reshard``) plans each input's
move. Ops with no rule, or whose rule offers nothing, run replicated and warn once.

A decision is one of three records, a pure function of global metadata:

- ``LocalStep``: the common one. What to move (a reshard plan per DistTensor input, and for
  in-place writes the way back), the local function to run on the shards (the op itself, or a
  kernel with its ``LocalContext``), and how to wrap the outputs (specs, strides, which outputs
  are written inputs).
- ``ValueDecision``: the result is a Python value known from metadata alone (``x.dim()``-like
  ops that reach dispatch); nothing runs.
- ``InplaceViewDecision``: ``x.squeeze_()`` and kin run as their out-of-place view, then the
  wrapper takes the view's shard and layout.

An observer of the op path (``dispatch.observed_by``) reads ``fallback``, ``plans`` and
``out_kind`` of whichever kind it is handed. Deciding also reads which inputs an op writes
(``self`` of ``add_``, ``out=``; from the op's schema) and where the DistTensors sit in a call's
``(args, kwargs)`` (its slots), which running a decision (``execute``) uses too.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any, TypeVar

import torch

from autoparallel import compat, runtime
from autoparallel.engine import generic
from autoparallel.engine.kernels import Collectives, kernel_for
from autoparallel.placement import Replicate, StridedShard
from autoparallel.spec import DistSpec
from autoparallel.strides import dense_strides
from reshard.choice import as_is, cheapest, cost, multiplies, plan_price, plan_to
from reshard.crossmesh import CrossMeshPlan, plan_best
from reshard.plan import RELABEL, SLICE, Plan
from spmd_rules.base import LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import get_out_shapes, get_rule

# ---- the decision records ------------------------------------------------------------------------
AnyPlan = Plan | CrossMeshPlan


class OutKind(enum.Enum):
    """The shape of an op's result."""

    TENSOR = "tensor"    # one tensor
    TUPLE = "tuple"      # a tuple of tensors (None entries allowed)
    LIST = "list"        # a list of tensors
    NONE = "none"        # None
    VALUE = "value"      # a Python value (``item()``, ``equal``), not tensors
    UNKNOWN = "unknown"  # no meta kernel said: known only once the kernel ran (fallback)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalStep:
    """Move the inputs, run a local function on the shards, wrap the outputs."""

    # where
    mesh: Any
    coord: tuple[int, ...] | None                      # this rank's mesh coordinate (None: not a member)
    # what to move
    plans: tuple[AnyPlan | None, ...]                  # per DistTensor input (None: used as it is)
    in_specs: tuple[DistSpec, ...]                     # each DistTensor input's layout as the op runs
    in_conform: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()  # (input, its wrapper's
    #   strides, dense local strides in their nesting) per input a plan copies: the moved shard follows them
    restore: tuple[AnyPlan | None, ...] = ()           # per written input: back to its own layout
    slots: Any = None                                  # where each DistTensor sits in (args, kwargs)
    # the local function
    local_fn: Callable[..., Any] | None = None         # a kernel (None: the op itself)
    call: OpCall | None = None                         # the call as the rule saw it
    context: LocalContext | None = None                # the kernel's view of the call
    # how the outputs are wrapped
    out_kind: OutKind = OutKind.TENSOR
    out_specs: tuple[DistSpec | None, ...] = ()         # per output (None: not a tensor)
    out_strides: tuple[tuple[int, ...] | None, ...] = ()
    out_dense: tuple[tuple[int, ...] | None, ...] = ()  # per new output: dense local strides nested as
    #   out_strides (its shard is made to follow them); None: a view or written input, or off the mesh
    out_alias: tuple[int | None, ...] = ()              # per output: the written input it is (None: new)
    mutated: tuple[int, ...] = ()                       # DistTensor inputs written (in place, out=)
    meta_value: Any = None                              # the result where out_kind is VALUE and inputs are written
    fallback: bool = False                              # no rule: replicated inputs, the kernel's own outputs
    detached_view: bool = False                         # a view whose input had to move (writes cannot reach it)
    view_out: bool = False                              # the op returns a view of an input (a view of a
    #   detached view is detached too: ``execute._inherit_detached``)
    simple: bool = False                                # one new tensor out, nothing written: wrap and return


def evolve(obj: _T, **changes: Any) -> _T:
    """``dataclasses.replace`` for the frozen slots dataclasses a decision is made of (``LocalStep``,
    ``LocalContext``; neither has a ``__post_init__``): the copy is built field by field, not
    through ``__init__`` (a decision filled in at a new sequence length makes three per op).
    Like ``dataclasses``' own ``__init__``, the copier of each class is generated once, as code
    naming its fields (a keyword per field, each slot set through its descriptor): ~1.3 us a
    copy of ``LocalStep``, against ~4 us for a loop over the fields."""
    copier = _COPIERS.get(type(obj))
    if copier is None:
        copier = _COPIERS[type(obj)] = _copier(type(obj))
    try:
        return copier(obj, **changes)  # type: ignore[no-any-return]
    except TypeError:
        unknown = set(changes) - {f.name for f in fields(obj)}  # type: ignore[arg-type]
        if unknown:
            raise TypeError(f"evolve: {type(obj).__name__} has no fields {sorted(unknown)}") from None
        raise


def _copier(cls: type) -> Callable[..., Any]:
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    assert not hasattr(cls, "__post_init__") and set(names) == set(getattr(cls, "__slots__", ())), cls
    assert all(n.isidentifier() and not n.startswith("_") for n in names), names
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_KEEP": _KEEP}
    env.update({f"_set_{n}": cls.__dict__[n].__set__ for n in names})
    params = ", ".join(f"{n}=_KEEP" for n in names)
    body = "".join(f"    _set_{n}(new, obj.{n} if {n} is _KEEP else {n})\n" for n in names)
    exec(f"def copy(obj, *, {params}):\n    new = _new(_cls)\n{body}    return new\n", env)  # noqa: S102
    return env["copy"]  # type: ignore[no-any-return]


_T = TypeVar("_T")
_KEEP = object()  # a field not given to ``evolve``: copied from the original
_COPIERS: dict[type, Callable[..., Any]] = {}


@dataclass(frozen=True, slots=True)
class ValueDecision:
    """The op's result is ``value``, known from metadata (nothing runs, nothing moves)."""

    value: Any
    fallback = False
    plans = ()
    out_kind = OutKind.VALUE


@dataclass(frozen=True, slots=True)
class InplaceViewDecision:
    """An in-place view op: run ``view_op`` (its out-of-place form), then re-point the wrapper."""

    view_op: Any
    fallback = False
    plans = ()
    out_kind = OutKind.TENSOR


@dataclass(frozen=True, slots=True)
class DecomposeDecision:
    """An op without a rule that torch defines by other ops (``compat.decomposable``: ``linear``
    under ``torch.inference_mode``): run its definition, whose ops are decided one by one."""

    fallback = False
    plans = ()
    out_kind = OutKind.UNKNOWN


Decision = LocalStep | ValueDecision | InplaceViewDecision | DecomposeDecision


# ---- aliases: which inputs an op writes, which outputs are those inputs --------------------------
aten = torch.ops.aten

# Ops that write arguments their schema does not mark ``(a!)``: op -> (the written arguments,
# the bool argument that must be true for the write). ``native_batch_norm`` updates its running
# statistics in place in training mode although its schema declares them read-only (the
# functional ``_native_batch_norm_legit`` marks them). Missed, a running statistic that the plan
# moved (sliced to the channel shard) was written in the moved copy only: under data parallelism
# each rank kept 1/n of the update (tests/world/test_batch_norm_world.py).
UNMARKED_WRITES: dict[Any, tuple[tuple[str, ...], str]] = {
    aten.native_batch_norm.default: (("running_mean", "running_var"), "training"),
}


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int) -> Any:
    arg = func._schema.arguments[i]
    return args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)


@lru_cache(maxsize=4096)
def may_write(func: Any) -> bool:
    """Whether the op's schema (or ``UNMARKED_WRITES``) lets it write any argument at all."""
    return func in UNMARKED_WRITES or any(
        a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op writes: ``self`` of ``add_``, ``out=``, and the ``UNMARKED_WRITES``."""
    if not may_write(func):
        return []
    written: list[Any] = []
    unmarked, flag = UNMARKED_WRITES.get(func, ((), ""))
    names = [a.name for a in func._schema.arguments]
    if unmarked and not _arg(func, args, kwargs, names.index(flag)):
        unmarked = ()
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if (alias is None or not alias.is_write) and arg.name not in unmarked:
            continue
        value = _arg(func, args, kwargs, i)
        written.extend(value if isinstance(value, (list, tuple)) else [value])
    return [w for w in written if w is not None]


def out_aliases(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], mutated: tuple[int, ...], n_out: int
) -> tuple[int | None, ...]:
    """Per output, the position in ``dts`` of the written input it returns (``add_``'s self, the
    ``out=`` tensors), None for a new tensor (``_native_batch_norm_legit`` writes its running
    stats and returns new ones). From the schema's alias sets; outputs paired with the written
    inputs in order where a set names a list argument."""
    if not mutated:
        return (None,) * n_out
    by_set: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        a = arg.alias_info
        if a is not None and a.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            by_set.update((name, value) for name in a.before_set)
    pos = {id(t): k for k, t in enumerate(dts)}
    out: list[int | None] = []
    for r in func._schema.returns[:n_out]:
        a = r.alias_info
        value = by_set.get(next(iter(a.before_set))) if a is not None and a.is_write and a.before_set else None
        if isinstance(value, (list, tuple)):
            return tuple(mutated[k] if k < len(mutated) else None for k in range(n_out))
        out.append(pos.get(id(value)) if value is not None else None)
    return tuple(out) + (None,) * (n_out - len(out))


def mutated_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any]) -> tuple[int, ...]:
    """Positions (in ``dts``) of the DistTensors the op writes."""
    if not may_write(func):
        return ()
    ids = [id(t) for t in written_args(func, args, kwargs)]
    return tuple(i for i, t in enumerate(dts) if id(t) in ids)


# ---- slots: where the DistTensors sit in a call, and the shape of a result -----------------------
def map_args(cls: Any, items: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(items, dict):
        return {k: map_args(cls, v, fn) for k, v in items.items()}
    if isinstance(items, cls):
        return fn(items)
    if isinstance(items, (list, tuple)):
        mapped = [map_args(cls, a, fn) for a in items]
        return type(items)(mapped) if isinstance(items, tuple) else mapped
    if isinstance(items, torch.Tensor) and items.dim() == 0:
        return fn(items)
    return items


def dist_slots(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Positions of the DistTensors: ``((arg index, k | (k or None per element)), ...)`` for args,
    the same keyed by name for kwargs; None when tensors nest deeper than one list."""
    k = 0

    def walk(items: Any) -> list[tuple[Any, Any]] | None:
        nonlocal k
        out: list[tuple[Any, Any]] = []
        for pos, a in items:
            if isinstance(a, cls):
                out.append((pos, k))
                k += 1
            elif isinstance(a, (list, tuple)) and any(isinstance(x, (cls, list, tuple)) for x in a):
                inner: list[int | None] = []
                for x in a:
                    if isinstance(x, cls):
                        inner.append(k)
                        k += 1
                    elif isinstance(x, (list, tuple)):
                        return None
                    else:
                        inner.append(None)
                out.append((pos, tuple(inner)))
        return out

    a = walk(enumerate(args))
    kw = walk(kwargs.items()) if a is not None else None
    return None if a is None or kw is None else (tuple(a), tuple(kw))


def place_locals(items: Any, slots: Any, locs: list[torch.Tensor]) -> Any:
    """``items`` (a list of args, or a dict of kwargs) with DistTensors swapped for locals."""
    for pos, k in slots:
        if type(k) is int:
            items[pos] = locs[k]
        else:
            seq = items[pos]
            items[pos] = type(seq)(x if j is None else locs[j] for x, j in zip(seq, k))
    return items


def flatten_out(out: Any) -> tuple[OutKind, list[Any]]:
    """The kind of a result and its tensors (None entries kept)."""
    if out is None:
        return OutKind.NONE, []
    if isinstance(out, torch.Tensor):
        return OutKind.TENSOR, [out]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out) and any(
        isinstance(o, torch.Tensor) for o in out
    ):
        return (OutKind.TUPLE if isinstance(out, tuple) else OutKind.LIST), list(out)
    return OutKind.VALUE, []


def mesh_coord(mesh: Any) -> tuple[int, ...] | None:
    """This rank's coordinate on ``mesh`` (None: not a member)."""
    return mesh.coordinate_of(runtime.get_rank())


# ---- deciding ------------------------------------------------------------------------------------
_warned: set[str] = set()  # ops that warned they run replicated (once each)


def forget_warnings() -> None:
    """Let every op warn again that it runs replicated (with a cleared decision cache)."""
    _warned.clear()
# Ops whose result is a Python value of the whole tensor (``x.item()``, ``torch.equal``): they
# need the replicated value by definition, so running them replicated is the rule, not a gap.
VALUE_OPS = frozenset({
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
})
# Ops whose output's shape depends on the values (``nonzero``, ``masked_select``, ``unique``):
# every rank must see the whole input to agree on it, so they run replicated by definition too.
DATA_SHAPED_OPS = frozenset({
    torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default, torch.ops.aten.argwhere.default,
    torch.ops.aten.bincount.default,  # its length is the largest value + 1
})
# Views whose local implementation computes a new tensor (a lazy conj/neg bit cannot live on the
# wrapper): like views of a moved input, writes through them raise instead of being lost.
_MATERIALISED_VIEWS = frozenset({torch.ops.aten._conj.default, torch.ops.aten._neg_view.default})
_SIZED_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._reshape_alias.default})
# In-place views (they change the tensor's own shape or strides) and their out-of-place view.
_aten = torch.ops.aten
INPLACE_VIEWS = {
    _aten.squeeze_.default: _aten.squeeze.default, _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims, _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.transpose_.default: _aten.transpose.int, _aten.t_.default: _aten.t.default,
    _aten.as_strided_.default: _aten.as_strided.default,
}


def _restrides_only(args: tuple[Any, ...], kwargs: dict[str, Any], x: Any) -> bool:
    """Whether ``as_strided(x, size, stride, offset)`` is ``x`` itself: the same shape and offset,
    and the same strides on every dim longer than 1 (the strides of size-1 dims address nothing).
    Kernels restride so (``adaptive_avg_pool2d`` to 1 x 1 on a channels-last input)."""
    size, stride = args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    shape = x._spec.shape
    return (tuple(size) == tuple(shape) and offset in (None, 0) and len(stride) == len(shape)
            and all(n == 1 or int(a) == int(b) for n, a, b in zip(shape, stride, x._stride)))


def decide(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
           filled: list[Any] | None = None, target: DistSpec | None = None, symbolic: bool = False) -> Decision:
    """The decision for ``func`` on these arguments (``dts``: the DistTensors among them, in
    order): a pure function of their specs, strides and the non-tensor arguments. ``filled``
    gets the template's key where the decision is one shape of a template: filled in from one
    made at another shape, or the one made afresh that becomes the template (the dispatcher
    keeps a bounded number of each template's shapes). ``target``: the layout of the parameter
    whose gradient the op makes, in a backward (``reshard.choice.cost``). ``symbolic``: the call
    holds sizes a capture leaves open (``torch.SymInt``s): decided afresh (no template), in the
    capture's fake mode, so that every branch on them is recorded as a guard."""
    specs = [t._spec for t in dts]
    if symbolic:
        return _finish(cls, func, _decide(cls, func, args, kwargs, dts, [], target, symbolic=True), args, kwargs, specs,
                       [t._stride for t in dts])
    key, out = _template_key(cls, func, args, kwargs, dts, specs)
    if key is not None and target is not None:
        key = (key, target.mesh, target.placements)
    template = generic.template(key)
    if template is not None and out is not None:
        if filled is not None:
            filled.append(key)
        return _from_template(template, specs, out, cls, func, args, kwargs, dts)
    stored: list[bool] = []
    d = _finish(cls, func, _decide(cls, func, args, kwargs, dts, stored, target), args, kwargs, specs,
                [t._stride for t in dts])
    if stored and key is not None and _template_kind(d, func):
        generic.store_template(key, d)
        if filled is not None:
            filled.append(key)
    return d


# ---- whole decisions at a new shape ----------------------------------------------------------
# A decision whose choice is stored shape-generically (``generic.choice_key``), that moves no
# input, writes none, runs the op itself and returns one new tensor of a known layout is the same
# decision at every shape of its signature but for the input and output specs and strides:
# those are filled in from a decision made at another shape, without the meta kernel, the
# ``OpCall``, the rule or the planner. ``tests/pure/test_generic_choice.py`` and
# ``tests/world/test_generic_decisions.py`` check it against fresh decisions.
@lru_cache(maxsize=4096)
def _templatable(func: Any) -> bool:
    return (func not in INPLACE_VIEWS and func not in VALUE_OPS and func not in DATA_SHAPED_OPS
            and func not in _MATERIALISED_VIEWS and func is not _aten.as_strided.default
            and not may_write(func) and get_out_shapes(func) is None)


def _strided(specs: Any) -> bool:
    return any(s is not None and s.has_strided for s in specs)


def _template_kind(d: Decision, func: Any) -> bool:
    """Whether ``d`` can be filled in at another shape: a local step on this mesh writing nothing,
    its outputs all tensors, its moves (if any) re-plannable from placements alone — and none
    for a view (a view of a moved input is detached: decided afresh)."""
    return (type(d) is LocalStep and d.coord is not None and not d.mutated and not d.fallback
            and not _strided(d.in_specs) and not _strided(d.out_specs)
            and not d.detached_view and d.out_kind in (OutKind.TENSOR, OutKind.TUPLE, OutKind.LIST)
            and all(o is not None for o in d.out_specs)
            and all(not isinstance(p, CrossMeshPlan) for p in d.plans)
            and all(p is None or not p.dst.shard_order for p in d.plans)
            and (not _returns_view(func) or all(p is None for p in d.plans)))


def _template_key(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
                  specs: list[DistSpec]) -> tuple[Any, generic.Layouts | None]:
    """(the template key, the known output layouts) of this call; (None, None) where none."""
    if not _templatable(func):
        return None, None
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh is not mesh and s.mesh != mesh:
            return None, None

    def is_dist(a: Any) -> bool:
        return isinstance(a, cls)

    return generic.template_key(func, specs, [(s.shape, d._stride) for s, d in zip(specs, dts)], args, kwargs, is_dist)


def _from_template(t: LocalStep, specs: list[DistSpec], outs: generic.Layouts, cls: Any, func: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any], dts: list[Any]) -> LocalStep:
    """The decision ``t`` made at another shape, for inputs ``specs`` and output layouts ``outs``."""
    assert t.coord is not None and len(outs) == len(t.out_specs)
    out_specs: list[DistSpec] = []
    locals_: list[tuple[int, ...]] = []
    dense: list[tuple[int, ...] | None] = []
    for (shape, stride, dtype), was, d in zip(outs, t.out_specs, t.out_dense):
        assert was is not None
        spec = was.with_shape(shape, dtype)
        local = spec.local_shape(t.coord)
        out_specs.append(spec)
        locals_.append(local)
        dense.append(dense_strides(local, stride) if d is not None else None)
    strides, dense_out = tuple(o[1] for o in outs), tuple(dense)
    moves: dict[str, Any] = {}
    if any(p is not None for p in t.plans):
        # the stored choice's moves, planned for these inputs (``_plan`` as ``_local_step`` does)
        plans = tuple(None if p is None else plan_to(s, p.dst.placements) for s, p in zip(specs, t.plans))
        in_specs = _in_specs(specs, plans)
        wrapper = [d._stride for d in dts]
        moves = dict(plans=plans, in_conform=tuple(
            (i, wrapper[i], dense_strides(in_specs[i].local_shape(t.coord), wrapper[i]))
            for i, p in enumerate(plans) if _copies(p)))
    else:
        in_specs = tuple(specs)
    specs_out = tuple(out_specs)
    if t.context is None:  # the op itself runs: the rule's view of the call is not needed
        return evolve(t, in_specs=in_specs, call=None, out_specs=specs_out, out_strides=strides, out_dense=dense_out,
                      **moves)
    metas: dict[int, TensorMeta] = {}

    def to_meta(x: Any) -> Any:
        if isinstance(x, cls):
            return metas.setdefault(id(x), TensorMeta(x._spec.shape, x._spec.dtype))
        return ScalarMeta(x.dtype)

    call = OpCall(func, map_args(cls, args, to_meta), map_args(cls, kwargs, to_meta), tuple(to_meta(d) for d in dts),
                  tuple(TensorMeta(o[0], o[2]) for o in outs), tuple(s.placements for s in specs), tuple(t.mesh.shape))
    shapes = tuple(locals_)
    context = evolve(t.context, call=call, out_shapes=shapes, in_specs=in_specs, out_specs=specs_out)
    return evolve(t, in_specs=in_specs, call=call, context=context, out_specs=specs_out, out_strides=strides,
                  out_dense=dense_out, **moves)


def _decide(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any],
            stored: list[Any], target: DistSpec | None, symbolic: bool = False) -> Decision:
    """``stored`` gets an entry where the choice is stored shape-generically."""
    mesh = dts[0]._spec.mesh
    for d in dts[1:]:
        if d._spec.mesh != mesh:
            raise ValueError(
                f"{func}: inputs live on different meshes {mesh} and {d._spec.mesh}; "
                "reshard one of them onto the other's mesh first (ap.reshard)"
            )
    specs = [d._spec for d in dts]
    metas: dict[int, TensorMeta] = {}

    def to_meta(t: Any) -> Any:
        if isinstance(t, cls):
            return metas.setdefault(id(t), TensorMeta(t._spec.shape, t._spec.dtype))
        return ScalarMeta(t.dtype)

    def to_fake(t: Any) -> Any:
        if isinstance(t, cls):
            return torch.empty_strided(t._spec.shape, t._stride, dtype=t._spec.dtype, device="meta")
        return torch.empty((), dtype=t.dtype, device="meta")

    mutated = mutated_inputs(func, args, kwargs, dts)
    if func in INPLACE_VIEWS:  # run as the out-of-place view, then re-point the wrapper
        return InplaceViewDecision(INPLACE_VIEWS[func])
    if func in VALUE_OPS or func in DATA_SHAPED_OPS:
        return _fallback_decision(func, specs, mesh, None, mutated, reason="", warn=False)
    if get_rule(func) is None and compat.decomposable(func):
        return DecomposeDecision()
    fake_kwargs = map_args(cls, kwargs, to_fake)
    if isinstance(fake_kwargs.get("device"), (torch.device, str)):  # ``_to_copy(x, device=cpu)``
        # (autocast's casts, ``.to(device)``): where the result lives is the local step's business;
        # the shapes and dtypes come from meta either way
        fake_kwargs["device"] = torch.device("meta")
    same = func is _aten.as_strided.default and _restrides_only(args, kwargs, dts[0])
    # An op whose output shape follows from its definition runs its meta kernel once per dtype
    # signature, not per shape (autoparallel.engine.generic).
    shaped = [(d._spec.shape, d._stride) for d in dts] if not mutated and not symbolic else None
    out_key = generic.out_key(func, args, kwargs, lambda a: isinstance(a, cls)) if shaped else None
    fake_out = generic.known_out(func, out_key, shaped, args, kwargs) if shaped else None
    if fake_out is None:
        try:
            fake_args = map_args(cls, args, to_fake)
            fn = compat.open_size_impl(func, fake_args) if symbolic and func in compat.OPEN_SIZE_OPS else func
            fake_out = fn(*fake_args, **fake_kwargs)
        except Exception as e:  # no meta kernel: compute replicated and learn the outputs from it
            if _invalid_call(e):
                raise  # the op's own error on these shapes (every rank raises it, before any collective)
            why = "its output shape depends on the values" if _data_shaped(e) else "it has no meta kernel"
            return _fallback_decision(func, specs, mesh, None, mutated, reason=why)
        if shaped:
            generic.learn_out(func, out_key, shaped, fake_out, args, kwargs)
    out_kind, outs = flatten_out(fake_out)
    alias = out_aliases(func, args, kwargs, dts, mutated, len(outs))
    for k, i in enumerate(alias):
        if i is not None and outs[k] is not None and tuple(outs[k].shape) != specs[i].shape:
            raise RuntimeError(
                f"{func} changes the shape of a DistTensor in place ({tuple(specs[i].shape)} -> "
                f"{tuple(outs[k].shape)}); use the out-of-place op instead"
            )
    if out_kind is OutKind.VALUE and not mutated:
        if isinstance(fake_out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in fake_out):
            # tensors next to values (CUDA flash attention's (out, lse, ..., max_q, max_k, seed, ...)):
            # no rule speaks for them; run replicated, wrapping the tensors the kernel returns
            return _fallback_decision(func, specs, mesh, None, mutated, reason="it returns tensors mixed with values")
        return ValueDecision(fake_out)
    out_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    if same:  # decided and run as the alias it is; the wrapper advertises the asked strides
        func, args, kwargs = _aten.alias.default, args[:1], {}
    call = OpCall(
        func,
        map_args(cls, args, to_meta),
        map_args(cls, kwargs, to_meta),
        tuple(to_meta(d) for d in dts),
        out_metas,
        tuple(s.placements for s in specs),
        tuple(mesh.shape),
    )
    shapes = get_out_shapes(func)
    fixed = shapes(call) if shapes is not None else None
    if fixed is not None:  # the CPU kernel's shapes, where its meta kernel says otherwise
        outs = [o if o is None or s is None else torch.empty(s, dtype=o.dtype, device="meta") for o, s in zip(outs, fixed)]
        out_metas = tuple(TensorMeta(tuple(o.shape), o.dtype) if o is not None else None for o in outs)
        call = replace(call, out=out_metas)
    rule = get_rule(func)
    key = generic.choice_key(call, specs) if rule is not None and not mutated and not symbolic else None
    if key is not None and target is not None:
        key = (key, target.mesh, target.placements)
    best = generic.stored_choice(key)
    if best is not None:  # decided at another shape of this signature: the same choice
        stored.append(True)
        return _local_step(func, mesh, specs, best, call, out_metas, outs, out_kind, alias, mutated, fake_out)
    strategies = rule(call) if rule is not None else []
    if mutated:
        # An output that IS a written input (``x.mul_(y)``, ``out=``) must come out in the layout
        # the input was written in: (R, P) -> P is fine for ``x * y`` but would leave a summand in
        # a tensor still labelled R. Then prefer strategies that keep the written layouts.
        strategies = [
            s for s in strategies if all(i is None or s.outputs[k] == s.inputs[i] for k, i in enumerate(alias))
        ]
        strategies = [s for s in strategies if all(s.inputs[i] == specs[i].placements for i in mutated)] or strategies
    if not strategies:
        why = "it has no SPMD rule" if rule is None else "its rule offered no strategy"
        return replace(_fallback_decision(func, specs, mesh, outs, mutated, reason=why, kind=out_kind), out_alias=alias,
                       meta_value=fake_out if out_kind is OutKind.VALUE else None)
    # at open sizes, a choice that holds at every shape needs no price (which would be a
    # function of the sizes, its comparisons guards); where sizes decide, they are priced so
    best = None
    if symbolic:
        hinted, hinted_metas, hinted_target = _at_hints(specs, out_metas, target)
        best = _generic_best(strategies, hinted, mesh, hinted_metas, hinted_target, open_sizes=True)
    best = best or cheapest(strategies, specs, tuple(mesh.shape), out_metas, target)
    if key is not None and _generic_best(strategies, specs, mesh, out_metas, target) is best:
        generic.store_choice(key, best)
        stored.append(True)
    return _local_step(func, mesh, specs, best, call, out_metas, outs, out_kind, alias, mutated, fake_out)


_NOT_META = ("meta", "fake", "data-dependent", "data dependent", "dynamic", "not implemented", "symbolic")


def _data_shaped(e: Exception) -> bool:
    """Whether a meta kernel refused because the output's shape depends on the values
    (``x[x > 0]``, ``nonzero``)."""
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("dynamicoutputshape", "data-dependent", "datadependent", "data-independent"))


def _invalid_call(e: Exception) -> bool:
    """Whether a meta kernel's error is the op refusing its inputs (shapes that do not fit, an
    index out of range), which the op raises on plain tensors too, rather than the meta kernel
    missing or unable to compute without values."""
    if not isinstance(e, (RuntimeError, ValueError, IndexError)) or isinstance(e, NotImplementedError):
        return False
    text = f"{type(e).__name__} {e}".lower()
    return not any(w in text for w in _NOT_META)


def _local_step(func: Any, mesh: Any, specs: list[DistSpec], best: Strategy, call: OpCall,
                out_metas: tuple[TensorMeta | None, ...], outs: list[Any], out_kind: OutKind,
                alias: tuple[int | None, ...], mutated: tuple[int, ...], fake_out: Any) -> LocalStep:
    """The ``LocalStep`` running ``best`` on these inputs (plans, output specs and strides)."""
    plans = tuple(plan_to(spec, req) for spec, req in zip(specs, best.inputs))
    out_specs = tuple(
        DistSpec(mesh, pl, m.shape, m.dtype) if m is not None else None for m, pl in zip(out_metas, best.outputs)
    )
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return LocalStep(
        mesh=mesh, coord=mesh_coord(mesh), plans=plans, in_specs=_in_specs(specs, plans),
        local_fn=kernel_for(func), call=call, out_kind=out_kind, out_specs=out_specs, out_strides=strides,
        out_alias=alias, mutated=mutated, meta_value=fake_out if out_kind is OutKind.VALUE else None,
    )


def _at_hints(specs: Sequence[DistSpec], out_metas: tuple[TensorMeta | None, ...],
              target: DistSpec | None) -> tuple[list[DistSpec], tuple[TensorMeta | None, ...], DistSpec | None]:
    """A call's specs, output metadata and target at the sizes a symbolic capture has now
    (``compat.size_hint``)."""
    def at(shape: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(compat.size_hint(n) for n in shape)

    return ([s.with_shape(at(s.shape)) if s.symbolic else s for s in specs],
            tuple(None if m is None else TensorMeta(at(m.shape), m.dtype) for m in out_metas),
            target.with_shape(at(target.shape)) if target is not None and target.symbolic else target)


def _generic_best(strategies: Sequence[Strategy], specs: Sequence[DistSpec], mesh: Any,
                  out_metas: tuple[TensorMeta | None, ...], target: DistSpec | None = None,
                  open_sizes: bool = False) -> Strategy | None:
    """The strategy the cost comparison picks at every shape of the call's signature, where that
    follows without comparing sizes: the one strategy taking every input as it is (only such
    strategies compete when there is one); with several, and one output, the one of least local
    output (each strategy's is the output's size over a divisor of its own at every shape of the
    signature: its generic sizes are multiples of the mesh's size, the rest are fixed, so their
    order holds; with several outputs sums of such terms may swap; and where a generic size is
    no multiple, ``torch.chunk``'s rounding up may too); with none taking every
    input as it is, the one strategy that moves nothing (every input as it is or reached by local
    steps: slices, relabels, ``R -> P``; priced 0 at any size, while every other plan has a
    collective or a fill, priced above 0 at any size). None where sizes decide, and where a
    ``StridedShard`` is in or out (its block count is a product of sizes). ``open_sizes``: the
    sizes are a symbolic capture's present ones, its open sizes not known to stay multiples of
    the mesh's: several strategies taking every input as they are are left to the sizes."""
    if _strided(specs):
        return None
    free = [s for s in strategies if all(as_is(spec, req) for spec, req in zip(specs, s.inputs))]
    if len(free) == 1:
        best: Strategy | None = free[0]
    elif free:
        if open_sizes or sum(m is not None for m in out_metas) != 1 or _uneven_sizes(mesh, out_metas):
            return None
        best = min(free, key=lambda s: cost(s, list(specs), tuple(mesh.shape), out_metas, target=target))
    else:
        still = [s for s in strategies if all(not plan_price(spec, tuple(req)) for spec, req in zip(specs, s.inputs))]
        best = still[0] if len(still) == 1 else None
    if best is not None and any(isinstance(p, StridedShard) for o in best.outputs for p in o):
        return None
    if best is not None and any(multiplies(s, specs, out_metas) for s in free):
        return None  # reducing now and carrying compete: sizes decide (``reshard.choice.cheapest``)
    return best


def _uneven_sizes(mesh: Any, out_metas: tuple[TensorMeta | None, ...]) -> bool:
    """Whether an output's size is generic but no multiple of the mesh's size (``generic._coding``):
    free strategies are compared by their local outputs alone (``_cost``: nothing moves), so
    the inputs' sizes (an odd sequence length reduced away) do not matter."""
    n = mesh.size
    return any(size % n and generic.is_generic(size, n) for m in out_metas if m is not None for size in m.shape)


def _fallback_decision(
    func: Any, specs: list[DistSpec], mesh: Any, outs: list[Any] | None, mutated: tuple[int, ...], reason: str,
    warn: bool = True, kind: OutKind = OutKind.TENSOR,
) -> LocalStep:
    """Gather every input to Replicate and run the op itself; members wrap what the kernel
    returns (its shapes may differ from the meta kernel's, e.g. empty saved statistics), so the
    ``outs`` metas (None: no meta kernel) only give the layout for ranks outside the mesh."""
    name = str(func)
    if warn and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"autoparallel: {name} runs replicated (gather inputs, compute, keep Replicate) because "
            f"{reason}; register a rule with ap.register_rule to shard it",
            stacklevel=4,
        )
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    plans = tuple(plan_to(s, rep) for s in specs)
    where = dict(mesh=mesh, coord=mesh_coord(mesh), plans=plans, in_specs=_in_specs(specs, plans), mutated=mutated)
    if outs is None:
        return LocalStep(**where, out_kind=OutKind.UNKNOWN, fallback=True)
    out_specs = tuple(DistSpec(mesh, rep, tuple(o.shape), o.dtype) if o is not None else None for o in outs)
    strides = tuple(tuple(o.stride()) if o is not None else None for o in outs)
    return LocalStep(**where, out_kind=kind, out_specs=out_specs, out_strides=strides, fallback=True)


def _in_specs(specs: list[DistSpec], plans: tuple[Plan | CrossMeshPlan | None, ...]) -> tuple[DistSpec, ...]:
    return tuple(p.dst if p is not None else s for s, p in zip(specs, plans))


def _finish(cls: Any, func: Any, d: Decision, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[DistSpec],
            strides: list[tuple[int, ...]]) -> Decision:
    """Add what execution needs: where the DistTensors sit, for in-place writes the way back
    to each written tensor's own layout (in-place ops never change a tensor's layout), and the
    strides the shards must follow (``autoparallel.strides``): the meta kernel computed the
    outputs' strides from the inputs' wrapper strides, so a shard a plan copied is made to
    follow its wrapper's, and every new output's shard the strides its wrapper advertises."""
    if not isinstance(d, LocalStep):
        return d
    back = tuple(None if d.in_specs[i] == specs[i] else plan_best(d.in_specs[i], specs[i]) for i in d.mutated)
    returns_view = _returns_view(func)
    moved_input = func in _MATERIALISED_VIEWS or any(_copies(p) for p in d.plans)
    context = None
    if d.local_fn is not None and d.coord is not None:
        assert d.call is not None
        shapes = tuple(None if s is None else s.local_shape(d.coord) for s in d.out_specs)
        context = LocalContext(d.call, shapes, d.in_specs, d.out_specs, d.coord, Collectives(d.mesh))
    # (a view of a StridedShard layout may copy the shard: ``spmd_rules.view._strided_view``)
    detached_view = returns_view and (moved_input or (func in _SIZED_VIEWS and _strided(d.in_specs + d.out_specs)))
    simple = d.out_kind is OutKind.TENSOR and not d.mutated and not d.fallback and not detached_view
    in_conform: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    out_dense: tuple[tuple[int, ...] | None, ...] = ()
    if d.coord is not None:
        in_conform = tuple((i, strides[i], dense_strides(d.in_specs[i].local_shape(d.coord), strides[i]))
                           for i, p in enumerate(d.plans) if _copies(p))
        # views and written inputs follow their inputs' shards; fallback outputs carry the kernel's own strides
        fresh = not returns_view and not d.fallback
        alias = d.out_alias or (None,) * len(d.out_specs)
        out_dense = tuple(
            dense_strides(s.local_shape(d.coord), st) if fresh and s is not None and st is not None and a is None else None
            for s, st, a in zip(d.out_specs, d.out_strides, alias)
        )
    return replace(d, restore=back, slots=dist_slots(cls, args, kwargs), detached_view=detached_view, view_out=returns_view,
                   context=context, simple=simple, in_conform=in_conform, out_dense=out_dense)


@lru_cache(maxsize=4096)
def _returns_view(func: Any) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _copies(plan: Plan | CrossMeshPlan | None) -> bool:
    """Whether running ``plan`` yields a new tensor rather than a view of the old shard."""
    if plan is None:
        return False
    if isinstance(plan, CrossMeshPlan):
        return True
    return any(s.kind not in (SLICE, RELABEL) for s in plan.steps)
