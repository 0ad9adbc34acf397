"""Escape hatches: run arbitrary per-shard code with declared input and output layouts.

``local_map(fn, out_placements, in_placements=None, mesh=None)`` wraps ``fn`` so that DistTensor
arguments arrive as local shards (first resharded to ``in_placements`` when given) and the
local results come back as DistTensors with ``out_placements``. ``LocalLayer`` does the same
for an ``nn.Module``'s ``forward``. Both are differentiable: gradients flow through
``to_local`` / ``dtensor_from_local``.

The caller promises that ``fn`` computes, on each shard, the shard of the declared output
(that is the whole point: the framework cannot check it). Global output shapes are inferred
for even shards; pass ``out_shapes`` for uneven ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.api import dtensor_from_local, reshard
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Placement

PlacementsLike = Sequence[Placement]


def _is_placements(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(not isinstance(p, (list, tuple)) for p in x)


def local_map(
    fn: Callable[..., Any],
    out_placements: PlacementsLike | Sequence[PlacementsLike | None],
    in_placements: Sequence[PlacementsLike | None] | None = None,
    mesh: ProcessMesh | None = None,
    out_shapes: Sequence[Sequence[int] | None] | None = None,
) -> Callable[..., Any]:
    """Wrap ``fn`` to run on local shards of DistTensor arguments.

    ``out_placements``: one placement list for a single tensor output, or one per output
    (``None`` for a non-tensor output). ``in_placements``: one per positional argument
    (``None`` = take it as it is). ``mesh`` defaults to the mesh of the first DistTensor argument.
    """
    single = _is_placements(out_placements)
    outs: list[Any] = [out_placements] if single else list(out_placements)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        the_mesh = mesh
        local_args = []
        for i, a in enumerate(args):
            if isinstance(a, DistTensor):
                the_mesh = the_mesh or a.process_mesh
                want = in_placements[i] if in_placements is not None and i < len(in_placements) else None
                if want is not None:
                    a = reshard(a, a.process_mesh, list(want))
                local_args.append(a.to_local())
            else:
                local_args.append(a)
        if the_mesh is None:
            raise ValueError(f"local_map({getattr(fn, '__name__', fn)}): no DistTensor argument and no mesh given")
        result = fn(*local_args, **kwargs)
        results = [result] if single or not isinstance(result, (tuple, list)) else list(result)
        if len(results) != len(outs):
            raise ValueError(
                f"local_map({getattr(fn, '__name__', fn)}): {len(results)} outputs but {len(outs)} out_placements"
            )
        wrapped = []
        for k, (r, pl) in enumerate(zip(results, outs)):
            if pl is None or not isinstance(r, torch.Tensor):
                wrapped.append(r)
                continue
            shape = out_shapes[k] if out_shapes is not None else None
            wrapped.append(dtensor_from_local(r, the_mesh, list(pl), shape=shape))
        return wrapped[0] if single or not isinstance(result, (tuple, list)) else type(result)(wrapped)

    return wrapper


class LocalLayer(torch.nn.Module):
    """A module whose ``forward`` runs on local shards; outputs get ``out_dist_attrs``.

    ``out_dist_attrs`` lists ``(mesh, placements)`` per output. Subclass and write ``forward``
    as single-device code on the shards::

        class LocalSum(ap.LocalLayer):
            def __init__(self, mesh):
                super().__init__([(mesh, [ap.Partial()])])
            def forward(self, x):           # x: this rank's shard
                return x.sum()
    """

    def __init__(self, out_dist_attrs: Sequence[tuple[ProcessMesh, PlacementsLike]]) -> None:
        super().__init__()
        self.out_dist_attrs = [(m, list(p)) for m, p in out_dist_attrs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        local_args = [a.to_local() if isinstance(a, DistTensor) else a for a in args]
        local_kwargs = {k: v.to_local() if isinstance(v, DistTensor) else v for k, v in kwargs.items()}
        result = super().__call__(*local_args, **local_kwargs)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(results) != len(self.out_dist_attrs):
            raise ValueError(f"{type(self).__name__}: {len(results)} outputs but {len(self.out_dist_attrs)} out_dist_attrs")
        wrapped = [
            dtensor_from_local(r, m, p) if isinstance(r, torch.Tensor) else r
            for r, (m, p) in zip(results, self.out_dist_attrs)
        ]
        return type(result)(wrapped) if isinstance(result, (tuple, list)) else wrapped[0]
