"""``parallelize``: apply a declarative plan ``{module-name pattern: style}`` to a model.

A flat, ordered driver (the torchtitan shape): resolve the tensor-parallel mesh axis, match
every pattern against the module names, check every (module, style) pair — all from metadata,
so a bad plan raises the same error on every rank before anything is converted or any
collective runs — then apply the styles in plan order and replicate every parameter and
buffer the plan did not cover.
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from autoparallel import compat
from autoparallel.memory.meter import outermost_matches
from autoparallel.memory.recomputation import POLICIES
from autoparallel.memory.recomputation import recompute as recompute_module
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.context_parallel import warn_idle_axis
from autoparallel.nn.shard_layer import ParamSharder, watch_batch_split
from autoparallel.nn.styles import ParallelStyle, PlanContext, SequenceParallel
from autoparallel.regions import enable_local_regions

TP_AXIS_NAMES = ("mp", "tp")


def resolve_axis(mesh: ProcessMesh, axis: int | str | None) -> int:
    """The tensor-parallel mesh axis: ``axis``, else the axis named "mp"/"tp", else the only one."""
    if axis is not None:
        try:
            return mesh.axis_index(axis)
        except ValueError as e:
            raise ValueError(f"parallelize: tensor-parallel axis {axis!r}: {e}") from None
    named = [n for n in TP_AXIS_NAMES if n in mesh.dim_names]
    if len(named) == 1:
        return mesh.dim_names.index(named[0])
    if mesh.ndim == 1:
        return 0
    raise ValueError(
        f"parallelize: cannot tell the tensor-parallel axis of a mesh with axes {mesh.dim_names}; "
        f"name one {' or '.join(repr(n) for n in TP_AXIS_NAMES)}, or pass axis="
    )


def close_patterns(pattern: str, names: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` patterns that match some of ``names`` (dotted module names) and read closest
    to ``pattern`` (``difflib``), for a pattern that matches none: the names themselves, the
    names with each numeric part as ``*`` (``layers.*.mlp.gate_proj``), and for a pattern
    starting with ``*`` every name's dotted suffix after ``*.`` (``*.mlp.gate_proj``)."""
    candidates: dict[str, None] = {}  # ordered and unique
    for name in names:
        if not name:
            continue
        parts = name.split(".")
        wild = ".".join("*" if p.isdigit() else p for p in parts)
        candidates[name] = candidates[wild] = None
        if pattern.startswith("*"):
            wild_parts = wild.split(".")
            for i in range(1, len(wild_parts)):
                if wild_parts[i] != "*":
                    candidates["*." + ".".join(wild_parts[i:])] = None
    close = difflib.get_close_matches(pattern, list(candidates), n=2 * n)
    close.sort(key=lambda c: not c.startswith(pattern))  # a name the pattern stops short of first
    out: list[str] = []
    for c in close:
        if not any(fnmatchcase(c, earlier) for earlier in out):  # not ``layers.1.x`` after ``layers.*.x``
            out.append(c)
    return out[:n]


def no_match_message(what: str, pattern: Any, layer: nn.Module, names: list[str]) -> str:
    """``{what} {pattern!r} matches no module of <class>``, then the closest patterns that do
    match (or a sample of the module names when none reads close)."""
    msg = f"parallelize: {what} {pattern!r} matches no module of {type(layer).__name__}"
    close = close_patterns(pattern, names) if isinstance(pattern, str) else []
    if close:
        return msg + f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return msg + f" (module names look like {[n for n in names if n][:8]})"


def match_plan(layer: nn.Module, plan: dict[str, Any]) -> list[tuple[str, str, nn.Module, ParallelStyle]]:
    """``(pattern, name, module, style)`` for every module each pattern matches, in plan order.

    Patterns are ``fnmatch`` patterns over whole dotted module names (``*`` also crosses dots;
    ``""`` is the root module). A pattern matching nothing (``ValueError`` naming the closest
    patterns that match), a value that is not a style, or a module given two parameter-sharding
    styles raises.
    """
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: plan must be a dict {{module-name pattern: style}}, got {type(plan).__name__}")
    modules = list(layer.named_modules())
    out: list[tuple[str, str, nn.Module, ParallelStyle]] = []
    owner: dict[str, str] = {}  # module name -> pattern of its parameter-sharding style
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"parallelize: plan key {pattern!r} is not a module-name pattern (str)")
        if not isinstance(style, ParallelStyle):
            hint = " (SequenceParallel is a class: write SequenceParallel())" if isinstance(style, type) else ""
            raise TypeError(f"parallelize: plan[{pattern!r}] = {style!r} is not a parallel style{hint}")
        hits = [(n, m) for n, m in modules if fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(no_match_message("plan pattern", pattern, layer, [n for n, _ in modules]))
        for name, module in hits:
            if style.shards_parameters:
                if name in owner:
                    raise ValueError(
                        f"parallelize: module {name!r} is matched by {owner[name]!r} and {pattern!r}, "
                        "two styles that both lay out its parameters"
                    )
                owner[name] = pattern
            out.append((pattern, name, module, style))
    return out


def check_ties(matches: list[tuple[str, str, nn.Module, ParallelStyle]], axis_name: str) -> None:
    """A parameter reached from several matched modules (tied) must get one layout from all."""
    seen: dict[int, tuple[str, Any]] = {}
    for _, name, module, style in matches:
        for attr, p in style.param_placements(module).items():
            t = compat.own_parameters(module).get(attr)
            if t is None:
                continue
            where = f"{name}.{attr}" if name else attr
            first = seen.setdefault(id(t), (where, p))
            if first[1] != p:
                raise ValueError(
                    f"parallelize: {where} is tied to {first[0]}; their styles lay it out as {p} and "
                    f"{first[1]} on the tensor-parallel mesh axis {axis_name!r}"
                )


class ModelPlan(dict):  # type: ignore[type-arg]
    """A plan dict (``{pattern: style}``) that also states what must divide by the tp degree.

    ``divisible`` maps a description (``"attention heads (num_attention_heads)"``) to a size;
    ``parallelize`` checks each against the tensor-parallel degree from metadata alone, so every
    rank raises the same ``ValueError`` before anything is laid out. ``ap.plans`` returns these;
    a plain dict works everywhere a plan does.
    """

    def __init__(self, styles: dict[str, Any], divisible: dict[str, int], model: str) -> None:
        super().__init__(styles)
        self.divisible = dict(divisible)
        self.model = model

    def check_degree(self, mesh: ProcessMesh, axis: int) -> None:
        degree = mesh.shape[axis]
        bad = [f"{what} = {n}" for what, n in self.divisible.items() if n % degree]
        if bad:
            raise ValueError(
                f"parallelize: the {self.model} plan needs these sizes to divide by the tensor-parallel "
                f"degree {degree} (mesh axis {mesh.dim_names[axis]!r}): {', '.join(bad)}; use a smaller "
                "tensor-parallel degree, or write your own plan dict (uneven shards are correct, but gather)"
            )


def _seq_dim(plan: dict[str, Any]) -> int | None:
    dims = {s.seq_dim for s in plan.values() if isinstance(s, SequenceParallel)}
    if len(dims) > 1:
        raise ValueError(f"parallelize: SequenceParallel styles disagree on the sequence dim: {sorted(dims)}")
    return dims.pop() if dims else None


def match_recompute(layer: nn.Module, recompute: dict[str, Any] | None) -> list[tuple[nn.Module, Any]]:
    """``(module, policy)`` for the outermost modules each ``recompute`` pattern matches, in
    order (a later pattern overrides an earlier one). ``*`` crosses dots, so ``"blocks.*"`` also
    matches every module inside a block: only the outermost match is recomputed (one region per
    block, not nested ones). A pattern matching nothing (``ValueError`` naming the closest
    patterns that match) or a bad policy raises."""
    if recompute is None:
        return []
    if not isinstance(recompute, dict):
        raise TypeError(f"parallelize: recompute must be a dict {{module-name pattern: policy}}, got {type(recompute).__name__}")
    modules = list(layer.named_modules())
    out: list[tuple[nn.Module, Any]] = []
    for pattern, policy in recompute.items():
        if not (policy is None or callable(policy) or policy in POLICIES):
            raise ValueError(f"parallelize: recompute[{pattern!r}] = {policy!r} is none of {POLICIES} (or a SAC policy callable)")
        if not any(isinstance(pattern, str) and fnmatchcase(n, pattern) for n, _ in modules):
            raise ValueError(no_match_message("recompute pattern", pattern, layer, [n for n, _ in modules]))
        out += [(m, policy) for m in outermost_matches(layer, [pattern]).values()]
    return out


def parallelize(layer: nn.Module, mesh: ProcessMesh, plan: dict[str, Any], *, axis: int | str | None = None,
                recompute: dict[str, Any] | None = None) -> nn.Module:
    """Lay ``layer`` out on ``mesh`` by ``plan``, in place; return ``layer``.

    ``plan`` maps module-name patterns (``"blocks.*.attn.qkv"``) to styles
    (``ColWiseParallel()``, ``RowWiseParallel()``, ``SequenceParallel()``,
    ``VocabParallelEmbedding()``, ``PrepareLayerInput([...])``, ``PrepareLayerOutput([...])``),
    applied in plan order. ``axis`` is the tensor-parallel mesh axis (name or number; default
    the axis named "mp" or "tp", else the only axis). Parameters are Replicate on every other
    mesh axis, and every parameter/buffer the plan does not cover becomes Replicate. Under
    ``SequenceParallel`` styles, row-parallel layers and vocab-parallel embeddings reduce to
    ``Shard(seq_dim)`` (reduce-scatter) instead of Replicate (all-reduce) by default.
    ``recompute`` maps module-name patterns to recompute policies (``"full"``,
    ``"selective"``, ``"none"`` or a torch SAC policy; ``ap.recompute``), e.g.
    ``{"blocks.*": "selective"}``: each matched module's activations are recomputed in backward.
    Raises ``TypeError``/``ValueError`` for a bad plan before converting anything.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"parallelize: layer must be an nn.Module, got {type(layer).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"parallelize: mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    if recompute is None and isinstance(plan, ModelPlan):
        recompute = getattr(plan, "recompute", None) or None  # a plan that also says what to recompute (ap.Plan)
    if axis is None and plan and not any(getattr(s, "uses_tp_axis", True) for s in plan.values()):
        tp = 0  # (only styles with axes of their own, e.g. ContextParallel: no tensor-parallel axis to find)
    else:
        tp = resolve_axis(mesh, axis)
    if isinstance(plan, ModelPlan):
        plan.check_degree(mesh, tp)
    matches = match_plan(layer, plan)
    for _, name, module, style in matches:
        style.check(name, module, mesh, tp)
    check_ties(matches, mesh.dim_names[tp])
    recomputed = match_recompute(layer, recompute)
    ctx = PlanContext(mesh, tp, _seq_dim(plan), ParamSharder(mesh))
    ctx.sharder.check_swappable(layer)  # parameters become DistTensors in place: an optimizer built before sees them
    for _, name, module, style in matches:
        style.apply(name, module, ctx)
    ctx.sharder.replicate_rest(layer)
    watch_batch_split(layer, mesh)
    warn_idle_axis(mesh, plan.values())
    enable_local_regions(layer)
    for module, policy in recomputed:
        recompute_module(module, policy)
    return layer
