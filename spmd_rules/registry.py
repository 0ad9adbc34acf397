"""The rule registry: op -> rule, and the product of per-axis strategies over mesh axes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from autoparallel.placement import StridedShard, partials_compatible
from autoparallel.spec import strided_layout_ok
from spmd_rules.base import AxisRule, AxisStrategy, MeshRule, OpCall, Strategy

LocalImpl = Callable[..., Any]
OutShapes = Callable[[OpCall], Sequence[tuple[int, ...] | None] | None]

_MESH_RULES: dict[Any, MeshRule] = {}
_LOCAL_IMPLS: dict[Any, LocalImpl] = {}
_OUT_SHAPES: dict[Any, OutShapes] = {}
_TAG_RULES: dict[Any, MeshRule] = {}  # torch.Tag -> the rule of an op with that tag and no rule of its own
_SIZE_ARGS: dict[Any, tuple[int, ...]] = {}  # op -> arguments its rule reads only through the output's shape
MAX_COMBINATIONS = 512


def register_rule(ops: Any | Iterable[Any], size_args: tuple[int, ...] = ()) -> Callable[[MeshRule], MeshRule]:
    """Decorator: ``fn(call) -> [Strategy]`` answers for every op in ``ops`` (whole mesh).

    ``size_args``: positions of integer arguments the rule reads only through the output's shape
    (an output's size, a slice's bounds), a promise the engine's shape-generic keys rely on
    (``autoparallel.engine.generic``): a rule registered without it makes none."""

    def deco(fn: MeshRule) -> MeshRule:
        for op in _as_list(ops):
            _MESH_RULES[op] = fn
            _SIZE_ARGS[op] = tuple(size_args)
        return fn

    return deco


def register_axis_rule(ops: Any | Iterable[Any], size_args: tuple[int, ...] = ()) -> Callable[[AxisRule], AxisRule]:
    """Decorator: ``fn(call, axis, axis_size) -> [AxisStrategy]`` for one mesh axis
    (``size_args``: as for ``register_rule``)."""

    def deco(fn: AxisRule) -> AxisRule:
        def mesh_rule(call: OpCall) -> list[Strategy]:
            return product_of_axes(call, fn)

        mesh_rule.__name__ = f"product_of_{fn.__name__}"
        for op in _as_list(ops):
            _MESH_RULES[op] = mesh_rule
            _SIZE_ARGS[op] = tuple(size_args)
        return fn

    return deco


def size_args(op: Any) -> tuple[int, ...]:
    """Positions of the arguments ``op``'s rule reads only through the output's shape (the rule
    that answers for it: an overload's own, else its packet's; none for a tag's rule)."""
    if op in _MESH_RULES:
        return _SIZE_ARGS.get(op, ())
    return _SIZE_ARGS.get(getattr(op, "overloadpacket", None), ())


def register_tag_rule(tag: Any) -> Callable[[AxisRule], AxisRule]:
    """Decorator: ``fn(call, axis, axis_size)`` answers for every op tagged ``tag`` (a
    ``torch.Tag``) that has no rule of its own and writes no ``out=`` argument — e.g. the plain
    sharded rule for ``torch.Tag.pointwise``, so ``aten.rsub.Scalar`` (BERT's attention mask)
    and the hundreds of pointwise overloads no table names stay sharded instead of gathering."""

    def deco(fn: AxisRule) -> AxisRule:
        def mesh_rule(call: OpCall) -> list[Strategy]:
            return product_of_axes(call, fn)

        mesh_rule.__name__ = f"product_of_{fn.__name__}"
        _TAG_RULES[tag] = mesh_rule
        return fn

    return deco


def _tag_rule(op: Any) -> MeshRule | None:
    tags = getattr(op, "tags", ())
    if not tags or not _TAG_RULES:
        return None
    schema = getattr(op, "_schema", None)
    if schema is None or any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                             for a in schema.arguments):
        return None  # out= variants: the engine's own out= path, not a guess
    return next((_TAG_RULES[t] for t in tags if t in _TAG_RULES), None)


def register_local_impl(ops: Any | Iterable[Any]) -> Callable[[LocalImpl], LocalImpl]:
    """Decorator: ``fn(ctx, *local_args, **local_kwargs)`` replaces the op on local shards.

    ``ctx`` is a ``LocalContext`` (the ``OpCall`` and this rank's local output shapes).

    For ops whose per-shard computation differs from the op itself whatever the strategy,
    e.g. ``mean``: ``sum(local) / global count`` adds up across shards to the global mean.
    """

    def deco(fn: LocalImpl) -> LocalImpl:
        for op in _as_list(ops):
            _LOCAL_IMPLS[op] = fn
        return fn

    return deco


def register_out_shapes(ops: Any | Iterable[Any]) -> Callable[[OutShapes], OutShapes]:
    """Decorator: ``fn(call)`` -> the global shape of each output where the CPU kernel returns
    another shape than the meta kernel says (None per output, or for all: trust the meta kernel).

    E.g. eval-mode ``native_batch_norm`` returns empty saved statistics on CPU, (C,) on meta.
    """

    def deco(fn: OutShapes) -> OutShapes:
        for op in _as_list(ops):
            _OUT_SHAPES[op] = fn
        return fn

    return deco


def get_out_shapes(op: Any) -> OutShapes | None:
    return _OUT_SHAPES.get(op) or _OUT_SHAPES.get(getattr(op, "overloadpacket", None))


def get_local_impl(op: Any) -> LocalImpl | None:
    impl = _LOCAL_IMPLS.get(op)
    if impl is None:
        impl = _LOCAL_IMPLS.get(getattr(op, "overloadpacket", None))
    return impl


def get_rule(op: Any) -> MeshRule | None:
    """The rule for an aten overload, else for its overload packet, else for one of its tags, else None."""
    rule = _MESH_RULES.get(op)
    if rule is None:
        rule = _MESH_RULES.get(getattr(op, "overloadpacket", None))
    if rule is None:
        rule = _tag_rule(op)
    return rule


def has_rule(op: Any) -> bool:
    return get_rule(op) is not None


def product_of_axes(call: OpCall, fn: AxisRule) -> list[Strategy]:
    """Every combination of per-axis strategies (capped; beyond the cap, keep-current first)."""
    per_axis: list[Sequence[AxisStrategy]] = []
    for axis, size in enumerate(call.mesh_shape):
        cands = list(dict.fromkeys(fn(call, axis, size)))
        if not cands:
            return []
        per_axis.append(cands)
    total = 1
    for c in per_axis:
        total *= len(c)
    if total > MAX_COMBINATIONS:
        # Keep the strategy matching the current inputs first on each axis, then truncate.
        per_axis = [_prefer_current(call, a, c)[: max(1, int(MAX_COMBINATIONS ** (1 / len(per_axis))))] for a, c in enumerate(per_axis)]
    out = []
    n_in, n_out = len(call.inputs), len(call.out)
    for combo in itertools.product(*per_axis):
        inputs = tuple(tuple(s.inputs[i] for s in combo) for i in range(n_in))
        outputs = tuple(tuple(s.outputs[o] for s in combo) for o in range(n_out))
        if all(partials_compatible(p) for p in inputs + outputs) and (
                not any(isinstance(q, StridedShard) for p in inputs + outputs for q in p)
                or _strided_fit(call, inputs, outputs)):
            out.append(Strategy(inputs, outputs))
    return out


def _strided_fit(call: OpCall, inputs: tuple[tuple[Any, ...], ...], outputs: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether a combination's ``StridedShard`` axes fit the tensors' shapes (one block count per
    dim, dividing it: ``DistSpec``'s check)."""
    metas = list(zip(call.inputs, inputs)) + list(zip(call.out, outputs))
    return all(m is None or strided_layout_ok(p, m.shape) for m, p in metas)


def _prefer_current(call: OpCall, axis: int, cands: Sequence[AxisStrategy]) -> list[AxisStrategy]:
    current = tuple(p[axis] for p in call.placements)
    return sorted(cands, key=lambda s: sum(a != b for a, b in zip(s.inputs, current)))


def _as_list(ops: Any) -> list[Any]:
    if isinstance(ops, (list, tuple, set, frozenset)):
        return list(ops)
    return [ops]
