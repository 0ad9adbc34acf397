"""``ap.Strategy``: the settings of a static (captured) step and of ``ap.Engine``.

Two kinds of settings live here. The top-level fields (``accumulate_steps``, ``bucket_bytes``,
``compile``, ``overlap``) tell ``ap.to_static`` how to capture and replay a step. Paddle's config
groups (``sharding``, ``pipeline``, ``amp``, ``recompute``, ``gradient_merge``) and ``auto_mode``
tell ``ap.Engine`` which dynamic-API pieces to apply (docs/engine.md).

Every group has a fixed set of settings: assigning or reading a name that is not one of them
(``strategy.shardin``, ``strategy.sharding.enabel``) raises ``AttributeError`` naming the valid
ones, and each value is checked when it is assigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from autoparallel.schedule_names import ScheduleError, schedule_name

COMPILERS = (None, "inductor")
AUTO_MODES = ("semi", "full")
AMP_DTYPES = ("bfloat16", "float16")
SCHEDULES = ("FThenB", "1F1B", "Interleaved1F1B", "ZBH1")


def _int_at_least(where: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an int >= {low}, got {value!r}")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be a bool, got {value!r}")
    return value


def _one_of(where: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if value not in choices:
        raise ValueError(f"{where} must be one of {choices}, got {value!r}")
    return value


class _Slotted:
    """Attributes from a fixed list only; each assignment is validated by ``_check``."""

    __slots__ = ()
    _label: ClassVar[str]
    _defaults: ClassVar[dict[str, Any]]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._defaults:
            raise AttributeError(
                f"{self._label} has no setting {name!r}; its settings are {', '.join(self._defaults)}")
        object.__setattr__(self, name, self._check(name, value))

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not settings
        raise AttributeError(f"{self._label} has no setting {name!r}; its settings are {', '.join(self._defaults)}")

    def _check(self, name: str, value: Any) -> Any:
        raise NotImplementedError

    def _update(self, values: Mapping[str, Any]) -> None:
        for k, v in values.items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (groups as nested dicts)."""
        return {k: (v.to_dict() if isinstance(v, _Slotted) else v) for k, v in
                ((k, object.__getattribute__(self, k)) for k in self._defaults)}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.to_dict() == other.to_dict()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # mutable settings: not a cache key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


class _Group(_Slotted):
    __slots__ = ()

    def __init__(self) -> None:
        for k, v in self._defaults.items():
            setattr(self, k, v)


class Sharding(_Group):
    """ZeRO on the data-parallel axis: ``enable``, ``stage`` (1, 2, 3), ``degree`` (None: the
    whole data-parallel axis; a number must equal its size)."""

    __slots__ = ("enable", "stage", "degree")
    _label = "Strategy.sharding"
    _defaults = {"enable": False, "stage": 1, "degree": None}

    def _check(self, name: str, value: Any) -> Any:
        where = f"Strategy.sharding.{name}"
        if name == "enable":
            return _bool(where, value)
        if name == "stage":
            return _one_of(where, value, (1, 2, 3))
        return None if value is None else _int_at_least(where, value, 1)


class Pipeline(_Group):
    """Paddle's pipeline settings: ``enable``, ``micro_batch_size``, ``accumulate_steps``,
    ``schedule_mode`` (one of ``SCHEDULES``; the Engine cuts the stages where the forward's
    ``ap.shard_op`` meshes change and runs them with ``ap.pipeline.Pipeline``)."""

    __slots__ = ("enable", "micro_batch_size", "accumulate_steps", "schedule_mode")
    _label = "Strategy.pipeline"
    _defaults = {"enable": False, "micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B"}

    def _check(self, name: str, value: Any) -> Any:
        where = f"Strategy.pipeline.{name}"
        if name == "enable":
            return _bool(where, value)
        if name == "schedule_mode":
            return _schedule(where, value)
        return _int_at_least(where, value, 1)


def _schedule(where: str, value: Any) -> str:
    """The canonical name of a schedule the Engine runs (Paddle's names too: ``VPP``, ``ZBH1``)."""
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a schedule name, one of {SCHEDULES}, got {value!r}")
    try:
        canon = schedule_name(value)
    except ScheduleError:
        raise ValueError(f"{where} must be one of {SCHEDULES}, got {value!r}") from None
    if canon not in SCHEDULES:
        raise ValueError(f"{where}: {canon} places two chunks per stage mesh in a V, which the meshes a forward's "
                         "shard_op calls visit cannot express; run it with ap.pipeline.Pipeline and "
                         f"split_sequential(..., num_chunks=2, placement='v'), or choose one of {SCHEDULES}")
    return canon


class Amp(_Group):
    """Mixed precision: ``enable``, ``dtype`` ("bfloat16" or "float16") -> ``ap.MixedPrecision``;
    for float16 the loss is scaled (``ap.GradScaler``): ``init_loss_scaling`` (Paddle's default
    32768), ``use_dynamic_loss_scaling`` (grow and back off the scale; False: a fixed scale)."""

    __slots__ = ("enable", "dtype", "init_loss_scaling", "use_dynamic_loss_scaling")
    _label = "Strategy.amp"
    _defaults = {"enable": False, "dtype": "bfloat16", "init_loss_scaling": 32768.0, "use_dynamic_loss_scaling": True}

    def _check(self, name: str, value: Any) -> Any:
        where = f"Strategy.amp.{name}"
        if name in ("enable", "use_dynamic_loss_scaling"):
            return _bool(where, value)
        if name == "init_loss_scaling":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where} must be a number > 0, got {value!r}")
            return float(value)
        return _one_of(where, value, AMP_DTYPES)


class Recompute(_Group):
    """Activation recomputation: ``enable`` -> ``ap.recompute`` on the whole model."""

    __slots__ = ("enable",)
    _label = "Strategy.recompute"
    _defaults = {"enable": False}

    def _check(self, name: str, value: Any) -> Any:
        return _bool(f"Strategy.recompute.{name}", value)


class GradientMerge(_Group):
    """Gradient merge: ``enable``, ``k_steps`` (the optimizer steps once every ``k_steps`` runs
    with the mean of their gradients)."""

    __slots__ = ("enable", "k_steps")
    _label = "Strategy.gradient_merge"
    _defaults = {"enable": False, "k_steps": 1}

    def _check(self, name: str, value: Any) -> Any:
        where = f"Strategy.gradient_merge.{name}"
        return _bool(where, value) if name == "enable" else _int_at_least(where, value, 1)


_GROUPS: dict[str, type[_Group]] = {
    "sharding": Sharding, "pipeline": Pipeline, "amp": Amp, "recompute": Recompute, "gradient_merge": GradientMerge,
}


class Strategy(_Slotted):
    """How ``ap.to_static`` runs a step, and what ``ap.Engine`` applies.

    For ``ap.to_static``:

    - ``accumulate_steps``: gradient merge (Paddle's name): gradients of this many calls are
      summed, divided by ``accumulate_steps`` and stepped once, on the last call of each group
      (equal micro-batches of a mean loss: the step of the whole batch).
    - ``bucket_bytes``: the gradient bucket size of a ``shard_optimizer`` optimizer (its
      reductions are part of the captured program), and the most bytes two all-reduces of the
      program may carry once merged into one (``overlap``); None keeps the optimizer's bucket
      size and merges up to ``passes.MERGE_BYTES`` (1 MiB).
    - ``compile``: None replays the captured program as it is; ``"inductor"`` compiles it with
      ``torch.compile(backend="inductor")`` first (falls back to the plain program, with a
      warning, where compiling fails).
    - ``overlap``: each collective of the program starts as soon as its input exists
      (``passes.hoist_starts``: gradient buckets during the backward, ZeRO-3 all-gathers one
      unit ahead) and is waited for only where its result is first needed
      (``passes.sink_waits``), so compute overlaps the communication. A small value computed
      from the inputs by a few ops (a mean loss's token count) is reduced before the forward
      runs, and one only the outputs read (the loss's sum) is waited for last, so the step does
      not stop between its forward and its backward. All-reduces over the same
      group whose results are not needed before both inputs exist become one
      (``passes.merge_all_reduces``: one start instead of two; a loss's sum rides with the
      gradients), and a loss left Partial is then
      reduced inside the program when it can ride along one (it comes back Replicate). The
      values are the same either way (a merged sum may add an element's terms in another order
      on three or more ranks: the last bit of a float). Under a ZeRO-3 optimizer the stage's own ``overlap`` decides
      (``ShardingStage3(mesh, overlap=True)``): without it the program keeps eager's order, and so
      eager's peak memory.

    For ``ap.Engine`` (Paddle's groups, each an object with fixed settings):
    ``sharding`` (enable, stage, degree), ``pipeline`` (enable, micro_batch_size,
    accumulate_steps, schedule_mode), ``amp`` (enable, dtype, init_loss_scaling, use_dynamic_loss_scaling), ``recompute`` (enable),
    ``gradient_merge`` (enable, k_steps) and ``auto_mode`` ("semi"; "full": ``ap.auto_parallel`` chooses the layout).
    ``config``: Paddle's dict form, ``{"sharding": {"enable": True, "stage": 2}, "auto_mode": "semi"}``.
    """

    __slots__ = ("accumulate_steps", "bucket_bytes", "compile", "overlap", "auto_mode", *_GROUPS)
    _label = "Strategy"
    _defaults = {"accumulate_steps": 1, "bucket_bytes": None, "compile": None, "overlap": True, "auto_mode": "semi",
                 **{name: None for name in _GROUPS}}

    def __init__(self, config: Mapping[str, Any] | None = None, *, accumulate_steps: int = 1,
                 bucket_bytes: int | None = None, compile: str | None = None, overlap: bool = True,
                 auto_mode: str = "semi") -> None:
        for name, group in _GROUPS.items():
            object.__setattr__(self, name, group())
        self.accumulate_steps = accumulate_steps
        self.bucket_bytes = bucket_bytes
        self.compile = compile
        self.overlap = overlap
        self.auto_mode = auto_mode
        if config is not None:
            if not isinstance(config, Mapping):
                raise TypeError(f"Strategy: config must be a dict of settings, got {type(config).__name__}")
            for key, value in config.items():
                if key in _GROUPS and isinstance(value, Mapping):
                    getattr(self, key)._update(value)
                else:
                    setattr(self, key, value)

    def _check(self, name: str, value: Any) -> Any:
        if name in _GROUPS:
            raise AttributeError(f"Strategy.{name} is a group of settings: set its fields "
                                 f"(strategy.{name}.{next(iter(_GROUPS[name]._defaults))} = ...)")
        if name == "accumulate_steps":
            return _int_at_least("Strategy: accumulate_steps", value, 1)
        if name == "bucket_bytes":
            return None if value is None else _int_at_least("Strategy: bucket_bytes", value, 1)
        if name == "compile":
            return _one_of("Strategy: compile", value, COMPILERS)
        if name == "overlap":
            return _bool("Strategy: overlap", value)
        return _one_of("Strategy: auto_mode", value, AUTO_MODES)
