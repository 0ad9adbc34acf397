"""``as_strided`` as a view and a permute (``autoparallel.engine.dispatch.as_view_permute``), and its use on
DistTensors: adaptive pooling to 1 on a channels-last-like input (Swin's pooler) and its backward
run sharded, with no op falling back to running replicated; ops whose output shape depends on the
values run replicated by definition, without a warning."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel.engine.dispatch import as_view_permute


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_dense_restrides_are_a_view_and_a_permute(size: list[int], data: st.DataObject) -> None:
    n = len(size)
    order = data.draw(st.permutations(range(n)))  # outermost first
    stride = [0] * n
    step = 1
    for d in reversed(order):
        stride[d] = step if size[d] != 1 else data.draw(st.integers(1, 9))  # size-1: any stride
        step *= size[d]
    x = torch.arange(math.prod(size)).reshape(data.draw(st.sampled_from([(math.prod(size),), tuple(size)])))
    found = as_view_permute(x.shape, x.stride(), size, stride, 0)
    assert found is not None
    shape, perm = found
    assert torch.equal(x.view(shape).permute(perm), x.as_strided(size, stride))


def test_windows_overlaps_and_strided_inputs_are_not_rewritten() -> None:
    x = torch.arange(12)
    assert as_view_permute(x.shape, x.stride(), [2, 3], [3, 1], 1) is None  # an offset
    assert as_view_permute(x.shape, x.stride(), [2, 3], [3, 1], 0) is None  # a window of 6 of 12
    assert as_view_permute(x.shape, x.stride(), [3, 4], [1, 1], 0) is None  # overlapping
    assert as_view_permute(x.shape, x.stride(), [2, 6], [12, 1], 0) is None  # a gap
    t = torch.arange(12).reshape(3, 4).t()
    assert as_view_permute(t.shape, t.stride(), [4, 3], [3, 1], 0) is None  # reads storage, not order


def test_pooling_a_transposed_input_stays_sharded() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    x = torch.randn(4, 16, 8, requires_grad=True)
    F.adaptive_avg_pool1d(x.transpose(1, 2), 1).pow(2).sum().backward()
    xd = ap.shard_tensor(x.detach(), mesh, [ap.Shard(0)]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as_strided(_) no longer runs replicated
        y = F.adaptive_avg_pool1d(xd.transpose(1, 2), 1)
        y.pow(2).sum().backward()
    assert y.placements == (ap.Shard(0),)
    assert torch.equal(y.full_tensor(), F.adaptive_avg_pool1d(x.detach().transpose(1, 2), 1))
    torch.testing.assert_close(xd.grad.full_tensor(), x.grad)


def test_data_shaped_ops_run_replicated_without_a_warning() -> None:
    # nonzero / masked_select / unique: the output's length depends on every rank's values
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
    xd = ap.shard_tensor(x, mesh, [ap.Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nz = torch.nonzero(xd)
        ms = torch.masked_select(xd, xd > 0)
        un = torch.unique(xd)
    assert torch.equal(nz.full_tensor(), torch.nonzero(x))
    assert torch.equal(ms.full_tensor(), torch.masked_select(x, x > 0))
    assert torch.equal(un.full_tensor(), torch.unique(x))


@torch.library.custom_op("aptest::mixed_out", mutates_args=())
def _mixed_out(x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    return x * 2, 7, x.sum()


@_mixed_out.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    return torch.empty_like(x), 7, x.new_empty(())


def test_an_op_returning_tensors_and_values_returns_dist_tensors() -> None:
    # (CUDA flash attention returns (out, lse, None, None, max_q, max_k, seed, offset, mask)):
    # the tensors come back as DistTensors, never as the decision's meta tensors
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    x = torch.arange(6.0).reshape(3, 2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        a, n, b = torch.ops.aptest.mixed_out(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
    assert isinstance(a, ap.DistTensor) and isinstance(b, ap.DistTensor) and n == 7
    assert a.device.type == "cpu" and a.to_local().device.type == "cpu"
    assert torch.equal(a.full_tensor(), x * 2) and float(b.full_tensor()) == 15.0
