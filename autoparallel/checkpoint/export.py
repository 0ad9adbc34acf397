"""``export_state_dict``: one plain ``torch.save`` file of full tensors, for inference.

Every DistTensor is gathered with ``ap.unshard_dtensor`` (Partial values reduced), and rank 0
writes the state dict's structure with plain full tensors and plain values to a temporary name
and renames it into place. Read it back anywhere with ``torch.load(file, weights_only=True)``,
or into any layout with ``ap.load_state_dict(target, file)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.checkpoint import _world
from autoparallel.checkpoint.flat import flatten, map_leaves
from autoparallel.checkpoint.metadata import CheckpointError

WHERE = "export_state_dict"


FORMATS = ("torch", "safetensors")


def export_state_dict(state_dict: dict[str, Any], file: str | os.PathLike[str], *, format: str = "torch") -> None:
    """Write ``state_dict`` with full plain tensors to the single file ``file`` (rank 0 writes).

    Collective over the default world: every rank calls it with its state dict. Rank 0 must
    hold every key that any rank holds (e.g. not a pipeline stage's private keys); a DistTensor
    on a mesh without rank 0 (a later pipeline stage's) is moved whole onto rank 0.

    ``format="torch"``: a ``torch.save`` file of the state dict's structure (read it with
    ``torch.load(file, weights_only=True)`` or ``ap.load_state_dict``). ``format="safetensors"``
    (needs the ``safetensors`` package: ``pip install safetensors``, or the ``export`` extra): a
    flat ``{dotted key: tensor}`` safetensors file; plain values (steps, learning rates) go into
    its string metadata as JSON. Read it with ``safetensors.torch.load_file``.
    """
    if format not in FORMATS:
        raise ValueError(f"{WHERE}: format must be one of {FORMATS}, got {format!r}")
    if format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401, PLC0415  (optional: only this format needs it)
        except ImportError:
            raise ValueError(f"{WHERE}: format='safetensors' needs the safetensors package "
                             "(pip install safetensors)") from None
    rank = runtime.get_rank()
    errors: list[tuple[str, str]] = []
    flat: dict[str, Any] = {}
    try:
        flat = flatten(state_dict, WHERE)
    except (TypeError, ValueError) as e:
        errors.append(_world.error_of(e))
    gathered = _world.exchange((errors, list(flat)), WHERE, "checking the state dicts")
    first = set(gathered[0][1])
    lacking = [k for g in gathered for k in g[1] if k not in first]
    everyone = [g[0] + ([("value", f"rank 0 lacks keys other ranks hold: {sorted(set(lacking))[:8]}")]
                        if lacking else []) for g in gathered]
    _world.raise_gathered(everyone, WHERE)
    full: dict[str, torch.Tensor] = {}
    from autoparallel.api import reshard, unshard_dtensor  # noqa: PLC0415  (api imports the dtensor stack)
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)
    from autoparallel.mesh import ProcessMesh  # noqa: PLC0415
    from autoparallel.placement import Replicate  # noqa: PLC0415

    writer = ProcessMesh([0], dim_names=["writer"])
    with torch.no_grad():
        for key in gathered[0][1]:  # rank 0's order on every rank: each gather is a collective
            if key not in flat:
                continue
            leaf = flat[key]
            if layout.is_dist(leaf) and 0 not in leaf.process_mesh:
                # a pipeline stage's tensor: moved whole onto rank 0 (every rank joins the move)
                full[key] = reshard(leaf, writer, [Replicate()]).to_local().detach().cpu()
            elif layout.is_dist(leaf):
                full[key] = unshard_dtensor(leaf).detach().cpu()
            elif isinstance(leaf, torch.Tensor):
                full[key] = leaf.detach().cpu().clone()
    status = None
    if rank == 0:
        path = os.fspath(file)
        tmp = path + ".tmp"
        try:
            if format == "safetensors":
                _write_safetensors(flat, full, tmp)
            else:
                torch.save(map_leaves(state_dict, lambda k, v: full[k]), tmp)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            status = f"rank 0 could not write {path!r}: {type(e).__name__}: {e}"
    statuses = _world.exchange(status, WHERE, "writing")
    if statuses[0]:
        raise CheckpointError(f"{WHERE}: {statuses[0]}")


def _write_safetensors(flat: dict[str, Any], full: dict[str, torch.Tensor], path: str) -> None:
    """Tensors under their dotted keys; every other leaf as JSON in the metadata."""
    import json  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415  (optional dependency)

    tensors = {k: t.contiguous().clone() for k, t in full.items()}  # safetensors refuses shared storage
    values = {k: v for k, v in flat.items() if k not in full}
    meta = {"format": "pt", "autoparallel.values": json.dumps(values, default=repr)}
    save_file(tensors, path, metadata=meta)
