"""Random ops: a random DistTensor equals the single-device tensor drawn with the same seed.

Every rank draws the WHOLE tensor from its generator with the very op the single-device program
runs, then keeps its own box. So a sharded result equals the unsharded one, a Replicate one is
identical on every rank, and each generator ends in the state a single-device run leaves it in.
Contract: every rank must seed alike (``torch.manual_seed(s)`` with the same ``s`` on every rank)
and draw the same sequence. Cost: each draw allocates the full tensor transiently (memory
O(full size)) and every rank spends the full draw's time. Ranks outside the tensor's mesh compute
nothing, but draw (and drop) the same whole tensor (``draw_outside``), so every rank's generator
stays in step, except after a draw whose count depends on its input's values (``multinomial``,
``poisson``: there, only the mesh's ranks advance).

- fills (``uniform_``, ``normal_``, ``bernoulli_``, ``exponential_``, ``random_``, ...) keep the
  written tensor's layout and move nothing; a Partial tensor receives the value in Partial form
  (sum: on the first rank of the axis, zeros elsewhere; avg/max/min: on every rank);
- ``rand_like``/``randn_like``/``randint_like``/``bernoulli(x, p)`` follow x's layout (Partial ->
  Replicate) — only x's shape matters;
- ``bernoulli(probs)``, ``normal(mean, std)`` with tensor arguments, ``multinomial(probs, n)``
  (sampling in ``generate``), ``poisson``, ``_standard_gamma`` and
  ``_sample_dirichlet`` need those tensors whole (Replicate) and may give any output layout;
- ``native_dropout``: the mask is the single-device mask; the output is ``x * mask * scale`` on
  x's shards, so a Partial(sum/avg) x gives a Partial output and a Replicate mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autoparallel.placement import Partial, Placement, Shard
from spmd_rules.base import AxisStrategy, LocalContext, OpCall, R
from spmd_rules.registry import register_axis_rule, register_local_impl

aten = torch.ops.aten

FILL_OPS = [
    aten.uniform_, aten.normal_, aten.bernoulli_.float, aten.exponential_, aten.random_,
    aten.cauchy_, aten.log_normal_, aten.geometric_,
]
LIKE_RANDOM_OPS = [aten.rand_like, aten.randn_like, aten.randint_like, aten.bernoulli.p]
WHOLE_INPUT_OPS = [aten.bernoulli.default, aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
                   aten.multinomial.default, aten.poisson.default, aten._standard_gamma.default,
                   aten._sample_dirichlet.default]


# ---- rules -------------------------------------------------------------------------------------
@register_axis_rule(FILL_OPS)
def fill_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x.uniform_()`` and friends: x keeps its layout, Partial included (nothing moves)."""
    p = call.placements[0][axis]
    return [AxisStrategy((p,), (p,))]


@register_axis_rule(aten.bernoulli_.Tensor)
def bernoulli_tensor_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``x.bernoulli_(probs)``: x keeps its layout; the probabilities are needed whole."""
    p = call.placements[0][axis]
    return [AxisStrategy((p,) + tuple(R for _ in call.inputs[1:]), (p,))]


@register_axis_rule([aten.randint_like, aten.bernoulli.p])
def like_random_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``randint_like(x, ...)``/``bernoulli(x, p)``: the result takes x's layout (Partial -> Replicate)."""
    p = call.placements[0][axis]
    out: Placement = R if isinstance(p, Partial) else p
    return [AxisStrategy((p,) + tuple(R for _ in call.inputs[1:]), (out,))]


@register_axis_rule(WHOLE_INPUT_OPS)
def whole_input_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``bernoulli(probs)``/``normal(mean, std)``: tensor arguments whole; any output layout."""
    out = call.out[0]
    assert out is not None
    ins = tuple(R for _ in call.inputs)
    return [AxisStrategy(ins, (R,))] + [AxisStrategy(ins, (Shard(d),)) for d in range(out.ndim) if out.shape[d] > 1]


@register_axis_rule(aten.native_dropout)
def dropout_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    """``native_dropout(x)``: output follows x (Partial sum/avg stays Partial); the mask likewise, P -> R."""
    p = call.placements[0][axis]
    if isinstance(p, Partial) and p.reduce_type not in ("sum", "avg"):
        return [AxisStrategy((R,), (R, R))]
    return [AxisStrategy((p,), (p, R if isinstance(p, Partial) else p))]


# ---- local implementations ---------------------------------------------------------------------
def dim_order(t: torch.Tensor) -> list[int]:
    """Dims of ``t`` outermost first in memory (so a full draw walks memory like the original)."""
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda d: -strides[d])


def full_like_layout(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised global-size tensor laid out in memory like ``like``."""
    return torch.empty_permuted(shape, dim_order(like), dtype=dtype or like.dtype, device=like.device)


def local_piece(full: torch.Tensor, spec: Any, coord: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of the global value ``full`` under ``spec`` (a copy).

    Shards are boxes of ``full``; a Partial(sum) axis holds the value on its first rank and
    zeros elsewhere, other Partial types hold it everywhere.
    """
    piece = full
    for dim, (off, length) in enumerate(spec.local_box(coord)):
        piece = piece.narrow(dim, off, length)
    piece = piece.clone()
    if any(isinstance(p, Partial) and p.reduce_type == "sum" and coord[a] != 0 for a, p in enumerate(spec.placements)):
        piece.zero_()
    return piece


@register_local_impl(FILL_OPS + [aten.bernoulli_.Tensor])
def fill_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Fill a global-size tensor with the op, write this rank's piece into ``x``."""
    assert ctx.coord is not None
    spec = ctx.in_specs[0]
    full = full_like_layout(spec.shape, x)
    ctx.call.op(full, *args, **kwargs)
    return x.copy_(local_piece(full, spec, ctx.coord))


@register_local_impl(LIKE_RANDOM_OPS)
def like_random_local(ctx: LocalContext, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Draw ``op(global-size x)`` and keep this rank's piece (x's values are not read)."""
    assert ctx.coord is not None
    full = ctx.call.op(full_like_layout(ctx.in_specs[0].shape, x), *args, **kwargs)
    return local_piece(full, ctx.out_specs[0], ctx.coord)


@register_local_impl(WHOLE_INPUT_OPS)
def whole_input_local(ctx: LocalContext, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The op on the whole (replicated) inputs; keep this rank's piece of the result."""
    assert ctx.coord is not None
    return local_piece(ctx.call.op(*args, **kwargs), ctx.out_specs[0], ctx.coord)


@register_local_impl(aten.native_dropout)
def dropout_local(ctx: LocalContext, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-device mask (drawn on a global-size dummy), applied to x's local piece."""
    if train is not None and not train:
        return aten.native_dropout(x, p, train)
    assert ctx.coord is not None
    _, mask_full = aten.native_dropout(full_like_layout(ctx.in_specs[0].shape, x), p, train)
    mask = local_piece(mask_full, ctx.out_specs[1], ctx.coord)
    p1m = 1.0 - p  # as the CPU kernel computes it
    scale = 0.0 if p1m == 0 else 1.0 / p1m
    return x.mul(mask).mul_(scale), mask


def draw_outside(func: Any, specs: Sequence[Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                 device: torch.device) -> None:
    """On a rank outside the tensor's mesh: draw (and drop) what the mesh's ranks draw, the whole
    tensor, so that its generator advances as theirs and as one device's does (a later draw on a
    mesh it belongs to then gives every rank the same values). For the draws whose count follows
    from the shape alone: fills, ``*_like`` and dropout; a draw whose count depends on the input's
    values (``multinomial``, ``poisson``) leaves the generator as it is there."""
    packet = func.overloadpacket
    if not specs or not (packet in FILL_OPS or func in FILL_OPS or func is aten.bernoulli_.Tensor
                         or packet in LIKE_RANDOM_OPS or func in LIKE_RANDOM_OPS or packet is aten.native_dropout):
        return
    spec = specs[0]
    full = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    # (tensor arguments, as bernoulli_'s probabilities, matter only by their shape here)
    rest = [torch.full(tuple(a.shape), 0.5, dtype=a.dtype, device=device) if isinstance(a, torch.Tensor) else a
            for a in args[1:]]
    func(full, *rest, **kwargs)


__all__ = [
    "FILL_OPS", "LIKE_RANDOM_OPS", "WHOLE_INPUT_OPS", "dim_order", "draw_outside", "full_like_layout", "local_piece",
]


def draws_random(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether this call of ``func`` draws random numbers: a seeded op, unless its dropout
    probability is 0 (attention and dropout with ``p=0`` draw nothing)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for k, a in enumerate(func._schema.arguments):
        if a.name in ("dropout_p", "p"):
            value = kwargs.get(a.name, args[k] if k < len(args) else a.default_value)
            return bool(value)
    return True
