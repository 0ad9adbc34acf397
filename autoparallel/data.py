"""``shard_dataloader``: each rank loads only the samples of its data-parallel coordinate."""

from __future__ import annotations

from typing import Any


def shard_dataloader(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("autoparallel.data is being written")


__all__ = ["shard_dataloader"]
