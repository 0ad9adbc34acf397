"""Public conversions: ``shard_tensor``, ``dtensor_from_local``, ``reshard``, ``unshard_dtensor``.

Each validates everything it can from metadata alone — raising the same ``ValueError`` /
``TypeError`` on every rank before any communication — then runs a differentiable conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Placement, Replicate, Shard, check_placement
from autoparallel.runtime import agree, comm, groups
from autoparallel.spec import DistSpec

ShardOrder = Sequence[tuple[int, Sequence[int]]] | dict[int, Sequence[int]] | None


def _check_mesh(mesh: Any, where: str) -> ProcessMesh:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{where}: mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    groups.ensure(mesh)  # every rank passes here: the mesh's process groups, same order everywhere
    return mesh


def _check_placements(placements: Any, where: str, mesh: Any) -> tuple[Placement, ...]:
    """One placement per mesh axis: a shorter list is padded with ``Replicate()`` for the mesh
    axes it leaves out (Paddle's rule); a longer one is refused."""
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        raise TypeError(f"{where}: placements must be a list of Replicate/Shard/Partial, got {placements!r}")
    out = tuple(check_placement(p) for p in placements)
    if isinstance(mesh, ProcessMesh):
        if len(out) > mesh.ndim:
            raise ValueError(f"{where}: {len(out)} placements {list(out)} for a {mesh.ndim}-d mesh {mesh!r}: "
                             "give one placement per mesh axis")
        out += (Replicate(),) * (mesh.ndim - len(out))
    return out


def _check_reductions(spec: DistSpec, where: str) -> DistSpec:
    """Refuse a Partial that ``spec.dtype`` cannot be reduced by exactly (``Partial('avg')`` on
    bool or integers, ``max``/``min`` on complex...): its value could never be read."""
    for p in spec.placements:
        if isinstance(p, Partial):
            why = comm.reduce_refusal(spec.dtype, p.reduce_type)
            if why is not None:
                raise ValueError(f"{where}: {p!r} on a {spec.dtype} tensor: {why}")
    return spec


def _order(shard_order: ShardOrder) -> tuple[tuple[int, tuple[int, ...]], ...]:
    if not shard_order:
        return ()
    items = shard_order.items() if isinstance(shard_order, dict) else shard_order
    return tuple((int(d), tuple(int(a) for a in axes)) for d, axes in items)


def _local_device(t: torch.Tensor) -> torch.Tensor:
    dev = runtime.default_device()
    return t.to(dev) if t.device.type != dev.type else t


def _describe(spec: DistSpec) -> str:
    """The metadata every rank must pass alike, as text (for the agreement check)."""
    order = f", shard order {spec.shard_order}" if spec.shard_order else ""
    return f"shape {list(spec.shape)}, {spec.dtype}, placements {list(spec.placements)}{order}"


def shard_tensor(
    data: Any,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    dtype: torch.dtype | None = None,
    stop_gradient: bool | None = None,
    *,
    shard_order: ShardOrder = None,
) -> DistTensor:
    """Lay out ``data`` (the full value, identical on every rank) on ``mesh`` by ``placements``.

    Returns the DistTensor holding this rank's shard. An ``nn.Parameter`` comes back as a
    Parameter. ``Partial`` placements keep the value on the first rank of the axis (sum) or on
    every rank (avg/max/min). Differentiable: the gradient of ``data`` is the full gradient.
    """
    placements = _check_placements(placements, "shard_tensor", mesh)
    mesh = _check_mesh(mesh, "shard_tensor")
    if isinstance(data, DistTensor):
        return reshard(data, mesh, placements)
    is_param = isinstance(data, torch.nn.Parameter)
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    if dtype is not None:
        data = data.to(dtype)
    spec = _check_reductions(DistSpec(mesh, placements, tuple(data.shape), data.dtype, _order(shard_order)), "shard_tensor")
    agree.check("shard_tensor", mesh, lambda: _describe(spec), lambda: agree.checksum(data))
    requires_grad = data.requires_grad if stop_gradient is None else not stop_gradient
    if is_param:
        with torch.no_grad():
            out = layout.shard_full(_local_device(data.detach()), spec)
        return torch.nn.Parameter(out, requires_grad=requires_grad)  # type: ignore[return-value]
    out = layout.shard_full(_local_device(data), spec)
    if stop_gradient:
        out = out.detach()  # type: ignore[assignment]  # a DistTensor's detach is one
    elif requires_grad and not out.requires_grad:
        out.requires_grad_(True)
    return out


def dtensor_from_local(
    local: torch.Tensor,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None = None,
    *,
    shard_order: ShardOrder = None,
) -> DistTensor:
    """Assemble a DistTensor from each rank's ``local`` shard.

    Without ``shape`` the shards are taken as even (global = local x shard count per dim);
    pass ``shape`` for uneven shards. A local shape that does not match raises ``ValueError``.
    """
    if not isinstance(local, torch.Tensor) or isinstance(local, DistTensor):
        raise TypeError(f"dtensor_from_local: local must be a plain torch.Tensor, got {type(local).__name__}")
    placements = _check_placements(placements, "dtensor_from_local", mesh)
    mesh = _check_mesh(mesh, "dtensor_from_local")
    coord = mesh.coordinate_of(runtime.get_rank())
    if shape is None:
        if coord is None:
            raise ValueError("dtensor_from_local: a rank outside the mesh must pass the global shape")
        g = list(local.shape)
        for a, p in enumerate(placements):
            if isinstance(p, Shard) and -local.dim() <= p.dim < local.dim():
                g[p.dim % local.dim()] *= mesh.shape[a]
        shape = g
    spec = DistSpec(mesh, placements, tuple(int(s) for s in shape), local.dtype, _order(shard_order))
    _check_reductions(spec, "dtensor_from_local")
    agree.check("dtensor_from_local", mesh, lambda: _describe(spec))
    expected = spec.local_shape(coord)
    if coord is not None and tuple(local.shape) != expected:
        raise ValueError(
            f"dtensor_from_local: local shape {tuple(local.shape)} does not match global shape "
            f"{tuple(spec.shape)} with placements {list(placements)} on mesh shape "
            f"{list(mesh.shape)}: this rank (mesh coordinate {coord}) should hold {expected}"
        )
    if coord is None:
        local = local.new_empty((0,))
    return layout.from_local(local, spec)


def reshard(x: DistTensor, mesh: ProcessMesh, placements: Sequence[Placement], *, shard_order: ShardOrder = None) -> DistTensor:
    """The same global value laid out on ``mesh`` by ``placements`` (any mesh; differentiable)."""
    if not isinstance(x, DistTensor):
        raise TypeError(f"reshard: x must be a DistTensor, got {type(x).__name__}; use shard_tensor for plain tensors")
    placements = _check_placements(placements, "reshard", mesh)
    mesh = _check_mesh(mesh, "reshard")
    src = layout.spec_of(x)
    dst = _check_reductions(DistSpec(mesh, placements, src.shape, src.dtype, _order(shard_order)), "reshard")
    agree.check("reshard", mesh, lambda: f"{_describe(src)} -> {list(dst.placements)}"
                + (f" order {dst.shard_order}" if dst.shard_order else ""))
    if dst == src:
        return x
    return layout.reshard(x, dst)


def unshard_dtensor(x: DistTensor) -> torch.Tensor:
    """The full value as a plain tensor on every rank of ``x``'s mesh (empty elsewhere); an
    ``nn.Parameter`` comes back as a plain ``nn.Parameter`` (a new leaf, with its ``requires_grad``)."""
    if not isinstance(x, DistTensor):
        raise TypeError(f"unshard_dtensor: x must be a DistTensor, got {type(x).__name__}")
    if isinstance(x, torch.nn.Parameter):  # a parameter stays a parameter (Paddle's rule)
        return torch.nn.Parameter(x.full_tensor().detach(), requires_grad=x.requires_grad)
    return x.full_tensor()


