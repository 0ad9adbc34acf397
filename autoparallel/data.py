"""``shard_dataloader``: each rank loads only the samples of its data-parallel coordinate.

The wrapped loader replays the original batch sampler (the same global index lists on every
rank), keeps on each rank only the contiguous slice of each batch that its mesh coordinate
along the data-parallel axis needs, and turns the collated local batch into DistTensors of the
global batch: ``Shard(0)`` on the data-parallel axis, ``Replicate`` on the other axes. With a
list of meshes (one per input — e.g. inputs on the first pipeline stage mesh, labels on the
last) each input lands on its own mesh; a rank outside an input's mesh holds an empty shard.

An input may be a tensor or a nest of lists, tuples, dicts, namedtuples and dataclass instances
(``{"inputs": [x1, x2], "label": y}``): every tensor in it is laid out on the mesh of its input,
the containers are rebuilt as the same types, and str, number and None leaves pass through.

Every decision (which slice, global shapes, errors) depends only on the global batch index
list and the meshes, never on the rank, so every rank raises the same error at the same batch.
A batch is checked whole before any of it is laid out (laying out may communicate), and error
messages name only what every rank sees alike: the path of the value, its type, dtype and the
dims after the batch dim.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
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

# Leaves of an input that are kept as loaded: they carry no rows to lay out.
_PASSTHROUGH = (str, bytes, numbers.Number, type(None))
_WHOLE = object()  # the key of a batch that is one input (a tensor, a dataclass instance)


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
            lo, hi = self.span(n)
            self.sizes.append(n)
            yield indices[lo:hi]

    def span(self, n: int) -> tuple[int, int]:
        """Global rows [lo, hi) this rank loads of a batch of ``n`` samples."""
        spans = [r for r in (t.rows(self.rank, n) for t in self.targets) if r is not None]
        lo = min((s[0] for s in spans), default=0)
        hi = max((s[1] for s in spans), default=1)  # no input here: one sample, for shapes
        return lo, hi


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
        """The loaded ``batch`` with every input laid out as DistTensors of a global batch of ``n``."""
        lo, hi = self._sampler.span(n)
        inputs = self._inputs(batch)
        for value, _, path in inputs.values():  # refuse the whole batch before laying out any of it
            _map(value, path, functools.partial(self._check, rows=hi - lo, n=n))
        laid = {k: _map(value, path, functools.partial(self._lay, target=t, n=n, start=lo))
                for k, (value, t, path) in inputs.items()}
        return laid[_WHOLE] if _WHOLE in laid else _rebuild(batch, laid)

    def _inputs(self, batch: Any) -> dict[Any, tuple[Any, _Target, str]]:
        """The inputs of ``batch``: {key, index or _WHOLE: (value, target, path)}."""
        if isinstance(batch, Mapping):
            keys = list(batch) if self._input_keys is None else self._input_keys
            missing = [k for k in keys if k not in batch]
            if missing:
                raise ValueError(f"shard_dataloader: input_keys {missing} are not in the batch keys {list(batch)}")
            targets = self._per_input(len(keys), f"input keys {keys}")
            return {k: (batch[k], t, f"batch[{k!r}]") for k, t in zip(keys, targets)}
        if isinstance(batch, (list, tuple)):  # positional: every element is an input; input_keys unused
            targets = self._per_input(len(batch), f"{len(batch)} batch elements")
            return {i: (v, t, f"batch[{i}]") for i, (v, t) in enumerate(zip(batch, targets))}
        target = self._per_input(1, f"one input (a {_type_name(batch)} batch)")[0]
        return {_WHOLE: (batch, target, "batch")}

    def _per_input(self, count: int, what: str) -> list[_Target]:
        if len(self._targets) == 1:
            return self._targets * count
        if len(self._targets) != count:
            raise ValueError(f"shard_dataloader: {len(self._targets)} meshes for {what}; give one mesh or one per input")
        return self._targets

    @staticmethod
    def _check(value: torch.Tensor, path: str, rows: int, n: int) -> torch.Tensor:
        """``value`` if its dim 0 holds one row per loaded sample (``rows`` of them), else raise.

        The message leaves out dim 0 and ``rows``: both may differ between ranks.
        """
        if value.dim() == 0:
            raise ValueError(
                f"shard_dataloader: {path} is a 0-d {value.dtype} tensor; every tensor of an input "
                "needs the batch along dim 0"
            )
        if value.shape[0] != rows:
            shape = "(*" + "".join(f", {d}" for d in value.shape[1:]) + ")"  # dim 0 left out
            raise ValueError(
                f"shard_dataloader: {path} is a {value.dtype} tensor of shape {shape} whose dim 0 "
                f"is not the batch dim: it does not hold one row per sample of the batch ({n} samples "
                "in all); collate it per sample along dim 0, or leave its key out of input_keys"
            )
        return value

    def _lay(self, value: torch.Tensor, path: str, target: _Target, n: int, start: int) -> Any:
        """``value`` (this rank's rows from global row ``start`` on) as a DistTensor of ``n`` rows."""
        shape = (n,) + tuple(value.shape[1:])
        rows = target.rows(self._rank, n)
        local = value[rows[0] - start: rows[1] - start] if rows is not None else value[:0]
        device = runtime.default_device()  # the loader yields host tensors; shards live on the device
        if local.device.type != device.type:
            local = local.to(device, non_blocking=local.is_pinned())
        return dtensor_from_local(local.contiguous(), target.mesh, target.placements(), shape)


# ---- nested inputs: lists, tuples, dicts, namedtuples, dataclass instances -----------------
def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _children(value: Any) -> list[tuple[Any, str, Any]] | None:
    """(key, path suffix, child) of each child of a container; None for anything else."""
    if isinstance(value, Mapping):
        return [(k, f"[{k!r}]", v) for k, v in value.items()]
    if _is_namedtuple(value):
        return [(i, f".{f}", v) for i, (f, v) in enumerate(zip(value._fields, value))]
    if isinstance(value, (list, tuple)):
        return [(i, f"[{i}]", v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    return None


def _rebuild(value: Any, new: Mapping[Any, Any]) -> Any:
    """The container ``value`` again, same type, with the children keyed in ``new`` replaced."""
    if isinstance(value, Mapping):
        if isinstance(value, MutableMapping) and type(value) is not dict:
            clone = copy.copy(value)  # OrderedDict, defaultdict, UserDict keep their type and state
            clone.update(new)
            return clone
        kind: Any = type(value)  # dict, or an immutable Mapping built from a dict
        return kind({k: new.get(k, v) for k, v in value.items()})
    if _is_namedtuple(value):
        return type(value)(*(new.get(i, v) for i, v in enumerate(value)))
    if isinstance(value, (list, tuple)):
        items = [new.get(i, v) for i, v in enumerate(value)]
        return items if type(value) is list else type(value)(items)
    clone = copy.copy(value)  # a dataclass instance: fields set directly (frozen ones too)
    for name, v in new.items():
        object.__setattr__(clone, name, v)
    return clone


def _map(value: Any, path: str, fn: Callable[[torch.Tensor, str], Any]) -> Any:
    """``value`` rebuilt with ``fn(tensor, path)`` at each tensor; str, number and None kept.

    Any other leaf raises TypeError naming its path and type.
    """
    if isinstance(value, torch.Tensor):
        return fn(value, path)
    if isinstance(value, _PASSTHROUGH):
        return value
    kids = _children(value)
    if kids is None:
        raise TypeError(
            f"shard_dataloader: {path} is a {_type_name(value)}, which cannot be laid out: the leaves "
            "of an input must be tensors (laid out), or str, numbers or None (passed through); "
            "make it a tensor in collate_fn, or leave its key out of input_keys"
        )
    return _rebuild(value, {k: _map(v, path + suffix, fn) for k, suffix, v in kids})


def shard_dataloader(
    dataloader: DataLoader,
    meshes: ProcessMesh | Sequence[ProcessMesh],
    input_keys: Sequence[str] | None = None,
    shard_dims: AxisSpec | Sequence[AxisSpec] = None,
) -> ShardDataloader:
    """Wrap ``dataloader`` so each rank loads only its part and batches arrive as DistTensors.

    The inputs of a batch: the values of ``input_keys`` for a dict batch (every key without
    ``input_keys``); each element of a tuple or list batch (``input_keys`` is not used: positions
    are not keys); any other batch (a tensor, a dataclass instance) is one input. An input is a
    tensor or a nest of lists, tuples, dicts, namedtuples and dataclass instances: each tensor
    in it becomes a DistTensor of the global batch on the input's mesh, ``Shard(0)`` on the
    data-parallel axis and ``Replicate`` elsewhere; the containers are rebuilt as the same
    types; str, number and None leaves pass through. Any other leaf raises TypeError, and a
    tensor without one row per sample along dim 0 raises ValueError, both naming the leaf's
    path (``batch['inputs'][1]``); a key of ``input_keys`` missing from a dict batch raises
    ValueError. Keys of a dict batch not in ``input_keys`` pass through as loaded (this rank's
    rows only).

    ``meshes``: one mesh for every input, or a list with one mesh per input (per batch element
    for tuple/list batches, per key of ``input_keys`` for dict batches); all tensors of a nested
    input share its mesh (give leaves that belong on different meshes keys of their own).
    ``shard_dims``: the mesh axis (name or number) the batch dim is split on — one for all
    meshes or one per mesh; None replicates the batch (every rank loads all of it). Every batch
    of the original loader must hold a multiple of the data-parallel degree samples. Local
    shards move to the world's device (the current CUDA device under NCCL;
    ``pin_memory=True`` makes that copy asynchronous).
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
