"""The machine a plan is priced for: ``Profile`` (compute and memory throughput, the network's
latency and bandwidth per collective kind, inside a node and between nodes), the H100-class
profile, and the local profile measured on this machine (and, inside a started world, its
backend)."""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.runtime import comm


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
    # the part of a core each rank computes on while every rank computes (below 1 where ranks
    # outnumber the cores; the figures above are at that share): a waiting rank's part goes to the others
    core_share: float = 1.0

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
    all-reduces of 4 bytes between short computations (as a step issues them; ranks sharing
    cores wait for each other's turn), each kind's bandwidth from collectives of 4 MiB less the
    latency of an idle world;
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
    betas = {kind: big[kind][1] / max(statistics.median(times[kind]) - alpha, 1e-9) for kind in kinds}
    # a step computes between its collectives: where ranks share cores each collective also
    # waits for the last rank to get its turn. Latency in a step = a chain of short computations
    # each followed by a 4-byte all-reduce, less the same chain without them (median of 3)
    scratch = torch.empty(1 << 14, device=device)

    def chain(collectives: bool) -> None:
        for _ in range(20):
            for _ in range(8):
                scratch.mul_(1.0)
            if collectives:
                dist.all_reduce(small)

    busy = [(timed(lambda: chain(True)) - timed(lambda: chain(False))) / 20 for _ in range(3)]
    return max(alpha, statistics.median(busy)), betas


CACHE_ENV = "AUTOPARALLEL_PROFILE_CACHE"  # the file the measured network is kept in ("": none)


def _cache_path() -> str | None:
    path = os.environ.get(CACHE_ENV)
    if path is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "autoparallel", "network.json")
    return path or None


def _kept_network() -> tuple[float, dict[str, float]] | None:
    """``_network()``, kept per machine in a JSON file (``$AUTOPARALLEL_PROFILE_CACHE``, by
    default ``~/.cache/autoparallel/network.json``; empty: not kept) under a key of rank 0's host
    name, the backend, the world size, the cores and torch's version: a later run on the same
    machine and world reads it instead of measuring. Rank 0 reads and writes the file; every rank
    takes what rank 0 has (one broadcast), so every rank measures, or skips measuring, alike."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    path = _cache_path()
    key = (f"{socket.gethostname()}|{dist.get_backend()}|world {dist.get_world_size()}|cores {os.cpu_count()}"
           f"|torch {torch.__version__}")
    kept: list[Any] = [None]
    if dist.get_rank() == 0 and path:
        kept[0] = _read_kept(path).get(key)
    dist.broadcast_object_list(kept, src=0)
    if kept[0] is not None:
        alpha, betas = kept[0]
        return float(alpha), {str(k): float(v) for k, v in betas.items()}
    measured = _network()
    if dist.get_rank() == 0 and path and measured is not None:
        table = _read_kept(path)
        table[key] = [measured[0], measured[1]]
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            scratch = f"{path}.{os.getpid()}"
            with open(scratch, "w") as f:
                json.dump(table, f, indent=1)
            os.replace(scratch, path)
        except OSError:  # a read-only home: measured again next time
            pass
    return measured


def _read_kept(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            table = json.load(f)
        return table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        return {}


def local_profile(world: int) -> Profile:
    """This machine, ``world`` ranks sharing its cores. Inside a started world of two or more
    ranks the network is measured too (``_network``, kept per machine: ``_kept_network``);
    otherwise gloo over loopback is assumed
    (0.2 ms per collective, 1 GB/s). Rank 0's figures are used on every rank (one broadcast), so
    every rank prices, and chooses, alike."""
    from autoparallel.runtime.world import ensure_world

    ensure_world()  # under torchrun: the world, so every rank takes rank 0's figures
    flops, bw, kernel = _local_throughput()
    alpha, betas = _kept_network() or (2e-4, {})
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        measured = [(flops, bw, kernel, alpha, betas)]
        dist.broadcast_object_list(measured, src=0)
        flops, bw, kernel, alpha, betas = measured[0]
    cores = min(1.0, (os.cpu_count() or 1) / max(1, world))
    share = cores / max(1, torch.get_num_threads())
    return Profile("local", flops * share, bw * share, alpha, betas.get("all_reduce", 1e9), LOCAL_OP_S / max(share, 1e-3),
                   tuple(sorted(betas.items())), kernel_s=kernel / max(share, 1e-3), core_share=cores)


def resolve_profile(profile: Any, world: int) -> Profile:
    """``profile=`` of ``ap.auto_parallel``: a Profile, ``"local"`` (or None) or ``"h100"``."""
    if isinstance(profile, Profile):
        return profile
    if profile in (None, "local"):
        return local_profile(world)
    if profile == "h100":
        return H100
    raise ValueError(f"ap.auto_parallel: profile must be 'local', 'h100' or an ap.auto.Profile, got {profile!r}")
