"""One training step of a single-device model, recorded on fake tensors: what the plan search reads.

``trace_step(model, example, loss)`` runs forward, loss and backward under ``FakeTensorMode``
(no real compute, no memory for activations, any parameter size) with ``torch.func.functional_call``
(the model itself is not touched), and records every aten op the step runs, in order: the op,
its arguments with each tensor replaced by a ``Ref`` (an index into ``Step.metas``), its outputs,
whether it ran in the forward or the backward, and the innermost module that ran it. It also
records which tensors are parameters (by name, tied parameters once), which are the inputs, the
gradients reaching each parameter, and which forward tensors autograd saved for the backward
(the activations a step keeps alive).

A model that cannot run on fake tensors (it reads a value out of a tensor to steer Python, or
calls an op without a meta kernel) raises ``ValueError`` naming the op or the reason.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autoparallel import compat
from autoparallel.engine.dtensor import DistTensor
from autoparallel.regions import moves
from autoparallel.spec import itemsize
from spmd_rules.base import TensorMeta


@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor of the recorded step: an index into ``Step.metas``."""

    id: int


@dataclass(slots=True)
class OpRecord:
    """One aten op of the step: ``func(*args, **kwargs)`` with tensors as ``Ref``s."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: tuple[Ref | None, ...]   # one per output (None: not a tensor)
    out_value: Any                 # the op's output structure with Refs (for a rule's out metas)
    backward: bool                 # ran during loss.backward()
    module: str                    # the innermost module running it ("" = the model itself)
    flops: int                     # floating-point operations of the whole (global) op


@dataclass
class Step:
    """The recorded step (see the module docstring)."""

    ops: list[OpRecord] = field(default_factory=list)
    metas: list[TensorMeta] = field(default_factory=list)
    params: dict[str, Ref] = field(default_factory=dict)           # qualified name -> its tensor
    inputs: list[Ref] = field(default_factory=list)                # the example's tensors, in order
    grads: dict[str, list[Ref]] = field(default_factory=dict)      # parameter -> gradients reaching it
    saved: set[int] = field(default_factory=set)                   # ref ids autograd saved for backward
    loss: Ref | None = None
    modules: dict[str, str] = field(default_factory=dict)          # module name -> class name, call order
    module_inputs: dict[str, list[Ref]] = field(default_factory=dict)  # first call's tensor inputs
    # ref id -> ("in"/"out", module name): a view standing for a module's first floating input
    # (output) as the module sees (returns) it, where a parallel style brings the value to its layout
    boundaries: dict[int, tuple[str, str]] = field(default_factory=dict)
    storages: dict[int, int] = field(default_factory=dict)         # ref id -> its storage (views share one)
    boundary_grads: dict[int, Ref] = field(default_factory=dict)   # boundary view's ref id -> its gradient
    boundary_grad_at: dict[int, int] = field(default_factory=dict)  # boundary view's ref id -> ops recorded when it arrived

    def blocks(self) -> list[str]:
        """The repeated blocks: the most frequent module pattern ending in an index (outermost
        first), two or more of them."""
        counts: dict[str, list[str]] = {}
        for n in self.modules:
            if re.search(r"(^|\.)\d+$", n):
                counts.setdefault(pattern(n), []).append(n)
        if not counts:
            return []
        best = max(counts.values(), key=lambda v: (len(v), -v[0].count(".")))
        return best if len(best) >= 2 else []

    def nbytes(self, ref: Ref) -> int:
        m = self.metas[ref.id]
        n = 1
        for s in m.shape:
            n *= s
        return n * itemsize(m.dtype)


def pattern(name: str) -> str:
    """A module name with its indices made ``*`` (``blocks.3.mlp`` -> ``blocks.*.mlp``)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


class _Recorder(TorchDispatchMode):
    def __init__(self, step: Step, ids: dict[int, Ref], keep: list[Any], where: list[str]) -> None:
        super().__init__()
        self.step, self.ids, self.keep, self.where = step, ids, keep, where
        self.backward = False

    def ref(self, t: torch.Tensor) -> Ref:
        r = self.ids.get(id(t))
        if r is None:
            r = Ref(len(self.step.metas))
            self.step.metas.append(TensorMeta(tuple(int(s) for s in t.shape), t.dtype))
            self.ids[id(t)] = r
            try:
                self.step.storages[r.id] = t.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): a storage of its own
                self.step.storages[r.id] = -1 - r.id
            self.keep.append(t)  # ids stay unique while the step is recorded
        return r

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) == "prim":  # metadata queries (prim.device): nothing to lay out
            return out
        conv: Callable[[Any], Any] = lambda x: self.ref(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        rargs = tree_map(conv, tuple(args))
        rkwargs = tree_map(conv, dict(kwargs))
        out_value = tree_map(conv, out)
        flat, _ = tree_flatten(out_value)
        outs = tuple(x if isinstance(x, Ref) else None for x in flat)
        self.step.ops.append(OpRecord(func, rargs, rkwargs, outs, out_value, self.backward,
                                      self.where[-1], _flops(func, args, kwargs, out)))
        return out


def _where(e: BaseException) -> str:
    """`` at FILE:LINE (`code`)`` of the innermost frame of ``e``'s traceback outside torch and this
    library (the model's line that asked for a value), or ''."""
    import os
    import traceback

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return ""
    f = frames[-1]
    hint = ""
    if f.filename.endswith("modeling_attn_mask_utils.py"):  # the skip-the-mask check of transformers' sdpa attention
        hint = (" — transformers' check whether the attention mask is all ones; the model built with "
                "attn_implementation=\"eager\" has none")
    return f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`){hint}"


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    from torch.utils.flop_counter import flop_registry
    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is None:
        return 0
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments: no matmul FLOPs known
        return 0


def split_example(example: Any, loss: Callable[..., Any] | None) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """``(model args, model kwargs, loss targets)`` from ``example``: a dict is the model's
    keyword arguments; a tuple is the model's arguments, its last item the loss's target when a
    ``loss`` is given; a tensor is the model's one argument."""
    if isinstance(example, Mapping):
        return (), dict(example), ()
    if isinstance(example, torch.Tensor):
        return (example,), {}, ()
    if isinstance(example, (tuple, list)):
        items = tuple(example)
        if loss is not None:
            if len(items) < 2:
                raise ValueError("ap.auto_parallel: with loss=, example must be (inputs..., target)")
            return items[:-1], {}, items[-1:]
        return items, {}, ()
    raise TypeError(f"ap.auto_parallel: example must be a tuple, a dict or a tensor, got {type(example).__name__}")


def loss_of(out: Any, targets: tuple[Any, ...], loss: Callable[..., Any] | None) -> torch.Tensor:
    """The step's scalar loss: ``loss(out, *targets)``, else the output's ``.loss``
    (``transformers`` models given labels), else the output itself when it is a scalar."""
    if loss is not None:
        value = loss(out, *targets)
    elif isinstance(out, torch.Tensor):
        value = out
    else:
        value = getattr(out, "loss", None)
        if value is None and isinstance(out, Mapping):
            value = out.get("loss")
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            "ap.auto_parallel: the step has no scalar loss; pass loss=fn (called as fn(model(*inputs), target)) "
            "or an example whose model output is a scalar or has .loss")
    return value


def trace_step(model: nn.Module, example: Any, loss: Callable[..., Any] | None = None) -> Step:
    """Record one training step of ``model`` on ``example`` (see the module docstring).

    An op whose output's shape depends on the values (``nonzero`` in a mixture of experts' routing)
    cannot run on fake tensors; such a step is recorded once on real tensors instead (one step's
    compute on this process, with a warning; the model, its buffers and the random state are left
    as they were), which needs real parameters (not the meta device)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    try:
        return _record(model, example, loss, real=False)
    except ValueError as e:
        if not isinstance(e.__cause__, DynamicOutputShapeException):
            raise
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(f"{e}; with real parameters (not the meta device) the step is recorded on real "
                             "tensors instead") from e.__cause__
        op = str(e.__cause__).splitlines()[0] if str(e.__cause__) else "an op"
        warnings.warn(f"ap.auto_parallel: {op} has an output shaped by the values: the step is recorded on "
                      "real tensors (one step's compute here)", stacklevel=3)
        with torch.random.fork_rng():
            return _record(model, example, loss, real=True)


def _record(model: nn.Module, example: Any, loss: Callable[..., Any] | None, real: bool) -> Step:
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs, targets = split_example(example, loss)
    step = Step()
    ids: dict[int, Ref] = {}
    keep: list[Any] = []
    where = [""]
    fake_mode: Any = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _Recorder(step, ids, keep, where)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, DistTensor):  # laid out by hand: recorded as the whole tensor it stands for
            if real:
                return t.full_tensor().detach().clone()
            with fake_mode:
                return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
        if real:
            return t.detach().clone()
        if t.device.type == "meta":  # a model built on the meta device (any size): a CPU fake of its shape
            with fake_mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return fake_mode.from_tensor(t)

    seen: dict[int, str] = {}
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            state[name] = state[seen[id(p)]]
            continue
        seen[id(p)] = name
        state[name] = fake(p.detach()).requires_grad_(p.requires_grad)
    for name, b in model.named_buffers(remove_duplicate=False):
        state[name] = fake(b)
    # what stands in for each parameter and buffer during the recording (by the tensor's identity)
    stand_ins = {id(t): state[n] for n, t in (*model.named_parameters(), *model.named_buffers())}
    hooks = []
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def pre(mod: nn.Module, margs: Any, mkwargs: Any) -> Any:
        name = names.get(id(mod), "")
        where.append(name)
        flat, _ = tree_flatten((margs, mkwargs))
        tensors = [recorder.ref(t) for t in flat if isinstance(t, torch.Tensor)]
        if name not in step.modules:
            step.modules[name] = type(mod).__name__
            step.module_inputs[name] = tensors
        # the module's first floating input becomes a view of its own (a style's hook would give
        # a new tensor in that layout): the module's ops, and the backward, read that view
        return mark_first((tuple(margs), dict(mkwargs)), "in", name)

    def post(mod: nn.Module, margs: Any, out: Any) -> Any:
        return mark_first(out, "out", where.pop())

    def _arrived(rid: int, g: torch.Tensor) -> None:
        step.boundary_grads.setdefault(rid, recorder.ref(g))
        step.boundary_grad_at.setdefault(rid, len(step.ops))

    def mark_first(value: Any, kind: str, name: str) -> Any:
        done = [False]

        def first(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not done[0] and x.is_floating_point():
                done[0] = True
                y = x.view_as(x)
                rid = recorder.ref(y).id
                step.boundaries[rid] = (kind, name)
                if y.requires_grad:  # where the backward crosses the boundary (a style's move reversed)
                    y.register_hook(lambda g, rid=rid: _arrived(rid, g))
                return y
            return x

        return tree_map(first, value)

    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post))

    def pack(t: torch.Tensor) -> torch.Tensor:
        step.saved.add(recorder.ref(t).id)
        return t

    try:
        fargs = tree_map(fake, args)
        fkwargs = tree_map(fake, kwargs)
        ftargets = tree_map(fake, targets)
        # a module laid out by hand (``ap.parallelize``) keeps its styles' hooks: on whole tensors
        # their moves change nothing
        with fake_mode, moves.opened(moves.Whole()):
            with recorder:
                for name, t in state.items():
                    if name in dict(model.named_parameters()):
                        step.params[name] = recorder.ref(t)
                for t in tree_flatten((fargs, fkwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        step.inputs.append(recorder.ref(t))
                for name in step.params:
                    t = state[name]
                    if t.requires_grad:
                        t.register_hook(lambda g, n=name: step.grads.setdefault(n, []).append(recorder.ref(g)))
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    with compat.tensors_stood_in(model.modules(), stand_ins):
                        out = model(*fargs, **fkwargs)
                    value = loss_of(out, ftargets, loss)
                step.loss = recorder.ref(value)
                recorder.backward = True
                if value.requires_grad:
                    value.backward()
    except (ValueError, TypeError):
        raise
    except Exception as e:  # data-dependent Python, an op without a meta kernel, ...
        raise ValueError(
            f"ap.auto_parallel: the model's step cannot be traced on fake tensors ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}){_where(e)}; a step whose Python depends on tensor "
            "values has no plan that holds for every batch — lay it out by hand (ap.parallelize)") from e
    finally:
        for h in hooks:
            h.remove()
    step.saved -= {r.id for r in step.params.values()}
    return step
