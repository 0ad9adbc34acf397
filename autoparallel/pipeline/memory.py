"""``ActivationMeter``: live and peak bytes of the tensors autograd keeps for backward.

Installed with ``torch.autograd.graph.saved_tensors_hooks`` around a forward: every tensor an
op saves is wrapped in a small holder that counts its storage once (several ops saving views of
one storage count it once) and uncounts it when the graph frees it (after backward, or when the
graph is dropped). Parameters are excluded — they live for the whole run anyway. For a
DistTensor the bytes are those of this rank's local shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autoparallel import compat
from autoparallel.engine import layout


def _local(t: torch.Tensor) -> torch.Tensor:
    return layout.local_or_plain(t)


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of ``t``'s local storage; None for empty or meta tensors."""
    local = _local(t)
    if compat.is_fake(local) or local.device.type == "meta" or local.numel() == 0:
        return None  # (a fake tensor: a capture's, no storage)
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


class _Held:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        meter._add(key, nbytes)

    def __del__(self) -> None:
        self.meter._drop(self.key)


class ActivationMeter:
    """Counts bytes saved for backward: ``current``, ``peak`` (call ``reset_peak`` per step)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # data pointer -> [bytes, holders]
        self._exclude = {k[0] for k in (_storage(t) for t in exclude) if k is not None}

    def _add(self, key: int, nbytes: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1

    def _drop(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def reset_peak(self) -> None:
        self.peak = self.current

    @compat.mark_own_observer
    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor pack hook: ``t`` in a holder that counts its storage."""
        info = _storage(t)
        if info is None or info[0] in self._exclude:
            return t
        return _Held(self, t, *info)

    @staticmethod
    def unpack(obj: Any) -> torch.Tensor:
        """The saved-tensor unpack hook."""
        return obj.tensor if isinstance(obj, _Held) else obj

    @contextmanager
    def track(self) -> Iterator[ActivationMeter]:
        """Count what the forward passes run inside this block save for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


__all__ = ["ActivationMeter"]
