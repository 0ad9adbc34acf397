"""Model-level tensor/sequence parallelism: ``shard_layer``, ``parallelize`` and parallel styles."""

from __future__ import annotations

from autoparallel.nn.parallelize import parallelize
from autoparallel.nn.shard_layer import shard_layer
from autoparallel.nn.styles import (
    ColWiseParallel,
    ParallelStyle,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
)

__all__ = [
    "ColWiseParallel",
    "ParallelStyle",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "shard_layer",
]
