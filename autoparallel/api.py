"""Public conversions: ``shard_tensor``, ``dtensor_from_local``, ``reshard``, ``unshard_dtensor``.

Each validates everything it can from metadata alone — raising the same ``ValueError`` /
``TypeError`` on every rank before any communication — then runs a differentiable conversion.
A layout is given as placements (one ``Replicate``/``Shard``/``Partial`` per mesh axis) or, in
``shard_tensor`` and ``reshard``, as Paddle's static *dims mapping* (one mesh-axis name or
``None`` per tensor dim, ``dims_mapping_to_placements``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Placement, Replicate, Shard, check_placement
from autoparallel.runtime import agree, comm, groups
from autoparallel.spec import DistSpec

ShardOrder = Sequence[tuple[int, Sequence[int]]] | dict[int, Sequence[int]] | None
# A layout: one placement per mesh axis, or Paddle's static dims mapping (one mesh-axis name or
# None per tensor dim: ``[None, "mp"]`` shards tensor dim 1 along mesh axis "mp").
Layout = Sequence[Placement] | Sequence[str | None]


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


def is_dims_mapping(layout: Any) -> bool:
    """Whether ``layout`` is a dims mapping (Paddle's static form) rather than placements: a
    list holding a str (a mesh-axis name) or ``None`` anywhere. An all-``None`` list is a dims
    mapping too (fully replicated)."""
    return (isinstance(layout, Sequence) and not isinstance(layout, (str, bytes))
            and any(e is None or isinstance(e, str) for e in layout))


def dims_mapping_to_placements(mapping: Sequence[str | None], mesh: ProcessMesh, shape: Sequence[int],
                               where: str = "shard_tensor") -> tuple[Placement, ...]:
    """The placements of a dims mapping: mesh axis ``a`` is ``Shard(d)`` where ``mapping[d]``
    names ``a``, ``Replicate()`` where no tensor dim names it.

    ``mapping`` holds one mesh-axis name or ``None`` per dim of a tensor of shape ``shape``
    (``[None, "mp"]`` on a 2-d tensor and mesh axes ``["dp", "mp"]`` -> ``(Replicate(), Shard(1))``).
    Raises ``ValueError`` naming the values for a mapping mixed with placements, of the wrong
    length, naming an axis the mesh lacks, or using one mesh axis for two tensor dims.
    """
    items = list(mapping)
    others = [e for e in items if e is not None and not isinstance(e, str)]
    if others and all(isinstance(e, Placement) for e in others):
        raise ValueError(f"{where}: {items} mixes placements {others} with mesh-axis names/None: give either "
                         "one placement per mesh axis or one mesh-axis name (or None) per tensor dim")
    if others:
        raise ValueError(f"{where}: dims mapping {items} holds {others}, neither a mesh-axis name (str) nor None: "
                         "give one mesh-axis name or None per tensor dim")
    if len(items) != len(shape):
        raise ValueError(f"{where}: dims mapping {items} has {len(items)} entries for a {len(shape)}-d tensor "
                         f"of shape {tuple(shape)}: give one mesh-axis name or None per tensor dim")
    names = mesh.dim_names
    unknown = [e for e in items if e is not None and e not in names]
    if unknown:
        raise ValueError(f"{where}: dims mapping {items} names mesh axis {unknown[0]!r}, which mesh {mesh!r} "
                         f"lacks; its axes are {names}")
    for name in dict.fromkeys(e for e in items if e is not None):
        dims = [d for d, e in enumerate(items) if e == name]
        if len(dims) > 1:
            raise ValueError(f"{where}: dims mapping {items} uses mesh axis {name!r} for tensor dims {dims}: "
                             "a mesh axis can shard one tensor dim only")
    dim_of = {e: d for d, e in enumerate(items) if e is not None}
    return tuple(Shard(dim_of[a]) if a in dim_of else Replicate() for a in names)


def to_placements(layout: Any, where: str, mesh: Any, shape: Sequence[int]) -> tuple[Placement, ...]:
    """Placements from either form of a layout (see ``Layout``), checked (metadata only)."""
    if not is_dims_mapping(layout):
        return _check_placements(layout, where, mesh)
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{where}: mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    return dims_mapping_to_placements(layout, mesh, shape, where)


def _check_in_place(param: torch.nn.Parameter, where: str) -> None:
    """Raise ``ValueError`` (metadata only: the same verdict on every rank) when ``param`` cannot
    become its DistTensor in place."""
    if weakref.getweakrefs(param):
        raise ValueError(f"{where}: this parameter of shape {tuple(param.shape)} has weak references, so it cannot "
                         "be laid out in place (torch.utils.swap_tensors refuses); lay it out with "
                         "`module.weight = ap.shard_tensor(module.weight, mesh, placements)` instead")
    if compat.tensor_use_count(param) > 2:  # its Python object and this call's reference
        raise ValueError(f"{where}: something besides its Python object holds this parameter's tensor of shape "
                         f"{tuple(param.shape)} (a view of it, or the graph of a forward whose backward has not "
                         "run), so it cannot be laid out in place; annotate it before that")


def _lay_out_in_place(param: torch.nn.Parameter, new: torch.Tensor, where: str) -> torch.nn.Parameter:
    """``param`` (a plain Parameter) takes the contents of ``new`` (its DistTensor Parameter) —
    the same object, now the DistTensor, so a module or an optimizer holding it holds the
    DistTensor (``torch.utils.swap_tensors``, as a plain leaf meeting DistTensors is adopted)."""
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError as e:  # ``_check_in_place`` should have said why; never a silent no-op
        raise ValueError(f"{where}: cannot lay this parameter out in place: {e}") from e
    return param


def _annotated(param: DistTensor, mesh: Any, placements: tuple[Placement, ...],
               shard_order: ShardOrder, where: str) -> DistTensor:
    """A DistTensor Parameter annotated again: itself when the layout is its own, else a
    ``ValueError`` naming both layouts (an annotation never moves a parameter)."""
    if not isinstance(mesh, ProcessMesh):
        _check_mesh(mesh, where)  # raises the TypeError
    src = layout.spec_of(param)
    dst = DistSpec(mesh, placements, src.shape, src.dtype, _order(shard_order))
    if dst != src:
        raise ValueError(
            f"{where}: this parameter of shape {list(src.shape)} is already laid out as {list(src.placements)} "
            f"on {src.mesh!r}" + (f" (shard order {src.shard_order})" if src.shard_order else "")
            + f"; annotating it as {list(dst.placements)} on {mesh!r}"
            + (f" (shard order {dst.shard_order})" if dst.shard_order else "")
            + " would move it, and an annotation does not move a parameter: annotate it once, or move "
            "a copy with ap.reshard(param, mesh, placements)")
    agree.check(where, _check_mesh(mesh, where), lambda: _describe(src))
    return param


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


class LayOut:
    """A layout recorded inside a traced forward (``torch.fx``: a pipeline split by mesh, where
    ``shard_tensor`` meets a proxy, not a tensor). Called on a tensor, it lays it out as
    ``shard_tensor`` would (a plain tensor; a Parameter in place, for a dims mapping) or as
    ``reshard`` would (a DistTensor). ``ap.pipeline.split_by_meshes`` applies the ones on
    parameters once, before it splits, and keeps the others as steps of their stage."""

    __module__ = __name__

    def __init__(self, mesh: ProcessMesh, placements: Layout, shard_order: ShardOrder = None) -> None:
        self.mesh, self.placements, self.shard_order = _check_mesh(mesh, "shard_tensor"), placements, shard_order
        self.__name__ = "ap_lay_out"  # how the traced program's code names this step
        # checked now, when the forward is traced (on every rank alike), as far as a layout can be
        # without the tensor: a mapping's names and their uses; its length meets the tensor later
        if is_dims_mapping(placements):
            mapping: Any = placements
            dims_mapping_to_placements(mapping, self.mesh, [1] * len(list(mapping)), "shard_tensor")
        else:
            _check_placements(placements, "shard_tensor", self.mesh)

    def __call__(self, t: torch.Tensor) -> Any:
        return shard_tensor(t, self.mesh, self.placements, shard_order=self.shard_order)

    def __repr__(self) -> str:
        return f"ap_lay_out({self.mesh!r}, {list(self.placements)})"


def shard_tensor(
    data: Any,
    mesh: ProcessMesh,
    placements: Layout,
    dtype: torch.dtype | None = None,
    stop_gradient: bool | None = None,
    *,
    shard_order: ShardOrder = None,
) -> DistTensor:
    """Lay out ``data`` (the full value, identical on every rank) on ``mesh`` by ``placements``.

    Returns the DistTensor holding this rank's shard. ``placements`` is one placement per mesh
    axis (a shorter list is padded with ``Replicate()``), or Paddle's static dims mapping: one
    mesh-axis name or ``None`` per tensor dim (``[None, "mp"]``). ``Partial`` placements keep the
    value on the first rank of the axis (sum) or on every rank (avg/max/min). Differentiable: the
    gradient of ``data`` is the full gradient.

    Parameters. With placements, a plain ``nn.Parameter`` comes back as a new Parameter (assign
    it: ``layer.weight = ap.shard_tensor(layer.weight, ...)``). With a dims mapping the call is
    an annotation, as in Paddle's static graph: a plain Parameter is laid out in place (the same
    object becomes the DistTensor, so the module and an optimizer built before hold it) and
    returned, so ``ap.shard_tensor(self.linear1.weight, mesh, ["mp", None])`` may stand alone in
    ``forward``; on a Parameter that is already a DistTensor it returns the parameter when the
    layout is its own and raises ``ValueError`` naming both layouts when it is not. With
    placements, a DistTensor (a Parameter too) is resharded: ``ap.reshard``.
    """
    if isinstance(data, torch.fx.Proxy):  # inside a traced forward: recorded, applied by the split
        return data.tracer.create_proxy("call_function", LayOut(mesh, placements, shard_order), (data,), {})  # type: ignore[return-value]
    static = is_dims_mapping(placements)
    if not isinstance(data, torch.Tensor):
        data = torch.as_tensor(data)
    placements = to_placements(placements, "shard_tensor", mesh, tuple(data.shape))
    if isinstance(data, DistTensor):
        if static and isinstance(data, torch.nn.Parameter):
            return _annotated(data, mesh, placements, shard_order, "shard_tensor")
        return reshard(data, _check_mesh(mesh, "shard_tensor"), placements, shard_order=shard_order)
    is_param, original = isinstance(data, torch.nn.Parameter), data
    if static and is_param:
        _check_in_place(data, "shard_tensor")  # before any collective: every rank raises alike
    mesh = _check_mesh(mesh, "shard_tensor")
    if dtype is not None:
        data = data.to(dtype)
    spec = _check_reductions(DistSpec(mesh, placements, tuple(data.shape), data.dtype, _order(shard_order)), "shard_tensor")
    agree.check("shard_tensor", mesh, lambda: _describe(spec), lambda: agree.checksum(data))
    requires_grad = data.requires_grad if stop_gradient is None else not stop_gradient
    if is_param:
        with torch.no_grad():
            out = layout.shard_full(_local_device(data.detach()), spec)
        param = torch.nn.Parameter(out, requires_grad=requires_grad)
        if static:
            return _lay_out_in_place(original, param, "shard_tensor")  # type: ignore[return-value]
        return param  # type: ignore[return-value]
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
    expected = spec.local_shape(coord)
    fits = coord is None or tuple(local.shape) == expected
    # (a shard that does not fit is part of what the ranks compare: every rank raises, naming it)
    agree.check("dtensor_from_local", mesh, lambda: _describe(spec) + (
        "" if fits else f", local shape {tuple(local.shape)} where mesh coordinate {coord} should hold {expected}"))
    if not fits:
        raise ValueError(
            f"dtensor_from_local: local shape {tuple(local.shape)} does not match global shape "
            f"{tuple(spec.shape)} with placements {list(placements)} on mesh shape "
            f"{list(mesh.shape)}: this rank (mesh coordinate {coord}) should hold {expected}"
        )
    if coord is None:
        local = local.new_empty((0,))
    return layout.from_local(local, spec)


def reshard(x: DistTensor, mesh: ProcessMesh, placements: Layout, *, shard_order: ShardOrder = None) -> DistTensor:
    """The same global value laid out on ``mesh`` by ``placements`` (any mesh; differentiable).

    ``placements``: one placement per mesh axis, or a dims mapping (one mesh-axis name or
    ``None`` per tensor dim, as in ``shard_tensor``)."""
    if not isinstance(x, DistTensor):
        raise TypeError(f"reshard: x must be a DistTensor, got {type(x).__name__}; use shard_tensor for plain tensors")
    placements = to_placements(placements, "reshard", mesh, tuple(x.shape))
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


