"""Helpers for building DistTensors with known values in worker processes (imported by tests)."""

from __future__ import annotations

import torch

import autoparallel as ap
from autoparallel.placement import Partial


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
        for dim, (off, length) in enumerate(spec.local_box(coord)):
            piece = piece.narrow(dim, off, length)
        local = piece.clone()
    return ap.dtensor_from_local(local, mesh, list(placements), shape=tuple(full.shape), shard_order=shard_order)
