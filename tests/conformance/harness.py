"""op_db conformance harness: an op on plain tensors vs the same op on distributed tensors.

Contract. ``run_op(name, variant, backend)`` runs INSIDE one rank of a 4-rank gloo world (every
rank calls it with the same arguments). For the OpInfo ``name`` (``OpInfo.name``, plus
``.variant_test_name`` when it has one) it takes the first few float32 CPU samples (seeded, so
every rank builds the same ones), runs the op on plain tensors (the reference), then on
distributed tensors of the same values laid out by ``variant``:

``replicate``   every tensor input ``Replicate()``
``shard0``      ``Shard(0)`` (0-dim tensors: ``Replicate()``)
``shard_last``  ``Shard(ndim - 1)``
``uneven``      ``Shard(d)`` on the smallest dim whose size the world size does not divide (the
                shards are uneven, some empty when the size is below 4; ties: a middle dim,
                then the later dim); ``Shard(0)`` when every dim divides

and compares ``full_tensor()`` of every output with the reference (``torch.allclose`` rtol 1e-4,
atol 1e-5, equal_nan; integer/bool outputs exactly; shapes and dtypes must match). Backward:
the loss is the sum of ``out.sum()`` over the floating outputs (after the sample's
``output_process_fn_grad``); the gradients of the floating inputs are compared the same way.
``backend`` is ``"ours"`` (``ap.shard_tensor`` on ``ProcessMesh([0, 1, 2, 3])``) or ``"torch"``
(``torch.distributed.tensor.distribute_tensor`` on ``DeviceMesh("cpu", [0, 1, 2, 3])``; only
this harness and ``benchmarks/op_coverage.py`` import ``torch.distributed.tensor``).

Per phase (``forward``, ``backward``) the verdict is one of, worst sample first:

``WRONG``  it ran and a value differs from the reference: a silently wrong result, the worst
``hang``   no answer within the timeout (set by the driver, ``run_ops``)
``error``  it raised (a clear failure); a backward whose forward failed is an error too
``pass``   every sample matched
``skip``   nothing to compare (no float32 samples, no tensor input, not differentiable...)

Random ops (``RANDOM_OPS``) and ops whose values are uninitialised memory (``has_nondeterministic_
output``) are compared by shape and dtype only. Ops that run the fallback (replicate, compute,
replicate) produce the right value and so pass.

The parent side, ``run_ops(world, names, ...)``, calls ``run_op`` once per (op, variant, backend)
through ``world.run`` and turns a hang or a dead world into a ``hang`` verdict (the world
restarts itself on the next call). ``summarize`` computes pass rates.

The harness is split by concept: ``samples`` (op table, samples, layouts),
``compare`` (comparison, verdict records), ``backends`` (the two
libraries, ranks agreeing on each step), this module (running a sample, an op, a list of ops),
``known`` (the known-failures bookkeeping). Their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from tests.conformance.backends import (
    LayoutMismatch,
    RankFailed,
    _Backend,
    _fulls,
    _Ours,
    _step,
    backend_of,
)
from tests.conformance.compare import (
    Mismatch,
    OpResult,
    SampleResult,
    _error_text,
    _loss_terms,
    _total,
    _worst,
    compare,
    shapes_of,
)
from tests.conformance.known import (
    known_failures,
    listed_reason,
    needs_entry,
    stale,
    unlisted,
    updated_known_failures,
    write_known_failures,
)
from tests.conformance.samples import (
    BACKENDS,
    DEFAULT_SAMPLES,
    PHASES,
    RANDOM_OPS,
    SEED,
    STATUS_ORDER,
    VARIANTS,
    WARMUP_TIMEOUT,
    WORLD,
    _fresh,
    _map_tensors,
    _tensors,
    all_op_names,
    op_table,
    opinfo_name,
    samples_of,
    shard_dim,
)


def _run_sample(op: Any, sample: Any, backend: _Backend, variant: str, values: bool,
                want_backward: bool) -> SampleResult:
    """Reference vs distributed on one sample; forward then backward."""
    res = SampleResult(0, shapes_of((sample.input, *sample.args, sample.kwargs)), "skip", "skip")
    # Reference.
    inp, args, kwargs = _fresh(sample)
    if not _tensors((inp, args, kwargs)):
        res.forward_detail = res.backward_detail = "no tensor input"
        return res
    try:
        torch.manual_seed(SEED + 1)
        ref_out = op(inp, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the sample itself is not runnable
        res.forward_detail = res.backward_detail = f"reference raised {_error_text(e)}"
        return res
    ref_leaves = [t for t in _tensors((inp, args, kwargs)) if t.requires_grad]
    ref_grads: list[torch.Tensor | None] | None = None
    bwd_skip = ""
    if not want_backward:
        bwd_skip = "op does not support autograd"
    else:
        try:
            terms = _loss_terms(sample.output_process_fn_grad(ref_out))
            if not terms or not ref_leaves:
                bwd_skip = "no differentiable float output/input"
            else:
                loss = _total(terms)
                ref_grads = list(torch.autograd.grad(loss, ref_leaves, allow_unused=True))
        except Exception as e:  # noqa: BLE001
            bwd_skip = f"reference backward raised {_error_text(e)}"
    ref_value = _map_tensors(ref_out, lambda t: t.detach())

    # Distributed: every step ends with all ranks agreeing on its outcome.
    memo: dict[int, torch.Tensor] = {}
    inp, args, kwargs = _fresh(sample)

    def dist(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            d = backend.distribute(t, shard_dim(tuple(t.shape), variant))
            memo[id(t)] = d.requires_grad_(True) if t.requires_grad else d
        return memo[id(t)]

    def forward() -> Any:
        dinp, dargs, dkwargs = _map_tensors((inp, args, kwargs), dist)
        torch.manual_seed(SEED + 1)
        return op(dinp, *dargs, **dkwargs)

    try:
        out = _step(forward)
        got = _fulls(backend, out)
    except LayoutMismatch as e:
        res.forward, res.forward_detail = "WRONG", f"layout: {e.args[0]}"
        res.backward, res.backward_detail = ("error", "forward was wrong") if ref_grads is not None else ("skip", bwd_skip)
        return res
    except RankFailed as e:  # a clear failure
        res.forward, res.forward_detail = "error", str(e)
        res.backward, res.backward_detail = ("error", "forward failed") if ref_grads is not None else ("skip", bwd_skip)
        return res
    mm = compare(ref_value, got, values)
    if mm is not None:
        res.forward = "WRONG"
        res.forward_detail = f"{mm.where}: {mm.what}" + ("" if math.isnan(mm.max_err) else f" (max err {mm.max_err:.3g})")
        res.max_err = mm.max_err
    else:
        res.forward = "pass"
    if ref_grads is None:
        res.backward, res.backward_detail = "skip", bwd_skip
        return res
    if res.forward != "pass":
        res.backward, res.backward_detail = "error", "forward was wrong"
        return res
    leaves = [memo[id(t)] for t in _tensors((inp, args, kwargs)) if t.requires_grad]

    def backward() -> list[Any]:
        terms = _loss_terms(sample.output_process_fn_grad(out))
        if not terms:
            raise RuntimeError("no differentiable output (requires_grad lost)")
        loss = _total(terms)
        return list(torch.autograd.grad(loss, leaves, allow_unused=True))

    try:
        grads = _step(backward)
        got_grads = _fulls(backend, grads)
    except LayoutMismatch as e:
        res.backward, res.backward_detail = "WRONG", f"layout (backward): {e.args[0]}"
        return res
    except RankFailed as e:
        res.backward, res.backward_detail = "error", str(e)
        return res
    for i, (rg, gg, leaf) in enumerate(zip(ref_grads, got_grads, leaves)):
        if rg is None and gg is None:
            continue
        rg = torch.zeros(leaf.shape, dtype=leaf.dtype) if rg is None else rg
        gg = torch.zeros(leaf.shape, dtype=leaf.dtype) if gg is None else gg
        mm = compare(rg.detach(), gg, values, f"grad[{i}]")
        if mm is not None:
            res.backward = "WRONG"
            res.backward_detail = f"{mm.where}: {mm.what}" + ("" if math.isnan(mm.max_err) else f" (max err {mm.max_err:.3g})")
            res.max_err = mm.max_err if math.isnan(res.max_err) else max(res.max_err, mm.max_err)
            return res
    res.backward = "pass"
    return res


def _fallback_names() -> set[str]:
    try:
        from autoparallel.engine import dispatch
    except Exception:  # noqa: BLE001
        return set()
    return set(getattr(dispatch, "_warned", set()))


def run_op(name: str, variant: str, backend: str, n_samples: int = DEFAULT_SAMPLES) -> OpResult:
    """Verdicts for op_db's op ``name`` under ``variant`` on ``backend`` (every rank alike)."""
    return run_opinfo(op_table()[name], variant, backend, n_samples)


def run_opinfo(op: Any, variant: str, backend: str, n_samples: int = DEFAULT_SAMPLES) -> OpResult:
    """``run_op`` for an OpInfo object (or anything with the same attributes)."""
    t0 = time.perf_counter()
    name = opinfo_name(op)
    result = OpResult(name, variant, backend, "skip", "skip")
    if torch.float32 not in op.supported_dtypes("cpu"):
        result.forward_reason = result.backward_reason = "no float32 support on CPU"
        return result
    try:
        samples = samples_of(op, n_samples)
    except Exception as e:  # noqa: BLE001
        result.forward_reason = result.backward_reason = f"sample generation failed: {_error_text(e)}"
        return result
    if not samples:
        result.forward_reason = result.backward_reason = "no float32 samples"
        return result
    be = backend_of(backend)
    values = name not in RANDOM_OPS and not op.has_nondeterministic_output
    before = _fallback_names()
    guard = be.guard() if isinstance(be, _Ours) else contextlib.nullcontext()
    with warnings.catch_warnings(), guard:
        warnings.simplefilter("ignore")
        for i, sample in enumerate(samples):
            try:
                sr = _run_sample(op, sample, be, variant, values, bool(op.supports_autograd))
            except Exception as e:  # noqa: BLE001 - a harness failure: report, never hide
                sr = SampleResult(i, "?", "error", "error", f"harness: {_error_text(e)}",
                                  traceback.format_exc(limit=3))
            sr.index = i
            result.samples.append(sr)
    result.fallbacks = sorted(_fallback_names() - before)
    for phase in PHASES:
        statuses = [getattr(s, phase) for s in result.samples]
        worst = _worst(statuses)
        first = next(s for s in result.samples if getattr(s, phase) == worst)
        detail = getattr(first, f"{phase}_detail")
        if not values and worst == "pass":
            detail = "random/uninitialised values: shapes and dtypes only"
        setattr(result, phase, worst)
        setattr(result, f"{phase}_reason", detail)
        setattr(result, f"{phase}_where", f"sample {first.index} ({first.shapes})")
    result.seconds = time.perf_counter() - t0
    return result


def worker_run_op(rank: int, name: str, variant: str, backend: str, n_samples: int = DEFAULT_SAMPLES) -> dict[str, Any]:
    """``world.run`` entry point: ``run_op`` as a plain dict."""
    os.environ.setdefault("AP_OP_CONFORMANCE", "1")
    return run_op(name, variant, backend, n_samples).to_dict()


def worker_op_names(rank: int) -> list[str]:
    """``world.run`` entry point: every op_db name (also warms the op table in the workers)."""
    return all_op_names()


# ---- driving from the parent ---------------------------------------------------------------
def _merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One verdict from every rank's: the worst; a disagreement between ranks is noted."""
    base = copy.deepcopy(per_rank[0])
    for phase in PHASES:
        statuses = [r[phase] for r in per_rank]
        worst = _worst(statuses)
        if worst != base[phase]:
            src = next(r for r in per_rank if r[phase] == worst)
            base[phase] = worst
            base[f"{phase}_reason"] = src[f"{phase}_reason"]
        if len(set(statuses)) > 1:
            base[f"{phase}_reason"] += f" [ranks disagree: {statuses}]"
    base["seconds"] = max(r["seconds"] for r in per_rank)
    return base


def run_ops(
    world: Any,
    names: Sequence[str],
    variants: Sequence[str] = VARIANTS,
    backends: Sequence[str] = ("ours",),
    n_samples: int = DEFAULT_SAMPLES,
    timeout: float = 60.0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """``run_op`` for every (op, variant, backend) on ``world`` (a ``tests.world_harness.World``).

    A hang or a crashed world becomes a ``hang`` verdict for that case; the world restarts on
    the next call.
    """
    results = []
    for name in names:
        for variant in variants:
            for backend in backends:
                t0 = time.perf_counter()
                try:
                    rec = _merge_ranks(world.run(worker_run_op, name, variant, backend, n_samples, timeout=timeout))
                except Exception as e:  # noqa: BLE001 - TimeoutError / WorkerError: world restarts
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    rec = OpResult(name, variant, backend, "hang", "hang", why, why).to_dict()
                    rec["seconds"] = time.perf_counter() - t0
                    world.run(worker_op_names, timeout=WARMUP_TIMEOUT)  # restart + op_db import, untimed
                results.append(rec)
                if progress is not None:
                    progress(rec)
    return results


def summarize(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, int]]:
    """Counts of each verdict per (backend, variant, phase)."""
    table: dict[tuple[str, str, str], dict[str, int]] = {}
    for r in records:
        for phase in PHASES:
            c = table.setdefault((r["backend"], r["variant"], phase), dict.fromkeys(STATUS_ORDER, 0))
            c[r[phase]] += 1
    return table


def pass_rate(counts: dict[str, int]) -> float:
    """Passes over the cases that ran (skips excluded)."""
    ran = sum(v for k, v in counts.items() if k != "skip")
    return counts["pass"] / ran if ran else math.nan


__all__ = [
    # samples and layouts
    "BACKENDS", "DEFAULT_SAMPLES", "PHASES", "RANDOM_OPS", "STATUS_ORDER", "VARIANTS", "WARMUP_TIMEOUT", "WORLD",
    "all_op_names", "op_table", "opinfo_name", "samples_of", "shard_dim",
    # comparing
    "Mismatch", "OpResult", "SampleResult", "compare", "shapes_of",
    # running
    "pass_rate", "run_op", "run_opinfo", "run_ops", "summarize", "worker_op_names", "worker_run_op",
    # known failures
    "known_failures", "listed_reason", "needs_entry", "stale", "unlisted", "updated_known_failures",
    "write_known_failures",
]
