"""The world this process lives in: rank, world size, and lazy initialisation.

If the user already called ``torch.distributed.init_process_group`` we use that world. If not,
and torchrun's environment is present (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``), we initialise
from it: NCCL when CUDA is available, else gloo. Plain ``python`` with no such environment is a
world of one, and nothing is initialised.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

# Imported before the world we initialise exists, on purpose (~3 ms). torch's
# ``torch.distributed.nn.functional`` takes ``group=group.WORLD`` as a default argument of ten
# functions; imported after ``init_process_group`` (torch imports it lazily, through
# ``torch._dynamo``, on the first fake-tensor op our decisions run), those defaults keep the
# world's ``ProcessGroup`` for the life of the process, so destroying it cannot free it: gloo's
# worker threads outlive the interpreter's finalisation, and one of them dropping a finished
# collective's tensors after that (it must take the GIL) aborts the process ("terminate called
# without an active exception", a few runs in a hundred; pytorch/pytorch#190489 is the same
# crash). Imported first, the defaults are None. docs/operations.md, "Clean exits".
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401

from autoparallel.log import logger

_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_VAR = "AUTOPARALLEL_TIMEOUT"


def collective_timeout() -> datetime.timedelta | None:
    """Timeout of every collective of a world we initialise: ``AUTOPARALLEL_TIMEOUT`` seconds.

    Unset: torch's default. A rank that died or hangs then makes the others raise after this
    long instead of waiting forever.
    """
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_VAR}={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def collective_timeout_s() -> str:
    """The timeout in force, for error messages."""
    t = collective_timeout()
    return f"{TIMEOUT_VAR}={t.total_seconds():g}s" if t else f"torch's default; set {TIMEOUT_VAR} to shorten it"


def torchrun_env_present() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def world_available() -> bool:
    """True when a world exists or can be made from the environment (no side effects)."""
    return dist.is_available() and (dist.is_initialized() or torchrun_env_present())


def ensure_world() -> None:
    """Initialise the default process group from torchrun's environment if needed."""
    if not dist.is_available() or dist.is_initialized():
        return
    if torchrun_env_present():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=collective_timeout())
        _initialised_here[:] = [dist.group.WORLD]
        atexit.register(_destroy_at_exit)
        logger.debug("world: initialised a %s world of %d ranks from torchrun's environment",
                     backend, dist.get_world_size())


# The default group this module initialised (empty: none, or the user's own)
_initialised_here: list[object] = []


def _destroy_at_exit() -> None:
    """Destroy the default group this module made, if it is still the default one, as the
    interpreter exits: left to the interpreter's teardown, gloo's worker threads can be torn
    down mid-flight and abort the process ("terminate called without an active exception")."""
    if initialised_here():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (exiting anyway: nothing to report it to)
            pass
        forget()


def initialised_here() -> bool:
    """Whether the current default group is the one this module initialised (not the user's)."""
    return bool(_initialised_here) and dist.is_initialized() and dist.group.WORLD is _initialised_here[0]


_rank_cache: dict[object, int] = {}


def get_rank() -> int:
    """This process's rank in the default world (0 in a world of one)."""
    if dist.is_available() and dist.is_initialized():
        world = dist.GroupMember.WORLD
        rank = _rank_cache.get(world)
        if rank is None:
            _rank_cache.clear()
            rank = _rank_cache[world] = dist.get_rank()
        return rank
    ensure_world()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def forget() -> None:
    """Drop what is cached about the current world (it is being destroyed)."""
    _rank_cache.clear()
    _initialised_here.clear()


def get_world_size() -> int:
    ensure_world()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def backend() -> str:
    ensure_world()
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "none"


def default_device() -> torch.device:
    """Device the local shards live on: the current CUDA device under NCCL, else CPU."""
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
