"""The optimizer's gradient reduction: planned from the gradients' layouts, replayed each step.

``plan_reduction`` is a pure function of metadata — each parameter's gradient layout, the ZeRO
stage's shard layouts and the bucket size — so every rank plans the same collectives in the same order.
``ShardedOptimizer`` keeps the plan for the layouts it last saw; a step with the same layouts
(every step of a steady training loop) only packs, reduces and unpacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoparallel.optim import buckets
from autoparallel.optim.stages import shard_layout
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec


@dataclass(frozen=True)
class BucketOp:
    """One collective: reduce the gradients of ``members`` (slot indices) over ``axis``."""

    mesh: Any
    axis: int
    kind: str                        # "ar" (all-reduce) or "rs" (reduce-scatter)
    reduce_type: str
    members: tuple[int, ...]
    targets: tuple[DistSpec, ...]    # each member's gradient layout afterwards
    dims: tuple[int, ...]            # "rs": the tensor dim each member is scattered along


@dataclass(frozen=True)
class SlotLayout:
    """What the plan needs of a parameter: its data-parallel axis and ZeRO shard layout."""

    axis: int | None
    shard: DistSpec | None


def plan_reduction(
    specs: Sequence[DistSpec | None], slots: Sequence[SlotLayout], scatters: bool, bucket_bytes: int,
) -> tuple[BucketOp, ...]:
    """The collectives reducing every Partial gradient: per mesh, per axis (the data-parallel
    axis first when ZeRO >= 2 scatters it: the later all-reduces are then smaller), per
    (kind, reduce type, dtype), per bucket of at most ``bucket_bytes``.

    ``specs[i]``: slot ``i``'s gradient layout (None: no DistTensor gradient).
    """
    cur = list(specs)
    todo = [i for i, s in enumerate(cur) if s is not None and s.has_partial]
    meshes: dict[Any, list[int]] = {}
    for i in todo:
        meshes.setdefault(cur[i].mesh, []).append(i)  # type: ignore[union-attr]
    ops: list[BucketOp] = []
    for mesh, idx in meshes.items():
        first = [a for i in idx if (a := slots[i].axis) is not None and scatters]
        for axis in dict.fromkeys(first + list(range(mesh.ndim))):
            groups: dict[tuple[Any, ...], list[tuple[int, DistSpec]]] = {}
            for i in idx:
                spec = cur[i]
                assert spec is not None
                p = spec.placements[axis]
                if not isinstance(p, Partial):
                    continue
                target = reduced_layout(spec, axis, slots[i], scatters)
                kind = "rs" if isinstance(target.placements[axis], Shard) else "ar"
                groups.setdefault((kind, p.reduce_type, spec.dtype), []).append((i, target))
            for (kind, reduce_type, _), items in groups.items():
                # last parameters first: the backward produces their gradients first, so the
                # first bucket is complete earliest (a captured step starts its reduction then)
                items = items[::-1]
                sizes = [meta_bytes(cur[i]) for i, _ in items]  # type: ignore[arg-type]
                for bucket in buckets.plan_buckets(sizes, bucket_bytes):
                    chosen = [items[k] for k in bucket]
                    dims = tuple(t.placements[axis].dim for _, t in chosen) if kind == "rs" else ()  # type: ignore[union-attr]
                    ops.append(BucketOp(mesh, axis, kind, reduce_type, tuple(i for i, _ in chosen),
                                        tuple(t for _, t in chosen), dims))
                for i, target in items:
                    cur[i] = target
    return tuple(ops)


def reduced_layout(spec: DistSpec, axis: int, slot: SlotLayout, scatters: bool) -> DistSpec:
    """A gradient's layout after reducing ``axis``: Replicate there, or for ZeRO >= 2 on the
    data-parallel axis the parameter's shard layout."""
    placements = list(spec.placements)
    placements[axis] = Replicate()
    reduced = spec.with_placements(placements, spec.shard_order)
    if axis == slot.axis and slot.shard is not None and scatters:
        target = shard_layout(reduced, axis)
        if target is not None and target.placements[axis] == slot.shard.placements[axis]:
            return target
    return reduced


def meta_bytes(spec: DistSpec) -> int:
    """Bytes of the largest local shard (mesh coordinate 0): the same number on every rank."""
    n = 1
    for s in spec.local_shape((0,) * spec.mesh.ndim):
        n *= s
    return n * spec.itemsize
