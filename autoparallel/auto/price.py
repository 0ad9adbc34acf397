"""A candidate plan's predicted step per rank, from its replayed step (``Simulation``) and the
machine's ``Profile``: compute, communication, the framework's per-op time, the optimizer's update
and the peak memory, with ZeRO stages and recompute as known changes (docs/auto.md, "Pricing")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoparallel.auto.plan import Prediction
from autoparallel.auto.profile import Profile
from autoparallel.auto.simulate import POST, PRE, Part, Simulation
from autoparallel.auto.trace import Step
from autoparallel.placement import Partial, Placement, Replicate, Shard
from autoparallel.spec import itemsize

BUCKET_BYTES = 25 * 2**20  # gradients are reduced in buckets of about this size


def state_factor_of(optimizer: Any) -> float:
    """Optimizer state per parameter byte (AdamW: 2, SGD with momentum: 1, plain SGD: 0)."""
    if optimizer is None:
        return 2.0
    if isinstance(optimizer, str):
        name, momentum = optimizer.lower(), None
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = cls.__name__.lower()
        defaults = getattr(optimizer, "defaults", {}) if not isinstance(optimizer, type) else {}
        momentum = defaults.get("momentum")
    if name.startswith("adam") or name in ("lamb", "nadam", "radam"):
        return 2.0
    if name == "sgd":
        return 1.0 if momentum else (0.0 if momentum is not None else 1.0)
    if name in ("adagrad", "rmsprop", "adadelta", "lion"):
        return 1.0
    raise ValueError(f"ap.auto_parallel: optimizer {optimizer!r} is unknown; pass 'adamw', 'sgd', or the optimizer")


def local_bytes(shape: tuple[int, ...], itemsize: int, pl: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> int:
    n = itemsize
    sizes = list(shape)
    for p, k in zip(pl, mesh_shape):
        if isinstance(p, Shard) and sizes:
            d = p.dim % len(sizes)
            sizes[d] = -(-sizes[d] // k)
    for s in sizes:
        n *= s
    return n


def price_step(step: Step, sim: Simulation, mesh_shape: tuple[int, ...], dp_axis: int | None, tp_axis: int | None,
               params: dict[str, tuple[Placement, ...]], zero: int, recompute: float, state_factor: float,
               prof: Profile) -> Prediction:
    """One candidate's predicted step; ``recompute``: the fraction of the repeated blocks recomputed."""
    dp = mesh_shape[dp_axis] if dp_axis is not None else 1
    p_bytes, block_bytes, tp_grad_bytes = _param_bytes(step, sim, params, mesh_shape, tp_axis, step.params)
    n_blocks = max(1, len(step.blocks()))
    colls = [(c.kind, c.nbytes, 1, c.axis) for c in sim.collectives]
    colls += _gradient_sync(p_bytes, block_bytes, n_blocks, dp, zero, dp_axis, mesh_shape, tp_axis, tp_grad_bytes)
    comm_s = sum(prof.seconds(kind, b, n, prof.inside_node(mesh_shape, axis)) for kind, b, n, axis in colls)
    flops = sim.flops + recompute * sim.forward_flops
    compute_s = flops / prof.flops_per_s + sim.touched_bytes * (1 + 0.5 * recompute) / prof.bytes_per_s
    overhead_s = sim.ops * (1 + 0.5 * recompute) * prof.op_s
    update_s, update_host_s = _update(p_bytes, len(step.params), dp, zero, state_factor, prof)  # (tied parameters once)
    compute_s += update_s
    overhead_s += update_host_s
    s_bytes = int(state_factor * p_bytes) // (dp if zero >= 1 else 1)
    # activations and gradients: the replay's peak of live bytes (gradients whole: ZeRO-2 reduces
    # them after the backward, so at the peak they are whole too)
    live = _with_step_buffers(int(sim.live_peak - recompute * (sim.live_peak - sim.live_peak_recompute)), p_bytes, dp, zero)
    if zero >= 3:  # the shard, and gathered at the peak the root unit (what no block holds: the
        # embedding, the head) and two blocks (the first re-gathered for its backward while the
        # last's gathers are freed), one with recompute (benchmarks/zero3_peak.py's breakdown)
        unit = block_bytes // n_blocks
        p_bytes = p_bytes // dp + (p_bytes - block_bytes) + unit * (2 - int(recompute >= 1))
    return Prediction(compute_s + comm_s + overhead_s, compute_s, comm_s, p_bytes + s_bytes + live,
                      sum(n for _, _, n, _ in colls), sum(b for _, b, _, _ in colls), overhead_s)


def _param_bytes(step: Step, sim: Simulation, params: dict[str, tuple[Placement, ...]], mesh_shape: tuple[int, ...],
                 tp_axis: int | None, names: Any) -> tuple[int, int, int]:
    """(local bytes of the parameters ``names``, of those in the repeated blocks, of those whose
    gradient is Partial on the tensor axis: all-reduced there once the backward is done)."""
    rep = tuple(Replicate() for _ in mesh_shape)
    p_bytes = block_bytes = tp_grad_bytes = 0
    blocks = tuple(b + "." for b in step.blocks())
    for name in names:
        m = step.metas[step.params[name].id]
        b = local_bytes(m.shape, itemsize(m.dtype), params.get(name, rep), mesh_shape)
        p_bytes += b
        if name.startswith(blocks):
            block_bytes += b
        grads = step.grads.get(name, [])
        g = sim.specs.get(grads[-1].id) if grads else None
        if tp_axis is not None and g is not None and isinstance(g.placements[tp_axis], Partial):
            tp_grad_bytes += b
    return p_bytes, block_bytes, tp_grad_bytes


def _gradient_sync(p_bytes: int, block_bytes: int, n_blocks: int, dp: int, zero: int, dp_axis: int | None,
                   mesh_shape: tuple[int, ...], tp_axis: int | None, tp_grad_bytes: int) -> list[tuple[str, int, int, int]]:
    """(kind, bytes, count, mesh axis) of the collectives the data axis (and the tensor axis, for
    gradients Partial there) adds after the backward for ``p_bytes`` of parameters."""
    colls: list[tuple[str, int, int, int]] = []
    if dp > 1:
        f = (dp - 1) / dp
        buckets = max(1, -(-p_bytes // BUCKET_BYTES))
        a = dp_axis if dp_axis is not None else -1
        if zero <= 1:  # DP and ZeRO-1 keep whole gradients: all-reduced per bucket
            colls.append(("all_reduce", int(2 * f * p_bytes), buckets, a))
        else:
            # reduce-scatter of the gradients: ZeRO-3 one per unit (the blocks and the root), ZeRO-2 per bucket
            colls.append(("reduce_scatter", int(f * p_bytes), n_blocks + 1 if zero == 3 else buckets, a))
        if zero == 3:  # each block in forward and again in backward; the root unit once (kept for its backward)
            colls.append(("all_gather", int(f * (p_bytes + block_bytes)), 2 * n_blocks + 1, a))
        elif zero:     # ZeRO-1/2: the updated shards
            colls.append(("all_gather", int(f * p_bytes), buckets, a))
    if tp_grad_bytes and tp_axis is not None:
        k = mesh_shape[tp_axis]
        colls.append(("all_reduce", int(2 * (k - 1) / k * tp_grad_bytes), 1, tp_axis))
    return colls


def _update(p_bytes: int, tensors: int, dp: int, zero: int, state_factor: float, prof: Profile) -> tuple[float, float]:
    """(seconds of memory traffic, seconds of kernels' host time) of the optimizer's update:
    passes over the parameters' bytes (on this rank's shard from ZeRO-1 on) and kernels per
    parameter tensor; ZeRO-1/2 also point a shard at each parameter, give it its gradient and
    copy the gathered parameters back."""
    passes, kernels = update_cost(state_factor)
    seconds = passes * (p_bytes // dp if zero else p_bytes) / prof.bytes_per_s
    if zero in (1, 2) and dp > 1:
        seconds += 2 * p_bytes / prof.bytes_per_s
        kernels += 4
    return seconds, tensors * kernels * prof.kernel_s


def _with_step_buffers(live: int, p_bytes: int, dp: int, zero: int) -> int:
    """``live`` or the optimizer's step, whichever holds more: with every gradient alive, DP
    flattens a bucket of them to all-reduce; ZeRO-1/2 hold the gradients' shards and gather the
    updated shards (a bucket's rows and the parameters cut from them, besides this rank's piece)."""
    bucket = min(p_bytes, BUCKET_BYTES)
    if dp > 1 and zero == 0:
        return max(live, p_bytes + bucket)
    if dp > 1 and zero in (1, 2):
        return max(live, p_bytes + 2 * bucket + bucket // dp + p_bytes // dp)
    return live


def update_cost(state_factor: float) -> tuple[float, int]:
    """(passes over the parameters' bytes, kernels per parameter tensor) of one optimizer update
    with ``state_factor`` states per parameter (AdamW: about 12 and 10; SGD with momentum 7.5 and 6)."""
    return 3 + 4.5 * state_factor, 2 + int(4 * state_factor)


# ---- pipelines ----------------------------------------------------------------------------------
# The pipeline runner's own host time, in the framework's per-op time: per micro-batch and stage
# (its schedule's actions, the messages posted and awaited, the activation wrapped on its mesh)
# and per step. Measured: a pipeline of two one-Linear stages on 2 gloo ranks takes 1.9 ms per
# step plus 0.8 ms per micro-batch, of which about 0.4 ms is the stages' own ops and messages;
# the rest is about 10 and 45 ops' time at 40 us per op.
RUNNER_OPS_PER_MICROBATCH = 10
RUNNER_OPS_PER_STEP = 45


@dataclass(frozen=True)
class PipelineShape:
    """A pipeline axis of a candidate: ``stages`` stage meshes, ``microbatches`` per step, 1F1B,
    and the block index each stage starts at (``starts[0] == 0``)."""

    stages: int
    microbatches: int
    starts: tuple[int, ...]


def price_pipeline(step: Step, sim: Simulation, uses: dict[str, list[str]], mesh_shape: tuple[int, ...],
                   dp_axis: int | None, tp_axis: int | None, params: dict[str, tuple[Placement, ...]], zero: int,
                   recompute: bool, state_factor: float, prof: Profile, stages: int,
                   microbatches: int) -> tuple[Prediction, PipelineShape] | None:
    """A candidate with a pipeline axis of ``stages`` (outermost, before the data and tensor axes
    of ``mesh_shape``, on which ``sim`` replayed the whole step), run as 1F1B over
    ``microbatches``; None when the blocks cannot fill the stages. ``uses``: the parts reading
    each parameter outside the blocks (``param_parts``).

    Each part's time for one micro-batch is its compute over ``microbatches`` plus its tensor-axis
    collectives (bytes over ``microbatches``, latency each) plus its ops' host time. The blocks
    are cut into the contiguous stages (the ops before them with the first, after them with the
    last) whose slowest is fastest. The pipeline takes ``sum(stage) + (m - 1) x slowest`` (1F1B;
    the bubble is ``sum - slowest``) plus the activation and its gradient sent across each
    boundary per micro-batch; then each stage reduces its gradients on the data axis and steps
    its optimizer (the stage with the most parameters). Memory: stage ``s`` keeps
    ``min(stages - s, m)`` micro-batches' saved tensors (1F1B), or only the blocks' inputs with
    recompute."""
    m = microbatches
    blocks = sorted((k for k in sim.parts if k not in (PRE, POST)), key=lambda b: int(b.rsplit(".", 1)[-1]))
    if len(blocks) < stages:
        return None
    dp = mesh_shape[dp_axis] if dp_axis is not None else 1
    full = (stages, *mesh_shape)
    empty = Part()

    def seconds(part: Part, again: bool = False) -> tuple[float, float, float]:
        """(compute, communication, host) seconds of one micro-batch through ``part`` (``again``:
        its forward recomputed in the backward)."""
        compute = ((part.flops + again * part.forward_flops) / prof.flops_per_s
                   + part.touched_bytes * (1 + 0.5 * again) / prof.bytes_per_s) / m
        comm = sum(prof.seconds(c.kind, c.nbytes / m, 1, prof.inside_node(mesh_shape, c.axis)) for c in part.collectives)
        return compute, comm, part.ops * (1 + 0.5 * again) * prof.op_s

    pre, post = seconds(sim.parts.get(PRE, empty)), seconds(sim.parts.get(POST, empty))
    per_block = [seconds(sim.parts[b], recompute) for b in blocks]
    starts = _balanced(sum(pre), [sum(t) for t in per_block], sum(post), stages)
    bounds = [*starts, len(blocks)]
    stage_parts = [blocks[bounds[s]:bounds[s + 1]] for s in range(stages)]
    times = []
    for s, names in enumerate(stage_parts):
        ts = [per_block[blocks.index(b)] for b in names] + ([pre] if s == 0 else []) + ([post] if s == stages - 1 else [])
        compute, comm, host = (sum(t[i] for t in ts) for i in range(3))
        times.append((compute, comm, host + RUNNER_OPS_PER_MICROBATCH * prof.op_s))
    totals = [sum(t) for t in times]
    slow = max(range(stages), key=lambda s: totals[s])
    # the activation crossing a boundary (a block's input), forward and its gradient back, per micro-batch
    act = max((_ref_bytes(step, sim, step.module_inputs[blocks[b]], mesh_shape) for b in starts[1:]
               if step.module_inputs.get(blocks[b])), default=0)
    hop = prof.seconds("send_recv", act / m, 1, prof.inside_node(full, 0))
    p2p_s = 2 * (stages - 1) * hop + 2 * (m - 1) * hop
    bubble_s = sum(totals) - totals[slow]
    if prof.core_share < 1:  # ranks sharing cores: while some wait the busy ones compute faster, so the
        # step is the longer of the critical path at a whole core and every micro-batch at the shared one
        fast = [prof.core_share * (c + h) + x for c, x, h in times]
        critical = sum(fast) + (m - 1) * fast[slow]
        bubble_s = max(0.0, critical - m * totals[slow])
    # the stage's parameters: its blocks' and the ones its outer ops read (a weight tied between
    # the first and the last stage on both, its gradients summed over the two: one all-reduce)
    held: list[list[str]] = [[] for _ in range(stages)]
    tied_bytes = 0
    for name in step.params:
        owner = next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)
        if owner is not None:
            places = {next(s for s in range(stages) if bounds[s] <= owner < bounds[s + 1])}
        else:
            places = {0 if u == PRE else stages - 1 for u in uses.get(name, [PRE]) if u in (PRE, POST)} or {0}
        for s in places:
            held[s].append(name)
        if len(places) > 1:
            tied_bytes += _param_bytes(step, sim, params, mesh_shape, tp_axis, [name])[0]
    # one micro-batch's working set besides what it saves and the parameters' gradients
    working = max(0, sim.live_peak - sim.saved_bytes - _param_bytes(step, sim, params, mesh_shape, tp_axis, step.params)[0])
    peak = 0
    sync_s = update_s = host_s = 0.0
    colls_n = colls_b = 0
    for s, names in enumerate(held):
        p_bytes, block_bytes, tp_grad = _param_bytes(step, sim, params, mesh_shape, tp_axis, names)
        colls = _gradient_sync(p_bytes, block_bytes, max(1, len(stage_parts[s])), dp, zero, dp_axis, mesh_shape, tp_axis, tp_grad)
        if tied_bytes and s in (0, stages - 1):
            colls.append(("all_reduce", tied_bytes, 1, -1))
        c_s = sum(prof.seconds(kind, b, n, prof.inside_node(full, axis + 1 if axis >= 0 else 0)) for kind, b, n, axis in colls)
        u_s, h_s = _update(p_bytes, len(names), dp, zero, state_factor, prof)
        if c_s + u_s + h_s >= sync_s + update_s + host_s:
            sync_s, update_s, host_s = c_s, u_s, h_s
            colls_n, colls_b = sum(n for _, _, n, _ in colls), sum(b for _, b, _, _ in colls)
        # memory of stage s: parameters, gradients, optimizer states, and its micro-batches in flight
        parts = [sim.parts[b] for b in stage_parts[s]]
        saved = (sum(_ref_bytes(step, sim, step.module_inputs.get(b, [])[:1], mesh_shape) for b in stage_parts[s])
                 if recompute else sum(p.saved_bytes for p in parts))
        saved += (sim.parts.get(PRE, empty).saved_bytes if s == 0 else 0) + (sim.parts.get(POST, empty).saved_bytes if s == stages - 1 else 0)
        s_bytes = int(state_factor * p_bytes) // (dp if zero >= 1 else 1)
        peak = max(peak, p_bytes + s_bytes
                   + _with_step_buffers(p_bytes + saved * min(stages - s, m) // m + working // m, p_bytes, dp, zero))
    compute_s, comm_s, host = times[slow]
    pipe_comm = comm_s * m + p2p_s + sync_s
    host_s += RUNNER_OPS_PER_STEP * prof.op_s
    time_s = totals[slow] * m + bubble_s + p2p_s + sync_s + update_s + host_s
    stage_colls = sum(len(sim.parts[b].collectives) for b in stage_parts[slow]) * m
    return (Prediction(time_s, compute_s * m + update_s, pipe_comm, peak, stage_colls + colls_n + 2 * m,
                       colls_b + int(2 * act), host * m + host_s, bubble_s),
            PipelineShape(stages, m, tuple(starts)))


def _balanced(pre: float, blocks: list[float], post: float, stages: int) -> list[int]:
    """The block index each of ``stages`` contiguous stages starts at (each at least one block;
    ``pre`` on the first, ``post`` on the last) whose slowest stage is fastest (exact: dynamic
    programming over the cut points)."""
    n = len(blocks)
    prefix = [0.0]
    for t in blocks:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[s][i]: the least slowest stage cutting blocks[:i] into s + 1 stages; cut[s][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = pre + prefix[i]
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + (post if s == stages - 1 and i == n else 0))
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    starts = [0] * stages
    i = n
    for s in range(stages - 1, 0, -1):
        starts[s] = i = cut[s][i]
    return starts


def _ref_bytes(step: Step, sim: Simulation, refs: list[Any], mesh_shape: tuple[int, ...]) -> int:
    """Local bytes of the first of ``refs`` (a module's input) as the replay laid it out."""
    if not refs:
        return 0
    m = step.metas[refs[0].id]
    spec = sim.specs.get(refs[0].id)
    pl = spec.placements if spec is not None else tuple(Replicate() for _ in mesh_shape)
    return local_bytes(m.shape, itemsize(m.dtype), tuple(pl), mesh_shape)
