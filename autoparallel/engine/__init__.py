"""The engine: ``DistTensor`` and the op path.

``dtensor`` (the tensor subclass and its differentiable conversions), ``dispatch`` (from
``__torch_dispatch__`` to a cached decision, and the door through which an observer, a
capture, watches the op path: ``observed_by``), ``decide`` (rule -> strategy ->
plans), ``decision`` (what a decision holds: a ``LocalStep`` and two rarer kinds), ``execute``
(running a decision), the argument walking by concept (``keys``: the cache key and plain
tensors; ``slots``: where DistTensors sit and the result's shape; ``aliases``: written inputs),
``kernels`` (local steps that need a collective, handed theirs by the engine) and ``layout`` (the one
module through which model-level code reads and re-lays out a DistTensor). Imports point down:
values, rules, planner, runtime.
"""
