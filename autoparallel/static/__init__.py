"""Static mode: ``ap.to_static`` captures a training step per rank and replays it; ``ap.Engine``
runs Paddle's static semi-auto programs on the dynamic API.

``model`` (``DistModel``, ``to_static``), ``capture`` (recording one call as a program of local
ops and functional collectives), ``strategy`` (``ap.Strategy``), ``inputs`` (``ap.InputSpec``),
``metrics`` (``ap.metrics``). ``ap.Engine`` lives above pipelines, in ``autoparallel.static_engine``
(it builds pipelines, which replay static chunks). See docs/static.md and docs/engine.md.
"""

from __future__ import annotations

from autoparallel.static import metrics
from autoparallel.static.inputs import InputSpec
from autoparallel.static.model import DistModel, to_static
from autoparallel.static.strategy import Strategy

__all__ = ["DistModel", "InputSpec", "Strategy", "metrics", "to_static"]
