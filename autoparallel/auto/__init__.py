"""Full-auto parallel: ``ap.auto_parallel`` records the single-device step on fake tensors, prices
a complete family of plans on it with the eager engine's own rules and reshard planner, and
returns the best as an ``ap.Plan`` in the semi-auto vocabulary (docs/auto.md)."""

from autoparallel.auto.plan import Candidate, Plan, Prediction
from autoparallel.auto.search import H100, Profile, auto_parallel, local_profile

__all__ = ["H100", "Candidate", "Plan", "Prediction", "Profile", "auto_parallel", "local_profile"]


def parallelize(layer, mesh, plan, *, axis=None, recompute=None, **auto):  # type: ignore[no-untyped-def]
    """``ap.parallelize``: lay ``layer`` out on ``mesh`` by ``plan`` (``autoparallel.nn.parallelize``).

    ``plan="auto"`` searches one first (``ap.auto_parallel(layer, mesh=mesh, example=..., loss=...)``,
    keyword arguments passed on) on ``mesh`` as given, and returns the layer laid out by it; the
    plan is then ``layer.auto_plan`` (its ZeRO stage is for ``ap.shard_optimizer``)."""
    from autoparallel.nn.parallelize import parallelize as _parallelize

    if isinstance(plan, str) and plan == "auto":
        found = auto_parallel(layer, mesh=mesh, **auto)
        _parallelize(layer, mesh, found, axis=axis, recompute=recompute)
        layer.auto_plan = found
        return layer
    if auto:
        raise TypeError(f"parallelize: unexpected keyword arguments {sorted(auto)} (they go with plan='auto')")
    return _parallelize(layer, mesh, plan, axis=axis, recompute=recompute)
