"""Static mode: ``ap.to_static`` captures a training step per rank and replays it; ``ap.Engine``
runs Paddle's static semi-auto programs on the dynamic API.

``model`` (``DistModel``, ``to_static``), ``capture`` (recording one call as a program of local
ops and functional collectives), ``strategy`` (``ap.Strategy``), ``engine`` (``ap.Engine``,
``ap.InputSpec``), ``metrics`` (``ap.metrics``). See docs/static.md and docs/engine.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoparallel.static import metrics
from autoparallel.static.inputs import InputSpec
from autoparallel.static.model import DistModel, to_static
from autoparallel.static.strategy import Strategy

if TYPE_CHECKING:
    from autoparallel.static.engine import Engine


def __getattr__(name: str) -> Any:
    # the Engine sits above pipelines (it builds them), and pipelines use static chunks: it is
    # imported on first use, so importing ``static.chunk`` does not run the Engine's imports
    if name == "Engine":
        return importlib.import_module("autoparallel.static.engine").Engine
    raise AttributeError(f"module 'autoparallel.static' has no attribute {name!r}")


__all__ = ["DistModel", "Engine", "InputSpec", "Strategy", "metrics", "to_static"]
