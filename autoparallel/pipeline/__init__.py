"""Pipeline parallelism across stage meshes: stage splitting and schedules as data."""

from __future__ import annotations

__all__: list[str] = []
