"""Placements: what a tensor is along one mesh axis.

``Replicate()`` — every rank of the axis holds the whole value.
``Shard(dim)`` — tensor dim ``dim`` is split across the axis, ``torch.chunk``-style
(earlier ranks get the larger pieces; trailing ranks may hold empty pieces).
``Partial(reduce_type)`` — every rank holds a summand (or candidate); the value is the
reduction of the pieces over the axis.
``StridedShard(dim, split_factor)`` — tensor dim ``dim`` is cut into ``split_factor`` equal
blocks and every block is split across the axis like ``Shard``; a rank holds its piece of each
block, blocks in order. It is what flattening two dims sharded on different mesh axes gives the
inner one (``[b, h] -> [b * h]`` with ``h`` split: ``StridedShard(0, split_factor=b)``); ops
produce it, so a reshape of co-sharded dims keeps its shards instead of gathering them.
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCE_TYPES = ("sum", "avg", "max", "min")


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank of the mesh axis holds the full tensor."""

    def is_replicate(self) -> bool:
        return True

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


class _SplitsDim:
    """What the placements that split a tensor dim (``Shard``, ``StridedShard``) answer alike."""

    __slots__ = ()
    dim: int

    def is_replicate(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def is_partial(self) -> bool:
        return False

    def get_dim(self) -> int:
        return self.dim


def _check_dim(dim: object, what: str) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what} takes an int tensor dim, got {dim!r}")


@dataclass(frozen=True, slots=True)
class Shard(_SplitsDim):
    """Tensor dim ``dim`` is split across the mesh axis with ``torch.chunk`` semantics."""

    dim: int

    def __post_init__(self) -> None:
        _check_dim(self.dim, "Shard(dim)")

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each rank holds a piece; the value is ``reduce_type`` over the mesh axis."""

    reduce_type: str = "sum"

    def __post_init__(self) -> None:
        if not isinstance(self.reduce_type, str) or self.reduce_type not in REDUCE_TYPES:
            raise ValueError(
                f"Partial reduce type {self.reduce_type!r} is unknown; "
                f"expected one of {', '.join(REDUCE_TYPES)}"
            )

    def is_replicate(self) -> bool:
        return False

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"P({self.reduce_type})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce_type!r})"


@dataclass(frozen=True, slots=True)
class StridedShard(_SplitsDim):
    """Tensor dim ``dim`` cut into ``split_factor`` equal blocks, each split across the mesh axis
    with ``torch.chunk`` semantics; a rank holds its piece of every block, in block order.

    ``Shard(d)`` on another mesh axis of the same layout splits the blocks themselves
    (``torch.chunk`` of the blocks). With ``split_factor`` 1 it is ``Shard(dim)``, and a layout
    says so.
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        _check_dim(self.dim, "StridedShard(dim, split_factor)")
        if isinstance(self.split_factor, bool) or not isinstance(self.split_factor, int) or self.split_factor < 1:
            raise TypeError(f"StridedShard(dim, split_factor) takes a positive int split_factor, got {self.split_factor!r}")

    def __str__(self) -> str:
        return f"S({self.dim}/{self.split_factor})"

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, split_factor={self.split_factor})"


Placement = Replicate | Shard | Partial | StridedShard
PLACEMENT_TYPES = (Replicate, Shard, Partial, StridedShard)


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece ``index`` when ``size`` is split like ``torch.chunk``."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return start, max(0, min(size, start + step) - start)


def check_placement(p: object) -> Placement:
    """Return ``p`` if it is a placement, else raise a ``TypeError`` naming it."""
    if not isinstance(p, PLACEMENT_TYPES):
        raise TypeError(
            f"placement {p!r} is not a Replicate(), Shard(dim), Partial(reduce_type) or "
            "StridedShard(dim, split_factor)"
        )
    return p


def partials_compatible(placements: tuple[Placement, ...]) -> bool:
    """Whether the Partial axes of one layout reduce unambiguously.

    ``sum`` and ``avg`` commute, so they mix freely; ``max``/``min`` do not commute with
    anything else, so a layout may only repeat the same one.
    """
    kinds = {p.reduce_type for p in placements if isinstance(p, Partial)}
    return len(kinds) <= 1 or kinds <= {"sum", "avg"}


def placements_str(placements: tuple[Placement, ...]) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"
