"""Pending DistTensors: what may run on them without computing their value.

``PendingTensor`` (the data type, in ``autoparallel.engine.dtensor``) is a DistTensor whose
value waits on a deferred statistic (``autoparallel.engine.deferred``). This module is its
policy: which ops propagate it unscaled, which resolve it. Two kinds:

- a *deferred value* (a batch-mean loss, its total weight): ``finish(stat)`` once the
  statistic's all-reduce is done;
- a *scaled gradient*: ``raw * stat.inverse_count()``. The backward of a deferred mean
  (``nll_loss_backward`` run with total weight 1) makes one; it passes *unscaled* through ops
  linear in it (``LINEAR``), layout changes (``_moved``), a local region's backward
  (``autoparallel.regions``) and autograd's gradient accumulation, to the optimizer's bucketed
  reduction, which scales each reduced bucket once. The backward being linear in its incoming gradient, scaling at the end
  equals scaling at the start (up to rounding: fp32 agrees to ~1e-7).

Anything else resolves the value first: reading ``_local`` (any other op, ``to_local``,
``full_tensor``, ``item``) waits for the statistic and computes it. The all-reduce was started
by every member in the same forward op, so a read on some ranks only never hangs. Whether a
tensor propagates or resolves depends only on the op and on which arguments are pending — the
same on every rank — so every rank scales at the same points and replicas stay identical.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from autoparallel.engine.deferred import Stat
from autoparallel.engine.dispatch import dispatch
from autoparallel.placement import Partial
from autoparallel.spec import DistSpec

aten = torch.ops.aten
MEAN = 1  # at::Reduction::Mean


def scale(raw: torch.Tensor, stat: Stat) -> torch.Tensor:
    """The value of a scaled gradient: its unscaled shard times ``1 / count``."""
    return raw * stat.inverse_count()


def _pending(t: Any) -> bool:
    """Whether ``t`` is a PendingTensor whose value is not computed yet (only a PendingTensor
    has ``_done``)."""
    return getattr(t, "_done", False) is None


def sums_only(spec: DistSpec) -> bool:
    """No Partial(max/min): a scale commutes with summing summands, not with their max."""
    return not any(isinstance(p, Partial) and p.reduce_type not in ("sum", "avg") for p in spec.placements)


def scaled_raw(t: Any) -> tuple[torch.Tensor, Stat] | None:
    """(unscaled shard, statistic) of a pending scaled gradient; None for anything else."""
    if _pending(t) and t._scaled:
        return t._raw, t._stat
    return None


# Ops linear in the tensor arguments at these positions (each one alone: the others must not be
# pending), and ops jointly linear in them (all pending, one statistic: add/sub of two gradients).
LINEAR: dict[Any, tuple[int, ...]] = {
    op: (0,) for op in (
        aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.t.default,
        aten.transpose.int, aten.permute.default, aten.squeeze.default, aten.squeeze.dim,
        aten.squeeze.dims, aten.unsqueeze.default, aten.slice.Tensor, aten.select.int,
        aten.alias.default, aten.detach.default, aten.clone.default, aten._to_copy.default,
        aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten.div.Tensor, aten.sum.default,
        aten.sum.dim_IntList, aten._log_softmax_backward_data.default,
        aten._softmax_backward_data.default, aten.gelu_backward.default, aten.threshold_backward.default,
        aten.native_dropout_backward.default, aten.embedding_dense_backward.default,
        aten.native_layer_norm_backward.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )
}
LINEAR.update({aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.mul.Tensor: (0, 1)})
JOINT: dict[Any, tuple[int, ...]] = {aten.add.Tensor: (0, 1), aten.sub.Tensor: (0, 1)}
# Ops that read only metadata: autograd's ``ones_like(loss)`` must not wait for the loss.
METADATA_ONLY = frozenset({
    aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default,
})
NLL_BACKWARD = frozenset({aten.nll_loss_backward.default, aten.nll_loss2d_backward.default})


def intercept(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` (``cls``: DistTensor) without resolving its pending arguments where that is
    exact; NotImplemented lets the dispatcher run it normally (reading ``_local`` resolves them)."""
    where = [k for k, a in enumerate(args) if _pending(a)]
    if not where and not any(_pending(v) for v in kwargs.values()):
        return NotImplemented  # resolved ones, or pending ones nested in a list: resolve
    if func in METADATA_ONLY:
        return dispatch(cls, func, *_substitute(cls, args, kwargs, {}))
    if torch.is_grad_enabled() or any(_pending(v) for v in kwargs.values()):
        return NotImplemented  # a differentiable use (create_graph, a forward op): resolve
    if func in NLL_BACKWARD:
        return _nll_backward(cls, func, args, kwargs)
    if not all(args[k]._scaled for k in where) or len({id(args[k]._stat) for k in where}) != 1:
        return NotImplemented
    if not all(sums_only(args[k]._spec) for k in where):
        return NotImplemented
    if func in LINEAR:
        ok = len(where) == 1 and where[0] in LINEAR[func]
    else:
        ok = func in JOINT and tuple(where) == JOINT[func]
    if not ok:
        return NotImplemented
    out = dispatch(cls, func, *_substitute(cls, args, kwargs, {}))
    return _rewrap(out, args[where[0]])


@cache
def _arg_names(func: Any) -> tuple[str, ...]:
    return tuple(a.name for a in func._schema.arguments)


def detached(x: Any) -> Any:
    """``x.detach()`` of a pending ``x``: the same pending value (or unscaled gradient) on a
    detached shard."""
    return type(x).make(x._raw.detach(), x._spec, x._stride, x._stat, None if x._scaled else x._finish)


def _nll_backward(cls: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The backward of a deferred mean: run with total weight 1, scale by 1/total later."""
    bound = dict(zip(_arg_names(func), args)) | kwargs
    tw: Any = bound.get("total_weight")
    if (not _pending(tw) or tw._scaled or int(bound.get("reduction", MEAN)) != MEAN
            or any(_pending(v) for k, v in bound.items() if k != "total_weight")):
        return NotImplemented
    one = cls._wrap(torch.ones_like(tw._raw), tw._spec, tw._stride)
    out = dispatch(cls, func, *_substitute(cls, args, kwargs, {id(tw): one}))
    return _rewrap(out, tw)


def _substitute(
    cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], extra: dict[int, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with each pending tensor as a plain DistTensor of its raw shard."""
    return tuple(_sub(cls, a, extra) for a in args), {k: _sub(cls, v, extra) for k, v in kwargs.items()}


def _sub(cls: Any, a: Any, extra: dict[int, Any]) -> Any:
    """One argument of ``_substitute`` (a module function: a closure calling itself is a reference
    cycle that would hold the tensors it saw until a full garbage collection)."""
    if id(a) in extra:
        return extra[id(a)]
    if _pending(a):
        return cls._wrap(a._raw, a._spec, a._stride)
    if isinstance(a, (list, tuple)):
        return type(a)(_sub(cls, v, extra) for v in a)
    return a


def _rewrap(out: Any, source: Any) -> Any:
    """Every DistTensor in ``out`` as a scaled gradient of ``source``'s statistic (``source``: a
    pending argument; its class makes the new ones)."""
    if isinstance(out, torch.Tensor) and hasattr(out, "_spec"):
        dt: Any = out
        return type(source).make(dt._local, dt._spec, dt._stride, source._stat)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, source) for o in out)
    return out
