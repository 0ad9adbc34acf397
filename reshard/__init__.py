"""Reshard: the pure planner (layout -> layout as ordered steps) and the plan executor."""


from reshard.crossmesh import CrossMeshPlan, Transfer, plan_best, plan_cross_mesh
from reshard.plan import Plan, Step
from reshard.planner import ReshardError, plan_reshard

__all__ = ["CrossMeshPlan", "Plan", "ReshardError", "Step", "Transfer", "plan_best", "plan_cross_mesh", "plan_reshard"]
