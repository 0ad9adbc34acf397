"""``MixedPrecision``: the dtype policy ``shard_optimizer`` applies to the model's parameters.

The model's parameters stay what they are (fp32, the *masters*): ``state_dict()``, checkpoints
and the optimizer (its states included) see only them. Around each forward, the parameters of
the module running are *compute copies* in ``param_dtype`` (a cast of the master, or under
ZeRO-3 a cast of the shard, gathered in ``param_dtype``); the gradient flows back through the
cast into an fp32 gradient of the master, which is reduced across ranks in ``reduce_dtype``.
See docs/mixed_precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# dtypes a model can compute in: the float8 family has no arithmetic on most backends
_COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, step fp32 masters.

    ``cast_inputs``: cast the floating tensors a unit's forward receives to ``param_dtype``
    (as FSDP2 does), so a plain fp32 batch meets low-precision weights; off when an autocast
    region decides the operand dtypes instead.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    cast_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecision: {name} must be a torch.dtype, got {type(value).__name__} {value!r}")
            if value not in _COMPUTE:
                raise ValueError(
                    f"MixedPrecision: {name}={value} is not a floating dtype a model computes and reduces in; "
                    f"use one of {', '.join(str(d) for d in _COMPUTE)}"
                )
        if not isinstance(self.cast_inputs, bool):
            raise TypeError(f"MixedPrecision: cast_inputs must be a bool, got {self.cast_inputs!r}")

    def __repr__(self) -> str:
        return (f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}, "
                f"cast_inputs={self.cast_inputs})")


def check_precision(value: Any) -> MixedPrecision | None:
    """``mixed_precision=`` as a policy (None: the parameters' own dtype); TypeError otherwise."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    raise TypeError(
        f"shard_optimizer: mixed_precision must be ap.MixedPrecision(...) or None, got {type(value).__name__}"
    )


def casts(policy: MixedPrecision | None, p: torch.Tensor) -> bool:
    """Whether ``policy`` gives parameter ``p`` a compute copy (a floating master of another dtype)."""
    return policy is not None and p.is_floating_point() and p.dtype != policy.param_dtype
