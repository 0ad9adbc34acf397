"""Choosing among a rule's strategies: the price of moving each input, and the cheapest strategy.

Pure metadata, shared by the eager engine (one op at a time) and the plan search
(``autoparallel.auto``: a whole step on a simulated mesh), so both choose alike. A strategy's
cost is lexicographic: bytes moved (each collective also pays ``LATENCY_BYTES``, and a local fill
``S -> P`` the all-gather it stands for), inputs changed, largest local output bytes. An op
making a laid-out parameter's gradient (the engine reads it off the running backward node) also
pays for moving its output to the parameter's layout, which the optimizer would otherwise do.

Where a strategy taking every input as it is would carry a Partial input into more Partial
outputs, the choice weighs when to reduce: a Partial value is reduced some time, and an op only
chooses when, and into how many values. Then each Partial output is priced at its eventual
reduction plus ``REDUCE_LATENCY_BYTES`` per collective (a collective's start-up: latency, not
bandwidth, bounds the small reductions a step is full of); a Partial input carried through is
credited with the same; one reduced now by the move is credited with the reduction's bytes
only; and every collective a move issues pays its start-up. So a layer norm's backward given a
Partial output gradient reduces it once, as Megatron's ``f`` does, instead of carrying three
Partial values (its input gradient and its weight's and bias's gradients: two reductions more).
An op carrying as many Partial values as it takes (pointwise ops, views, sums, an embedding's
backward into its table's gradient, which rides the optimizer's bucket) carries them as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from autoparallel.compat import metadata_cache, whole
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec, itemsize
from reshard.crossmesh import CrossMeshPlan, best_price, plan_best
from reshard.plan import ALL_GATHER, FILL, LOCAL_KINDS, Plan, Step, step_bytes
from reshard.planner import LATENCY_BYTES
from spmd_rules.base import Strategy, TensorMeta

# A collective's start-up, in bytes of bandwidth, when choosing whether a Partial value is
# reduced now or carried: about 0.1 ms at 1.3 GB/s (gloo on a host) or 10 us at 13 GB/s.
REDUCE_LATENCY_BYTES = 1 << 17


def plan_to(spec: DistSpec, req: tuple[Any, ...]) -> Plan | CrossMeshPlan | None:
    """The plan taking ``spec`` to placements ``req`` (default shard order); None if none needed.
    Not cached here: the planner caches what it searched, and builds one-step plans directly."""
    dst = spec.with_placements(req) if tuple(req) != spec.placements or spec.shard_order else spec
    return None if dst == spec else plan_best(spec, dst)


@lru_cache(maxsize=8192)
def plan_price(spec: DistSpec, req: tuple[Any, ...]) -> int | None:
    """Bytes (plus latency terms) of moving ``spec`` to ``req`` by the plan ``plan_to`` would
    make (priced without building it); None if nothing moves."""
    dst = spec.with_placements(req) if tuple(req) != spec.placements or spec.shard_order else spec
    if dst == spec:
        return None
    nbytes, steps, communicates = best_price(spec, dst)
    return nbytes + _deferred_price(steps) + (LATENCY_BYTES if communicates else 0)


def _deferred_price(steps: tuple[Step, ...]) -> int:
    """What a plan's fills (``S -> P``, local) leave to pay: a Partial some later step must reduce,
    n x the piece in memory and compute. Priced as the all-gather a fill replaces (with its latency
    term), so an op is not steered into a partial layout by a move that is free only now
    (``ap.reshard`` to a Partial target still runs the fill)."""
    price = 0
    for s in steps:
        if s.kind == FILL:  # an all-gather's bytes depend on its source only
            price += whole(step_bytes(Step(ALL_GATHER, s.axis, s.src, s.dst))[1].max()) + LATENCY_BYTES
    return price


def as_is(spec: DistSpec, req: tuple[Any, ...]) -> bool:
    """Whether ``spec`` already has placements ``req`` (in the default shard order)."""
    return not spec.shard_order and tuple(req) == tuple(spec.placements)


def cost(s: Strategy, specs: Sequence[DistSpec], mesh_shape: tuple[int, ...],
         out_metas: tuple[TensorMeta | None, ...], pending: bool = False,
         target: DistSpec | None = None) -> tuple[int, int, int]:
    """(bytes moved, inputs changed, largest local output bytes): lexicographic. ``pending``:
    the bytes also count the reductions left pending and every collective's start-up.
    ``target``: the layout of the parameter whose gradient the op makes (in a backward); the
    bytes also count moving the output there (``toward``)."""
    moved = changed = 0
    owing = partial_axes(specs) if pending else ()
    for spec, req in zip(specs, s.inputs):
        price = plan_price(spec, req)
        if price is not None:
            changed += 1
            moved += price
            if owing:
                moved += REDUCE_LATENCY_BYTES * plan_collectives(spec, tuple(req))
        if owing and spec.has_partial:
            moved -= _settled(spec, tuple(req), price)
    compute = 0
    for m, pl in zip(out_metas, s.outputs):
        if m is not None:
            compute += largest_local_numel(m.shape, pl, mesh_shape) * itemsize(m.dtype)
            if owing and any(isinstance(pl[a], Partial) for a in owing):
                moved += pending_price(DistSpec(specs[0].mesh, tuple(pl), m.shape, m.dtype), owing)
    if target is not None and specs:
        moved += toward(s, specs[0].mesh, out_metas, target)
    return moved, changed, compute


def toward(s: Strategy, mesh: Any, out_metas: tuple[TensorMeta | None, ...], target: DistSpec) -> int:
    """What moving the op's output to ``target``, the layout of the parameter it is the
    gradient of, costs on the mesh axes where the output is not Partial (0 where the output is
    not that gradient's shape; a Partial axis is the optimizer's bucketed reduction either way).
    A row-sharded gradient of a replicated table pays the all-gather the optimizer would issue;
    a replicated gradient of a row-sharded table nothing (a slice)."""
    outs = [(m, pl) for m, pl in zip(out_metas, s.outputs) if m is not None]
    if len(outs) != 1 or target.mesh != mesh or target.has_partial:
        return 0
    m, pl = outs[0]
    if m.shape != target.shape:
        return 0
    settled = tuple(t if isinstance(p, Partial) else p for p, t in zip(pl, target.placements))
    return plan_price(DistSpec(mesh, settled, m.shape, m.dtype), target.placements) or 0


def multiplies(s: Strategy, specs: Sequence[DistSpec], out_metas: tuple[TensorMeta | None, ...]) -> bool:
    """Whether ``s`` leaves more Partial values than it carries in: more outputs Partial on an
    axis where an input is than inputs it takes Partial as they are (a layer norm's backward
    carrying a Partial output gradient into three Partial gradients)."""
    owing = partial_axes(specs)
    if not owing:
        return False
    carried = sum(1 for spec, req in zip(specs, s.inputs)
                  if spec.has_partial and any(isinstance(req[a], Partial) for a in owing))
    made = sum(1 for m, pl in zip(out_metas, s.outputs)
               if m is not None and any(isinstance(pl[a], Partial) for a in owing))
    return made > carried


def partial_axes(specs: Sequence[DistSpec]) -> tuple[int, ...]:
    """The mesh axes on which some of ``specs`` is Partial: where an op's outputs may carry what
    its inputs owe (a Partial made on another axis, by rows sharded there, is what data
    parallelism is; its reduction is the optimizer's, not this op's choice)."""
    return tuple(sorted({a for spec in specs if spec.has_partial
                         for a, p in enumerate(spec.placements) if isinstance(p, Partial)}))


@lru_cache(maxsize=8192)
def pending_price(spec: DistSpec, axes: tuple[int, ...] | None = None) -> int:
    """What reducing the Partial axes of ``spec`` (those among ``axes``, default all) costs, a
    start-up per collective included (0 if none)."""
    if not spec.has_partial:
        return 0
    to = _reduced(spec, axes)
    price = plan_price(spec, to)
    return 0 if price is None else price + REDUCE_LATENCY_BYTES * plan_collectives(spec, to)


def _settled(spec: DistSpec, req: tuple[Any, ...], price: int | None) -> int:
    """The credit of a Partial input: its pending reduction where the strategy carries it (every
    Partial axis taken as it is); where the move reduces it, the bytes that reduction would have
    moved (at most what the move paid), the move's start-up left to pay."""
    owed = pending_price(spec)
    if all(req[a] == p for a, p in enumerate(spec.placements) if isinstance(p, Partial)):
        return owed
    return min(owed - REDUCE_LATENCY_BYTES * plan_collectives(spec, _reduced(spec)), price or 0)


def _reduced(spec: DistSpec, axes: tuple[int, ...] | None = None) -> tuple[Any, ...]:
    """``spec``'s placements with its Partial axes (those among ``axes``, default all) reduced."""
    return tuple(Replicate() if isinstance(p, Partial) and (axes is None or a in axes) else p
                 for a, p in enumerate(spec.placements))


@lru_cache(maxsize=8192)
def plan_collectives(spec: DistSpec, req: tuple[Any, ...]) -> int:
    """How many collectives the plan ``plan_to`` would make issues (a point-to-point move: one),
    a fill counted as the all-gather it stands for (``_deferred_price``)."""
    dst = spec.with_placements(req) if tuple(req) != spec.placements or spec.shard_order else spec
    if dst == spec:
        return 0
    _, steps, communicates = best_price(spec, dst)
    n = sum(1 for st in steps if st.kind not in LOCAL_KINDS or st.kind == FILL)
    return n if n or not communicates else 1


def cheapest(strategies: Sequence[Strategy], specs: Sequence[DistSpec], mesh_shape: tuple[int, ...],
             out_metas: tuple[TensorMeta | None, ...], target: DistSpec | None = None) -> Strategy:
    """The first strategy of least ``cost``, planning as few reshards as possible (``target``:
    the layout of the parameter whose gradient the op makes, see ``cost``).

    When some strategy takes every input as it is, only such strategies can win (bytes moved
    come first): they are compared without running the planner for the others. But where such
    a strategy would carry a Partial input into more Partial outputs (``multiplies``), every
    strategy competes with the pending reductions priced: reducing the input now may be the
    cheaper (see the module's docstring).
    """
    free = [s for s in strategies if all(as_is(spec, req) for spec, req in zip(specs, s.inputs))]
    if free and any(multiplies(s, specs, out_metas) for s in free):
        return min(strategies, key=lambda s: cost(s, specs, mesh_shape, out_metas, pending=True, target=target))
    return min(free or strategies, key=lambda s: cost(s, specs, mesh_shape, out_metas, target=target))


@metadata_cache(8192)
def largest_local_numel(shape: tuple[int, ...], placements: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> int:
    """Elements of the shard at mesh coordinate 0 (torch.chunk gives it the largest piece)."""
    n = 1
    for dim, size in enumerate(shape):
        for a, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim % len(shape) == dim:
                size = -(-size // mesh_shape[a])
        n *= size
    return n
