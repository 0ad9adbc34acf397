"""``shard_dataloader``: each rank loads only the samples of its data-parallel coordinate.

The wrapped loader replays the original batch sampler (the same global index lists on every
rank), keeps on each rank only the contiguous slice of each batch that its mesh coordinate
along the data-parallel axis needs, and turns the collated local batch into DistTensors of the
global batch: ``Shard(0)`` on the data-parallel axis, ``Replicate`` on the other axes. With a
list of meshes (one per input — e.g. inputs on the first pipeline stage mesh, labels on the
last) each input lands on its own mesh; a rank outside an input's mesh holds an empty shard.

Every decision (which slice, global shapes, errors) depends only on the global batch index
list and the meshes, never on the rank, so every rank raises the same error at the same batch.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from autoparallel import runtime
from autoparallel.api import dtensor_from_local
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Placement, Replicate, Shard
from autoparallel.runtime import groups

AxisSpec = str | int | None


@dataclass(frozen=True)
class _Target:
    """Where one input goes: a mesh and the mesh axis its batch dim is split on (or None)."""

    mesh: ProcessMesh
    axis: int | None

    @property
    def degree(self) -> int:
        return 1 if self.axis is None else self.mesh.shape[self.axis]

    def placements(self) -> list[Placement]:
        return [Shard(0) if a == self.axis else Replicate() for a in range(self.mesh.ndim)]

    def rows(self, rank: int, batch: int) -> tuple[int, int] | None:
        """Rows [lo, hi) of a global batch of ``batch`` samples that ``rank`` holds, or None."""
        coord = self.mesh.coordinate_of(rank)
        if coord is None:
            return None
        if self.axis is None:
            return 0, batch
        per = batch // self.degree
        return coord[self.axis] * per, (coord[self.axis] + 1) * per


def _targets(meshes: Any, shard_dims: Any) -> list[_Target]:
    mesh_list = [meshes] if isinstance(meshes, ProcessMesh) else meshes
    if not isinstance(mesh_list, (list, tuple)) or not mesh_list:
        raise TypeError(f"shard_dataloader: meshes must be a ProcessMesh or a non-empty list of them, got {meshes!r}")
    for m in mesh_list:
        if not isinstance(m, ProcessMesh):
            raise TypeError(f"shard_dataloader: meshes must hold ProcessMesh values, got {type(m).__name__}")
    if isinstance(shard_dims, (list, tuple)):
        if len(shard_dims) != len(mesh_list):
            raise ValueError(
                f"shard_dataloader: {len(shard_dims)} shard_dims {list(shard_dims)} for {len(mesh_list)} meshes"
            )
        dims = list(shard_dims)
    else:
        dims = [shard_dims] * len(mesh_list)
    out = []
    for i, (m, d) in enumerate(zip(mesh_list, dims)):
        if d is None:
            out.append(_Target(m, None))
            continue
        if isinstance(d, str) and d not in m.dim_names:
            raise ValueError(
                f"shard_dataloader: shard_dims {d!r} is not a mesh axis of meshes[{i}] {m!r} "
                f"(axes {m.dim_names})"
            )
        out.append(_Target(m, m.axis_index(d)))
    degrees = sorted({t.degree for t in out if t.axis is not None})
    if len(degrees) > 1:
        raise ValueError(
            f"shard_dataloader: the data-parallel axes of the meshes have different sizes {degrees}; "
            "every input must split the batch the same number of ways"
        )
    return out


class _SliceSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch; queues the global sizes in order."""

    def __init__(self, batch_sampler: Any, targets: list[_Target], rank: int) -> None:
        self.batch_sampler = batch_sampler
        self.targets = targets
        self.rank = rank
        self.sizes: collections.deque[int] = collections.deque()
        self.degree = max(t.degree for t in targets)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        for step, indices in enumerate(self.batch_sampler):
            indices = list(indices)
            n = len(indices)
            if n == 0 or n % self.degree:
                raise ValueError(
                    f"shard_dataloader: batch {step} has {n} samples, not divisible by the "
                    f"data-parallel degree {self.degree}" + (
                        " (the last batch is short: use drop_last=True)" if n else "")
                )
            spans = [r for r in (t.rows(self.rank, n) for t in self.targets) if r is not None]
            lo = min((s[0] for s in spans), default=0)
            hi = max((s[1] for s in spans), default=1)  # no input here: one sample, for shapes
            self.sizes.append(n)
            yield indices[lo:hi]

    def span(self, n: int) -> int:
        """First global row this rank loaded for a batch of ``n`` samples."""
        spans = [r for r in (t.rows(self.rank, n) for t in self.targets) if r is not None]
        return min((s[0] for s in spans), default=0)


class ShardDataloader:
    """Iterable over global batches as DistTensors; see :func:`shard_dataloader`."""

    def __init__(self, loader: DataLoader, targets: list[_Target], input_keys: list[str] | None) -> None:
        self._targets = targets
        self._input_keys = input_keys
        self._rank = runtime.get_rank()
        self._sampler = _SliceSampler(loader.batch_sampler, targets, self._rank)
        self.dataset = loader.dataset
        self.batch_sampler = loader.batch_sampler
        extra: dict[str, Any] = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}
        self._loader = DataLoader(
            loader.dataset,
            batch_sampler=self._sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            persistent_workers=loader.persistent_workers,
            **extra,
        )

    def __len__(self) -> int:
        return len(self._loader)

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        self._sampler.sizes.clear()
        for local in self._loader:
            n = self._sampler.sizes.popleft()
            yield self._distribute(local, n)

    # ---- turning a local batch into DistTensors -------------------------------------------
    def _distribute(self, batch: Any, n: int) -> Any:
        if isinstance(batch, Mapping):
            keys = list(batch) if self._input_keys is None else self._input_keys
            missing = [k for k in keys if k not in batch]
            if missing:
                raise ValueError(f"shard_dataloader: input_keys {missing} are not in the batch keys {list(batch)}")
            targets = self._per_input(len(keys), f"input keys {keys}")
            moved = {k: self._one(batch[k], t, n, repr(k)) for k, t in zip(keys, targets)}
            return {k: moved.get(k, v) for k, v in batch.items()}
        if self._input_keys is not None:
            raise ValueError(
                f"shard_dataloader: input_keys {self._input_keys} given but batches are {type(batch).__name__}, not dicts"
            )
        if isinstance(batch, (list, tuple)):
            targets = self._per_input(len(batch), f"{len(batch)} batch elements")
            items = [self._one(v, t, n, f"element {i}") for i, (v, t) in enumerate(zip(batch, targets))]
            return type(batch)(items) if isinstance(batch, list) else tuple(items)
        return self._one(batch, self._per_input(1, "a single tensor")[0], n, "the batch")

    def _per_input(self, count: int, what: str) -> list[_Target]:
        if len(self._targets) == 1:
            return self._targets * count
        if len(self._targets) != count:
            raise ValueError(f"shard_dataloader: {len(self._targets)} meshes for {what}; give one mesh or one per input")
        return self._targets

    def _one(self, value: Any, target: _Target, n: int, name: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0:
            raise ValueError(f"shard_dataloader: {name} is a 0-d tensor; batches need a leading batch dim")
        start = self._sampler.span(n)
        shape = (n,) + tuple(value.shape[1:])
        rows = target.rows(self._rank, n)
        local = value[rows[0] - start: rows[1] - start] if rows is not None else value[:0]
        device = runtime.default_device()  # the loader yields host tensors; shards live on the device
        if local.device.type != device.type:
            local = local.to(device, non_blocking=local.is_pinned())
        return dtensor_from_local(local.contiguous(), target.mesh, target.placements(), shape)


def shard_dataloader(
    dataloader: DataLoader,
    meshes: ProcessMesh | Sequence[ProcessMesh],
    input_keys: Sequence[str] | None = None,
    shard_dims: AxisSpec | Sequence[AxisSpec] = None,
) -> ShardDataloader:
    """Wrap ``dataloader`` so each rank loads only its part and batches arrive as DistTensors.

    ``meshes``: one mesh for every input, or a list with one mesh per input (per batch element
    for tuple/list batches, per key of ``input_keys`` for dict batches). ``shard_dims``: the
    mesh axis (name or number) the batch dim is split on — one for all meshes or one per mesh;
    None replicates the batch (every rank loads all of it). Every batch of the original loader
    must hold a multiple of the data-parallel degree samples. Keys of a dict batch not in
    ``input_keys`` and non-tensor values pass through as loaded. Local shards move to the
    world's device (the current CUDA device under NCCL; ``pin_memory=True`` makes that copy
    asynchronous).
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"shard_dataloader: dataloader must be a torch DataLoader, got {type(dataloader).__name__}")
    if dataloader.batch_sampler is None:
        raise ValueError("shard_dataloader: the DataLoader has batch_size=None; it must batch samples")
    targets = _targets(meshes, shard_dims)
    keys = None
    if input_keys is not None:
        if isinstance(input_keys, str) or not isinstance(input_keys, Sequence):
            raise TypeError(f"shard_dataloader: input_keys must be a list of keys, got {input_keys!r}")
        keys = list(input_keys)
        if len(targets) not in (1, len(keys)):
            raise ValueError(f"shard_dataloader: {len(targets)} meshes for input_keys {keys}; give one mesh or one per key")
    degree = max(t.degree for t in targets)
    bs = getattr(dataloader, "batch_size", None)
    if isinstance(bs, int) and bs % degree:
        raise ValueError(
            f"shard_dataloader: batch_size {bs} is not divisible by the data-parallel degree {degree}"
        )
    for t in targets:
        groups.ensure(t.mesh)
    return ShardDataloader(dataloader, targets, keys)


__all__ = ["ShardDataloader", "shard_dataloader"]
