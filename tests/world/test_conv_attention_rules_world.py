"""World part of ``tests/pure/test_conv_attention_rules.py``: SDPA, convolution, pooling, batch/group norm.

One 4-rank world runs each op forward and backward on DistTensors under a few layouts
against plain torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Shard
from tests.layouts import make_dist
from tests.pure.test_conv_attention_rules import R


# ---- 4-rank world: forward + backward against plain torch ----------------------------------
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _check(name: str, fn: Any, fulls: list[torch.Tensor], mesh: Any, layouts: list[tuple], grads: int = 9) -> list[str]:
    """fn on DistTensors laid out as ``layouts`` vs on ``fulls``: outputs and gradients (first ``grads`` inputs)."""
    bad = []
    ref_in = [t.clone().requires_grad_(i < grads) for i, t in enumerate(fulls)]
    ref = fn(*ref_in)
    gw = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    (ref * gw).sum().backward()
    dist_in = [make_dist(t, mesh, pl).requires_grad_(i < grads) for i, (t, pl) in enumerate(zip(fulls, layouts))]
    out = fn(*dist_in)
    (out * make_dist(gw, mesh, tuple(R for _ in layouts[0]))).sum().backward()
    if not _close(out.full_tensor(), ref):
        bad.append(f"{name} {layouts}: forward")
    for i, (d, r) in enumerate(zip(dist_in, ref_in)):
        if r.grad is not None and (d.grad is None or not _close(d.grad.full_tensor(), r.grad)):
            bad.append(f"{name} {layouts}: grad {i}")
    return bad


def _world(rank: int) -> list[str]:
    torch.manual_seed(0)
    m1 = ap.ProcessMesh([0, 1, 2, 3], ["x"])
    m2 = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    S0, S1 = Shard(0), Shard(1)
    bad: list[str] = []
    q, k, v = torch.randn(5, 6, 4, 3), torch.randn(5, 6, 7, 3), torch.randn(5, 6, 7, 3)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    bad += _check("sdpa", sdpa, [q, k, v], m2, [(S0, S1)] * 3)
    mask = torch.randn(5, 1, 4, 7)
    sdpa_mask = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    bad += _check("sdpa-mask", sdpa_mask, [q, k, v, mask], m1, [(S0,)] * 4, grads=3)
    bad += _check("sdpa-mask", sdpa_mask, [q, k, v, mask], m2, [(S0, S1)] * 3 + [(R, R)], grads=3)

    x, w, b = torch.randn(5, 6, 7, 7), torch.randn(5, 6, 3, 3), torch.randn(5)
    conv = lambda x, w, b: F.conv2d(x, w, b, padding=1)  # noqa: E731
    for lay in [[(R,), (S0,), (S0,)], [(S1,), (S1,), (R,)]]:
        bad += _check("conv2d", conv, [x, w, b], m1, lay)
    bad += _check("conv2d", conv, [x, w, b], m2, [(S0, R), (R, S0), (R, S0)])
    bad += _check("conv2d", conv, [x, w, b], m2, [(S0, S1), (R, S1), (R, R)])

    for name, pool in [("maxpool", lambda x: F.max_pool2d(x, 2)), ("avgpool", lambda x: F.avg_pool2d(x, 3, 2, 1)),
                       ("adaptive", lambda x: F.adaptive_avg_pool2d(x, (3, 2)))]:
        bad += _check(name, pool, [x], m2, [(S0, S1)])

    g, bb = torch.randn(6), torch.randn(6)
    bn = lambda x, g, bb: F.batch_norm(x, None, None, g, bb, training=True)  # noqa: E731
    bad += _check("batchnorm", bn, [x, g, bb], m1, [(S1,), (S0,), (S0,)])
    bad += _check("batchnorm", bn, [x, g, bb], m2, [(S0, S1), (R, S0), (R, R)])
    gn = lambda x, g, bb: F.group_norm(x, 3, g, bb)  # noqa: E731
    bad += _check("groupnorm", gn, [x, g, bb], m1, [(S0,), (R,), (R,)])
    bad += _check("groupnorm", gn, [x, g, bb], m2, [(S0, S0), (R, R), (S0, R)])
    return bad


def test_ops_match_single_process(world4):  # type: ignore[no-untyped-def]
    for bad in world4.run(_world):
        assert bad == []
