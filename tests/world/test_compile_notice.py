"""``torch.compile`` of a model on DistTensors says once that it runs their ops eagerly.

2 gloo ranks: a tensor-parallel two-Linear model (column- then row-parallel) trained 3 SGD
steps under ``torch.compile(model, backend="eager")`` (Dynamo only: no inductor) equals the same
model in one process, and the steps warn exactly once, pointing to ``ap.to_static(...,
strategy=ap.Strategy(compile="inductor"))``. Neither eager steps nor ``ap.to_static`` steps
(``make_fx``, no Dynamo) warn, even once a compile has started in the process.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.engine.dtensor import COMPILE_NOTICE, forget_compile_notice

POINTER = 'ap.to_static(model, loss=..., optimizer=..., strategy=ap.Strategy(compile="inductor"))'


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "torch.compile" in str(w.message)]


def _compiled(rank: int) -> dict[str, Any]:
    """(the notices said by eager, static and compiled steps; compiled losses and parameters next
    to one process's)."""
    import torch._dynamo

    mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
    model = _model()
    ref = copy.deepcopy(model)
    ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    lay = [ap.Replicate()]
    forget_compile_notice()  # (as if a compile had started: every op looks, none is in a compiled call)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = _batches(1)[0]
        static = ap.to_static(copy.deepcopy(model), loss=F.mse_loss)  # eval: a loss, no optimizer
        static(ap.shard_tensor(x, mesh, lay), ap.shard_tensor(y, mesh, lay))
        F.mse_loss(model(ap.shard_tensor(x, mesh, lay)), ap.shard_tensor(y, mesh, lay)).detach()
        out["eager_and_static"] = _said(caught)
        caught.clear()
        compiled = torch.compile(model, backend="eager")
        losses = []
        try:
            for x, y in _batches(3):
                loss = F.mse_loss(compiled(ap.shard_tensor(x, mesh, lay)), ap.shard_tensor(y, mesh, lay))
                loss.backward()
                opt.step()
                opt.zero_grad()
                want = F.mse_loss(ref(x), y)
                want.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append((loss.full_tensor().item(), want.item()))
        finally:
            torch._dynamo.reset()
        out["compiled"] = _said(caught)
        out["where"] = [w.filename for w in caught if "torch.compile" in str(w.message)]
    out["losses"] = losses
    out["params"] = [(p.full_tensor(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())]
    return out


def test_torch_compile_over_dist_tensors_warns_once_and_trains_as_one_process(world2: Any) -> None:  # type: ignore[no-untyped-def]
    assert POINTER in COMPILE_NOTICE
    for res in world2.run(_compiled, timeout=300):
        assert res["eager_and_static"] == [], res["eager_and_static"]
        assert res["compiled"] == [COMPILE_NOTICE], res["compiled"]
        assert res["where"] == [__file__], res["where"]  # the user's call, not the library's frame
        for got, want in res["losses"]:
            assert abs(got - want) <= 1e-5 * abs(want), res["losses"]
        for a, b in res["params"]:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
