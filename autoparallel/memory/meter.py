"""``LayerMeter``: the bytes each layer's forward leaves alive for the backward, per rank.

The pipeline's ``ActivationMeter`` counts what autograd's saved-tensor hooks see; inside a
recomputed (checkpointed) region those hooks are the checkpoint's own, and what the region
really keeps — its inputs, the selective policy's cache — never passes through them. This
meter counts storage instead: while it tracks a forward, a dispatch mode notes the storage of
every tensor an op makes (for a DistTensor, this rank's local shard; views and in-place results
count their storage once) and which tracked layer was running; when the forward ends it sums,
per layer, the storages still alive. That is exactly what the forward holds for the backward —
autograd's saved tensors, a checkpoint's kept inputs and cache, ZeRO-3's nothing — plus what
the caller still references (the model's output, counted outside the layers). Parameters and
tensors made before tracking are not counted.

    meter = LayerMeter(model, "blocks.*")
    with meter.track():
        loss = lm_loss(model(x), y)
    meter.bytes        # {"blocks.0": 1_234_944, "blocks.1": 1_234_944}
    loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from autoparallel import compat
from autoparallel.compat import TorchDispatchMode, tree_flatten
from autoparallel.engine import layout

OTHER = "<other>"


def _storage(t: Any) -> tuple[int, int, torch.UntypedStorage] | None:
    """(address, bytes, storage) of a tensor's local storage; None for empty, meta or sparse."""
    if not isinstance(t, torch.Tensor):
        return None
    local = layout.local_or_plain(t)
    if compat.is_fake(local) or local.layout != torch.strided or local.device.type == "meta":
        return None  # (a fake tensor: a capture's, no storage)
    st = local.untyped_storage()
    if st.nbytes() == 0:
        return None
    return st.data_ptr(), st.nbytes(), st


def outermost_matches(model: nn.Module, patterns: list[str]) -> dict[str, nn.Module]:
    """The modules whose dotted names match one of ``patterns`` (``fnmatch``; ``*`` crosses
    dots) and have no matching ancestor: ``"blocks.*"`` gives the blocks, not their insides."""
    names = [n for n, _ in model.named_modules() if any(fnmatchcase(n, p) for p in patterns)]
    chosen = set(names)
    mods = dict(model.named_modules())
    return {n: mods[n] for n in names
            if not any(a in chosen for a in _ancestors(n))}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [""] + [".".join(parts[:k]) for k in range(1, len(parts))] if name else []


class _Recorder(TorchDispatchMode):  # type: ignore[misc,valid-type]  # compat's TorchDispatchMode
    _ap_own_observer = True  # (``compat.OWN_OBSERVER``)

    def __init__(self, meter: LayerMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.meter._note(t, func)
        return out


class LayerMeter:
    """Per tracked layer: bytes of the storages its forward made that outlive the forward."""

    def __init__(self, model: nn.Module, layers: str | list[str] = "*") -> None:
        patterns = [layers] if isinstance(layers, str) else list(layers)
        self.model = model
        self.layers = outermost_matches(model, patterns)
        if not self.layers:
            raise ValueError(f"LayerMeter: no module of {type(model).__name__} matches {patterns}")
        self.bytes: dict[str, int] = {}
        self.detail: dict[str, list[tuple[str, int]]] = {}  # per layer: (op(local shape):dtype, bytes)
        self._stack: list[str] = []
        self._seen: dict[int, tuple[StorageWeakRef, int, str, str]] = {}
        self._params: set[int] = set()

    @property
    def per_layer(self) -> int:
        """The largest layer's bytes (the per-layer figure of a uniform stack)."""
        return max((v for k, v in self.bytes.items() if k != OTHER), default=0)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def _note(self, t: Any, func: Any = None) -> None:
        info = _storage(t)
        if info is None or info[0] in self._params:
            return
        key, nbytes, st = info
        old = self._seen.get(key)
        if old is not None and not old[0].expired():
            return  # a view, an in-place result, or a storage already noted
        self._seen[key] = (StorageWeakRef(st), nbytes, self._stack[-1] if self._stack else OTHER,
                           f"{func}{tuple(layout.local_or_plain(t).shape)}:{t.dtype}")

    def _push(self, name: str) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            self._stack.append(name)
        return pre

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    @contextlib.contextmanager
    def track(self) -> Iterator[LayerMeter]:
        """Meter the forward run inside the block; ``bytes`` is filled when it ends."""
        self._seen.clear()
        self._stack.clear()
        self._params = {i[0] for i in (_storage(t) for t in [*self.model.parameters(), *self.model.buffers()])
                        if i is not None}
        handles = []
        for name, m in self.layers.items():
            handles.append(m.register_forward_pre_hook(self._push(name)))
            handles.append(m.register_forward_hook(self._pop, always_call=True))
        try:
            with _Recorder(self):
                yield self
        finally:
            for h in handles:
                h.remove()
        out: dict[str, int] = {n: 0 for n in self.layers}
        detail: dict[str, list[tuple[str, int]]] = {n: [] for n in self.layers}
        for ref, nbytes, name, what in self._seen.values():
            if not ref.expired():
                out[name] = out.get(name, 0) + nbytes
                detail.setdefault(name, []).append((what, nbytes))
        self.bytes, self.detail = out, detail
        self._seen.clear()


__all__ = ["OTHER", "LayerMeter", "outermost_matches"]
