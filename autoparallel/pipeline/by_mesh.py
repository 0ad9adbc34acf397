"""Pipeline stages from the meshes a forward assigns: Paddle's pipeline by ``shard_op`` sub-meshes.

``split_by_meshes(model)`` traces ``model``'s forward with ``torch.fx`` (symbolically: no tensor
is computed, nothing communicates). Each ``ap.shard_op(op, sub_mesh)`` call in it marks the nodes
it made with its mesh (``sharded_call.MESH_META``); every other node follows its inputs (the
latest stage among them; the model's inputs start on the first mesh; a parameter read directly
belongs to the stage of its first use). The program is cut where the mesh changes
(``torch.fx.passes.split_module``) into one ``torch.fx.GraphModule`` per mesh, holding the
original submodules and parameters (the optimizer's references stay valid); plain parameters are
laid out ``Replicate`` on their stage's mesh (``ap.shard_layer``, in place).

Layouts written in the forward are kept: ``ap.shard_tensor(self.fc.weight, sub_mesh, ["mp",
None])`` (a dims mapping: an annotation) lays that parameter out once, before the split (tensor
parallelism inside a stage), and ``shard_tensor`` on an activation, or ``shard_op``'s dims
mappings, stay steps of the stage on their mesh. A parameter laid out on another mesh than its
stage's raises ``ValueError``.

What a split needs, checked on metadata before anything runs (the same error on every rank):

- at least one ``shard_op`` call on a mesh in ``forward``;
- the meshes visited in one order, each once, on disjoint ranks; or round robin (``A, B, A, B``:
  two chunks per mesh, for ``schedule="Interleaved1F1B"``);
- one tensor crossing each stage boundary, and one model input (the Pipeline's micro-batches).

``Pipeline(split_by_meshes(model), loss_fn, num_microbatches=..., schedule=...)`` is what
``ap.Engine`` runs for ``Strategy.pipeline``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoparallel.api import LayOut
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.shard_layer import shard_layer
from autoparallel.pipeline.stage import Stage, check_meshes, off_mesh
from autoparallel.sharded_call import MESH_META

_WHAT = "split_by_meshes"


class Leaves(torch.fx.Tracer):
    """A tracer that records the calls of ``leaves`` (modules) without tracing into them."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)


def trace_forward(model: nn.Module, what: str = _WHAT, leaves: set[int] | None = None) -> torch.fx.GraphModule:
    try:
        if leaves:
            tracer = Leaves(leaves)
            return torch.fx.GraphModule(model, tracer.trace(model), type(model).__name__)
        return torch.fx.symbolic_trace(model)
    except Exception as e:  # noqa: BLE001  (any trace failure: say what to do)
        if isinstance(e, ValueError) and not isinstance(e, torch.fx.proxy.TraceError):
            raise  # a layout the forward wrote is wrong: its own message says which
        raise ValueError(
            f"{what}: splitting the model into stages traces its forward with torch.fx, which failed "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Keep the forward free of data-dependent "
            "Python control flow, or build the stages yourself: Pipeline(split_sequential(...), ...)") from e


def _stages_of(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, int], list[ProcessMesh]]:
    """Chunk index of every node, and each chunk's mesh, in forward order.

    A chunk is a run of nodes on one mesh: a node ``shard_op`` marked with another mesh than the
    current chunk's starts the next chunk; every other node joins the current one. The chunks'
    meshes must go round robin over the distinct meshes (``p`` of them): one chunk per mesh, or
    ``v`` per mesh for an interleaved schedule (mesh ``c % p`` for chunk ``c``)."""
    nodes = list(gm.graph.nodes)
    marked = [n for n in nodes if MESH_META in n.meta]
    if not marked:
        raise ValueError(f"{_WHAT}: the forward assigns nothing to a stage mesh; call ap.shard_op(layer, "
                         "sub_mesh)(x) in forward for the layers of each stage (sub_mesh = world_mesh[k])")
    chunks: list[ProcessMesh] = [marked[0].meta[MESH_META]]
    stage: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n.op in ("get_attr", "output"):
            continue
        mesh = n.meta.get(MESH_META)
        if mesh is not None and mesh != chunks[-1]:
            chunks.append(mesh)
        stage[n] = len(chunks) - 1
    for n in nodes:
        if n.op == "get_attr":
            users = [stage[u] for u in n.users if u in stage]
            stage[n] = min(users) if users else 0
    distinct = list(dict.fromkeys(chunks))
    check_meshes(distinct)
    p = len(distinct)
    if len(chunks) % p or any(m != distinct[c % p] for c, m in enumerate(chunks)):
        order = [distinct.index(m) for m in chunks]
        raise ValueError(
            f"{_WHAT}: sub-mesh stages must cover the model in order: the forward visits the stage meshes in the "
            f"order {order}; each mesh once ({list(range(p))}), or round robin for an interleaved schedule "
            f"({list(range(p)) * 2}, ...)")
    return stage, chunks


def check_boundaries(split: torch.fx.GraphModule, count: int, what: str = _WHAT) -> list[nn.Module]:
    """The stage modules in order; each takes exactly the previous one's single output."""
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    inputs = [n for n in split.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ValueError(f"{what}: the model takes {len(inputs)} inputs; a pipeline feeds one tensor "
                         "(its micro-batches) to the first stage")
    if len(calls) != count or any(n.op not in ("placeholder", "call_module", "output") for n in split.graph.nodes):
        raise ValueError(f"{what}: a stage passes several values to the next; each stage boundary must carry "
                         "one tensor (return one tensor from the layers of each stage)")
    prev: torch.fx.Node = inputs[0]
    for k, n in enumerate(calls):
        if list(n.args) != [prev] or n.kwargs:
            raise ValueError(f"{what}: stage {k} takes {len(n.args) + len(n.kwargs)} values; each stage boundary "
                             "must carry one tensor, from the stage just before it")
        prev = n
    out = next(n for n in split.graph.nodes if n.op == "output")
    if out.args[0] is not prev:
        raise ValueError(f"{what}: the model's output must be the last stage's one tensor")
    return [getattr(split, str(n.target)) for n in calls]


def split_by_meshes(model: nn.Module) -> list[Stage]:
    """``model`` as pipeline stages, one per mesh its forward's ``shard_op`` calls name (module doc)."""
    from torch.fx.passes.split_module import split_module

    gm = trace_forward(model)
    _annotations(gm)
    stage, meshes = _stages_of(gm)
    split = split_module(gm, model, lambda n: stage[n])
    modules = check_boundaries(split, len(meshes))
    stages = []
    for k, (module, mesh) in enumerate(zip(modules, meshes, strict=True)):
        off = off_mesh(module, mesh)
        if off is not None:
            raise ValueError(f"{_WHAT}: parameter {off[0]!r} is laid out on {off[1]!r} but used by stage {k}, "
                             f"on {mesh!r}: annotate it on its stage's mesh")
        shard_layer(module, mesh)  # plain parameters: Replicate on the stage mesh, in place
        stages.append(Stage(module, mesh, name=f"stage {k}"))
    return stages


def _annotations(gm: torch.fx.GraphModule) -> None:
    """The layouts the forward recorded (``ap.shard_tensor`` / ``shard_op`` mappings on a proxy):
    a parameter's is applied now, in place, once (a dims mapping: the parameter object becomes
    the DistTensor) and leaves the program; an activation's stays a step, on its mesh's stage."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, LayOut):
            continue
        src = n.args[0]
        if isinstance(src, torch.fx.Node) and src.op == "get_attr":
            param = gm.get_parameter(str(src.target))
            if n.target(param) is not param:
                raise ValueError(f"{_WHAT}: parameter {src.target!r} is laid out with placements in the forward; in a "
                                 "forward split into stages annotate parameters with a dims mapping (in place: "
                                 "ap.shard_tensor(self.fc.weight, mesh, ['mp', None]))")
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            if not src.users:  # read only to be annotated
                gm.graph.erase_node(src)
        else:
            n.meta[MESH_META] = n.target.mesh
    gm.recompile()


def run_stages(stages: list[Stage], x: Any) -> Any:
    """The stages one after another on the whole batch (no micro-batches, no schedule): each
    stage's input moved onto its mesh (``Replicate``) as the pipeline would."""
    from autoparallel.api import reshard
    from autoparallel.placement import Replicate

    for k, st in enumerate(stages):
        if k:
            x = reshard(x, st.mesh, [Replicate()] * st.mesh.ndim)
        x = st.module(x)
    return x


__all__ = ["run_stages", "split_by_meshes"]
