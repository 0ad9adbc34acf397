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

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from autoparallel.api import LayOut
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.shard_layer import shard_layer
from autoparallel.pipeline.stage import Stage, check_meshes, off_mesh
from autoparallel.sharded_call import MESH_META

_WHAT = "split_by_meshes"


class _Leaves(torch.fx.Tracer):
    """A tracer that records the calls of ``leaves`` (modules) without tracing into them."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _trace(model: nn.Module, what: str = _WHAT, leaves: set[int] | None = None) -> torch.fx.GraphModule:
    try:
        if leaves:
            tracer = _Leaves(leaves)
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


def _check_boundaries(split: torch.fx.GraphModule, count: int, what: str = _WHAT) -> list[nn.Module]:
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

    gm = _trace(model)
    _annotations(gm)
    stage, meshes = _stages_of(gm)
    split = split_module(gm, model, lambda n: stage[n])
    modules = _check_boundaries(split, len(meshes))
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


def split_at_blocks(model: nn.Module, meshes: Sequence[ProcessMesh], blocks: str, starts: Sequence[int],
                    plan: dict[str, Any] | None = None, recompute: dict[str, Any] | None = None) -> list[Stage]:
    """``model`` as one stage per mesh, cut between the blocks of its ``nn.ModuleList`` named
    ``blocks``: stage ``k`` runs blocks ``starts[k]`` up to ``starts[k + 1]``; what the forward
    does before the blocks runs on the first stage, after them on the last (an ``ap.Plan`` with a
    pipeline axis is applied this way). The forward around the blocks is traced with ``torch.fx``
    (each block a call of its own, not traced into) and cut as ``split_by_meshes`` cuts it (one
    tensor crossing each boundary, one model input); each stage is laid out by ``ap.parallelize``
    with the part of ``plan`` matching its layers, else ``Replicate`` on its mesh, and recomputes
    the modules ``recompute`` names (patterns over the model's names, as ``ap.parallelize``). A weight two stages read (an embedding tied to the head) raises
    ``ValueError``: the stages would share one parameter on two meshes (for a ``transformers``
    decoder ``ap.pipeline.decoder_stages`` keeps a synchronised copy)."""
    from torch.fx.passes.split_module import split_module

    from autoparallel.nn.parallelize import parallelize

    what = "split_at_blocks"
    check_meshes(list(meshes))
    stack = model.get_submodule(blocks) if blocks else None
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(f"{what}: {blocks!r} is not an nn.ModuleList of the model's blocks")
    p, n = len(meshes), len(stack)
    bounds = [*(int(s) for s in starts), n]
    if len(bounds) != p + 1 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: starts {list(starts)} must be {p} increasing block indices from 0, below {n}")
    stage_of = {i: k for k in range(p) for i in range(bounds[k], bounds[k + 1])}
    gm = _trace(model, what, {id(b) for b in stack})
    stage: dict[torch.fx.Node, int] = {}
    head = f"{blocks}."
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        scopes = [str(k) for k in node.meta.get("nn_module_stack", {})]
        if node.op == "call_module":
            scopes.append(str(node.target))
        index = next((int(k[len(head):].split(".")[0]) for k in scopes if k.startswith(head)), None)
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        stage[node] = stage_of[index] if index is not None else max(inputs, default=0)
    _reads_as_calls(gm, stage)
    split = split_module(gm, gm, lambda node: stage[node])
    modules = _check_boundaries(split, p, what)
    holders: dict[int, int] = {}
    for k, module in enumerate(modules):
        for name, param in module.named_parameters():
            if holders.setdefault(id(param), k) != k:
                raise ValueError(f"{what}: parameter {name!r} is read by stages {holders[id(param)]} and {k} (a weight "
                                 "tied across stages); untie it, or keep both ends on one stage")
    plans = _stage_plans(model, modules, plan, what)
    recomputes = _stage_plans(model, modules, recompute, what)
    stages = []
    for k, (module, mesh, sub, again) in enumerate(zip(modules, meshes, plans, recomputes, strict=True)):
        if sub or again:
            parallelize(module, mesh, sub, recompute=again or None)
        else:
            shard_layer(module, mesh)
        stages.append(Stage(module, mesh, name=f"blocks {bounds[k]}..{bounds[k + 1] - 1}"))
    return stages


def why_not_cut(model: nn.Module, blocks: str) -> str | None:
    """Why ``split_at_blocks(model, ..., blocks, ...)`` could not cut ``model`` (its forward around
    the blocks does not trace with ``torch.fx``), or None. Traces only: nothing runs."""
    stack = model.get_submodule(blocks)
    try:
        _trace(model, "split_at_blocks", {id(b) for b in stack.children()})
    except ValueError as e:
        return str(e).split(". Keep")[0].removeprefix("split_at_blocks: ")
    return None


def _stage_plans(model: nn.Module, modules: list[nn.Module], plan: dict[str, Any] | None, what: str) -> list[dict[str, Any]]:
    """Each stage's part of ``plan`` (``{module-name pattern: value}`` over ``model``'s names: styles,
    or recompute policies), by the stage modules' own names for the same module objects (a split
    renames them)."""
    if not plan:
        return [{} for _ in modules]
    matches = [(pat, name, m, value) for pat, value in plan.items()
               for name, m in model.named_modules() if fnmatchcase(name, pat)]
    out = []
    for module in modules:
        names = {id(m): n for n, m in module.named_modules()}
        out.append({names[id(m)]: style for _, _, m, style in matches if id(m) in names})
    used = {pat for pat, _, m, _ in matches if any(id(m) in {id(x) for x in mod.modules()} for mod in modules)}
    unused = [k for k in plan if k not in used]
    if unused:
        raise ValueError(f"{what}: plan patterns {unused} match no layer the stages run")
    return out


class _Read(nn.Module):
    """A tensor attribute of ``owner`` read by the forward (``self.pos.weight[:t]``), as a module
    call: the stage reading it then holds ``owner`` (and lays its parameters out on its mesh)
    instead of taking the tensor as an input from outside."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        super().__init__()
        self.owner = owner
        self.attr = name

    def forward(self) -> Any:
        return getattr(self.owner, self.attr)


def _reads_as_calls(gm: torch.fx.GraphModule, stage: dict[torch.fx.Node, int]) -> None:
    """Each ``get_attr`` of ``gm`` becomes a call of a ``_Read`` module (on ``gm`` only: the
    model is not touched), in the stage of its first user."""
    for i, node in enumerate([n for n in gm.graph.nodes if n.op == "get_attr"]):
        users = [stage[u] for u in node.users if u in stage]
        owner_name, _, attr = str(node.target).rpartition(".")
        target = f"_read_{i}"
        gm.add_submodule(target, _Read(gm.get_submodule(owner_name), attr))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(target)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        stage[call] = min(users) if users else 0
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


__all__ = ["run_stages", "split_at_blocks", "split_by_meshes", "why_not_cut"]
