"""The dispatcher's argument walking: the cache key, plain tensors, DistTensor slots, outputs.

Pure helpers of ``autoparallel.dispatch`` over an op's ``(args, kwargs)``: the hashable key of a
call (``call_key``), adopting plain tensors as Replicate (``adopt_plain``, the policy of
docs/plain_tensors.md), where the DistTensors sit and how to put local shards there
(``dist_slots``/``place_locals``/``map_args``), which inputs an op writes and which outputs are those inputs
(``written_args``/``mutated_inputs``/``out_aliases``), and the shape of a result
(``flatten_out``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from autoparallel import runtime
from autoparallel.placement import Replicate
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
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    member = mesh_coord(mesh) is not None
    adopted: dict[int, Any] = {}

    def adopt(t: torch.Tensor) -> Any:
        if id(t) not in adopted:
            local = t if member else t.new_empty((0,))
            stride = tuple(t.stride()) if t.layout == torch.strided else None
            adopted[id(t)] = cls._wrap(local, DistSpec(mesh, rep, tuple(t.shape), t.dtype), stride)
        return adopted[id(t)]

    def walk(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.dim() != 0:
            return adopt(a)
        if isinstance(a, (list, tuple)):
            return type(a)(walk(x) for x in a)
        return a

    return walk(args), {k: walk(v) for k, v in kwargs.items()}


def map_args(cls: Any, items: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(items, dict):
        return {k: map_args(cls, v, fn) for k, v in items.items()}
    if isinstance(items, cls):
        return fn(items)
    if isinstance(items, (list, tuple)):
        mapped = [map_args(cls, a, fn) for a in items]
        return type(items)(mapped) if isinstance(items, tuple) else mapped
    if isinstance(items, torch.Tensor) and items.dim() == 0:
        return fn(items)
    return items


def dist_slots(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Positions of the DistTensors: ``((arg index, k | (k or None per element)), ...)`` for args,
    the same keyed by name for kwargs; None when tensors nest deeper than one list."""
    k = 0

    def walk(items: Any) -> list[tuple[Any, Any]] | None:
        nonlocal k
        out: list[tuple[Any, Any]] = []
        for pos, a in items:
            if isinstance(a, cls):
                out.append((pos, k))
                k += 1
            elif isinstance(a, (list, tuple)) and any(isinstance(x, (cls, list, tuple)) for x in a):
                inner: list[int | None] = []
                for x in a:
                    if isinstance(x, cls):
                        inner.append(k)
                        k += 1
                    elif isinstance(x, (list, tuple)):
                        return None
                    else:
                        inner.append(None)
                out.append((pos, tuple(inner)))
        return out

    a = walk(enumerate(args))
    kw = walk(kwargs.items()) if a is not None else None
    return None if a is None or kw is None else (tuple(a), tuple(kw))


def place_locals(items: Any, slots: Any, locs: list[torch.Tensor]) -> Any:
    """``items`` (a list of args, or a dict of kwargs) with DistTensors swapped for locals."""
    for pos, k in slots:
        if type(k) is int:
            items[pos] = locs[k]
        else:
            seq = items[pos]
            items[pos] = type(seq)(x if j is None else locs[j] for x, j in zip(seq, k))
    return items


def mesh_coord(mesh: Any) -> tuple[int, ...] | None:
    return mesh.coordinate_of(runtime.get_rank())


def flatten_out(out: Any) -> tuple[str, list[Any]]:
    if out is None:
        return "none", []
    if isinstance(out, torch.Tensor):
        return "tensor", [out]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in out) and any(
        isinstance(o, torch.Tensor) for o in out
    ):
        return ("tuple" if isinstance(out, tuple) else "list"), list(out)
    return "value", []


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op writes: ``self`` of ``add_``, ``out=``."""
    written: list[Any] = []
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written.extend(value if isinstance(value, (list, tuple)) else [value])
    return written


def out_aliases(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], mutated: tuple[int, ...], n_out: int
) -> tuple[int | None, ...]:
    """Per output, the position in ``dts`` of the written input it returns (``add_``'s self, the
    ``out=`` tensors), None for a new tensor (``_native_batch_norm_legit`` writes its running
    stats and returns new ones). From the schema's alias sets; outputs paired with the written
    inputs in order where a set names a list argument."""
    if not mutated:
        return (None,) * n_out
    by_set: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        a = arg.alias_info
        if a is not None and a.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            by_set.update((name, value) for name in a.before_set)
    pos = {id(t): k for k, t in enumerate(dts)}
    out: list[int | None] = []
    for r in func._schema.returns[:n_out]:
        a = r.alias_info
        value = by_set.get(next(iter(a.before_set))) if a is not None and a.is_write and a.before_set else None
        if isinstance(value, (list, tuple)):
            return tuple(mutated[k] if k < len(mutated) else None for k in range(n_out))
        out.append(pos.get(id(value)) if value is not None else None)
    return tuple(out) + (None,) * (n_out - len(out))


def mutated_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any]) -> tuple[int, ...]:
    """Positions (in ``dts``) of the DistTensors the op writes."""
    ids = [id(t) for t in written_args(func, args, kwargs)]
    return tuple(i for i, t in enumerate(dts) if id(t) in ids)


__all__ = [
    "adopt_plain", "call_key", "dist_slots", "flatten_out", "map_args", "mesh_coord", "mutated_inputs",
    "out_aliases", "place_locals", "written_args",
]
