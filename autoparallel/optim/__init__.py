"""Optimizer sharding (ZeRO stages 1/2/3) over a data-parallel mesh axis: ``shard_optimizer``."""

from __future__ import annotations

from typing import Any


def _todo(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("autoparallel.optim is being written")


shard_optimizer = ShardingStage1 = ShardingStage2 = ShardingStage3 = _todo

__all__ = ["ShardingStage1", "ShardingStage2", "ShardingStage3", "shard_optimizer"]
