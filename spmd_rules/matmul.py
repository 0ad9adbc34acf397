"""Contractions written as einsum equations, one rule generator for the whole family.

For ``"mk,kn->mn"`` along one mesh axis the candidates are: everything replicated; a letter of
the output sharded in every operand that has it (output ``S(position)``); a contracted letter
sharded in every operand (output ``P(sum)``); and one ``P`` operand with the others replicated
(output ``P``, contractions are linear in each operand). An additive operand (``addmm``'s bias)
follows the output through broadcasting, and is ``P`` when the output is. Operands strided alike on a
dim (the flattened ``[b, h]`` with ``h`` split, ``[b, s]`` with ``s`` split) stay so.
"""

from __future__ import annotations

from typing import Any

import torch

from autoparallel.placement import Placement, Shard
from spmd_rules.base import P_SUM, AxisStrategy, LocalContext, OpCall, R, follow, with_strided
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten


def einsum_strategies(equation: str, call: OpCall, operands: tuple[int, ...], bias: int | None = None) -> list[AxisStrategy]:
    """Per-axis strategies of ``equation`` over inputs ``operands`` (+ an additive ``bias``)."""
    lhs, out_sub = equation.split("->")
    subs = lhs.split(",")
    out = call.out[0]
    assert out is not None
    n_in = len(call.inputs)

    def make(ops: dict[int, Placement], out_p: Placement) -> AxisStrategy:
        ins: list[Placement] = [R] * n_in
        for i, p in ops.items():
            ins[i] = p
        if bias is not None:
            ins[bias] = follow(out_p, out.shape, call.inputs[bias].shape)
        return AxisStrategy(tuple(ins), (out_p,))

    strategies = [make({}, R)]
    letters = dict.fromkeys("".join(subs))
    for letter in letters:
        ops: dict[int, Placement] = {}
        for i, sub in zip(operands, subs):
            if letter in sub:
                ops[i] = Shard(sub.index(letter))
        if letter in out_sub:
            if out.shape[out_sub.index(letter)] > 1:
                strategies.append(make(ops, Shard(out_sub.index(letter))))
        else:
            strategies.append(make(ops, P_SUM))
    for i in operands:
        strategies.append(make({i: P_SUM}, P_SUM))  # a bias follows the output: P as well
    return strategies


@register_axis_rule(aten.mm)
@with_strided
def mm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("mk,kn->mn", call, (0, 1))


@register_axis_rule(aten.bmm)
@with_strided
def bmm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("bmk,bkn->bmn", call, (0, 1))


@register_axis_rule(aten.mv)
@with_strided
def mv_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("mk,k->m", call, (0, 1))


@register_axis_rule(aten.dot)
def dot_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("k,k->", call, (0, 1))


@register_axis_rule(aten.outer)
def outer_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("m,n->mn", call, (0, 1))


@register_axis_rule(aten.addmm)
@with_strided
def addmm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    # addmm(bias, m1, m2) = beta * bias + alpha * m1 @ m2
    return einsum_strategies("mk,kn->mn", call, (1, 2), bias=0)


@register_axis_rule(aten.baddbmm)
@with_strided
def baddbmm_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("bmk,bkn->bmn", call, (1, 2), bias=0)


@register_axis_rule(aten.addmv)
def addmv_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return einsum_strategies("mk,k->m", call, (1, 2), bias=0)


@register_local_impl([aten.addmv, aten.addmm, aten.baddbmm])
def add_product_local(ctx: LocalContext, bias: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Broadcast the bias to the local output shape first: with an empty shard the CPU kernel
    returns the un-broadcast bias (``addmv(ones(1), ones(0, k), v)`` has shape (1,), not (0,)).
    Other shards call the op as it is (what the same code on plain tensors calls)."""
    shape = ctx.out_shapes[0]
    if shape is not None and 0 in shape and tuple(bias.shape) != tuple(shape):
        bias = bias.expand(shape)
    return ctx.call.op(bias, *args, **kwargs)
