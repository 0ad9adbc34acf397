"""Layout helpers shared by the parallel styles: bring a module's inputs/outputs to a layout.

A *layout* names what a tensor should be on the mesh:

- ``None`` — leave the value as it is;
- one placement (``Replicate()``, ``Shard(dim)``, ``Partial()``) — the placement on the
  tensor-parallel mesh axis; the other mesh axes keep theirs (a plain tensor counts as
  Replicate on every axis, i.e. the full value on every rank);
- a list with one placement per mesh axis — the whole layout.

A plain ``torch.Tensor`` is taken as the full value (``ap.shard_tensor``), a ``DistTensor`` is
resharded (``ap.reshard``, a no-op when it already has the layout); other values pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoparallel.api import reshard, shard_tensor
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import PLACEMENT_TYPES, Placement, Replicate, check_placement
from autoparallel.regions import moves

Layout = None | Placement | Sequence[Placement]


def check_layout(layout: Any, mesh: ProcessMesh, where: str) -> Layout:
    """``layout`` validated against ``mesh`` (pure; raises TypeError/ValueError naming it)."""
    if layout is None or isinstance(layout, PLACEMENT_TYPES):
        return layout
    if isinstance(layout, (list, tuple)):
        for p in layout:
            try:
                check_placement(p)
            except TypeError as e:
                raise TypeError(f"{where}: layout {layout!r}: {e}") from None
        if len(layout) != mesh.ndim:
            raise ValueError(
                f"{where}: layout {list(layout)} has {len(layout)} placements for a {mesh.ndim}-d mesh "
                f"with axes {mesh.dim_names}: give one placement per mesh axis, or a single placement "
                "for the tensor-parallel axis"
            )
        return tuple(layout)
    raise TypeError(
        f"{where}: layout {layout!r} is not None, a placement, or a list of placements (one per mesh axis)"
    )


def placements_for(x: Any, mesh: ProcessMesh, axis: int, layout: Layout) -> tuple[Placement, ...]:
    """Full placements ``layout`` asks for, starting from ``x``'s own (Replicate for plain)."""
    if isinstance(layout, PLACEMENT_TYPES):
        if isinstance(x, DistTensor):
            current = list(x.placements)
        else:
            current = [Replicate()] * mesh.ndim
        current[axis] = layout
        return tuple(current)
    assert isinstance(layout, tuple)
    return layout


def to_layout(x: Any, mesh: ProcessMesh, axis: int, layout: Layout, where: str) -> Any:
    """``x`` in ``layout`` on ``mesh`` (see the module docstring); non-tensors pass through.
    Inside a local region's trace or local run the move goes through the region's door
    (``autoparallel.regions.moves``)."""
    if layout is None or not isinstance(x, torch.Tensor):
        return x
    door = moves.current()
    if door is not None:
        return door.move(x, lambda t: _to_layout(t, mesh, axis, layout, where))
    return _to_layout(x, mesh, axis, layout, where)


def _to_layout(x: torch.Tensor, mesh: ProcessMesh, axis: int, layout: Layout, where: str) -> Any:
    if isinstance(x, DistTensor) and x.process_mesh != mesh:
        raise ValueError(
            f"{where}: input lies on {x.process_mesh!r}, but the layer was parallelized on {mesh!r}; "
            "reshard it to this mesh first (ap.reshard)"
        )
    placements = placements_for(x, mesh, axis, layout)
    if isinstance(x, DistTensor):
        if tuple(x.placements) == placements:
            return x
        return reshard(x, mesh, placements)
    return shard_tensor(x, mesh, placements)


def map_layouts(values: tuple[Any, ...], layouts: Sequence[Layout], mesh: ProcessMesh, axis: int, where: str) -> tuple[Any, ...]:
    """``values[i]`` in ``layouts[i]``; values past the end of ``layouts`` pass through."""
    if len(layouts) > len(values):
        raise ValueError(f"{where}: {len(layouts)} layouts for {len(values)} values; give at most one per value")
    return tuple(to_layout(v, mesh, axis, layouts[i], where) if i < len(layouts) else v for i, v in enumerate(values))
