"""Model-level tensor/sequence/context parallelism: ``shard_layer``, ``parallelize`` and parallel styles."""

from __future__ import annotations

from autoparallel.nn.context_parallel import ContextParallel
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
    "ContextParallel",
    "ParallelStyle",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "shard_layer",
]
