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

# torch's spellings of the same styles (``torch.distributed.tensor.parallel``), for scripts coming from it
ColwiseParallel = ColWiseParallel
RowwiseParallel = RowWiseParallel

__all__ = [
    "ColWiseParallel",
    "ColwiseParallel",
    "ContextParallel",
    "ParallelStyle",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "VocabParallelEmbedding",
    "parallelize",
    "shard_layer",
]
