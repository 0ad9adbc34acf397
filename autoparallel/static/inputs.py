"""``ap.InputSpec``: the shape and dtype of one input of ``ap.Engine`` (Paddle's ``InputSpec``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"InputSpec: dtype must be a torch.dtype or its name ('float32', 'int64'), got {value!r}")
    return found


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input: ``shape`` with ``None`` (or -1) for a dim of any size (the batch dim), its
    ``dtype`` (a ``torch.dtype`` or a name such as ``"float32"``), and an optional ``name`` (the
    key of this input in a dict batch)."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype = torch.float32
    name: str | None = None

    def __init__(self, shape: Sequence[int | None], dtype: torch.dtype | str = torch.float32,
                 name: str | None = None) -> None:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise TypeError(f"InputSpec: shape must be a list of ints and None, got {shape!r}")
        dims: list[int | None] = []
        for d in shape:
            if d is None or d == -1:
                dims.append(None)
            elif isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"InputSpec: shape {list(shape)} holds {d!r}; each dim is an int >= 0 or None")
            else:
                dims.append(d)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"InputSpec: name must be a str or None, got {name!r}")
        object.__setattr__(self, "shape", tuple(dims))
        object.__setattr__(self, "dtype", _dtype(dtype))
        object.__setattr__(self, "name", name)

    def _label(self) -> str:
        return f"InputSpec({list(self.shape)}, {self.dtype}{', ' + repr(self.name) if self.name else ''})"

    def check(self, t: Any, where: str) -> None:
        """Raise ``ValueError`` naming both if tensor ``t`` (global shape) does not fit this spec."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: expected a tensor for {self._label()}, got {type(t).__name__}")
        shape = tuple(t.shape)
        fits = len(shape) == len(self.shape) and all(w is None or w == s for s, w in zip(shape, self.shape))
        if not fits or t.dtype != self.dtype:
            raise ValueError(f"{where}: a {t.dtype} tensor of shape {shape} does not fit {self._label()} "
                             "(None: any size)")

    def sample(self) -> torch.Tensor:
        """Zeros of this spec's shape, one row for each dim of any size."""
        return torch.zeros([1 if d is None else d for d in self.shape], dtype=self.dtype)


def as_specs(value: Any, where: str) -> list[InputSpec] | None:
    """``value`` (None, one ``InputSpec`` or a list of them) as a list, or None."""
    if value is None:
        return None
    specs = [value] if isinstance(value, InputSpec) else value
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, InputSpec) for s in specs):
        raise TypeError(f"{where} must be an ap.InputSpec or a list of them, got {value!r}")
    return list(specs)


__all__ = ["InputSpec", "as_specs"]
