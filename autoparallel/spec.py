"""``DistSpec``: mesh + placements + global metadata, and the shard geometry it implies.

Sharding is ``torch.chunk``-style: a dim of size ``n`` over ``k`` ranks gives pieces of
``ceil(n / k)`` with the remainder (possibly empty) at the end. When several mesh axes shard
the same tensor dim they split it one after another; ``shard_order`` records that order per
tensor dim (outermost axis first). The default order is ascending mesh axis.

A ``StridedShard(d, f)`` axis splits each of ``f`` equal blocks of dim ``d``; plain ``Shard(d)``
axes of the same layout then split the blocks (``torch.chunk`` of the ``f`` blocks: where they
split them evenly, the same pieces as a ``Shard(d)`` alone). Such a layout is the plain layout of the
*expanded* shape, ``d`` cut into ``[f, size / f]`` (``expanded``): the strided axes shard the
inner dim, the plain ones the outer, and a rank's shard is its expanded shard, flattened back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache

import torch

from autoparallel.compat import metadata_cache
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    check_placement,
    chunk_bounds,
    partials_compatible,
    placements_str,
)

Box = tuple[tuple[int, int], ...]  # per tensor dim: (global offset, length)


@dataclass(frozen=True, slots=True)
class DistSpec:
    """How a global tensor of ``shape``/``dtype`` lies on ``mesh``.

    ``shard_order`` lists, for each tensor dim sharded by two or more mesh axes, the pair
    ``(dim, axes outermost-first)``; it is canonical (default orders are dropped), so equal
    layouts compare and hash equal.
    """

    mesh: ProcessMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] = field(default=())
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    has_partial: bool = field(default=False, init=False, repr=False, compare=False)  # some axis is Partial
    has_strided: bool = field(default=False, init=False, repr=False, compare=False)  # some axis is StridedShard
    symbolic: bool = field(default=False, init=False, repr=False, compare=False)  # some dim is a torch.SymInt

    def __hash__(self) -> int:  # fields are immutable: hash them once
        return self._hash

    def __eq__(self, other: object) -> bool:  # the same object, or the stored hashes differ: fast
        if self is other:
            return True
        if not isinstance(other, DistSpec):
            return NotImplemented
        return (self._hash == other._hash and shape_key(self.shape) == shape_key(other.shape) and self.dtype == other.dtype
                and self.placements == other.placements and self.shard_order == other.shard_order
                and self.mesh == other.mesh)

    def __post_init__(self) -> None:
        placements = tuple(self.placements)
        for p in placements:
            check_placement(p)
        if len(placements) != self.mesh.ndim:
            raise ValueError(
                f"{len(placements)} placements {placements_str(placements)} for a "
                f"{self.mesh.ndim}-d mesh of shape {list(self.mesh.shape)}: need one per mesh axis"
            )
        if not partials_compatible(placements):
            raise ValueError(
                f"placements {placements_str(placements)} mix Partial reduce types that do not "
                "commute; max/min may only be combined with the same type"
            )
        shape = tuple(_dim(s) for s in self.shape)
        ndim = len(shape)
        norm: list[Placement] = []
        for p in placements:
            if isinstance(p, (Shard, StridedShard)):
                if not -ndim <= p.dim < ndim or ndim == 0:
                    raise ValueError(
                        f"{p!r} on a {ndim}-d tensor of shape {tuple(shape)}: "
                        f"tensor dim {p.dim} does not exist"
                    )
                if isinstance(p, StridedShard) and p.split_factor > 1:
                    p = StridedShard(p.dim % ndim, p.split_factor)
                else:  # (one block: a Shard)
                    p = Shard(p.dim % ndim)
            norm.append(p)
        strided = any(isinstance(p, StridedShard) for p in norm)
        if strided:
            _check_strided(tuple(norm), shape)
        object.__setattr__(self, "placements", tuple(norm))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "shard_order", _canonical_order(tuple(norm), self.shard_order))
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, shape_key(shape), self.dtype, self.shard_order)))
        object.__setattr__(self, "has_partial", any(isinstance(p, Partial) for p in norm))
        object.__setattr__(self, "has_strided", strided)
        object.__setattr__(self, "symbolic", any(isinstance(s, torch.SymInt) for s in shape))

    # ---- derived ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    def axes_of_dim(self, dim: int) -> tuple[int, ...]:
        """Mesh axes sharding tensor ``dim``, outermost first."""
        for d, axes in self.shard_order:
            if d == dim:
                return axes
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

    def pieces(self, dim: int) -> int:
        """How many pieces the mesh axes sharding tensor ``dim`` with ``Shard`` cut it into (1:
        whole), 0 where a ``StridedShard`` axis splits it (its pieces are no ranges)."""
        if any(isinstance(p, StridedShard) and p.dim == dim for p in self.placements):
            return 0
        return math.prod(self.mesh.shape[a] for a in self.axes_of_dim(dim))

    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def with_placements(
        self, placements: Sequence[Placement], shard_order: tuple[tuple[int, tuple[int, ...]], ...] = ()
    ) -> DistSpec:
        """The same tensor in another layout (cached: specs are values)."""
        placements, shard_order = tuple(placements), tuple(shard_order)
        try:
            return _with_placements(self, placements, shard_order)
        except TypeError:  # unhashable input: build it uncached, for the constructor's own error
            return DistSpec(self.mesh, placements, self.shape, self.dtype, shard_order)

    def with_shape(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> DistSpec:
        """The same layout (placements, shard order, mesh) over another shape of the same rank
        (and ``dtype``, if given): what the constructor checks depends on the rank only, so
        nothing is checked again (a decision filled in at a new sequence length)."""
        if len(shape) != len(self.shape):
            raise ValueError(f"with_shape: {tuple(shape)} has not the rank of {tuple(self.shape)}")
        shape = tuple(_dim(s) for s in shape)
        dtype = self.dtype if dtype is None else dtype
        out = object.__new__(DistSpec)
        put = object.__setattr__
        put(out, "mesh", self.mesh)
        put(out, "placements", self.placements)
        put(out, "shape", shape)
        put(out, "dtype", dtype)
        put(out, "shard_order", self.shard_order)
        put(out, "_hash", hash((self.mesh, self.placements, shape_key(shape), dtype, self.shard_order)))
        put(out, "has_partial", self.has_partial)
        put(out, "has_strided", self.has_strided)
        put(out, "symbolic", any(isinstance(s, torch.SymInt) for s in shape))
        if self.has_strided:  # a block count need not divide the new size: checked
            _check_strided(self.placements, shape)
        return out

    def with_dtype(self, dtype: torch.dtype) -> DistSpec:
        """The same layout for a tensor of another dtype (an optimizer state of a parameter)."""
        return self if dtype == self.dtype else DistSpec(self.mesh, self.placements, self.shape, dtype, self.shard_order)

    def without_partial(self) -> DistSpec:
        """The same layout with every Partial axis made Replicate (the reduced value's layout)."""
        if not self.has_partial:
            return self
        placements = [Replicate() if isinstance(p, Partial) else p for p in self.placements]
        return self.with_placements(placements, self.shard_order)

    def local_box(self, coord: Sequence[int]) -> Box:
        """Global region held by the rank at mesh coordinate ``coord`` (a ``StridedShard``
        layout holds no box: its ``expanded`` layout does)."""
        if self.has_strided:
            raise ValueError(f"a layout with a StridedShard axis, {self}, holds no box of the tensor; "
                             "its expanded() layout does")
        return _local_box(self.placements, self.shard_order, self.shape, self.mesh.shape, tuple(coord))

    def dim_box(self, coord: Sequence[int], dim: int) -> tuple[int, int]:
        """(global offset, length) along ``dim`` of the rank at ``coord``: ``local_box(coord)[dim]``,
        also in a ``StridedShard`` layout where no strided axis splits ``dim``."""
        if not self.has_strided:
            return self.local_box(coord)[dim]
        if any(isinstance(p, StridedShard) and p.dim == dim for p in self.placements):
            raise ValueError(f"tensor dim {dim} of {self} is strided: its piece is no range")
        placements = tuple(Replicate() if isinstance(p, StridedShard) else p for p in self.placements)
        return _local_box(placements, self.shard_order, self.shape, self.mesh.shape, tuple(coord))[dim]

    def local_shape(self, coord: Sequence[int] | None) -> tuple[int, ...]:
        """Shape of the local shard at ``coord``; ranks outside the mesh hold ``(0,)``."""
        if coord is None:
            return (0,)
        if self.has_strided:
            return merge_expanded(self.expanded().local_shape(coord), strided_factors(self.placements))
        return tuple(length for _, length in self.local_box(coord))

    def expanded(self, factors: tuple[tuple[int, int], ...] | None = None) -> DistSpec:
        """This layout over the shape with each dim ``d`` of ``factors`` (``(dim, blocks)`` pairs,
        ascending dims; default: this layout's strided dims) cut into ``[blocks, size / blocks]``:
        ``StridedShard(d, blocks)`` axes become ``Shard`` of the inner dim, ``Shard(d)`` axes of the
        outer. A rank's shard of this layout is its expanded shard viewed flat. Raises
        ``ValueError`` where a factor does not fit (a plain split not along block bounds, another
        block count)."""
        out = _expand(self, strided_factors(self.placements) if factors is None else tuple(factors))
        if out is None:
            raise ValueError(f"{self} cannot be cut into blocks {dict(factors or ())}")
        return out

    def fits(self, factors: tuple[tuple[int, int], ...]) -> bool:
        """Whether ``expanded(factors)`` exists."""
        return _expand(self, tuple(factors)) is not None

    def unstrided(self) -> DistSpec:
        """The same layout with every ``StridedShard`` axis made ``Replicate``, and the ``Shard``
        axes of its dims too where they split the blocks unevenly (their pieces are then no
        ``Shard`` pieces)."""
        if not self.has_strided:
            return self
        factors = dict(strided_factors(self.placements))
        mesh_shape = self.mesh.shape
        uneven = {d for d, f in factors.items()
                  if f % math.prod(mesh_shape[a] for a, p in enumerate(self.placements) if p == Shard(d))}
        placements = [Replicate() if isinstance(p, StridedShard) or (isinstance(p, Shard) and p.dim in uneven) else p
                      for p in self.placements]
        order = tuple((d, axes) for d, axes in self.shard_order if d not in uneven)
        return self.with_placements(placements, order)

    def __str__(self) -> str:
        order = f" order={dict(self.shard_order)}" if self.shard_order else ""
        return f"{placements_str(self.placements)} {tuple(self.shape)}{order}"


def _dim(s: object) -> int:
    """One dim of a spec's shape: an int, or a ``torch.SymInt`` (a size a symbolic capture leaves
    open) kept as it is."""
    if isinstance(s, torch.SymInt):
        return int(s) if s.node.expr.is_number else s  # type: ignore[return-value]
    return int(s)  # type: ignore[call-overload]


def shape_key(shape: tuple[int, ...]) -> tuple[object, ...]:
    """``shape`` as a hashable key that compares without guards: a symbolic dim by its expression
    in its shape environment."""
    if not any(isinstance(s, torch.SymInt) for s in shape):
        return shape
    return tuple(("sym", s.node.shape_env, s.node.expr) if isinstance(s, torch.SymInt) else s for s in shape)


# Keyed by the exact shape too: a warm step asks for <= 5 entries, a new length adds ~5-15
# (measured on the example GPT and transformers' Llama, DP and TP), planning a few dozen.
@lru_cache(maxsize=512)
def _with_placements(
    spec: DistSpec, placements: tuple[Placement, ...], shard_order: tuple[tuple[int, tuple[int, ...]], ...]
) -> DistSpec:
    return DistSpec(spec.mesh, placements, spec.shape, spec.dtype, shard_order)


def strided_factors(placements: Sequence[Placement]) -> tuple[tuple[int, int], ...]:
    """``(dim, split_factor)`` of every dim a ``StridedShard`` axis splits, ascending dims."""
    return tuple(sorted({(p.dim, p.split_factor) for p in placements if isinstance(p, StridedShard)}))


def merge_expanded(shape: Sequence[int], factors: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """A shape of an ``expanded(factors)`` layout with each cut dim's two parts multiplied back."""
    out = list(shape)
    for k, (d, _) in reversed(list(enumerate(factors))):
        at = d + k  # (each cut dim before it added one)
        out[at:at + 2] = [out[at] * out[at + 1]]
    return tuple(out)


def strided_layout_ok(placements: tuple[Placement, ...], shape: Sequence[int]) -> bool:
    """Whether a layout's ``StridedShard`` axes fit ``shape`` (what ``DistSpec`` checks)."""
    try:
        _check_strided(placements, tuple(shape))
    except ValueError:
        return False
    return True


def _check_strided(placements: tuple[Placement, ...], shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless every ``StridedShard`` axis of a dim has one block count that
    divides the dim."""
    for d in sorted({p.dim for p in placements if isinstance(p, StridedShard)}):
        factors = {p.split_factor for p in placements if isinstance(p, StridedShard) and p.dim == d}
        if len(factors) > 1:
            raise ValueError(f"{placements_str(placements)}: the StridedShard axes of tensor dim {d} "
                             f"give different block counts {sorted(factors)}")
        f = factors.pop()
        if shape[d] % f:
            raise ValueError(f"{placements_str(placements)} on shape {tuple(shape)}: {f} blocks do not "
                             f"divide tensor dim {d} of size {shape[d]}")


@lru_cache(maxsize=1024)
def _expand(spec: DistSpec, factors: tuple[tuple[int, int], ...]) -> DistSpec | None:
    cut = dict(factors)
    new_dim: list[int] = []
    shape: list[int] = []
    for d, size in enumerate(spec.shape):
        new_dim.append(len(shape))
        if d in cut:
            f = cut[d]
            if f < 1 or size % f:
                return None
            shape += [f, size // f]
        else:
            shape.append(size)
    mesh_shape = spec.mesh.shape
    placements: list[Placement] = []
    plain = dict.fromkeys(cut, 1)
    for a, p in enumerate(spec.placements):
        if isinstance(p, StridedShard):
            if cut.get(p.dim) != p.split_factor:
                return None
            placements.append(Shard(new_dim[p.dim] + 1))
        elif isinstance(p, Shard):
            if p.dim in cut:
                plain[p.dim] *= mesh_shape[a]
            placements.append(Shard(new_dim[p.dim]))
        else:
            placements.append(p)
    strided = {p.dim for p in spec.placements if isinstance(p, StridedShard)}
    if any(cut[d] % k for d, k in plain.items() if d not in strided):
        return None  # a plain split of a dim not cut by blocks: the same pieces only if it cuts whole blocks
    order = tuple((new_dim[d], axes) for d, axes in spec.shard_order)
    return DistSpec(spec.mesh, tuple(placements), tuple(shape), spec.dtype, order)


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The global region two boxes share, or None when they do not overlap."""
    out = []
    for (o1, l1), (o2, l2) in zip(a, b):
        lo, hi = max(o1, o2), min(o1 + l1, o2 + l2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def _canonical_order(
    placements: tuple[Placement, ...], order: tuple[tuple[int, tuple[int, ...]], ...]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    given = {int(d): tuple(int(a) for a in axes) for d, axes in (order or ())}
    out = []
    dims = sorted({p.dim for p in placements if isinstance(p, Shard)})
    for d in dims:
        default = tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)
        axes = given.pop(d, default)
        if sorted(axes) != list(default):
            raise ValueError(
                f"shard_order {axes} for tensor dim {d} does not list exactly the mesh axes "
                f"{default} that shard it in {placements_str(placements)}"
            )
        if len(axes) > 1 and axes != default:
            out.append((d, axes))
    if given:
        raise ValueError(f"shard_order names tensor dims {sorted(given)} that no mesh axis shards")
    return tuple(out)


# Keyed by the exact shape: a new sequence length adds ~20 entries, a miss costs a few
# microseconds, and warm steps do not ask (their decisions hold the local shapes): small.
@metadata_cache(256)
def _local_box(
    placements: tuple[Placement, ...],
    order: tuple[tuple[int, tuple[int, ...]], ...],
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> Box:
    explicit = dict(order)
    box = []
    for dim, size in enumerate(shape):
        axes = explicit.get(dim) or tuple(
            a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim
        )
        off, length = 0, size
        for a in axes:
            o, length = chunk_bounds(length, mesh_shape[a], coord[a])
            off += o
        box.append((off, length))
    return tuple(box)


@cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: the price of a layout reads it per tensor)."""
    return torch.empty((), dtype=dtype).element_size()
