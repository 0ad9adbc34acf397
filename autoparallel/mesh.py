"""``ProcessMesh``: an n-d array of ranks with named axes.

A mesh is a value (frozen, hashable, comparable): building one issues no collective and
creates no process group of its own; under torchrun the first mesh starts the default process
group if none exists (through ``ProcessMesh.world_starter``, a door the package opens), so
``torch.distributed.get_rank()``, a ``DistributedSampler`` and the user's own collectives work
right after it. The runtime (``autoparallel.runtime.groups``) creates a mesh's groups
when the mesh enters the world through an entry point every rank passes. The two things a mesh
reads of the world are its size (ranks outside it are refused at once) and this process's rank,
for ``mesh["dp"]`` (the line through this rank): the default group's, else torchrun's
``WORLD_SIZE``/``RANK``. It reads them; it never creates the world.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch


class Dims(tuple):  # type: ignore[type-arg]
    """A tuple of ints that also compares equal to the same list (``mesh.shape == [2, 2]``)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            other = tuple(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


def _to_array(mesh: Any) -> np.ndarray:
    if isinstance(mesh, ProcessMesh):
        return mesh.mesh
    if isinstance(mesh, np.ndarray):
        arr = mesh
    else:
        try:
            arr = np.array(mesh)
        except ValueError as e:  # numpy >= 1.24 refuses ragged lists
            raise ValueError(f"ProcessMesh: ragged mesh list {mesh!r}: {e}") from None
        if arr.dtype == object:
            raise ValueError(f"ProcessMesh: ragged mesh list {mesh!r}: every row needs the same length")
    if arr.size == 0:
        raise ValueError(f"ProcessMesh: mesh {mesh!r} holds no ranks")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ProcessMesh: ranks must be ints, got {arr.dtype} in {mesh!r}")
    return arr.astype(np.int64)


class ProcessMesh:
    """An n-d array of ranks; ``dim_names`` names its mesh axes.

    >>> mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    >>> mesh.shape, mesh.get_dim_size("mp")
    ((2, 2), 2)
    """

    __slots__ = ("_shape", "_ids", "_dim_names", "_hash", "_family", "_coords", "_lines")
    # The door through which the package starts the default process group when a mesh is built
    # under torchrun and none exists (as ``init_device_mesh`` does): ``autoparallel/__init__.py``
    # sets it to the runtime's ``ensure_world``. The value itself creates nothing; sub-groups stay
    # lazy and owned by the runtime.
    world_starter: ClassVar[Callable[[], None] | None] = None

    def __init__(self, mesh: Any, dim_names: Sequence[str] | None = None) -> None:
        arr = _to_array(mesh)
        ids = tuple(int(r) for r in arr.flatten())
        if any(r < 0 for r in ids):
            raise ValueError(f"ProcessMesh: negative rank in {arr.tolist()}")
        if len(set(ids)) != len(ids):
            dup = sorted({r for r in ids if ids.count(r) > 1})
            raise ValueError(f"ProcessMesh: ranks {dup} appear more than once in {arr.tolist()}")
        if dim_names is None:
            names = tuple(f"d{i}" for i in range(arr.ndim))
        else:
            if isinstance(dim_names, str) or not all(isinstance(n, str) for n in dim_names):
                raise TypeError(f"ProcessMesh: dim_names must be a list of str, got {dim_names!r}")
            names = tuple(dim_names)
            if len(names) != arr.ndim:
                raise ValueError(
                    f"ProcessMesh: {len(names)} dim_names {list(names)} for a {arr.ndim}-d mesh "
                    f"of shape {list(arr.shape)}"
                )
            if len(set(names)) != len(names):
                raise ValueError(f"ProcessMesh: dim_names {list(names)} repeat a name")
        self._shape = Dims(int(s) for s in arr.shape)
        self._ids = Dims(ids)
        self._dim_names = tuple(names)
        self._hash = hash((self._shape, self._ids, self._dim_names))
        self._family: ProcessMesh | None = None  # the mesh a per-rank sub-mesh was taken from
        if ProcessMesh.world_starter is not None:
            ProcessMesh.world_starter()
        world = _world_size()
        bad = [r for r in ids if world is not None and r >= world]
        if bad:
            raise ValueError(f"ProcessMesh {arr.tolist()}: ranks {bad} are not in the world of size {world}")
        self._coords: dict[int, tuple[int, ...] | None] = {}  # rank -> coordinate (a mesh never changes)
        self._lines: dict[tuple[int, int], tuple[int, ...] | None] = {}  # (axis, rank) -> axis line

    @classmethod
    def simulated(cls, shape: Sequence[int], dim_names: Sequence[str] | None = None) -> ProcessMesh:
        """A mesh of ``prod(shape)`` ranks for planning only (``ap.auto_parallel`` pricing a world
        of 512 from one process): no world is started or checked. Metadata of layouts on it is
        exact; communicating on it is not possible."""
        arr = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(tuple(int(s) for s in shape))
        mesh = cls.__new__(cls)
        names = tuple(dim_names) if dim_names is not None else tuple(f"d{i}" for i in range(arr.ndim))
        if len(names) != arr.ndim or len(set(names)) != len(names):
            raise ValueError(f"ProcessMesh.simulated: dim_names {list(names)} for a mesh of shape {list(arr.shape)}")
        mesh._shape = Dims(int(s) for s in arr.shape)
        mesh._ids = Dims(int(r) for r in arr.flatten())
        mesh._dim_names = names
        mesh._hash = hash((mesh._shape, mesh._ids, mesh._dim_names))
        mesh._family = None
        mesh._coords = {}
        mesh._lines = {}
        return mesh

    # ---- values -------------------------------------------------------------------------
    @property
    def shape(self) -> Dims:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return len(self._ids)

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def process_ids(self) -> Dims:
        return self._ids

    @property
    def mesh(self) -> np.ndarray:
        return np.array(self._ids, dtype=np.int64).reshape(self._shape)

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, ProcessMesh)
            and self._hash == other._hash
            and self._shape == other._shape
            and self._ids == other._ids
            and self._dim_names == other._dim_names
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ProcessMesh({self.mesh.tolist()}, dim_names={list(self._dim_names)})"

    def __contains__(self, rank: object) -> bool:
        return rank in self._ids

    # ---- axes ---------------------------------------------------------------------------
    def axis_index(self, axis: int | str) -> int:
        """Mesh axis number for an axis name or number (negative counts from the end)."""
        if isinstance(axis, str):
            if axis not in self._dim_names:
                raise ValueError(f"mesh axis name {axis!r} is unknown; mesh has {list(self._dim_names)}")
            return self._dim_names.index(axis)
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"mesh axis must be a name or an int, got {axis!r}")
        a = int(axis)
        if not -self.ndim <= a < self.ndim:
            raise ValueError(f"mesh axis {a} does not exist on a {self.ndim}-d mesh")
        return a % self.ndim

    def get_dim_size(self, axis: int | str) -> int:
        return self._shape[self.axis_index(axis)]

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` in the mesh, or None when it is not a member."""
        try:
            return self._coords[rank]
        except KeyError:
            pass
        try:
            flat = self._ids.index(rank)
        except ValueError:
            coord = None
        else:
            coord = tuple(int(c) for c in np.unravel_index(flat, self._shape))
        self._coords[rank] = coord
        return coord

    def rank_at(self, coord: Sequence[int]) -> int:
        return self._ids[int(np.ravel_multi_index(tuple(coord), self._shape))]

    def axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """All rank lines along ``axis``, in a fixed order (every rank computes the same)."""
        arr = np.moveaxis(self.mesh, axis, -1).reshape(-1, self._shape[axis])
        return [tuple(int(r) for r in row) for row in arr]

    def axis_group_of(self, axis: int, rank: int) -> tuple[int, ...] | None:
        """The ranks on ``rank``'s line along ``axis``, in coordinate order (None: not a member)."""
        try:
            return self._lines[axis, rank]
        except KeyError:
            pass
        coord = self.coordinate_of(rank)
        line = None if coord is None else tuple(
            self.rank_at(coord[:axis] + (i,) + coord[axis + 1:]) for i in range(self._shape[axis])
        )
        self._lines[axis, rank] = line
        return line

    # ---- sub-meshes ---------------------------------------------------------------------
    def get_mesh_with_dim(self, dim_name: str, index: int | None = None) -> ProcessMesh:
        """The mesh with axis ``dim_name`` moved first; with ``index``, the slice at it.

        ``mesh.get_mesh_with_dim("pp", 1)`` is the stage mesh of pipeline stage 1.
        """
        a = self.axis_index(dim_name)
        order = [a] + [i for i in range(self.ndim) if i != a]
        arr = np.transpose(self.mesh, order)
        names = [self._dim_names[i] for i in order]
        if index is None:
            return ProcessMesh(arr, names)
        if not -arr.shape[0] <= index < arr.shape[0]:
            raise ValueError(f"index {index} is out of range for mesh axis {dim_name!r} of size {arr.shape[0]}")
        if arr.ndim == 1:
            return ProcessMesh([int(arr[index])], names)
        return ProcessMesh(arr[index], names[1:])

    def __getitem__(self, key: Any) -> ProcessMesh:
        """``mesh["dp"]``: the 1-d mesh along axis ``dp`` through this rank.

        ``mesh[("dp", "mp")]`` keeps several axes; an int or slice indexes the rank array.
        """
        if isinstance(key, str):
            key = (key,)
        if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
            axes = [self.axis_index(k) for k in key]
            rank = _this_rank()
            coord = self.coordinate_of(rank)
            if coord is None:
                raise ValueError(f"mesh[{key!r}]: rank {rank} is not in {self!r}")
            index = tuple(slice(None) if i in axes else coord[i] for i in range(self.ndim))
            sub = self.mesh[index]
            kept = [i for i in range(self.ndim) if i in axes]
            sub = np.transpose(sub, [kept.index(a) for a in axes])
            out = ProcessMesh(sub, list(key))
            # differs per rank: its groups are created as this mesh's lines, the same everywhere
            out._family = self._family or self
            return out
        sub = self.mesh[key]
        if np.ndim(sub) == 0:
            return ProcessMesh([int(sub)], [self._dim_names[-1]])
        # Axes dropped by integer indexing disappear; the others keep their names.
        names = list(self._dim_names)
        if not isinstance(key, tuple):
            key = (key,)
        dropped = [i for i, k in enumerate(key) if isinstance(k, (int, np.integer))]
        kept_names = [n for i, n in enumerate(names) if i not in dropped]
        return ProcessMesh(sub, kept_names[: np.ndim(sub)])

    @property
    def family(self) -> ProcessMesh | None:
        """The mesh this per-rank sub-mesh (``mesh["dp"]``) was taken from, else None. Not part
        of the value (equality and hash ignore it): it tells the runtime which lines to create
        so that every rank creates the same groups."""
        return self._family


def _world_size() -> int | None:
    """The world's size where one is known (initialised, or torchrun's ``WORLD_SIZE``), else
    None (a mesh built before any world is checked when it enters one). Reads, never creates."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    size = os.environ.get("WORLD_SIZE")
    return int(size) if size and size.isdigit() else None


def _this_rank() -> int:
    """This process's rank: the default group's, else torchrun's ``RANK`` (the world may be
    initialised later from it), else 0. Reads the world; never creates it."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))
