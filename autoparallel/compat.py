"""Every private torch name the library uses: why, and what happens when it is gone.

Private names change between releases without notice. Each one is read here, once, and the rest
of the library uses only the names below. For each: what we need it for, and the fallback when
this torch does not have it (the library keeps working, at the cost stated). This module imports
torch only (it sits with the values at the bottom of the layers; the rules use it too).

torch.distributed's own renames (``all_gather_single`` vs ``all_gather_into_tensor``) are public
API across releases; ``autoparallel.runtime.comm`` picks whichever this torch has.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# ---- tensor subclass -------------------------------------------------------------------------
# ``_make_wrapper_subclass`` builds a tensor with global metadata and no storage: the DistTensor
# wrapper (what torch's own DTensor and every wrapper subclass use). No fallback exists: without
# it there is no wrapper subclass, so a missing name fails at import, naming it.
make_wrapper_subclass: Callable[..., Any] = torch.Tensor._make_wrapper_subclass  # type: ignore[attr-defined]


class _Probe(torch.Tensor):
    pass


def _positional_wrapper_ok() -> bool:
    """Whether ``_make_wrapper_subclass`` takes (size, strides, storage_offset, memory_format,
    dtype, layout, device, pin_memory, requires_grad) positionally in this torch. Faster than
    keywords (every op output is wrapped); keywords otherwise."""
    try:
        probe = make_wrapper_subclass(_Probe, (2, 3), (1, 2), None, None, torch.float64, torch.strided,
                                      torch.device("cpu"), False, True)
    except Exception:  # noqa: BLE001  (any refusal means: use keywords)
        return False
    return (tuple(probe.shape) == (2, 3) and probe.stride() == (1, 2) and probe.dtype == torch.float64
            and probe.layout == torch.strided and probe.device == torch.device("cpu") and probe.requires_grad)


WRAPPER_POSITIONAL = _positional_wrapper_ok()

# A subclass that handles everything in ``__torch_dispatch__`` turns ``__torch_function__`` off
# (as torch's own wrapper subclasses do). Fallback: torch's default (slower, same results).
disabled_torch_function_impl: Any = getattr(torch._C, "_disabled_torch_function_impl", torch.Tensor.__torch_function__)
# What that impl does, for a subclass whose ``__torch_function__`` looks at a call first: run the
# function with subclass ``__torch_function__`` handling off. Fallback: ``torch._C.DisableTorchFunction``.
disable_torch_function_subclass: Any = getattr(torch._C, "DisableTorchFunctionSubclass", None) or torch._C.DisableTorchFunction


def attribute_access() -> Any:
    """A context for reading and writing attributes of many tensor-subclass objects at once
    (``.grad``, ``requires_grad``, hook tables, hashing as dict keys): each such access otherwise
    calls the subclass's ``__torch_function__`` (~1.4 us), which has nothing to look at for an
    attribute. Ops inside it skip the subclass's ``__torch_function__`` too: only attributes."""
    return disable_torch_function_subclass()


def torch_function_enabled() -> bool:
    """Whether subclass ``__torch_function__`` handling is on (it is off inside a subclass's own
    handling: in the whole backward of ``loss.backward()`` on a DistTensor)."""
    return bool(torch._C._is_torch_function_enabled())


def enable_torch_function() -> Any:
    """A context manager turning subclass ``__torch_function__`` handling back on (for a
    recompute that must run as its forward did); a no-op context where torch has none."""
    enable = getattr(torch._C, "_EnableTorchFunction", None)
    return enable() if enable is not None else contextlib.nullcontext()


# ---- dispatch ----------------------------------------------------------------------------------
try:  # run a kernel with no Python dispatch in the way (for in-place views' metadata)
    from torch.utils._mode_utils import no_dispatch
except ImportError:  # pragma: no cover - older or newer torch
    def no_dispatch() -> Any:  # type: ignore[misc,no-redef]  # the same context manager
        return torch._C._DisableTorchDispatch()

try:  # a mode seeing every aten call, for local regions' traces
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover
    TorchDispatchMode = None  # type: ignore[assignment,misc]  # local regions then stay off (regions check it)

_get_meta_tls = getattr(torch._C, "_meta_in_tls_dispatch_include", None)
_set_meta_tls = getattr(torch._C, "_set_meta_in_tls_dispatch_include", None)


@contextlib.contextmanager
def meta_in_tls() -> Iterator[None]:
    """Dispatch to meta kernels in this block: an in-place view (``x.squeeze_()``) runs its meta
    kernel on the wrapper itself, which corrects the wrapper's sizes and strides (as
    ``torch.utils._python_dispatch.return_and_correct_aliasing`` does). Fallback: none; in-place
    views on DistTensors raise, naming the missing API (their out-of-place forms work)."""
    if _get_meta_tls is None or _set_meta_tls is None:
        raise RuntimeError("in-place views of a DistTensor need torch._C._set_meta_in_tls_dispatch_include, "
                           "which this torch lacks; use the out-of-place view (x = x.squeeze())")
    before = _get_meta_tls()
    _set_meta_tls(True)
    try:
        yield
    finally:
        _set_meta_tls(before)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode``: a capture runs a module on them): it
    has no storage to read an address of."""
    fake = getattr(torch._subclasses, "FakeTensor", None)
    return fake is not None and isinstance(t, fake)


def static_fake_mode() -> Any:
    """A fake-tensor mode of static shapes, without a symbolic shape environment (a static
    capture's: meta kernels then skip the guards a symbolic one checks), in which a real tensor
    met is taken as a constant."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True)


def traced_node(t: torch.Tensor) -> Any:
    """The graph node ``make_fx`` recorded for ``t`` (a tensor made inside the function it traces)."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        raise RuntimeError("traced_node: no make_fx trace is running")
    return proxy_tensor.get_proxy_slot(t, mode.tracer).proxy.node


class OpenSizeFakes:
    """Fake tensors some of whose dims are symbolic sizes (``torch.SymInt``s of one ``ShapeEnv``,
    which records every branch taken on them as a guard): a capture whose program serves every
    size its guards admit. Sizes 0 and 1 stay concrete (torch specializes them), as does a dim
    whose size equals another's only by chance (no duck sizing: each open dim its own symbol)."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        self.env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=self.env)
        # (fake tensor mode's op cache off: a hit rebuilds its outputs' symbolic sizes, and hashing
        # symbolic arguments costs more than the meta kernel it saves; a capture of open sizes
        # takes ~25 % less time without it)
        self.mode.cache_enabled = False
        self._context = StatelessSymbolicContext
        self._open, self._fixed = DimDynamic.DYNAMIC, DimDynamic.STATIC

    def fake(self, t: torch.Tensor, open_dims: tuple[int, ...] = ()) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """A fake of ``t`` whose ``open_dims`` are symbolic sizes, and each open dim's size as
        made (a sympy symbol; an int where torch fixed it)."""
        if not open_dims:
            return self.mode.from_tensor(t, static_shapes=True), ()
        context: Any = self._context(dynamic_sizes=[self._open if d in open_dims else self._fixed for d in range(t.dim())])
        f = self.mode.from_tensor(t, symbolic_context=context)
        sizes: list[Any] = list(f.shape)
        return f, tuple(sizes[d].node.expr if isinstance(sizes[d], torch.SymInt) else int(sizes[d]) for d in open_dims)

    def guards(self) -> list[Any]:
        """Every condition on the sizes the trace relied on (sympy expressions): its guards and
        runtime assertions."""
        out = [g.expr for g in self.env.guards]
        for asserts in getattr(self.env, "deferred_runtime_asserts", {}).values():
            out += [a.expr for a in asserts]
        return out

    def ranges(self, symbols: Any) -> list[Any]:
        """The value range the trace assumed of each of ``symbols``, as conditions."""
        import sympy

        out = []
        for sym in symbols:
            r = self.env.var_to_range.get(sym)
            if r is not None and isinstance(r.lower, sympy.Integer):
                out.append(sympy.Ge(sym, r.lower))
            if r is not None and isinstance(r.upper, sympy.Integer):
                out.append(sympy.Le(sym, r.upper))
        return out


@contextlib.contextmanager
def outside_trace(keep_fake: bool = False) -> Iterator[None]:
    """Real tensors and real work inside a fake-tensor ``make_fx`` trace: its proxy and fake
    modes are suspended for the block (the agreement checks' control messages during a capture).
    ``keep_fake``: only the proxy mode is (metadata of symbolic sizes computed in the trace's fake
    mode, whose shape environment records the guards, but not recorded as the step's ops)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    if keep_fake:
        with disable_proxy_modes_tracing():
            yield
        return
    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        yield


def storage_id(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, shared by its views: the storage object's address
    (``_cdata``), which real and fake tensors both have (a fake tensor has no data address)."""
    return int(t.untyped_storage()._cdata)


_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_depth = getattr(torch._C, "_len_torch_function_stack", None)


def modes_active() -> bool:
    """Whether a ``TorchDispatchMode`` or ``TorchFunctionMode`` is active (a fake run under one
    would hand it fake tensors). Fallback: "yes" -- no fake runs."""
    if _dispatch_depth is None or _function_depth is None:
        return True
    return bool(_dispatch_depth() or _function_depth())


# What sees every tensor autograd saves, or every op: the top of the saved-tensor hooks stack
# (``torch.autograd.graph.saved_tensors_hooks``: torch's checkpoint, in its forward and in its
# recompute, and CPU offloading) and the dispatch mode stack (selective checkpoint's caching
# modes, ``make_fx``). A module run twice under them would be seen twice: torch's checkpoint
# counts and compares the saves of its forward and of its recompute. Our own hooks and modes
# carry ``OWN_OBSERVER`` (they follow what runs, as the code around them expects). Fallback:
# "observed" -- local regions then prove new signatures only where nothing watches (slower).
OWN_OBSERVER = "_ap_own_observer"
# The autograd node a reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``) leaves in the
# graph (its ``CheckpointFunction``): it runs its own backward inside the node and refuses
# ``autograd.grad``. Read by name (``Node.name()``); without it, no node is recognised as one.
REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"
_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _own(obj: Any) -> bool:
    return bool(getattr(getattr(obj, "__func__", obj), OWN_OBSERVER, False))


def foreign_saved_hooks() -> bool:
    """Whether saved-tensor hooks that are not the library's own are on top of the stack (they
    receive every tensor autograd saves now: torch's checkpoint, offloading)."""
    if _top_saved_hooks is None:
        return True
    try:
        top = _top_saved_hooks(False)
    except (TypeError, RuntimeError):  # pragma: no cover - another signature
        return True
    return top is not None and not _own(top[0])


def decomposable(func: Any) -> bool:
    """Whether torch defines the op ``func`` by other ops (a ``CompositeImplicitAutograd``
    kernel: ``linear``, ``dropout``, ``matmul``), which autograd normally runs before the op reaches
    a tensor subclass, but not under ``torch.inference_mode``. Fallback: False (the op runs
    replicated, as one without a rule)."""
    try:
        return bool(func._can_decompose())
    except (AttributeError, RuntimeError):  # pragma: no cover - another torch
        return False


def foreign_dispatch_modes() -> bool:
    """Whether a ``TorchDispatchMode`` that is not the library's own is active (selective
    checkpoint's caching and replaying modes, ``make_fx``, a user's mode)."""
    if _dispatch_depth is None:
        return True
    n = _dispatch_depth()
    if not n:
        return False
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        return any(not _own(type(m)) for m in _get_current_dispatch_mode_stack())
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover
        return True


def boxed(gm: torch.fx.GraphModule) -> bool:
    """Make ``gm`` take its inputs as one list it empties (``gm(args)``), so that each input is let
    go after its last use inside the program rather than held by the caller until it returns (a
    backward program's saved activations). Whether it was done; fallback: False (called as usual)."""
    codegen = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # pragma: no cover - another torch
        return False
    gm.graph.set_codegen(codegen())
    gm.recompile()
    return True


def release_saved(ctx: Any) -> None:
    """Let autograd drop the tensors a ``torch.autograd.Function``'s backward read from
    ``ctx.saved_tensors`` (unless the graph is retained for another backward), so that only the
    backward itself holds them. Fallback: nothing (autograd drops them when the node is done)."""
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)
    if clear is not None:
        clear()


def mark_own_observer(obj: Any) -> Any:
    """Mark a saved-tensor pack function or a dispatch mode class as the library's own."""
    setattr(getattr(obj, "__func__", obj), OWN_OBSERVER, True)
    return obj


# torch.nn's global module hooks (``register_module_forward_hook`` and the pre-hook): a local
# region's capture would run them once, on fake tensors. Fallback: "there may be some" -- regions
# are then refused.
OBSERVER_HOOK = "_ap_observer_hook"  # set (True) on a global hook that never reads a tensor (CommDebugMode's)


def global_module_hooks() -> bool:
    """Whether any global forward (pre-)hook is registered, besides observers' (``OBSERVER_HOOK``)."""
    import torch.nn.modules.module as module_module

    tables = [getattr(module_module, n, None) for n in ("_global_forward_hooks", "_global_forward_pre_hooks")]
    return any(t is None or any(not getattr(h, OBSERVER_HOOK, False) for h in t.values()) for t in tables)


# Whether autograd's engine is running a backward on this thread (``CommDebugMode`` names the
# module whose backward issued a collective only then). Fallback: "no" -- a backward's
# collectives are attributed to no module.
_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether a backward pass is running on this thread."""
    return _graph_task_id is not None and _graph_task_id() != -1


# The autograd node running now (``torch._C._current_autograd_node``): which node reads a saved
# tensor, so a zero-bubble ``B`` can drop what only the input's path reads. Fallback: None --
# nothing is dropped after ``B`` (a micro-batch waiting for ``W`` holds all it saved).
_current_node = getattr(torch._C, "_current_autograd_node", None)


def current_autograd_node() -> Any:
    """The autograd node whose backward runs now on this thread; None outside one (or unknown)."""
    return _current_node() if _current_node is not None else None


_ACCUMULATE_GRAD: Any = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def accumulated_leaf() -> Any:
    """The leaf tensor whose gradient the running backward node makes, where that node's only
    successor is the leaf's gradient accumulation (an embedding's backward into its table, a
    transpose's into a weight); None otherwise, outside a backward, or on a torch without the names."""
    if _current_node is None or _ACCUMULATE_GRAD is None:
        return None
    node = _current_node()
    if node is None:
        return None
    leaf = None
    for fn, _ in node.next_functions:
        if fn is None:
            continue
        if leaf is not None or type(fn) is not _ACCUMULATE_GRAD:
            return None
        leaf = fn.variable
    return leaf


# ---- nn.Module internals -----------------------------------------------------------------------
# ``Module._parameters`` / ``_buffers`` / ``_modules`` (the dicts behind attribute access) and the
# hook tables ``_forward_pre_hooks``, ``_forward_hooks``, ``_backward_hooks``,
# ``_backward_pre_hooks``: laying a parameter out in place replaces the entry without
# ``nn.Module.__setattr__``'s checks (a DistTensor is not a Parameter), a region or a static
# program keys its signature on the hooks a module has, a cut stack of blocks swaps its children.
# No fallback: these have been nn.Module's storage since its first release; a torch without them
# fails on first use, naming the attribute.
def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameter slots (name -> tensor or None), not its children's."""
    return module._parameters  # type: ignore[return-value]


def called_modules(tb: Any) -> list[torch.nn.Module]:
    """The modules whose call the traceback ``tb`` passes through, outermost first (the frames of
    ``Module._call_impl``, the body of every module call)."""
    code, frames = torch.nn.Module._call_impl.__code__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return [f.f_locals["self"] for f in frames if f.f_code is code and isinstance(f.f_locals.get("self"), torch.nn.Module)]


def set_own_parameters(module: torch.nn.Module, params: dict[str, Any]) -> None:
    """Give ``module`` the parameter slots ``params`` (a dict of its own: a shallow copy of a
    module then stops sharing its original's)."""
    module._parameters = params  # type: ignore[assignment]


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffer slots (name -> tensor or None)."""
    return module._buffers  # type: ignore[return-value]


def own_tensor(module: torch.nn.Module, attr: str) -> tuple[Any, bool]:
    """(the parameter or buffer ``attr`` of ``module`` itself, whether it is a parameter slot);
    ``KeyError`` when it has neither."""
    if attr in module._parameters:
        return module._parameters[attr], True
    return module._buffers[attr], False


def put_tensor(module: torch.nn.Module, attr: str, t: Any) -> None:
    """Put ``t`` in ``module``'s parameter slot ``attr`` if it has one, else in its buffer slot
    (no Parameter check: a laid-out DistTensor goes where the tensor was)."""
    if attr in module._parameters:
        module._parameters[attr] = t
    else:
        module._buffers[attr] = t


@contextlib.contextmanager
def tensors_stood_in(modules: Any, stand_ins: dict[int, Any]) -> Iterator[None]:
    """Inside: every parameter or buffer slot of ``modules`` that holds a tensor ``t`` with
    ``id(t)`` in ``stand_ins`` holds ``stand_ins[id(t)]`` instead; put back on exit. Each module
    object's slots are swapped once however many paths reach it (a module shared by two parents,
    a parameter tied across modules): ``torch.func.functional_call`` left a stand-in behind in a
    module reached by two paths."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    seen: set[int] = set()
    try:
        for m in modules:
            if id(m) in seen:
                continue
            seen.add(id(m))
            for own in (m._parameters, m._buffers):
                for name, t in own.items():
                    if t is not None and id(t) in stand_ins:
                        swapped.append((own, name, t))
                        own[name] = stand_ins[id(t)]
        yield
    finally:
        for own, name, t in reversed(swapped):
            own[name] = t


_PLAIN_VALUES = (bool, int, float, str, type(None))
PLAIN_VALUES = _PLAIN_VALUES  # the attribute values a signature holds (``module_values``)


def module_values(module: torch.nn.Module) -> tuple[tuple[str, Any], ...]:
    """The plain Python values ``module`` holds as attributes (a flag, a counter, a temperature:
    ``bool``, ``int``, ``float``, ``str``, ``None``), in attribute order; ``training`` aside. A
    forward may branch on them or compute with them, so a program or a proof made at one value
    does not hold at another: the signatures of captured steps and local regions include them."""
    return tuple((k, v) for k, v in module.__dict__.items() if type(v) in _PLAIN_VALUES and k != "training")


def child_modules(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s children by name (the dict itself)."""
    return module._modules  # type: ignore[return-value]


def set_child_modules(module: torch.nn.Module, children: dict[str, Any]) -> None:
    """Give ``module`` the children ``children`` (a dict of its own; the old one is left as it was)."""
    module._modules = children  # type: ignore[assignment]


def module_hooks(module: torch.nn.Module) -> tuple[tuple[Any, ...], ...]:
    """The handles of ``module``'s forward pre-, forward, backward and backward pre-hooks (a
    signature of what runs around its forward)."""
    return (tuple(module._forward_pre_hooks), tuple(module._forward_hooks),
            tuple(module._backward_hooks), tuple(module._backward_pre_hooks))


def forward_hook_fns(module: torch.nn.Module) -> list[Any]:
    """``module``'s forward pre-hooks then forward hooks (the callables)."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


class QuietHook:
    """A forward (pre-)hook that says when a call of it changes nothing: ``quiet(module)`` true
    (asked before the module runs) means the hook will neither change the module's inputs,
    outputs or state nor communicate, so a captured program of a module around it may leave it
    out when it replays (ZeRO-3's hooks on the submodules of a unit that has gathered)."""

    def __init__(self, fn: Callable[..., Any], quiet: Callable[[torch.nn.Module], bool]) -> None:
        self.fn, self.quiet = fn, quiet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def quiet_hook(hook: Any, module: torch.nn.Module) -> bool:
    """Whether ``hook`` (one of ``module``'s, as ``forward_hook_fns`` lists them) says it is quiet now."""
    return isinstance(hook, QuietHook) and hook.quiet(module)


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether ``t`` has gradient hooks (``register_hook``) or post-accumulate-grad hooks."""
    return bool(getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None))


# ---- the generator's resets -------------------------------------------------------------------
# torch's checkpoint restores the default generator (``torch.set_rng_state``) before it recomputes
# a forward, so dropout draws the same masks. Nothing announces the call, so while a step is
# captured the function is wrapped to count it (restored on exit). Fallback: none needed (a
# public function).
class RngResets:
    """Counts ``torch.set_rng_state`` calls while a step is captured. Activation recompute
    (torch's checkpoint) restores the generator before re-running a forward so dropout draws the
    same masks; the program records the draws but not the restore, so a replay would draw new
    masks in the recompute. A capture that saw a reset and draws is refused."""

    def __init__(self) -> None:
        self.count = 0
        self._real: Any = None

    def __enter__(self) -> RngResets:
        self._real = torch.set_rng_state

        def counted(state: torch.Tensor) -> None:
            self.count += 1
            self._real(state)

        torch.set_rng_state = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state = self._real



# ---- tensor holders ----------------------------------------------------------------------------
# ``Tensor._use_count()``: how many references hold a tensor's TensorImpl (its Python object, a view,
# a saved tensor of a pending backward). A parameter laid out in place (``torch.utils.swap_tensors``)
# must have no other holder. Fallback: 0 -- no extra holder seen; swap_tensors itself still refuses
# a tensor it cannot swap.
def tensor_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s TensorImpl (0 where torch does not say)."""
    count = getattr(t, "_use_count", None)
    return int(count()) if callable(count) else 0


# ---- autograd ----------------------------------------------------------------------------------
# Whether the running backward will execute an autograd node: a local region hands a parameter
# its gradient directly only where the accumulation node would run and store it unchanged.
# Fallback: "no" -- gradients go through autograd's accumulation (correct, one dispatch more per
# parameter).
will_engine_execute_node: Callable[[Any], bool] = getattr(torch._C, "_will_engine_execute_node", lambda node: False)


# ---- op registry -------------------------------------------------------------------------------
# Whether a torch profiler (or NVTX emitter) is recording: a profiler range costs ~15 us to
# enter and leave even when none is (``record_function`` calls into the dispatcher); older torch
# without the flag always opens the range.
profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def all_op_schemas() -> list[Any]:
    """Every registered op schema (the rules enumerate the ``_foreach_*`` family from it).
    Fallback: none found -- those ops then run replicated, with the usual warning."""
    get = getattr(torch._C, "_jit_get_all_schemas", None)
    return list(get()) if get is not None else []


# ---- optimizers --------------------------------------------------------------------------------
def optimizer_global_hooks() -> tuple[dict[Any, Any], dict[Any, Any]]:
    """torch.optim's global step hooks (``register_optimizer_step_pre_hook``/``post_hook``), which
    torch's own step wrapper runs and ``ShardedOptimizer.step`` runs itself. Fallback: no tables
    -- global hooks are not run around a sharded step (per-optimizer hooks still are)."""
    import torch.optim.optimizer as optim_module

    return (getattr(optim_module, "_global_optimizer_pre_hooks", {}),
            getattr(optim_module, "_global_optimizer_post_hooks", {}))


# ---- automatic mixed precision ------------------------------------------------------------------
# ``torch.amp.GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` is the one
# step of ``GradScaler.unscale_`` that reads gradients; ``ap.GradScaler`` overrides it by this name
# so the inf/NaN check runs on local shards and agrees across ranks. Fallback: none --
# ``ap.GradScaler`` refuses to be built on a torch without it, naming it.
GRAD_SCALER_UNSCALE = "_unscale_grads_"
HAS_GRAD_SCALER_UNSCALE = hasattr(torch.amp.GradScaler, GRAD_SCALER_UNSCALE)
_amp_unscale = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


def amp_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (plain tensors of one device) by ``inv_scale`` in place and set
    ``found_inf`` to 1 if any holds an inf or NaN: torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_``. Fallback: a loop of ``isfinite`` and ``mul_``."""
    if _amp_unscale is not None:
        _amp_unscale(grads, found_inf, inv_scale)
        return
    for g in grads:  # pragma: no cover - torch without the fused kernel
        if not bool(torch.isfinite(g).all()):
            found_inf.fill_(1.0)
        g.mul_(inv_scale)


# ---- torch.compile ------------------------------------------------------------------------------
# ``torch._dynamo.trace_rules.add(package)``: Dynamo runs the frames of a listed package as they
# are, as it does torch's own files, and stops its graph before a call into one. Without it,
# ``torch.compile`` of a model on DistTensors compiles the library's own planning (decisions,
# shape arithmetic, collectives) into graphs, which inductor fails on. The packages are listed
# when ``torch._dynamo`` is imported (``torch.compile`` imports it), not earlier: importing it
# costs ~1.3 s. Fallback when the name is gone: nothing listed (torch.compile over DistTensors
# may fail, as without). docs/static.md: each DistTensor op then runs eagerly.
LIBRARY_PACKAGES = ("autoparallel", "spmd_rules", "reshard")


def run_as_is_under_dynamo() -> None:
    """List the library's packages with Dynamo: now if ``torch._dynamo`` is imported, else as soon
    as it is (an import watcher that removes itself)."""
    when_dynamo_imported(_list_with_dynamo)


def when_dynamo_imported(action: Callable[[], None]) -> None:
    """Run ``action()`` now if ``torch._dynamo`` is imported, else right after it is (one import
    watcher, which removes itself, runs every action handed to it in order)."""
    if "torch._dynamo" in sys.modules:
        action()
        return
    watch = next((f for f in sys.meta_path if isinstance(f, _DynamoImportWatch)), None)
    if watch is None:
        watch = _DynamoImportWatch()
        sys.meta_path.insert(0, watch)
    if action not in watch.actions:
        watch.actions.append(action)


def _list_with_dynamo() -> None:
    try:
        from torch._dynamo import trace_rules
        for name in LIBRARY_PACKAGES:
            trace_rules.add(name)
    except Exception:  # noqa: BLE001  (a torch without it: nothing listed, see above)
        pass


# ``torch._dynamo.callback.callback_handler.register_start_callback``: Dynamo calls it as it
# starts compiling a frame (a torch.compile'd function's first call, a recompile); the engine
# looks for DistTensor ops under torch.compile (``in_compiled_call``) only from then on, so a
# process that never compiles pays one bool per op. Fallback when gone: never called (no
# warning that torch.compile runs DistTensor ops eagerly; they still run, as eagerly).
def on_dynamo_compile(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever Dynamo starts compiling a frame (registered as soon as
    ``torch._dynamo`` is imported; the library's own ``make_fx`` captures compile no frame)."""
    when_dynamo_imported(functools.partial(_register_compile_start, callback))


def _register_compile_start(callback: Callable[[], None]) -> None:
    try:
        from torch._dynamo.callback import callback_handler
        callback_handler.register_start_callback(lambda *_: callback())  # (older torch passes no arguments)
    except Exception:  # noqa: BLE001  (a torch without it: never called, see above)
        pass


# ``torch._C._dynamo.eval_frame.get_eval_frame_callback``: Dynamo's frame hook, set (not None or
# False: torch's own test in ``torch._dynamo.eval_frame._set_stance``) while a torch.compile'd
# function runs: its graphs and, after each graph break, the eager code between them, where every
# DistTensor op runs (the library's frames are run as they are, above). ``torch.compiler.
# is_compiling()`` is False there: it is True only while Dynamo traces, and it never traces the
# library's frames. Fallback when gone: "not in a compiled call" (no warning).
_eval_frame_callback: Callable[[], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None)


def in_compiled_call() -> bool:
    """Whether this code runs inside a call of a ``torch.compile``'d function (Dynamo's frame
    hook is set), in a graph or in the eager code after a graph break."""
    if _eval_frame_callback is None:
        return False
    hook = _eval_frame_callback()
    return hook is not None and hook is not False


class _DynamoImportWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch._dynamo`` is imported, its loader runs the ``actions``
    (``when_dynamo_imported``) right after the module ran."""

    def __init__(self) -> None:
        self.actions: list[Callable[[], None]] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:  # the finders after it, as the import system would ask them
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, actions = spec.loader.exec_module, self.actions

        def exec_module(module: Any) -> None:
            run(module)
            for action in actions:
                action()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader object
        return spec


# ---- pytrees and flat buffers ---------------------------------------------------------------------
try:
    from torch.utils._pytree import tree_flatten, tree_unflatten
except ImportError:  # pragma: no cover - the public module of newer torch
    from torch.utils.pytree import tree_flatten, tree_unflatten  # type: ignore[no-redef]

try:  # one flat buffer of many tensors, in C++ (gradient buckets)
    from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
    from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors
except ImportError:  # pragma: no cover - the same in Python
    def flatten_dense_tensors(tensors: Any) -> torch.Tensor:  # type: ignore[misc]
        return torch.cat([t.reshape(-1) for t in tensors])

    def unflatten_dense_tensors(flat: torch.Tensor, tensors: Any) -> list[torch.Tensor]:  # type: ignore[misc]
        out, offset = [], 0
        for t in tensors:
            out.append(flat.narrow(0, offset, t.numel()).view_as(t))
            offset += t.numel()
        return out


__all__ = [
    "LIBRARY_PACKAGES", "REENTRANT_CHECKPOINT_NODE", "run_as_is_under_dynamo", "when_dynamo_imported", "on_dynamo_compile", "in_compiled_call", "profiler_enabled", "global_module_hooks", "in_backward", "current_autograd_node", "tensor_use_count", "OBSERVER_HOOK", "modes_active", "OWN_OBSERVER", "foreign_saved_hooks", "foreign_dispatch_modes", "PLAIN_VALUES", "boxed", "release_saved", "mark_own_observer",
    "GRAD_SCALER_UNSCALE", "HAS_GRAD_SCALER_UNSCALE", "amp_check_and_unscale_",
    "WRAPPER_POSITIONAL", "TorchDispatchMode", "all_op_schemas", "disable_torch_function_subclass", "disabled_torch_function_impl", "flatten_dense_tensors",
    "attribute_access", "enable_torch_function", "torch_function_enabled",
    "make_wrapper_subclass", "meta_in_tls", "no_dispatch", "optimizer_global_hooks", "tree_flatten", "tree_unflatten",
    "unflatten_dense_tensors", "will_engine_execute_node",
    "own_parameters", "set_own_parameters", "own_buffers", "own_tensor", "put_tensor", "child_modules",
    "set_child_modules", "module_hooks", "forward_hook_fns", "has_tensor_hooks", "RngResets",
]


def whole(x: Any) -> Any:
    """``int(x)``, but a symbolic size (``torch.SymInt``) stays one: ``int()`` of it would fix it
    to its present value (a guard that the size is exactly that)."""
    return x if isinstance(x, torch.SymInt) else int(x)


def size_hint(x: Any) -> int:
    """The value a symbolic size has in the capture that made it (an int as it is)."""
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


# Ops whose fake (meta) kernel reads a symbolic size as an int, which fixes it (a guard
# ``Eq(s, n)``: the capture's program would serve one length only). ``constant_pad_nd``'s does
# (``F.pad``, which a causal LM's loss applies to its labels); torch's decomposition keeps it open.
OPEN_SIZE_OPS = frozenset({torch.ops.aten.constant_pad_nd.default})


def open_size_impl(func: Any, args: Any) -> Callable[..., Any]:
    """What runs ``func`` (one of ``OPEN_SIZE_OPS``) on ``args``: torch's decomposition of it
    where a tensor among ``args`` has a symbolic size, else ``func`` itself."""
    if not any(isinstance(a, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in a.shape) for a in args):
        return func
    from torch._decomp import decomposition_table

    return decomposition_table.get(func, func)  # type: ignore[no-any-return]


def size_dtype(*values: Any) -> Any:
    """The numpy dtype of an array of sizes or byte counts: ``object`` where one of ``values``
    (or of the arrays among them) holds a ``torch.SymInt``, else ``numpy.int64``."""
    import numpy as np

    for v in values:
        if isinstance(v, torch.SymInt) or getattr(v, "dtype", None) is np.dtype(object):
            return object
        if isinstance(v, (tuple, list)) and any(isinstance(x, torch.SymInt) for x in v):
            return object
    return np.int64


def metadata_cache(maxsize: int | None = 128) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.lru_cache`` for pure functions of shapes and layouts that may be handed a
    ``torch.SymInt`` (a size a symbolic capture leaves open), which torch makes unhashable: such a
    call runs uncached, its comparisons then recording their guards in the capture's shape
    environment. Every other call is cached as ``lru_cache`` caches it."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return cached(*args, **kwargs)
            except TypeError as e:
                if "SymInt" not in str(e):
                    raise
                return fn(*args, **kwargs)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return call

    return wrap
