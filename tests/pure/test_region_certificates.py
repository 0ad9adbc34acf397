"""Symbolic certificates (autoparallel.regions.symbolic): a family's model vouched for by the
shape guards of one fake run. The property that makes them sound: wherever a certificate holds
and the model admits the length, the real run is the one the recorder would have admitted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.regions.generic import Model, Proof, Recorder, point_of
from autoparallel.regions.symbolic import Certificate, certify

pytestmark = pytest.mark.pure


class Block(nn.Module):
    """A transformer-like block over (B, t, 8): attention over t and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.qkv, self.fc = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 2, 12).transpose(1, 2).split(4, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + a.transpose(1, 2).reshape(b, t, 8)
        return h + F.gelu(self.fc(h))[..., :8]


class Threshold(Block):
    """Past 20 tokens it adds a tanh: Python branches on the length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return torch.tanh(y) if x.shape[1] > 20 else y


class Parity(Block):
    """Doubles on lengths divisible by 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if x.shape[1] % 4 == 0 else y


class Halves(Block):
    """Keeps the first half of the tokens: a size ``t // 2``, on no line of ``t``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, : x.shape[1] // 2]


class Positive(Block):
    """Keeps the positive entries: a size only the data decides."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[y > 0]


def _input(t: int) -> torch.Tensor:
    return torch.randn(2, t, 8, generator=torch.Generator().manual_seed(t))


def _record(module: nn.Module, t: int) -> Any:
    x = _input(t)
    rec = Recorder()
    with rec:
        module(x)
    return rec.record


def _model(module: nn.Module, ta: int, tb: int) -> Model:
    model = Model(*[Proof(point_of((_input(t),)), _record(module, t), verdict=None) for t in (ta, tb)])
    assert model.build() is None
    return model


def _certify(module: nn.Module, model: Model, t: int) -> Certificate | str:
    names = [n for n, _ in module.named_parameters()]
    slots = [(p, p.requires_grad) for _, p in module.named_parameters()]

    def run(args: list[Any], fakes: list[torch.Tensor]) -> Any:
        return torch.func.functional_call(module, dict(zip(names, fakes)), tuple(args))

    sizes = [tuple(_input(model.ta).shape)], [tuple(_input(model.tb).shape)]
    return certify(model, [_input(t)], *sizes, [False], slots, run)


def _sound(module: nn.Module, model: Model, cert: Certificate, lengths: range) -> list[int]:
    """The lengths the certificate answers; at each, the real run is the model's."""
    answered = []
    for t in lengths:
        if model.admits_point(point_of((_input(t),))) != t or model.refusal_at(t) is not None:
            continue
        if cert.holds([_input(t)]):
            assert model.admits_record(_record(module, t), t) is None, t
            answered.append(t)
    return answered


def test_a_block_is_certified_at_every_admitted_length() -> None:
    torch.manual_seed(0)
    block = Block()
    model = _model(block, 5, 7)
    cert = _certify(block, model, 9)
    assert isinstance(cert, Certificate), cert
    answered = _sound(block, model, cert, range(2, 70))
    admitted = [t for t in range(2, 70) if model.admits_point(point_of((_input(t),))) == t and model.refusal_at(t) is None]
    assert answered == admitted and len(answered) > 50


@pytest.mark.parametrize("cls, inside, outside", [(Threshold, [9, 20], [21, 40]), (Parity, [6, 10, 30], [8, 12, 32])])
def test_a_branch_on_the_length_is_a_guard(cls: Any, inside: list[int], outside: list[int]) -> None:
    torch.manual_seed(0)
    module = cls()
    model = _model(module, 5, 7)
    cert = _certify(module, model, 9)
    assert isinstance(cert, Certificate), cert
    assert all(cert.holds([_input(t)]) for t in inside)
    assert not any(cert.holds([_input(t)]) for t in outside)  # there the real run differs
    assert all(model.admits_record(_record(module, t), t) is not None for t in outside)
    _sound(module, model, cert, range(2, 70))


def test_a_size_off_every_line_has_no_certificate() -> None:
    torch.manual_seed(0)
    module = Halves()
    model = _model(module, 7, 11)  # t // 2 is 3 and 5: a line of slope 1/2 through them
    assert model.refusal_at(9) is None
    reason = _certify(module, model, 9)
    assert isinstance(reason, str) and "not affine" in reason, reason


def test_data_dependent_code_has_no_certificate() -> None:
    torch.manual_seed(0)
    module = Positive()
    rec_a, rec_b = _record(module, 5), _record(module, 7)
    proofs = [Proof(point_of((_input(t),)), r, verdict=None) for t, r in ((5, rec_a), (7, rec_b))]
    model = Model(*proofs)
    assert model.build() is None, "the counts of positive entries are off a line: choose other lengths"
    reason = _certify(module, model, 9)
    assert isinstance(reason, str) and "depends on the data" in reason, reason


def test_a_run_that_differs_from_the_model_has_no_certificate() -> None:
    torch.manual_seed(0)
    module = Threshold()
    model = _model(module, 5, 7)
    reason = _certify(module, model, 25)  # past 20 the fake run issues a tanh the model lacks
    assert reason == "its fake run issues other aten calls"


def test_non_contiguous_inputs_are_not_answered() -> None:
    torch.manual_seed(0)
    block = Block()
    model = _model(block, 5, 7)
    cert = _certify(block, model, 9)
    assert isinstance(cert, Certificate)
    assert cert.holds([_input(11)])
    assert not cert.holds([_input(11).transpose(0, 1).contiguous().transpose(0, 1)])


class Rotary(nn.Module):
    """Indexes with whole slices (``ids[:, None, :]``), as transformers' rotary embeddings do:
    torch skips them on real sizes and dispatches them on symbolic ones."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[1])[None, :].expand(x.shape[0], -1)
        freqs = self.inv[None, :, None].float() @ ids[:, None, :].float()
        return x * freqs.transpose(1, 2).repeat(1, 1, 2).cos()


def test_whole_slices_of_symbolic_sizes_are_left_out() -> None:
    module = Rotary()
    model = _model(module, 5, 7)
    names = [n for n, _ in module.named_buffers()]
    slots = [(b, False) for _, b in module.named_buffers()]

    def run(args: list[Any], fakes: list[torch.Tensor]) -> Any:
        return torch.func.functional_call(module, dict(zip(names, fakes)), tuple(args))

    cert = certify(model, [_input(9)], [tuple(_input(5).shape)], [tuple(_input(7).shape)], [False], slots, run)
    assert isinstance(cert, Certificate), cert
    _sound(module, model, cert, range(2, 40))
