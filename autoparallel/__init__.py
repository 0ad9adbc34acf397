"""autoparallel: semi-automatic parallel training for PyTorch.

Write a single-device model, annotate tensors with a ``ProcessMesh`` and placements, and run
under ``torchrun``: every op on a ``DistTensor`` is propagated by SPMD rules and the needed
collectives are inserted by a reshard planner.

This module is the public face and nothing else: each name below is imported from the layer
that defines it on first access (PEP 562), so ``import autoparallel.placement`` (or
``import spmd_rules``, which uses the value types) runs no engine, runtime or model code.
The layers, bottom up (docs/architecture.md): values (``placement``, ``mesh``, ``spec``,
``cost``, and ``compat``: the private torch names) -> ``spmd_rules`` and ``reshard``'s planner -> ``runtime`` -> ``engine`` -> model-level
APIs (``api``, ``shard_op``, ``factory``, ``local_map``, ``nn``, ``plans``, ``optim``, ``data``, ``pipeline``,
``checkpoint``, ``regions``, ``memory``, ``static``: ``to_static`` and ``Engine``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoparallel import compat as _compat
from autoparallel import errors as _errors
from autoparallel import log as _log

# Under torchrun (WORLD_SIZE > 1), an uncaught ValueError/TypeError — a user error every rank
# raises alike — is printed once, as one line (autoparallel/errors.py; AUTOPARALLEL_DEBUG=1: off).
_errors.install()
_log.configure_from_env()  # AUTOPARALLEL_LOG=debug: the library's diagnostics on stderr
_compat.run_as_is_under_dynamo()  # torch.compile runs DistTensor ops eagerly, not the library's code compiled


def _start_world() -> None:
    """Start the default process group from torchrun's environment if none exists (the runtime's)."""
    importlib.import_module("autoparallel.runtime.world").ensure_world()


# Under torchrun the first ProcessMesh starts the default process group (as init_device_mesh does).
importlib.import_module("autoparallel.mesh").ProcessMesh.world_starter = _start_world

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # values
    "Partial": "autoparallel.placement",
    "Placement": "autoparallel.placement",
    "Replicate": "autoparallel.placement",
    "Shard": "autoparallel.placement",
    "StridedShard": "autoparallel.placement",
    "ProcessMesh": "autoparallel.mesh",
    "DistSpec": "autoparallel.spec",
    # rules
    "register_axis_rule": "spmd_rules.registry",
    "register_local_impl": "spmd_rules.registry",
    "register_rule": "spmd_rules.registry",
    "with_strided": "spmd_rules.base",
    # runtime
    "get_rank": "autoparallel.runtime.world",
    "get_world_size": "autoparallel.runtime.world",
    "CommDebugMode": "autoparallel.runtime.debug",
    "CommRecord": "autoparallel.runtime.debug",
    # engine
    "DistTensor": "autoparallel.engine.dtensor",
    # model level
    "dtensor_from_local": "autoparallel.api",
    "reshard": "autoparallel.api",
    "shard_tensor": "autoparallel.api",
    "shard_op": "autoparallel.sharded_call",
    "unshard_dtensor": "autoparallel.api",
    "LocalLayer": "autoparallel.local_fn",
    "local_map": "autoparallel.local_fn",
    "empty": "autoparallel.factory",
    "full": "autoparallel.factory",
    "ones": "autoparallel.factory",
    "rand": "autoparallel.factory",
    "randn": "autoparallel.factory",
    "zeros": "autoparallel.factory",
    "ColWiseParallel": "autoparallel.nn",
    "ColwiseParallel": "autoparallel.nn",
    "ContextParallel": "autoparallel.nn",
    "PrepareLayerInput": "autoparallel.nn",
    "PrepareLayerOutput": "autoparallel.nn",
    "RowWiseParallel": "autoparallel.nn",
    "RowwiseParallel": "autoparallel.nn",
    "SequenceParallel": "autoparallel.nn",
    "VocabParallelEmbedding": "autoparallel.nn",
    "parallelize": "autoparallel.auto",
    "auto_parallel": "autoparallel.auto",
    "Plan": "autoparallel.auto",
    "shard_layer": "autoparallel.nn",
    "ShardingStage1": "autoparallel.optim",
    "ShardingStage2": "autoparallel.optim",
    "ShardingStage3": "autoparallel.optim",
    "shard_optimizer": "autoparallel.optim",
    "clip_grad_norm_": "autoparallel.optim",
    "GradScaler": "autoparallel.optim",
    "MixedPrecision": "autoparallel.optim",
    "shard_dataloader": "autoparallel.data",
    "load_state_dict": "autoparallel.checkpoint",
    "save_state_dict": "autoparallel.checkpoint",
    "disable_local_regions": "autoparallel.regions",
    "enable_local_regions": "autoparallel.regions",
    "local_regions_report": "autoparallel.regions",
    "LayerMeter": "autoparallel.memory",
    "recompute": "autoparallel.memory",
    "DistModel": "autoparallel.static",
    "Engine": "autoparallel.static_engine",
    "InputSpec": "autoparallel.static",
    "metrics": "autoparallel.static",
    "Strategy": "autoparallel.static",
    "to_static": "autoparallel.static",
}
# sub-packages reachable as attributes (``ap.pipeline.Pipeline``, ``ap.checkpoint``, ...)
_SUBMODULES = frozenset({
    "api", "auto", "checkpoint", "compat", "cost", "data", "engine", "factory", "local_map", "memory", "mesh", "nn",
    "optim", "pipeline", "placement", "plans", "regions", "runtime", "spec", "static",
})

__all__ = [
    "ColWiseParallel",
    "ColwiseParallel",
    "ContextParallel",
    "CommDebugMode",
    "CommRecord",
    "DistSpec",
    "DistModel",
    "DistTensor",
    "Engine",
    "GradScaler",
    "InputSpec",
    "LayerMeter",
    "LocalLayer",
    "MixedPrecision",
    "Partial",
    "Placement",
    "Plan",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "ProcessMesh",
    "Replicate",
    "RowWiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "Shard",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "Strategy",
    "StridedShard",
    "VocabParallelEmbedding",
    "auto_parallel",
    "clip_grad_norm_",
    "disable_local_regions",
    "dtensor_from_local",
    "empty",
    "enable_local_regions",
    "full",
    "get_rank",
    "get_world_size",
    "load_state_dict",
    "local_map",
    "local_regions_report",
    "metrics",
    "ones",
    "parallelize",
    "pipeline",
    "plans",
    "rand",
    "recompute",
    "randn",
    "register_axis_rule",
    "register_local_impl",
    "register_rule",
    "reshard",
    "save_state_dict",
    "shard_dataloader",
    "shard_layer",
    "shard_op",
    "shard_optimizer",
    "shard_tensor",
    "to_static",
    "unshard_dtensor",
    "with_strided",
    "zeros",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and keep the name here."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'autoparallel' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


if TYPE_CHECKING:  # for type checkers and IDEs; nothing is imported at run time
    from autoparallel import pipeline, plans
    from autoparallel.api import dtensor_from_local, reshard, shard_tensor, unshard_dtensor
    from autoparallel.checkpoint import load_state_dict, save_state_dict
    from autoparallel.data import shard_dataloader
    from autoparallel.engine.dtensor import DistTensor
    from autoparallel.factory import empty, full, ones, rand, randn, zeros
    from autoparallel.local_fn import LocalLayer, local_map
    from autoparallel.memory import LayerMeter, recompute
    from autoparallel.mesh import ProcessMesh
    from autoparallel.nn import (
        ColWiseParallel,
        ColwiseParallel,
        ContextParallel,
        PrepareLayerInput,
        PrepareLayerOutput,
        RowWiseParallel,
        RowwiseParallel,
        SequenceParallel,
        VocabParallelEmbedding,
    )
    from autoparallel.nn.parallelize import parallelize
    from autoparallel.nn.shard_layer import shard_layer
    from autoparallel.optim import GradScaler, MixedPrecision, ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer
    from autoparallel.placement import Partial, Placement, Replicate, Shard, StridedShard
    from autoparallel.regions import disable_local_regions, enable_local_regions, local_regions_report
    from autoparallel.runtime.debug import CommDebugMode, CommRecord
    from autoparallel.runtime.world import get_rank, get_world_size
    from autoparallel.sharded_call import shard_op
    from autoparallel.spec import DistSpec
    from autoparallel.static import DistModel, InputSpec, Strategy, metrics, to_static
    from autoparallel.static_engine import Engine
    from spmd_rules.base import with_strided
    from spmd_rules.registry import register_axis_rule, register_local_impl, register_rule
