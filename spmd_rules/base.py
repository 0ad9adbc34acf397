"""Rule vocabulary: what a rule sees (``OpCall``) and what it answers (``Strategy``).

Rules are pure functions of metadata. The common kind is written for ONE mesh axis
(``register_axis_rule``): it answers which placements along that axis its inputs may take and
what the outputs then are; the registry takes the product over mesh axes. Rules that must see
every axis at once (``view``/``reshape``, where nested splits of one dim interact) register with
``register_rule`` and answer whole-mesh strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Replicate, Shard, StridedShard

R = Replicate()
P_SUM = Partial("sum")


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global metadata of one tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class OpCall:
    """One op call as a rule sees it.

    ``args``/``kwargs`` are the call's arguments with every tensor replaced by its
    ``TensorMeta``; ``inputs`` lists those metas in argument order (nested lists flattened),
    ``out`` the metas of the outputs, ``placements`` the current placements of each input
    (one tuple per input, one placement per mesh axis) and ``mesh_shape`` the mesh's shape.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[TensorMeta, ...]
    out: tuple[TensorMeta | None, ...]
    placements: tuple[tuple[Placement, ...], ...]
    mesh_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class LocalContext:
    """What a local implementation knows besides the local arguments.

    Compared and hashed by identity: the dispatcher builds one per cached decision, so a local
    implementation may cache what it derives from it (``functools.lru_cache`` on the context).
    """

    call: OpCall
    out_shapes: tuple[tuple[int, ...] | None, ...]  # this rank's local output shapes
    in_specs: tuple[Any, ...] = ()    # DistSpec of each tensor input as the op runs
    out_specs: tuple[Any, ...] = ()   # DistSpec of each output (None: not a tensor)
    coord: tuple[int, ...] | None = None  # this rank's mesh coordinate
    # The collectives the engine hands a kernel that needs them (``all_reduce``, ``exchange``
    # over axes of the op's mesh: autoparallel.engine.kernels.Collectives); rules never call it.
    comm: Any = None


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """Along one mesh axis: required input placements -> resulting output placements."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Strategy:
    """Whole-mesh strategy: per input and per output, one placement per mesh axis."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]


@dataclass(frozen=True, slots=True)
class ScalarMeta:
    """A plain 0-dim tensor argument: treated like a Python scalar, replicated everywhere."""

    dtype: torch.dtype


AxisRule = Callable[[OpCall, int, int], Sequence[AxisStrategy]]
MeshRule = Callable[[OpCall], Sequence[Strategy]]


def with_strided(fn: AxisRule | None = None, *, skip: Callable[[OpCall, AxisStrategy], bool] | None = None) -> Any:
    """``fn``, plus each of its sharded strategies again with ``StridedShard`` for ``Shard`` where
    this axis's inputs are strided that way: for ops whose sharded dims are independent (each
    index of an output dim reads the same index of the inputs' dims: elementwise ops, batch
    dims, contracted dims summed into a Partial), any subset of indices is as good as a chunk.
    A strategy qualifies when every input it shards is now ``StridedShard`` of that dim with one
    block count, or replicated (some input strided), and every sharded dim, output dims
    included, has one size; ``skip(call, strategy)``: strategies whose sharded dims are not
    independent (a loss's class dim, which the targets index). Use as ``@with_strided`` or
    ``@with_strided(skip=...)``."""
    if fn is None:
        return lambda f: with_strided(f, skip=skip)
    inner = fn

    def rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
        out = list(inner(call, axis, size))
        current = axis_placements(call, axis)
        factors = {p.split_factor for p in current if isinstance(p, StridedShard)}
        if len(factors) != 1:
            return out
        f = factors.pop()
        for s in list(out):
            sharded = [(i, q) for i, q in enumerate(s.inputs) if isinstance(q, Shard)]
            held = [current[i] == StridedShard(q.dim, f) for i, q in sharded]
            # (a replicated input takes its strided piece locally)
            if not any(held) or not all(h or current[i] == R for h, (i, _) in zip(held, sharded)):
                continue
            sizes = [call.inputs[i].shape[q.dim] for i, q in sharded]
            sizes += [m.shape[q.dim] if m is not None else -1 for q, m in zip(s.outputs, call.out) if isinstance(q, Shard)]
            if any(n != sizes[0] for n in sizes):  # (compared, not hashed: a size may be symbolic)
                continue
            if skip is not None and skip(call, s):
                continue
            out.append(AxisStrategy(tuple(StridedShard(q.dim, f) if isinstance(q, Shard) else q for q in s.inputs),
                                    tuple(StridedShard(q.dim, f) if isinstance(q, Shard) else q for q in s.outputs)))
        return out

    rule.__name__ = getattr(inner, "__name__", "rule")
    rule.__doc__ = inner.__doc__
    return rule


def replicate_all(call: OpCall) -> AxisStrategy:
    return AxisStrategy(tuple(R for _ in call.inputs), tuple(R for _ in call.out))


def axis_placements(call: OpCall, axis: int) -> tuple[Placement, ...]:
    """Current placement of each input along ``axis``."""
    return tuple(p[axis] for p in call.placements)


def divides(size: int, n: Any) -> bool:
    """Whether ``size`` splits ``n`` evenly, where that holds whatever the open sizes
    (``n`` symbolic: a capture with open sizes): asked of a strategy that is one candidate among
    several, it records no guard, so a program is not confined to the sizes a strategy it did not
    take would need."""
    if isinstance(n, int):
        return n % size == 0
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(n % size == 0))


def broadcast_dim(out_ndim: int, in_shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> int | None:
    """Input dim feeding output dim ``out_dim`` under broadcasting, or None if broadcast."""
    d = out_dim - (out_ndim - len(in_shape))
    if d < 0 or in_shape[d] != out_shape[out_dim]:
        return None
    return d


def follow(out_p: Placement, out_shape: Sequence[int], in_shape: Sequence[int]) -> Placement:
    """Placement an operand broadcast into an output of placement ``out_p`` must take."""
    if isinstance(out_p, Shard):
        d = broadcast_dim(len(out_shape), in_shape, out_shape, out_p.dim)
        return R if d is None else Shard(d)
    return out_p


def is_partial(p: Placement, *types: str) -> bool:
    return isinstance(p, Partial) and (not types or p.reduce_type in types)


def bound_args(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op call's arguments by schema name, defaults filled in (a rule's ``call.args`` or a
    local step's own arguments)."""
    out = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in op._schema.arguments), args))
    out.update(kwargs)
    return out


def tensor_names(call: OpCall) -> list[str]:
    """Each tensor input's schema name, in input order (``input_slots`` inverted)."""
    return list(input_slots(call))


def input_slots(call: OpCall) -> dict[str, int]:
    """Input index of each tensor argument, by schema name (args, then kwargs, as dispatched)."""
    names = [a.name for a in call.op._schema.arguments]
    slots: dict[str, int] = {}
    for i, a in enumerate(call.args):
        if isinstance(a, TensorMeta):
            slots[names[i]] = len(slots)
    for name, a in call.kwargs.items():
        if isinstance(a, TensorMeta):
            slots[name] = len(slots)
    return slots


def named_strategy(call: OpCall, placed: dict[str, Placement], outs: Sequence[Placement]) -> AxisStrategy:
    """Named inputs take ``placed`` (the rest Replicate); outputs ``outs`` (None outputs: R)."""
    ins: list[Placement] = [R] * len(call.inputs)
    for name, i in input_slots(call).items():
        if name in placed:
            ins[i] = placed[name]
    return AxisStrategy(tuple(ins), tuple(p if o is not None else R for p, o in zip(outs, call.out)))
