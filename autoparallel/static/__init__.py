"""Static mode: ``ap.to_static`` captures a training step per rank and replays it; ``ap.Engine``
runs Paddle's static semi-auto programs on the dynamic API.

``model`` (``DistModel``, ``to_static``), ``capture`` (recording one call as a program of local
ops and functional collectives), ``strategy`` (``ap.Strategy``), ``engine`` (``ap.Engine``,
``ap.InputSpec``), ``metrics`` (``ap.metrics``). See docs/static.md and docs/engine.md.
"""

from autoparallel.static import metrics
from autoparallel.static.engine import Engine
from autoparallel.static.inputs import InputSpec
from autoparallel.static.model import DistModel, to_static
from autoparallel.static.strategy import Strategy

__all__ = ["DistModel", "Engine", "InputSpec", "Strategy", "metrics", "to_static"]
