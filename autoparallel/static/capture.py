"""Capture: a call of a step recorded per rank as a ``torch.fx`` program of local ops, on fake tensors.

The step runs once under ``make_fx`` on **fake tensors** (no data, no compute, no real
collective) while the engine works as in eager mode: every DistTensor op reaches the
dispatcher, which plans it from metadata and runs its local step on the (fake) shards, and
``make_fx`` records those local ops. Collectives are issued as functional collectives
(``runtime.comm.functional_collectives``), so they are graph nodes too. The program's inputs are
the local shards the step reads, in a fixed order: the caller's state (the parameters' and
buffers' shards: ``standing_in`` puts the fake ones in their place for the trace) and its
arguments. Running the program on the real shards does what the eager step would (the caller
runs it at once for the call that captured it), with no dispatch, no planning and no Python per
op. Nothing of the step ran for real during the capture, so a refused capture leaves nothing
done twice: the caller runs the call eagerly.

A capture is refused (``Capture.refused`` names why; the caller then stays eager for that
input signature, with a warning) when a replay could not repeat the call: a Python value read
from a tensor in the step (``.item()``, ``bool(t)``: data-dependent control flow would be baked
in), a point-to-point transfer (pipelines), or an op that ran replicated because it has no rule.

What the traced step assigns to its modules is found and put back (``TensorSlots``: buffers and
tensor attributes, which a caller returns from the program and assigns at each run;
``PlainValues``: plain Python attributes, which a program cannot repeat): a trace leaves no fake
tensor in a module.

Random ops are recorded as the ops they are: a random DistTensor is drawn whole on every rank
from torch's default generator (``spmd_rules.random_ops``), so the program draws from that
generator when it runs, in the order eager would: dropout masks equal eager's for the same seed.
The trace draws nothing (the generator's state is restored after it). A step that also resets
the generator (activation recompute restoring it so the recomputed dropout draws the forward's
masks) is refused when it draws: the reset is Python, not an op.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import autoparallel
import spmd_rules
from autoparallel import compat
from autoparallel.engine import dispatch, layout
from autoparallel.log import logger
from autoparallel.runtime import agree, comm
from autoparallel.runtime.debug import CommDebugMode, CommRecord
from autoparallel.static.sizes import OpenSizes, bind_free_sizes
from spmd_rules.random_ops import draws_random

aten = torch.ops.aten
# Ops whose result is a Python value read from a tensor (the engine's own list, and the composite
# ones a plain-tensor region may record): a replay would bake the value in.
VALUE_OPS = layout.VALUE_OPS | {aten.item.default, aten.allclose.default}


@dataclass
class Capture:
    """What one capture produced: the program (None when refused), why it was refused, the
    collectives it issues (recorded again at each run) and, for a capture of open sizes, the
    symbols of its inputs' open dims and the shape environment's record of its guards."""

    program: torch.fx.GraphModule | None
    refused: str
    records: tuple[CommRecord, ...] = field(default_factory=tuple)
    symbols: tuple[tuple[Any, ...], ...] = ()  # per input, each open dim's size as made (``OpenSizeFakes.fake``)
    open_sizes: compat.OpenSizeFakes | None = None

    def sizes(self, dims: Sequence[tuple[int, ...]]) -> tuple[OpenSizes | None, str]:
        """(the sizes a program captured with ``dims`` open serves (None: captured at fixed sizes),
        why it serves none: '' when it does)."""
        if self.open_sizes is None:
            return None, ""
        sizes = OpenSizes.of(self.symbols, dims, self.open_sizes)
        return sizes, "" if sizes is not None else "its guards speak of sizes that are no input's"


class Watch:
    """An observer of the op path during a capture: notes the first reason a replay could not
    repeat the call, and lets every op run."""

    def __init__(self) -> None:
        self.reason = ""

    def observe(self, func: Any, decision: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                run: Callable[[], Any]) -> Any:
        if not self.reason:
            if func in VALUE_OPS:
                self.reason = (f"{func} reads a Python value from a DistTensor (data-dependent Python in the step"
                               f"{where(traceback.extract_stack())})")
            elif decision.fallback:
                self.reason = f"{func} has no SPMD rule and runs replicated"
        return run()


def plain_trained(module: torch.nn.Module) -> str | None:
    """The name of a parameter of ``module`` that requires grad and is not laid out (None: none).
    Its first op lays it out in place (``engine.dispatch.adopt_plain_leaves``), which a trace on
    fake tensors cannot do for real: such a step runs eagerly, and the next call, with the
    parameter laid out (a new signature), is captured."""
    return next((n for n, p in module.named_parameters() if p.requires_grad and not layout.is_dist(p)), None)


def plain_trained_reason(name: str, module: torch.nn.Module | None = None) -> str:
    """Why a step with the plain trainable parameter ``name`` runs eagerly (``plain_trained``);
    with ``module``, a model none of whose parameters is laid out is said to be one."""
    if module is not None and not any(layout.is_dist(p) for p in module.parameters()):
        return (f"no parameter of the model is a DistTensor (parameter {name!r} is plain): the model is not laid out "
                "(ap.shard_layer, ap.parallelize), so every rank trains its own copy and nothing is captured")
    return (f"parameter {name!r} is a plain tensor that requires grad: this call lays it out at its first op "
            "(the calls after it are captured)")


@contextmanager
def standing_in(state: Sequence[torch.Tensor], modules: Iterable[torch.nn.Module],
                fakes: Sequence[torch.Tensor]) -> Iterator[None]:
    """For the trace, ``fakes[i]`` stands in for ``state[i]`` (a parameter or buffer): a
    DistTensor keeps its object and takes the fake shard (so the optimizer, ZeRO-3's units and
    tied modules, which hold the object, see it); a plain tensor (a buffer, a frozen parameter)
    is replaced in the slots of ``modules`` that hold it. Everything is put back on exit."""
    swapped: list[tuple[Any, torch.Tensor]] = []
    plain: dict[int, torch.Tensor] = {}
    try:
        for t, f in zip(state, fakes):
            if layout.is_dist(t):
                swapped.append((t, layout.local_of(t)))
                layout.set_local_(t, f)
            else:
                plain[id(t)] = f
        with compat.tensors_stood_in(modules if plain else (), plain):
            yield
    finally:
        for t, local in swapped:
            layout.set_local_(t, local)


class TensorSlots:
    """The tensors ``modules`` hold in their buffer slots and plain attributes when a trace
    starts: which ones the traced step assigned anew (``self.x = self.x * 0.5``, ``self.cache =
    h``), and putting the old ones back (a trace must leave no fake tensor in a module).

    A parameter's name is no attribute here: ZeRO-3 seats the gathered parameter under it."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        unique = {id(m): m for m in modules}.values()
        self.before = [(m, dict(compat.own_buffers(m)), _tensor_attributes(m)) for m in unique]

    def assigned(self) -> list[tuple[torch.nn.Module, str, bool, Any]]:
        """(module, name, whether a buffer, the value now) of each slot assigned since."""
        out: list[tuple[torch.nn.Module, str, bool, Any]] = []
        for m, buffers, attrs in self.before:
            now = compat.own_buffers(m)
            out += [(m, k, True, t) for k, t in now.items() if k not in buffers or buffers[k] is not t]
            out += [(m, k, True, None) for k in buffers if k not in now]
            now = _tensor_attributes(m)
            out += [(m, k, False, t) for k, t in now.items() if attrs.get(k) is not t]
            out += [(m, k, False, m.__dict__.get(k)) for k in attrs if k not in now]
        return out

    def restore(self) -> None:
        """Every slot back to what it held when this was made."""
        for m, buffers, attrs in self.before:
            own = compat.own_buffers(m)
            for k in [k for k in own if k not in buffers]:
                del own[k]
            own.update(buffers)
            for k in [k for k in _tensor_attributes(m) if k not in attrs]:
                del m.__dict__[k]
            m.__dict__.update(attrs)


def kept_in_place(state: Sequence[torch.Tensor], modules: Iterable[torch.nn.Module], fakes: Sequence[torch.Tensor],
                  fn: Callable[[], Any]) -> Any:
    """``fn()`` in a trace with ``fakes`` standing in for ``state`` (``standing_in``), for a caller
    whose programs keep no module state the step sets: raises ``comm.CaptureError`` where the step
    assigned a buffer or tensor attribute (``TensorSlots``) or laid out one of ``state``'s
    DistTensors anew (a buffer's update moved); every slot is put back either way."""
    modules = list(modules)
    with standing_in(state, modules, fakes):
        slots = TensorSlots(modules)
        specs = [layout.spec_or_none(t) for t in state]
        try:
            out = fn()
            assigned = slots.assigned()
            relaid = [t for t, f, s in zip(state, fakes, specs)
                      if layout.is_dist(t) and (layout.local_of(t) is not f or layout.spec_of(t) != s)]
        finally:
            slots.restore()  # (no fake tensor is left in a module)
    if assigned:
        m, name, buffer, _ = assigned[0]
        raise comm.CaptureError(f"the forward assigns the {'buffer' if buffer else 'tensor attribute'} "
                                f"{type(m).__name__}.{name} (a program keeps no assigned module state)")
    if relaid:
        raise comm.CaptureError("the forward lays out one of its parameters or buffers anew (a buffer's update moved)")
    return out


def _tensor_attributes(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = compat.own_parameters(m)
    return {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor) and k not in params}


class PlainValues:
    """The plain Python attribute values of ``model``'s modules (``compat.module_values``) before
    a trace: which ones the traced step wrote (a counter, a flag it flips), and putting them back
    (a refused capture is run eagerly, which writes them again)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.before = [(name, m, compat.module_values(m)) for name, m in model.named_modules()]

    def written(self) -> list[str]:
        """'module.attribute' of each value the step wrote."""
        out = []
        for name, m, values in self.before:
            now = compat.module_values(m)
            if now != values:
                keys = sorted({k for k, _ in set(now) ^ set(values)})
                out += [f"{name}.{k}" if name else k for k in keys]
        return out

    def restore(self) -> None:
        for _, m, values in self.before:
            old = dict(values)
            for k, _ in compat.module_values(m):
                if k not in old:
                    del m.__dict__[k]
            m.__dict__.update(old)


def capture(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
            open_dims: Sequence[tuple[int, ...]] | None = None, recompile: bool = True, apart: bool = False) -> Capture:
    """Record ``fn(*fakes)`` per rank, ``fakes`` being fake tensors of ``inputs`` (see the
    module docstring; ``fn`` puts them in place with ``standing_in``).

    ``fn`` returns a flat list of local tensors; they are the program's outputs in order.
    ``open_dims`` (per input, the dims left open: ``autoparallel.static.sizes``) makes those
    sizes symbolic: the program reads them from its inputs, and the capture's shape environment
    holds the guards under which it is the step. ``recompile=False``: the program's code is left
    for the caller to generate, after its own edits of the graph (each generation of a large
    program's code costs tens of milliseconds). ``apart``: kernels reduce apart what they would
    reduce together (``comm.reduce_apart``), for a caller whose passes merge them back where
    nothing else pays for it.
    """
    watch = Watch()

    def traced(*fakes: torch.Tensor) -> Any:
        with agree.stand_ins({id(f): r for f, r in zip(fakes, inputs)}):  # what each fake stands for
            return fn(*fakes)

    # (no module hooks of its own: a capture runs the same modules' code as an uncaptured step)
    # (saved-tensor hooks of the caller's context, as ``torch.utils.checkpoint``'s around a call captured inside
    # it, would take the trace's fake tensors: the trace keeps its own, the program's runs meet the caller's)
    with CommDebugMode(modules=False, isolated=True) as seen, comm.functional_collectives(apart), dispatch.observed_by(watch), \
            torch.random.fork_rng(devices=[]), compat.RngResets() as resets, \
            torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        sizes = compat.OpenSizeFakes() if open_dims is not None and any(open_dims) else None
        symbols: tuple[tuple[Any, ...], ...] = ()
        try:
            # fake tensors of static shapes, without a symbolic shape environment (make_fx's
            # "fake" mode builds one: every op's meta kernel then runs its guards, ~1.5x the time);
            # a tensor met that is no input (a constant the step reads) is recorded as a constant
            if sizes is None:
                mode = compat.static_fake_mode()
                fakes = [mode.from_tensor(t) for t in inputs]
            else:
                mode = sizes.mode
                made = [sizes.fake(t, dims) for t, dims in zip(inputs, open_dims or ())]
                fakes = [f for f, _ in made]
                symbols = tuple(syms for _, syms in made)
            with mode, dispatch.symbolic_decisions() if sizes is not None else contextlib.nullcontext():
                gm = make_fx(traced, tracing_mode="real")(*fakes)
        except comm.CaptureError as e:
            return Capture(None, str(e))
        except RuntimeError as e:  # make_fx refuses a Python value read from a traced tensor
            if "_local_scalar_dense" in str(e) or "data-dependent" in str(e):
                return Capture(None, "the step reads a Python value from a tensor (data-dependent Python in the step"
                                     f"{where(traceback.extract_tb(e.__traceback__))})")
            if sizes is not None:  # the open sizes tripped the trace: the caller captures at these sizes
                logger.debug("static: a capture with open sizes failed", exc_info=True)
                return Capture(None, f"tracing with open sizes failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                               open_sizes=sizes)
            # anything else the tracing trips on: the caller runs the step eagerly, where an error
            # of the step itself raises again (on every rank alike)
            return Capture(None, f"tracing the step failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        except Exception as e:  # noqa: BLE001  (open sizes: the caller captures at these sizes instead)
            if sizes is None:
                raise
            logger.debug("static: a capture with open sizes failed", exc_info=True)
            return Capture(None, f"tracing with open sizes failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    reason = watch.reason or _graph_reason(gm)
    if not reason and resets.count and draws(gm):
        reason = ("the step resets the random generator and draws random numbers (activation recompute re-drawing "
                  "dropout masks: ap.recompute or torch.utils.checkpoint): a replay cannot repeat the reset")
    if not reason and sizes is not None:
        reason = bind_free_sizes(gm, symbols, open_dims or ())
        reason = reason and f"tracing with open sizes failed ({reason})"
    if reason:
        return Capture(None, reason, open_sizes=sizes)
    gm.graph.eliminate_dead_code()
    if recompile:  # (False: the caller edits the graph further and recompiles it once)
        gm.recompile()
    # a replay records these again, with no time of their own (the program runs as a whole)
    return Capture(gm, "", tuple(replace(r, seconds=0.0) for r in seen.records), symbols, sizes)


def _kept(t: Any) -> Any:
    return t


_LIBRARIES = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, autoparallel, spmd_rules))


def where(frames: traceback.StackSummary) -> str:
    """``': at file:line (code)'`` of the innermost frame of ``frames`` in the user's code (not torch's,
    nor this library's): the line a warning about the step can point to ('' when none is)."""
    for f in reversed(frames):
        if f.filename.startswith(_LIBRARIES) or f.filename.startswith("<"):
            continue
        return f": at {f.filename}:{f.lineno} ({(f.line or '').strip()[:80]})"
    return ""


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
