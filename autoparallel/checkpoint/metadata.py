"""Checkpoint metadata: what a checkpoint folder holds, as JSON (pure; never pickle).

``metadata.json`` maps every flattened key to either a plain value or a tensor entry: global
shape, dtype and its chunks. A chunk is a box of the global tensor (global offset, shape)
stored row-major in one data file at ``[start, start + nbytes)``, with a CRC-32 per
``crc_block`` bytes so a reader can verify exactly the blocks it reads.

Parsing validates everything a hostile or damaged file could get wrong — format and version,
dtype names from a fixed table, integer fields, chunk boxes inside the tensor, byte counts that
match the box, and file names that are plain names inside the checkpoint folder (no path
separators, no absolute paths, no ``..``) — and raises ``CheckpointError`` naming the key.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.checkpoint.flat import decode_value, encode_value
from autoparallel.spec import Box

FORMAT = "autoparallel.checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
CRC_BLOCK = 1 << 20  # bytes covered by one CRC-32
ALIGN = 64  # chunk starts in a data file are multiples of this (any dtype view is aligned)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")

_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64",
                "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                "float8_e4m3fn", "float8_e5m2")
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupted, or its metadata is invalid."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored box of a tensor: where it lies in the global tensor and in which file."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    start: int
    nbytes: int
    crc32: tuple[int, ...]

    @property
    def box(self) -> Box:
        return tuple(zip(self.offset, self.shape))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor: global shape and dtype, and the chunks that together cover it exactly once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class ValueEntry:
    """A plain value (None/bool/int/float/str, or a container of them) stored in the metadata."""

    value: Any


Entry = TensorEntry | ValueEntry


def dtype_name(dtype: torch.dtype, key: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{key!r} has dtype {dtype}, which checkpoints do not support; "
                        f"supported: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def check_file_name(name: object, key: str) -> str:
    """``name`` if it is a plain file name inside the checkpoint folder, else CheckpointError."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise CheckpointError(f"metadata of {key!r} names the data file {name!r}, which is not a "
                              "plain file name inside the checkpoint folder (absolute paths, "
                              "separators and '..' are rejected)")
    return name


# ---- JSON ----------------------------------------------------------------------------------
def to_json(entries: dict[str, Entry]) -> str:
    """The metadata document for ``entries``."""
    out: dict[str, Any] = {}
    for key, e in entries.items():
        if isinstance(e, ValueEntry):
            out[key] = {"kind": "value", "value": encode_value(e.value)}
            continue
        out[key] = {"kind": "tensor", "dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                    "chunks": [{"offset": list(c.offset), "shape": list(c.shape), "file": c.file,
                                "start": c.start, "nbytes": c.nbytes, "crc32": list(c.crc32)}
                               for c in e.chunks]}
    doc = {"format": FORMAT, "version": VERSION, "byteorder": sys.byteorder,
           "crc_block": CRC_BLOCK, "entries": out}
    return json.dumps(doc, separators=(",", ":"))


def from_json(text: str, source: str) -> dict[str, Entry]:
    """Parse and validate a metadata document; ``source`` names it in errors."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not an autoparallel checkpoint (format field missing)")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{source} has version {doc.get('version')!r}; this reader knows {VERSION}")
    if doc.get("byteorder") != sys.byteorder:
        raise CheckpointError(f"{source} was written on a {doc.get('byteorder')}-endian machine; "
                              f"this one is {sys.byteorder}-endian")
    if doc.get("crc_block") != CRC_BLOCK:
        raise CheckpointError(f"{source} has crc_block {doc.get('crc_block')!r}, expected {CRC_BLOCK}")
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source} has no 'entries' object")
    return {key: _entry(key, e) for key, e in raw.items()}


def _ints(v: object, key: str, field: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(i) is int and i >= 0 for i in v) or (n is not None and len(v) != n):
        raise CheckpointError(f"metadata of {key!r}: {field} must be a list of "
                              f"{'' if n is None else str(n) + ' '}non-negative ints, got {v!r}")
    return tuple(v)


def _int(v: object, key: str, field: str) -> int:
    if type(v) is not int or v < 0:
        raise CheckpointError(f"metadata of {key!r}: {field} must be a non-negative int, got {v!r}")
    return v


def _entry(key: str, e: object) -> Entry:
    if not isinstance(e, dict) or e.get("kind") not in ("value", "tensor"):
        raise CheckpointError(f"metadata of {key!r} is not a value or tensor entry: {e!r:.200}")
    if e["kind"] == "value":
        try:
            return ValueEntry(decode_value(e.get("value"), key))
        except (ValueError, RecursionError) as err:
            raise CheckpointError(f"metadata of {key!r}: {err}") from None
    if e.get("dtype") not in DTYPES:
        raise CheckpointError(f"metadata of {key!r}: unknown dtype {e.get('dtype')!r}")
    dtype = DTYPES[e["dtype"]]
    shape = _ints(e.get("shape"), key, "shape")
    chunks = e.get("chunks")
    if not isinstance(chunks, list):
        raise CheckpointError(f"metadata of {key!r}: chunks must be a list")
    out = []
    item = torch.empty((), dtype=dtype).element_size()
    for c in chunks:
        if not isinstance(c, dict):
            raise CheckpointError(f"metadata of {key!r}: chunk {c!r:.200} is not an object")
        off = _ints(c.get("offset"), key, "chunk offset", len(shape))
        cs = _ints(c.get("shape"), key, "chunk shape", len(shape))
        if any(o + s > n for o, s, n in zip(off, cs, shape)):
            raise CheckpointError(f"metadata of {key!r}: chunk at offset {list(off)} of shape "
                                  f"{list(cs)} lies outside the tensor of shape {list(shape)}")
        nbytes = _int(c.get("nbytes"), key, "nbytes")
        if nbytes != numel(cs) * item:
            raise CheckpointError(f"metadata of {key!r}: chunk of shape {list(cs)} and dtype "
                                  f"{e['dtype']} has nbytes {nbytes}, expected {numel(cs) * item}")
        crc = _ints(c.get("crc32"), key, "crc32", -(-nbytes // CRC_BLOCK))
        out.append(Chunk(off, cs, check_file_name(c.get("file"), key),
                         _int(c.get("start"), key, "start"), nbytes, crc))
    covered = sum(numel(c.shape) for c in out)
    if covered != numel(shape):
        raise CheckpointError(f"metadata of {key!r}: chunks hold {covered} elements but the tensor "
                              f"of shape {list(shape)} has {numel(shape)}")
    return TensorEntry(shape, dtype, tuple(out))
