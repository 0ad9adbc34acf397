"""Step an elementwise ``torch.optim`` optimizer on local shards instead of DistTensors.

SGD, Adam, AdamW and their kin update each element of a parameter from the same element of its
gradient and states: when every gradient and state tensor has exactly its parameter's layout,
stepping the local shards computes the local shards of the DistTensor step, with no per-op
dispatch. ``local_step(optimizer)`` does that when the layouts allow it (a check on metadata
only, so all ranks agree) and returns False otherwise, leaving the caller to step on
DistTensors. Optimizers that read whole tensors (a norm, a matrix factor) are not listed.

The inner optimizer sees, for the duration of ``step()``, the parameters' local tensors as its
parameters (with the local gradients attached) and a state dict keyed by them holding local
state tensors; states it creates are wrapped back into DistTensors in the parameter's layout,
and the user-visible ``optimizer.state`` keeps DistTensor states keyed by the parameters.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import Any

import torch

from autoparallel.dtensor import DistTensor
from autoparallel.placement import Partial

ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
)


def can_step_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter, gradient and state tensor allows a local step (metadata only)."""
    if type(optimizer) not in ELEMENTWISE:  # a subclass may override step with anything
        return False
    state = optimizer.state
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return False
        for p in group["params"]:
            if not isinstance(p, DistTensor):
                return False
            spec = p._spec
            if _has_partial(spec.placements):
                return False
            g = p.grad
            if g is not None and (not isinstance(g, DistTensor) or (g._spec is not spec and g._spec != spec)):
                return False
            for v in state.get(p, _NO_STATE).values():
                if isinstance(v, DistTensor):
                    vs = v._spec
                    if vs is not spec and (vs.placements != spec.placements or vs.shape != spec.shape):
                        return False
                elif isinstance(v, torch.Tensor) and v.dim() > 0:
                    return False
    return True


_NO_STATE: dict[str, Any] = {}


@lru_cache(maxsize=1024)
def _has_partial(placements: tuple[Any, ...]) -> bool:
    return any(isinstance(p, Partial) for p in placements)


def local_step(optimizer: torch.optim.Optimizer) -> bool:
    """Step ``optimizer`` on local shards if ``can_step_locally``; True when it did."""
    if not can_step_locally(optimizer):
        return False
    state = optimizer.state
    groups = [g["params"] for g in optimizer.param_groups]
    pairs: list[tuple[DistTensor, torch.Tensor]] = []
    local_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for group in optimizer.param_groups:
        locs = []
        for p in group["params"]:
            loc = p._local
            loc.grad = None if p.grad is None else p.grad._local
            if p in state:
                local_state[loc] = {k: v._local if isinstance(v, DistTensor) else v for k, v in state[p].items()}
            pairs.append((p, loc))
            locs.append(loc)
        group["params"] = locs
    optimizer.state = local_state
    try:
        optimizer.step()
    finally:
        optimizer.state = state
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        for p, loc in pairs:
            loc.grad = None
            if loc in local_state:
                state[p] = _rewrap(state.get(p, {}), local_state[loc], p)
    return True


def _rewrap(old: dict[str, Any], new: dict[str, Any], p: DistTensor) -> dict[str, Any]:
    """The stepped state of ``p`` as DistTensors (kept objects where the step wrote in place)."""
    out: dict[str, Any] = {}
    for k, v in new.items():
        prev = old.get(k)
        if isinstance(prev, DistTensor) and prev._local is v:
            out[k] = prev
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = DistTensor._wrap(v if v.is_contiguous() else v.contiguous(), p._spec.with_dtype(v.dtype))
        else:
            out[k] = v
    return out
