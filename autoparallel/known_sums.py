"""Sums a local step knows without communicating, noted on the shard it wrote.

A shard holds part of a tensor; its sums along a sharded dim are usually Partial (each rank has
its piece's sum) and cost an all-reduce to complete. Sometimes the step that wrote the shard
knows the whole sum from values every rank holds: the NLL loss's backward over class-split
log-probabilities writes ``-w[t] * g`` at each row's target class and zeros elsewhere, so each
row's sum over *all* classes is ``-w[t] * g`` (0 where the target is ignored) — computed from
the replicated targets, on every rank alike. ``log_softmax``'s backward, which needs exactly
those row sums, then takes them instead of all-reducing its pieces' sums (what Megatron's fused
vocabulary-parallel cross-entropy does by hand). The value is the same bit for bit: the
all-reduce would add one nonzero term to zeros.

The note lives on the shard (a plain tensor). It counts only once the engine has wrapped the
shard (``bind``: the DistTensor's version counter then), and only while neither the DistTensor
(written in place, or through a view of it: autograd's version counter) nor the shard itself
has been written since (``check``, as the engine hands the shard to the next step; a stale note
is dropped). A copy of the shard that keeps its values (``autoparallel.strides.conform``)
carries it. Every member of the mesh writes its shard by the same step and sees the same writes,
so every member holds the note, or none does, and all take the same path.

Imports torch only.
"""

from __future__ import annotations

import torch

_ATTR = "_autoparallel_known_sums"


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def note(shard: torch.Tensor, dim: int, sums: torch.Tensor) -> torch.Tensor:
    """Note that ``shard``'s sums over the whole (global) ``dim``, with ``dim`` kept, are ``sums``
    (not yet usable: see ``bind``)."""
    version = _version(shard)
    if version is not None:
        setattr(shard, _ATTR, [dim, sums, version, None])
    return shard


def bind(shard: torch.Tensor, wrapper: torch.Tensor) -> None:
    """``shard`` is now ``wrapper``'s: a note on it holds while ``wrapper`` is not written."""
    found = getattr(shard, _ATTR, None)
    if found is not None and found[3] is None:
        found[3] = _version(wrapper)


def check(shard: torch.Tensor, wrapper: torch.Tensor) -> None:
    """Drop ``shard``'s note if ``wrapper`` or ``shard`` was written since it was made."""
    found = getattr(shard, _ATTR, None)
    if found is not None and (found[3] is None or found[3] != _version(wrapper) or found[2] != _version(shard)):
        delattr(shard, _ATTR)


def known(shard: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The sums over ``dim`` noted on ``shard``, if it was bound and not written since."""
    found = getattr(shard, _ATTR, None)
    if found is None or found[0] != dim or found[3] is None or found[2] != _version(shard):
        return None
    sums: torch.Tensor = found[1]
    return sums


def carry(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst`` (a copy of ``src``'s values) with ``src``'s current note, if any."""
    found = getattr(src, _ATTR, None)
    if found is not None and found[2] == _version(src):
        setattr(dst, _ATTR, [found[0], found[1], _version(dst), found[3]])
    return dst


__all__ = ["bind", "carry", "check", "known", "note"]
