"""``ap.Strategy``: the settings of a static (captured) training step."""

from __future__ import annotations

from dataclasses import dataclass

COMPILERS = (None, "inductor")


@dataclass(frozen=True)
class Strategy:
    """How ``ap.to_static`` runs a step.

    - ``accumulate_steps``: gradient merge (Paddle's name): gradients of this many calls are
      summed, divided by ``accumulate_steps`` and stepped once, on the last call of each group
      (equal micro-batches of a mean loss: the step of the whole batch).
    - ``bucket_bytes``: the gradient bucket size of a ``shard_optimizer`` optimizer (its
      reductions are part of the captured program); None keeps the optimizer's.
    - ``compile``: None replays the captured program as it is; ``"inductor"`` compiles it with
      ``torch.compile(backend="inductor")`` first (falls back to the plain program, with a
      warning, where compiling fails).
    - ``overlap``: each collective of the program starts as soon as its input exists
      (``passes.hoist_starts``: gradient buckets during the backward, ZeRO-3 all-gathers one
      unit ahead) and is waited for only where its result is first needed
      (``passes.sink_waits``), so compute overlaps the communication. The values are the same
      either way.
    """

    accumulate_steps: int = 1
    bucket_bytes: int | None = None
    compile: str | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.accumulate_steps, bool) or not isinstance(self.accumulate_steps, int) or self.accumulate_steps < 1:
            raise ValueError(f"Strategy: accumulate_steps must be an int >= 1, got {self.accumulate_steps!r}")
        if self.bucket_bytes is not None and (not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1):
            raise ValueError(f"Strategy: bucket_bytes must be a positive int or None, got {self.bucket_bytes!r}")
        if self.compile not in COMPILERS:
            raise ValueError(f"Strategy: compile must be one of {COMPILERS}, got {self.compile!r}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"Strategy: overlap must be a bool, got {self.overlap!r}")
