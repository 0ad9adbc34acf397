"""``load_state_dict``: fill a target state dict in place from a checkpoint, in any layout.

The target decides the layout: each rank computes the global box each of its tensors holds
(a DistTensor's local shard on any mesh, placements, uneven sizes or shard order; a plain
tensor's whole value), intersects it with the stored chunks, and reads only those pieces: the
rows of each chunk the box needs, widened to the CRC blocks that verify them. No pickle is
ever run: a checkpoint folder is JSON plus raw bytes, an exported file is read with
``torch.load(weights_only=True)``.

Errors are agreed before anything is changed: every rank checks the target against the
metadata (missing/unexpected keys, shapes, kinds) and the data files it needs (present, long
enough), the ranks exchange their findings, and all raise the same error. Read errors
(checksums) are exchanged the same way after reading; the target's tensors may then hold
partly loaded values, its plain values are untouched.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.checkpoint import _world
from autoparallel.checkpoint.flat import flatten, replace_values
from autoparallel.checkpoint.metadata import (
    CheckpointError,
    Chunk,
    Entry,
    TensorEntry,
    ValueEntry,
    from_json,
    numel,
)
from autoparallel.checkpoint.planner import box_numel, check_target, overlaps, target_box, unexpected_keys
from autoparallel.checkpoint.storage import DataReader, read_metadata_text
from autoparallel.spec import Box

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

    def read(self, key: str, entry: TensorEntry, chunk: Chunk, ov: Box) -> torch.Tensor:
        """The stored values of global region ``ov`` (inside ``chunk``)."""
        item = torch.empty((), dtype=entry.dtype).element_size()
        if not chunk.shape:
            return self.reader.read_rows(chunk, 0, chunk.nbytes, key).view(entry.dtype).reshape(())
        row = numel(chunk.shape[1:]) * item
        r0 = ov[0][0] - chunk.offset[0]
        r1 = r0 + ov[0][1]
        t = self.reader.read_rows(chunk, r0 * row, r1 * row, key).view(entry.dtype).reshape((r1 - r0, *chunk.shape[1:]))
        for d in range(1, len(ov)):
            t = t.narrow(d, ov[d][0] - chunk.offset[d], ov[d][1])
        return t

    def read_whole_into(self, key: str, chunk: Chunk, out: torch.Tensor) -> None:
        self.reader.read_into(chunk, 0, out.view(-1).view(torch.uint8), key)

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

    def read(self, key: str, entry: TensorEntry, chunk: Chunk, ov: Box) -> torch.Tensor:
        t = self.full[key]
        for d, (o, n) in enumerate(ov):
            t = t.narrow(d, o, n)
        return t

    def read_whole_into(self, key: str, chunk: Chunk, out: torch.Tensor) -> None:
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


def _local(leaf: torch.Tensor) -> torch.Tensor:
    local = getattr(leaf, "_local", None)
    return (leaf if local is None else local).detach()


def _reads(source: Source, flat: dict[str, Any], rank: int) -> list[tuple[str, torch.Tensor, Box, bool]]:
    """(key, local tensor, box, zero-fill) for every target tensor this rank must fill."""
    out = []
    for key, leaf in flat.items():
        if isinstance(leaf, torch.Tensor) and isinstance(source.entries.get(key), TensorEntry):
            box, zero = target_box(leaf, rank)
            if box is not None and box_numel(box) > 0:
                out.append((key, _local(leaf), box, zero))
    return out


def _fill(source: Source, key: str, local: torch.Tensor, box: Box, zero: bool) -> None:
    """Fill ``local`` (this rank's data of global region ``box``) from the stored chunks."""
    if zero:
        local.zero_()
        return
    entry = source.entries[key]
    assert isinstance(entry, TensorEntry)
    filled = 0
    for chunk, ov in overlaps(box, entry.chunks):
        filled += box_numel(ov)
        if (source.direct and ov == box == chunk.box and local.dtype == entry.dtype
                and local.device.type == "cpu" and local.is_contiguous()):
            source.read_whole_into(key, chunk, local)  # straight into the target's memory
            continue
        dst = local
        for d, (o, n) in enumerate(ov):
            dst = dst.narrow(d, o - box[d][0], n)
        dst.copy_(source.read(key, entry, chunk, ov))
    if filled != box_numel(box):
        raise CheckpointError(f"{source.name}: the stored chunks of {key!r} cover {filled} of the "
                              f"{box_numel(box)} elements of the region {list(box)} this rank needs")


def _check(source: Source, flat: dict[str, Any], strict: bool, rank: int) -> tuple[list[tuple[str, str]], list[str]]:
    """(errors, checkpoint keys this rank's target lacks) from metadata and file sizes only."""
    errors = [("value", m) for m in check_target(source.entries, flat, source.name, strict)]
    for key, _, box, zero in _reads(source, flat, rank):
        entry = source.entries[key]
        assert isinstance(entry, TensorEntry)
        if zero or tuple(entry.shape) != tuple(flat[key].shape):
            continue
        for chunk, _ in overlaps(box, entry.chunks):
            why = source.check(key, chunk)
            if why:
                errors.append(("io", why))
    extra = [k for k in source.entries if k not in flat] if strict else []
    return errors, extra


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
    try:
        flat = flatten(state_dict, WHERE)
        source = open_source(os.fspath(path))
        errors, extra = _check(source, flat, strict, rank)
    except (TypeError, ValueError) as e:
        errors.append(("value", str(e)))
    except (CheckpointError, OSError) as e:
        errors.append(("io", str(e)))
    gathered = _world.exchange((errors, extra), WHERE, "checking the checkpoint against the state dicts")
    everyone = [g[0] for g in gathered]
    if strict:
        common = [("value", m) for m in unexpected_keys([g[1] for g in gathered], f"the checkpoint {os.fspath(path)!r}")]
        everyone = [errs + common for errs in everyone]
    try:
        _world.raise_gathered(everyone, WHERE)
        assert source is not None
        _read_all(source, flat, rank)
    finally:
        if source is not None:
            source.close()
    entries = source.entries
    replace_values(state_dict, lambda key, leaf: _new_value(entries, key, leaf))


def _read_all(source: Source, flat: dict[str, Any], rank: int) -> None:
    errors: list[tuple[str, str]] = []
    try:
        with torch.no_grad():
            for key, local, box, zero in _reads(source, flat, rank):
                _fill(source, key, local, box, zero)
    except CheckpointError as e:
        errors.append(("io", str(e)))
    _world.agree(errors, WHERE, "reading the checkpoint")


def _new_value(entries: dict[str, Entry], key: str, leaf: Any) -> Any:
    e = entries.get(key)
    return e.value if isinstance(e, ValueEntry) else leaf
