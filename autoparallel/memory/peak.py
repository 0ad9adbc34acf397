"""A step's peak memory on this rank, measured: what it holds, and how far live tensors rise.

    held = ap.memory.held_bytes(model, opt)            # parameters (tied once) + optimizer states
    peak = held + ap.memory.peak_rise(train_step)      # + the highest rise while one step runs

``peak_rise`` reads torch.profiler's memory events (every tensor allocation and free on the CPU
and, when CUDA is there, the device), so it works where no allocator statistics exist (the CPU);
it costs the profiler's overhead for the step it watches. Run a few steps first: the first calls
of a laid-out model do one-time work (plans, local regions proving their signatures).

The profiler reports the free of a tensor only if it saw the tensor made. A loop that keeps the
last step's gradients until its ``zero_grad`` frees them inside the watched step: when the step
before ran unwatched, that free is not seen, and ``held + rise`` is the peak of a step whose
peak comes after its ``zero_grad`` (the backward's); when the step before was watched too, the
free is counted, and the gradients held when the step starts belong in ``held``. A buffer a
communication backend frees on its own thread (gloo's, after a collective) is not seen freed
either: it counts as live to the end of the step, so the least of a few watched steps is the
figure to keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoparallel.engine import layout


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank stores for ``model``'s parameters (tied ones once; a DistTensor's local
    shard) and ``optimizer``'s state tensors."""
    tensors: list[Any] = list(model.parameters())
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    total = 0
    for t in tensors:
        local = layout.local_of(t) if layout.is_dist(t) else t
        total += local.numel() * local.element_size()
    return total


def peak_rise(fn: Callable[[], Any]) -> int:
    """The highest rise of live tensor bytes while ``fn()`` runs (torch.profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
