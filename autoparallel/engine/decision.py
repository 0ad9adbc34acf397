"""What the engine decides for one op call: a pure function of global metadata, cached.

Three kinds, one class each:

- ``LocalStep``: the common one. What to move (a reshard plan per DistTensor input, and for
  in-place writes the way back), the local function to run on the shards (the op itself, or a
  kernel with its ``LocalContext``), and how to wrap the outputs (specs, strides, which outputs
  are written inputs).
- ``ValueDecision``: the result is a Python value known from metadata alone (``x.dim()``-like
  ops that reach dispatch); nothing runs.
- ``InplaceViewDecision``: ``x.squeeze_()`` and kin run as their out-of-place view, then the
  wrapper takes the view's shard and layout.

An observer of the op path (``dispatch.observed_by``) reads ``fallback``, ``plans`` and
``out_kind`` of whichever kind it is handed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from autoparallel.spec import DistSpec
from reshard.crossmesh import CrossMeshPlan
from reshard.plan import Plan
from spmd_rules.base import LocalContext, OpCall

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


Decision = LocalStep | ValueDecision | InplaceViewDecision
