"""Helpers for building DistTensors with known values in worker processes (imported by tests)."""

from __future__ import annotations

import torch

import autoparallel as ap
from autoparallel.placement import Partial, Shard, StridedShard, chunk_bounds


def reference(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def summand(full: torch.Tensor, placements: tuple, mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> torch.Tensor:
    """The piece the rank at ``coord`` holds so that reducing the Partial axes gives ``full``.

    sum: weight (c+1)/T; avg: weight 2(c+1)/(n+1); max: full - c; min: full + c (per axis).
    """
    piece = full.clone()
    for a, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        n, c = mesh_shape[a], coord[a]
        if p.reduce_type == "sum":
            piece = piece * ((c + 1) / (n * (n + 1) / 2))
        elif p.reduce_type == "avg":
            piece = piece * (2 * (c + 1) / (n + 1))
        elif p.reduce_type == "max":
            piece = piece - c
        else:
            piece = piece + c
    return piece


def make_dist(full: torch.Tensor, mesh: ap.ProcessMesh, placements: tuple, shard_order=None) -> ap.DistTensor:
    """A DistTensor whose value is ``full``, built from per-rank summands/shards."""
    spec = ap.DistSpec(mesh, tuple(placements), tuple(full.shape), full.dtype,
                       tuple((d, tuple(a)) for d, a in (shard_order or {}).items()))
    coord = mesh.coordinate_of(ap.get_rank())
    if coord is None:
        local = full.new_empty((0,))
    else:
        piece = summand(full, spec.placements, tuple(mesh.shape), coord)
        for dim in range(piece.dim()):
            piece = piece.index_select(dim, torch.tensor(held_indices(spec, coord, dim), dtype=torch.long))
        local = piece.clone()
    return ap.dtensor_from_local(local, mesh, list(placements), shape=tuple(full.shape), shard_order=shard_order)


def _chunked(indices: list[int], axes: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> list[int]:
    for a in axes:
        off, length = chunk_bounds(len(indices), mesh_shape[a], coord[a])
        indices = indices[off:off + length]
    return indices


def held_indices(spec: ap.DistSpec, coord: tuple[int, ...], dim: int) -> list[int]:
    """The global indices along ``dim`` of the rank at ``coord``, in its local order, from the
    placements' definitions (a reference: no ``local_box``, no expansion)."""
    mesh_shape, size = tuple(spec.mesh.shape), spec.shape[dim]
    plain = tuple(a for a in spec.axes_of_dim(dim) if isinstance(spec.placements[a], Shard))
    strided = [(a, p) for a, p in enumerate(spec.placements) if isinstance(p, StridedShard) and p.dim == dim]
    if not strided:
        return _chunked(list(range(size)), plain, mesh_shape, coord)
    blocks, block = strided[0][1].split_factor, size // strided[0][1].split_factor
    inner = _chunked(list(range(block)), tuple(a for a, _ in strided), mesh_shape, coord)
    return [b * block + i for b in _chunked(list(range(blocks)), plain, mesh_shape, coord) for i in inner]
