"""The runtime layer: the world this process lives in, the process groups, the collectives.

``autoparallel.runtime`` itself answers the world's facts (``get_rank``, ``get_world_size``,
``backend``, ``default_device``, the collective timeout): they live in ``runtime.world``, a leaf
that imports nothing of the library. ``runtime.groups`` owns every process group the library
creates, for its whole life; ``runtime.comm`` is the only module that issues collectives;
``runtime.debug`` records them (``CommDebugMode``). Nothing here imports the engine or above.
"""

from autoparallel.runtime.world import (
    TIMEOUT_VAR,
    backend,
    collective_timeout,
    collective_timeout_s,
    default_device,
    ensure_world,
    get_rank,
    get_world_size,
    torchrun_env_present,
    world_available,
)

__all__ = [
    "TIMEOUT_VAR",
    "backend",
    "collective_timeout",
    "collective_timeout_s",
    "default_device",
    "ensure_world",
    "get_rank",
    "get_world_size",
    "torchrun_env_present",
    "world_available",
]
