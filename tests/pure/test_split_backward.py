"""A stage's backward split into B (input gradient) and W (weight gradients), on one process.

``input_grad`` then ``weight_grads`` must give what one ``backward`` gives, bitwise: the input's
gradient, and every parameter's gradient accumulated over micro-batches — for a plain MLP with a
LayerNorm, a weight used twice and in a scale that does not touch the input, a scalar loss, and a
first stage whose input needs no gradient (everything then runs in W); with the forward's saved
tensors in slots B empties (what only B reads), as the pipeline runs it, and without.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from autoparallel.pipeline import ActivationMeter
from autoparallel.pipeline.split_backward import SavedByForward, input_grad, weight_grads
from autoparallel.static.split import SplitError, split_input_weight


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(torch.tanh(self.lin(x)))) * self.lin.weight.sum()


MODELS = {
    "mlp": lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8)),
    "tied": Tied,
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("loss", [False, True], ids=["grad-out", "scalar-loss"])
@pytest.mark.parametrize("has_input", [True, False], ids=["input", "first-stage"])
@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
def test_b_then_w_equals_one_backward_bitwise(model: str, loss: bool, has_input: bool, release: bool) -> None:
    torch.manual_seed(0)
    split, whole = MODELS[model](), None
    whole = copy.deepcopy(split)
    pending = []
    for _ in range(3):  # three micro-batches: W runs after every B, gradients accumulate
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        xs = x.clone().requires_grad_(has_input)
        saved = SavedByForward() if release else None
        with saved.track() if saved is not None else contextlib.nullcontext():
            y = split(xs)
        out, g_out = ((y * g).sum(), None) if loss else (y, g)
        gx, work = input_grad(out, g_out, xs if has_input else None, list(split.parameters()), saved)
        pending.append(work)
        xw = x.clone().requires_grad_(has_input)
        yw = whole(xw)
        (yw * g).sum().backward() if loss else yw.backward(g)
        if has_input:
            assert torch.equal(gx, xw.grad)
        else:
            assert gx is None
    assert all(p.grad is None for p in split.parameters())  # B adds nothing to .grad
    for work in pending:
        weight_grads(work)
    for (name, a), b in zip(split.named_parameters(), whole.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_b_releases_what_only_it_reads() -> None:
    """After B a micro-batch keeps what W reads: the Linears' inputs and the LayerNorm's saves,
    not the GELU's input (its only reader runs in B), nor the loss's operand; W then frees all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    meter = ActivationMeter(exclude=list(model.parameters()))
    saved = SavedByForward(meter)
    with saved.track():
        h = model[0](x)
        y = model[3](model[2](model[1](h)))
        loss = y.square().mean()
    full = meter.current
    _, work = input_grad(loss, None, x, list(model.parameters()), saved)
    assert full - meter.current == h.numel() * 4 + y.numel() * 4  # the GELU's input, square's input
    weight_grads(work)
    del work, loss, y, h
    assert meter.current == 0


def test_program_split_keeps_every_op_once_and_refuses_in_place_writes() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(8, 8)

    def backward(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ w)
        gh = g * (1 - h * h)
        return x.t() @ gh, gh @ w.t()  # (weight gradient, input gradient last)

    gm = make_fx(backward)(torch.randn(4, 8), torch.randn(4, 8))
    cut = split_input_weight(gm)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    g_in, *carry = cut.input_grad(x, g)
    (g_w,) = cut.weight_grads(*carry)
    want_w, want_in = backward(x, g)
    assert torch.equal(g_in, want_in) and torch.equal(g_w, want_w)
    calls = lambda m: [n for n in m.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert len(calls(cut.input_grad)) + len(calls(cut.weight_grads)) == len(calls(gm))
    mms = lambda m: sum(n.target is torch.ops.aten.mm.default for n in calls(m))  # noqa: E731
    assert (mms(cut.input_grad), mms(cut.weight_grads)) == (2, 1)  # x @ w and gh @ w.t() in B; x.t() @ gh in W

    def writes(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros(8, 8)
        acc.add_(x.t() @ g)
        return acc, g @ w.t()

    with pytest.raises(SplitError, match=r"writes a tensor in place"):
        split_input_weight(make_fx(writes)(torch.randn(4, 8), torch.randn(4, 8)))
