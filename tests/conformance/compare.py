"""op_db conformance, part 2: comparing a result with the reference, and the verdict records.

``compare(ref, got)`` is None when ``got`` matches ``ref`` (nested tensors and Python values;
floats by ``allclose`` rtol 1e-4, atol 1e-5, NaNs equal; integers and bools exactly; shapes and
dtypes must match), else the first ``Mismatch``. ``SampleResult``/``OpResult`` hold verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tests.conformance.samples import ATOL, RTOL, STATUS_ORDER, _is_float, _tensors


# ---- comparing ---------------------------------------------------------------------------
@dataclass
class Mismatch:
    """Where a result differs from the reference."""

    where: str
    what: str
    max_err: float = math.nan


def _to_dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def compare(ref: Any, got: Any, values: bool = True, where: str = "out") -> Mismatch | None:
    """None when ``got`` matches ``ref`` (nested); else the first difference."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return Mismatch(where, f"expected a tensor, got {type(got).__name__}")
        if tuple(ref.shape) != tuple(got.shape):
            return Mismatch(where, f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        if ref.dtype != got.dtype:
            return Mismatch(where, f"dtype {got.dtype} != reference {ref.dtype}")
        if not values or ref.numel() == 0:
            return None
        r, g = _to_dense(ref.detach()), _to_dense(got.detach())
        if _is_float(r):
            if torch.allclose(g, r, rtol=RTOL, atol=ATOL, equal_nan=True):
                return None
            diff = (g - r).abs()
            nan_mismatch = torch.isnan(g) != torch.isnan(r)
            finite = torch.isfinite(diff)
            err = float(diff[finite].max()) if bool(finite.any()) else math.inf
            what = "values differ" + (" (NaN pattern differs)" if bool(nan_mismatch.any()) else "")
            return Mismatch(where, what, err)
        if torch.equal(g, r):
            return None
        return Mismatch(where, "values differ", float((g.double() - r.double()).abs().max()))
    if isinstance(ref, (list, tuple)) and not isinstance(ref, torch.Size):
        if not isinstance(got, (list, tuple)) or len(got) != len(ref):
            return Mismatch(where, f"expected a sequence of {len(ref)}, got {_describe(got)}")
        for i, (a, b) in enumerate(zip(ref, got)):
            m = compare(a, b, values, f"{where}[{i}]")
            if m is not None:
                return m
        return None
    if isinstance(got, torch.Tensor):  # a Python value came back as a tensor
        got = got.item() if got.numel() == 1 else got.tolist()
    if not values:
        return None
    if isinstance(ref, float) and isinstance(got, (int, float)):
        if math.isclose(ref, got, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(ref) and math.isnan(got)):
            return None
        return Mismatch(where, f"{got!r} != reference {ref!r}", abs(got - ref))
    if ref != got:
        return Mismatch(where, f"{got!r} != reference {ref!r}")
    return None


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__


def shapes_of(obj: Any) -> str:
    """Compact description of a sample's arguments: shapes of tensors, repr of the rest."""
    if isinstance(obj, torch.Tensor):
        s = "x".join(str(d) for d in obj.shape) or "scalar"
        return s if obj.dtype == torch.float32 else f"{s}:{str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k}={shapes_of(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        inner = ", ".join(shapes_of(v) for v in obj)
        return f"[{inner}]" if isinstance(obj, list) else f"({inner})"
    r = repr(obj)
    return r if len(r) <= 40 else r[:37] + "..."


def _error_text(e: BaseException) -> str:
    """One line: exception type and the first meaningful line of its message."""
    msg = str(e).strip()
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    text = f"{type(e).__name__}: {first}"
    return text if len(text) <= 240 else text[:237] + "..."


# ---- one op, one variant, one backend (runs inside a worker) -------------------------------
@dataclass
class SampleResult:
    index: int
    shapes: str
    forward: str
    backward: str
    forward_detail: str = ""
    backward_detail: str = ""
    max_err: float = math.nan


@dataclass
class OpResult:
    """Verdicts of one (op, variant, backend); ``reason`` is the first non-pass sample's detail."""

    op: str
    variant: str
    backend: str
    forward: str
    backward: str
    forward_reason: str = ""
    backward_reason: str = ""
    forward_where: str = ""     # the sample the reason comes from: "sample i (shapes)"
    backward_where: str = ""
    samples: list[SampleResult] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def status(self, phase: str) -> str:
        return self.forward if phase == "forward" else self.backward

    def reason(self, phase: str) -> str:
        return self.forward_reason if phase == "forward" else self.backward_reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worst(statuses: Iterable[str]) -> str:
    present = set(statuses)
    return next((s for s in STATUS_ORDER if s in present), "skip")


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    loss = terms[0].sum()
    for t in terms[1:]:
        loss = loss + t.sum()
    return loss


def _loss_terms(out: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.dtype.is_floating_point and t.requires_grad]
