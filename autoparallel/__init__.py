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
from autoparallel import pending  # noqa: F401  (installs the deferred-statistic hooks)
from autoparallel.api import dtensor_from_local, reshard, shard_tensor, unshard_dtensor
from autoparallel.local_map import LocalLayer, local_map
from autoparallel.runtime import get_rank, get_world_size
from autoparallel.factory import empty, full, ones, rand, randn, zeros
from spmd_rules.registry import register_axis_rule, register_local_impl, register_rule
import spmd_rules  # noqa: F401,E402  (registers every rule family)
from autoparallel.nn import (  # noqa: E402
    ColWiseParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
    parallelize,
    shard_layer,
)
from autoparallel.optim import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer  # noqa: E402
from autoparallel.data import shard_dataloader  # noqa: E402
from autoparallel import pipeline  # noqa: E402,F401
from autoparallel.checkpoint import load_state_dict, save_state_dict  # noqa: E402
from autoparallel.regions import disable_local_regions, enable_local_regions, local_regions_report  # noqa: E402

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
    # model level (autoparallel.nn, .optim, .data, .checkpoint; pipelines under ap.pipeline)
    "ColWiseParallel",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallel",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "VocabParallelEmbedding",
    "disable_local_regions",
    "enable_local_regions",
    "load_state_dict",
    "local_regions_report",
    "parallelize",
    "pipeline",
    "save_state_dict",
    "shard_dataloader",
    "shard_layer",
    "shard_optimizer",
]

__version__ = "0.1.0"
