"""Aliases: which inputs an op writes (``self`` of ``add_``, ``out=``) and which outputs are
those inputs, read from the op's schema."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

aten = torch.ops.aten

# Ops that write arguments their schema does not mark ``(a!)``: op -> (the written arguments,
# the bool argument that must be true for the write). ``native_batch_norm`` updates its running
# statistics in place in training mode although its schema declares them read-only (the
# functional ``_native_batch_norm_legit`` marks them). Missed, a running statistic that the plan
# moved (sliced to the channel shard) was written in the moved copy only: under data parallelism
# each rank kept 1/n of the update (tests/world/test_batch_norm_world.py).
UNMARKED_WRITES: dict[Any, tuple[tuple[str, ...], str]] = {
    aten.native_batch_norm.default: (("running_mean", "running_var"), "training"),
}


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int) -> Any:
    arg = func._schema.arguments[i]
    return args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)


@lru_cache(maxsize=4096)
def may_write(func: Any) -> bool:
    """Whether the op's schema (or ``UNMARKED_WRITES``) lets it write any argument at all."""
    return func in UNMARKED_WRITES or any(
        a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op writes: ``self`` of ``add_``, ``out=``, and the ``UNMARKED_WRITES``."""
    if not may_write(func):
        return []
    written: list[Any] = []
    unmarked, flag = UNMARKED_WRITES.get(func, ((), ""))
    names = [a.name for a in func._schema.arguments]
    if unmarked and not _arg(func, args, kwargs, names.index(flag)):
        unmarked = ()
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if (alias is None or not alias.is_write) and arg.name not in unmarked:
            continue
        value = _arg(func, args, kwargs, i)
        written.extend(value if isinstance(value, (list, tuple)) else [value])
    return [w for w in written if w is not None]


def out_aliases(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any], mutated: tuple[int, ...], n_out: int
) -> tuple[int | None, ...]:
    """Per output, the position in ``dts`` of the written input it returns (``add_``'s self, the
    ``out=`` tensors), None for a new tensor (``_native_batch_norm_legit`` writes its running
    stats and returns new ones). From the schema's alias sets; outputs paired with the written
    inputs in order where a set names a list argument."""
    if not mutated:
        return (None,) * n_out
    by_set: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        a = arg.alias_info
        if a is not None and a.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            by_set.update((name, value) for name in a.before_set)
    pos = {id(t): k for k, t in enumerate(dts)}
    out: list[int | None] = []
    for r in func._schema.returns[:n_out]:
        a = r.alias_info
        value = by_set.get(next(iter(a.before_set))) if a is not None and a.is_write and a.before_set else None
        if isinstance(value, (list, tuple)):
            return tuple(mutated[k] if k < len(mutated) else None for k in range(n_out))
        out.append(pos.get(id(value)) if value is not None else None)
    return tuple(out) + (None,) * (n_out - len(out))


def mutated_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dts: list[Any]) -> tuple[int, ...]:
    """Positions (in ``dts``) of the DistTensors the op writes."""
    if not may_write(func):
        return ()
    ids = [id(t) for t in written_args(func, args, kwargs)]
    return tuple(i for i, t in enumerate(dts) if id(t) in ids)


__all__ = ["UNMARKED_WRITES", "may_write", "mutated_inputs", "out_aliases", "written_args"]
