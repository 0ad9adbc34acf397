"""``ap.auto_parallel``: price every plan of a small, complete family on the recorded step; keep the best.

The step is recorded once on fake tensors (``autoparallel.auto.trace``). The candidates are every
factorisation of the world into data x tensor parallel (tensor-parallel degrees up to 8 that
divide the world), for each: the tensor-parallel plan (``ap.plans``' for a model family it
recognises, else Megatron pairs found on the step itself — a Linear whose split output reaches
another Linear's input split on its features with no collective in between — plus a tied or
vocabulary-sized embedding vocab-parallel and its head column-parallel, or the vocabulary left
whole), with and without sequence parallelism, ZeRO stage 0-3 on the data axis and recompute of
the repeated blocks (none, all, or under a budget the fewest blocks that fit it). Each (mesh,
tensor-parallel plan) is replayed once on layouts (``autoparallel.auto.simulate``: the eager
engine's own rules, choices and reshard plans); ZeRO and recompute change known terms.
Predicted time = compute (FLOPs / throughput + other bytes / bandwidth) + communication (per
collective: latency + bytes / bandwidth, no overlap assumed) + the optimizer's update (on the
rank's shard from ZeRO-1 on); peak memory = parameters and optimizer states after ZeRO + the
most bytes alive at once in the replayed step (activations, what autograd saves, gradients,
moved copies; recompute drops a block's saved tensors until its backward) or at the optimizer's
step (gradients and its buckets), whichever is more (``autoparallel.auto.price``). With
``pipeline=True`` a pipeline axis comes first: the blocks cut into the stages whose slowest is
fastest, 1F1B over the micro-batch counts the batch allows (``price.price_pipeline``), applied
by ``ap.pipeline.split_at_blocks`` or ``decoder_stages``. Every decision reads global metadata
only: every rank gets the same plan.
"""

from __future__ import annotations

import itertools
import re
import time
import warnings
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from autoparallel.auto.plan import Candidate, Plan, Prediction, parse_bytes
from autoparallel.auto.price import price_pipeline, price_step, state_factor_of
from autoparallel.auto.profile import resolve_profile
from autoparallel.auto.repeat import record, signature
from autoparallel.auto.simulate import Simulation, param_parts, simulate
from autoparallel.auto.trace import Step, pattern
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.parallelize import ModelPlan, match_plan
from autoparallel.nn.styles import ColWiseParallel, RowWiseParallel, SequenceParallel, VocabParallelEmbedding
from autoparallel.pipeline.by_blocks import why_not_cut
from autoparallel.pipeline.decoder import is_decoder
from autoparallel.placement import Placement, Replicate, Shard


# ---- plan keys ---------------------------------------------------------------------------------
def copies_pattern(name: str, modules: dict[str, nn.Module], signatures: dict[str, Any] | None = None) -> str:
    """``pattern(name)`` (``layers.0.mlp.fc1`` -> ``layers.*.mlp.fc1``) where every module it
    matches is ``name``'s copy in another block (the same name but for its indices, the same
    class and shapes); else ``name`` itself. ``*`` crosses dots and matches the root, so the
    pattern of a top-level index (``"2"`` -> ``"*"``) or of an index in a list of unlike modules
    would style modules it was never priced for. ``signatures``: the blocks' signatures
    (``repeat.signature``) by name, kept across the calls for one model."""
    wild = pattern(name)
    if wild == name:
        return name
    exact = re.compile("\\.".join(r"\d+" if p == "*" else re.escape(p) for p in wild.split(".")) + "$")
    sigs = {} if signatures is None else signatures

    def sig(n: str) -> Any:
        if n not in sigs:
            sigs[n] = signature(modules[n])
        return sigs[n]

    mine = sig(name)
    if all(exact.match(n) and sig(n) == mine for n in modules if fnmatchcase(n, wild)):
        return wild
    return name


def pair_patterns(a: str, b: str, modules: dict[str, nn.Module],
                  signatures: dict[str, Any] | None = None) -> tuple[str, str]:
    """Plan keys of a column/row pair found in one block: both as their copies' patterns when
    the two lie in the same innermost indexed block (the pair repeats in every copy), else both
    exact names."""
    pa, pb = copies_pattern(a, modules, signatures), copies_pattern(b, modules, signatures)
    if pa != a and pb != b and pa != pb and _block_of(a) == _block_of(b):
        return pa, pb
    return a, b


def blocks_pattern(blocks: list[str], modules: dict[str, nn.Module]) -> list[str]:
    """Recompute keys for ``blocks``: their common pattern when its outermost matches are exactly
    the blocks, else the block names."""
    wild = pattern(blocks[0])
    inside = tuple(b + "." for b in blocks)
    if all(n in blocks or n.startswith(inside) for n in modules if fnmatchcase(n, wild)):
        return [wild]
    return list(blocks)


def _block_of(name: str) -> str | None:
    """``name`` up to its last index (``layers.0.mlp.fc1`` -> ``layers.0``), or None."""
    parts = name.split(".")
    last = max((i for i, p in enumerate(parts) if p.isdigit()), default=None)
    return None if last is None else ".".join(parts[:last + 1])


# ---- tensor-parallel plans ---------------------------------------------------------------------
def family_plans(model: nn.Module) -> list[tuple[str, ModelPlan, bool]]:
    """``ap.plans``' plans for a model family it recognises: ``[(label, plan, sp)]``."""
    from autoparallel import plans
    out: list[tuple[str, ModelPlan, bool]] = []
    for fn in (plans.llama, plans.mixtral, plans.gpt2, plans.bert, plans.vit):
        try:
            out.append((fn.__name__, fn(model), False))
        except (TypeError, ValueError, AttributeError):
            continue
        try:
            out.append((f"{fn.__name__}+sp", fn(model, sp=True), True))  # type: ignore[call-arg]
        except (TypeError, ValueError, AttributeError):
            pass
        break
    return out


def found_plans(model: nn.Module, step: Step) -> list[tuple[str, ModelPlan, bool]]:
    """Megatron pairs found on the step (see the module docstring): ``[(label, plan, sp)]``."""
    modules = dict(model.named_modules())
    linears = [n for n, c in step.modules.items() if isinstance(modules.get(n), nn.Linear)]
    mesh = ProcessMesh.simulated((2,), ["mp"])
    r = (Replicate(),)
    styles: dict[str, Any] = {}
    divisible: dict[str, int] = {}
    memo: dict[Any, Any] = {}  # the replays' shared decisions (the same call on the same layouts)
    sigs: dict[str, Any] = {}  # the modules' signatures, by name (``copies_pattern``)
    seen_patterns: set[str] = set()
    paired: set[str] = set()
    for i, a in enumerate(linears):
        wa = copies_pattern(a, modules, sigs)
        if a in paired or wa in seen_patterns:
            continue
        col = {f"{a}.weight": (Shard(0),), f"{a}.bias": (Shard(0),)}
        sim = simulate(step, mesh, col, r, {a: (Replicate(), None)}, memo=memo)
        b = next((n for n in linears[i + 1:] if n not in paired and _split_features(sim.edges.get(("in", n)))), None)
        if b is None:
            seen_patterns.add(wa)  # (its copies pair no better)
            continue
        row = {**col, f"{b}.weight": (Shard(1),)}
        sim = simulate(step, mesh, row, r, {a: (Replicate(), None), b: (Shard(-1), Replicate())}, memo=memo)
        if any(not c.backward and c.module != b for c in sim.collectives):
            seen_patterns.add(wa)
            continue  # something between needs the whole value: no pair
        paired |= {a, b}
        pa, pb = pair_patterns(a, b, modules, sigs)
        seen_patterns |= {pa, pb}
        styles[pa] = ColWiseParallel()
        styles[pb] = RowWiseParallel()
        la, lb = modules[a], modules[b]
        assert isinstance(la, nn.Linear) and isinstance(lb, nn.Linear)
        divisible[f"{pa} out_features"] = la.out_features
        divisible[f"{pb} in_features"] = lb.in_features
    if not styles:
        return []
    # the embedding tied to a head (or the largest embedding) vocab-parallel, its head column-parallel
    for name, m in modules.items():
        if isinstance(m, nn.Embedding) and name in step.modules and m.max_norm is None and not m.sparse:
            head = next((n for n in linears if modules[n].weight is m.weight and n not in paired), None)  # type: ignore[union-attr]
            if head is not None:
                styles[name] = VocabParallelEmbedding()
                styles[head] = ColWiseParallel()
                divisible[f"{name} num_embeddings"] = m.num_embeddings
    plan = ModelPlan(styles, divisible, "found")
    out = [("megatron", plan, False)]
    norms = [n for n, c in step.modules.items() if isinstance(modules.get(n), (nn.LayerNorm, nn.RMSNorm))]
    if norms:
        sp_styles = dict(styles)
        for n in norms:
            sp_styles[copies_pattern(n, modules, sigs)] = SequenceParallel()
        out.append(("megatron+sp", ModelPlan(sp_styles, divisible, "found"), True))
    return out


def whole_vocabulary(model: nn.Module, step: Step, label: str, plan: ModelPlan, sp: bool) -> tuple[str, ModelPlan, bool] | None:
    """``plan`` with its vocabulary-parallel input embedding and the column-parallel head over
    that vocabulary (outside the repeated blocks) left whole on the tensor axis; None when it
    splits no vocabulary. At a small vocabulary the split costs more collectives (the
    embedding's all-reduce, the loss's reductions) than the whole weight's gradient all-reduce;
    the pricing decides."""
    blocks = tuple(b + "." for b in step.blocks())
    if not blocks:
        return None
    matches = match_plan(model, plan)
    vocab = {m.num_embeddings for _, _, m, st in matches if isinstance(st, VocabParallelEmbedding) and isinstance(m, nn.Embedding)}
    if not vocab:
        return None
    drop = {pat for pat, name, m, st in matches
            if not name.startswith(blocks) and (isinstance(st, VocabParallelEmbedding) or (
                isinstance(st, ColWiseParallel) and isinstance(m, nn.Linear) and m.out_features in vocab))}
    if any(name.startswith(blocks) for pat, name, _, _ in matches if pat in drop):
        return None  # (a pattern reaching into the blocks too)
    styles = {k: v for k, v in plan.items() if k not in drop}
    divisible = {k: v for k, v in plan.divisible.items() if not ("vocab" in k or "num_embeddings" in k)}
    return f"{label}, vocabulary whole", ModelPlan(styles, divisible, plan.model), sp


def _split_features(spec: Any) -> bool:
    return spec is not None and len(spec.shape) >= 1 and any(
        isinstance(p, Shard) and p.dim == len(spec.shape) - 1 for p in spec.placements)


# ---- pricing ------------------------------------------------------------------------------------
def _annotations(model: nn.Module, mesh: ProcessMesh | None) -> tuple[dict[str, tuple[Placement, ...]], ProcessMesh | None]:
    """The parameters the user laid out already (``ap.shard_tensor``): their placements, kept
    fixed, and the mesh they share, which the search then keeps (``ValueError`` on several meshes,
    a mesh over ranks out of order, or a ``mesh=`` other than theirs)."""
    from autoparallel.engine import layout
    from autoparallel.engine.dtensor import DistTensor

    fixed: dict[str, tuple[Placement, ...]] = {}
    theirs: ProcessMesh | None = None
    for name, p in model.named_parameters():
        if not isinstance(p, DistTensor):
            continue
        spec = layout.spec_of(p)
        if theirs is not None and spec.mesh != theirs:
            raise ValueError(f"ap.auto_parallel: parameters laid out by hand sit on two meshes ({theirs} and "
                             f"{spec.mesh}, {name}); the search keeps one mesh: lay them out on one")
        theirs = spec.mesh
        fixed[name] = tuple(spec.placements)
    if theirs is None:
        return fixed, mesh
    if mesh is not None and mesh != theirs:
        raise ValueError(f"ap.auto_parallel: mesh={mesh} differs from the mesh {theirs} the model's parameters are "
                         "laid out on; pass that mesh (or none)")
    if list(theirs.process_ids) != list(range(theirs.size)):
        raise ValueError(f"ap.auto_parallel: the parameters laid out by hand sit on {theirs}, whose ranks are not "
                         "0 .. n-1 in order; the plan's mesh is: lay them out on ProcessMesh(arange(n).reshape(shape))")
    return fixed, theirs


def _without(plan: ModelPlan, model: nn.Module, fixed: dict[str, Any]) -> ModelPlan:
    """``plan`` less the modules that hold a parameter laid out by hand: a pattern matching one of
    them is replaced by the names of the other modules it matches (they keep their style)."""
    if not fixed:
        return plan

    def holds_fixed(name: str, module: nn.Module) -> bool:
        return any((f"{name}.{n}" if name else n) in fixed for n, _ in module.named_parameters())

    matches = match_plan(model, plan)
    touched = {pat for pat, name, module, _ in matches if holds_fixed(name, module)}
    styles: dict[str, Any] = {}
    for pat, style in plan.items():
        if pat not in touched:
            styles[pat] = style
            continue
        for p, name, module, _ in matches:
            if p == pat and not holds_fixed(name, module):
                styles[name] = style
    return ModelPlan(styles, plan.divisible, plan.model)


def _placements(model: nn.Module, plan: ModelPlan | None, mesh: ProcessMesh, tp: int | None) -> tuple[dict[str, tuple[Placement, ...]], dict[str, Any]]:
    """Each parameter's placements and each module's io layouts under ``plan`` on ``mesh``."""
    params: dict[str, tuple[Placement, ...]] = {}
    io: dict[str, Any] = {}
    if plan is None or tp is None:
        return params, io
    seq = next((s.seq_dim for s in plan.values() if isinstance(s, SequenceParallel)), None)
    for _, name, module, style in match_plan(model, plan):
        for attr, p in style.param_placements(module).items():
            if getattr(module, attr, None) is not None:
                pl: list[Placement] = [Replicate()] * mesh.ndim
                pl[tp] = p
                params[f"{name}.{attr}" if name else attr] = tuple(pl)
        into, out = style.io_layouts(module, seq)
        old = io.get(name, (None, None))
        io[name] = (into if into is not None else old[0], out if out is not None else old[1])
    # a parameter tied to another (an LM head's weight) is recorded under its first name
    return params, io


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- the search ---------------------------------------------------------------------------------
def auto_parallel(model: nn.Module, world: int | None = None, example: Any = None, loss: Callable[..., Any] | None = None,
                  optimizer: Any = "adamw", memory_budget: Any = None, mesh: ProcessMesh | None = None,
                  profile: Any = None, max_tp: int = 8, verbose: bool = False, extrapolate: bool = True,
                  pipeline: bool = False, max_pp: int = 8) -> Plan:
    """Find a parallel plan for ``model`` on ``world`` ranks (see the module docstring).

    ``example``: one global batch as the model takes it (``(x, y)`` with ``loss=fn`` called as
    ``fn(model(x), y)``; a dict of keyword arguments for ``transformers`` models with labels; fake
    or meta tensors work). ``optimizer``: ``"adamw"``, ``"sgd"`` or the optimizer (its state size).
    ``memory_budget``: per rank (``"70GiB"``, bytes). ``mesh``: fix the mesh (its shape and axis
    names ``pp`` / ``dp`` / ``mp``) instead of choosing one. ``profile``: ``"local"`` (this machine,
    measured), ``"h100"``, or an ``ap.auto.Profile``. ``extrapolate``: a model with N >= 4 identical
    blocks is recorded with two and three of them and priced for N (exact for identical blocks;
    ``autoparallel.auto.repeat``); False records every block. ``pipeline``: also price a pipeline
    axis (``pp``, up to ``max_pp`` stages, 1F1B) cutting the model between its repeated blocks; a
    plan with one is run by ``pipe.step`` (``Plan.apply``), not by calling the model, so it is
    searched only when asked (or when ``mesh`` has a ``pp`` axis). Returns an ``ap.Plan``; raises ``ValueError``
    (the same on every rank, before any collective) when the model cannot be traced, no mesh fits
    the world, or no plan fits the budget (naming the smallest that would).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ap.auto_parallel: model must be an nn.Module, got {type(model).__name__}")
    if example is None:
        raise ValueError("ap.auto_parallel: pass example= (one global batch as the model takes it)")
    if mesh is not None and not isinstance(mesh, ProcessMesh):
        raise TypeError(f"ap.auto_parallel: mesh must be None or an ap.ProcessMesh, got {type(mesh).__name__}")
    fixed, mesh = _annotations(model, mesh)
    if world is None:
        world = mesh.size if mesh is not None else None
    if world is None:
        from autoparallel.runtime.world import get_world_size
        world = get_world_size()
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"ap.auto_parallel: world must be a positive number of ranks, got {world!r}")
    if mesh is not None and mesh.size != world:
        raise ValueError(f"ap.auto_parallel: mesh {mesh} has {mesh.size} ranks for a world of {world}")
    budget = parse_bytes(memory_budget)
    state_factor = state_factor_of(optimizer)
    started = time.perf_counter()
    recording = record(model, example, loss, extrapolate)  # (before the profile's collectives: an untraceable step raises first)
    step = recording.step
    prof = resolve_profile(profile, world)
    tp_plans = [(label, _without(tp_plan, model, fixed), sp)
                for label, tp_plan, sp in family_plans(model) or found_plans(model, recording.short)]
    tp_plans += [v for t in tp_plans if (v := whole_vocabulary(model, step, *t)) is not None]
    if mesh is not None and "pp" in mesh.dim_names:
        pipeline = True
    meshes = _meshes(mesh, world, max_tp, max_pp if pipeline else 1)
    seq_len = _seq_len(step)
    blocks = step.blocks()
    modules = dict(model.named_modules())
    pipe_why = _unsplittable(model, blocks) if any(pp > 1 for pp, _, _ in meshes) else None
    if pipe_why is not None:
        if mesh is not None:
            raise ValueError(f"ap.auto_parallel: the mesh's pipeline axis cannot be used: {pipe_why}")
        warnings.warn(f"ap.auto_parallel: no pipeline plan was priced: {pipe_why}", stacklevel=2)
        meshes = [m for m in meshes if m[0] == 1]
    uses = param_parts(recording.short) if any(pp > 1 for pp, _, _ in meshes) else {}
    rows = _batch_rows(step)
    memo: dict[Any, Any] = {}  # decisions shared by the replays (same mesh, same layouts: same choice)
    sims: dict[tuple[int, int, str], Simulation] = {}  # one replay per (data, tensor, tensor plan)
    priced: list[tuple[float, float, Candidate, Plan]] = []
    for pp, dp, tp in meshes:
        options: list[tuple[str, ModelPlan | None, bool]] = [("replicated", None, False)] if tp == 1 else list(tp_plans)
        for label, tp_plan, sp in options:
            if tp_plan is not None and any(n % tp for n in tp_plan.divisible.values()):
                continue
            if sp and (seq_len is None or seq_len % tp):
                continue
            shape, names = _mesh_of(dp, tp)
            dp_axis = names.index("dp") if "dp" in names else None
            tp_axis = names.index("mp") if "mp" in names else None
            sim_mesh = ProcessMesh.simulated(shape, names)
            params, io = _placements(model, tp_plan, sim_mesh, tp_axis)
            params.update(fixed)  # the user's own layouts stay as they are
            inputs = tuple(Shard(0) if a == dp_axis else Replicate() for a in range(len(shape)))
            key = (dp, tp, label)
            if key not in sims:
                sims[key] = recording.simulate(sim_mesh, params, inputs, io, tp_axis if tp_axis is not None else 0, memo)
            sim = sims[key]
            styles = dict(tp_plan) if tp_plan is not None else {}
            divisible = tp_plan.divisible if tp_plan is not None else {}
            tp_name = f"dp{dp} x tp{tp}" + (f" {label}" if tp > 1 else "")
            if pp > 1:  # a pipeline axis first: 1F1B over the micro-batch counts the batch allows
                for zero, again in itertools.product((0, 1, 2) if dp > 1 else (0,), (False, True)):
                    found = [r for m in (pp, 2 * pp, 4 * pp, 8 * pp) if rows is not None and rows % (dp * m) == 0
                             if (r := price_pipeline(step, sim, uses, shape, dp_axis, tp_axis, params, zero, again,
                                                     state_factor, prof, pp, m)) is not None]
                    if not found:
                        continue
                    pred, cut = min(found, key=lambda r: r[0].time_s)
                    name = (f"pp{pp} x {tp_name}" + (f" zero{zero}" if zero else "") + (" recompute" if again else "")
                            + f" (1F1B, {cut.microbatches} micro-batches)")
                    pipe = {"stages": pp, "microbatches": cut.microbatches, "schedule": "1F1B",
                            "blocks": blocks[0].rsplit(".", 1)[0], "starts": list(cut.starts)}
                    plan = Plan(styles, (pp, *shape), ["pp", *names], zero,
                                {b: "full" for b in blocks_pattern(blocks, modules)} if again else {},
                                divisible, pred, None, "", "auto", pipe)
                    feasible = budget is None or pred.memory_bytes <= budget
                    priced.append((pred.time_s, 2 + (tp > 1) + zero + again, Candidate(name, pred, feasible), plan))
                continue
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                def price(k: int, zero: int = zero) -> Prediction:  # k of the blocks recomputed
                    return price_step(step, sim, shape, dp_axis, tp_axis, params, zero, k / max(1, len(blocks)),
                                      state_factor, prof)
                counts = [0, len(blocks)] if blocks else [0]
                if budget is not None and len(counts) == 2 and price(0).memory_bytes > budget >= price(counts[1]).memory_bytes:
                    # recompute as a per-block choice: the fewest blocks that bring the peak within the budget
                    counts.insert(1, next(k for k in range(1, len(blocks) + 1) if price(k).memory_bytes <= budget))
                for k in dict.fromkeys(counts):
                    pred = price(k)
                    rec = "" if k == 0 else " recompute" if k == len(blocks) else f" recompute {k}/{len(blocks)}"
                    name = tp_name + (f" zero{zero}" if zero else "") + rec
                    feasible = budget is None or pred.memory_bytes <= budget
                    recompute = ({} if k == 0 else {b: "full" for b in blocks_pattern(blocks, modules)} if k == len(blocks)
                                 else {b: "full" for b in sorted(blocks, key=_index)[:k]})
                    plan = Plan(styles, shape, names, zero, recompute, divisible, pred, None, "", "auto")
                    # ties: fewer mesh axes, lower ZeRO stage, less recompute (simpler plans first)
                    simplicity = (tp > 1) + zero + k / max(1, len(blocks))
                    priced.append((pred.time_s, simplicity, Candidate(name, pred, feasible), plan))
    if not priced:  # (every mesh has a tensor-parallel axis: a given mesh, or max_tp excluding 1)
        if not tp_plans:
            why = ("no tensor-parallel plan was found for this model (no known family, and no column/row-parallel "
                   "pairs of Linears in its step)")
        else:
            sizes = sorted({f"{k} = {v}" for _, tp_plan, _ in tp_plans if tp_plan is not None
                            for k, v in tp_plan.divisible.items()})
            why = f"the sizes its tensor-parallel plans split ({', '.join(sizes)}) do not divide by it"
        on = (f"the given mesh's tensor-parallel axis of {meshes[0][2]}" if mesh is not None
              else f"every mesh of {world} ranks with a tensor-parallel axis")
        raise ValueError(f"ap.auto_parallel: no plan for {on}: {why}; pass mesh=None (or a mesh without a "
                         "tensor-parallel axis), or lay the tensor-parallel part out by hand (ap.parallelize)")
    priced.sort(key=lambda x: (not x[2].feasible, x[0], x[1]))
    best = priced[0]
    if not best[2].feasible:
        smallest = min(priced, key=lambda x: x[2].prediction.memory_bytes)
        raise ValueError(
            f"ap.auto_parallel: no plan fits memory_budget={memory_budget!r} per rank; the smallest predicted "
            f"peak is {smallest[2].prediction.memory_bytes / 2**20:.1f} MiB ({smallest[2].name}); raise the budget "
            "or use more ranks")
    plan = best[3]
    plan.candidates = [c for _, _, c, _ in priced]
    seconds = time.perf_counter() - started
    plan.why = (f"{best[2].name}: the least predicted step time of {len(priced)} candidates"
                + (f", {len(fixed)} parameters laid out by hand kept" if fixed else "")
                + ""
                + (f" within {memory_budget} per rank" if budget is not None else "")
                + f" (profile {prof.name}; searched in {seconds:.1f} s)")
    if verbose:
        print(plan)
    return plan


def _meshes(mesh: ProcessMesh | None, world: int, max_tp: int, max_pp: int) -> list[tuple[int, int, int]]:
    """(pipeline, data, tensor) degrees to search: the given mesh's, or every factorisation of the
    world (tensor degree up to ``max_tp``, pipeline up to ``max_pp``)."""
    if mesh is None:
        return [(pp, world // pp // tp, tp) for pp in _divisors(world) if pp <= max_pp
                for tp in _divisors(world // pp) if tp <= max_tp]
    names = list(mesh.dim_names)
    if mesh.ndim == 1 and names[0] not in ("pp", "mp", "tp"):
        return [(1, world, 1)]  # one axis of any other name: data parallel
    size = dict(zip(names, mesh.shape))
    known = [n for n in ("pp", "dp", "mp", "tp") if n in names]
    if len(known) != len(names) or ("mp" in names and "tp" in names) or ("pp" in names and names[0] != "pp"):
        raise ValueError(f"ap.auto_parallel: mesh axes {names} are not a choice of ['pp', 'dp', 'mp'] in that order "
                         "('pp' first, 'tp' for 'mp' also understood)")
    return [(size.get("pp", 1), size.get("dp", 1), size.get("mp", size.get("tp", 1)))]


def _unsplittable(model: nn.Module, blocks: list[str]) -> str | None:
    """Why ``model`` cannot be cut into pipeline stages between its repeated blocks, or None."""
    if not blocks:
        return "the model has no stack of repeated blocks to cut between"
    parent = blocks[0].rsplit(".", 1)[0] if "." in blocks[0] else ""
    if not parent or not isinstance(model.get_submodule(parent), (nn.ModuleList, nn.Sequential)):
        return (f"its repeated blocks ({blocks[0]}, ...) are not the items of an nn.ModuleList or nn.Sequential "
                "inside the model (a model that is itself an nn.Sequential: ap.pipeline.split_sequential cuts it)")
    if is_decoder(model):
        return None  # ap.pipeline.decoder_stages splits it
    return why_not_cut(model, parent)


def _batch_rows(step: Step) -> int | None:
    """The example batch's rows (dim 0 of its first input)."""
    for r in step.inputs:
        shape = step.metas[r.id].shape
        if shape:
            return shape[0]
    return None


def _index(block: str) -> int:
    """A block's index in its stack (``blocks.3`` -> 3)."""
    return int(block.rsplit(".", 1)[-1])


def _mesh_of(dp: int, tp: int) -> tuple[tuple[int, ...], list[str]]:
    if tp == 1:
        return (dp,), ["dp"]
    if dp == 1:
        return (tp,), ["mp"]
    return (dp, tp), ["dp", "mp"]


def _seq_len(step: Step) -> int | None:
    """The example's sequence length (dim 1 of its first input of two or more dims)."""
    for r in step.inputs:
        shape = step.metas[r.id].shape
        if len(shape) >= 2:
            return shape[1]
    return None
