"""Pure planning for save and load: who writes which chunk, what each rank reads.

Save: every rank describes its flattened state dict as ``Item`` values (metadata only: key,
dtype, global shape, and the global box this rank holds); all ranks gather all descriptions and
run ``plan_save`` on the same input, so they agree on every decision without further messages.
Each distinct box of a tensor becomes one chunk with exactly one writer, chosen among the ranks
holding it: chunks are taken largest first and each goes to the holder given the fewest bytes
so far (ties: lowest rank), which spreads replicated tensors over their replicas.

Load: ``check_target`` compares a target with the checkpoint entries and lists every mismatch;
``target_box`` gives the region a rank fills;
``blocks_to_verify`` splits the checksum work: every CRC block that some rank reads is verified
by exactly one of its readers (spread evenly), so a tensor read by every rank is checked once,
not once per rank, and a corrupted block is still always detected.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.checkpoint.metadata import DTYPES, Entry, TensorEntry, numel
from autoparallel.placement import Partial
from autoparallel.spec import Box, DistSpec, intersect_boxes


@dataclass(frozen=True, slots=True)
class Item:
    """One flattened leaf as one rank sees it: a plain value, or a tensor and the box it holds."""

    key: str
    dtype: str | None = None  # None: a plain value
    shape: tuple[int, ...] = ()
    box: Box | None = None  # the global region this rank holds (None: none of it)
    value: Any = None


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    box: Box
    writer: int


@dataclass(frozen=True, slots=True)
class TensorPlan:
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[PlannedChunk, ...]


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Per key (in first-seen order): a plain value, or a tensor's chunks with one writer each."""

    entries: dict[str, Any | TensorPlan]

    def chunks_of(self, rank: int) -> list[tuple[str, int, PlannedChunk]]:
        """(key, chunk index, chunk) of every chunk ``rank`` writes, in key order."""
        return [(k, i, c) for k, e in self.entries.items() if isinstance(e, TensorPlan)
                for i, c in enumerate(e.chunks) if c.writer == rank]


def box_numel(box: Box) -> int:
    return numel(tuple(length for _, length in box))


def plan_save(items_by_rank: Sequence[Sequence[Item]]) -> SavePlan:
    """The save plan for every rank's item list (rank = list index); ValueError on conflicts."""
    first: dict[str, Item] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    for rank, items in enumerate(items_by_rank):
        for it in items:
            seen = first.setdefault(it.key, it)
            if (seen.dtype, seen.shape) != (it.dtype, it.shape):
                raise ValueError(
                    f"save_state_dict: {it.key!r} differs between ranks: {_describe(seen)} on one rank, "
                    f"{_describe(it)} on rank {rank}")
            if it.dtype is not None and it.box is not None and box_numel(it.box) > 0:
                holders.setdefault(it.key, {}).setdefault(it.box, []).append(rank)
    load = [0] * len(items_by_rank)
    pending = []
    for key, it in first.items():
        if it.dtype is None:
            continue
        held_by = holders.get(key, {})
        if sum(box_numel(b) for b in held_by) != numel(it.shape) or _overlap(list(held_by)):
            raise ValueError(
                f"save_state_dict: the ranks' pieces of {key!r} (shape {list(it.shape)}) do not cover it "
                f"exactly once: boxes {sorted(held_by)}")
        item_size = torch.empty((), dtype=DTYPES[it.dtype]).element_size()
        pending += [(-box_numel(b) * item_size, key, b, ranks) for b, ranks in held_by.items()]
    writer: dict[tuple[str, Box], int] = {}
    for neg_bytes, key, box, ranks in sorted(pending):
        w = min(ranks, key=lambda r: (load[r], r))
        load[w] -= neg_bytes
        writer[(key, box)] = w
    entries: dict[str, Any | TensorPlan] = {}
    for key, it in first.items():
        if it.dtype is None:
            entries[key] = it.value
            continue
        boxes = sorted(holders.get(key, {}))
        entries[key] = TensorPlan(it.shape, it.dtype, tuple(PlannedChunk(b, writer[(key, b)]) for b in boxes))
    return SavePlan(entries)


def _describe(it: Item) -> str:
    return "a plain value" if it.dtype is None else f"a {it.dtype} tensor of shape {list(it.shape)}"


def _overlap(boxes: list[Box]) -> bool:
    return len(boxes) > 1 and any(intersect_boxes(a, b) is not None
                                  for i, a in enumerate(boxes) for b in boxes[i + 1:])


# ---- load ----------------------------------------------------------------------------------
def target_box(t: torch.Tensor, rank: int) -> tuple[Box | None, bool]:
    """(global region ``t`` holds on ``rank``, whether that region must be zero-filled).

    A plain tensor holds everything. A DistTensor holds its reduced layout's box (with any
    ``StridedShard`` axis replicated: such a piece is no box); a rank that is not the first on a
    ``Partial(sum)`` axis holds zeros (the value lives on the first rank).
    """
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)

    spec: DistSpec | None = layout.spec_or_none(t)
    if spec is None:
        return tuple((0, s) for s in t.shape), False
    coord = spec.mesh.coordinate_of(rank)
    if coord is None:
        return None, False
    zero = any(isinstance(p, Partial) and p.reduce_type == "sum" and coord[a] > 0
               for a, p in enumerate(spec.placements))
    return spec.without_partial().unstrided().local_box(coord), zero  # (strided: saved, loaded gathered)


def check_target(entries: dict[str, Entry], target: dict[str, Any], source: str, strict: bool) -> list[str]:
    """Every way ``target`` (flattened) does not fit the checkpoint ``entries``; empty when it fits.

    Missing keys count only when ``strict``; kind and shape mismatches always do.
    """
    errors = []
    missing = [k for k in target if k not in entries]
    for k in missing:  # e.g. an optimizer before its first step: {"state": {}, ...} has no tensors
        below = next((e for e in entries if e.startswith(k + ".")), None)
        if below is not None:
            errors.append(f"{k!r} holds no tensors in the target but {source} has tensors under it "
                          f"(e.g. {below!r}); build that state first (for an optimizer: "
                          "ap.checkpoint.init_optimizer_state(optimizer))")
    missing = [k for k in missing if not any(e.startswith(k + ".") for e in entries)]
    if missing and strict:
        errors.append(f"{len(missing)} key(s) of the target state dict are not in {source}: {_few(missing)}")
    for key, leaf in target.items():
        e = entries.get(key)
        if e is None:
            continue
        is_tensor = isinstance(leaf, torch.Tensor)
        if is_tensor != isinstance(e, TensorEntry):
            want = "a tensor" if is_tensor else "a plain value"
            have = "a tensor" if isinstance(e, TensorEntry) else f"the value {e.value!r:.60}"
            errors.append(f"{key!r}: the target holds {want} but {source} holds {have}")
        elif isinstance(e, TensorEntry) and tuple(leaf.shape) != e.shape:
            errors.append(f"{key!r}: shape mismatch: the target has shape {list(leaf.shape)}, "
                          f"{source} has {list(e.shape)}")
    return errors


def unexpected_keys(extra_by_rank: Sequence[Sequence[str]], source: str) -> list[str]:
    """The error for checkpoint keys that no rank's target has (each rank lists those it lacks)."""
    common = set.intersection(*(set(e) for e in extra_by_rank)) if extra_by_rank else set()
    extra = [k for k in extra_by_rank[0] if k in common] if common else []
    if not extra:
        return []
    return [f"{len(extra)} key(s) in {source} are not in the target state dict of any rank "
            f"(pass strict=False to ignore them): {_few(extra)}"]


def _few(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")



Claim = tuple[str, int, int, int]  # key, chunk index, first block, last block + 1 (a rank reads them)


def blocks_to_verify(claims_by_rank: Sequence[Sequence[Claim]], rank: int) -> set[tuple[str, int, int]]:
    """(key, chunk index, block) of every block ``rank`` must verify (pure; same on every rank).

    A block read by ranks ``r_0 < ... < r_{n-1}`` is verified by ``r_{(block + salt) % n}``, where
    the salt depends only on the key and chunk, so single-block chunks spread over ranks too.
    """
    by_chunk: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for r, claims in enumerate(claims_by_rank):
        for key, ci, b0, b1 in claims:
            by_chunk.setdefault((key, ci), []).append((r, b0, b1))
    mine = set()
    for key, ci, b0, b1 in claims_by_rank[rank]:
        ranges = by_chunk[(key, ci)]
        salt = zlib.crc32(key.encode()) + ci
        for b in range(b0, b1):
            readers = sorted({r for r, lo, hi in ranges if lo <= b < hi})
            if readers[(b + salt) % len(readers)] == rank:
                mine.add((key, ci, b))
    return mine
