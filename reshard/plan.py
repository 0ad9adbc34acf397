"""Plan values: the ordered steps that turn one layout into another, with bytes per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autoparallel import cost
from autoparallel.placement import Partial, Shard
from autoparallel.spec import DistSpec

# Step kinds. Local ones move no bytes.
SLICE = "slice"                # R -> S(d): keep this rank's chunk
TO_PARTIAL = "to_partial"      # R -> P: zero all but one summand (sum) or keep (avg/max/min)
RELABEL = "relabel"            # any -> any on a mesh axis of size 1
ALL_GATHER = "all_gather"      # S(d) -> R
ALL_REDUCE = "all_reduce"      # P -> R
REDUCE_SCATTER = "reduce_scatter"  # P -> S(d)
ALL_TO_ALL = "all_to_all"      # S(i) -> S(j)
LOCAL_KINDS = frozenset({SLICE, TO_PARTIAL, RELABEL})


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
        """The largest number of bytes any rank receives."""
        mesh = self.src.mesh
        return max(self.bytes_at(mesh.coordinate_of(r))[1] for r in mesh.process_ids)

    def collectives(self) -> list[str]:
        return [s.kind for s in self.steps if not s.is_local]

    def __str__(self) -> str:
        body = "; ".join(str(s) for s in self.steps) or "no-op"
        return f"Plan({self.src} -> {self.dst}: {body})"


def _local_bytes(spec: DistSpec, coord: tuple[int, ...]) -> int:
    n = spec.itemsize
    for _, length in spec.local_box(coord):
        n *= length
    return n


def _line_coords(coord: tuple[int, ...], axis: int, size: int) -> list[tuple[int, ...]]:
    return [coord[:axis] + (i,) + coord[axis + 1:] for i in range(size)]


def _step_bytes(step: Step, coord: tuple[int, ...]) -> tuple[int, int]:
    if step.is_local:
        return 0, 0
    a = step.axis
    n = step.src.mesh.shape[a]
    line = _line_coords(coord, a, n)
    me = coord[a]
    if step.kind == ALL_GATHER:
        return cost.all_gather_bytes([_local_bytes(step.src, c) for c in line], me)
    if step.kind == ALL_REDUCE:
        return cost.all_reduce_bytes(_local_bytes(step.src, coord), n)
    if step.kind == REDUCE_SCATTER:
        dim = _placement_dim(step.dst, a)
        local = step.src.local_box(coord)
        size = local[dim][1]
        piece = -(-size // n) if size else 0
        other = _local_bytes(step.src, coord) // size if size else 0
        return cost.reduce_scatter_bytes(piece * other, n)
    if step.kind == ALL_TO_ALL:
        send = [_overlap_bytes(step.src, coord, step.dst, c) for c in line]
        recv = [_overlap_bytes(step.src, c, step.dst, coord) for c in line]
        return cost.all_to_all_bytes(send, recv, me)
    raise AssertionError(f"unknown step kind {step.kind}")


def _placement_dim(spec: DistSpec, axis: int) -> int:
    p = spec.placements[axis]
    assert isinstance(p, Shard)
    return p.dim


def _overlap_bytes(a: DistSpec, ca: tuple[int, ...], b: DistSpec, cb: tuple[int, ...]) -> int:
    n = a.itemsize
    for (o1, l1), (o2, l2) in zip(a.local_box(ca), b.local_box(cb)):
        n *= max(0, min(o1 + l1, o2 + l2) - max(o1, o2))
    return n


def is_partial(spec: DistSpec, axis: int) -> bool:
    return isinstance(spec.placements[axis], Partial)
