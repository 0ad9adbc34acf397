"""Full-auto parallel: ``ap.auto_parallel`` records the single-device step on fake tensors, prices
a complete family of plans on it with the eager engine's own rules and reshard planner, and
returns the best as an ``ap.Plan`` in the semi-auto vocabulary (docs/auto.md)."""

from typing import Any

from torch import nn

from autoparallel.auto.plan import Candidate, PipelineRun, Plan, Prediction
from autoparallel.auto.profile import H100, Profile, local_profile
from autoparallel.auto.search import auto_parallel
from autoparallel.mesh import ProcessMesh

__all__ = ["H100", "Candidate", "PipelineRun", "Plan", "Prediction", "Profile", "auto_parallel", "local_profile"]


def parallelize(layer: nn.Module, mesh: ProcessMesh, plan: dict[str, Any] | str, *, axis: int | str | None = None,
                recompute: dict[str, Any] | None = None, **auto: Any) -> nn.Module:
    """``ap.parallelize``: lay ``layer`` out on ``mesh`` by ``plan`` (``autoparallel.nn.parallelize``).

    ``plan="auto"`` searches one first (``ap.auto_parallel(layer, mesh=mesh, example=..., loss=...)``,
    keyword arguments passed on) on ``mesh`` as given, and returns the layer laid out by it; the
    plan is then ``layer.auto_plan`` (its ZeRO stage is for ``ap.shard_optimizer``)."""
    from autoparallel.nn.parallelize import parallelize as _parallelize

    if isinstance(plan, str) and plan == "auto":
        found = auto_parallel(layer, mesh=mesh, **auto)
        _parallelize(layer, mesh, found, axis=axis, recompute=recompute)
        layer.auto_plan = found  # type: ignore[assignment]
        return layer
    if auto:
        raise TypeError(f"parallelize: unexpected keyword arguments {sorted(auto)} (they go with plan='auto')")
    if isinstance(plan, str):
        raise ValueError(f"parallelize: plan must be a dict of styles, an ap.Plan or 'auto', got {plan!r}")
    return _parallelize(layer, mesh, plan, axis=axis, recompute=recompute)
