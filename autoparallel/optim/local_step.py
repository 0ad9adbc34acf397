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

import operator
from collections import defaultdict
from typing import Any

import torch

from autoparallel import compat
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor

ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
)


def can_step_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter, gradient and state tensor allows a local step (metadata only)."""
    return _local_view(optimizer) is not None


_NO_STATE: dict[str, Any] = {}


_View = tuple[list[list[torch.Tensor]], list[tuple[DistTensor, torch.Tensor, Any]], dict[torch.Tensor, dict[str, Any]]]


def _local_view(optimizer: torch.optim.Optimizer) -> _View | None:
    """The optimizer seen on local shards, or None when some layout forbids it (checked on
    metadata only, in one pass): per group the local parameters; per parameter (parameter,
    local, gradient); the local state dicts keyed by the locals."""
    if type(optimizer) not in ELEMENTWISE:  # a subclass may override step with anything
        return None
    state = optimizer.state
    spec_of, local_of = layout.spec_of, layout.local_of
    groups: list[list[torch.Tensor]] = []
    items: list[tuple[DistTensor, torch.Tensor, Any]] = []
    local_state: dict[torch.Tensor, dict[str, Any]] = {}
    with compat.attribute_access():
        for group in optimizer.param_groups:
            if group.get("differentiable", False):
                return None
            locs = []
            for p in group["params"]:
                if not isinstance(p, DistTensor):
                    return None
                spec = spec_of(p)
                if spec.has_partial:
                    return None
                g = p.grad
                if g is not None and (not isinstance(g, DistTensor) or ((gs := spec_of(g)) is not spec and gs != spec)):
                    return None
                loc = local_of(p)
                st = state.get(p)
                if st:
                    ls: dict[str, Any] = {}
                    for k, v in st.items():
                        if isinstance(v, DistTensor):
                            vs = spec_of(v)
                            if vs is not spec and (vs.placements != spec.placements or vs.shape != spec.shape):
                                return None
                            ls[k] = local_of(v)
                        elif isinstance(v, torch.Tensor) and v.dim() > 0:
                            return None
                        else:
                            ls[k] = v
                    local_state[loc] = ls
                items.append((p, loc, g))
                locs.append(loc)
            groups.append(locs)
    return groups, items, local_state


def local_step(optimizer: torch.optim.Optimizer) -> bool:
    """Step ``optimizer`` on local shards if ``can_step_locally``; True when it did."""
    view = _local_view(optimizer)
    if view is None:
        return False
    local_groups, items, local_state = view
    before = {loc: (tuple(st), tuple(st.values())) for loc, st in local_state.items()}
    state = optimizer.state
    groups = [g["params"] for g in optimizer.param_groups]
    local_of = layout.local_of
    for _, loc, g in items:
        loc.grad = None if g is None else local_of(g)
    for group, locs in zip(optimizer.param_groups, local_groups):
        group["params"] = locs
    optimizer.state = defaultdict(dict, local_state)
    try:
        optimizer.step()
    finally:
        stepped = optimizer.state
        optimizer.state = state
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        for p, loc, _ in items:
            loc.grad = None
            new = stepped.get(loc)
            if new is None:
                continue
            old = before.get(loc)
            if old is not None and old[0] == tuple(new) and all(map(operator.is_, old[1], new.values())):
                continue  # updated in place (the usual step): the DistTensor states already see it
            state[p] = _rewrap(state.get(p, {}), new, p)
    return True


def _rewrap(old: dict[str, Any], new: dict[str, Any], p: DistTensor) -> dict[str, Any]:
    """The stepped state of ``p`` as DistTensors (kept objects where the step wrote in place)."""
    out: dict[str, Any] = {}
    for k, v in new.items():
        prev = old.get(k)
        if isinstance(prev, DistTensor) and layout.local_of(prev) is v:
            out[k] = prev
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = layout.wrap(v if v.is_contiguous() else v.contiguous(), layout.spec_of(p).with_dtype(v.dtype))
        else:
            out[k] = v
    return out
