"""``load_state_dict``: fill a target state dict in place from a checkpoint, in any layout.

The target decides the layout: each rank computes the global box each of its tensors holds
(a DistTensor's local shard on any mesh, placements, uneven sizes or shard order; a plain
tensor's whole value), intersects it with the stored chunks, and reads only those pieces: the
rows of each chunk the box needs. Every CRC block some rank reads is verified by exactly one of
the ranks reading it (``planner.blocks_to_verify``; that rank reads the whole block), and any
mismatch fails the load on every rank. No pickle is ever run: a checkpoint folder is JSON plus
raw bytes, an exported file is read with ``torch.load(weights_only=True)``.

Errors are agreed before anything is changed: every rank checks the target against the
metadata (missing/unexpected keys, shapes, kinds) and the data files it needs (present, long
enough), the ranks exchange their findings, and all raise the same error. Read errors
(checksums) are exchanged the same way after reading; the target's tensors may then hold
partly loaded values, its plain values are untouched.
"""

from __future__ import annotations

import os
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.checkpoint import _world
from autoparallel.checkpoint.flat import flatten, replace_values
from autoparallel.checkpoint.metadata import (
    CRC_BLOCK,
    CheckpointError,
    Chunk,
    Entry,
    TensorEntry,
    ValueEntry,
    from_json,
    numel,
)
from autoparallel.checkpoint.planner import (
    Claim,
    blocks_to_verify,
    box_numel,
    check_target,
    target_box,
    unexpected_keys,
)
from autoparallel.checkpoint.storage import DataReader, read_metadata_text
from autoparallel.spec import Box, DistSpec, intersect_boxes

WHERE = "load_state_dict"


class FolderSource:
    """A checkpoint folder written by ``save_state_dict``."""

    direct = True

    def __init__(self, folder: str) -> None:
        self.name = f"the checkpoint {folder!r}"
        self.entries: dict[str, Entry] = from_json(read_metadata_text(folder), os.path.join(folder, "metadata.json"))
        self.reader = DataReader(folder)

    def check(self, key: str, chunk: Chunk) -> str | None:
        return self.reader.check_file(chunk, key)

    def read(self, key: str, entry: TensorEntry, piece: Piece, verify: Container[int]) -> torch.Tensor:
        """The stored values of ``piece.ov`` (global region inside ``piece.chunk``)."""
        chunk, ov = piece.chunk, piece.ov
        raw = self.reader.read_range(chunk, piece.lo, piece.hi, verify, key).view(entry.dtype)
        if not chunk.shape:
            return raw.reshape(())
        t = raw.reshape((ov[0][1], *chunk.shape[1:]))
        for d in range(1, len(ov)):
            t = t.narrow(d, ov[d][0] - chunk.offset[d], ov[d][1])
        return t

    def read_whole_into(self, key: str, chunk: Chunk, out: torch.Tensor, verify: Container[int]) -> None:
        self.reader.read_into(chunk, 0, out.view(-1).view(torch.uint8), verify, key)

    def close(self) -> None:
        self.reader.close()


class FileSource:
    """A single-file state dict (``export_state_dict`` or any ``torch.save`` of tensors/values)."""

    direct = False

    def __init__(self, file: str) -> None:
        self.name = f"the file {file!r}"
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            self.full = flatten(obj, WHERE)
        except Exception as e:  # noqa: BLE001 - unpickling refused, not a torch file, bad structure
            raise CheckpointError(f"cannot load {file!r} as a state dict with weights_only=True: "
                                  f"{type(e).__name__}: {e}") from None
        self.entries: dict[str, Entry] = {}
        for key, v in self.full.items():
            if isinstance(v, torch.Tensor):
                shape = tuple(v.shape)
                whole = Chunk((0,) * len(shape), shape, "", 0, 0, ())
                self.entries[key] = TensorEntry(shape, v.dtype, (whole,))
            else:
                self.entries[key] = ValueEntry(v)

    def check(self, key: str, chunk: Chunk) -> str | None:
        return None

    def read(self, key: str, entry: TensorEntry, piece: Piece, verify: Container[int]) -> torch.Tensor:
        t = self.full[key]
        for d, (o, n) in enumerate(piece.ov):
            t = t.narrow(d, o, n)
        return t

    def read_whole_into(self, key: str, chunk: Chunk, out: torch.Tensor, verify: Container[int]) -> None:
        raise AssertionError("FileSource has no direct reads")

    def close(self) -> None:
        pass


Source = FolderSource | FileSource


def open_source(path: str) -> Source:
    if os.path.isdir(path):
        return FolderSource(path)
    if os.path.isfile(path):
        return FileSource(path)
    raise CheckpointError(f"no checkpoint at {path!r}: neither a checkpoint folder nor a file")


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored chunk's overlap with a target box: chunk-relative bytes ``[lo, hi)`` hold its rows."""

    chunk_index: int
    chunk: Chunk
    ov: Box
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Target:
    """A tensor this rank fills: its local data, the global box it holds, the pieces to read."""

    key: str
    local: torch.Tensor
    box: Box
    zero: bool
    pieces: tuple[Piece, ...]
    # A StridedShard target holds no box: ``local`` is then its shard of the layout with the strided
    # axes replicated (``move[0]``), taken apart into ``into`` (its own, ``move[1]``) once filled
    into: torch.Tensor | None = None
    move: tuple[DistSpec, DistSpec] | None = None


class _Blocks:
    """The blocks of one chunk this rank verifies, as a container of block numbers."""

    def __init__(self, verify: set[tuple[str, int, int]], key: str, ci: int) -> None:
        self.verify, self.key, self.ci = verify, key, ci

    def __contains__(self, block: object) -> bool:
        return (self.key, self.ci, block) in self.verify


def _piece(ci: int, chunk: Chunk, ov: Box, itemsize: int) -> Piece:
    if not chunk.shape:
        return Piece(ci, chunk, ov, 0, chunk.nbytes)
    row = numel(chunk.shape[1:]) * itemsize
    r0 = ov[0][0] - chunk.offset[0]
    return Piece(ci, chunk, ov, r0 * row, (r0 + ov[0][1]) * row)


def plan_reads(source: Source, flat: dict[str, Any], rank: int) -> list[Target]:
    """Every target tensor this rank fills (shapes already checked to match)."""
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)

    out = []
    for key, leaf in flat.items():
        entry = source.entries.get(key)
        if not isinstance(leaf, torch.Tensor) or not isinstance(entry, TensorEntry) or tuple(leaf.shape) != entry.shape:
            continue
        box, zero = target_box(leaf, rank)
        if box is None or box_numel(box) == 0:
            continue
        local = layout.local_or_plain(leaf).detach()
        item = torch.empty((), dtype=entry.dtype).element_size()
        pieces = () if zero else tuple(
            _piece(ci, c, ov, item) for ci, c in enumerate(entry.chunks)
            if (ov := intersect_boxes(box, c.box)) is not None)
        spec = layout.spec_or_none(leaf)
        if spec is not None and spec.has_strided:
            mine, held = spec.without_partial(), spec.without_partial().unstrided()
            whole = torch.empty([n for _, n in box], dtype=local.dtype, device=local.device)
            out.append(Target(key, whole, box, zero, pieces, local, (held, mine)))
            continue
        out.append(Target(key, local, box, zero, pieces))
    return out


def _claims(source: Source, targets: list[Target]) -> list[Claim]:
    if not isinstance(source, FolderSource):
        return []
    return [(t.key, p.chunk_index, p.lo // CRC_BLOCK, (p.hi - 1) // CRC_BLOCK + 1)
            for t in targets for p in t.pieces if p.hi > p.lo]


def _fill(source: Source, t: Target, verify: set[tuple[str, int, int]]) -> None:
    """Fill ``t.local`` (this rank's data of global region ``t.box``) from the stored chunks."""
    if t.zero:
        t.local.zero_()
        return
    entry = source.entries[t.key]
    assert isinstance(entry, TensorEntry)
    local, filled = t.local, 0
    for p in t.pieces:
        filled += box_numel(p.ov)
        mine = _Blocks(verify, t.key, p.chunk_index)
        if (source.direct and p.ov == t.box == p.chunk.box and local.dtype == entry.dtype
                and local.device.type == "cpu" and local.is_contiguous() and not local.is_conj()
                and not local.is_neg()):
            source.read_whole_into(t.key, p.chunk, local, mine)  # straight into the target's memory
            continue
        dst = local
        for d, (o, n) in enumerate(p.ov):
            dst = dst.narrow(d, o - t.box[d][0], n)
        dst.copy_(source.read(t.key, entry, p, mine))
    if filled != box_numel(t.box):
        raise CheckpointError(f"{source.name}: the stored chunks of {t.key!r} cover {filled} of the "
                              f"{box_numel(t.box)} elements of the region {list(t.box)} this rank needs")


def _check(source: Source, flat: dict[str, Any], targets: list[Target],
           strict: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """(errors, checkpoint keys this rank's target lacks) from metadata and file sizes only."""
    errors = [("value", m) for m in check_target(source.entries, flat, source.name, strict)]
    for t in targets:
        for p in t.pieces:
            why = source.check(t.key, p.chunk)
            if why:
                errors.append(("io", why))
    extra = [k for k in source.entries if k not in flat] if strict else []
    return errors, extra


def checkpoint_keys(path: str | os.PathLike[str]) -> list[str]:
    """The dotted keys a checkpoint folder or exported file holds (its metadata only: no tensor
    is read; every rank reads the same). Raises CheckpointError when there is none."""
    source = open_source(os.fspath(path))
    try:
        return list(source.entries)
    finally:
        source.close()


def load_state_dict(state_dict: dict[str, Any], path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Fill ``state_dict`` in place from the checkpoint folder or exported file at ``path``.

    Collective over the default world. Tensors keep their identity and layout (DistTensor
    shards are overwritten; dtypes are cast); plain values (step counters, ...) are replaced.
    ``strict`` (default): every target key must be in the checkpoint and every checkpoint key in
    some rank's target; shapes must always match. Raises ValueError (the state dict does not
    fit) or CheckpointError (missing, damaged or invalid checkpoint) on every rank alike.
    """
    rank = runtime.get_rank()
    errors: list[tuple[str, str]] = []
    extra: list[str] = []
    source: Source | None = None
    flat: dict[str, Any] = {}
    targets: list[Target] = []
    try:
        flat = flatten(state_dict, WHERE)
        source = open_source(os.fspath(path))
        targets = plan_reads(source, flat, rank)
        errors, extra = _check(source, flat, targets, strict)
    except (TypeError, ValueError) as e:
        errors.append(_world.error_of(e))
    except (CheckpointError, OSError) as e:
        errors.append(("io", str(e)))
    claims = _claims(source, targets) if source is not None else []
    gathered = _world.exchange((errors, extra, claims), WHERE, "checking the checkpoint against the state dicts")
    everyone = [g[0] for g in gathered]
    if strict:
        name = f"the checkpoint {os.fspath(path)!r}"
        common = [("value", m) for m in unexpected_keys([g[1] for g in gathered], name)]
        everyone = [errs + common for errs in everyone]
    try:
        _world.raise_gathered(everyone, WHERE)
        assert source is not None
        _read_all(source, targets, blocks_to_verify([g[2] for g in gathered], rank))
    finally:
        if source is not None:
            source.close()
    entries = source.entries
    replace_values(state_dict, lambda key, leaf: _new_value(entries, key, leaf))


def _read_all(source: Source, targets: list[Target], verify: set[tuple[str, int, int]]) -> None:
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)

    errors: list[tuple[str, str]] = []
    key = ""
    try:
        with torch.no_grad():
            for t in targets:
                key = t.key
                _fill(source, t, verify)
                if t.into is not None and t.move is not None:  # (held -> its own: local slices, no collective)
                    t.into.copy_(layout.move(t.local, *t.move))
    except CheckpointError as e:
        errors.append(("io", str(e)))
    except Exception as e:  # noqa: BLE001 - a target this rank cannot write: every rank must learn it
        errors.append(("value", f"cannot write the values of {key!r} into the target: {type(e).__name__}: {e}"))
    _world.agree(errors, WHERE, "reading the checkpoint")


def _new_value(entries: dict[str, Entry], key: str, leaf: Any) -> Any:
    e = entries.get(key)
    return e.value if isinstance(e, ValueEntry) else leaf
