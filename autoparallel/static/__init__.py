"""Static mode: ``ap.to_static`` captures a training step per rank and replays it.

``model`` (``DistModel``, ``to_static``), ``capture`` (recording one call as a program of local
ops and functional collectives), ``strategy`` (``ap.Strategy``). See docs/static.md.
"""

from autoparallel.static.model import DistModel, to_static
from autoparallel.static.strategy import Strategy

__all__ = ["DistModel", "Strategy", "to_static"]
