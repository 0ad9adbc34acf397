"""``ap.clip_grad_norm_``: clip gradients by the norm of all of them, wherever they live.

    loss = pipe.step(x, y)
    ap.clip_grad_norm_(split.parameters(), max_norm=1.0)   # every rank, the same parameter list
    opt.step()

``torch.nn.utils.clip_grad_norm_`` works on DistTensor gradients of one mesh (sharded, Partial:
the engine reduces what a norm needs), but it sees only the gradients this rank holds. In a
pipeline a rank holds only its stage's gradients (the other stages' backward never ran there),
so each stage would be clipped by its own norm: a silently different step. This function takes
every stage's parameters, the same list on every rank, and clips all of them by their global
norm, as one process clips the whole model:

1. per mesh (in the order the parameters first name it), its members compute the norm of the
   mesh's gradients on DistTensors (collectives inside the mesh only);
2. one value per mesh, contributed by the mesh's first rank, is summed (``inf``: maxed) over
   the union of the meshes (one all-reduce of a scalar);
3. every gradient is scaled by ``min(1, max_norm / (total + 1e-6))``, torch's coefficient.

Plain (non-DistTensor) gradients are taken to be the same on every rank that holds them, as
checkpoints take plain tensors: each rank adds their norm once. Which ranks compute what depends
on the meshes only (global metadata). A parameter list that is all plain tensors is clipped by
``torch.nn.utils.clip_grad_norm_`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from autoparallel import runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.runtime import comm
from autoparallel.runtime import groups as process_groups


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    copies: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale every gradient of ``parameters`` so that their joint ``norm_type`` norm is at most
    ``max_norm``; return that norm before clipping (a plain 0-d tensor, the same on every rank
    of the meshes). Every rank passes the same parameters (see the module docstring).
    The arguments are ``torch.nn.utils.clip_grad_norm_``'s (``foreach`` is passed on where torch
    clips, for plain tensors only).

    ``copies``: parameters whose gradients repeat ones of ``parameters`` (the last stage's copy
    of a tied weight, after ``sync_tied_grads``): scaled as well, not counted in the norm
    (``DecoderStages.clip_grad_norm_`` passes them)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    extra = list(copies)
    if not all(isinstance(p, torch.Tensor) for p in params + extra):
        raise TypeError("clip_grad_norm_: parameters and copies must be tensors")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 (or inf), got {norm_type!r}")
    groups: dict[ProcessMesh, list[DistTensor]] = {}
    plain: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, DistTensor):
            groups.setdefault(p.process_mesh, []).append(p)
        else:
            plain.append(p)
    if not groups and not any(isinstance(p, DistTensor) for p in extra):
        found = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        scale = min(1.0, max_norm / (float(found) + 1e-6))
        with torch.no_grad():
            for p in extra:
                if p.grad is not None and scale < 1.0:
                    p.grad.mul_(scale)
        return found
    norm_type = float(norm_type)
    top = math.isinf(norm_type)
    rank = runtime.get_rank()
    own = 0.0  # this rank's share of the total (the sum of powers, or the max)
    for mesh, ps in groups.items():
        if rank not in mesh:
            continue  # its gradients are the members' (this rank never ran their backward)
        value = _norm([p.grad for p in ps if p.grad is not None], norm_type)
        if rank == mesh.process_ids[0]:
            own = _top(own, value) if top else own + value ** norm_type
    held = [p for p in extra if not isinstance(p, DistTensor) or rank in p.process_mesh]
    union = ProcessMesh(sorted({r for mesh in groups for r in mesh.process_ids} or {rank}), dim_names=["all"])
    first = next(p for p in params + extra if isinstance(p, DistTensor))
    share = torch.tensor([own], dtype=torch.float64, device=layout.local_of(first).device)  # NCCL: on the GPU
    process_groups.ensure(union)  # every rank: creating a group is a collective over the world
    summed = float(comm.all_reduce(share, union, 0, "max" if top else "sum")) if rank in union else 0.0
    local = _norm([p.grad for p in plain if p.grad is not None], norm_type)
    total = _top(summed, local) if top else (summed + local ** norm_type) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({total}), so it cannot be clipped (error_if_nonfinite=True)")
    coef = min(1.0, float(max_norm) / (total + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for p in plain + held + [p for mesh, ps in groups.items() if rank in mesh for p in ps]:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return torch.tensor(total)


def _top(a: float, b: float) -> float:
    """The larger of two norms, NaN where either is (Python's ``max`` keeps its first NaN only)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The ``norm_type`` norm of ``grads`` together (DistTensors of one mesh, or plain tensors), 0 for none."""
    if not grads:
        return 0.0
    with torch.no_grad():
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        value = torch.linalg.vector_norm(torch.stack(norms), norm_type) if len(norms) > 1 else norms[0]
        if isinstance(value, DistTensor):
            value = value.full_tensor()
    return float(value)


__all__ = ["clip_grad_norm_"]
