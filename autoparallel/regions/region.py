"""The per-module wrapper of local regions: signature, first call (trace, classify, replay),
local runs. See ``autoparallel.regions``."""

from __future__ import annotations

import copy
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autoparallel import compat, runtime
from autoparallel.compat import tree_flatten, tree_unflatten
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.log import logger
from autoparallel.regions import moves, objects, program
from autoparallel.regions.checks import (
    _classify,
    _pieces,
    _precheck,
    _refused,
    _Trace,
    _uneven,
    _Verdict,
    as_summand,
    reentrant_checkpoint_refusal,
    summands_refusal,
)
from autoparallel.regions.crossing import _Call, _localize, _wrap_out, needs_grad, with_partial
from autoparallel.regions.generic import Family, Model, Proof, Record, Recorder, Stop, point_of, sizes_at
from autoparallel.regions.state import State as _State
from autoparallel.regions.state import autocast_state, flatten_call, ties, unflatten_call
from autoparallel.regions.state import current as _current
from autoparallel.regions.state import read_values as _read_values
from autoparallel.regions.state import slots as _slots
from autoparallel.regions.state import structure as _structure
from autoparallel.regions.symbolic import Certificate, certify
from autoparallel.runtime import agree
from autoparallel.runtime.debug import CommDebugMode
from autoparallel.spec import DistSpec

_ATTR = "_ap_region"
_MODE: list[str] = []          # "trace" (a parent is tracing) or "local" (running on shards)
MAX_SIGNATURES = 16            # per module; beyond that, evict the least recently used signature
#   while signatures are reused (varying sequence lengths), else give up (a changing scalar argument)
MAX_PROVEN = MAX_SIGNATURES // 2  # of those, proven by a trace: kept before family-answered ones
MAX_FAMILIES = 8               # per module: signatures up to sizes (``regions.generic``)
_MISSING = object()


def _captured_regions() -> bool:
    """``AUTOPARALLEL_LOCAL_REGIONS=capture``: regions are captured programs (``regions.program``)."""
    return os.environ.get("AUTOPARALLEL_LOCAL_REGIONS", "1") == "capture"


def _enabled() -> bool:
    return os.environ.get("AUTOPARALLEL_LOCAL_REGIONS", "1") not in ("0", "false", "off")


# ---- public API ----------------------------------------------------------------------------
def enable_local_regions(module: nn.Module) -> nn.Module:
    """Let ``module`` (and, where it is refused, its submodules) run on local shards; in place."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"enable_local_regions: expected an nn.Module, got {type(module).__name__}")
    if _enabled():
        _install(module)
    return module


def disable_local_regions(module: nn.Module) -> nn.Module:
    """Remove the wrappers from ``module`` and every submodule; in place."""
    for m in module.modules():
        region = m.__dict__.pop(_ATTR, None)
        if region is not None:
            m.__dict__.pop("forward", None)
            if region.own_forward is not _MISSING:  # an instance forward set before ours
                m.__dict__["forward"] = region.own_forward
    return module


def local_regions_report(module: nn.Module) -> dict[str, list[str]]:
    """Per wrapped submodule name: one line per signature seen, ``local`` or ``refused: why``."""
    out: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        region = m.__dict__.get(_ATTR)
        if region is not None:
            out[name or "<root>"] = [v.summary() for v in region.verdicts.values()]
    return out


# ---- installing ------------------------------------------------------------------------------
def _install(module: nn.Module) -> None:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers are never called
        for child in module.children():
            _install(child)
        return
    if _ATTR in module.__dict__ or not _has_dist_state(module):
        return
    region = _Region(module)
    module.__dict__[_ATTR] = region
    module.__dict__["forward"] = _Forward(region)


def _has_dist_state(module: nn.Module) -> bool:
    return any(isinstance(t, DistTensor) for t in [*module.parameters(), *module.buffers()])


class _Forward:
    """A wrapped module's ``forward``: calls its region, and shows the module's own signature
    (``inspect.signature(model.forward)``: transformers' ``generate`` and ``Trainer`` decide from it
    which inputs to build and pass, e.g. position ids from a padding mask). An object, not a
    closure: ``copy.deepcopy`` of the module gives the copy its own."""

    def __init__(self, region: _Region) -> None:
        self.region = region
        self.__signature__: inspect.Signature | None = None
        try:
            self.__signature__ = inspect.signature(region.forward)
        except (TypeError, ValueError):  # (a forward without one: a builtin)
            pass
        self.__doc__ = getattr(region.forward, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.region.call(args, kwargs)


# ---- the per-module wrapper --------------------------------------------------------------------
class _Region:
    """The wrapper state of one module: its original forward, slots and verdicts."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward: Callable[..., Any] = module.forward
        self.own_forward = module.__dict__.get("forward", _MISSING)
        self.modules = list(module.modules())
        self.shape = _structure(self.modules)
        self.slots = _slots(module)
        self.verdicts: dict[Any, _Verdict] = {}  # least recently used first
        self.families: dict[Any, Family] = {}    # signatures up to their arguments' sizes
        self.firsts = self.reused = 0  # first calls of a signature, and calls answered by a known one
        self.generic = 0               # first calls answered by their family (no proof)
        self.certified = 0             # of those, answered by a symbolic certificate (no recorder)
        self.children_done = False
        self.calls = program.Calls()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Region:
        """A copied module's wrapper (``copy.deepcopy(model)``: an EMA or reference copy) starts
        with no verdicts: they are caches, and name the original's objects."""
        new = _Region.__new__(_Region)
        memo[id(self)] = new
        fresh = {"verdicts": {}, "families": {}, "calls": program.Calls(), "firsts": 0, "reused": 0, "generic": 0, "certified": 0}
        for k, v in self.__dict__.items():
            new.__dict__[k] = fresh[k] if k in fresh else copy.deepcopy(v, memo)
        return new

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _MODE:  # inside a parent's trace or local run: behave as the plain module
            return self.forward(*args, **kwargs)
        ran = self._call(args, kwargs)
        return self._plain(args, kwargs) if ran is None else ran[0]

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool] | None:
        """``(output, ran locally)`` for a call it ran (locally, or traced on its first
        signature); None: take the DistTensor path."""
        leaves, tree = flatten_call(args, kwargs)
        if _structure(self.modules) != self.shape:  # a submodule, parameter or buffer was added or removed
            self.modules = list(self.module.modules())
            self.shape, self.slots = _structure(self.modules), _slots(self.module)
            self.verdicts.clear()
            self.families.clear()
            self.calls = program.Calls()
        tensors = [_current(m, a) for m, a in self.slots]
        _agree_plain(self.module, leaves, tensors)
        key, held = self._key(leaves, tree, tensors)
        if key is None:
            return None
        if _captured_regions():
            return self._captured(key, leaves, tree, tensors, held)
        try:
            verdict = self.verdicts.get(key)
        except TypeError:  # an unhashable non-tensor argument: no signature
            return None
        if verdict is None:
            kind = next((p[1] for p in key[1] if p[0] is _OBJECT and p[2] is None), None)  # as ``_key`` marked it
            if kind is not None:
                # its entries cannot be walked: what the module writes into it could not be
                # undone between the trace, the replay and the local run (``regions.objects``)
                self._remember(key, _refused(f"an argument is a {kind.__name__} object whose entries a region "
                                             "cannot follow (regions.objects): it runs on DistTensors"))
                return None
            # A new signature is proven (traced, replayed, run locally: the module runs more
            # than once) only where nothing watches each saved tensor or op: inside torch's
            # checkpoint (its forward, and its recompute in the backward), selective
            # checkpoint's modes, offloading hooks or make_fx, the call takes the DistTensor
            # path, as its recompute will (checkpoint compares what both save).
            if compat.observed():
                return None
            family = self.families.get(_family_of(key))
            if family is not None and family.model is not None:
                out = self._generic(family.model, key, leaves, tree, tensors, held)
                if out is not None:
                    self.generic += 1
                    return out, True
            if family is not None and family.refusal:
                # refused at the two latest proven lengths for one reason: take the DistTensor
                # path without a trace (always correct; the children get their turn now)
                self._remember(key, _refused(family.refusal, generic=True))
                return None
            if len(self.verdicts) >= MAX_SIGNATURES:
                if self.reused < self.firsts:  # signatures are not coming back: stop proving new ones
                    return None
                self._evict()
            self.firsts += 1
            return self._first_call(key, leaves, tree, tensors, args, kwargs)
        self.reused += 1
        if len(self.verdicts) > 1:
            self.verdicts[key] = self.verdicts.pop(key)  # now the most recently used
        if verdict.local:
            return self._run_local(verdict, leaves, tree, tensors, held=held), True
        return None

    def _captured(self, key: Any, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                  held: dict[Any, Any] | None) -> tuple[Any, bool] | None:
        """A call as the module's captured program (``regions.program``); None: on DistTensors."""
        if compat.foreign_dispatch_modes():  # a trace of the caller's (make_fx, a static capture): plain
            return None
        try:
            progs, captured = self.calls.find(key, leaves, tree, tensors, self.module, self._inside, held)
        except TypeError:  # an unhashable non-tensor argument: no signature
            return None
        if key not in self.verdicts:
            if len(self.verdicts) >= MAX_SIGNATURES:
                del self.verdicts[next(iter(self.verdicts))]
            self.verdicts[key] = _refused(progs) if isinstance(progs, str) else _Verdict(generic=not captured)
        return None if isinstance(progs, str) else (program.run_call(progs, tensors, leaves, self.module), True)

    def _inside(self, *args: Any, **kwargs: Any) -> Any:
        with _mode("trace"):  # (its submodules' regions: plain)
            return self.forward(*args, **kwargs)

    def _plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The usual DistTensor path; submodules get their own chance to be regions."""
        self._try_children()
        return self.forward(*args, **kwargs)

    def _try_children(self) -> None:
        if not self.children_done:
            self.children_done = True
            for child in self.module.children():
                _install(child)

    def _key(self, leaves: list[Any], tree: Any, tensors: list[torch.Tensor]) -> tuple[Any, dict[Any, Any] | None]:
        """(the signature, or None when this call cannot be a region (no DistTensor at all); the
        entries of its object arguments, as ``objects.entries`` walks them, where it has some:
        its local run starts from that walk)."""
        parts: list[Any] = []
        held: dict[Any, Any] | None = None
        spec_of, stride_of = layout.spec_of, layout.stride_of  # bound once: every call of the module asks
        for i, x in enumerate(leaves):
            if isinstance(x, DistTensor):
                parts.append((spec_of(x), stride_of(x), x.requires_grad))
            elif isinstance(x, torch.Tensor):
                parts.append(("plain", tuple(x.shape), x.dtype, x.requires_grad))
            elif objects.is_object(x):  # keyed by its class and entries: its identity would make
                # every call a new signature (None: entries a region cannot follow)
                sig, found = objects.walked(x, i)
                parts.append((_OBJECT, type(x), sig))
                if sig is not None and found is not None:
                    held = found if held is None else {**held, **found}
            else:
                parts.append(("value", x))
        with compat.attribute_access():
            slot_parts = tuple(
                (spec_of(t), t.requires_grad) if isinstance(t, DistTensor) else ("plain", tuple(t.shape), t.requires_grad)
                for t in tensors
            )
        if not any(isinstance(x, DistTensor) for x in leaves) and not any(isinstance(t, DistTensor) for t in tensors):
            return None, None
        return (tree, tuple(parts), slot_parts, ties(tensors), tuple((m.training, _read_values(m)) for m in self.modules),
                torch.is_grad_enabled(), autocast_state()), held

    # ---- first call of a signature: trace, classify, replay ---------------------------------
    def _first_call(self, key: Any, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """(output, ran locally) of a signature's first call: traced on DistTensors, classified
        and replayed; a local verdict's output is then the local run's (see below)."""
        reason = _precheck(leaves, tensors)
        if reason:
            self.verdicts[key] = _refused(reason)
            return self._plain(args, kwargs), False
        slots: dict[int, int] = {}
        for k, t in enumerate(tensors):
            if isinstance(t, DistTensor):
                slots.setdefault(id(t), k)
        point = point_of(leaves)  # the family's coordinates: the arguments as given
        rng = _rng_states()
        # object arguments (a key/value cache): what the trace, the replay and the local run
        # write into them is undone before the next (``regions.objects``); ``out`` is then
        # ``(output, the tensors written)``
        entry = objects.snapshot(leaves) if objects.any_object(leaves) else []
        state = _State(self.modules)  # the modules' own state: the replay starts from it too
        trace, door, comm, out, writer = self._trace(leaves, slots, args, kwargs)
        sliced: dict[int, DistSpec] = {}
        if (trace.arg_moves and not trace.reason and not trace.writes and len(comm.records) <= door.comm
                and not door.epilogue(tree_flatten(out)[0])[0]):
            # an op took an argument (or a view of one) sliced: trace again with those arguments
            # sliced first (the first trace wrote nothing; attributes its forward set are reset,
            # and the random generators: the second trace draws what the first did) — unless
            # the first is refused for what slicing does not change (it communicates, a style
            # moves data inside it): a second trace would issue its collectives again
            _set_rng_states(rng)
            objects.restore(entry)
            state.rewind()
            sliced = dict(trace.arg_moves)
            leaves = [moves.remake(_dist(x, sliced[k]), sliced[k], None) if k in sliced else x
                      for k, x in enumerate(leaves)]
            args, kwargs = unflatten_call(leaves, tree)
            trace, door, comm, out, writer = self._trace(leaves, slots, args, kwargs)
        traced = objects.snapshot(leaves) if writer is not None else []  # its writes stand where it is refused
        user = out if writer is None else out[0]  # the module's own output
        outs, out_tree = tree_flatten(out)
        moved, in_moves, done_in = door.arguments(leaves)  # the styles' prologue
        why, before, out_moves = door.epilogue(outs)
        if len(comm.records) > door.comm:
            why = why or f"it communicates ({comm.records[0].kind})"
        why = trace.reason or why or summands_refusal(trace, leaves, tensors) or reentrant_checkpoint_refusal(outs, leaves)
        why = why or ("" if writer is None else writer.refusal(trace.reads)) or state.assigned()
        if not why and trace.arg_moves:
            why = f"an op takes an argument sliced ({next(iter(trace.arg_moves.values()))})"
        if not why and sliced:
            why, in_moves, done_in = _sliced_first(sliced, leaves, in_moves, done_in)
        verdict = _refused(why) if why else replace(
            _classify(tree_unflatten(before, out_tree), moved, tensors, trace.summands, trace.reads),
            out_moves=out_moves, in_moves=in_moves, style_moves=door.calls,
            writes=None if writer is None else writer.paths, written_values=() if writer is None else writer.values)
        record = None
        if verdict.local:
            objects.restore(entry)
            traced_state = state.rewind()  # (a plain buffer written in place: the trace's write stands)
            try:
                verdict, record = self._replay(verdict, trace, out, leaves, tree, tensors, done_in)
            finally:
                objects.restore(traced)
                traced_state.rewind()
        self._family(key).add(Proof(point, record, verdict))
        self.verdicts[key] = verdict
        if not verdict.local:
            self._try_children()
            return user, False
        if torch.is_grad_enabled() and _requires_grad(out) and not trace.writes and not state.set_values():
            # The trace's output would take the backward through every op on DistTensors again
            # (about as long as the trace). Proven local, the module runs once more on its shards
            # (writing nothing: no in-place op wrote what the trace did not make) and its output, with the local
            # backward a warm call has, is returned instead.
            # (the epilogue's moves are the trace's: the local run recomputes the same aten
            # calls on the same shards, as the replay checked, so nothing moves twice)
            done = [o if m is not None else None for o, m in zip(outs, verdict.out_moves)] or None
            objects.restore(entry)
            return self._run_local(verdict, leaves, tree, tensors, done=done, done_in=done_in), True
        return user, False

    def _trace(self, leaves: list[Any], slots: dict[int, int], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[_Trace, moves.Traced, CommDebugMode, Any, objects.Writing | None]:
        """The module's forward on DistTensors, traced: (the trace, its styles' door, the
        communication it made, the output, what it wrote into object arguments: None where it
        has none, else the output is ``(output, the tensors written)``). The attributes the
        forward sets are put back as they were when an op sliced an argument
        (``_Trace.arg_moves``: it is traced again)."""
        saved = [(m.__dict__, dict(m.__dict__)) for m in self.modules]
        trace = _Trace(slots=slots, args=leaves)
        writer = objects.Writing(self.forward, leaves) if objects.any_object(leaves) else None
        with CommDebugMode() as comm, _mode("trace"), trace.spy():
            door = moves.Traced(trace, lambda: len(comm.records), leaves)
            with moves.opened(door):
                out = (writer or self.forward)(*args, **kwargs)
        if trace.arg_moves:
            for d, before in saved:
                d.clear()
                d.update(before)
        return trace, door, comm, out, writer

    def _replay(self, verdict: _Verdict, trace: _Trace, out: Any, leaves: list[Any], tree: Any,
                tensors: list[torch.Tensor], done_in: list[Any] | None) -> tuple[_Verdict, Record | None]:
        """Run once on detached local shards; the aten calls must be the traced ones. Also the
        replay's record where the signature may join its family (``regions.generic``)."""
        replay = _Trace(replay=True)
        try:
            with torch.random.fork_rng(devices=[]):
                local_out, replay_inputs = self._run_local(verdict, leaves, tree, tensors, spy=replay, done_in=done_in)
        except Exception as e:  # noqa: BLE001  (any failure on plain tensors refuses the region)
            return _refused(f"it fails on local tensors ({type(e).__name__}: {str(e)[:80]})"), None
        if replay.reason:
            return _refused(replay.reason), None
        if len(replay.ops) != len(trace.ops):
            return _refused(f"on local tensors it runs {len(replay.ops)} aten calls, not {len(trace.ops)}"), None
        for k, (a, b) in enumerate(zip(trace.ops, replay.ops)):
            if a != b:
                return _refused(f"aten call {k} differs on local tensors ({a[0]} vs {b[0]}): "
                                "it reads global sizes or layouts"), None
        dist_leaves, _ = tree_flatten(out)
        local_leaves, local_tree = tree_flatten(local_out)
        if local_tree != verdict.out_tree:
            return _refused("its output structure differs on local tensors"), None
        coord = _coord(verdict)
        inputs = {_storage(t) for t in replay_inputs.values() if t.numel()}
        generic = True
        for d, lo, spec in zip(dist_leaves, local_leaves, verdict.out_specs):
            if spec is None:
                if isinstance(d, torch.Tensor) or d != lo:
                    return _refused("a non-DistTensor output differs on local tensors"), None
                generic = generic and lo is None  # another value may depend on sizes
            elif tuple(lo.shape) != spec.local_shape(coord) or lo.dtype != spec.dtype:
                return _refused("an output's local shape differs from its layout"), None
            elif lo.numel() and _storage(lo) in inputs:
                return _refused("an output aliases an input"), None
            else:
                generic = generic and tuple(lo.shape) == _local_even(spec)
        shapes = tuple(None if s is None else s.local_shape(coord) for s in verdict.out_specs)
        record = replay.split if generic and replay.split is not None and not replay.split.mutates else None
        return replace(verdict, out_local_shapes=shapes), record

    # ---- families: a new length answered by two proven ones --------------------------------
    def _family(self, key: Any) -> Family:
        fkey = _family_of(key)
        family = self.families.get(fkey)
        if family is None:
            if len(self.families) >= MAX_FAMILIES:
                del self.families[next(iter(self.families))]
            family = self.families[fkey] = Family()
        return family

    def _remember(self, key: Any, verdict: _Verdict) -> None:
        """Store a verdict not proven by a trace (its family's), evicting one if full (``_evict``)."""
        if len(self.verdicts) >= MAX_SIGNATURES:
            self._evict()
        self.verdicts[key] = verdict

    def _evict(self) -> None:
        """Drop one verdict: the least recently used of those its family answered (a local run
        away: ``_generic``), unless proven ones hold more than ``MAX_PROVEN`` places. A proven
        verdict took a trace, a replay and a local run (3-5 warm steps): at a length where sizes
        coincide (``t == 16`` where ``4 * t`` meets a width of 64) no family answers, and every
        return to it after its eviction would pay that again."""
        proven = [k for k, v in self.verdicts.items() if not v.generic]
        if len(proven) > MAX_PROVEN or len(proven) == len(self.verdicts):
            del self.verdicts[proven[0]]
        else:
            del self.verdicts[next(k for k, v in self.verdicts.items() if v.generic)]

    def _generic(self, model: Model, key: Any, leaves: list[Any], tree: Any,
                 tensors: list[torch.Tensor], held: dict[Any, Any] | None = None) -> Any:
        """Run a call of a new signature locally where its family answers for it (else None:
        nothing was written; prove it). ``held``: its object arguments' entries (``_key``)."""
        tc = model.admits_point(point_of(leaves))
        if tc is None or _uneven(leaves):  # ranks' local runs would differ
            # (the rest of ``_precheck`` reads what the family's signature fixes: placements,
            # meshes, the parameters' layouts)
            return None
        why = model.refusal_at(tc)
        if why is not None:  # known before running it: prove this length at once
            logger.debug("local region %s: no generic verdict at %d: %s", type(self.module).__name__, tc, why)
            return None
        base = model.b.verdict
        leaves = _moved_in(base, leaves, None)  # the styles' prologue: the local run's arguments
        if base.in_moves and _uneven(leaves):  # an argument sliced into uneven pieces at this length
            return None
        grads = tuple(with_partial(layout.spec_of(x), base.sharded_axes) if isinstance(x, DistTensor) else None
                      for x in leaves)
        pre = replace(base, arg_grads=grads)
        # a symbolic certificate may stand in for the recorder (``regions.symbolic``): built
        # once per model, at its first new length
        if model.certificate is None:
            began = time.perf_counter()
            model.certificate = self._certify(model, pre, leaves, tree, tensors)
            logger.debug("local region %s at %d: %s (%.0f ms)", type(self.module).__name__, tc,
                         f"no symbolic certificate: {model.certificate}" if isinstance(model.certificate, str)
                         else f"symbolic certificate, guards {model.certificate.text}",
                         (time.perf_counter() - began) * 1e3)
        cert = model.certificate
        recorder = None if isinstance(cert, Certificate) and cert.holds(_locals(leaves)) else Recorder(expect=model.skeleton)
        entry = objects.snapshot(leaves, held) if base.writes is not None else []  # (undone where it is no answer)
        try:
            out, call = self._enter_local(pre, leaves, tree, tensors, recorder=recorder, held=held)
        except (Stop, Exception) as e:  # noqa: BLE001  (the proof runs it again, and raises what is real)
            logger.debug("local region %s: no generic verdict: %s: %s", type(self.module).__name__,
                         type(e).__name__, e)
            objects.restore(entry)
            return None
        why = None if recorder is None else model.admits_record(recorder.record, tc)
        outs, out_tree = ([out], None) if isinstance(out, torch.Tensor) else tree_flatten(out)
        if why is None and (not base.out_tree.is_leaf() if out_tree is None else out_tree != base.out_tree):
            why = "its output structure differs"
        specs: list[DistSpec | None] = []
        shapes: list[tuple[int, ...] | None] = []
        for o, s in zip(outs, base.out_specs):
            if why is not None:
                break
            if s is None:
                if o is not None:
                    why = "it returns a value"
                specs.append(None)
                shapes.append(None)
            elif not isinstance(o, torch.Tensor) or isinstance(o, DistTensor) or o.dtype != s.dtype or o.dim() != len(s.shape):
                why = "an output is not its proven kind"
            else:
                glob = tuple(n * _pieces(s, d) for d, n in enumerate(o.shape))
                specs.append(s.with_shape(glob))  # the proven layout, nothing to validate again
                shapes.append(tuple(o.shape))
        if why is not None:
            logger.debug("local region %s: no generic verdict: %s", type(self.module).__name__, why)
            objects.restore(entry)
            return None
        verdict = replace(pre, out_specs=tuple(specs), out_local_shapes=tuple(shapes), generic=True)
        self._remember(key, verdict)
        self.certified += recorder is None
        return _put_written(verdict, leaves, self._wrap_local(verdict, out, call))

    def _certify(self, model: Model, verdict: _Verdict, leaves: list[Any], tree: Any,
                 tensors: list[torch.Tensor]) -> Certificate | str:
        """``model``'s symbolic certificate from a fake run of this call, or why there is none."""
        # (the module's own hooks run around this wrapper, on the real tensors)
        if any(moves.foreign_hooks(m) for m in self.modules[1:]) or compat.global_module_hooks():
            return "a forward hook would see fake tensors"  # (a style's moves through the door)
        grad = torch.is_grad_enabled()
        # as the local run gets them (``_localize``): a DistTensor's shard needs a gradient where
        # it gets one through the region's entry node, a plain tensor as it is
        leaf_grads = [isinstance(x, torch.Tensor) and (needs_grad(x, g, grad) if isinstance(x, DistTensor)
                                                        else x.requires_grad)
                      for x, g in zip(leaves, verdict.arg_grads)]
        slots = [(layout.local_of(t), needs_grad(t, g, grad)) if isinstance(t, DistTensor) else (t, t.requires_grad)
                 for t, g in zip(tensors, verdict.slot_grads)]

        def run(fake_leaves: list[Any], fake_slots: list[torch.Tensor]) -> Any:
            saved = [(m.__dict__, dict(m.__dict__)) for m in self.modules]  # attributes set by the forward
            held = objects.snapshot(leaves) if verdict.writes is not None else []  # and into object arguments
            try:
                for (m, a), f in zip(self.slots, fake_slots):
                    m.__dict__[a] = f
                largs, lkwargs = unflatten_call(fake_leaves, tree)
                door = moves.Local(verdict.style_moves)
                with _mode("local"), moves.opened(door):
                    out = self.forward(*largs, **lkwargs)
                if door.why():
                    raise RuntimeError(door.why())
                return out
            finally:
                objects.restore(held)
                for d, before in saved:
                    d.clear()
                    d.update(before)

        try:
            return certify(model, _locals(leaves), _local_sizes(leaves, model.pa), _local_sizes(leaves, model.pb),
                           leaf_grads, slots, run)
        except Exception as e:  # noqa: BLE001  (no certificate is always safe: the recorder checks)
            return f"it could not be certified ({type(e).__name__}: {str(e)[:80]})"

    # ---- running on shards -------------------------------------------------------------------
    def _run_local(self, verdict: _Verdict, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                   spy: _Trace | None = None, done: list[Any] | None = None, done_in: list[Any] | None = None,
                   held: dict[Any, Any] | None = None) -> Any:
        """Run the module on shards. With ``spy`` (a replay): on detached shards, recording its
        aten calls, returning the local outputs. ``done``/``done_in``: per output / argument leaf,
        its epilogue's / prologue's move already made (``_wrap_local``, ``_moved_in``); ``held``:
        the object arguments' entries as the signature walked them (``_key``)."""
        leaves = _moved_in(verdict, leaves, done_in)
        if spy is not None:
            return self._enter_local(verdict, leaves, tree, tensors, spy=spy)
        out, call = self._enter_local(verdict, leaves, tree, tensors, held=held)
        return _put_written(verdict, leaves, self._wrap_local(verdict, out, call, done))

    def _enter_local(self, verdict: _Verdict, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
                     spy: _Trace | None = None, recorder: Recorder | None = None,
                     held: dict[Any, Any] | None = None) -> Any:
        """The module's forward on shards: ``(local output, the run's _Call)``; with ``spy``
        ``(local output, the detached inputs)``; under ``recorder`` when given (``held``:
        ``_run_local``)."""
        grad = torch.is_grad_enabled()
        want: dict[int, tuple[DistTensor, DistSpec | None]] = {}
        for x, g in zip(leaves, verdict.arg_grads):
            if isinstance(x, DistTensor):
                want.setdefault(id(x), (x, g))
        for t, g in zip(tensors, verdict.slot_grads):
            if isinstance(t, DistTensor):
                want.setdefault(id(t), (t, g))
        call = None if spy is not None else _Call(single=sum(o is not None for o in verdict.out_specs) == 1)
        local = _localize(list(want.values()), grad, call)
        if verdict.summand_slots:  # replicated parameters its ops take as summands: made so once
            done: set[int] = set()
            for t, summand in zip(tensors, verdict.summand_slots):
                if summand is not None and isinstance(t, DistTensor) and id(t) not in done:
                    done.add(id(t))
                    local[id(t)] = as_summand(local[id(t)], layout.spec_of(t), summand)
        if spy is not None:  # plain tensor arguments: copies too (see _localize)
            for x in leaves:
                if isinstance(x, torch.Tensor) and not isinstance(x, DistTensor):
                    local.setdefault(id(x), x.detach().clone())
        largs, lkwargs = unflatten_call([local.get(id(x), x) for x in leaves], tree)
        saved = []
        for (m, a), t in zip(self.slots, tensors):  # ``tensors``: what each slot resolves to now
            d = m.__dict__
            saved.append(d.get(a, _MISSING))
            d[a] = local.get(id(t), t)
        door = moves.Local(verdict.style_moves)
        writer = None if verdict.writes is None else objects.Writing(self.forward, leaves, held)
        forward = writer or self.forward
        try:
            with _mode("local"), moves.opened(door):
                if spy is not None:
                    with spy.spy():
                        out = forward(*largs, **lkwargs)
                elif recorder is not None:
                    with recorder:
                        out = forward(*largs, **lkwargs)
                else:
                    out = forward(*largs, **lkwargs)
        finally:
            for (m, a), prev in zip(self.slots, saved):
                if prev is _MISSING:
                    del m.__dict__[a]
                else:
                    m.__dict__[a] = prev
        why = door.why() or ("" if writer is None else writer.differs(verdict.writes, verdict.written_values))
        if why:
            if spy is not None:
                spy.refuse(why)
            elif recorder is not None:
                raise Stop(why)
            else:
                raise RuntimeError(f"local region {type(self.module).__name__}: {why}; the module behaves differently "
                                   "from its traced call with the same signature. Run with "
                                   "AUTOPARALLEL_LOCAL_REGIONS=0 and report it.")
        return out, (local if spy is not None else call)

    def _wrap_local(self, verdict: _Verdict, out: Any, call: _Call, done: list[Any] | None = None) -> Any:
        """A local run's outputs as the DistTensors of the verdict's layouts, moved by the
        styles' epilogue (``done``: per output leaf, that move already made, or None)."""
        outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        for o, s, shape in zip(outs, verdict.out_specs, verdict.out_local_shapes):
            if s is not None and (not isinstance(o, torch.Tensor) or isinstance(o, DistTensor) or o.dtype != s.dtype
                                  or tuple(o.shape) != shape):
                raise RuntimeError(
                    f"local region {type(self.module).__name__}: an output came out as "
                    f"{getattr(o, 'dtype', type(o).__name__)} {tuple(getattr(o, 'shape', ()))} where its traced "
                    f"layout {s} gives {s.dtype} {shape} locally; the module behaves differently from its "
                    "traced call with the same signature. Run with AUTOPARALLEL_LOCAL_REGIONS=0 and report it."
                )
        wrapped = [o if s is None else _wrap_out(o, s, call) for o, s in zip(outs, verdict.out_specs)]  # type: ignore[arg-type]
        for k, dst in enumerate(verdict.out_moves):  # the styles' epilogue (``regions.moves``)
            if dst is not None:
                wrapped[k] = moves.remake(wrapped[k], dst, None if done is None else done[k])
        if isinstance(out, torch.Tensor) and verdict.out_tree.is_leaf():
            return wrapped[0]
        return tree_unflatten(wrapped, verdict.out_tree)


def _moved_in(verdict: _Verdict, leaves: list[Any], done: list[Any] | None) -> list[Any]:
    """The arguments moved by the styles' prologue (``regions.moves``; ``done``: per leaf, that
    move already made by the trace, or None): as every read in the local run sees them."""
    if not verdict.in_moves:
        return leaves
    return [x if dst is None else moves.remake(_dist(x, dst), dst, None if done is None else done[k])
            for k, (x, dst) in enumerate(zip(leaves, verdict.in_moves))]


def _agree_plain(module: nn.Module, leaves: list[Any], tensors: list[torch.Tensor]) -> None:
    """The plain tensor arguments of a call that holds DistTensors are Replicate (the same value
    on every rank), whichever path the call takes: checked as an op checks them
    (``agree.check_plain``), since a local run issues no op that would."""
    plain = [x for x in leaves if type(x) is torch.Tensor and x.dim() != 0]
    if not plain:
        return
    dist = next((t for t in (*leaves, *tensors) if isinstance(t, DistTensor)), None)
    if dist is not None:
        agree.check_plain(f"a plain argument of {type(module).__name__}", layout.spec_of(dist).mesh, plain)


def _dist(x: Any, like: DistSpec) -> DistTensor:
    """``x`` as a DistTensor: a plain tensor argument an op slices (a mask built from plain
    tensors) as the Replicate DistTensor an op adopts it as (``dispatch.adopt_one``), on ``like``'s mesh."""
    return x if isinstance(x, DistTensor) else layout.adopt(x, like.mesh)


# marks an object argument's part of a signature: (_OBJECT, its class, its entries'
# ``objects.signature``, None where a region cannot follow them)
_OBJECT = object()


def _put_written(verdict: _Verdict, leaves: list[Any], wrapped: Any) -> Any:
    """A local run's wrapped output; where it wrote into object arguments (``verdict.writes``),
    ``(output, written)``: the written DistTensors are put at their paths, the output returned."""
    if verdict.writes is None:
        return wrapped
    out, written = wrapped
    objects.put(leaves, verdict.writes, written)
    return out


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state, and each CUDA device's where CUDA is initialized."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


def _sliced_first(sliced: dict[int, DistSpec], leaves: list[Any], in_moves: tuple[DistSpec | None, ...],
                  done_in: list[Any] | None) -> tuple[str, tuple[DistSpec | None, ...], list[Any] | None]:
    """The arguments sliced before the second trace joined to its styles' prologue (``leaves``:
    as that trace got them): (why not, '' when they join; per leaf the layout the local run gets
    it in; per leaf its value so moved, or None)."""
    specs: list[DistSpec | None] = list(in_moves) if in_moves else [None] * len(leaves)
    if any(specs[k] is not None for k in sliced):
        return "a parallel style moves an argument an op took sliced", in_moves, done_in
    done = list(done_in) if done_in is not None else [None] * len(leaves)
    for k, dst in sliced.items():
        specs[k], done[k] = dst, leaves[k]
    return "", tuple(specs), done


def _family_of(key: Any) -> Any:
    """A signature up to its tensor arguments' sizes and strides (``regions.generic``)."""
    tree, parts, *rest = key
    fam: list[Any] = []
    for p in parts:
        if isinstance(p[0], DistSpec):
            spec, _, grad = p
            fam.append((spec.mesh, spec.placements, spec.dtype, spec.shard_order, len(spec.shape), grad))
        elif p[0] == "plain":
            fam.append(("plain", len(p[1]), *p[2:]))
        else:
            fam.append(p)
    return (tree, tuple(fam), *rest)


def _requires_grad(out: Any) -> bool:
    """Whether any tensor of ``out`` needs a gradient."""
    outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
    return any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)


def _locals(leaves: list[Any]) -> list[Any]:
    """The call's arguments as its local run gets them: shards for DistTensors."""
    return [layout.local_of(x) if isinstance(x, DistTensor) else x for x in leaves]


def _local_sizes(leaves: list[Any], point: Any) -> list[tuple[int, ...] | None]:
    """Per argument, its local sizes at a family member's ``point``; None for other values."""
    return [sizes if sizes is None or not isinstance(x, DistTensor) else
            tuple(v // _pieces(layout.spec_of(x), d) for d, v in enumerate(sizes))
            for x, sizes in zip(leaves, sizes_at(leaves, point))]


def _local_even(spec: DistSpec) -> tuple[int, ...]:
    """The local shape of ``spec`` if every sharded dim were split evenly (may be fractional: -1)."""
    out = []
    for d, n in enumerate(spec.shape):
        k = _pieces(spec, d)
        out.append(n // k if n % k == 0 else -1)
    return tuple(out)


def _coord(verdict: _Verdict) -> tuple[int, ...]:
    spec = next(s for s in verdict.out_specs if s is not None)
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    assert coord is not None
    return coord


def _storage(t: torch.Tensor) -> int:
    return compat.storage_id(t)


class _mode:
    """Push ``name`` on the region mode stack for the duration of a ``with`` block."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _MODE.append(self.name)

    def __exit__(self, *exc: object) -> None:
        _MODE.pop()
