"""Pending DistTensors: values that wait on a deferred statistic (``autoparallel.deferred``).

One class, two kinds:

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

from functools import lru_cache
from typing import Any, Callable, cast

import torch

from autoparallel import deferred
from autoparallel.dispatch import dispatch
from autoparallel.dtensor import DistTensor
from autoparallel.placement import Partial
from autoparallel.spec import DistSpec

aten = torch.ops.aten
_DETACH = aten.detach.default
MEAN = 1  # at::Reduction::Mean


class PendingTensor(DistTensor):
    """A DistTensor whose local value is computed from a deferred statistic on first use."""

    _raw: torch.Tensor                 # scaled gradient: the unscaled shard; value: a placeholder
    _stat: deferred.Stat
    _finish: Callable[[torch.Tensor, deferred.Stat], torch.Tensor]
    _scaled: bool                      # a scaled gradient (propagates through linear ops)
    _done: torch.Tensor | None         # the resolved shard

    @classmethod
    def make(
        cls, raw: torch.Tensor, spec: DistSpec, stride: tuple[int, ...] | None, stat: deferred.Stat,
        finish: Callable[[torch.Tensor, deferred.Stat], torch.Tensor] | None = None,
    ) -> "PendingTensor":
        """A pending tensor of layout ``spec``: ``finish(raw, stat)``; None: a scaled gradient."""
        r = cast(PendingTensor, cls._wrap(raw, spec, stride))
        r._raw, r._stat, r._scaled = raw, stat, finish is None
        r._finish = _scale if finish is None else finish
        r._done = None
        return r

    @property  # type: ignore[override]  # DistTensor stores _local as a plain attribute
    def _local(self) -> torch.Tensor:
        if self._done is None:
            self._done = self._finish(self._raw, self._stat)
            self._raw = self._done  # the unscaled shard is no longer needed: free it
        return self._done

    @_local.setter
    def _local(self, value: torch.Tensor) -> None:  # a write replaces the value (make clears it)
        self._done = value

    @property
    def is_pending(self) -> bool:
        """Whether the value still waits to be computed."""
        return self._done is None

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        """Torch calls this (a subclass goes first) for every op with a PendingTensor argument,
        so plain DistTensor ops never pay for the checks below."""
        if func is _DETACH and len(args) == 1 and not kwargs and _pending(args[0]):
            return _detached(args[0])  # autograd detaches every gradient it keeps: the hot case
        kwargs = kwargs or {}
        out = _intercept(func, args, kwargs)
        return dispatch(DistTensor, func, args, kwargs) if out is NotImplemented else out

    def _moved(self, move: Any, spec: DistSpec) -> DistTensor:
        if _pending(self) and self._scaled and not torch.is_grad_enabled() and _sums_only(self._spec):
            return PendingTensor.make(move(self._raw), spec, None, self._stat)  # a linear map: unscaled
        return super()._moved(move, spec)


def _scale(raw: torch.Tensor, stat: deferred.Stat) -> torch.Tensor:
    return raw * stat.inverse_count()


def _pending(t: Any) -> bool:
    """Whether ``t`` is a PendingTensor whose value is not computed yet."""
    return type(t) is PendingTensor and t._done is None


def _sums_only(spec: DistSpec) -> bool:
    """No Partial(max/min): a scale commutes with summing summands, not with their max."""
    return not any(isinstance(p, Partial) and p.reduce_type not in ("sum", "avg") for p in spec.placements)


def scaled_raw(t: Any) -> tuple[torch.Tensor, deferred.Stat] | None:
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


def _intercept(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` without resolving its pending arguments where that is exact; NotImplemented
    lets the dispatcher run it normally (reading ``_local`` resolves them)."""
    where = [k for k, a in enumerate(args) if _pending(a)]
    if not where and not any(_pending(v) for v in kwargs.values()):
        return NotImplemented  # resolved ones, or pending ones nested in a list: resolve
    if func in METADATA_ONLY:
        return dispatch(DistTensor, func, *_substitute(args, kwargs, {}))
    if torch.is_grad_enabled() or any(_pending(v) for v in kwargs.values()):
        return NotImplemented  # a differentiable use (create_graph, a forward op): resolve
    if func in NLL_BACKWARD:
        return _nll_backward(func, args, kwargs)
    if not all(args[k]._scaled for k in where) or len({id(args[k]._stat) for k in where}) != 1:
        return NotImplemented
    if not all(_sums_only(args[k]._spec) for k in where):
        return NotImplemented
    if func in LINEAR:
        ok = len(where) == 1 and where[0] in LINEAR[func]
    else:
        ok = func in JOINT and tuple(where) == JOINT[func]
    if not ok:
        return NotImplemented
    out = dispatch(DistTensor, func, *_substitute(args, kwargs, {}))
    return _rewrap(out, args[where[0]]._stat)


@lru_cache(maxsize=None)
def _arg_names(func: Any) -> tuple[str, ...]:
    return tuple(a.name for a in func._schema.arguments)


def _detached(x: PendingTensor) -> PendingTensor:
    """``x.detach()``: the same pending value (or unscaled gradient) on a detached shard."""
    return PendingTensor.make(x._raw.detach(), x._spec, x._stride, x._stat, None if x._scaled else x._finish)


def _nll_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The backward of a deferred mean: run with total weight 1, scale by 1/total later."""
    bound = dict(zip(_arg_names(func), args)) | kwargs
    tw: Any = bound.get("total_weight")
    if (not _pending(tw) or tw._scaled or int(bound.get("reduction", MEAN)) != MEAN
            or any(_pending(v) for k, v in bound.items() if k != "total_weight")):
        return NotImplemented
    one = DistTensor._wrap(torch.ones_like(tw._raw), tw._spec, tw._stride)
    out = dispatch(DistTensor, func, *_substitute(args, kwargs, {id(tw): one}))
    return _rewrap(out, tw._stat)


def _substitute(args: tuple[Any, ...], kwargs: dict[str, Any], extra: dict[int, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with each pending tensor as a plain DistTensor of its raw shard."""
    def sub(a: Any) -> Any:
        if id(a) in extra:
            return extra[id(a)]
        if _pending(a):
            return DistTensor._wrap(a._raw, a._spec, a._stride)
        if isinstance(a, (list, tuple)):
            return type(a)(sub(v) for v in a)
        return a
    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}


def _rewrap(out: Any, stat: deferred.Stat) -> Any:
    """Every DistTensor in ``out`` as a scaled gradient of ``stat``."""
    if isinstance(out, DistTensor):
        return PendingTensor.make(out._local, out._spec, out._stride, stat)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, stat) for o in out)
    return out


def adopt(wrapped: list[Any]) -> list[Any]:
    """The dispatcher's wrapped outputs with registered placeholders made pending values."""
    fresh = dict(deferred.FRESH)
    deferred.FRESH.clear()
    out = []
    for w in wrapped:
        entry = fresh.get(id(w._local)) if isinstance(w, DistTensor) else None
        if entry is not None:
            placeholder, stat, finish = entry
            w = PendingTensor.make(placeholder, w._spec, w._stride, stat, finish)
        out.append(w)
    return out


deferred.ADOPT[:] = [adopt]
