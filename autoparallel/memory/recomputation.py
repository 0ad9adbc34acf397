"""``recompute``: activation recompute (checkpointing) of whole modules, full or selective.

Built on torch's own non-reentrant ``torch.utils.checkpoint.checkpoint`` and its selective
variant (``create_selective_checkpoint_contexts``), which work on DistTensor code unchanged:
the recomputed forward runs the same aten ops through the same dispatch, so every rank issues
the same collectives in the same order again in the backward (under sequence parallelism the
all-gather before a column-parallel layer is redone, as in Megatron), and the values are
bitwise those of the first forward. Dropout draws the same masks: checkpoint restores the
generator state before recomputing, and a DistTensor random op draws from that generator.

``recompute(module, policy)`` makes every call of ``module`` (hooks included) one checkpointed
region. The module keeps its identity, parameters and state-dict keys: its class becomes a
subclass whose ``__call__`` runs ``nn.Module.__call__`` inside the checkpoint (FSDP2's trick).
Module hooks run inside the region, so ZeRO-3's gather of a block's parameters is redone by the
recompute (one all-gather, the one ZeRO-3 issues in backward anyway) and no gathered parameter
is kept between forward and backward.

Policies:

* ``"full"``: keep only the region's inputs; recompute everything (Megatron's full recompute:
  ``2sbh`` bytes per layer for a 16-bit layer input).
* ``"selective"``: keep the outputs of the matrix multiplications of linear layers
  (``mm``/``addmm``) whose output is not ``Partial``; recompute the rest — the attention core
  (QK^T, softmax, dropout, AV as ``bmm``s, or one SDPA op), norms, activations, the all-gathers
  of sequence parallelism and the row-parallel products (a ``Partial`` output holds the whole
  sequence on every rank: keeping it would cost more than the layer's other activations).
  The expensive column-parallel GEMMs are never redone; the attention core always is.
* a callable ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``: any torch SAC policy.
* ``"none"``/``None``: undo.

A key/value cache cannot be recomputed: the recomputed forward would write into it again (its
keys grow by the sequence a second time). As transformers' own gradient checkpointing does, a
checkpointed call given a cache (``past_key_values``, ``past_key_value``, ``layer_past`` not
None, or ``use_cache=True``, by keyword or by position) runs without it (``None``,
``use_cache=False``), after one warning per module class: set ``model.config.use_cache = False``
for training.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoparallel import compat
from autoparallel.engine import layout

aten = torch.ops.aten
Policy = str | Callable[..., Any] | None
POLICIES = ("full", "selective", "none")

# the linear layers' products: kept by "selective" unless their output is Partial
KEEP_OPS = frozenset({aten.mm.default, aten.addmm.default, aten._scaled_mm.default})
_ATTR = "_ap_recompute"
# transformers' names for a layer's key/value cache (GradientCheckpointingLayer drops the same)
CACHE_ARGS = ("past_key_values", "past_key_value", "layer_past")
_warned: set[str] = set()  # module classes that warned they run without their cache (once each)


def forget_warnings() -> None:
    """Let every module class warn again that its recompute runs without its cache."""
    _warned.clear()


def _is_partial(t: Any) -> bool:
    spec = layout.spec_or_none(t)
    return spec is not None and any(p.is_partial() for p in spec.placements)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Megatron-style selective recompute: keep the linear layers' non-Partial products.

    Whether a product is Partial shows only in its output: torch releases before 2.13 call the
    policy without it (no ``ctx.op_output``), and then the product is recomputed (exact, as
    "full" is; only the memory saving is lost)."""
    out = getattr(ctx, "op_output", None)
    if op in KEEP_OPS and out is not None and not _is_partial(out):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy: Policy) -> Callable[[], Any] | None:
    if policy == "full":
        return None
    fn = selective_policy if policy == "selective" else policy
    return functools.partial(create_selective_checkpoint_contexts, fn)


def _region(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` as checkpoint's function: its first run is the forward, later runs recompute.

    A recompute runs with the forward's ``__torch_function__`` state: a backward started by
    ``torch.autograd.backward``/``grad`` on a DistTensor runs with subclass handling off (torch's
    default; ``loss.backward()`` keeps it on, ``engine.dtensor``), and what the forward's
    ``__torch_function__`` did there (plain leaves laid out, split points read whole) would be
    skipped in the recompute, which could then take another path and save other tensors than the
    forward did (torch's checkpoint refuses that)."""
    runs = [0]
    forward_tf = [True]

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if runs[0] == 0:
            forward_tf[0] = compat.torch_function_enabled()
        runs[0] += 1
        if runs[0] > 1 and forward_tf[0] and not compat.torch_function_enabled():
            with compat.enable_torch_function():
                return call(*args, **kwargs)
        return call(*args, **kwargs)
    return run


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters that a positional argument may fill (self left out)."""
    try:
        params = inspect.signature(cls.forward).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin or an unreadable signature: keywords only
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)[1:]


def _dropped(name: str, value: Any) -> Any:
    """What a cache argument becomes in a checkpointed call (``value`` itself when nothing to drop)."""
    if name == "use_cache":
        return False if value else value
    return None if name in CACHE_ARGS else value


def _without_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``, ``kwargs`` with a key/value cache dropped (``None``, ``use_cache=False``), warning once per class.

    A recomputed forward would write into the cache a second time (the keys of a
    ``DynamicCache`` grow by the sequence again, and torch's checkpoint refuses the recomputed
    shapes); transformers' ``GradientCheckpointingLayer`` drops the same arguments."""
    changed: list[str] = []
    names = _positional_names(type(module))  # type: ignore[arg-type]  # classes hash
    if any(n == "use_cache" or n in CACHE_ARGS for n in names[:len(args)]):
        new_args = list(args)
        for i, name in enumerate(names[:len(args)]):
            new_args[i] = _dropped(name, args[i])
            if new_args[i] is not args[i]:
                changed.append(f"{name}={new_args[i]}")
        args = tuple(new_args)
    if any(n == "use_cache" or n in CACHE_ARGS for n in kwargs):
        kwargs = dict(kwargs)
        for name, value in list(kwargs.items()):
            kwargs[name] = _dropped(name, value)
            if kwargs[name] is not value:
                changed.append(f"{name}={kwargs[name]}")
    cls = type(module).__name__
    if changed and cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"autoparallel: ap.recompute runs {cls} without its key/value cache ({', '.join(changed)}): a "
            "recomputed forward would write into the cache a second time. A cache is for generation; "
            "set model.config.use_cache = False (or pass use_cache=False) for training.", stacklevel=4)
    return args, kwargs


class _Recomputed:
    """Mixed into a module's class by ``recompute``: each call is one checkpointed region."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = getattr(self, _ATTR, None)
        if policy is None or not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        args, kwargs = _without_cache(self, args, kwargs)  # type: ignore[arg-type]
        ctx_fn = _context_fn(policy)
        extra: dict[str, Any] = {} if ctx_fn is None else {"context_fn": ctx_fn}
        return checkpoint(_region(super().__call__), *args,  # type: ignore[misc]
                          use_reentrant=False, **extra, **kwargs)


@functools.cache
def _recomputed_class(cls: type) -> type:
    return type(cls.__name__, (_Recomputed, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def recompute(module: nn.Module, policy: Policy = "full") -> nn.Module:
    """Recompute ``module``'s activations in the backward instead of keeping them; return it.

    ``policy``: ``"full"`` (keep the inputs only), ``"selective"`` (keep the linear layers'
    products, recompute the attention core and the cheap ops), a torch SAC policy callable, or
    ``"none"``/``None`` to turn it off. In place: the module keeps its parameters, hooks and
    state-dict keys. Works on plain and on laid-out (``parallelize``/``shard_layer``) modules,
    with ZeRO-3, pipelines and local regions; results are bitwise those without recompute.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"recompute: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(policy, str) and policy not in POLICIES:
        raise ValueError(f"recompute: policy {policy!r} is none of {POLICIES} (or a callable SAC policy)")
    if policy is not None and not isinstance(policy, str) and not callable(policy):
        raise TypeError(f"recompute: policy must be one of {POLICIES} or a callable, got {type(policy).__name__}")
    if policy == "none":
        policy = None
    if not isinstance(module, _Recomputed):
        if policy is None:
            return module
        module.__class__ = _recomputed_class(type(module))  # type: ignore[arg-type]  # classes hash
    object.__setattr__(module, _ATTR, policy)
    return module


def policy_of(module: nn.Module) -> Policy:
    """The recompute policy of ``module`` (None: not recomputed)."""
    return getattr(module, _ATTR, None) if isinstance(module, _Recomputed) else None


__all__ = ["CACHE_ARGS", "KEEP_OPS", "POLICIES", "forget_warnings", "policy_of", "recompute", "selective_policy"]
