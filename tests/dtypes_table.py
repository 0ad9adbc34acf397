"""The dtype x collective table of docs/dtypes.md, rendered from ``autoparallel.runtime.comm``.

``python -m tests.dtypes_table`` prints it; ``--write`` puts it into docs/dtypes.md between the
markers. ``tests/pure/test_dtype_table.py`` checks the file holds exactly this table and
``tests/world/test_dtypes.py`` checks every cell on a gloo world (exact: equal to the
single-device reference bit for bit; refused: the same ``ValueError`` on every rank).
"""

from __future__ import annotations

import os
import sys

import torch

from autoparallel.runtime import comm

DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
    torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
)
MOVES = ("all_gather", "all_to_all", "broadcast", "send_recv")  # data movement
REDUCES = ("sum", "avg", "max", "min")  # all_reduce, reduce_scatter, and reshards of Partial
COLUMNS = MOVES + REDUCES
BEGIN, END = "<!-- dtype table: begin (python -m tests.dtypes_table --write) -->", "<!-- dtype table: end -->"
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "dtypes.md")


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cell(dtype: torch.dtype, column: str) -> str:
    """``refused``, or how the values travel exactly (``native``, ``bytes``, ``int32``...)."""
    if column in MOVES:
        return "native" if dtype in comm.NATIVE else "bytes"
    if comm.reduce_refusal(dtype, column) is not None:
        return "refused"
    c = comm.reduction_carry(dtype, column)
    if c.how == "native":
        return "native"
    wire = name(c.wire)
    return {"view": f"{wire} view", "flip": f"{wire} flip", "ordered": f"{wire} ordered"}.get(c.how, wire) + ("" if c.op == column or column == "avg" else f" {c.op}")


def is_exact(dtype: torch.dtype, column: str) -> bool:
    return cell(dtype, column) != "refused"


def render() -> str:
    head = "| dtype | " + " | ".join(COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [f"| {name(d)} | " + " | ".join(cell(d, c) for c in COLUMNS) + " |" for d in DTYPES]
    return "\n".join([BEGIN, head, rule, *rows, END])


def _read() -> str:
    with open(DOC) as f:
        return f.read()


def in_doc() -> str:
    text = _read()
    return text[text.index(BEGIN): text.index(END) + len(END)]


if __name__ == "__main__":
    if "--write" in sys.argv:
        text = _read().replace(in_doc(), render())
        with open(DOC, "w") as f:
            f.write(text)
    else:
        print(render())
