"""Embedded default dataset: three interleaved spirals in 2-d (deterministic, no download)."""

from __future__ import annotations

import math

import torch


def spirals(n_per_class: int = 256, classes: int = 3, noise: float = 0.15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Points ``x`` of shape (n_per_class * classes, 2) and integer labels ``y``."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, n_per_class)
        theta = torch.linspace(c * 2 * math.pi / classes, c * 2 * math.pi / classes + 3.5, n_per_class)
        theta = theta + noise * torch.randn(n_per_class, generator=g)
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((n_per_class,), c, dtype=torch.long))
    x, y = torch.cat(xs), torch.cat(ys)
    perm = torch.randperm(len(x), generator=g)
    return x[perm], y[perm]
