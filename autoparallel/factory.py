"""Factories: ``ones``/``zeros``/``full``/``empty``/``rand``/``randn`` built directly as DistTensors.

``ones``, ``zeros``, ``full`` and ``empty`` allocate only this rank's shard: the full tensor is
never materialised. ``rand``/``randn`` follow the random-op contract of ``spmd_rules.random_ops``:
every rank (members of the mesh or not) draws the WHOLE tensor from its generator and keeps its
box, so the result equals ``torch.rand(shape)`` on one device for the same seed and every
generator ends where the single-device program leaves it. Call ``torch.manual_seed(s)`` with the
same ``s`` on every rank; the draw costs O(full size) memory transiently.

Partial placements hold the value in Partial form: for ``sum`` on the first rank of the axis
(zeros elsewhere), for ``avg``/``max``/``min`` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel import runtime
from autoparallel.api import _check_mesh, _check_placements
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Placement
from autoparallel.spec import DistSpec
from spmd_rules.random_ops import local_piece

Size = int | Sequence[int]


def _shape(size: tuple[Any, ...], where: str) -> tuple[int, ...]:
    """``(2, 3)`` or ``((2, 3),)`` -> ``(2, 3)``, as torch factories accept both."""
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise TypeError(f"{where}: shape must be non-negative ints, got {size!r}")
    return tuple(int(s) for s in size)


def _spec(where: str, shape: tuple[int, ...], mesh: ProcessMesh, placements: Sequence[Placement],
          dtype: torch.dtype) -> tuple[DistSpec, tuple[int, ...] | None]:
    """The validated layout and this rank's mesh coordinate (None outside the mesh)."""
    pl = _check_placements(placements, where, mesh)
    mesh = _check_mesh(mesh, where)
    return DistSpec(mesh, pl, shape, dtype), mesh.coordinate_of(runtime.get_rank())


def _wrap(spec: DistSpec, local: torch.Tensor | None, requires_grad: bool) -> DistTensor:
    if local is None:  # outside the mesh
        local = torch.empty((0,), dtype=spec.dtype, device=runtime.default_device())
    out = layout.wrap(local, spec, None, requires_grad)
    if requires_grad:
        layout.keep_grad_layout(out)  # a leaf's gradient in its own layout
    return out


def _constant(where: str, shape: tuple[int, ...], value: Any, mesh: ProcessMesh, placements: Sequence[Placement],
              dtype: torch.dtype, requires_grad: bool) -> DistTensor:
    """A DistTensor of ``value`` everywhere (``None``: uninitialised), allocated at local size only."""
    spec, coord = _spec(where, shape, mesh, placements, dtype)
    local = None
    if coord is not None:
        local_shape, device = spec.local_shape(coord), runtime.default_device()
        zero_here = any(
            isinstance(p, Partial) and p.reduce_type == "sum" and coord[a] != 0 for a, p in enumerate(spec.placements)
        )
        if value is None:
            local = torch.empty(local_shape, dtype=dtype, device=device)
        else:
            local = torch.full(local_shape, 0 if zero_here else value, dtype=dtype, device=device)
    return _wrap(spec, local, requires_grad)


def _random(where: str, shape: tuple[int, ...], draw: Callable[..., torch.Tensor], mesh: ProcessMesh,
            placements: Sequence[Placement], dtype: torch.dtype, requires_grad: bool,
            generator: torch.Generator | None) -> DistTensor:
    """Every rank, in the mesh or not, draws the whole tensor (as one device would); members keep their piece."""
    spec, coord = _spec(where, shape, mesh, placements, dtype)
    full = draw(shape, dtype=dtype, device=runtime.default_device(), generator=generator)
    return _wrap(spec, None if coord is None else local_piece(full, spec, coord), requires_grad)


def ones(*size: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> DistTensor:
    """A DistTensor of ones of global ``size`` laid out by ``placements`` (local shard only)."""
    dt = dtype or torch.get_default_dtype()
    return _constant("ones", _shape(size, "ones"), 1, mesh, placements, dt, requires_grad)


def zeros(*size: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> DistTensor:
    """A DistTensor of zeros of global ``size`` laid out by ``placements`` (local shard only)."""
    dt = dtype or torch.get_default_dtype()
    return _constant("zeros", _shape(size, "zeros"), 0, mesh, placements, dt, requires_grad)


def empty(*size: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> DistTensor:
    """An uninitialised DistTensor of global ``size`` (local shard only)."""
    dt = dtype or torch.get_default_dtype()
    return _constant("empty", _shape(size, "empty"), None, mesh, placements, dt, requires_grad)


def full(size: Size, fill_value: Any, *, mesh: ProcessMesh, placements: Sequence[Placement],
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DistTensor:
    """A DistTensor filled with ``fill_value`` (dtype inferred like ``torch.full``; local shard only)."""
    dt = dtype or torch.full((), fill_value).dtype
    return _constant("full", _shape((size,), "full"), fill_value, mesh, placements, dt, requires_grad)


def rand(*size: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: torch.dtype | None = None,
         requires_grad: bool = False, generator: torch.Generator | None = None) -> DistTensor:
    """Uniform [0, 1) samples equal to ``torch.rand(size)`` for the same seed (see module doc)."""
    dt = dtype or torch.get_default_dtype()
    return _random("rand", _shape(size, "rand"), torch.rand, mesh, placements, dt, requires_grad, generator)


def randn(*size: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: torch.dtype | None = None,
          requires_grad: bool = False, generator: torch.Generator | None = None) -> DistTensor:
    """Standard normal samples equal to ``torch.randn(size)`` for the same seed (see module doc)."""
    dt = dtype or torch.get_default_dtype()
    return _random("randn", _shape(size, "randn"), torch.randn, mesh, placements, dt, requires_grad, generator)


__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]
