"""``shard_op`` (module ``sharded_call``, so that importing it never hides ``ap.shard_op``): Paddle's static-graph op annotation, on the dynamic engine.

``ap.shard_op(op, mesh, in_dims_mappings, out_dims_mappings)(*args)`` lays each tensor input
out as its dims mapping says, runs ``op``, and lays each tensor output out as its mapping says.
Between the two the op is an ordinary call on DistTensors: its SPMD rules choose how it runs
on the shards, as for any other op. A mapping is what ``shard_tensor`` takes (one mesh-axis name
or ``None`` per tensor dim, or one placement per mesh axis); ``None`` in place of a mapping
leaves that tensor as it is.

Pipeline stages by mesh: ``ap.shard_op(self.linear3, world_mesh[1])(x)`` with a sub-mesh
assigns that call to the stage on that mesh. ``ap.Engine`` with ``Strategy.pipeline.enable``
traces the forward (``torch.fx``), where each call marks the nodes it made with its mesh
(``MESH_META``), and splits the program into stages at the mesh changes
(``ap.pipeline.split_by_meshes``); its dims mappings become layout steps of that stage
(``api.LayOut``; one output mapping). Run eagerly, a call on another mesh is an ordinary call
whose inputs the engine moves where its parameters live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.api import Layout, reshard, shard_tensor, to_placements
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh

Mappings = Sequence[Layout | None] | None
MESH_META = "ap_mesh"  # fx node meta key: the mesh a traced shard_op call assigned the node to


def _check_mappings(mappings: Any, what: str) -> tuple[Layout | None, ...] | None:
    """``mappings`` as a tuple (one entry per tensor: a layout or ``None``), or ``None``."""
    if mappings is None:
        return None
    if isinstance(mappings, (str, bytes)) or not isinstance(mappings, Sequence):
        raise TypeError(f"shard_op: {what} must be a list with one dims mapping (or None) per tensor, "
                        f"got {mappings!r}")
    for m in mappings:
        if m is not None and (isinstance(m, (str, bytes)) or not isinstance(m, Sequence)):
            raise TypeError(f"shard_op: {what} {list(mappings)} holds {m!r}: each entry is a dims mapping "
                            "(a list such as [None, 'mp']) or None")
    return tuple(mappings)


def _check_count(mappings: tuple[Layout | None, ...], positions: list[int], what: str) -> None:
    """One mapping (or None) per tensor, else ``ValueError`` naming both counts."""
    if len(mappings) != len(positions):
        raise ValueError(f"shard_op: {len(mappings)} {what} {list(mappings)} for {len(positions)} tensor "
                         f"{'inputs' if what.startswith('in') else 'outputs'}: give one per tensor (None: leave it)")


def _lay_out(values: list[Any], positions: list[int], mappings: tuple[Layout | None, ...],
             mesh: ProcessMesh, what: str) -> list[Any]:
    """``values`` with ``values[positions[i]]`` laid out by ``mappings[i]`` (checked first, on
    metadata only, so a bad mapping raises on every rank before any tensor moves)."""
    _check_count(mappings, positions, what)
    for p, m in zip(positions, mappings, strict=True):
        if m is not None:
            to_placements(m, f"shard_op ({what}[{positions.index(p)}])", mesh, tuple(values[p].shape))
    out = list(values)
    for p, m in zip(positions, mappings, strict=True):
        if m is not None:
            t = values[p]
            out[p] = reshard(t, mesh, m) if isinstance(t, DistTensor) else shard_tensor(t, mesh, m)
    return out


def shard_op(
    op: Callable[..., Any],
    mesh: ProcessMesh,
    in_dims_mappings: Mappings = None,
    out_dims_mappings: Mappings = None,
) -> Callable[..., Any]:
    """``op`` (a function or a module) with its tensor inputs and outputs laid out on ``mesh``.

    ``in_dims_mappings``: one entry per positional tensor argument, in order (non-tensor
    arguments and keyword arguments pass through): a dims mapping (``[None, "mp"]``: tensor dim 1
    sharded along mesh axis ``"mp"``), placements, or ``None`` to leave the tensor as it is. A
    plain tensor is laid out with ``shard_tensor`` (a plain ``nn.Parameter`` in place, as an
    annotation), a DistTensor with ``reshard``. ``out_dims_mappings``: the same for the tensors
    ``op`` returns (one tensor, or the tensors of a returned tuple or list). A wrong number of
    mappings raises ``ValueError`` naming both counts.

    >>> y = ap.shard_op(torch.matmul, mesh, [[None, None], [None, "mp"]], [[None, "mp"]])(x, w)
    """
    if not callable(op):
        raise TypeError(f"shard_op: op must be a function or a module, got {type(op).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"shard_op: mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    ins = _check_mappings(in_dims_mappings, "in_dims_mappings")
    outs = _check_mappings(out_dims_mappings, "out_dims_mappings")

    def call(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer_of(args, kwargs)
        if tracer is not None:
            return _traced(tracer, op, mesh, ins, outs, args, kwargs)
        values = list(args)
        if ins is not None:
            positions = [i for i, a in enumerate(values) if isinstance(a, torch.Tensor)]
            values = _lay_out(values, positions, ins, mesh, "in_dims_mappings")
        result = op(*values, **kwargs)
        if outs is None:
            return result
        if isinstance(result, torch.Tensor):
            return _lay_out([result], [0], outs, mesh, "out_dims_mappings")[0]
        if isinstance(result, (tuple, list)):
            positions = [i for i, r in enumerate(result) if isinstance(r, torch.Tensor)]
            laid = _lay_out(list(result), positions, outs, mesh, "out_dims_mappings")
            return type(result)(laid) if type(result) in (tuple, list) else type(result)(*laid)
        return _lay_out([result], [], outs, mesh, "out_dims_mappings")[0]

    call.__name__ = f"shard_op({getattr(op, '__name__', type(op).__name__)})"
    call.__doc__ = getattr(op, "__doc__", None)
    return call


def _tracer_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``torch.fx`` tracer when a call's arguments are proxies (a symbolic trace), else None."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer
    return None


def _traced(tracer: Any, op: Callable[..., Any], mesh: ProcessMesh, ins: Any, outs: Any,
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call inside a symbolic trace: record ``op``, its inputs' and output's layouts
    (``shard_tensor`` on a proxy records an ``api.LayOut`` step), and mark every node it made with
    ``mesh``. An output mapping needs one output: the trace cannot look inside a returned tuple."""
    graph = tracer.graph
    last = next(iter(reversed(graph.nodes)), None)
    values = list(args)
    if ins is not None:
        positions = [i for i, a in enumerate(values) if isinstance(a, (torch.Tensor, torch.fx.Proxy))]
        _check_count(ins, positions, "in_dims_mappings")
        for p, m in zip(positions, ins, strict=True):
            if m is not None:
                values[p] = shard_tensor(values[p], mesh, m)
    result = op(*values, **kwargs)
    if outs is not None:
        if len(outs) != 1:
            raise NotImplementedError(
                f"shard_op: {len(outs)} out_dims_mappings on a call inside a traced forward (a pipeline split by mesh): "
                "a traced call's outputs are one value; give one mapping, or lay the outputs out after the call")
        if outs[0] is not None:
            result = shard_tensor(result, mesh, outs[0])
    seen = last is None
    for node in graph.nodes:
        if seen and node.op != "placeholder":
            node.meta[MESH_META] = mesh
        seen = seen or node is last
    return result


__all__ = ["MESH_META", "shard_op"]
