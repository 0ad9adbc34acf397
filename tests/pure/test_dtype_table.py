"""docs/dtypes.md holds the dtype x collective table that ``autoparallel.runtime.comm`` implements."""

from __future__ import annotations

import pytest
import torch

from autoparallel.runtime import comm
from tests.dtypes_table import COLUMNS, DTYPES, REDUCES, cell, in_doc, render


def test_doc_table_is_what_comm_does() -> None:
    assert in_doc() == render(), "docs/dtypes.md is stale: run python -m tests.dtypes_table --write"


def test_the_dtypes_the_issue_names_are_exact_for_data_movement() -> None:
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2):
        assert all(cell(dtype, c) != "refused" for c in COLUMNS if c not in REDUCES), dtype
        assert all(cell(dtype, c) != "refused" for c in ("sum", "max", "min")), dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_refusals_name_dtype_and_reduce_type(dtype: torch.dtype) -> None:
    for t in REDUCES:
        why = comm.reduce_refusal(dtype, t)
        if why is not None:
            assert str(dtype) in why and repr(t) in why, why
            with pytest.raises(ValueError, match=str(dtype)):
                comm.reduction_carry(dtype, t)


def test_integer_and_bool_avg_are_refused() -> None:
    for dtype in (torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint64):
        assert "not an integer" in (comm.reduce_refusal(dtype, "avg") or "")
