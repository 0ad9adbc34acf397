"""``ap.clip_grad_norm_`` without a world: plain parameters are clipped as torch clips them, and
bad arguments raise before anything is computed. (Pipelines, where it differs from torch's:
tests/world/test_pipeline.py and tests/models/test_hf_llama.py.)"""

from __future__ import annotations

import pytest
import torch

import autoparallel as ap


def _with_grads(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_plain_parameters_are_clipped_as_torch_clips_them(norm_type: float) -> None:
    ours, theirs = _with_grads(0), _with_grads(0)
    got = ap.clip_grad_norm_(ours.parameters(), 0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
    assert float(want) > 0.1 and torch.equal(got, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_copies_are_scaled_but_not_counted() -> None:
    model = _with_grads(1)
    copy_ = torch.nn.Parameter(model[0].weight.detach().clone())
    copy_.grad = model[0].weight.grad.clone()
    before = _with_grads(1)
    got = ap.clip_grad_norm_(model.parameters(), 0.1, copies=[copy_])
    assert torch.equal(got, torch.nn.utils.clip_grad_norm_(before.parameters(), 0.1))
    assert torch.equal(copy_.grad, model[0].weight.grad)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_norm": -1.0}, ValueError, "max_norm must be a number >= 0"),
    ({"max_norm": "1"}, ValueError, "max_norm must be a number >= 0"),
    ({"max_norm": 1.0, "norm_type": 0}, ValueError, "norm_type must be a number > 0"),
])
def test_bad_arguments_raise(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ap.clip_grad_norm_(_with_grads(2).parameters(), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be tensors"):
        ap.clip_grad_norm_([1.0], 1.0)  # type: ignore[list-item]
