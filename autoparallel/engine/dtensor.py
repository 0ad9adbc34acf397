"""``DistTensor``: a global tensor whose bytes live as per-rank shards.

A wrapper subclass: the wrapper carries the global shape, stride, dtype and ``requires_grad``
(so autograd sees the global tensor); ``_local`` is this rank's shard and ``_spec`` its layout.
Every aten op reaching ``__torch_dispatch__`` goes through ``autoparallel.engine.dispatch``.

``torch.compile`` over DistTensors compiles none of the distributed step: Dynamo stops its graph
before every DistTensor op (the library's packages run as they are:
``compat.run_as_is_under_dynamo``), so a compiled model runs each op eagerly — correct, and
slower than it looks. ``NOTICE`` says so once per process, at the first DistTensor op inside a
compiled call, pointing to the static step, whose program inductor does compile.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, cast

import torch

from autoparallel import compat, runtime
from autoparallel.engine.dispatch import (
    adopt_plain_leaves,
    adopt_written_plain,
    dispatch,
    is_in_place_name,
    whole_world_mesh,
)
from autoparallel.engine.execute import outside
from autoparallel.mesh import Dims, ProcessMesh
from autoparallel.placement import Partial, Replicate
from autoparallel.runtime import agree
from autoparallel.spec import DistSpec
from autoparallel.strides import conform, contiguous_strides, dense_in, dense_strides, nesting
from reshard.executor import piece_of_whole, reshard_local

# ---- the notice that torch.compile compiles none of the distributed step -------------------------
COMPILE_NOTICE = (
    "autoparallel: torch.compile runs every DistTensor op eagerly: Dynamo stops its graph before each "
    "one (the library's own code runs as it is), so none of the distributed step is compiled. To compile "
    "it, capture the step with ap.to_static(model, loss=..., optimizer=..., strategy=ap.Strategy("
    "compile=\"inductor\")): its program is plain tensors and collectives, which inductor compiles "
    "(docs/static.md)")


class _CompileNotice:
    """``COMPILE_NOTICE``, said once per process, at the first DistTensor op that runs inside a
    ``torch.compile``'d call (where Dynamo broke its graph: ``compat.in_compiled_call``).

    ``armed`` is the one bool every op reads: set when Dynamo starts compiling a frame
    (``compat.on_dynamo_compile``), so a process that never compiles looks no further. The
    library's own captures (``make_fx``) compile no frame; its inductor programs run no
    DistTensor op."""

    __slots__ = ("armed", "said")

    def __init__(self) -> None:
        self.armed = self.said = False

    def arm(self) -> None:
        self.armed = not self.said

    def check(self) -> None:
        if compat.in_compiled_call():
            self.armed, self.said = False, True
            warnings.warn(COMPILE_NOTICE, stacklevel=_caller_level())

    def forget(self) -> None:
        """Say it again at the next DistTensor op inside a compiled call."""
        self.armed, self.said = True, False


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch and this library (the user's call)."""
    frame, level = sys._getframe(2), 2  # (stacklevel 1 is ``check``, the caller of ``warnings.warn``)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_INSIDE = (os.path.dirname(torch.__file__) + os.sep, *(os.path.join(_ROOT, p) + os.sep for p in compat.LIBRARY_PACKAGES))
NOTICE = _CompileNotice()
compat.on_dynamo_compile(NOTICE.arm)


def forget_compile_notice() -> None:
    """Let ``torch.compile`` over DistTensors warn again (it warns once per process)."""
    NOTICE.forget()


_COMPILE = NOTICE


# ---- DistTensor ----------------------------------------------------------------------------------
_DETACH = torch.ops.aten.detach.default


def contiguous_local(local: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """``local`` made to follow the contiguous wrapper of ``spec`` (``autoparallel.strides``):
    a shard that a slice, an expanded gradient or a transpose left otherwise is copied."""
    return conform(local, contiguous_strides(spec.shape))


_IN_PLACE, _SPLIT_AT, _GRAD_FLAG, _BACKWARD, _SET_DATA, _READ_WHOLE = 1, 2, 3, 4, 5, 6
# ``t.tolist()`` / ``t.numpy()``: the whole value, read as ``item()`` reads it (every rank of the mesh)
_READS_WHOLE = (torch.Tensor.tolist, torch.Tensor.numpy)
# ``t.data = new`` (``module.to(dtype)``, ``module.half()``, ``p.data = ...``): the shard and layout follow
_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # a getset descriptor
# ``t.requires_grad_()`` and ``t.requires_grad = ...``: a leaf that starts requiring grad gets its
# gradient in its own layout (``keep_grad_layout``)
# ``nn.Parameter(dist_tensor)`` makes its parameter with ``data.detach().requires_grad_()``
_PARAMETER_NEW = torch.nn.Parameter.__new__.__code__
_GRAD_FLAGS = (torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__)  # type: ignore[attr-defined]  # a getset descriptor
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the exact types of plain tensors and parameters
_TF_KIND: dict[Any, int] = {}  # torch function -> 0 (pass through), _IN_PLACE, _SPLIT_AT, _GRAD_FLAG or _BACKWARD
# Functions taking split points as a tensor whose values torch's C++ reads from its memory (a
# DistTensor has none: "data is not allocated"): the whole value is passed instead.
_SPLIT_POINTS = {torch.tensor_split: ("tensor_indices_or_sections", "indices_or_sections", "indices", "sections"),
                 torch.Tensor.tensor_split: ("tensor_indices_or_sections", "indices_or_sections", "indices", "sections")}


def _tf_kind(func: Any) -> int:
    """What ``DistTensor.__torch_function__`` looks at for ``func`` (cached per function)."""
    if any(func == f for f in _GRAD_FLAGS):
        return _GRAD_FLAG
    if func in _SPLIT_POINTS:
        return _SPLIT_AT
    if func is torch.Tensor.backward:
        return _BACKWARD
    if func == _DATA_SET:
        return _SET_DATA
    if func in _READS_WHOLE:
        return _READ_WHOLE
    name = getattr(func, "__name__", "")
    return _IN_PLACE if isinstance(name, str) and is_in_place_name(name) else 0


def _replicated_with_grad(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with every plain tensor that requires grad and is not a leaf (a value
    the model computed on plain tensors, e.g. T5's position bias under gradient checkpointing)
    made a Replicate DistTensor on the DistTensors' mesh, differentiably: its gradient comes back
    as the full plain gradient on every rank. Like any plain tensor mixed in, it must hold the
    same value on every rank (``agree.check_plain``). Left as it is — and the op raises its
    ``TypeError`` — when the DistTensors live on several meshes or the mesh is not the whole world."""
    items = (*args, *kwargs.values())
    grads = [a for a in items if type(a) in _PLAIN and a.requires_grad and not a.is_leaf and a.dim() != 0]
    if not grads:
        return args, kwargs
    mesh = whole_world_mesh(cls, items)
    if mesh is None:
        return args, kwargs
    agree.check_plain(f"a plain tensor that requires grad in {getattr(func, '__name__', func)}", mesh, grads)
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    made: dict[int, Any] = {}

    def replicated(a: Any) -> Any:
        if not any(a is g for g in grads):
            return a
        if id(a) not in made:
            made[id(a)] = _ShardTensor.apply(a, DistSpec(mesh, rep, tuple(a.shape), a.dtype))
        return made[id(a)]

    return tuple(replicated(a) for a in args), {k: replicated(v) for k, v in kwargs.items()}


def _data_for(cls: Any, t: DistTensor, new: Any) -> Any:
    """What ``t.data = new`` gives ``t``: a DistTensor as it is; a plain tensor is the global value,
    laid out as ``t`` is (it must have ``t``'s global shape; the same value on every rank, as any
    plain tensor mixed in)."""
    if isinstance(new, cls) or not isinstance(new, torch.Tensor):
        return new  # (anything else: torch's own error)
    spec = t._spec
    if tuple(new.shape) != spec.shape or spec.has_partial:
        raise ValueError(
            f"DistTensor.data = a plain tensor of shape {tuple(new.shape)}: a DistTensor's data takes its global "
            f"value (shape {spec.shape}), laid out as it is ({list(spec.placements)}; not Partial); assign a "
            "DistTensor to change its layout or shape")
    spec = spec.with_dtype(new.dtype)
    return DistTensor._wrap(piece_of_whole(new.detach(), spec).contiguous(), spec)


_BACKWARD_ARGS = ("gradient", "retain_graph", "create_graph", "inputs")
_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)


def _backward_as_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``loss.backward()`` run with subclass ``__torch_function__`` handling on, as the forward
    ran; False: not done (torch's default then runs it with that handling off).

    torch's default turns the handling off for the function it hands on, which here is the
    whole backward pass: a recompute inside it (torch's checkpoint) would then skip what the
    forward's ``__torch_function__`` did (plain leaves and written plain tensors laid out, split
    points read whole) and take another path. The pass starts from the loss's gradient edge,
    which no ``__torch_function__`` looks at."""
    bound = dict(zip(_BACKWARD_ARGS, args[1:]))
    bound.update(kwargs)
    loss = args[0]
    if (_gradient_edge is None or bound.get("inputs") is not None or not isinstance(loss, DistTensor)
            or not loss.requires_grad or set(bound) - set(_BACKWARD_ARGS)):
        return False
    gradient = bound.get("gradient")
    if gradient is None:
        if loss.numel() != 1:
            return False  # (torch's own error: a gradient is needed for a non-scalar)
        gradient = torch.ones_like(loss, memory_format=torch.preserve_format)
    elif type(gradient) in _PLAIN and tuple(gradient.shape) == loss._spec.shape:
        # a plain gradient is the global value (the same on every rank, as any plain tensor mixed
        # in): laid out as the loss (Partial axes replicated), so the gradients stay DistTensors
        spec = loss._spec.without_partial().with_dtype(gradient.dtype)
        gradient = DistTensor._wrap(piece_of_whole(gradient.detach(), spec).contiguous(), spec)
    torch.autograd.backward(_gradient_edge(loss), grad_tensors=gradient, retain_graph=bound.get("retain_graph"),
                            create_graph=bool(bound.get("create_graph", False)))
    return True


class DistTensor(torch.Tensor):
    """A tensor of global ``shape`` laid out on ``process_mesh`` by ``placements``.

    Build one with ``ap.shard_tensor`` or ``ap.dtensor_from_local``; read it back with
    ``to_local()`` (this rank's shard) or ``full_tensor()`` (the whole value on every member).
    Ranks outside the mesh hold an empty local tensor and skip compute.
    """

    _local: torch.Tensor
    _spec: DistSpec
    _stride: tuple[int, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: DistSpec, *, requires_grad: bool = False) -> DistTensor:
        return cls._wrap(local, spec, None, requires_grad)

    @classmethod
    def _wrap(
        cls,
        local: torch.Tensor,
        spec: DistSpec,
        stride: tuple[int, ...] | None = None,
        requires_grad: bool = False,
    ) -> DistTensor:
        stride = stride if stride is not None else contiguous_strides(spec.shape)
        if spec.symbolic:  # a capture's open sizes: made outside the trace's recording (``_open_layout``)
            spec, stride = _open_layout(local, spec, stride)
            with compat.outside_trace(keep_fake=True):
                r = _make_wrapper(cls, spec.shape, strides=stride, dtype=spec.dtype, device=local.device,
                                  layout=local.layout, requires_grad=requires_grad)
        elif compat.WRAPPER_POSITIONAL:  # the same call without keyword parsing (every op output comes here)
            r = _make_wrapper(cls, spec.shape, stride, None, None, spec.dtype, local.layout, local.device, False, requires_grad)
        else:
            r = _make_wrapper(cls, spec.shape, strides=stride, dtype=spec.dtype, device=local.device,
                              layout=local.layout, requires_grad=requires_grad)
        r._local = local
        r._spec = spec
        r._stride = tuple(stride)
        return r

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        """Torch's default without wrapping results (ops decompose below Python and reach
        ``__torch_dispatch__``), after a few looks: a plain leaf that requires grad (a parameter
        left plain) becomes a Replicate DistTensor in place (``dispatch.adopt_plain_leaves``); an
        in-place op writing a plain tensor with a value that requires grad makes it a DistTensor
        first (``dispatch.adopt_written_plain``); split points given as a DistTensor are read whole;
        ``loss.backward()`` runs as the forward did. Inside a ``torch.compile``'d call the first
        op warns that it runs eagerly (``_CompileNotice``)."""
        if _COMPILE.armed:  # (a torch.compile started in this process and has not warned yet)
            _COMPILE.check()
        for a in (*args, *kwargs.values()) if kwargs else args:  # a plain tensor that requires grad: a
            if type(a) in _PLAIN and a.requires_grad:  # leaf (a parameter left plain) laid out first, any other replicated
                adopt_plain_leaves(cls, func, args, kwargs or {})
                args, kwargs = _replicated_with_grad(cls, func, args, kwargs or {})
                break
        kind = _TF_KIND.get(func)
        if kind is None:
            kind = _TF_KIND[func] = _tf_kind(func)
        if kind and args:
            if kind == _IN_PLACE:
                adopt_written_plain(cls, func.__name__, args)
            elif kind == _GRAD_FLAG:
                out = compat.disabled_torch_function_impl(func, types, args, kwargs or {})
                if sys._getframe(1).f_code is not _PARAMETER_NEW:  # (a parameter in the making: not a leaf input)
                    keep_grad_layout(args[0])
                return out
            elif kind == _SPLIT_AT:
                args, kwargs = _whole_split_points(cls, func, args, kwargs or {})
            elif kind == _BACKWARD and _backward_as_forward(args, kwargs or {}):
                return None
            elif kind == _READ_WHOLE and isinstance(args[0], cls):
                x = args[0]
                if x._spec.mesh.coordinate_of(_rank()) is None:
                    raise outside(func, x._spec.mesh)
                if func is torch.Tensor.numpy and x.requires_grad:  # (torch's rule, before anything moves)
                    raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
                return func(_full_local(x), *args[1:], **(kwargs or {}))
            elif kind == _SET_DATA and len(args) == 2 and isinstance(args[0], cls):
                args = (args[0], _data_for(cls, args[0], args[1]))
                compat.disabled_torch_function_impl(func, types, args, {})  # the wrapper's dtype, shape, device
                t, new = args
                t._local, t._spec, t._stride = new._local, new._spec, new._stride
                return None
        return compat.disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch types it as a plain function
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(cls, func, args, kwargs or {})

    # ---- layout ---------------------------------------------------------------------------
    @property
    def placements(self) -> Dims:
        return Dims(self._spec.placements)

    @property
    def process_mesh(self) -> ProcessMesh:
        return self._spec.mesh

    @property
    def dist_spec(self) -> DistSpec:
        return self._spec

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self._local.shape)

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:
        """This rank's shard (differentiable; its gradient flows back as a DistTensor)."""
        if not (self.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate
            if grad_placements is not None:
                self._spec.with_placements(grad_placements)  # the same checks as with autograd
            return self._local.view_as(self._local)
        return _ToLocal.apply(self, grad_placements)

    def full_tensor(self) -> torch.Tensor:
        """The whole value on every rank of the mesh (differentiable); empty off the mesh."""
        if not (self.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate
            return _full_local(self)
        return _FullTensor.apply(self)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DistTensor(local={self._local!r}, mesh={self._spec.mesh!r}, "
            f"placements={list(self._spec.placements)}, shape={tuple(self._spec.shape)})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as this rank's shard with its layout and the rank that saved
        it: only that rank, in a world of the same size, may load it (another rank would get a
        shard that is not its own; see ``_unpickled``). A whole checkpoint: ``ap.save_state_dict``."""
        return (_unpickled, (self._local, self._spec, self._stride, self.requires_grad,
                             (runtime.get_rank(), runtime.get_world_size()), isinstance(self, torch.nn.Parameter)))


def _unpickled(local: torch.Tensor, spec: DistSpec, stride: tuple[int, ...], requires_grad: bool,
               saver: tuple[int, int], parameter: bool = False) -> DistTensor:
    """A pickled DistTensor back (``torch.load``), on the rank that saved it (``parameter``: as
    an ``nn.Parameter``, as it was)."""
    here = (runtime.get_rank(), runtime.get_world_size())
    if here != saver:
        raise ValueError(
            f"this DistTensor was saved by rank {saver[0]} of a world of {saver[1]} and holds that rank's "
            f"shard only; it is loaded by rank {here[0]} of a world of {here[1]}. Load each rank's file on "
            "its own rank, or save the whole value: ap.save_state_dict (any layout and world size on "
            "load) or t.full_tensor()")
    out = DistTensor._wrap(local, spec, stride, requires_grad)
    return cast(DistTensor, torch.nn.Parameter(out, requires_grad=requires_grad)) if parameter else out


class _InFlight:
    """An asynchronous collective's work, waited for once by whichever tensor reads first."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class AwaitedTensor(DistTensor):
    """A DistTensor whose shard an asynchronous collective is still writing (ZeRO-3's
    overlapped reduce-scatter: the gradient exists at once, its bytes when the reduction ends).
    Reading ``_local`` — any op on the value, ``to_local``, ``full_tensor`` — waits first and
    casts the received buffer to the layout's dtype; autograd's detach of a kept gradient does
    not wait. Every member started the collective, so a read on some ranks only never hangs."""

    _raw: torch.Tensor                 # the buffer the collective writes
    _flight: _InFlight
    _done: torch.Tensor | None         # the shard, once received

    @classmethod
    def make(cls, raw: torch.Tensor, spec: DistSpec, stride: tuple[int, ...] | None, flight: _InFlight) -> AwaitedTensor:
        r = cast(AwaitedTensor, cls._wrap(raw, spec, stride))
        r._raw, r._flight, r._done = raw, flight, None
        return r

    @property  # type: ignore[override]  # DistTensor stores _local as a plain attribute
    def _local(self) -> torch.Tensor:
        if self._done is None:
            self._flight.wait()
            raw = self._raw
            self._done = self._raw = raw if raw.dtype == self._spec.dtype else raw.to(self._spec.dtype)
        return self._done

    @_local.setter
    def _local(self, value: torch.Tensor) -> None:  # a write replaces the value (make clears it)
        self._done = self._raw = value

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        """Torch calls this (a subclass goes first) for every op with an AwaitedTensor argument."""
        if func is _DETACH and len(args) == 1 and not kwargs and type(args[0]) is AwaitedTensor and args[0]._done is None:
            a = args[0]  # autograd detaches every gradient it keeps: the same bytes, still in flight
            return AwaitedTensor.make(a._raw.detach(), a._spec, a._stride, a._flight)
        return dispatch(DistTensor, func, args, kwargs or {})


def awaited(raw: torch.Tensor, spec: DistSpec, work: Any) -> DistTensor:
    """A DistTensor whose shard is ``raw`` (cast to ``spec``'s dtype) once ``work`` (an
    asynchronous collective writing ``raw``) is done."""
    return AwaitedTensor.make(raw, spec, None, _InFlight(work))


_make_wrapper = compat.make_wrapper_subclass


def keep_grad_layout(t: Any) -> None:
    """Make ``.grad`` of the leaf ``t`` (not a parameter) come back in ``t``'s own layout.

    The gradient of a leaf arrives in ``grad_spec`` of its layout, or Partial where the backward
    left summands (a Replicate input of an op on a sharded batch): each rank would read a
    summand. A post-accumulate-grad hook reshards it to the leaf's placements (an all-reduce or
    reduce-scatter, on every rank in backward order), as Paddle does for leaf gradients.
    Parameters are left to the optimizer: ``shard_optimizer`` reduces their gradients in
    buckets, and an optimizer's ops reduce a Partial gradient where they read it.
    """
    if (isinstance(t, DistTensor) and t.requires_grad and t.is_leaf and not isinstance(t, torch.nn.Parameter)
            and not getattr(t, "_grad_layout_kept", False)):
        handle: Any = None

        def hook(leaf: DistTensor) -> None:
            _grad_to_own_layout(leaf, handle)

        handle = t.register_post_accumulate_grad_hook(hook)
        t._grad_layout_kept = True  # type: ignore[attr-defined]  # once per tensor


def _grad_to_own_layout(t: DistTensor, handle: Any) -> None:
    if isinstance(t, torch.nn.Parameter):  # made a parameter after the hook: the optimizer's business
        handle.remove()
        return
    g = t.grad
    want = t._spec
    if (not isinstance(g, DistTensor) or g._spec.mesh != want.mesh or want.has_partial
            or (g._spec.placements == want.placements and g._spec.shard_order == want.shard_order)):
        return
    dst = g._spec.with_placements(want.placements, want.shard_order)
    with torch.no_grad():
        t.grad = _moved(g, dst)



# ---- differentiable conversions -----------------------------------------------------------
# The gradient of a layout change is the reverse layout change, except that the gradient of a
# Partial value is Replicate: every summand receives the whole incoming gradient.


def grad_spec(spec: DistSpec) -> DistSpec:
    """Layout the gradient of a tensor of layout ``spec`` comes back in: Partial -> Replicate."""
    return spec.without_partial()


def replicated(spec: DistSpec) -> DistSpec:
    return spec.with_placements([Replicate()] * spec.mesh.ndim)


class _FromLocal(torch.autograd.Function):
    """local shard -> DistTensor. Backward: gradient to the forward layout (P as R), its shard."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DistSpec) -> DistTensor:  # type: ignore[override]
        ctx.spec = spec
        # the wrapper advertises contiguous strides: a non-contiguous shard is copied
        return DistTensor._wrap(local.view_as(local) if local.is_contiguous() else local.contiguous(), spec)

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return reshard_local(grad._local, grad._spec, grad_spec(ctx.spec)), None


class _ShardTensor(torch.autograd.Function):
    """full tensor (same on every rank) -> DistTensor. Backward: the full gradient."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, spec: DistSpec) -> DistTensor:  # type: ignore[override]
        ctx.spec = spec
        ctx.shape = full.shape
        whole = full.detach()
        # (``reshard_local`` takes the same piece for replicated -> sharded; called directly, no
        # replicated spec is made, nor kept, per batch shape)
        local = reshard_local(whole, replicated(spec), spec) if spec.has_partial else piece_of_whole(whole, spec)
        return DistTensor._wrap(local.contiguous(), spec)  # the wrapper advertises contiguous strides

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        full = reshard_local(grad._local, grad._spec, replicated(ctx.spec))
        if ctx.spec.mesh.coordinate_of(_rank()) is None:
            full = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad._local.device)
        return full, None


class _ToLocal(torch.autograd.Function):
    """DistTensor -> its local shard. Backward: the local gradient in ``grad_placements``."""

    @staticmethod
    def forward(ctx: Any, x: DistTensor, grad_placements: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = x._spec if grad_placements is None else x._spec.with_placements(grad_placements)
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DistTensor, None]:  # type: ignore[override]
        return DistTensor._wrap(contiguous_local(grad, ctx.spec), ctx.spec), None


def _whole_split_points(cls: Any, func: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``tensor_split``'s split points (its second argument) as a plain tensor where they are a
    DistTensor: torch reads their values from memory, as it does for a plain CPU tensor."""
    if len(args) > 1 and isinstance(args[1], cls):
        args = (args[0], _full_local(args[1]), *args[2:])
    for name in _SPLIT_POINTS[func]:
        if isinstance(kwargs.get(name), cls):
            kwargs = {**kwargs, name: _full_local(kwargs[name])}
    return args, kwargs


def _full_local(x: DistTensor) -> torch.Tensor:
    """The whole value of ``x`` as a plain tensor (never the shard object itself)."""
    out = reshard_local(x._local, x._spec, replicated(x._spec))
    return out.view_as(out) if out is x._local else out


class _FullTensor(torch.autograd.Function):
    """DistTensor -> the whole value on every member. Backward: slice back to the layout."""

    @staticmethod
    def forward(ctx: Any, x: DistTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = x._spec
        return _full_local(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DistTensor]:  # type: ignore[override]
        target = grad_spec(ctx.spec)
        return (DistTensor._wrap(contiguous_local(reshard_local(grad, replicated(target), target), target), target),)


class _Reshard(torch.autograd.Function):
    """DistTensor -> the same value in another layout (or mesh). Backward: the reverse move."""

    @staticmethod
    def forward(ctx: Any, x: DistTensor, dst: DistSpec) -> DistTensor:  # type: ignore[override]
        ctx.src = x._spec
        # the same value in another layout keeps its strides, as it would in one process (a
        # transposed tensor stays transposed); the moved shard follows them
        moved = reshard_local(x._local, x._spec, dst)
        if moved.numel() and (moved is not x._local or _made_partial(x._spec, dst)) and _same_storage(moved, x._local):
            # a slice (R -> S), a summand kept (R -> P: the first rank's is x's value): a new tensor,
            # not a window onto x, so writes stay apart (on some ranks only, x would differ)
            moved = moved.clone()
        return DistTensor._wrap(conform(moved, x._stride), dst, x._stride)

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[DistTensor, None]:  # type: ignore[override]
        target = grad_spec(ctx.src)
        return _moved(grad, target), None


def _moved(t: DistTensor, spec: DistSpec) -> DistTensor:
    """``t``'s value in layout ``spec`` (a gradient's layout change, outside autograd)."""
    return DistTensor._wrap(contiguous_local(reshard_local(t._local, t._spec, spec), spec), spec)


def _made_partial(src: DistSpec, dst: DistSpec) -> bool:
    """Whether a move makes a Partial axis of a value that was not Partial there."""
    return src.mesh == dst.mesh and any(isinstance(q, Partial) and not isinstance(p, Partial)
                                        for p, q in zip(src.placements, dst.placements))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return compat.storage_id(a) == compat.storage_id(b)


def _rank() -> int:
    return runtime.get_rank()


def _open_layout(local: torch.Tensor, spec: DistSpec, stride: tuple[int, ...]) -> tuple[DistSpec, tuple[int, ...]]:
    """The layout and strides of a wrapper of open sizes (a capture's): its sizes the traced
    shard's where they are its own (``_traced_shape``), dense strides computed from them in their
    nesting, so that what the model reads of the wrapper is what the program computes."""
    spec = _traced_shape(local, spec)
    with compat.outside_trace(keep_fake=True):
        dense = stride == dense_strides(spec.shape, stride)
        order = nesting(stride)
    return spec, dense_in(spec.shape, order) if dense else stride


def _traced_shape(local: torch.Tensor, spec: DistSpec) -> DistSpec:
    """``spec`` with each symbolic global size that is its shard's size times the pieces of its dim
    (the same expression) computed from the shard's size. A capture's decisions make their sizes
    outside the trace; these are the trace's own, so that a size the model reads (``x.shape[1]``)
    and hands to a plain op (``torch.ones(t, t)``) is one the program computes from its inputs."""
    if local.dim() != spec.ndim:
        return spec
    shape = list(spec.shape)
    for d, n in enumerate(shape):
        if not isinstance(n, torch.SymInt) or not isinstance(local.shape[d], torch.SymInt):
            continue
        k = spec.pieces(d)
        own = local.shape[d] * k if k > 1 else local.shape[d]
        if k and own.node.expr == n.node.expr:
            shape[d] = own
    return spec.with_shape(tuple(shape))
