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
step (gradients and its buckets), whichever is more. Every decision reads global metadata only:
every rank gets the same plan.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoparallel.auto.plan import Candidate, Plan, Prediction, parse_bytes
from autoparallel.auto.repeat import record
from autoparallel.auto.simulate import Simulation, simulate
from autoparallel.auto.trace import Step, pattern
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.parallelize import ModelPlan, match_plan
from autoparallel.nn.styles import ColWiseParallel, RowWiseParallel, SequenceParallel, VocabParallelEmbedding
from autoparallel.placement import Partial, Placement, Replicate, Shard
from autoparallel.runtime import comm
from autoparallel.spec import itemsize

BUCKET_BYTES = 25 * 2**20  # gradients are reduced in buckets of about this size


@dataclass(frozen=True)
class Profile:
    """The machine the plan is for: per-rank compute and memory throughput, and the network's
    latency per collective (``alpha_s``) and bandwidth (``beta_bytes_per_s``: bytes a rank receives
    per second; ``kind_beta`` overrides it per collective kind, e.g. a backend whose
    reduce-scatter runs as an all-reduce). With ``node_size`` ranks to a node, a mesh axis whose
    groups stay inside a node (ranks laid out row-major: the innermost axes) moves bytes at
    ``node_beta_bytes_per_s`` after ``node_alpha_s`` instead (NVLink against the network)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    alpha_s: float
    beta_bytes_per_s: float
    op_s: float = 0.0  # the framework's own time per op of the step (eager dispatch on the host)
    kind_beta: tuple[tuple[str, float], ...] = ()
    node_size: int = 0  # 0: one network for every axis
    node_alpha_s: float = 0.0
    node_beta_bytes_per_s: float = 0.0
    kernel_s: float = 0.0  # the host time of one plain local kernel (the optimizer's update runs such kernels)

    def seconds(self, kind: str, nbytes: float, count: int = 1, inside_node: bool = False) -> float:
        """Time of ``count`` collectives of ``kind`` moving ``nbytes`` (received per rank) in all,
        over a mesh axis inside a node or not."""
        if inside_node and self.node_size:
            return count * self.node_alpha_s + nbytes / self.node_beta_bytes_per_s
        beta = dict(self.kind_beta).get(kind, self.beta_bytes_per_s)
        return count * self.alpha_s + nbytes / beta

    def inside_node(self, mesh_shape: tuple[int, ...], axis: int) -> bool:
        """Whether each group of ``axis`` of a row-major mesh of ``mesh_shape`` stays in one node."""
        if not self.node_size or axis < 0:
            return False
        span = 1
        for n in mesh_shape[axis:]:
            span *= n
        return span <= self.node_size and self.node_size % span == 0


# Nodes of 8 H100-class GPUs (bf16 dense peak ~989 TFLOPS at ~50 % achieved): NVLink inside a
# node (~360 GB/s of all-reduce bus bandwidth, ~15 us), 400 Gb/s per GPU between nodes (~45 GB/s,
# ~30 us); ~20 us of host time per eager op.
H100 = Profile("h100", 0.5 * 989e12, 2.0e12, 30e-6, 45e9, 20e-6, (), 8, 15e-6, 360e9, kernel_s=5e-6)
# The eager engine's host time per op on this kind of machine (dispatch, rule lookup, wrapping),
# on one core of its own.
LOCAL_OP_S = 40e-6


@functools.cache
def _local_throughput() -> tuple[float, float, float]:
    """(FLOP/s, bytes/s, seconds per small kernel) of this process, measured once (~0.1 s): a
    256 x 256 matmul, an in-place multiply of 4 MiB and of 64 floats."""
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    x = torch.empty(1 << 20)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 0.05:
        a @ b
        n += 1
    flops = n * 2 * 256**3 / (time.perf_counter() - t)
    t = time.perf_counter()
    m = 0
    while time.perf_counter() - t < 0.03:
        x.mul_(1.0)
        m += 1
    bw = m * 2 * x.numel() * 4 / (time.perf_counter() - t)
    tiny = torch.empty(64)
    t = time.perf_counter()
    for _ in range(200):
        tiny.mul_(1.0)
    kernel = (time.perf_counter() - t) / 200
    return flops, bw, kernel


@functools.cache
def _network() -> tuple[float, dict[str, float]] | None:
    """(seconds per collective, {kind: bytes received per second}) of the started world's
    backend, measured once per process (~0.5 s on gloo over loopback): the latency from
    all-reduces of 4 bytes, each kind's bandwidth from collectives of 4 MiB less that latency;
    the kinds take turns over nine rounds and each figure is the median of its rounds (a slow
    moment of a shared machine hits one round, not the figure).
    None without a world of two or more ranks."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    n = dist.get_world_size()
    small = torch.zeros(1, device=device)

    def timed(run: Callable[[], Any]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def runs(numel: int) -> dict[str, tuple[Callable[[], Any], float]]:
        """kind -> (one collective over ``numel`` floats, bytes a rank receives as the planner counts them)"""
        piece = torch.zeros(numel // n, device=device)
        whole = torch.zeros(piece.numel() * n, device=device)
        size = whole.numel() * 4
        return {"all_reduce": (lambda: dist.all_reduce(whole), 2 * (n - 1) / n * size),
                "all_gather": (lambda: comm.all_gather_flat(whole, piece), (n - 1) / n * size),
                "reduce_scatter": (lambda: comm.reduce_scatter_flat(piece, whole), (n - 1) / n * size)}

    big = runs(1 << 20)  # 4 MiB of floats
    kinds = []
    for kind, (run, _) in big.items():
        try:
            run()
        except (RuntimeError, NotImplementedError):  # not offered by this backend: priced as the default
            continue
        kinds.append(kind)
    for _ in range(2):
        dist.all_reduce(small)
    alphas: list[float] = []
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(9):
        alphas += [timed(lambda: dist.all_reduce(small)) for _ in range(3)]
        for kind in kinds:
            times[kind].append(timed(big[kind][0]))
    alpha = statistics.median(alphas)
    return alpha, {kind: big[kind][1] / max(statistics.median(times[kind]) - alpha, 1e-9) for kind in kinds}


def local_profile(world: int) -> Profile:
    """This machine, ``world`` ranks sharing its cores. Inside a started world of two or more
    ranks the network is measured too (``_network``); otherwise gloo over loopback is assumed
    (0.2 ms per collective, 1 GB/s). Rank 0's figures are used on every rank (one broadcast), so
    every rank prices, and chooses, alike."""
    from autoparallel.runtime.world import ensure_world

    ensure_world()  # under torchrun: the world, so every rank takes rank 0's figures
    flops, bw, kernel = _local_throughput()
    alpha, betas = _network() or (2e-4, {})
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        measured = [(flops, bw, kernel, alpha, betas)]
        dist.broadcast_object_list(measured, src=0)
        flops, bw, kernel, alpha, betas = measured[0]
    share = min(1.0, (os.cpu_count() or 1) / max(1, world)) / max(1, torch.get_num_threads())
    return Profile("local", flops * share, bw * share, alpha, betas.get("all_reduce", 1e9), LOCAL_OP_S / max(share, 1e-3),
                   tuple(sorted(betas.items())), kernel_s=kernel / max(share, 1e-3))


def _profile(profile: Any, world: int) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if profile in (None, "local"):
        return local_profile(world)
    if profile == "h100":
        return H100
    raise ValueError(f"ap.auto_parallel: profile must be 'local', 'h100' or an ap.auto.Profile, got {profile!r}")


def _state_factor(optimizer: Any) -> float:
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
    seen_patterns: set[str] = set()
    paired: set[str] = set()
    for i, a in enumerate(linears):
        pa = pattern(a)
        if a in paired or pa in seen_patterns:
            continue
        seen_patterns.add(pa)
        col = {f"{a}.weight": (Shard(0),), f"{a}.bias": (Shard(0),)}
        sim = simulate(step, mesh, col, r, {a: (Replicate(), None)}, memo=memo)
        b = next((n for n in linears[i + 1:] if n not in paired and _split_features(sim.edges.get(("in", n)))), None)
        if b is None:
            continue
        row = {**col, f"{b}.weight": (Shard(1),)}
        sim = simulate(step, mesh, row, r, {a: (Replicate(), None), b: (Shard(-1), Replicate())}, memo=memo)
        if any(not c.backward and c.module != b for c in sim.collectives):
            continue  # something between needs the whole value: no pair
        paired |= {a, b}
        seen_patterns.add(pattern(b))
        styles[pa] = ColWiseParallel()
        styles[pattern(b)] = RowWiseParallel()
        la, lb = modules[a], modules[b]
        assert isinstance(la, nn.Linear) and isinstance(lb, nn.Linear)
        divisible[f"{pa} out_features"] = la.out_features
        divisible[f"{pattern(b)} in_features"] = lb.in_features
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
            sp_styles[pattern(n)] = SequenceParallel()
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


def _local_bytes(shape: tuple[int, ...], itemsize: int, pl: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> int:
    n = itemsize
    sizes = list(shape)
    for p, k in zip(pl, mesh_shape):
        if isinstance(p, Shard) and sizes:
            d = p.dim % len(sizes)
            sizes[d] = -(-sizes[d] // k)
    for s in sizes:
        n *= s
    return n


def _price(step: Step, sim: Simulation, mesh_shape: tuple[int, ...], dp_axis: int | None, tp_axis: int | None,
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
        b = _local_bytes(m.shape, itemsize(m.dtype), pl, mesh_shape)
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
    passes, kernels = _update_cost(state_factor)
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


def _update_cost(state_factor: float) -> tuple[float, int]:
    """(passes over the parameters' bytes, kernels per parameter tensor) of one optimizer update
    with ``state_factor`` states per parameter (AdamW: about 12 and 10; SGD with momentum 7.5 and 6)."""
    return 3 + 4.5 * state_factor, 2 + int(4 * state_factor)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- the search ---------------------------------------------------------------------------------
def auto_parallel(model: nn.Module, world: int | None = None, example: Any = None, loss: Callable[..., Any] | None = None,
                  optimizer: Any = "adamw", memory_budget: Any = None, mesh: ProcessMesh | None = None,
                  profile: Any = None, max_tp: int = 8, verbose: bool = False, extrapolate: bool = True) -> Plan:
    """Find a parallel plan for ``model`` on ``world`` ranks (see the module docstring).

    ``example``: one global batch as the model takes it (``(x, y)`` with ``loss=fn`` called as
    ``fn(model(x), y)``; a dict of keyword arguments for ``transformers`` models with labels; fake
    or meta tensors work). ``optimizer``: ``"adamw"``, ``"sgd"`` or the optimizer (its state size).
    ``memory_budget``: per rank (``"70GiB"``, bytes). ``mesh``: fix the mesh (its shape and axis
    names ``dp`` / ``mp``) instead of choosing one. ``profile``: ``"local"`` (this machine,
    measured), ``"h100"``, or an ``ap.auto.Profile``. ``extrapolate``: a model with N >= 4 identical
    blocks is recorded with two and three of them and priced for N (exact for identical blocks;
    ``autoparallel.auto.repeat``); False records every block. Returns an ``ap.Plan``; raises ``ValueError``
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
    state_factor = _state_factor(optimizer)
    started = time.perf_counter()
    recording = record(model, example, loss, extrapolate)  # (before the profile's collectives: an untraceable step raises first)
    step = recording.step
    prof = _profile(profile, world)
    tp_plans = [(label, _without(tp_plan, model, fixed), sp)
                for label, tp_plan, sp in family_plans(model) or found_plans(model, recording.short)]
    tp_plans += [v for t in tp_plans if (v := whole_vocabulary(model, step, *t)) is not None]
    meshes: list[tuple[int, int]] = []
    if mesh is not None:
        names = mesh.dim_names
        if mesh.ndim == 1:
            meshes = [(1, world)] if names[0] in ("mp", "tp") else [(world, 1)]
        elif mesh.ndim == 2 and "dp" in names and any(n in names for n in ("mp", "tp")):
            meshes = [(mesh.shape[names.index("dp")], world // mesh.shape[names.index("dp")])]
        else:
            raise ValueError(f"ap.auto_parallel: mesh axes {names} are not ['dp'], ['mp'] or ['dp', 'mp']")
    else:
        meshes = [(world // t, t) for t in _divisors(world) if t <= max_tp]
    seq_len = _seq_len(step)
    memo: dict[Any, Any] = {}  # decisions shared by the replays (same mesh, same layouts: same choice)
    priced: list[tuple[float, float, Candidate, Plan]] = []
    for dp, tp in meshes:
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
            sim = recording.simulate(sim_mesh, params, inputs, io, tp_axis if tp_axis is not None else 0, memo)
            blocks = step.blocks()
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                def price(k: int, zero: int = zero) -> Prediction:  # k of the blocks recomputed
                    return _price(step, sim, shape, dp_axis, tp_axis, params, zero, k / max(1, len(blocks)),
                                  state_factor, prof)
                counts = [0, len(blocks)] if blocks else [0]
                if budget is not None and len(counts) == 2 and price(0).memory_bytes > budget >= price(counts[1]).memory_bytes:
                    # recompute as a per-block choice: the fewest blocks that bring the peak within the budget
                    counts.insert(1, next(k for k in range(1, len(blocks) + 1) if price(k).memory_bytes <= budget))
                for k in dict.fromkeys(counts):
                    pred = price(k)
                    rec = "" if k == 0 else " recompute" if k == len(blocks) else f" recompute {k}/{len(blocks)}"
                    name = f"dp{dp} x tp{tp}" + (f" {label}" if tp > 1 else "") + (f" zero{zero}" if zero else "") + rec
                    feasible = budget is None or pred.memory_bytes <= budget
                    recompute = ({} if k == 0 else {pattern(blocks[0]): "full"} if k == len(blocks)
                                 else {b: "full" for b in sorted(blocks, key=_index)[:k]})
                    styles = dict(tp_plan) if tp_plan is not None else {}
                    plan = Plan(styles, shape, names, zero, recompute, tp_plan.divisible if tp_plan is not None else {},
                                pred, None, "", "auto")
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
        on = (f"the given mesh's tensor-parallel axis of {meshes[0][1]}" if mesh is not None
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
