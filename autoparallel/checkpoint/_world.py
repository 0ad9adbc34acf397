"""The checkpoint's control messages between ranks (small picklable metadata, never tensors).

``exchange`` is an all-gather of one object per rank over the default world; it is how every
rank learns every other rank's plan inputs and outcome, so all ranks take the same decision
(commit or not, raise or not) after it. A rank that died or hangs makes the others fail here
with a ``CheckpointError`` within the process group's timeout (``AUTOPARALLEL_TIMEOUT``) instead
of waiting forever. In a world of one, nothing is sent.
"""

from __future__ import annotations

from typing import Any

from autoparallel import runtime
from autoparallel.checkpoint.metadata import CheckpointError
from autoparallel.runtime import comm


def world_size() -> int:
    return runtime.get_world_size()


def exchange(obj: Any, where: str, phase: str) -> list[Any]:
    """Every rank's ``obj`` in rank order (all ranks must call it in the same phase)."""
    if runtime.get_world_size() == 1:
        return [obj]
    try:
        out = comm.all_gather_object(obj)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError or DistError subtypes
        raise CheckpointError(
            f"{where}: rank {runtime.get_rank()} lost contact with the other ranks while {phase} "
            f"(a rank died, hung, or is not calling {where}; collective timeout "
            f"{runtime.collective_timeout_s()}): {type(e).__name__}: {e}") from e
    return out


def error_of(e: BaseException) -> tuple[str, str]:
    """``(kind, message)`` of an error a rank reports: ``"type"`` (a TypeError), ``"value"`` (the
    state dict does not fit) or ``"io"``."""
    kind = "type" if isinstance(e, TypeError) else "value" if isinstance(e, ValueError) else "io"
    return kind, str(e) if kind != "io" else f"{type(e).__name__}: {e}"


def agree(errors: list[tuple[str, str]], where: str, phase: str) -> None:
    """Raise on every rank if any rank reported an error.

    ``errors`` holds this rank's ``(kind, message)`` pairs; kind ``"value"`` (the state dict does
    not fit) raises ValueError, anything else CheckpointError. Messages are deduplicated and the
    ranks reporting each are named.
    """
    raise_gathered(exchange(errors, where, phase), where)


def raise_gathered(everyone: list[list[tuple[str, str]]], where: str) -> None:
    """``agree`` for errors already gathered from every rank (rank order)."""
    by_msg: dict[tuple[str, str], list[int]] = {}
    for rank, errs in enumerate(everyone):
        for e in errs:
            by_msg.setdefault(tuple(e), []).append(rank)  # type: ignore[arg-type]
    if not by_msg:
        return
    n = len(everyone)
    lines = [msg.removeprefix(f"{where}: ") for _, msg in by_msg]  # (an error of ours already names the call)
    lines = [m if len(ranks) == n else f"[rank(s) {ranks}] {m}" for m, ranks in zip(lines, by_msg.values())]
    text = f"{where}: {lines[0]}" if len(lines) == 1 else f"{where}:\n  " + "\n  ".join(lines[:12])
    if len(lines) > 12:
        text += f"\n  ... and {len(lines) - 12} more"
    kinds = {kind for kind, _ in by_msg}
    if kinds == {"type"}:
        raise TypeError(text)
    if kinds & {"value", "type"}:
        raise ValueError(text)
    raise CheckpointError(text)
