"""op_db conformance, part 1: the op table, the samples, and how each variant lays out a tensor.

``samples_of(op, n)`` draws ``n`` float32 CPU samples of an OpInfo (seeded: every rank builds the
same ones); ``shard_dim(shape, variant)`` is the tensor dim a variant shards (None: Replicate).
Constants shared by the harness modules live here.
"""

from __future__ import annotations

import itertools
import sys
import types
import unittest
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

WORLD = 4
VARIANTS = ("replicate", "shard0", "shard_last", "uneven")
BACKENDS = ("ours", "torch")
PHASES = ("forward", "backward")
RTOL, ATOL = 1e-4, 1e-5
DEFAULT_SAMPLES = 3
STATUS_ORDER = ("WRONG", "hang", "error", "pass", "skip")  # worst first
SEED = 0
WARMUP_TIMEOUT = 900.0  # a fresh world importing op_db on a loaded 2-core machine

# Ops drawing random numbers: the distributed run cannot reproduce the reference's stream, so
# only shapes and dtypes are compared.
RANDOM_OPS = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.in_place", "normal.number_mean", "uniform", "rand_like", "randn_like", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
})


# ---- op_db -------------------------------------------------------------------------------
def _ensure_expecttest() -> None:
    """``torch.testing._internal`` imports ``expecttest`` only for its TestCase base class.

    When the package is not installed, a stand-in module is enough for reading ``op_db``.
    """
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stub.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stub


def opinfo_name(op: Any) -> str:
    """``name`` or ``name.variant_test_name``: unique over op_db."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@lru_cache(maxsize=1)
def op_table() -> dict[str, Any]:
    """Every OpInfo of ``op_db`` by ``opinfo_name``."""
    _ensure_expecttest()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return {opinfo_name(op): op for op in op_db}


def all_op_names() -> list[str]:
    return list(op_table())


# ---- samples -----------------------------------------------------------------------------
_SAMPLES: dict[tuple[str, int], list[Any]] = {}


SAMPLE_POOL = 12  # samples drawn before choosing ``n`` of them


def samples_of(op: Any, n: int) -> list[Any]:
    """``n`` float32 CPU samples (seeded: identical on every rank), cached.

    From the first ``SAMPLE_POOL`` samples, those whose first tensor has at least one dim come
    first (a 0-dim input cannot be sharded), in op_db order.
    """
    key = (opinfo_name(op), n)
    if key not in _SAMPLES:
        torch.manual_seed(SEED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen = op.sample_inputs("cpu", torch.float32, requires_grad=bool(op.supports_autograd))
            pool = list(itertools.islice(gen, max(n, SAMPLE_POOL)))

        def scalar_only(s: Any) -> bool:
            ts = _tensors((s.input, tuple(s.args), dict(s.kwargs)))
            return not ts or ts[0].dim() == 0

        _SAMPLES[key] = sorted(pool, key=scalar_only)[:n]
    return _SAMPLES[key]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested lists/tuples/dicts (namedtuples keep their type)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t))
    return found


def _fresh(sample: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Fresh leaf copies of the sample's tensors (aliases stay aliases), same requires_grad."""
    memo: dict[int, torch.Tensor] = {}

    def copy_leaf(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            c = t.detach().clone()
            memo[id(t)] = c.requires_grad_(t.requires_grad) if _is_float(c) else c
        return memo[id(t)]

    return _map_tensors((sample.input, tuple(sample.args), dict(sample.kwargs)), copy_leaf)


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def shard_dim(shape: Sequence[int], variant: str, world: int = WORLD) -> int | None:
    """The tensor dim ``variant`` shards for a tensor of ``shape`` (None: Replicate)."""
    nd = len(shape)
    if variant == "replicate" or nd == 0:
        return None
    if variant == "shard0":
        return 0
    if variant == "shard_last":
        return nd - 1
    if variant == "uneven":
        # The smallest dim the world does not divide (a size < world leaves ranks empty);
        # ties go to a middle dim, then the later one: away from shard0/shard_last.
        cands = [d for d, s in enumerate(shape) if s % world]
        if not cands:
            return 0
        return min(cands, key=lambda d: (shape[d], d in (0, nd - 1), -d))
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
