"""autoparallel: semi-automatic parallel training for PyTorch.

Write a single-device model, annotate tensors with a ``ProcessMesh`` and placements, and run
under ``torchrun``: every op on a ``DistTensor`` is propagated by SPMD rules and the needed
collectives are inserted by a reshard planner.
"""

from autoparallel.placement import Partial, Placement, Replicate, Shard  # noqa: I001  (order: values first)
from autoparallel.mesh import ProcessMesh
from autoparallel.spec import DistSpec
from autoparallel.debug import CommDebugMode, CommRecord
from autoparallel.dtensor import DistTensor
from autoparallel.api import dtensor_from_local, reshard, shard_tensor, unshard_dtensor
from autoparallel.local_map import LocalLayer, local_map
from autoparallel.runtime import get_rank, get_world_size
from autoparallel.factory import empty, full, ones, rand, randn, zeros
from spmd_rules.registry import register_axis_rule, register_local_impl, register_rule
import spmd_rules  # noqa: F401,E402  (registers every rule family)

__all__ = [
    "CommDebugMode",
    "CommRecord",
    "DistSpec",
    "DistTensor",
    "LocalLayer",
    "Partial",
    "Placement",
    "ProcessMesh",
    "Replicate",
    "Shard",
    "dtensor_from_local",
    "get_rank",
    "get_world_size",
    "local_map",
    "register_axis_rule",
    "register_local_impl",
    "register_rule",
    "reshard",
    "shard_tensor",
    "unshard_dtensor",
    "empty",
    "full",
    "ones",
    "rand",
    "randn",
    "zeros",
]

__version__ = "0.1.0"
