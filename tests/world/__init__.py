"""Tier ``world``: library features in multi-process gloo worlds. ``pytest -m world``.

The harness itself is ``tests/world_harness.py``; its names are re-exported here so that
``from tests.world import World`` keeps working.
"""

from tests.world_harness import WorkerError, World, environment, world_fixture

__all__ = ["World", "WorkerError", "environment", "world_fixture"]
