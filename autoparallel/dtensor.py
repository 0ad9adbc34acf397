"""``DistTensor``: a global tensor whose bytes live as per-rank shards.

A wrapper subclass: the wrapper carries the global shape, stride, dtype and ``requires_grad``
(so autograd sees the global tensor); ``_local`` is this rank's shard and ``_spec`` its layout.
Every aten op reaching ``__torch_dispatch__`` goes through ``autoparallel.dispatch``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.dispatch import dispatch
from autoparallel.mesh import Dims, ProcessMesh
from autoparallel.placement import Partial, Replicate
from autoparallel.spec import DistSpec
from reshard.executor import reshard_local


@lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (cached: every wrapper without explicit strides asks)."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


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
    def __new__(cls, local: torch.Tensor, spec: DistSpec, *, requires_grad: bool = False) -> "DistTensor":
        return cls._wrap(local, spec, None, requires_grad)

    @classmethod
    def _wrap(
        cls,
        local: torch.Tensor,
        spec: DistSpec,
        stride: tuple[int, ...] | None = None,
        requires_grad: bool = False,
    ) -> "DistTensor":
        stride = stride if stride is not None else contiguous_strides(spec.shape)
        if _POSITIONAL_WRAPPER:  # the same call without keyword parsing (every op output comes here)
            r = _make_wrapper(cls, spec.shape, stride, None, None, spec.dtype, local.layout, local.device, False, requires_grad)
        else:
            r = _make_wrapper(cls, spec.shape, strides=stride, dtype=spec.dtype, device=local.device,
                              layout=local.layout, requires_grad=requires_grad)
        r._local = local
        r._spec = spec
        r._stride = tuple(stride)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

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

    def _moved(self, move: Any, spec: DistSpec) -> "DistTensor":
        """This value in layout ``spec``: ``move`` (a layout change, linear) applied to the shard.
        A pending gradient (``autoparallel.pending``) moves its unscaled shard instead."""
        return DistTensor._wrap(move(self._local), spec)

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
        raise TypeError("DistTensor cannot be pickled; use ap.save_state_dict or full_tensor()")


_make_wrapper = torch.Tensor._make_wrapper_subclass  # type: ignore[attr-defined]


def _positional_wrapper_ok() -> bool:
    """Whether ``_make_wrapper_subclass`` takes (size, strides, storage_offset, memory_format,
    dtype, layout, device, pin_memory, requires_grad) positionally in this torch (a private
    API: checked once here, keywords otherwise)."""
    try:
        probe = _make_wrapper(DistTensor, (2, 3), (1, 2), None, None, torch.float64, torch.strided,
                              torch.device("cpu"), False, True)
    except Exception:  # noqa: BLE001
        return False
    return (tuple(probe.shape) == (2, 3) and probe.stride() == (1, 2) and probe.dtype == torch.float64
            and probe.layout == torch.strided and probe.device == torch.device("cpu") and probe.requires_grad)


_POSITIONAL_WRAPPER = _positional_wrapper_ok()


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
        local = reshard_local(full.detach(), replicated(spec), spec)
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
        return DistTensor._wrap(grad, ctx.spec), None


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
        return (DistTensor._wrap(reshard_local(grad, replicated(target), target), target),)


class _Reshard(torch.autograd.Function):
    """DistTensor -> the same value in another layout (or mesh). Backward: the reverse move."""

    @staticmethod
    def forward(ctx: Any, x: DistTensor, dst: DistSpec) -> DistTensor:  # type: ignore[override]
        ctx.src = x._spec
        return DistTensor._wrap(reshard_local(x._local, x._spec, dst), dst)

    @staticmethod
    def backward(ctx: Any, grad: DistTensor) -> tuple[DistTensor, None]:  # type: ignore[override]
        target = grad_spec(ctx.src)
        return grad._moved(lambda local: reshard_local(local, grad._spec, target), target), None


def _rank() -> int:
    return runtime.get_rank()
