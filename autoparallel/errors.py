"""One clear message per user error in a multi-process run.

Under ``torchrun`` every rank runs the same script, so a configuration error (a mesh that does
not fit the world, a bad placement) is raised on every rank — by design, the same ``ValueError``
or ``TypeError`` everywhere before any collective. Printed by every rank, with a traceback
each and torchrun's report after them, the one-line cause drowns in ~80 lines. This hook,
installed by ``import autoparallel`` in a world of more than one process (``WORLD_SIZE`` > 1;
not under ``AUTOPARALLEL_DEBUG=1``), prints an uncaught ``ValueError``/``TypeError`` once: on the
lowest rank that raised it (ranks tell each other through the launcher's store; a rank whose
lower ranks did not raise the same message within a moment prints it itself), as one line
without the traceback. Every rank still exits non-zero. Any other exception, and everything
under ``AUTOPARALLEL_DEBUG=1``, goes to the previous hook (full tracebacks, every rank).
"""

from __future__ import annotations

import datetime
import os
import sys
from types import TracebackType
from typing import Any

DEBUG_VAR = "AUTOPARALLEL_DEBUG"
GRACE_S = 2.0  # how long a rank waits to learn whether a lower rank raised the same error
_KEY = "autoparallel/user_error/"
_installed: list[Any] = []  # the previous hook, once installed


def install() -> None:
    """Install the hook (once) when this is a multi-process run and debugging is off."""
    if _installed or os.environ.get(DEBUG_VAR, "") not in ("", "0"):
        return
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
    except ValueError:
        return
    _installed.append(sys.excepthook)
    sys.excepthook = _hook


def _hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    previous = _installed[0] if _installed else sys.__excepthook__
    if not issubclass(kind, (ValueError, TypeError)) or os.environ.get(DEBUG_VAR, "") not in ("", "0"):
        previous(kind, exc, tb)
        return
    rank = int(os.environ.get("RANK", "0"))
    message = f"{kind.__name__}: {exc}"
    try:
        first = _lowest_reporter(rank, message)
    except Exception:  # noqa: BLE001  (no store to ask: say it here rather than nowhere)
        first = True
    if first:
        print(f"autoparallel: rank {rank}: {message}\n"
              f"  (the same error on every rank that raised it; {DEBUG_VAR}=1 shows each rank's traceback)",
              file=sys.stderr, flush=True)


def _lowest_reporter(rank: int, message: str) -> bool:
    """Whether no lower rank raised ``message`` (it then prints); this rank's message is posted
    for the higher ranks."""
    store = _store()
    if store is None:
        return rank == 0
    prefix = _KEY + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"
    store.set(prefix + str(rank), message)
    if rank == 0:
        return True
    import time

    deadline = time.monotonic() + GRACE_S
    for lower in range(rank):
        key = prefix + str(lower)
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                if not store.check([key]):
                    continue
            else:
                store.wait([key], datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001, S112  (a store timeout: that rank did not raise)
            continue
        if store.get(key).decode(errors="replace") == message:
            return False
    return True


def _store() -> Any:
    """The world's store: the default group's, else a client of the launcher's (torchrun)."""
    import torch

    dist = torch.distributed  # read, as autoparallel.mesh reads the world: this module sits below the runtime
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001, S110  (private API: fall back to the launcher's store)
            pass
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=GRACE_S),
                         wait_for_workers=False)
