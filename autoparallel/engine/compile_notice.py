"""The notice that ``torch.compile`` over DistTensors compiles none of the distributed step.

Dynamo stops its graph before every DistTensor op (the library's packages run as they are:
``compat.run_as_is_under_dynamo``), so a compiled model runs each op eagerly — correct, and
slower than it looks. ``NOTICE`` says so once per process, at the first DistTensor op inside a
compiled call, pointing to the static step, whose program inductor does compile.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from autoparallel import compat

COMPILE_NOTICE = (
    "autoparallel: torch.compile runs every DistTensor op eagerly: Dynamo stops its graph before each "
    "one (the library's own code runs as it is), so none of the distributed step is compiled. To compile "
    "it, capture the step with ap.to_static(model, loss=..., optimizer=..., strategy=ap.Strategy("
    "compile=\"inductor\")): its program is plain tensors and collectives, which inductor compiles "
    "(docs/static.md)")


class _CompileNotice:
    """``COMPILE_NOTICE``, said once per process, at the first DistTensor op that runs inside a
    ``torch.compile``'d call (where Dynamo broke its graph: ``compat.in_compiled_call``).

    ``armed`` is the one bool every op reads: set when Dynamo starts compiling a frame
    (``compat.on_dynamo_compile``), so a process that never compiles looks no further. The
    library's own captures (``make_fx``) compile no frame; its inductor programs run no
    DistTensor op."""

    __slots__ = ("armed", "said")

    def __init__(self) -> None:
        self.armed = self.said = False

    def arm(self) -> None:
        self.armed = not self.said

    def check(self) -> None:
        if compat.in_compiled_call():
            self.armed, self.said = False, True
            warnings.warn(COMPILE_NOTICE, stacklevel=_caller_level())

    def forget(self) -> None:
        """Say it again at the next DistTensor op inside a compiled call."""
        self.armed, self.said = True, False


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside torch and this library (the user's call)."""
    frame, level = sys._getframe(2), 2  # (stacklevel 1 is ``check``, the caller of ``warnings.warn``)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_INSIDE = (os.path.dirname(torch.__file__) + os.sep, *(os.path.join(_ROOT, p) + os.sep for p in compat.LIBRARY_PACKAGES))
NOTICE = _CompileNotice()
compat.on_dynamo_compile(NOTICE.arm)


def forget_compile_notice() -> None:
    """Let ``torch.compile`` over DistTensors warn again (it warns once per process)."""
    NOTICE.forget()


__all__ = ["COMPILE_NOTICE", "NOTICE", "forget_compile_notice"]
