"""Keys: the hashable description of an op call that decisions are cached on, and the plain
tensors a call mixes with DistTensors (adopted as Replicate, docs/plain_tensors.md)."""

from __future__ import annotations

from typing import Any

import torch

from autoparallel import runtime
from autoparallel.engine.aliases import written_args
from autoparallel.placement import Replicate
from autoparallel.runtime import agree
from autoparallel.spec import DistSpec


def call_key(cls: Any, items: tuple[Any, ...], dts: list[Any], plain: list[torch.Tensor]) -> tuple[Any, ...]:
    """Hashable description of the arguments; collects DistTensors into ``dts`` in order, and
    plain tensors of one or more dims into ``plain`` (0-dim ones count as scalars)."""
    out: list[Any] = []
    for a in items:
        if isinstance(a, cls):
            dts.append(a)
            out.append((a._spec, a._stride))
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                plain.append(a)
            out.append(("scalar_tensor", a.dtype))
        elif isinstance(a, (list, tuple)):
            out.append((type(a).__name__, call_key(cls, tuple(a), dts, plain)))
        else:
            out.append(a)
    return tuple(out)


def adopt_plain(
    cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], plain: list[torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with every plain tensor of one or more dims made a Replicate DistTensor.

    The policy (docs/plain_tensors.md): a plain tensor mixed with DistTensors in one op is the
    same full value on every rank, like a Python scalar, so it is Replicate on the DistTensors'
    mesh. Torch itself makes such tensors inside decompositions and backward formulas (zeros,
    ones, index tensors), and user code indexes with them (``x[idx]``). A plain tensor is refused
    (TypeError, before any collective) when it requires grad (its gradient would have to be a
    plain tensor), when the op writes it and the mesh is not the whole world (ranks outside the
    mesh would not write it; inside, the adopted tensor's shard IS the plain tensor, so the full
    result lands in it), or when the DistTensors live on several meshes (no mesh to replicate on).
    Plain tensors whose values differ across the mesh's ranks raise a ``ValueError`` on every rank
    (``agree.check_plain``: the first calls of each op, every call with ``AUTOPARALLEL_CHECK=1``).
    """
    what = f"{func}: cannot mix a DistTensor with a plain tensor of shape {tuple(plain[0].shape)}"
    meshes = list(dict.fromkeys(d._spec.mesh for d in dts))
    if len(meshes) > 1:
        raise TypeError(f"{what}: the DistTensors live on {len(meshes)} meshes, so it has no mesh to be "
                        "replicated on; make it a DistTensor first (ap.shard_tensor)")
    grad = next((t for t in plain if t.requires_grad), None)
    if grad is not None:
        raise TypeError(f"{func}: cannot mix a DistTensor with a plain tensor of shape {tuple(grad.shape)} "
                        "that requires grad (its gradient would be a plain tensor on every rank); make it a "
                        "DistTensor first (ap.shard_tensor)")
    mesh = meshes[0]
    written = {id(t) for t in written_args(func, args, kwargs)}
    hit = next((t for t in plain if id(t) in written), None)
    if hit is not None and mesh.size != runtime.get_world_size():
        raise TypeError(f"{func}: cannot write a DistTensor result into a plain tensor of shape "
                        f"{tuple(hit.shape)}: the ranks outside mesh {mesh} would not write it; "
                        "make it a DistTensor first (ap.shard_tensor)")
    member = mesh_coord(mesh) is not None
    agree.check_plain(str(func), mesh, plain)  # the same value on every rank, or one error everywhere
    adopted: dict[int, Any] = {}

    def adopt(t: torch.Tensor) -> Any:
        if id(t) not in adopted:
            adopted[id(t)] = adopt_one(cls, t, mesh, member)
        return adopted[id(t)]

    return _adopted(cls, args, adopt), {k: _adopted(cls, v, adopt) for k, v in kwargs.items()}


def adopt_one(cls: Any, t: torch.Tensor, mesh: Any, member: bool | None = None) -> Any:
    """The plain tensor ``t`` as the Replicate DistTensor on ``mesh`` an op adopts it as: its
    shard is ``t`` itself on the mesh's ranks (an empty tensor elsewhere). ``member``: whether
    this rank is on the mesh, if known."""
    if member is None:
        member = mesh_coord(mesh) is not None
    local = t if member else t.new_empty((0,))
    stride = tuple(t.stride()) if t.layout == torch.strided else None
    return cls._wrap(local, DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(t.shape), t.dtype), stride)


def _adopted(cls: Any, a: Any, adopt: Any) -> Any:
    """``a`` with every plain tensor of one or more dims as ``adopt`` makes it (a module function:
    a closure calling itself is a reference cycle holding the tensors until a full collection)."""
    if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.dim() != 0:
        return adopt(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_adopted(cls, x, adopt) for x in a)
    return a


# Python-level names of the in-place methods that write their first argument besides ``*_``.
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def is_in_place_name(name: str) -> bool:
    """Whether a torch function named ``name`` writes its first argument (``add_``, ``__setitem__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


def adopt_written_plain(cls: Any, name: str, args: tuple[Any, ...]) -> None:
    """Make a plain tensor that an in-place op writes with a value that requires grad a Replicate
    DistTensor, in place (``torch.utils.swap_tensors``), before autograd sees the op.

    Models build buffers with factories and fill them in place with computed values: Mixtral's
    MoE ``final = torch.zeros(...)`` then ``final.index_add_(0, idx, expert_out)`` per expert.
    With ``expert_out`` a DistTensor, written into the plain ``final`` below autograd, the plain
    tensor would carry a gradient path autograd cannot take (a plain gradient for a DistTensor),
    and the next write was refused. Made a DistTensor first, it is an ordinary written
    DistTensor: autograd records on it, later ops see one layout. The policy is
    ``adopt_plain``'s (docs/plain_tensors.md): the plain value is the same on every rank, the
    DistTensors share one mesh of the whole world; otherwise nothing changes here and the op
    raises as before. Called from ``DistTensor.__torch_function__`` (above autograd).
    """
    if not is_in_place_name(name):
        return
    if not args or type(args[0]) is not torch.Tensor or args[0].requires_grad or args[0].dim() == 0:
        return
    dts = [a for a in args[1:] if isinstance(a, cls)]
    if not dts or not torch.is_grad_enabled() or not any(d.requires_grad for d in dts):
        return
    meshes = {d._spec.mesh for d in dts}
    if len(meshes) != 1:
        return
    mesh = meshes.pop()
    if mesh.size != runtime.get_world_size():
        return
    plain = args[0]
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    stride = tuple(plain.stride()) if plain.layout == torch.strided else None
    new = cls._wrap(plain.detach(), DistSpec(mesh, rep, tuple(plain.shape), plain.dtype), stride)
    try:
        torch.utils.swap_tensors(plain, new)
    except RuntimeError:  # weak references or other holders: leave it; the op raises as before
        return


def adopt_plain_leaves(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Lay out, in place, every plain leaf that requires grad (a parameter left plain) that an op
    mixes with DistTensors: it becomes a Replicate DistTensor (a Parameter stays a Parameter;
    ``torch.utils.swap_tensors``, so a module or an optimizer holding it holds the DistTensor).

    Paddle's convention: a plain parameter meeting distributed tensors is replicated, and its
    gradient is the full gradient, so any optimizer keeps it in sync. Its values must agree
    across the mesh (``agree.check_plain``: the same value on every rank, or one error
    everywhere). Called from ``DistTensor.__torch_function__`` (above autograd, so autograd
    records the op on the DistTensor). Nothing changes — and the op raises its ``TypeError`` —
    for a non-leaf, when the DistTensors live on several meshes, or when the mesh is not the
    whole world (ranks outside it would hold no value of the parameter).
    """
    leaves = [a for a in (*args, *kwargs.values())
              if type(a) in (torch.Tensor, torch.nn.Parameter) and a.requires_grad and a.is_leaf and a.dim() != 0]
    if not leaves:
        return
    meshes = {a._spec.mesh for a in (*args, *kwargs.values()) if isinstance(a, cls)}
    if len(meshes) != 1:
        return
    mesh = meshes.pop()
    if mesh.size != runtime.get_world_size():
        return
    agree.check_plain(f"a plain parameter in {getattr(func, '__name__', func)}", mesh, leaves)
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    for t in dict.fromkeys(leaves):  # (one tensor passed twice is laid out once)
        stride = tuple(t.stride()) if t.layout == torch.strided else None
        new = cls._wrap(t.detach(), DistSpec(mesh, rep, tuple(t.shape), t.dtype), stride, True)
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new)
        try:
            torch.utils.swap_tensors(t, new)
        except RuntimeError:  # weak references or other holders: leave it; the op raises as before
            continue


def mesh_coord(mesh: Any) -> tuple[int, ...] | None:
    return mesh.coordinate_of(runtime.get_rank())


__all__ = ["adopt_plain", "adopt_plain_leaves", "adopt_written_plain", "call_key", "is_in_place_name", "mesh_coord"]
