"""A DistTensor's shard follows the strides its wrapper advertises (``autoparallel.strides``).

Torch decides from the wrapper's strides whether ``reshape`` is a view, whether ``.contiguous()``
copies and whether autograd keeps a gradient as it is; the shard then has to agree. One test
per way the two used to part (2 ranks):

- an input a plan copies (a collective writes row-major) standing for a transposed tensor: the
  local kernel followed the shard, the meta kernel the wrapper (the unmodified Llama's
  ``attn_output.reshape(*input_shape, -1)`` after grouped-query attention under TP);
- a kernel choosing another memory layout on the shard than its meta kernel on the global tensor;
- ``ap.reshard`` of a transposed tensor (its wrapper used to claim row-major);
- the gradients of ``full_tensor()`` and ``to_local()``: an expanded (stride-0) shard under a
  contiguous wrapper, which an in-place ``mul_`` (gradient clipping) refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Replicate, Shard
from autoparallel.engine import layout
from autoparallel.strides import follows
from spmd_rules import AxisStrategy, OpCall


@torch.library.custom_op("ap_strides_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # row-major


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).t().contiguous().t()  # the meta kernel says column-major


@ap.register_axis_rule(torch.ops.ap_strides_test.double.default)
def _double_rule(call: OpCall, axis: int, size: int) -> list[AxisStrategy]:
    return [AxisStrategy((p,), (p,)) for p in (Replicate(), Shard(0), Shard(1))]


def _follows(x: torch.Tensor) -> bool:
    local = layout.local_of(x)
    return follows(tuple(local.shape), local.stride(), layout.stride_of(x))


def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1], dim_names=["tp"])


def _moved_query_attention(rank: int) -> float:
    B, S, H, KV, D = 2, 4, 2, 1, 4  # 2 query heads over 2 ranks, 1 key/value head: not shardable alike
    torch.manual_seed(0)
    qf, kf, vf = torch.randn(B, S, H * D), torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    mesh = _mesh()
    q = ap.shard_tensor(qf, mesh, [Shard(2)]).view(B, S, H, D).transpose(1, 2)  # heads sharded, transposed
    k, v = (ap.shard_tensor(t, mesh, [Replicate()]) for t in (kf, vf))
    o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # batch-sharded: q moves (all-to-all)
    assert o.placements[0] == Shard(0) and _follows(o), (o.placements, layout.stride_of(o), layout.local_of(o).stride())
    out = o.transpose(1, 2).contiguous().view(B, S, -1)  # the wrapper skips the copy: the shard must view
    ref = F.scaled_dot_product_attention(qf.view(B, S, H, D).transpose(1, 2), kf, vf, enable_gqa=True)
    return (out.full_tensor() - ref.transpose(1, 2).reshape(B, S, -1)).abs().max().item()


def test_a_moved_input_follows_its_wrapper(world2) -> None:  # type: ignore[no-untyped-def]
    assert max(world2.run(_moved_query_attention)) < 1e-6


def _kernel_layout(rank: int) -> bool:
    full = torch.arange(24.0).view(4, 6)
    x = ap.shard_tensor(full, _mesh(), [Shard(0)])
    y = double(x)  # the kernel writes the shard row-major, the wrapper is column-major
    assert y.placements[0] == Shard(0) and layout.stride_of(y) == (1, 4) and _follows(y)
    yt = y.t()  # column-major meta: its transpose is contiguous to the wrapper
    flat = yt.view(-1) if yt.is_contiguous() else yt.reshape(-1)
    return torch.equal(flat.full_tensor(), (full * 2).t().reshape(-1))


def test_a_kernel_output_follows_its_wrapper(world2) -> None:  # type: ignore[no-untyped-def]
    assert all(world2.run(_kernel_layout))


def _reshard_transposed(rank: int) -> bool:
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    x = ap.shard_tensor(full, _mesh(), [Replicate()])
    z = ap.reshard(x.t(), _mesh(), [Shard(0)])  # the shard is a slice of a transposed tensor
    assert layout.stride_of(z) == x.t().stride() and not z.is_contiguous() and _follows(z)
    flat = z.reshape(-1)  # a copy, as for ``full.t()`` in one process
    z2 = ap.reshard(ap.reshard(x, _mesh(), [Shard(1)]).t(), _mesh(), [Shard(0)])  # all-to-all of a transposed shard
    assert _follows(z2) and torch.equal(z2.contiguous().view(-1).full_tensor(), full.t().reshape(-1))
    return torch.equal(flat.full_tensor(), full.t().reshape(-1))


def test_reshard_keeps_the_strides_and_the_shard_follows(world2) -> None:  # type: ignore[no-untyped-def]
    assert all(world2.run(_reshard_transposed))


def _writable_gradients(rank: int) -> bool:
    mesh = _mesh()
    for read in (lambda t: t.full_tensor(), lambda t: t.to_local()):
        x = ap.shard_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
        read(x).sum().backward()  # an expanded (stride-0) gradient of ones
        g = x.grad
        assert g is not None and _follows(g)
        g.mul_(2)  # what gradient clipping does; refused by a stride-0 shard
        assert torch.equal(g.full_tensor(), torch.full((4, 6), 2.0))
    return True


def test_gradients_of_full_tensor_and_to_local_are_writable(world2) -> None:  # type: ignore[no-untyped-def]
    assert all(world2.run(_writable_gradients))
