"""A candidate plan's predicted step per rank, from its replayed step (``Simulation``) and the
machine's ``Profile``: compute, communication, the framework's per-op time, the optimizer's update
and the peak memory, with ZeRO stages and recompute as known changes (docs/auto.md, "Pricing")."""

from __future__ import annotations

from typing import Any

from autoparallel.auto.plan import Prediction
from autoparallel.auto.profile import Profile
from autoparallel.auto.simulate import Simulation
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
    rep = tuple(Replicate() for _ in mesh_shape)
    p_bytes = 0
    block_bytes = 0  # the parameters of the repeated blocks (ZeRO-3's units beside the root)
    tp_grad_bytes = 0
    blocks = tuple(b + "." for b in step.blocks())
    for name, ref in step.params.items():
        m = step.metas[ref.id]
        pl = params.get(name, rep)
        b = local_bytes(m.shape, itemsize(m.dtype), pl, mesh_shape)
        p_bytes += b
        if name.startswith(blocks):
            block_bytes += b
        grads = step.grads.get(name, [])
        g = sim.specs.get(grads[-1].id) if grads else None
        if tp_axis is not None and g is not None and isinstance(g.placements[tp_axis], Partial):
            tp_grad_bytes += b
    colls = [(c.kind, c.nbytes, 1, c.axis) for c in sim.collectives]
    n_blocks = max(1, len(step.blocks()))
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
    comm_s = sum(prof.seconds(kind, b, n, prof.inside_node(mesh_shape, axis)) for kind, b, n, axis in colls)
    flops = sim.flops + recompute * sim.forward_flops
    compute_s = flops / prof.flops_per_s + sim.touched_bytes * (1 + 0.5 * recompute) / prof.bytes_per_s
    overhead_s = sim.ops * (1 + 0.5 * recompute) * prof.op_s
    # the optimizer's update: passes over the parameters' bytes (on this rank's shard from ZeRO-1
    # on) and kernels per parameter tensor; ZeRO-1/2 also point a shard at each parameter, give it
    # its gradient and copy the gathered parameters back
    passes, kernels = update_cost(state_factor)
    tensors = len(step.params)  # (tied parameters once)
    compute_s += passes * (p_bytes // dp if zero else p_bytes) / prof.bytes_per_s
    if zero in (1, 2) and dp > 1:
        compute_s += 2 * p_bytes / prof.bytes_per_s
        kernels += 4
    overhead_s += tensors * kernels * prof.kernel_s
    s_bytes = int(state_factor * p_bytes) // (dp if zero >= 1 else 1)
    # activations and gradients: the replay's peak of live bytes (gradients whole: ZeRO-2 reduces
    # them after the backward, so at the peak they are whole too)
    live = int(sim.live_peak - recompute * (sim.live_peak - sim.live_peak_recompute))
    # the optimizer's step, with every gradient alive: DP flattens a bucket of them to all-reduce;
    # ZeRO-1/2 hold the gradients' shards, and gather the updated shards (a bucket's rows and the
    # parameters cut from them, besides this rank's piece)
    bucket = min(p_bytes, BUCKET_BYTES)
    if dp > 1 and zero == 0:
        live = max(live, p_bytes + bucket)
    elif dp > 1 and zero in (1, 2):
        live = max(live, p_bytes + 2 * bucket + bucket // dp + p_bytes // dp)
    if zero >= 3:  # the shard, and gathered at the peak the root unit (what no block holds: the
        # embedding, the head) and two blocks (the first re-gathered for its backward while the
        # last's gathers are freed), one with recompute (benchmarks/zero3_peak.py's breakdown)
        unit = block_bytes // n_blocks
        p_bytes = p_bytes // dp + (p_bytes - block_bytes) + unit * (2 - int(recompute >= 1))
    return Prediction(compute_s + comm_s + overhead_s, compute_s, comm_s, p_bytes + s_bytes + live,
                      sum(n for _, _, n, _ in colls), sum(b for _, b, _, _ in colls), overhead_s)


def update_cost(state_factor: float) -> tuple[float, int]:
    """(passes over the parameters' bytes, kernels per parameter tensor) of one optimizer update
    with ``state_factor`` states per parameter (AdamW: about 12 and 10; SGD with momentum 7.5 and 6)."""
    return 3 + 4.5 * state_factor, 2 + int(4 * state_factor)
