"""``runtime.agree.checksum``: the value checksum ranks compare, for any layout of a tensor."""

from __future__ import annotations

import pytest
import torch

from autoparallel.runtime import agree


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(0.5).expand(1),          # one element of stride 0 (torch.quantile's q)
    lambda: torch.tensor([0.5]).expand(3),        # a broadcast row
    lambda: torch.arange(12.0).view(3, 4).t(),    # transposed
    lambda: torch.arange(12.0)[::2],              # strided
    lambda: torch.zeros(0, 3),                    # empty
])
def test_a_tensor_s_checksum_is_its_values_checksum_whatever_its_strides(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    assert agree.checksum(t) == agree.checksum(t.contiguous().clone())
    assert agree.checksum(t, sample=True) == agree.checksum(t.contiguous().clone(), sample=True)


def test_different_values_have_different_checksums() -> None:
    assert agree.checksum(torch.tensor([1.0, 2.0])) != agree.checksum(torch.tensor([2.0, 1.0]))
