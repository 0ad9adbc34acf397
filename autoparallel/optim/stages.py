"""ZeRO stage values (``ShardingStage1/2/3``) and the pure layout decisions they imply.

A stage names a mesh and its data-parallel axis. For each parameter it decides, from metadata
only, the *shard layout*: the parameter's own layout with the data-parallel axis changed from
``Replicate`` to ``Shard(dim)``. Every rank computes the same decision, and every bad
configuration raises here, before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec


@dataclass(frozen=True)
class ShardingStage:
    """Shard optimizer states (stage 1), + gradients (2), + parameters (3) along ``axis`` of ``mesh``.

    ``axis`` is a mesh axis name or index: the data-parallel axis, the one the batch is sharded
    on. By default the axis named ``"dp"`` if the mesh has one, else the only axis of a 1-d mesh;
    on a mesh of several axes none of which is named ``"dp"`` it must be given (a ``ValueError``
    says so: sharding along a model-parallel axis would be wrong). Paddle's argument order,
    ``ShardingStage1("x", mesh)``, is accepted too. Parameters may live on ``mesh`` or on a
    sub-mesh of it (pipeline stages) that has an axis of the same name.
    """

    mesh: ProcessMesh
    axis: int | str | None = None
    stage: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.axis, ProcessMesh) and isinstance(self.mesh, (str, int)):  # Paddle's order
            mesh, axis = self.axis, self.mesh
            object.__setattr__(self, "mesh", mesh)  # (a frozen value, set once here)
            object.__setattr__(self, "axis", axis)
        if not isinstance(self.mesh, ProcessMesh):
            raise TypeError(f"{type(self).__name__}: mesh must be an ap.ProcessMesh, got {type(self.mesh).__name__}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ShardingStage: stage must be 1, 2 or 3, got {self.stage!r}")
        self.mesh.axis_index(self.axis_name)  # validates an explicit axis, naming the mesh's axes

    @property
    def axis_name(self) -> str:
        """The data-parallel axis as a name of ``mesh``."""
        names = self.mesh.dim_names
        if self.axis is None:
            if "dp" in names or len(names) == 1:
                return "dp" if "dp" in names else names[0]
            raise ValueError(
                f"{type(self).__name__}: mesh {self.mesh!r} has {len(names)} axes and none is named 'dp': "
                f"name the data-parallel axis (the one the batch is sharded on), e.g. "
                f"ap.{type(self).__name__}(mesh, {names[0]!r})")
        if isinstance(self.axis, str):
            if self.axis not in names:
                raise ValueError(
                    f"{type(self).__name__}: mesh axis name {self.axis!r} is not in the mesh's axes {names}"
                )
            return self.axis
        return names[self.mesh.axis_index(self.axis)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh!r}, axis={self.axis_name!r})"


class ShardingStage1(ShardingStage):
    """ZeRO-1: optimizer states sharded along the data-parallel axis; gradients all-reduced."""

    def __init__(self, mesh: ProcessMesh | int | str, axis: int | str | ProcessMesh | None = None) -> None:
        super().__init__(mesh, axis, 1)  # type: ignore[arg-type]  # Paddle's order is swapped in __post_init__


class ShardingStage2(ShardingStage):
    """ZeRO-2: optimizer states and gradients (reduce-scattered) sharded along the axis."""

    def __init__(self, mesh: ProcessMesh | int | str, axis: int | str | ProcessMesh | None = None) -> None:
        super().__init__(mesh, axis, 2)  # type: ignore[arg-type]  # Paddle's order is swapped in __post_init__


@dataclass(frozen=True, repr=False)
class ShardingStage3(ShardingStage):
    """ZeRO-3: parameters too, gathered before each module's forward and freed after it.

    ``overlap=True``: communication overlaps compute, as torch's FSDP2 does. From the second
    step on, each unit's all-gather starts as soon as the unit before it (in the previous step's
    order) has gathered, in forward and in backward, at most one unit ahead; each unit's
    gradients are reduce-scattered without waiting (a gradient waits for its reduction when it
    is first read, at the latest when the next unit's reduction starts). It holds one more
    unit's gathered parameters, and an in-flight reduction's buffers, while the current unit
    computes. ``overlap=False`` (the default): every collective completes where it is issued,
    the least memory. What each costs and gains on gloo and on NCCL: docs/memory.md.
    """

    overlap: bool = False

    def __init__(self, mesh: ProcessMesh | int | str, axis: int | str | ProcessMesh | None = None,
                 *, overlap: bool = False) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"ShardingStage3: overlap must be True or False, got {overlap!r}")
        object.__setattr__(self, "overlap", overlap)  # (a frozen value, set once here)
        super().__init__(mesh, axis, 3)  # type: ignore[arg-type]  # Paddle's order is swapped in __post_init__

    def __repr__(self) -> str:
        extra = ", overlap=True" if self.overlap else ""
        return f"{type(self).__name__}(mesh={self.mesh!r}, axis={self.axis_name!r}{extra})"


def param_axis(stage: ShardingStage, spec: DistSpec, where: str) -> int:
    """The data-parallel axis index in the parameter's own mesh (checked against the stage mesh)."""
    name = stage.axis_name
    mesh = spec.mesh
    outside = sorted(set(mesh.process_ids) - set(stage.mesh.process_ids))
    if outside:
        raise ValueError(
            f"shard_optimizer: {where} lives on {mesh!r}, whose ranks {outside} are not in the "
            f"sharding mesh {stage.mesh!r}"
        )
    if name not in mesh.dim_names:
        raise ValueError(
            f"shard_optimizer: {where} lives on {mesh!r}, which has no mesh axis named {name!r} "
            f"(its axes are {mesh.dim_names}); name the data-parallel axis in both meshes alike"
        )
    return mesh.axis_index(name)


def shard_layout(spec: DistSpec, axis: int) -> DistSpec | None:
    """The layout of the parameter ``spec`` with mesh ``axis`` changed from Replicate to Shard.

    The new shard is a ``torch.chunk`` piece of the current local shard (no data moves): the first
    tensor dim (dim 0 when possible) whose other sharding axes all come before ``axis`` (the
    default shard order); else dim 0, split by ``axis`` inside its other axes' pieces (an explicit
    shard order: a column-parallel bias on a (dp, tp) mesh). None when the parameter stays as it
    is: already sharded on ``axis``, or a 0-d tensor.
    """
    placements = list(spec.placements)
    if isinstance(placements[axis], Partial):
        raise ValueError(f"shard_optimizer: a parameter is Partial on mesh axis {axis}: {spec}")
    if not isinstance(placements[axis], Replicate):
        return None
    if spec.ndim == 0:
        return None
    dims = [d for d in range(spec.ndim)
            if all(a < axis for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)]
    dim = dims[0] if dims else 0
    others = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    placements[axis] = Shard(dim)
    order = [(d, axes) for d, axes in spec.shard_order if d != dim]
    if len(others) > 1 or not dims:
        order.append((dim, spec.axes_of_dim(dim) + (axis,)))
    return spec.with_placements(placements, tuple(order))


def check_stage(shard_fn: Any) -> ShardingStage | None:
    """``shard_fn`` as a stage (None: plain data parallel); TypeError for anything else."""
    if shard_fn is None or isinstance(shard_fn, ShardingStage):
        return shard_fn
    raise TypeError(
        "shard_optimizer: shard_fn must be ap.ShardingStage1/2/3(mesh, axis) or None, "
        f"got {type(shard_fn).__name__}"
    )
