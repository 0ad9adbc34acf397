"""Choosing among a rule's strategies: the price of moving each input, and the cheapest strategy.

Pure metadata, shared by the eager engine (one op at a time) and the plan search
(``autoparallel.auto``: a whole step on a simulated mesh), so both choose alike. A strategy's
cost is lexicographic: bytes moved (each collective also pays ``LATENCY_BYTES``, and a local fill
``S -> P`` the all-gather it stands for), inputs changed, largest local output bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from autoparallel.placement import Shard
from autoparallel.spec import DistSpec, itemsize
from reshard.crossmesh import CrossMeshPlan, best_price, plan_best
from reshard.plan import ALL_GATHER, FILL, Plan, Step, step_bytes
from reshard.planner import LATENCY_BYTES
from spmd_rules.base import Strategy, TensorMeta


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
            price += int(step_bytes(Step(ALL_GATHER, s.axis, s.src, s.dst))[1].max()) + LATENCY_BYTES
    return price


def as_is(spec: DistSpec, req: tuple[Any, ...]) -> bool:
    """Whether ``spec`` already has placements ``req`` (in the default shard order)."""
    return not spec.shard_order and tuple(req) == tuple(spec.placements)


def cost(s: Strategy, specs: Sequence[DistSpec], mesh_shape: tuple[int, ...],
         out_metas: tuple[TensorMeta | None, ...]) -> tuple[int, int, int]:
    """(bytes moved, inputs changed, largest local output bytes): lexicographic."""
    moved = changed = 0
    for spec, req in zip(specs, s.inputs):
        price = plan_price(spec, req)
        if price is not None:
            changed += 1
            moved += price
    compute = 0
    for m, pl in zip(out_metas, s.outputs):
        if m is not None:
            compute += largest_local_numel(m.shape, pl, mesh_shape) * itemsize(m.dtype)
    return moved, changed, compute


def cheapest(strategies: Sequence[Strategy], specs: Sequence[DistSpec], mesh_shape: tuple[int, ...],
             out_metas: tuple[TensorMeta | None, ...]) -> Strategy:
    """The first strategy of least ``cost``, planning as few reshards as possible.

    When some strategy takes every input as it is, only such strategies can win (bytes moved
    come first): they are compared without running the planner for the others.
    """
    free = [s for s in strategies if all(as_is(spec, req) for spec, req in zip(specs, s.inputs))]
    return min(free or strategies, key=lambda s: cost(s, specs, mesh_shape, out_metas))


@lru_cache(maxsize=8192)
def largest_local_numel(shape: tuple[int, ...], placements: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> int:
    """Elements of the shard at mesh coordinate 0 (torch.chunk gives it the largest piece)."""
    n = 1
    for dim, size in enumerate(shape):
        for a, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim % len(shape) == dim:
                size = -(-size // mesh_shape[a])
        n *= size
    return n
