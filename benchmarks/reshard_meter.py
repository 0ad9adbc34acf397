"""Torch side of ``benchmarks/reshard.py``: the byte meter and how DTensor is driven.

``make_torch_meter()`` returns a subclass of ``torch.distributed.tensor.debug.CommDebugMode``
(a ``TorchDispatchMode`` that sees every functional collective ``redistribute`` issues:
``torch.ops._c10d_functional.{all_gather_into_tensor, reduce_scatter_tensor, all_reduce,
all_to_all_single, broadcast}`` and their ``_coalesced`` forms). ``CommDebugMode`` only counts
collectives, so the subclass converts each op's real tensor sizes and group size to bytes with
the very same functions of ``autoparallel/cost.py``: all-gather ``(n-1) x piece``,
reduce-scatter ``(n-1) x (input / n)``, ring all-reduce ``2(n-1)/n x size``, all-to-all ``sum
of received splits except one's own``. Sizes are the tensors actually handed to the
collective, so torch's padding of uneven shards is counted. Any other c10d collective it sees
is listed in ``unpriced`` (the benchmark fails the case: never silently uncounted).

``torch_redistribute`` is ``DTensor.redistribute`` (or, for a new Partial target, the internal
``redistribute_local_tensor`` it wraps); ``use_torch_alltoall`` makes ``Shard(i) -> Shard(j)``
take DTensor's real all-to-all on CPU instead of its all-gather + chunk fallback.
"""

from __future__ import annotations

import math
from typing import Any

# --------------------------------------------------------------------------------------------
# torch-side meter
# --------------------------------------------------------------------------------------------


def make_torch_meter() -> Any:
    """A ``torch.distributed.tensor.debug.CommDebugMode`` that also prices what it sees."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug import _comm_mode as comm_mode

    from autoparallel import cost

    fc = torch.ops._c10d_functional

    def group_of(name: Any) -> Any:
        return name if isinstance(name, dist.ProcessGroup) else _resolve_process_group(name)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def ag(inp: torch.Tensor, n: int) -> tuple[int, int]:
        return cost.all_gather_bytes([nbytes(inp)] * n, 0)

    def rs(inp: torch.Tensor, n: int) -> tuple[int, int]:
        return cost.reduce_scatter_bytes(nbytes(inp) // n, n)

    def ar(inp: torch.Tensor, n: int) -> tuple[int, int]:
        return cost.all_reduce_bytes(nbytes(inp), n)

    def a2a(args: tuple[Any, ...]) -> tuple[int, int]:
        inp, out_splits, in_splits, name = args[:4]
        pg = group_of(name)
        n, me = pg.size(), pg.rank()
        rows = inp.shape[0] if inp.dim() else 1
        row_bytes = nbytes(inp) // rows if rows else inp.element_size() * math.prod(inp.shape[1:])
        out_splits = list(out_splits) if out_splits else [rows // n] * n
        in_splits = list(in_splits) if in_splits else [rows // n] * n
        return cost.all_to_all_bytes(
            [s * row_bytes for s in in_splits], [s * row_bytes for s in out_splits], me
        )

    def bcast(args: tuple[Any, ...]) -> tuple[int, int]:
        inp, src, name = args[:3]
        pg = group_of(name)
        b = nbytes(inp)
        return ((pg.size() - 1) * b, 0) if pg.rank() == src else (0, b)

    def op(name: str) -> Any:
        try:
            return getattr(fc, name)
        except (AttributeError, RuntimeError):
            return None

    table = {
        "all_gather_into_tensor": lambda a: ag(a[0], a[1]),
        "all_gather_into_tensor_out": lambda a: ag(a[0], a[1]),
        "reduce_scatter_tensor": lambda a: rs(a[0], a[2]),
        "all_reduce": lambda a: ar(a[0], group_of(a[2]).size()),
        "all_reduce_": lambda a: ar(a[0], group_of(a[2]).size()),
        "all_to_all_single": a2a,
        "broadcast": bcast,
        "broadcast_": bcast,
        "all_gather_into_tensor_coalesced": lambda a: _sum2(ag(t, a[1]) for t in a[0]),
        "reduce_scatter_tensor_coalesced": lambda a: _sum2(rs(t, a[2]) for t in a[0]),
        "all_reduce_coalesced": lambda a: _sum2(ar(t, group_of(a[2]).size()) for t in a[0]),
        "all_reduce_coalesced_": lambda a: _sum2(ar(t, group_of(a[2]).size()) for t in a[0]),
    }
    pricers = {op(k): v for k, v in table.items() if op(k) is not None}
    if hasattr(torch.ops, "_dtensor") and hasattr(torch.ops._dtensor, "shard_dim_alltoall"):
        # (input, gather_dim, shard_dim, group): a real all-to-all (not used on gloo)
        pricers[torch.ops._dtensor.shard_dim_alltoall] = lambda a: cost.reduce_scatter_bytes(
            nbytes(a[0]) // group_of(a[3]).size(), group_of(a[3]).size()
        )
    # Anything else CommDebugMode counts as a collective (legacy c10d ops, the autograd funcol
    # variants) has no pricer: seeing one fails the case instead of going uncounted.
    unpriced = (set(comm_mode.c10d_collective_ops) | set(CommDebugMode().comm_registry)) - set(pricers)

    class TorchCommMeter(CommDebugMode):
        """CommDebugMode + bytes: ``sent``/``received`` of this rank, ``ops`` seen."""

        def __init__(self) -> None:
            super().__init__()
            self.sent = 0
            self.received = 0
            self.ops: list[str] = []
            self.unpriced: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out
            packet = func._overloadpacket
            if packet in pricers:
                s, r = pricers[packet](tuple(args))
                self.sent += int(s)
                self.received += int(r)
                self.ops.append(packet.__name__)
            elif packet in unpriced:
                self.unpriced.append(str(packet))
            return out

    return TorchCommMeter


def _sum2(pairs: Any) -> tuple[int, int]:
    s = r = 0
    for a, b in pairs:
        s, r = s + a, r + b
    return s, r


# --------------------------------------------------------------------------------------------
# driving DTensor
# --------------------------------------------------------------------------------------------


def torch_redistribute(xt: Any, dmesh: Any, placements: list[Any]) -> Any:
    """``xt.redistribute(dmesh, placements)``; for a new ``Partial`` target, which the public
    method refuses ("for internal use only"), the internal ``redistribute_local_tensor`` that
    it wraps."""
    if not any(p.is_partial() and p != q for p, q in zip(placements, xt.placements)):
        return xt.redistribute(dmesh, placements)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    spec = DTensorSpec(dmesh, tuple(placements), tensor_meta=xt._spec.tensor_meta)
    return DTensor(redistribute_local_tensor(xt._local_tensor, xt._spec, spec), spec, requires_grad=False)


def use_torch_alltoall() -> None:
    """Make DTensor's ``Shard(i) -> Shard(j)`` use its real all-to-all op on CPU too.

    On a CPU mesh ``shard_dim_alltoall`` falls back to all-gather + chunk ("gloo does not
    support alltoall"); gloo does run ``all_to_all_single``, so this takes the branch DTensor
    takes on GPUs — the fair comparison with an NCCL world.
    """
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import _collective_utils as cu
    from torch.distributed.tensor import placement_types as pt

    def shard_dim_alltoall(input: Any, gather_dim: int, shard_dim: int, mesh: Any, mesh_dim: int) -> Any:
        group = funcol._resolve_group((mesh, mesh_dim))
        return torch.ops._dtensor.shard_dim_alltoall(
            input, gather_dim, shard_dim, funcol._group_or_group_name(group)
        )

    cu.shard_dim_alltoall = shard_dim_alltoall
    pt.shard_dim_alltoall = shard_dim_alltoall
