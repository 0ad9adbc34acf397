"""A recorded step replayed on layouts alone: the collectives, FLOPs and memory one rank would see.

``simulate(step, mesh, param_placements, input_placements)`` walks the recorded ops in order as
the eager engine would run them on DistTensors — the op's rule (``spmd_rules``) offers
strategies, ``reshard.choice.cheapest`` picks one as eager does, the planner (``reshard``) plans
each input's move — but on metadata only: no tensor, no process group, any mesh size
(``ProcessMesh.simulated``). Every decision depends on the global metadata alone, so the result is
the same on every rank. An op without a rule, or whose rule offers nothing, runs replicated (its
inputs gathered), as in eager.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autoparallel.auto.trace import OpRecord, Ref, Step
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Placement, Replicate, Shard
from autoparallel.spec import DistSpec, itemsize
from reshard.choice import cheapest, largest_local_numel
from reshard.crossmesh import best_price
from reshard.plan import step_bytes
from spmd_rules.base import OpCall, Strategy, TensorMeta
from spmd_rules.registry import get_rule


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of the simulated step: its kind, mesh axis and the bytes the busiest rank receives."""

    kind: str
    axis: int
    nbytes: int
    backward: bool
    module: str


PRE, POST = "<pre>", "<post>"  # the parts of a step before and after its repeated blocks


@dataclass
class Part:
    """What one part of the step costs one rank, forward and backward: the ops before the
    repeated blocks (``PRE``: the embedding), one block (its name), or the ops after them
    (``POST``: the final norm, the head, the loss). A pipeline stage is a run of parts."""

    flops: float = 0.0
    forward_flops: float = 0.0
    touched_bytes: float = 0.0
    ops: int = 0
    saved_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)


@dataclass
class Simulation:
    """What one rank does in the simulated step (the busiest rank where ranks differ)."""

    mesh: ProcessMesh
    collectives: list[Collective] = field(default_factory=list)
    flops: float = 0.0             # local floating-point operations (matmuls, attention, convolutions)
    touched_bytes: float = 0.0     # local bytes read and written by the other ops
    saved_bytes: int = 0           # local bytes of forward tensors autograd keeps for the backward
    specs: dict[int, DistSpec] = field(default_factory=dict)  # ref id -> layout at the end
    replicated_ops: list[str] = field(default_factory=list)    # ops with no rule: run gathered
    edges: dict[tuple[str, str], DistSpec] = field(default_factory=dict)  # ("in"/"out", module) -> layout arriving
    forward_flops: float = 0.0
    ops: int = 0                   # ops the step runs (each costs the framework's per-op time)
    live_peak: int = 0             # most local bytes alive at once, parameters aside (activations, gradients, moved copies)
    live_peak_recompute: int = 0   # the same with the repeated blocks recomputed in the backward
    parts: dict[str, Part] = field(default_factory=dict)  # the step by part (``op_parts``), in forward order


def _meta_args(x: Any, metas: Mapping[int, TensorMeta]) -> Any:
    return tree_map(lambda v: metas[v.id] if isinstance(v, Ref) else v, x)


def _tensor_refs(op: OpRecord) -> list[Ref]:
    refs = [a for a in tree_flatten(op.args)[0] if isinstance(a, Ref)]
    for v in op.kwargs.values():
        refs += [a for a in tree_flatten(v)[0] if isinstance(a, Ref)]
    return refs


def _local_fraction(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> float:
    f = 1.0
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, (Shard, Partial)):
            f /= n
    return f


def simulate(step: Step, mesh: ProcessMesh, param_placements: Mapping[str, tuple[Placement, ...]],
             input_placements: tuple[Placement, ...] | list[tuple[Placement, ...]],
             io: Mapping[str, tuple[Any, Any]] | None = None, axis: int = 0,
             memo: dict[Any, Strategy | None] | None = None) -> Simulation:
    """Replay ``step`` with parameters and inputs laid out as given (see the module docstring).
    ``input_placements``: one placement tuple for every input, or one per input. ``io`` maps a
    module name to the (first input, output) layouts its parallel style brings it to (a layout as
    in ``ap.parallelize``: None, one placement for mesh axis ``axis``, or one per mesh axis).
    ``memo``: decisions to share between replays (a call on the same layouts decides alike)."""
    shape = tuple(mesh.shape)
    rep = tuple(Replicate() for _ in shape)
    sim = Simulation(mesh)
    specs = sim.specs
    metas = step.metas
    for name, ref in step.params.items():
        m = metas[ref.id]
        specs[ref.id] = DistSpec(mesh, tuple(param_placements.get(name, rep)), m.shape, m.dtype)
    per_input = (input_placements if isinstance(input_placements, list)
                 else [input_placements] * len(step.inputs))
    for ref, pl in zip(step.inputs, per_input):
        m = metas[ref.id]
        specs[ref.id] = DistSpec(mesh, tuple(_fit(pl, m.shape)), m.shape, m.dtype)
    io = io or {}
    memo = {} if memo is None else memo

    def move(spec: DistSpec, layout: Any, module: str) -> DistSpec:
        if isinstance(layout, (Replicate, Shard, Partial)):
            pl = list(spec.placements)
            pl[axis] = Shard(layout.dim % len(spec.shape)) if isinstance(layout, Shard) else layout
            target = tuple(pl)
        else:
            target = tuple(layout)
        _count(sim, spec, target, False, module)
        return spec.with_placements(target) if target != spec.placements else spec

    moved: dict[int, int] = {}  # op index -> local bytes of its inputs' moved copies (alive while it runs)
    reverse: dict[int, tuple[tuple[Placement, ...], str]] = {}  # gradient ref id -> (layout it moves back to, module)
    owner = op_parts(step)
    sim.parts = {name: Part() for name in dict.fromkeys(owner)}
    made: dict[int, int] = {}  # ref id -> the op that made it (else the first that read it)
    part = Part()
    mark = 0  # the collectives up to here belong to earlier ops' parts
    for index, op in enumerate(step.ops):
        part.collectives += sim.collectives[mark:]
        mark = len(sim.collectives)
        if getattr(op.func, "namespace", None) == "prim" or not any(o is not None for o in op.outs):
            continue
        part = sim.parts[owner[index]]
        for r in (*_tensor_refs(op), *(o for o in op.outs if o is not None)):
            made.setdefault(r.id, index)
        sim.ops += 1
        part.ops += 1
        refs = _tensor_refs(op)
        out_metas = tuple(metas[o.id] if o is not None else None for o in op.outs)
        if op.backward and op.func in _UNINITIALIZED:  # autograd's own buffers (a gradient's accumulator)
            continue                                    # take the layout of what is copied in
        if not refs:  # a factory: the same values on every rank
            for o in op.outs:
                if o is not None:
                    specs[o.id] = DistSpec(mesh, rep, metas[o.id].shape, metas[o.id].dtype)
            continue
        if op.func is _COPY and refs[0].id not in specs:  # a gradient copied into its accumulator
            specs[refs[0].id] = specs.get(refs[1].id) or DistSpec(mesh, rep, metas[refs[1].id].shape, metas[refs[1].id].dtype)
            continue
        in_specs = []
        for r in refs:
            s = specs.get(r.id)
            if s is None:
                m = metas[r.id]
                s = specs[r.id] = DistSpec(mesh, rep, m.shape, m.dtype)
            back = reverse.pop(r.id, None) if op.backward else None
            if back is not None:  # the gradient crossing a style's boundary: the move reversed
                if _count(sim, s, back[0], True, back[1]):
                    s = specs[r.id] = s.with_placements(back[0])
            in_specs.append(s)
        edge = step.boundaries.get(op.outs[0].id) if len(op.outs) == 1 and op.outs[0] is not None else None
        if edge is not None and not op.backward:  # a module's input / output: its style's layout
            layout = io.get(edge[1], (None, None))[0 if edge[0] == "in" else 1]
            sim.edges.setdefault(edge, in_specs[0])
            out = op.outs[0]
            assert out is not None
            specs[out.id] = in_specs[0] if layout is None else move(in_specs[0], layout, edge[1])
            grad = step.boundary_grads.get(out.id)
            if layout is not None and grad is not None:  # its gradient goes back to the source's layout, P as R
                reverse[grad.id] = (in_specs[0].without_partial().placements, edge[1])
            continue
        # the same call on the same layouts decides alike (repeated blocks): decide it once
        key = _frozen((op.func, _without_refs(op.args), _without_refs(op.kwargs), tuple(in_specs), out_metas))
        if key is not None and key in memo:
            best = memo[key]
        else:
            best = _choose(op, in_specs, out_metas, shape)
            if key is not None:
                memo[key] = best
        if best is None:
            sim.replicated_ops.append(str(op.func))
            best = Strategy(tuple(rep for _ in refs), tuple(rep for _ in out_metas))
        for spec, req in zip(in_specs, best.inputs):
            if _count(sim, spec, tuple(req), op.backward, op.module):
                moved[index] = moved.get(index, 0) + largest_local_numel(spec.shape, tuple(req), shape) * spec.itemsize
        for a, nbytes in _kernel_collectives(op, in_specs, best, metas, shape):
            sim.collectives.append(Collective("all_reduce", a, nbytes, op.backward, op.module))
        frac = 1.0
        for o, pl in zip(op.outs, best.outputs):
            if o is None:
                continue
            m = metas[o.id]
            specs[o.id] = DistSpec(mesh, tuple(pl), m.shape, m.dtype)
            frac = min(frac, _local_fraction(tuple(pl), shape))
        if op.flops:
            sim.flops += op.flops * frac
            part.flops += op.flops * frac
            if not op.backward:
                sim.forward_flops += op.flops * frac
                part.forward_flops += op.flops * frac
        else:
            touched = sum(largest_local_numel(s.shape, tuple(p), shape) * s.itemsize for s, p in zip(in_specs, best.inputs))
            sim.touched_bytes += touched
            part.touched_bytes += touched
    part.collectives += sim.collectives[mark:]
    saved: dict[int, tuple[int, str]] = {}  # storage -> (local bytes, part) (views autograd saves of one storage count once)
    for rid in step.saved:
        s = specs.get(rid)
        if s is not None:
            st = step.storages.get(rid, -1 - rid)
            nbytes = largest_local_numel(s.shape, s.placements, shape) * s.itemsize
            if nbytes > saved.get(st, (-1, ""))[0]:
                saved[st] = (nbytes, owner[made[rid]] if rid in made else PRE)
    sim.saved_bytes = sum(n for n, _ in saved.values())
    for nbytes, name in saved.values():
        sim.parts[name].saved_bytes += nbytes
    sim.live_peak = _live_peak(step, specs, shape, moved, recompute=False)
    sim.live_peak_recompute = _live_peak(step, specs, shape, moved, recompute=True)
    return sim


def op_parts(step: Step) -> list[str]:
    """The part (``Part``) of every op of ``step``: a repeated block's op is the block's; a
    forward op before the first block is ``PRE``, after the last ``POST``; a backward op before
    the first block's backward is ``POST``, after the last ``PRE``; an op between two blocks is
    the earlier block's (in the order it ran). Without repeated blocks every op is ``PRE``."""
    blocks = step.blocks()
    memo: dict[str, str | None] = {}

    def block_of(module: str) -> str | None:
        if module not in memo:
            memo[module] = next((b for b in blocks if module == b or module.startswith(b + ".")), None)
        return memo[module]

    owners = [block_of(op.module) if not op.backward else None for op in step.ops]
    # a block's backward: from its output's gradient arriving to its input's (the boundary views)
    for rid, (kind, name) in step.boundaries.items():
        if name in blocks and kind == "out" and rid in step.boundary_grad_at:
            start = step.boundary_grad_at[rid]
            ends = [step.boundary_grad_at[r] for r, (k, n) in step.boundaries.items()
                    if n == name and k == "in" and r in step.boundary_grad_at]
            for i in range(start, min(ends, default=start)):
                if step.ops[i].backward and owners[i] is None:
                    owners[i] = name
    spans: dict[bool, tuple[int, int]] = {}
    for i, (op, b) in enumerate(zip(step.ops, owners)):
        if b is not None:
            lo, _ = spans.get(op.backward, (i, i))
            spans[op.backward] = (lo, i)
    out: list[str] = []
    last: str | None = None
    for i, (op, b) in enumerate(zip(step.ops, owners)):
        if b is not None:
            last = b
            out.append(b)
            continue
        span = spans.get(op.backward)
        if span is None or last is None or i > span[1] or i < span[0]:
            before = span is None or i < span[0]
            out.append((PRE if before else POST) if not op.backward else (POST if before else PRE))
        else:
            out.append(last)
    return out


def param_parts(step: Step) -> dict[str, list[str]]:
    """The parts (``op_parts``) whose forward ops read each parameter, in order (a weight tied
    between the embedding and the head: both)."""
    names = {ref.id: name for name, ref in step.params.items()}
    out: dict[str, list[str]] = {name: [] for name in step.params}
    for op, part in zip(step.ops, op_parts(step)):
        if op.backward:
            continue
        for r in _tensor_refs(op):
            name = names.get(r.id)
            if name is not None and part not in out[name]:
                out[name].append(part)
    return out


def _live_peak(step: Step, specs: dict[int, DistSpec], mesh_shape: tuple[int, ...], moved: dict[int, int],
               recompute: bool) -> int:
    """The most local bytes alive at once during the step, parameters aside: each storage (views
    share their base's) lives from the op that makes it (inputs: from the start) to the last op
    that reads it (what autograd saved: its backward use); gradients reaching parameters, and the
    buffers autograd accumulates them in, to the end (they become ``.grad``); an op's moved input
    copies while it runs. ``recompute``: what a repeated block saves lives until the block's
    forward ends, and again from the first backward use of any of them (the block's recompute)
    to its own last use."""
    params = {step.storages.get(r.id) for r in step.params.values()}
    size: dict[int, int] = {}
    birth: dict[int, int] = {}
    death: dict[int, int] = {}
    end = len(step.ops)

    def touch(ref: Ref, i: int) -> int | None:
        st = step.storages.get(ref.id)
        if st is None or st in params:
            return None
        spec = specs.get(ref.id)
        m = step.metas[ref.id]
        pl = spec.placements if spec is not None else tuple(Replicate() for _ in mesh_shape)
        nbytes = largest_local_numel(m.shape, tuple(pl), mesh_shape) * itemsize(m.dtype)
        size[st] = max(size.get(st, 0), nbytes)
        birth.setdefault(st, i)
        death[st] = max(death.get(st, i), i)
        return st

    for ref in step.inputs:
        touch(ref, 0)
    copied: set[int] = set()  # gradients copied into an accumulator (which becomes ``.grad``)
    for i, op in enumerate(step.ops):
        refs = _tensor_refs(op)
        for ref in refs:
            touch(ref, i)
        for o in op.outs:
            if o is not None:
                st = touch(o, i)
                if st is not None and op.backward and op.func is _COPY:  # a gradient's accumulator: kept
                    death[st] = end
                    copied.update(step.storages.get(r.id, -1) for r in refs[1:])
    for grads in step.grads.values():  # a gradient autograd keeps as it is becomes ``.grad``
        st = step.storages.get(grads[-1].id) if grads else None
        if st in death and st not in copied:
            death[st] = end
    if step.loss is not None and step.storages.get(step.loss.id) in death:
        death[step.storages[step.loss.id]] = end
    gaps = _recompute_gaps(step, birth) if recompute else {}
    delta = [0] * (end + 2)
    for st, nbytes in size.items():
        delta[birth[st]] += nbytes
        delta[death[st] + 1] -= nbytes
        gap = gaps.get(st)
        if gap is not None and gap[0] < gap[1] <= death[st]:  # dropped after the forward, recomputed later
            delta[gap[0] + 1] -= nbytes
            delta[gap[1]] += nbytes
    live = peak = 0
    for i in range(end + 1):
        live += delta[i]
        peak = max(peak, live + moved.get(i, 0))
    return peak


def _recompute_gaps(step: Step, birth: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Per storage a repeated block saves, other than a block's input (kept for the recompute):
    (the block's last forward op, its recompute: the first backward op reading any of them)."""
    blocks = step.blocks()
    if not blocks:
        return {}
    owner: dict[int, str] = {}   # storage -> the block whose forward made it
    last_forward: dict[str, int] = {}
    first_use: dict[int, int] = {}  # storage -> first backward op reading it
    for i, op in enumerate(step.ops):
        block = next((b for b in blocks if op.module == b or op.module.startswith(b + ".")), None)
        if not op.backward:
            if block is not None:
                last_forward[block] = i
                for o in op.outs:
                    st = step.storages.get(o.id) if o is not None else None
                    if st is not None and birth.get(st) == i:
                        owner.setdefault(st, block)
            continue
        for ref in _tensor_refs(op):
            st = step.storages.get(ref.id)
            if st is not None:
                first_use.setdefault(st, i)
    kept = {step.storages.get(r.id) for b in blocks for r in step.module_inputs.get(b, [])}  # each block's input
    saved = {step.storages.get(rid) for rid in step.saved} - kept
    start: dict[str, int] = {}
    for st, block in owner.items():
        if st in saved and st in first_use:
            start[block] = min(start.get(block, first_use[st]), first_use[st])
    return {st: (last_forward[block], start[block]) for st, block in owner.items()
            if st in saved and block in start}


def _count(sim: Simulation, spec: DistSpec, req: tuple[Placement, ...], backward: bool, module: str) -> bool:
    """Add the collectives of moving ``spec`` to ``req`` as eager would (none if it is there);
    whether anything moves."""
    dst = spec.with_placements(req) if tuple(req) != spec.placements or spec.shard_order else spec
    if dst == spec:
        return False
    nbytes, steps, communicates = best_price(spec, dst)
    moves = [s for s in steps if not s.is_local]
    for s in moves:
        sim.collectives.append(Collective(s.kind, s.axis, int(step_bytes(s)[1].max()), backward, module))
    if communicates and not moves:  # shipped point to point: the pieces each rank lacks
        sim.collectives.append(Collective("send_recv", -1, nbytes, backward, module))
    return True


_aten = torch.ops.aten
_COPY = _aten.copy_.default
_UNINITIALIZED = {_aten.new_empty_strided.default, _aten.new_empty.default, _aten.empty_like.default,
                  _aten.empty_strided.default, _aten.empty.memory_format}
_ROW_STATS = {_aten._softmax.default: 2, _aten._log_softmax.default: 2,
              _aten._softmax_backward_data.default: 1, _aten._log_softmax_backward_data.default: 1}
_NLL = {_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default}


def _kernel_collectives(op: OpRecord, in_specs: list[DistSpec], best: Strategy, metas: list[TensorMeta],
                        mesh_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(mesh axis, bytes) of the all-reduces an op's own local kernel issues under ``best``
    (the eager engine's kernels: softmax over a sharded dim reduces row statistics, a mean loss
    over a split batch its sum and weight, batch norm its per-channel sums)."""
    out = []
    if op.func in _ROW_STATS:
        fwd = op.func in (_aten._softmax.default, _aten._log_softmax.default)
        x = in_specs[0] if fwd else in_specs[1]
        dim = int(op.args[1 if fwd else 2]) % max(len(x.shape), 1)
        pl = best.inputs[0] if fwd else best.inputs[1]
        axes = [a for a, p in enumerate(pl) if isinstance(p, Shard) and p.dim % max(len(x.shape), 1) == dim]
        if axes:
            rows = largest_local_numel(x.shape, tuple(pl), mesh_shape) // max(1, -(-x.shape[dim] // _prod(mesh_shape, axes)))
            for a in axes:
                out += [(a, 2 * rows * 4 * (mesh_shape[a] - 1) // mesh_shape[a])] * _ROW_STATS[op.func]
    elif op.func in _NLL:
        reduction = op.args[3] if len(op.args) > 3 else op.kwargs.get("reduction", 1)
        pl = best.inputs[1] if len(best.inputs) > 1 else best.inputs[0]
        if reduction == 1:
            out += [(a, 8) for a, p in enumerate(pl) if isinstance(p, Shard)]
    return out


def _prod(shape: tuple[int, ...], axes: list[int]) -> int:
    n = 1
    for a in axes:
        n *= shape[a]
    return n


def _without_refs(x: Any) -> Any:
    """``x`` with each tensor left as a placeholder (the tensors' layouts are keyed apart)."""
    return tree_map(lambda v: Ref if isinstance(v, Ref) else v, x)


def _frozen(x: Any) -> Any:
    """``x`` made hashable (lists and dicts as tuples), or None where it cannot be."""
    def freeze(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return tuple(freeze(i) for i in v)
        if isinstance(v, dict):
            return tuple((k, freeze(i)) for k, i in v.items())
        return v
    try:
        out = freeze(x)
        hash(out)
        return out
    except TypeError:
        return None


def _fit(pl: tuple[Placement, ...], shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """An input placement made valid for an input of ``shape`` (a batch split of a 0-d tensor,
    or of a dim too short to split, stays Replicate)."""
    out: list[Placement] = []
    for p in pl:
        if isinstance(p, Shard) and (not shape or p.dim >= len(shape) or shape[p.dim] <= 1):
            out.append(Replicate())
        else:
            out.append(p)
    return tuple(out)


def _choose(op: OpRecord, in_specs: list[DistSpec], out_metas: tuple[TensorMeta | None, ...],
            mesh_shape: tuple[int, ...]) -> Strategy | None:
    rule = get_rule(op.func)
    if rule is None:
        return None
    metas = [TensorMeta(s.shape, s.dtype) for s in in_specs]
    by_id = _metas_by_id(op, metas)
    call = OpCall(op.func, _meta_args(op.args, by_id), _meta_args(op.kwargs, by_id),
                  tuple(metas), out_metas, tuple(s.placements for s in in_specs), mesh_shape)
    try:
        strategies = rule(call)
    except Exception:  # a rule that cannot speak for this call: eager would fall back too
        return None
    if not strategies:
        return None
    return cheapest(strategies, in_specs, mesh_shape, out_metas)


def _metas_by_id(op: OpRecord, metas: list[TensorMeta]) -> dict[int, TensorMeta]:
    """This op's argument metas by ref id (``_meta_args`` looks each ``Ref`` up)."""
    return {r.id: m for r, m in zip(_tensor_refs(op), metas)}
