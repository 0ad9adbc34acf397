"""``ap.GradScaler``: torch's loss scaler whose inf/NaN verdict is the same on every rank.

``torch.amp.GradScaler.unscale_`` multiplies each gradient by ``1/scale`` and notes whether any
holds an inf or NaN (``found_inf``); ``step`` then skips ``optimizer.step()`` and ``update``
lowers the scale when it did. With DistTensor gradients each rank holds only its shards: an
overflow in one rank's shard must make *every* rank skip, or the ranks' parameters part ways.
This subclass changes that one step (``_unscale_grads_``, ``compat.GRAD_SCALER_UNSCALE``):

1. a ``ShardedOptimizer`` reduces its gradients first (``reduce_gradients``, bucketed as in its
   step, which then finds nothing left to reduce), so the check sees what the step will use;
2. the local shards are unscaled and checked with torch's fused kernel, per device and dtype;
3. the verdict is all-reduced (max) over every rank of the world, one 4-byte collective.

Everything else (growth, backoff, ``state_dict``, ``scale``) is torch's. Every rank must call
``unscale_``/``step`` alike (the collective of step 3), as every rank runs the same training step.
"""

from __future__ import annotations

from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.engine import layout
from autoparallel.mesh import ProcessMesh
from autoparallel.optim.sharded import ShardedOptimizer
from autoparallel.runtime import comm


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for DistTensor gradients: all ranks skip a step, or none does.

    >>> scaler = ap.GradScaler("cpu")      # or "cuda"; torch.amp.GradScaler's arguments
    >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    """

    def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
        if not compat.HAS_GRAD_SCALER_UNSCALE:
            raise RuntimeError(
                f"ap.GradScaler needs torch.amp.GradScaler.{compat.GRAD_SCALER_UNSCALE}, which this torch lacks"
            )
        super().__init__(device, *args, **kwargs)
        self.device_type = device

    def _unscale_grads_(  # the name compat.GRAD_SCALER_UNSCALE
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale the local shards of ``optimizer``'s gradients; the verdict agreed by all ranks."""
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.reduce_gradients()
            grads = [g for g in optimizer.gradients() if g is not None]
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for g in grads:
            # metadata only, so every rank raises alike before the collective below
            if not allow_fp16 and g.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own message
            local = layout.local_of(g) if layout.is_dist(g) else g
            if local.layout != torch.strided:
                raise TypeError(f"ap.GradScaler: a {local.layout} gradient of shape {tuple(g.shape)} is not supported")
            by_device.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, per_dtype in by_device.items():
                found[device] = flag = found_inf.to(device)
                for locals_ in per_dtype.values():
                    compat.amp_check_and_unscale_(locals_, flag, inv_scale.to(device))
            agreed = self._agree(found, found_inf)
            if not found:  # no gradient here: the verdict still has a device to live on
                found[found_inf.device] = found_inf
            for flag in found.values():
                flag.copy_(agreed.to(flag.device))
        return found

    def _agree(self, found: dict[torch.device, torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
        """1.0 on every rank if any rank found an inf/NaN, else 0.0 (one all-reduce over the world)."""
        local = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in found.values():
            local = torch.maximum(local, flag.to(local.device))
        world = runtime.get_world_size()
        if world == 1:
            return local
        mesh = ProcessMesh(list(range(world)), ["world"])
        return comm.all_reduce(local.reshape(1), mesh, 0, "max").reshape(())
