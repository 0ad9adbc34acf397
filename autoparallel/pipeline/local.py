"""Stages on one-rank meshes run their module on plain local tensors.

On a mesh of one rank every placement holds the whole tensor, so the SPMD dispatch of each op
would only wrap and unwrap: the result is the same without it. :class:`LocalStage` runs such a
stage through ``torch.func.functional_call`` with plain leaf tensors that share the parameters'
storage, lets autograd accumulate their gradients over the micro-batches at plain-tensor cost,
and adds the sum into the DistTensor parameters' ``.grad`` once per step. Eligibility is
decided from metadata only (the same on every rank): a one-rank mesh, no forward hooks, no
gradient hooks on the parameters (those must see every micro-batch's gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from autoparallel import compat
from autoparallel.api import dtensor_from_local
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.pipeline.stage import Stage
from autoparallel.placement import Replicate


def runs_locally(st: Stage) -> bool:
    """Whether ``st`` can run on local tensors (one-rank mesh, no hooks)."""
    if st.mesh.size != 1:
        return False
    if any(compat.forward_hook_fns(m) for m in st.module.modules()):
        return False
    return not any(compat.has_tensor_hooks(p) for p in st.module.parameters())


class LocalStage:
    """One step of a local stage on this rank: leaf tensors in, gradients flushed at the end."""

    def __init__(self, st: Stage) -> None:
        self.st = st
        self.params: dict[str, nn.Parameter] = dict(st.module.named_parameters())
        self.leaves = {n: layout.local_of(p).detach().requires_grad_(p.requires_grad) for n, p in self.params.items()}  # type: ignore[arg-type]
        self.buffers = {n: layout.local_or_plain(b) for n, b in st.module.named_buffers()}

    def forward(self, *xs: DistTensor, copy: bool = False) -> DistTensor | tuple[DistTensor, ...]:
        """``st.module(*xs)`` computed on local tensors, returned Replicate on the stage mesh (a
        tuple of outputs as a tuple). ``copy``: the module gets copies of the inputs' local
        tensors, which it may write in place (the local tensors are views of the inputs)."""
        args = tuple(x.to_local().clone() if copy else x.to_local() for x in xs)
        y = torch.func.functional_call(self.st.module, {**self.leaves, **self.buffers}, args)
        ys = tuple(y) if isinstance(y, (tuple, list)) else (y,)
        for t in ys:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Pipeline: stage {self.st.name} must return tensors, got {type(t).__name__}")
        out = tuple(dtensor_from_local(t, self.st.mesh, [Replicate()] * self.st.mesh.ndim) for t in ys)
        return out if isinstance(y, (tuple, list)) else out[0]

    def flush_grads(self) -> None:
        """Add the step's accumulated local gradients into the parameters' ``.grad``."""
        with torch.no_grad():
            for n, leaf in self.leaves.items():
                if leaf.grad is None:
                    continue
                p = self.params[n]
                g = layout.wrap(leaf.grad, layout.grad_spec(layout.spec_of(p)))  # type: ignore[arg-type]
                p.grad = g if p.grad is None else p.grad + g


__all__ = ["LocalStage", "runs_locally"]
