"""The process groups the library creates, owned for their whole life.

A ``ProcessMesh`` is a value: building one issues no collective. A mesh's groups (one per axis
line: the ranks that differ only in that axis) are created here when the mesh enters the world
through an entry point every rank passes (``shard_tensor``, ``dtensor_from_local``, ``reshard``,
the factories, ``shard_layer``/``parallelize``, pipeline stages, ``shard_optimizer``,
``shard_dataloader``): ``ensure(mesh)``. Group creation is itself a collective over the whole
world (``torch.distributed.new_group``), so it is deterministic: every line of every axis, in
one fixed order, on every rank — never a group created on a subset of ranks. A sub-mesh taken
through this rank (``mesh["dp"]``) differs per rank, so ensuring it creates the lines of the
mesh it was taken from (the same on every rank).

The owner is bound to the default group it was built under: a new world (the user destroyed
and re-initialised it) starts a new owner. ``release()`` drops every cache and destroys the
groups created here (never a group the user created), at interpreter exit or when the user
destroys the world, so no collective outlives the process group it ran on.
"""

from __future__ import annotations

import atexit
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from autoparallel.log import logger
from autoparallel.runtime import world

if TYPE_CHECKING:
    from autoparallel.mesh import ProcessMesh

Line = tuple[int, ...]


class GroupOwner:
    """The groups of one world: by sorted rank tuple, in creation order."""

    __slots__ = ("world", "groups", "created", "meshes", "resolved")

    def __init__(self, world_group: object) -> None:
        self.world = world_group
        self.groups: dict[Line, Any] = {}      # sorted ranks -> process group
        self.created: list[Line] = []          # what ``new_group`` made here, in order
        self.meshes: set[Any] = set()          # meshes whose lines exist
        # (mesh, axis, rank) -> (group, axis line in coordinate order, group rank per coordinate)
        self.resolved: dict[tuple[Any, int, int], tuple[Any, Line, Line]] = {}


_owner: list[GroupOwner] = []  # at most one: the current world's
_YIELD_S = 0.01  # release(): how long gloo's workers get the GIL before the groups go


def _current() -> GroupOwner | None:
    """The owner for the current default group (a new one after the world changed)."""
    if not (dist.is_available() and dist.is_initialized()):
        if _owner:
            _owner.clear()  # the user destroyed the world: its groups are gone with it
        return None
    wg = dist.group.WORLD
    if not _owner or _owner[0].world is not wg:
        _owner[:] = [GroupOwner(wg)]
    return _owner[0]


def ensure(mesh: ProcessMesh) -> None:
    """Create the groups of every axis line of ``mesh`` (every rank, the same order).

    Call where every rank passes; a world that does not exist yet (plain ``python``, or a mesh
    built before ``init_process_group``) defers it to the mesh's first entry after that.
    """
    owner = _current()
    if owner is not None and mesh in owner.meshes:
        return
    size = world.get_world_size()  # initialises the world from torchrun's environment if needed
    bad = [r for r in mesh.process_ids if r >= size]
    if bad:
        raise ValueError(f"ProcessMesh {mesh.mesh.tolist()}: ranks {bad} are not in the world of size {size}")
    owner = _current()
    if owner is None:  # a world of one: no groups
        return
    family = mesh.family
    if family is not None and family not in owner.meshes:
        ensure(family)
    for axis in range(mesh.ndim):
        for line in mesh.axis_groups(axis):
            key = tuple(sorted(line))
            if len(key) < 2 or key in owner.groups:
                continue
            if key == tuple(range(size)):
                owner.groups[key] = dist.group.WORLD
            else:
                owner.groups[key] = dist.new_group(list(key))
                owner.created.append(key)
                logger.debug("groups: created the process group of ranks %s (for %r)", key, mesh)
    owner.meshes.add(mesh)


def group_of(mesh: ProcessMesh, axis: int) -> tuple[Any, Line, Line]:
    """(process group, axis line in coordinate order, group rank of each coordinate)."""
    rank = world.get_rank()
    owner = _current()
    assert owner is not None, "a collective needs an initialised world"
    found = owner.resolved.get((mesh, axis, rank))
    if found is not None:
        return found
    line = mesh.axis_group_of(axis, rank)
    assert line is not None, f"rank {rank} called a collective on a mesh it is not in"
    key = tuple(sorted(line))
    if key not in owner.groups:
        ensure(mesh)  # a mesh that reached a collective without an entry point (as every rank did)
    found = owner.resolved[mesh, axis, rank] = (owner.groups[key], line, tuple(key.index(r) for r in line))
    return found


def created() -> list[Line]:
    """Rank tuples of the groups this world's owner created, in creation order."""
    owner = _current()
    return list(owner.created) if owner is not None else []


def release() -> None:
    """Drop every cache and destroy what the library created: its groups (newest first), then
    the default group if the library initialised it from torchrun's environment. A group or
    world the user created stays the user's. Runs at interpreter exit."""
    if _owner or (dist.is_available() and dist.is_initialized()):
        # A gloo worker thread drops a finished collective (and its tensors' Python objects) just
        # after the caller's wait returned, and needs the GIL to do it. Yield the GIL once so it
        # does so now, not during the interpreter's finalisation (that aborts the process). This
        # only matters for a group something else keeps alive after it is destroyed (see
        # autoparallel/runtime/world.py); a freed group joins its workers.
        time.sleep(_YIELD_S)
    owner = _owner[0] if _owner else None
    _owner.clear()
    ours_world = world.initialised_here()
    world.forget()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if owner is not None and dist.group.WORLD is owner.world:
        for key in reversed(owner.created):
            _destroy(owner.groups.get(key))
        owner.groups.clear()
        owner.resolved.clear()
    if ours_world:
        _destroy(None)


def _destroy(group: Any) -> None:
    """Destroy ``group`` (None: the default group and every group left)."""
    if group is dist.group.WORLD and group is not None:
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001  (at exit a torn-down backend may refuse; nothing is left to keep)
        pass


atexit.register(release)
