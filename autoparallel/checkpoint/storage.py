"""Files of a checkpoint folder: raw chunk bytes with CRC-32s, atomic metadata commit.

A folder holds ``metadata.json`` and data files ``data-<save id>-r<rank>.bin``, one per rank
and save, each the row-major bytes of that rank's chunks (starts aligned to ``ALIGN``). A save
writes new data files next to the old ones, then replaces ``metadata.json`` atomically
(``os.replace`` of a fully written and fsynced temporary file): a crash at any moment leaves
either the old or the new metadata, each pointing at complete files. Data files no committed
metadata refers to are deleted after the commit.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Container, Sequence

import torch

from autoparallel.checkpoint.metadata import (
    ALIGN,
    CRC_BLOCK,
    METADATA_FILE,
    CheckpointError,
    Chunk,
    Entry,
    TensorEntry,
)

_DATA_FILE = re.compile(r"data-[0-9a-f]+-r\d+\.bin")
_TMP_META = "." + METADATA_FILE + ".tmp"


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.bin"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 CPU tensor (a view when ``t`` is contiguous on CPU)."""
    t = t.detach().resolve_conj().resolve_neg()  # (a lazily conjugated view has no byte view)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _view(t: torch.Tensor) -> memoryview:
    """A writable byte view of uint8 CPU tensor ``t``'s memory (no copy)."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays implement the buffer protocol


def write_data_file(path: str, tensors: Sequence[torch.Tensor], fsync: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """Write ``tensors`` back to back; (start, nbytes, CRC-32 per block) of each."""
    out = []
    pos = 0
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            pad = -pos % ALIGN
            if pad:
                f.write(b"\0" * pad)
                pos += pad
            mv = _view(as_bytes(t))
            crcs = []
            for i in range(0, len(mv), CRC_BLOCK):  # checksum each block while it is in cache
                block = mv[i:i + CRC_BLOCK]
                crcs.append(zlib.crc32(block))
                done = 0
                while done < len(block):
                    done += f.write(block[done:])  # type: ignore[operator]  # raw writes return the count
            out.append((pos, len(mv), tuple(crcs)))
            pos += len(mv)
        if fsync:
            os.fsync(f.fileno())
    return out


def commit_metadata(folder: str, text: str, fsync: bool) -> None:
    """Replace ``folder/metadata.json`` by ``text`` atomically."""
    tmp = os.path.join(folder, _TMP_META)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, METADATA_FILE))


def finish_commit(folder: str, entries: dict[str, Entry], fsync: bool) -> None:
    """After a commit: make the rename durable, delete data files the new metadata does not use.

    Best effort: the checkpoint is already committed, so errors here are ignored.
    """
    try:
        if fsync and hasattr(os, "O_DIRECTORY"):
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        keep = {c.file for e in entries.values() if isinstance(e, TensorEntry) for c in e.chunks}
        for name in os.listdir(folder):
            if _DATA_FILE.fullmatch(name) and name not in keep:
                os.remove(os.path.join(folder, name))
    except OSError:
        pass


def read_metadata_text(folder: str) -> str:
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.isdir(folder):
        raise CheckpointError(f"no checkpoint at {folder!r}: the folder does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {folder!r}: {METADATA_FILE} is missing "
                              "(never saved, or no save finished)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path!r}: {e}") from None


class DataReader:
    """Reads byte ranges of chunks, verifying the CRC-32 of every block it touches."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.realpath(folder)
        self._fds: dict[str, int] = {}

    def path(self, name: str) -> str:
        """Absolute path of data file ``name``; CheckpointError if it would leave the folder."""
        p = os.path.realpath(os.path.join(self.folder, name))
        if os.path.dirname(p) != self.folder:
            raise CheckpointError(f"data file {name!r} resolves to {p!r}, outside the checkpoint "
                                  f"folder {self.folder!r}")
        return p

    def check_file(self, chunk: Chunk, key: str) -> str | None:
        """Why ``chunk``'s file cannot serve it (missing, too short), or None."""
        try:
            size = os.stat(self.path(chunk.file)).st_size
        except FileNotFoundError:
            return f"data file {chunk.file!r} (needed by {key!r}) is missing from {self.folder!r}"
        except CheckpointError as e:
            return str(e)
        if size < chunk.start + chunk.nbytes:
            return (f"data file {chunk.file!r} is truncated: {size} bytes, but {key!r} needs bytes "
                    f"[{chunk.start}, {chunk.start + chunk.nbytes})")
        return None

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = self._fds[name] = os.open(self.path(name), os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"data file {name!r} is missing from {self.folder!r}") from None
        return fd

    def read_into(self, chunk: Chunk, lo: int, out: torch.Tensor, verify: Container[int], key: str) -> None:
        """Fill uint8 ``out`` with chunk bytes ``[lo, lo + len(out))``, block by block, checking the
        CRC-32 of every block in ``verify`` (those blocks must lie wholly inside the range)."""
        mv = _view(out)
        fd, hi = self._fd(chunk.file), lo + len(mv)
        pos = lo
        while pos < hi:
            blk = pos // CRC_BLOCK
            end = min((blk + 1) * CRC_BLOCK, hi)
            piece = mv[pos - lo:end - lo]
            done = 0
            while done < len(piece):
                n = os.preadv(fd, [piece[done:]], chunk.start + pos + done)
                if n <= 0:
                    raise CheckpointError(
                        f"data file {chunk.file!r} is truncated: {key!r} needs bytes [{chunk.start}, "
                        f"{chunk.start + chunk.nbytes}), the file ends at {chunk.start + pos + done}")
                done += n
            if blk in verify and zlib.crc32(piece) != chunk.crc32[blk]:
                b0 = chunk.start + blk * CRC_BLOCK
                raise CheckpointError(
                    f"data file {chunk.file!r} is corrupted: checksum mismatch in bytes "
                    f"[{b0}, {chunk.start + end}) holding {key!r}")
            pos = end

    def read_range(self, chunk: Chunk, lo: int, hi: int, verify: Container[int], key: str) -> torch.Tensor:
        """Chunk bytes ``[lo, hi)`` as uint8; the range read grows to whole blocks where a block
        in ``verify`` is cut by it, so that block can be checked."""
        first, last = lo // CRC_BLOCK, (hi - 1) // CRC_BLOCK
        a = first * CRC_BLOCK if first in verify else lo
        b = min((last + 1) * CRC_BLOCK, chunk.nbytes) if last in verify else hi
        buf = torch.empty(b - a, dtype=torch.uint8)
        self.read_into(chunk, a, buf, verify, key)
        return buf[lo - a:hi - a]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
