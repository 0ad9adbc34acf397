"""Memory: activation recompute (full / selective) and the per-layer activation meter.

* :mod:`.recomputation` — ``recompute(module, policy)``: torch's checkpoint on DistTensor modules.
* :mod:`.meter` — ``LayerMeter``: bytes each layer's forward keeps for the backward, per rank.
* :mod:`.peak` — ``held_bytes``, ``peak_rise``: a step's peak memory on this rank, measured.
"""

from autoparallel.memory.meter import LayerMeter
from autoparallel.memory.peak import held_bytes, peak_rise
from autoparallel.memory.recomputation import recompute

__all__ = ["LayerMeter", "held_bytes", "peak_rise", "recompute"]
