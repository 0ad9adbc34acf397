"""``save_state_dict``: every rank writes the chunks it owns; one atomic metadata commit.

Steps (all ranks of the default world call it; the state dicts may differ per rank, e.g.
pipeline stages, but a key present on several ranks must have the same shape and dtype):

1. Describe: flatten the state dict; each tensor becomes an ``Item`` (dtype, global shape, the
   global box this rank holds). ``Partial`` DistTensors count as their reduced value.
2. Agree: all-gather the items; every rank runs the same ``plan_save`` (one writer per
   distinct box, balanced by bytes); bad input raises the same error on every rank here.
3. Reduce: Partial DistTensors are reduced on their mesh (the checkpoint stores values, not
   summands, so it loads into any layout).
4. Write: each rank writes the chunks it owns into its own new data file.
5. Commit: ranks exchange their chunk records (or errors); only if all succeeded does rank 0
   write ``metadata.json`` atomically. Then every rank learns the outcome and raises if it
   failed, so a crash or error anywhere before the commit leaves the previous checkpoint.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.checkpoint import _world, storage
from autoparallel.checkpoint.flat import flatten
from autoparallel.checkpoint.metadata import DTYPES, Chunk, Entry, TensorEntry, ValueEntry, dtype_name, to_json
from autoparallel.checkpoint.planner import Item, SavePlan, TensorPlan, plan_save, target_box

WHERE = "save_state_dict"
Record = tuple[str, int, str, int, int, tuple[int, ...]]  # key, chunk index, file, start, nbytes, crc32s


def describe(flat: dict[str, Any], rank: int) -> list[Item]:
    """This rank's ``Item`` for every leaf (metadata only)."""
    items = []
    for key, leaf in flat.items():
        if not isinstance(leaf, torch.Tensor):
            items.append(Item(key, value=leaf))
            continue
        box, _ = target_box(leaf, rank)
        items.append(Item(key, dtype_name(leaf.dtype, key), tuple(leaf.shape), box))
    return items


def reduce_partials(flat: dict[str, Any], order: Iterable[str]) -> dict[str, Any]:
    """``flat`` with every Partial DistTensor replaced by its reduced value, and every
    ``StridedShard`` one gathered on its strided axes (same mesh): what ``target_box`` describes.

    Each is a collective, so they run in ``order`` (the plan's key order, the same on every rank),
    never in the order of this rank's dict, which may differ (a dict built from a set of names)
    and would pair one key's reduction with another's.
    """
    from autoparallel.api import reshard  # noqa: PLC0415  (api imports the dtensor stack)
    from autoparallel.engine import layout  # noqa: PLC0415

    out = dict(flat)
    for key in order:
        if key not in flat:
            continue
        leaf = flat[key]
        spec = layout.spec_or_none(leaf)
        if spec is not None and (spec.has_partial or spec.has_strided):
            reduced = spec.without_partial().unstrided()
            with torch.no_grad():
                out[key] = reshard(leaf, spec.mesh, list(reduced.placements), shard_order=reduced.shard_order)
    return out


def local_data(leaf: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``leaf``: a DistTensor's shard, a plain tensor itself (detached)."""
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)

    return layout.local_or_plain(leaf).detach()


def write_owned(folder: str, plan: SavePlan, flat: dict[str, Any], save_id: str, rank: int,
                fsync: bool) -> list[Record]:
    """Write this rank's chunks; records (key, chunk index, file, start, nbytes, crc32s)."""
    owned = plan.chunks_of(rank)
    if not owned:
        return []
    tensors = []
    for key, _, chunk in owned:
        data = local_data(flat[key])
        assert tuple(data.shape) == tuple(n for _, n in chunk.box), (key, data.shape, chunk.box)
        tensors.append(data)
    name = storage.data_file_name(save_id, rank)
    spans = storage.write_data_file(os.path.join(folder, name), tensors, fsync)
    return [(key, i, name, start, nbytes, crc) for (key, i, _), (start, nbytes, crc) in zip(owned, spans)]


def build_entries(plan: SavePlan, records: list[Record]) -> dict[str, Entry]:
    """The metadata entries: the plan's boxes completed by the writers' file records."""
    where = {(key, i): (file, start, nbytes, crc) for key, i, file, start, nbytes, crc in records}
    entries: dict[str, Entry] = {}
    for key, e in plan.entries.items():
        if not isinstance(e, TensorPlan):
            entries[key] = ValueEntry(e)
            continue
        chunks = []
        for i, c in enumerate(e.chunks):
            file, start, nbytes, crc = where[(key, i)]
            offset, shape = tuple(o for o, _ in c.box), tuple(n for _, n in c.box)
            chunks.append(Chunk(offset, shape, file, start, nbytes, tuple(crc)))
        entries[key] = TensorEntry(e.shape, DTYPES[e.dtype], tuple(chunks))
    return entries


def _error(e: BaseException) -> tuple[str, str]:
    return _world.error_of(e)


def save_state_dict(state_dict: dict[str, Any], path: str | os.PathLike[str], *, fsync: bool = True) -> None:
    """Save ``state_dict`` (nested dicts/lists of tensors, DistTensors and plain values) to folder ``path``.

    Collective over the default world. Each rank writes only the chunks it owns; replicated
    pieces are written once. ``metadata.json`` (JSON) is replaced atomically only after every
    rank finished writing, so an error or crash anywhere leaves the previous checkpoint in
    ``path`` loadable. ``fsync`` makes data and metadata durable before the commit.
    """
    folder = os.fspath(path)
    rank = runtime.get_rank()
    errors: list[tuple[str, str]] = []
    items: list[Item] = []
    flat: dict[str, Any] = {}
    try:
        flat = flatten(state_dict, WHERE)
        items = describe(flat, rank)
        os.makedirs(folder, exist_ok=True)
    except (OSError, TypeError, ValueError) as e:
        errors.append(_error(e))
    save_id = uuid.uuid4().hex[:16]
    gathered = _world.exchange((errors, items, save_id), WHERE, "describing the state dicts")
    _world.raise_gathered([g[0] for g in gathered], WHERE)
    save_id = gathered[0][2]
    plan = plan_save([g[1] for g in gathered])  # pure: raises the same ValueError everywhere
    flat = reduce_partials(flat, plan.entries)
    outcome: Any
    try:
        outcome = write_owned(folder, plan, flat, save_id, rank, fsync)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        outcome = f"{type(e).__name__}: {e}"
    commit(folder, plan, outcome, save_id, rank, fsync)


def commit(folder: str, plan: SavePlan, outcome: Any, save_id: str, rank: int, fsync: bool) -> None:
    """Gather every rank's records; rank 0 commits only if all ranks wrote; all learn the result."""
    outcomes = _world.exchange(outcome, WHERE, "collecting the written chunks before the commit")
    failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, str)}
    status: str | None = None
    if failed:
        status = (f"rank(s) {sorted(failed)} failed to write their chunks, so nothing was committed "
                  f"and {folder!r} still holds the previous checkpoint (if any): " +
                  "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items())))
    elif rank == 0:
        try:
            entries = build_entries(plan, [rec for recs in outcomes for rec in recs])
            storage.commit_metadata(folder, to_json(entries), fsync)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            status = f"rank 0 could not commit the metadata: {type(e).__name__}: {e}"
        else:  # committed: what follows is housekeeping, never a reason to fail the save
            storage.finish_commit(folder, entries, fsync)
    statuses = _world.exchange(status, WHERE, "committing")
    status = next((s for s in statuses if s), None)
    if status is not None:
        _remove_own(folder, save_id, rank)
        raise storage.CheckpointError(f"{WHERE}: {status}")


def _remove_own(folder: str, save_id: str, rank: int) -> None:
    try:
        os.remove(os.path.join(folder, storage.data_file_name(save_id, rank)))
    except OSError:
        pass
