"""Where a Partial input is reduced, and which layout a parameter's gradient takes:
``reshard.choice.cheapest`` prices the reductions a strategy leaves pending when carrying would
multiply them, and the move of a gradient to its parameter's layout (pure metadata, no
communication).

A layer norm's backward given a Partial output gradient: carrying it gives three Partial values
(input, weight and bias gradients), reducing it first gives none and moves the one reduction the
input gradient owed anyway: reduced (Megatron's ``f``), at every size. An op carrying one Partial
into one (an embedding's backward into its table's gradient, a pointwise op) carries it, as
before: the table's gradient rides the optimizer's bucket. Where strategies tie, a gradient comes
out in its parameter's layout (a replicated table's whole, a row-sharded table's by rows).
"""

from __future__ import annotations

import torch

from autoparallel import ProcessMesh
from autoparallel.placement import Partial, Replicate
from autoparallel.spec import DistSpec
from reshard.choice import cheapest, multiplies
from spmd_rules.base import Strategy, TensorMeta

MESH = ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
P, R = (Partial(),), (Replicate(),)
F32 = torch.float32


def _spec(shape: tuple[int, ...], pl: tuple[object, ...]) -> DistSpec:
    return DistSpec(MESH, pl, shape, F32)  # type: ignore[arg-type]


def test_a_layer_norm_backward_reduces_its_partial_gradient_first() -> None:
    for rows, width in [(2, 8), (512, 64), (8192, 4096)]:
        specs = [_spec((rows, width), P), _spec((rows, width), R), _spec((rows, 1), R), _spec((rows, 1), R),
                 _spec((width,), R), _spec((width,), R)]
        outs = (TensorMeta((rows, width), F32), TensorMeta((width,), F32), TensorMeta((width,), F32))
        carry = Strategy((P, R, R, R, R, R), (P, P, P))
        reduce_first = Strategy((R, R, R, R, R, R), (R, R, R))
        assert multiplies(carry, specs, outs)
        assert cheapest([reduce_first, carry], specs, (4,), outs) is reduce_first
        assert cheapest([carry, reduce_first], specs, (4,), outs) is reduce_first


def test_one_partial_carried_into_one_stays_carried() -> None:
    # an embedding's backward: the (batch, seq, width) Partial gradient into the table's gradient
    specs = [_spec((8, 64, 32), P), _spec((8, 64), R)]
    outs = (TensorMeta((128, 32), F32),)
    carry = Strategy((P, R), (P,))
    reduce_first = Strategy((R, R), (R,))
    assert not multiplies(carry, specs, outs)
    assert cheapest([reduce_first, carry], specs, (4,), outs) is carry
    # pointwise: a Partial times a replicated value
    specs = [_spec((8, 64), P), _spec((8, 64), R)]
    outs = (TensorMeta((8, 64), F32),)
    carry, reduce_first = Strategy((P, R), (P,)), Strategy((R, R), (R,))
    assert cheapest([reduce_first, carry], specs, (4,), outs) is carry


def test_a_parameter_gradient_takes_its_parameter_layout_where_strategies_tie() -> None:
    # an embedding's backward given a replicated output gradient: the table's gradient may come
    # out whole or row-sharded at no move; the parameter's layout (read off the backward node by
    # the engine) decides, so the optimizer moves nothing
    from autoparallel.placement import Shard

    S0 = (Shard(0),)
    specs = [_spec((8, 64, 32), R), _spec((8, 64), R)]
    outs = (TensorMeta((128, 32), F32),)
    whole, rows = Strategy((R, R), (R,)), Strategy((R, R), (S0,))
    assert cheapest([whole, rows], specs, (4,), outs) is rows  # no target: the smaller output
    assert cheapest([whole, rows], specs, (4,), outs, _spec((128, 32), R)) is whole
    assert cheapest([rows, whole], specs, (4,), outs, _spec((128, 32), R)) is whole
    assert cheapest([whole, rows], specs, (4,), outs, _spec((128, 32), S0)) is rows
    # a target of another shape (the op is not the gradient itself): no say
    assert cheapest([whole, rows], specs, (4,), outs, _spec((32, 128), R)) is rows


def test_a_partial_axis_is_left_to_the_optimizer_when_aiming_at_the_parameter() -> None:
    from autoparallel.placement import Shard

    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    g = DistSpec(mesh, (Partial(), Replicate()), (8, 64, 32), F32)  # type: ignore[arg-type]
    idx = DistSpec(mesh, (Replicate(), Replicate()), (8, 64), torch.int64)  # type: ignore[arg-type]
    outs = (TensorMeta((128, 32), F32),)
    whole = Strategy(((Partial(), Replicate()), (Replicate(), Replicate())), ((Partial(), Replicate()),))
    rows = Strategy(((Partial(), Replicate()), (Replicate(), Replicate())), ((Partial(), Shard(0)),))
    table = DistSpec(mesh, (Replicate(), Replicate()), (128, 32), F32)  # type: ignore[arg-type]
    assert cheapest([rows, whole], [g, idx], (2, 2), outs) is rows
    assert cheapest([rows, whole], [g, idx], (2, 2), outs, table) is whole
