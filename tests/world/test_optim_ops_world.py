"""World part of ``tests/pure/test_optim_ops.py``: torch.optim on DistTensors.

World (4 gloo ranks): unmodified ``torch.optim`` SGD (momentum + weight decay), Adam and
AdamW — default, ``foreach=False``, ``foreach=True`` and ``fused=True`` — take 3 steps on
DistTensor parameters whose gradients have other layouts (Partial included) on a 4-rank and a
2x2 mesh, match plain torch, keep the parameters' layouts and emit no fallback warning.
``clip_grad_norm_`` gives the global norm.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

import autoparallel as ap
from autoparallel.engine import dispatch
from tests.layouts import make_dist
from tests.pure.test_optim_ops import S0, S1, P, R


# ---- world: unmodified torch.optim optimizers on DistTensors -----------------------------------
def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


# (shape, param placements, grad placements) per mesh; 7 rows over 4 ranks is uneven
LAYOUTS = {
    1: [((6, 5), (S0,), (P,)), ((5,), (R,), (P,)), ((4, 7), (S1,), (S0,)), ((7, 3), (S0,), (R,)), ((3, 4), (R,), (S1,))],
    2: [((6, 5), (S0, R), (P, P)), ((5,), (R, R), (P, R)), ((4, 7), (R, S1), (S0, P)), ((7, 3), (S0, S1), (R, R)),
        ((3, 4), (R, R), (S1, S0))],
}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
}
MODES: list[dict[str, Any]] = [{}, {"foreach": False}, {"foreach": True}, {"fused": True}]


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "autoparallel" in str(w.message)]


def _optimizer_run(rank: int, name: str, mode: dict[str, Any], mesh_ndim: int) -> list[str]:
    mesh = _mesh1() if mesh_ndim == 1 else _mesh2()
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(0)
    layouts = LAYOUTS[mesh_ndim]
    full = [torch.randn(sh) for sh, _, _ in layouts]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    params = [ap.shard_tensor(torch.nn.Parameter(t.clone()), mesh, list(pl)) for t, (_, pl, _) in zip(full, layouts)]
    opt, ref_opt = cls(params, **kw, **mode), cls(ref, **kw, **mode)
    for _ in range(3):
        grads = [torch.randn(sh) for sh, _, _ in layouts]
        for p, q, g, (_, _, gpl) in zip(params, ref, grads, layouts):
            p.grad = make_dist(g, mesh, gpl)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, q, (_, pl, _) in zip(params, ref, layouts):
        assert isinstance(p, ap.DistTensor) and tuple(p.placements) == pl, (p.placements, pl)
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {mode} mesh{mesh_ndim} {pl}: {m}")
    return []


def _optimizers(rank: int) -> list[str]:
    """Every optimizer x mode x mesh; returns the fallback warnings seen (must be none)."""
    dispatch.clear_cache()  # decisions and warnings: this test counts the warnings
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in OPTIMIZERS:
            for mode in MODES:
                if name == "adam_amsgrad" and mode.get("fused"):
                    continue
                for nd in (1, 2):
                    _optimizer_run(rank, name, mode, nd)
    seen += _fallback_warnings(caught)
    return seen


def test_torch_optimizers_step_dist_tensors(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_optimizers, timeout=300):
        assert warned == [], warned


def _clip(rank: int) -> dict[str, Any]:
    """``clip_grad_norm_`` with foreach=True: the global norm; which ops (not ours) fell back."""
    dispatch.clear_cache()  # decisions and warnings: this test counts the warnings
    mesh = _mesh2()
    torch.manual_seed(3)
    layouts = LAYOUTS[2]
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for norm_type in (2.0, math.inf):
            for foreach in (True, None):
                grads = [torch.randn(sh) for sh, _, _ in layouts]
                ref = [torch.nn.Parameter(torch.zeros(sh)) for sh, _, _ in layouts]
                params = [ap.shard_tensor(torch.nn.Parameter(torch.zeros(sh)), mesh, list(pl)) for sh, pl, _ in layouts]
                for p, q, g, (_, _, gpl) in zip(params, ref, grads, layouts):
                    p.grad = make_dist(g, mesh, gpl)
                    q.grad = g.clone()
                total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=norm_type, foreach=foreach)
                want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach)
                got = total.full_tensor() if isinstance(total, ap.DistTensor) else total
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                for p, q in zip(params, ref):
                    torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    out["fallbacks"] = sorted({m.split(" runs replicated")[0].removeprefix("autoparallel: ") for m in _fallback_warnings(caught)})
    return out


def test_clip_grad_norm_is_global(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_clip)
    # ours (_foreach_norm, _foreach_mul_) never fall back; linalg_vector_norm/stack belong to other families
    assert not [f for f in res[0]["fallbacks"] if "_foreach" in f], res[0]["fallbacks"]
