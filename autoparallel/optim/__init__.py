"""Data parallel with bucketed gradient reduction and ZeRO stages 1/2/3: ``shard_optimizer``.

>>> opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters()))                     # DP
>>> opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters()), ap.ShardingStage2(mesh))
>>> opt = ap.shard_optimizer(adamw, ap.ShardingStage3(mesh), mixed_precision=ap.MixedPrecision(torch.bfloat16))
>>> ap.clip_grad_norm_(split.parameters(), 1.0)   # by the norm of every stage's gradients
"""

from __future__ import annotations

from autoparallel.optim.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from autoparallel.optim.clip import clip_grad_norm_
from autoparallel.optim.precision import MixedPrecision
from autoparallel.optim.scaler import GradScaler
from autoparallel.optim.sharded import ShardedOptimizer, shard_optimizer
from autoparallel.optim.stages import ShardingStage, ShardingStage1, ShardingStage2, ShardingStage3, shard_layout

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GradScaler",
    "MixedPrecision",
    "ShardedOptimizer",
    "ShardingStage",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "clip_grad_norm_",
    "plan_buckets",
    "shard_layout",
    "shard_optimizer",
]
