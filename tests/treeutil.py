"""Helpers shared by the pure rule tests: walking nested arguments, one intra-op thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with every tensor in nested lists/tuples/dicts replaced by ``fn(tensor)``."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(i, fn) for i in x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in nested ``x``, in argument order."""
    out: list[torch.Tensor] = []
    map_tensors(x, out.append)
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny brute-force ops: intra-op threads only contend on a loaded machine. Import to use."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
