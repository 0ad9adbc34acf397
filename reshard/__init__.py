"""Reshard: the pure planner (layout -> layout as ordered steps) and the plan executor."""

# The value types (mesh, placement, spec) live in ``autoparallel``, whose package __init__ pulls
# in the dispatcher, which imports this package: initialise ``autoparallel`` first so either
# import order works.
import autoparallel  # noqa: F401,I001


from reshard.plan import Plan, Step
from reshard.crossmesh import CrossMeshPlan, Transfer, plan_best, plan_cross_mesh
from reshard.planner import ReshardError, plan_reshard

__all__ = ["CrossMeshPlan", "Plan", "ReshardError", "Step", "Transfer", "plan_best", "plan_cross_mesh", "plan_reshard"]
