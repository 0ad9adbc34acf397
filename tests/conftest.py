"""Shared pytest configuration.

* Puts the repo root on ``sys.path`` so ``import autoparallel`` works.
* Multi-process gloo worlds: use the ready-made fixtures ``world2``, ``world4``,
  ``world8`` (started lazily by the first test that asks for one and shared by every
  module until the end of the run — worker functions must not leave global state
  behind that changes later tests), or declare a module-scoped one in a test module with
  ``world6 = world_fixture(6)`` (the fixture takes the variable's name). Worker
  functions must be module-level: ``world4.run(fn, *args)`` calls ``fn(rank, *args)``.
* ``AUTOPARALLEL_PROFILE_CACHE`` is empty unless set: the plan search's network profile is not
  kept between runs.
* Marker ``gpu``: tests needing CUDA/NCCL, auto-skipped when CUDA is unavailable.
* Tier markers, one per test, from its folder: ``pure`` (tests/pure: one process, no world;
  ``pytest -m pure``: one to two minutes on 2 cores), ``world`` (tests/world: multi-process gloo worlds),
  ``models`` (tests/models: the examples trained end to end), ``conformance``
  (tests/conformance: the op_db harness). A test marked with a tier itself keeps that tier
  instead of its folder's (a single-process test in a mostly-world module is ``@pytest.mark.pure``).
  A test in tests/pure never needs a world.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
# the plan search measures the network in each world instead of reading what an earlier run
# kept in the home directory (a test that keeps it names its own file)
os.environ.setdefault("AUTOPARALLEL_PROFILE_CACHE", "")

from tests.world_harness import WorkerError, World, world_fixture  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
_WORLD_FIXTURE = re.compile(r"world\d+")
TIERS = {
    "pure": "one process, no world (tests/pure); one to two minutes",
    "world": "multi-process gloo worlds (tests/world)",
    "models": "the examples trained end to end, torchrun included (tests/models)",
    "conformance": "the op_db conformance harness (tests/conformance)",
}

__all__ = ["World", "WorkerError", "world_fixture"]

world2 = world_fixture(2, scope="session")
world4 = world_fixture(4, scope="session")
world8 = world_fixture(8, scope="session")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA/NCCL; skipped without a GPU")
    config.addinivalue_line("markers", "inductor: compiles with torch.compile(backend=\"inductor\") (a cold compile takes 10-60 s here)")
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def _folder_tier(item: pytest.Item) -> str | None:
    rel = os.path.relpath(str(item.path), _TESTS)
    top = rel.split(os.sep, 1)[0]
    return top if top in TIERS and top != rel else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = _folder_tier(item)
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers and folder is not None:
            item.add_marker(getattr(pytest.mark, folder))
            tiers = [folder]
        needs_world = any(_WORLD_FIXTURE.fullmatch(f) for f in getattr(item, "fixturenames", ()))
        if ("pure" in tiers or folder == "pure") and (tiers != ["pure"] or needs_world):
            raise pytest.UsageError(f"{item.nodeid}: a pure test must not need a world or another tier; "
                                    "move it to tests/world (or mark it as what it is, outside tests/pure)")
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA/NCCL; no GPU available")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
