"""Pipeline stages cut between a model's repeated blocks: how an ``ap.Plan`` with a pipeline axis
is applied to a model ``ap.pipeline.decoder_stages`` does not know.

``split_at_blocks(model, meshes, "blocks", starts)`` traces the forward around the blocks with
``torch.fx`` (each block one call, not traced into), puts what runs before the blocks on the first
stage and what runs after them on the last, and cuts the rest between the blocks at ``starts``
(``by_mesh``'s cut: one tensor crossing each boundary). A weight read on two stages (an embedding
tied to the head) becomes a copy on the later stage, kept equal to the original: the stages'
``sync_tied_grads`` gives both the sum of their gradients; the model's state dict holds the copy
under the key of the module it was copied from (the head's weight), so ``ap.save_state_dict`` /
``ap.load_state_dict`` and ``model.load_state_dict`` keep and restore it (a weight the forward
reads directly, ``F.linear(x, self.tok.weight)``, has one key: ``model.load_state_dict`` fills
its copy from it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.api import reshard
from autoparallel.engine import layout
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.shard_layer import shard_layer
from autoparallel.pipeline.by_mesh import check_boundaries, trace_forward
from autoparallel.pipeline.decoder import DecoderStages, keep_the_copy_in_state_dicts
from autoparallel.pipeline.stage import Stage, check_meshes
from autoparallel.placement import Partial, Replicate


def split_at_blocks(model: nn.Module, meshes: Sequence[ProcessMesh], blocks: str, starts: Sequence[int],
                    plan: dict[str, Any] | None = None, recompute: dict[str, Any] | None = None,
                    loss: Callable[..., Any] | None = None) -> DecoderStages:
    """``model`` as one stage per mesh, cut between the blocks of its ``nn.ModuleList`` named
    ``blocks``: stage ``k`` runs blocks ``starts[k]`` up to ``starts[k + 1]``; what the forward
    does before the blocks runs on the first stage, after them on the last (an ``ap.Plan`` with a
    pipeline axis is applied this way). The forward around the blocks is traced with ``torch.fx``
    (each block a call of its own, not traced into) and cut as ``split_by_meshes`` cuts it (one
    tensor crossing each boundary, one model input); each stage is laid out by ``ap.parallelize``
    with the part of ``plan`` matching its layers, else ``Replicate`` on its mesh, and recomputes
    the modules ``recompute`` names (patterns over the model's names, as ``ap.parallelize``).
    A weight two stages read (an embedding tied to the head) becomes a copy on the later stage
    (module docstring). Returns the stages, ``loss`` and the tied pairs
    (``ap.pipeline.DecoderStages``): give ``.parameters()`` to the optimizer (they include the
    copies), call ``.sync_tied_grads()`` after each ``Pipeline.step``."""
    from torch.fx.passes.split_module import split_module

    from autoparallel.nn.parallelize import parallelize

    what = "split_at_blocks"
    check_meshes(list(meshes))
    stack = model.get_submodule(blocks) if blocks else None
    if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"{what}: {blocks!r} is not an nn.ModuleList (or nn.Sequential) of the model's blocks")
    p, n = len(meshes), len(stack)
    bounds = [*(int(s) for s in starts), n]
    if len(bounds) != p + 1 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: starts {list(starts)} must be {p} increasing block indices from 0, below {n}")
    stage_of = {i: k for k in range(p) for i in range(bounds[k], bounds[k + 1])}
    gm = trace_forward(model, what, {id(b) for b in stack})
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
    modules = check_boundaries(split, p, what)
    plans = _stage_plans(model, modules, plan, what)  # (by the stages' names: a copy below takes its original's place)
    recomputes = _stage_plans(model, modules, recompute, what)
    tied, sources = _copies_on_later_stages(modules)
    stages = []
    for k, (module, mesh, sub, again) in enumerate(zip(modules, meshes, plans, recomputes, strict=True)):
        if sub or again:
            parallelize(module, mesh, sub, recompute=again or None)
        else:
            shard_layer(module, mesh)
        stages.append(Stage(module, mesh, name=f"blocks {bounds[k]}..{bounds[k + 1] - 1}"))
    # a copy whose holder has a key of its own in the model's state dict (the head's weight) is
    # saved and loaded under it; a weight the forward reads directly has one key: loading the
    # model's state dict fills its copies after
    direct = []
    for pair, source in zip(tied, sources):
        if source is pair[0][0]:
            direct.append(pair)
        else:
            keep_the_copy_in_state_dicts(model, pair[0], source, pair[1])
    if direct:
        model.register_load_state_dict_post_hook(lambda module, keys: _copies_follow(direct))
    return DecoderStages(stages, loss, tied)


Tied = list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]


def _copies_on_later_stages(modules: list[nn.Module]) -> tuple[Tied, list[nn.Module]]:
    """Where a later stage reads a parameter an earlier one holds, the module holding it there is
    replaced (in that stage only) by a shallow copy holding a copy of the parameter: ``[((the
    first holder, attribute), (the copy, attribute))]``, and for each the module it was copied
    from (the model's own)."""
    first: dict[int, tuple[nn.Module, str, int]] = {}
    twins: dict[tuple[int, int], nn.Parameter] = {}
    tied: Tied = []
    sources: list[nn.Module] = []
    for k, module in enumerate(modules):
        for path, holder in list(module.named_modules()):
            own = compat.own_parameters(holder)
            for attr, param in list(own.items()):
                if param is None:
                    continue
                origin = first.setdefault(id(param), (holder, attr, k))
                if origin[2] == k:
                    continue
                twin = twins.get((id(param), k))
                fresh = twin is None
                if twin is None:
                    twin = twins[(id(param), k)] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                copied = copy.copy(holder)
                compat.set_own_parameters(copied, {**own, attr: twin})
                parent, _, name = path.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, name, copied)
                if fresh:  # (a second holder on this stage shares the copy: its gradient adds up there)
                    tied.append(((origin[0], origin[1]), (copied, attr)))
                    sources.append(holder)
    return tied, sources


def _copies_follow(tied: Tied) -> None:
    """After ``model.load_state_dict``: each copy takes its original's loaded value (moved onto
    its stage mesh; every rank joins the moves)."""
    for (ma, a), (mb, b) in tied:
        src, dst = getattr(ma, a), getattr(mb, b)
        placements = [Replicate() if isinstance(q, Partial) else q for q in dst.placements]
        moved = reshard(src.detach(), dst.process_mesh, placements)
        with torch.no_grad():
            layout.local_of(dst).copy_(layout.local_of(moved))


def why_not_cut(model: nn.Module, blocks: str) -> str | None:
    """Why ``split_at_blocks(model, ..., blocks, ...)`` could not cut ``model`` (its forward around
    the blocks does not trace with ``torch.fx``), or None. Traces only: nothing runs."""
    stack = model.get_submodule(blocks)
    try:
        trace_forward(model, "split_at_blocks", {id(b) for b in stack.children()})
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



__all__ = ["split_at_blocks", "why_not_cut"]
