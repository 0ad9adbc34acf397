"""Distributed checkpoints: sharded save, load that reshards to the target layout.

``save_state_dict(state_dict, path)`` writes a folder: each rank writes the chunks it owns
(one writer per replicated piece) and ``metadata.json`` (JSON) is committed atomically once all
ranks finished. ``load_state_dict(state_dict, path)`` fills any target layout in place, reading
only the stored pieces each rank needs. ``export_state_dict`` writes one plain ``torch.save``
file of full tensors; ``load_state_dict`` reads that too. See docs/checkpoint.md.
"""

from __future__ import annotations

from autoparallel.checkpoint.export import export_state_dict
from autoparallel.checkpoint.load import checkpoint_keys, load_state_dict
from autoparallel.checkpoint.metadata import CheckpointError
from autoparallel.checkpoint.resume import init_optimizer_state, rng_state, set_rng_state
from autoparallel.checkpoint.save import save_state_dict

__all__ = [
    "CheckpointError",
    "checkpoint_keys",
    "export_state_dict",
    "init_optimizer_state",
    "load_state_dict",
    "rng_state",
    "save_state_dict",
    "set_rng_state",
]
