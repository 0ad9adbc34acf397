"""Plan values: the ordered steps that turn one layout into another, with bytes per rank."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from autoparallel.compat import metadata_cache, size_dtype, whole
from autoparallel.placement import Partial, Shard
from autoparallel.spec import DistSpec, strided_factors

# Step kinds. Local ones move no bytes.
SLICE = "slice"                # R -> S(d): keep this rank's chunk
TO_PARTIAL = "to_partial"      # R -> P: zero all but one summand (sum) or keep (avg/max/min)
FILL = "fill"                  # S(d) -> P: own piece in place, the reduction's identity elsewhere
RELABEL = "relabel"            # any -> any on a mesh axis of size 1
VIEW = "view"                  # a layout <-> its expanded layout (StridedShard): a local reshape
ALL_GATHER = "all_gather"      # S(d) -> R
ALL_REDUCE = "all_reduce"      # P -> R
REDUCE_SCATTER = "reduce_scatter"  # P -> S(d)
ALL_TO_ALL = "all_to_all"      # S(i) -> S(j)
LOCAL_KINDS = frozenset({SLICE, TO_PARTIAL, FILL, RELABEL, VIEW})


@dataclass(frozen=True, slots=True)
class Step:
    """One move on one mesh axis from ``src`` to ``dst`` (specs on the same mesh)."""

    kind: str
    axis: int
    src: DistSpec
    dst: DistSpec

    @property
    def is_local(self) -> bool:
        return self.kind in LOCAL_KINDS

    def bytes_at(self, coord: Sequence[int]) -> tuple[int, int]:
        """(sent, received) bytes of the rank at mesh coordinate ``coord``."""
        return _step_bytes(self, tuple(coord))

    def __str__(self) -> str:
        a = self.axis
        if self.kind == VIEW:
            return f"view({tuple(self.src.shape)} -> {tuple(self.dst.shape)})"
        return f"{self.kind}(axis {a}: {self.src.placements[a]} -> {self.dst.placements[a]})"


@dataclass(frozen=True, slots=True)
class Plan:
    """Same-mesh plan: ``steps`` applied in order turn ``src`` into ``dst``."""

    src: DistSpec
    dst: DistSpec
    steps: tuple[Step, ...]

    def bytes_at(self, coord: Sequence[int] | None) -> tuple[int, int]:
        if coord is None:
            return 0, 0
        sent = recv = 0
        for s in self.steps:
            a, b = s.bytes_at(coord)
            sent, recv = sent + a, recv + b
        return sent, recv

    def bytes_per_rank(self, rank: int) -> tuple[int, int]:
        return self.bytes_at(self.src.mesh.coordinate_of(rank))

    def max_bytes(self) -> int:
        """The largest number of bytes any rank receives (computed afresh: its callers cache
        their verdicts, and a plan at a new shape then leaves no byte table behind)."""
        if not self.steps:
            return 0
        total = sum(step_bytes(s)[1] for s in self.steps)
        return whole(np.max(total))  # type: ignore[no-any-return]

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if not s.is_local]

    def __str__(self) -> str:
        body = "; ".join(str(s) for s in self.steps) or "no-op"
        return f"Plan({self.src} -> {self.dst}: {body})"


def local_shape_table(spec: DistSpec) -> np.ndarray:
    """Local shard shapes of every mesh coordinate: int array of shape ``mesh.shape + (ndim,)``."""
    if spec.has_strided:
        return _strided_table(spec)
    return _shape_table(spec.placements, spec.shard_order, spec.shape, tuple(spec.mesh.shape))


@metadata_cache(16384)
def _shape_table(placements, order, shape, mesh_shape) -> np.ndarray:  # type: ignore[no-untyped-def]
    coords = np.indices(mesh_shape).reshape(len(mesh_shape), -1)  # [axes, ranks]
    explicit = dict(order)
    cols = []
    dtype = size_dtype(shape)
    for dim, size in enumerate(shape):
        axes = explicit.get(dim) or tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)
        length = np.full(coords.shape[1], size, dtype=dtype)
        for a in axes:
            n = mesh_shape[a]
            step = -(-length // n)
            start = np.minimum(coords[a] * step, length)
            length = np.maximum(0, np.minimum(length, start + step) - start)
        cols.append(length)
    table = np.stack(cols, axis=-1) if cols else np.zeros((coords.shape[1], 0), dtype=dtype)
    table.setflags(write=False)
    return table.reshape(tuple(mesh_shape) + (len(shape),))


@lru_cache(maxsize=1024)
def _strided_table(spec: DistSpec) -> np.ndarray:
    factors = strided_factors(spec.placements)
    table = local_shape_table(spec.expanded())
    for k, (d, _) in reversed(list(enumerate(factors))):
        at = d + k  # (each cut dim before it added one)
        table = np.concatenate([table[..., :at], table[..., at:at + 1] * table[..., at + 1:at + 2], table[..., at + 2:]],
                               axis=-1)
    table.setflags(write=False)
    return table


def _prod_last(a: np.ndarray) -> np.ndarray:
    return np.prod(a, axis=-1, dtype=size_dtype(a))


@metadata_cache(16384)
def step_bytes_table(step: Step) -> tuple[np.ndarray, np.ndarray]:
    """(sent, received) bytes of every mesh coordinate for one step (arrays of mesh shape).

    The same formulas as ``autoparallel.cost`` (what ``CommDebugMode`` records), vectorised.
    Cached: the planner's search prices the same steps many times; ``step_bytes`` is the same
    uncached, for callers that cache what they make of it (a plan's price).
    """
    return step_bytes(step)


def step_bytes(step: Step) -> tuple[np.ndarray, np.ndarray]:
    """``step_bytes_table``, uncached."""
    mesh_shape = tuple(step.src.mesh.shape)
    if step.is_local:
        z = np.zeros(mesh_shape, dtype=np.int64)
        return z, z
    a, item = step.axis, step.src.itemsize
    n = mesh_shape[a]
    src = local_shape_table(step.src)  # mesh_shape + (ndim,)
    mine = _prod_last(src) * item
    line_sum = lambda x: np.sum(x, axis=a, keepdims=True)  # noqa: E731  (sum over the axis line)
    if step.kind == ALL_GATHER:
        return (n - 1) * mine, np.broadcast_to(line_sum(mine), mine.shape) - mine
    if step.kind == ALL_REDUCE:
        b = 2 * (n - 1) * mine // n
        return b, b
    dim = _placement_dim(step.dst, a)
    length = src[..., dim]
    rest = _prod_last(np.delete(src, dim, axis=-1)) * item  # bytes of one slice along ``dim``
    me = np.indices(mesh_shape)[a]
    own = _chunk_length(length, n, me)  # this member's piece along ``dim`` after the step
    if step.kind == REDUCE_SCATTER:
        # Even pieces: ring reduce-scatter. Uneven (``length % n``, the same on an axis line):
        # an all-to-all of the exact pieces and a local reduction, no padding. Either way a
        # member sends its summand of every other member's piece and receives n-1 of its own.
        return (length - own) * rest, (n - 1) * own * rest
    if step.kind == ALL_TO_ALL:
        # Each member splits its piece into n chunks along ``dim`` (same length on the line)
        # and keeps its own; it receives its chunk of every other member's piece.
        return rest * (length - own), own * (np.broadcast_to(line_sum(rest), rest.shape) - rest)
    raise AssertionError(f"unknown step kind {step.kind}")


def _chunk_length(length: np.ndarray, n: int, index: np.ndarray) -> np.ndarray:
    """``chunk_bounds(length, n, index)[1]``, elementwise."""
    step_len = -(-length // n)
    start = np.minimum(index * step_len, length)
    return np.maximum(0, np.minimum(length, start + step_len) - start)


def _step_bytes(step: Step, coord: tuple[int, ...]) -> tuple[int, int]:
    sent, recv = step_bytes_table(step)
    return whole(sent[coord]), whole(recv[coord])


def _placement_dim(spec: DistSpec, axis: int) -> int:
    p = spec.placements[axis]
    assert isinstance(p, Shard)
    return p.dim


def is_partial(spec: DistSpec, axis: int) -> bool:
    return isinstance(spec.placements[axis], Partial)


# ---- S(d) -> P without communication -----------------------------------------------------------
# A member keeps its piece in place and fills the rest of the axis block with the reduction's
# identity: the reduction over the axis is then the whole block, exactly. ``sum``: zeros (False
# for bool: bool ``+`` is ``or``). ``max``/``min``: the dtype's lowest/highest value (-inf/inf
# where the dtype has them, so an infinite element survives). ``avg``: ``n x`` the piece and
# zeros, exact only for a native floating dtype with ``n`` a power of two (scaling by 2^k is
# exact up to the overflow an ``avg`` all-reduce shares, as it sums before dividing);
# otherwise no edge, and the planner gathers then keeps the value on every member.
_HAS_INF = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e5m2})
_SCALABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128})
_ORDERED_INTS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.uint16, torch.uint32, torch.uint64})


def fill_value(dtype: torch.dtype, reduce_type: str) -> float | int | bool | None:
    """The identity of ``reduce_type`` in ``dtype`` (what a member holds outside its piece), or
    ``None`` when there is none (max/min on complex or on a dtype with no order)."""
    if reduce_type in ("sum", "avg"):
        return False if dtype == torch.bool else 0
    lowest = reduce_type == "max"
    if dtype == torch.bool:
        return not lowest
    if dtype in _ORDERED_INTS:
        ints = torch.iinfo(dtype)
        return ints.min if lowest else ints.max
    if dtype.is_floating_point:
        if dtype in _HAS_INF:
            return -math.inf if lowest else math.inf
        floats = torch.finfo(dtype)
        return float(floats.min if lowest else floats.max)
    return None


def fill_exact(dtype: torch.dtype, reduce_type: str, n: int) -> bool:
    """Whether ``S(d) -> Partial(reduce_type)`` over ``n`` members is exact by a local fill."""
    if reduce_type == "avg":
        return dtype in _SCALABLE and n & (n - 1) == 0
    return fill_value(dtype, reduce_type) is not None
