"""Model-level tensor/sequence parallelism: ``shard_layer``, ``parallelize`` and parallel styles."""

from __future__ import annotations

from typing import Any


def _todo(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("autoparallel.nn is being written")


shard_layer = parallelize = _todo
ColWiseParallel = RowWiseParallel = SequenceParallel = _todo
PrepareLayerInput = PrepareLayerOutput = VocabParallelEmbedding = _todo

__all__ = [
    "ColWiseParallel",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "shard_layer",
]
