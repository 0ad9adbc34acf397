"""Capture: one call of a step, recorded per rank as a ``torch.fx`` program of local ops.

The step runs once for real under ``make_fx`` (real tensors, so its results are this call's
results) while the engine works as in eager mode: every DistTensor op reaches the dispatcher,
which runs the op's cached local step on the shards, and ``make_fx`` records those local ops.
Collectives are issued as functional collectives (``runtime.comm.functional_collectives``), so
they are graph nodes too; the program's inputs are the local shards the step reads, in a fixed
order. Replaying the program runs the same local ops and collectives on new shards, with no
dispatch, no planning and no Python per op.

A capture is refused (``Capture.refused`` names why; the caller then stays eager for that
input signature, with a warning) when a replay could not repeat the call (``Watch`` looks for
the same things in the eager warm-up call, so most refusals happen before any capture): a Python value read
from a tensor in the step (``.item()``, ``bool(t)``: data-dependent control flow would be
baked in), a point-to-point transfer (pipelines), or an op that ran replicated because it has
no rule.

Random ops are recorded as the ops they are: a random DistTensor is drawn whole on every rank
from torch's default generator (``spmd_rules.random_ops``), so the program draws from that
generator when it runs, in the order eager would: dropout masks equal eager's for the same seed.
A step that also resets the generator (activation recompute restoring it so the recomputed
dropout draws the forward's masks) is refused when it draws: the reset is Python, not an op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import compat
from autoparallel.engine import dispatch, layout
from autoparallel.runtime import comm
from autoparallel.runtime.debug import CommDebugMode, CommRecord
from spmd_rules.random_ops import draws_random

aten = torch.ops.aten
# Ops whose result is a Python value read from a tensor (the engine's own list, and the composite
# ones a plain-tensor region may record): a replay would bake the value in.
VALUE_OPS = layout.VALUE_OPS | {aten.item.default, aten.allclose.default}


@dataclass
class Capture:
    """What one capture produced: the program (None when refused), why it was refused, the
    step's real results (None when the capture stopped part-way: the caller runs the step
    again eagerly), and the collectives it issued (recorded again at each replay)."""

    program: torch.fx.GraphModule | None
    refused: str
    results: Any
    records: tuple[CommRecord, ...] = field(default_factory=tuple)


class Watch:
    """An observer of the op path (a capture, or the eager warm-up call before it): notes the
    first reason a replay could not repeat the call, and lets every op run (the call itself
    completes, eagerly correct)."""

    def __init__(self) -> None:
        self.reason = ""

    def observe(self, func: Any, decision: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                run: Callable[[], Any]) -> Any:
        if not self.reason:
            if func in VALUE_OPS:
                self.reason = f"{func} reads a Python value from a DistTensor (data-dependent Python in the step)"
            elif decision.fallback:
                self.reason = f"{func} has no SPMD rule and runs replicated"
        return run()


def capture(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Capture:
    """Run ``fn(*inputs)`` once for real and record it per rank (see the module docstring).

    ``fn`` returns a flat list of local tensors; they are the program's outputs in order.
    """
    results: list[Any] = []

    def traced(*flat: torch.Tensor) -> list[torch.Tensor]:
        out = fn(*flat)
        results.append(out)
        return out

    watch = Watch()
    # (no module hooks of its own: a capture runs the same modules' code as an uncaptured step)
    with CommDebugMode(modules=False) as seen, comm.functional_collectives(), dispatch.observed_by(watch), compat.RngResets() as resets:
        try:
            with compat.one_fake_mode():  # one mode for every node's metadata: half the capture's time
                gm = make_fx(traced, tracing_mode="real")(*inputs)
        except comm.CaptureError as e:
            return Capture(None, str(e), None)
        except RuntimeError as e:  # make_fx refuses a Python value read from a traced tensor
            if "_local_scalar_dense" in str(e) or "data-dependent" in str(e):
                return Capture(None, "a Python value is read from a tensor (data-dependent Python in the step)", None)
            # anything else the tracing trips on: the caller runs the step eagerly, where an error
            # of the step itself raises again (on every rank alike)
            return Capture(None, f"tracing the step failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", None)
    reason = watch.reason or _graph_reason(gm)
    if not reason and resets.count and draws(gm):
        reason = ("the step resets the random generator and draws random numbers (activation recompute re-drawing "
                  "dropout masks: ap.recompute or torch.utils.checkpoint): a replay cannot repeat the reset")
    if reason:
        return Capture(None, reason, results[0] if results else None)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    # a replay records these again, with no time of their own (the program runs as a whole)
    return Capture(gm, "", results[0], tuple(replace(r, seconds=0.0) for r in seen.records))


def _graph_reason(gm: torch.fx.GraphModule) -> str:
    """Why the recorded program could not replay the call ('' when it can): plain-tensor code
    (a local region) reading a Python value."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in VALUE_OPS:
            return f"{node.target} reads a Python value from a tensor (data-dependent Python in the step)"
    return ""


def draws(gm: torch.fx.GraphModule) -> bool:
    """Whether the program draws random numbers (from torch's default generator, when it runs)."""
    return any(node.op == "call_function" and draws_random(node.target, node.args, node.kwargs) for node in gm.graph.nodes)
