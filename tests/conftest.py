"""Shared pytest configuration.

* Puts the repo root on ``sys.path`` so ``import autoparallel`` works.
* Multi-process gloo worlds: use the ready-made fixtures ``world2``, ``world4``,
  ``world8`` (started lazily by the first test that asks for one and shared by every
  module until the end of the run — worker functions must not leave global state
  behind that changes later tests), or declare a module-scoped one in a test module with
  ``world6 = world_fixture(6)`` (the fixture takes the variable's name). Worker
  functions must be module-level: ``world4.run(fn, *args)`` calls ``fn(rank, *args)``.
* Marker ``gpu``: tests needing CUDA/NCCL, auto-skipped when CUDA is unavailable.
"""

from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.world import World, WorkerError, world_fixture  # noqa: E402

__all__ = ["World", "WorkerError", "world_fixture"]

world2 = world_fixture(2, scope="session")
world4 = world_fixture(4, scope="session")
world8 = world_fixture(8, scope="session")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA/NCCL; skipped without a GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA/NCCL; no GPU available")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
