"""Stage placement: which part of a model runs on which stage mesh.

A :class:`Stage` is a module whose parameters all live on one stage mesh. Stages come from

* :func:`split_sequential` — cut an ``nn.Sequential`` (or list of blocks) at named children and
  lay each piece's parameters out on its mesh (Replicate, or by ``shard_fn``/``plan`` for
  tensor parallelism inside the stage);
* :func:`stages_from_annotations` — group the children of a model whose parameters the user
  already ``shard_tensor``-ed onto stage meshes.

The order of stages is the order of the forward pass (chunk ``c`` feeds chunk ``c + 1``); with
``v`` chunks per mesh the meshes repeat round robin (interleaved pipelines). Every check here
is on metadata only, so a bad split raises the same error on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.pipeline.schedule import v_stage
from autoparallel.placement import Placement, check_placement


@dataclass
class Stage:
    """``module`` runs on ``mesh``; its input arrives laid out by ``input_placements``.

    ``input_placements`` (one per mesh axis) is the layout of the activation entering this
    stage from the previous one; None keeps the previous stage's output layout (Partial
    reduced) when both meshes have the same axis names, else Replicate.
    """

    module: nn.Module
    mesh: ProcessMesh
    input_placements: Sequence[Placement] | None = None
    name: str = ""


class Piece(nn.Sequential):
    """A run of consecutive blocks of a model: exactly ``nn.Sequential`` (each block's output is
    the next block's one argument), except that several arguments, the tensors of the previous
    piece's output tuple, reach the first block as that one tuple, as they did in the model."""

    def forward(self, *args: Any) -> Any:
        x = args[0] if len(args) == 1 else args
        for block in self:
            x = block(x)
        return x


def _blocks(model: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential) or isinstance(model, nn.ModuleList):
        return list(model.named_children())
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(
        f"pipeline: expected an nn.Sequential, nn.ModuleList or list of modules, got {type(model).__name__}"
    )


def check_meshes(meshes: Sequence[ProcessMesh]) -> None:
    """Stage meshes must be ProcessMeshes with pairwise disjoint ranks."""
    if not isinstance(meshes, (list, tuple)) or not meshes:
        raise TypeError(f"pipeline: meshes must be a non-empty list of ProcessMesh, got {meshes!r}")
    for i, m in enumerate(meshes):
        if not isinstance(m, ProcessMesh):
            raise TypeError(f"pipeline: meshes[{i}] must be an ap.ProcessMesh, got {type(m).__name__}")
    for i, a in enumerate(meshes):
        for j in range(i + 1, len(meshes)):
            shared = sorted(set(a.process_ids) & set(meshes[j].process_ids))
            if shared:
                raise ValueError(
                    f"pipeline: stage meshes {i} {a.mesh.tolist()} and {j} {meshes[j].mesh.tolist()} overlap "
                    f"on ranks {shared}; stage meshes must be disjoint"
                )


def _param_mesh(name: str, module: nn.Module) -> ProcessMesh | None:
    """The one mesh all parameters of ``module`` live on; None for a parameter-free module."""
    meshes: dict[ProcessMesh, str] = {}
    for pname, p in module.named_parameters():
        if not isinstance(p, DistTensor):
            raise ValueError(
                f"pipeline: layer {name!r} is not assigned to a stage: parameter {name}.{pname} is a plain "
                "tensor; shard_tensor it onto a stage mesh"
            )
        meshes.setdefault(p.process_mesh, f"{name}.{pname}")
    if len(meshes) > 1:
        where = {n: m.mesh.tolist() for m, n in meshes.items()}
        raise ValueError(f"pipeline: layer {name!r} has parameters on several meshes {where}; one stage per layer")
    return next(iter(meshes), None)


def stages_from_annotations(model: Any, meshes: Sequence[ProcessMesh] | None = None) -> list[Stage]:
    """Group consecutive children of ``model`` by the mesh their (annotated) parameters live on.

    Parameter-free children (activations) join the stage before them (the first stage if they
    lead). Raises ``ValueError`` for a child with plain parameters (a layer left unassigned),
    for a child spread over several meshes, or — with ``meshes`` — for a mesh not listed.
    """
    blocks = _blocks(model)
    groups: list[tuple[ProcessMesh | None, list[tuple[str, nn.Module]]]] = []
    for name, block in blocks:
        mesh = _param_mesh(name, block)
        if groups and (mesh is None or mesh == groups[-1][0] or groups[-1][0] is None):
            groups[-1] = (groups[-1][0] or mesh, groups[-1][1] + [(name, block)])
        else:
            groups.append((mesh, [(name, block)]))
    if any(m is None for m, _ in groups):
        raise ValueError("pipeline: no layer of the model has parameters on a stage mesh")
    stage_meshes = [m for m, _ in groups]
    check_meshes(list(dict.fromkeys(stage_meshes)))  # type: ignore[arg-type]
    if meshes is not None:
        check_meshes(meshes)
        for m in stage_meshes:
            if m not in meshes:
                raise ValueError(f"pipeline: parameters live on {m!r}, which is not one of the stage meshes")
    return [Stage(Piece(OrderedDict(parts)), m, None, _span(parts)) for m, parts in groups]  # type: ignore[arg-type]


def _span(parts: list[tuple[str, nn.Module]]) -> str:
    return parts[0][0] if len(parts) == 1 else f"{parts[0][0]}..{parts[-1][0]}"


def split_sequential(
    model: Any,
    meshes: Sequence[ProcessMesh],
    split_points: Sequence[str] | None = None,
    *,
    num_chunks: int = 1,
    shard_fn: Callable[[str, nn.Module, ProcessMesh], None] | None = None,
    plan: dict[str, Any] | None = None,
    input_placements: Sequence[Sequence[Placement] | None] | None = None,
    placement: str = "loop",
) -> list[Stage]:
    """Cut ``model`` before each child named in ``split_points`` and place the pieces on meshes.

    There are ``len(meshes) * num_chunks`` pieces; piece ``c`` goes to ``meshes[c % len(meshes)]``
    (``placement="loop"``, for FThenB, 1F1B, Interleaved1F1B, ZBH1), or with ``placement="v"`` and
    two chunks to ``meshes[c]`` and then back up, ``meshes[2p - 1 - c]`` (the V of ZBV: each mesh
    holds a piece of the first half and its mirror in the second, the first mesh the loss).
    Without ``split_points`` the children are divided as evenly as possible. Each piece's
    parameters become DistTensors on its mesh: by ``ap.parallelize(piece, mesh, plan)`` when
    ``plan`` is given, else ``ap.shard_layer(piece, mesh, shard_fn)`` (Replicate by default).
    ``input_placements[c]`` sets piece ``c``'s input layout (see :class:`Stage`).
    """
    from autoparallel.nn import parallelize, shard_layer

    check_meshes(meshes)
    blocks = _blocks(model)
    names = [n for n, _ in blocks]
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"split_sequential: num_chunks must be a positive int, got {num_chunks!r}")
    if placement not in ("loop", "v"):
        raise ValueError(f"split_sequential: placement must be 'loop' or 'v', got {placement!r}")
    if placement == "v" and num_chunks != 2:
        raise ValueError(f"split_sequential: placement='v' places two chunks per mesh (a V), got num_chunks={num_chunks}")
    count = len(meshes) * num_chunks
    starts = _starts(names, split_points, count)
    if input_placements is not None and len(input_placements) != count:
        raise ValueError(f"split_sequential: {len(input_placements)} input_placements for {count} stages")
    pieces = [Piece(OrderedDict(blocks[lo:(starts[c + 1] if c + 1 < count else len(blocks))]))
              for c, lo in enumerate(starts)]
    plans = _stage_plans(pieces, plan)
    stages = []
    for c, piece in enumerate(pieces):
        parts = list(piece.named_children())
        mesh = meshes[v_stage(c, len(meshes)) if placement == "v" else c % len(meshes)]
        off = off_mesh(piece, mesh)
        if off is not None:
            raise ValueError(f"split_sequential: parameter {off[0]} of stage {c} is already on {off[1]!r}, "
                             f"but stage {c} runs on {mesh!r}")
        if plans[c]:
            parallelize(piece, mesh, plans[c])
        else:
            shard_layer(piece, mesh, shard_fn)
        ip = None if input_placements is None else input_placements[c]
        if ip is not None:
            ip = [check_placement(x) for x in ip]
        stages.append(Stage(piece, mesh, ip, _span(parts)))
    return stages


def off_mesh(module: nn.Module, mesh: ProcessMesh) -> tuple[str, ProcessMesh] | None:
    """(name, mesh) of the first parameter of ``module`` laid out on another mesh than ``mesh``,
    or None. (A function of its own: a loop variable left holding a parameter in the caller
    would count as one more holder when the layout asks whether an optimizer may hold it.)"""
    for name, p in module.named_parameters():
        if isinstance(p, DistTensor) and p.process_mesh != mesh:
            return name, p.process_mesh
    return None


class Absent(nn.Identity):
    """Where a stage holds no part of the model's own module (the final norm of a stage before
    the last): the stage's forward passes through it, and a plan's pattern naming the module
    applies only to the stage that holds it."""


def _stage_plans(pieces: Sequence[nn.Module], plan: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each stage's part of ``plan`` (the patterns matching its modules); a pattern matching none raises."""
    if plan is None:
        return [{} for _ in pieces]
    if not isinstance(plan, dict):
        raise TypeError(f"split_sequential: plan must be a dict {{module-name pattern: style}}, got {type(plan).__name__}")
    names = [[n for n, m in piece.named_modules() if not isinstance(m, Absent)] for piece in pieces]
    out = [{k: v for k, v in plan.items() if any(fnmatchcase(n, k) for n in ns)} for ns in names]
    unused = [k for k in plan if not any(k in sub for sub in out)]
    if unused:
        raise ValueError(f"split_sequential: plan patterns {unused} match no layer of any stage")
    return out


def _starts(names: list[str], split_points: Sequence[str] | None, count: int) -> list[int]:
    if len(names) < count:
        raise ValueError(f"split_sequential: {len(names)} layers cannot fill {count} stages")
    if split_points is None:
        base, extra = divmod(len(names), count)
        sizes = [base + (1 if c < extra else 0) for c in range(count)]
        return [sum(sizes[:c]) for c in range(count)]
    points = list(split_points)
    unknown = [p for p in points if p not in names]
    if unknown:
        raise ValueError(f"split_sequential: split points {unknown} are not layers of the model {names}")
    if len(points) != count - 1:
        raise ValueError(
            f"split_sequential: {len(points)} split points {points} make {len(points) + 1} stages, "
            f"but {count} are needed (meshes x num_chunks)"
        )
    idx = [names.index(p) for p in points]
    if idx != sorted(set(idx)) or (idx and idx[0] == 0):
        raise ValueError(f"split_sequential: split points {points} must be increasing and after the first layer {names[0]!r}")
    return [0] + idx


__all__ = ["Absent", "Piece", "Stage", "check_meshes", "split_sequential", "stages_from_annotations"]
