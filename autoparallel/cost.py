"""Bytes each rank sends and receives for one collective — the one formula for planner and meter.

The model is the bandwidth-optimal algorithm for each collective: ring all-reduce and
reduce-scatter, direct exchange for all-gather and all-to-all (and for a reduce-scatter onto
uneven pieces, which ``comm`` does as an all-to-all of the exact pieces). The planner prices its steps
with these functions and ``CommDebugMode`` records what ``autoparallel.runtime.comm`` issued with the
same ones, so tests can check that a plan moved exactly what it promised.
"""

from __future__ import annotations

from collections.abc import Sequence


def all_gather_bytes(piece_bytes: Sequence[int], me: int) -> tuple[int, int]:
    """(sent, received) by member ``me`` when every member's piece goes to all the others."""
    n = len(piece_bytes)
    return (n - 1) * piece_bytes[me], sum(piece_bytes) - piece_bytes[me]


def reduce_scatter_bytes(padded_piece_bytes: int, n: int) -> tuple[int, int]:
    """Ring reduce-scatter of ``n`` equal (padded) pieces."""
    b = (n - 1) * padded_piece_bytes
    return b, b


def pieces_reduce_scatter_bytes(piece_bytes: Sequence[int], me: int) -> tuple[int, int]:
    """Reduce-scatter onto the members' exact pieces (ring on even pieces, an all-to-all and a
    local reduction on uneven ones): member ``me`` sends its summand of every other piece and
    receives ``n - 1`` summands of its own."""
    n = len(piece_bytes)
    return sum(piece_bytes) - piece_bytes[me], (n - 1) * piece_bytes[me]


def all_reduce_bytes(total_bytes: int, n: int) -> tuple[int, int]:
    """Ring all-reduce: a reduce-scatter then an all-gather of ``total/n`` pieces."""
    b = 2 * (n - 1) * total_bytes // n if n > 1 else 0
    return b, b


def broadcast_bytes(total_bytes: int, n: int, is_src: bool) -> tuple[int, int]:
    """Direct broadcast: the source sends the tensor to the ``n - 1`` others, each receives it."""
    return ((n - 1) * total_bytes, 0) if is_src else (0, total_bytes)


def all_to_all_bytes(send_bytes: Sequence[int], recv_bytes: Sequence[int], me: int) -> tuple[int, int]:
    """Member ``me`` sends ``send_bytes[j]`` to j and receives ``recv_bytes[i]`` from i."""
    return sum(send_bytes) - send_bytes[me], sum(recv_bytes) - recv_bytes[me]
