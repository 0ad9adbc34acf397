"""BatchNorm's running statistics under data parallelism equal one process.

``aten.native_batch_norm`` writes ``running_mean``/``running_var`` in training mode although its
schema marks them read-only. With the batch split (``Shard(0)``) the op moved the input to
channel shards and sliced the running statistics; the write landed in the slices only, so each
rank kept its 1/n of the update (found by the model zoo: transformers' ResNet under DP). The
engine now knows the op writes them (``engine.decide.UNMARKED_WRITES``) and writes them back.
"""

from __future__ import annotations

import pytest


def _batch_norm(rank: int, split: bool) -> tuple[float, float, float, dict[str, int]]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    bn, ref = torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    ap.shard_layer(bn, mesh)
    x = torch.randn(4, 3, 2, 2)
    with ap.CommDebugMode() as comm:
        y = bn(ap.shard_tensor(x, mesh, [ap.Shard(0) if split else ap.Replicate()]))
    want = ref(x)
    return ((y.full_tensor() - want).abs().max().item(),
            (bn.running_mean.full_tensor() - ref.running_mean).abs().max().item(),
            (bn.running_var.full_tensor() - ref.running_var).abs().max().item(), comm.get_comm_counts())


def test_running_stats_follow_the_whole_batch(world2) -> None:  # type: ignore[no-untyped-def]
    for split in (False, True):
        for out, mean, var, comm in world2.run(_batch_norm, split):
            assert max(out, mean, var) < 1e-6, (split, out, mean, var)
            # replicated: nothing moves; batch-split: the statistics of the whole batch come from
            # one all-reduce of per-channel sums (the input stays split), the running statistics
            # stay whole
            assert comm == ({"all_reduce": 1} if split else {}), comm


@pytest.mark.pure
def test_unmarked_writes_are_known() -> None:
    import torch

    from autoparallel.engine.decide import written_args

    aten = torch.ops.aten
    x, m, v = torch.zeros(2, 3), torch.zeros(3), torch.ones(3)
    args = (x, None, None, m, v, True, 0.1, 1e-5)
    assert [id(t) for t in written_args(aten.native_batch_norm.default, args, {})] == [id(m), id(v)]
    eval_args = args[:5] + (False,) + args[6:]
    assert written_args(aten.native_batch_norm.default, eval_args, {}) == []


def _train_conv_bn(rank: int, dim: int) -> tuple[list[float], list[float], float, float, dict[str, int]]:
    """A conv + BatchNorm net trained 3 SGD-momentum steps with the batch (``dim`` 0) or the
    height (2) of its BatchNorms' input split, against one process: losses, the largest
    relative parameter error, the largest running-statistic error, the last step's collectives."""
    import torch
    import torch.nn.functional as F

    import autoparallel as ap

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.BatchNorm2d(6, affine=False), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(6, 5))

    model, ref = build(), build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the layout
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    ours, theirs = [], []
    for _ in range(3):
        # the mean is far from 0 (the statistics' shift by the running mean keeps the variance exact)
        x, y = torch.randn(6, 3, 6, 5, generator=gen) * 3 + 40, torch.randint(0, 5, (6,), generator=gen)
        with ap.CommDebugMode() as comm:
            loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [ap.Shard(dim)])), ap.shard_tensor(y, mesh, [ap.Replicate()]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ours.append(float(loss.full_tensor()))
        theirs.append(float(ref_loss))
    param = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(), ref.parameters()))
    stats = max((b.full_tensor() - q).abs().max().item() / (q.abs().max().item() + 1e-12)
                for b, q in zip(model.buffers(), ref.buffers()) if q.is_floating_point())
    return ours, theirs, param, stats, comm.get_comm_counts()


@pytest.mark.parametrize("dim", [0, 2], ids=["batch", "height"])
def test_batch_norm_on_batch_or_spatial_shards_trains_as_one_process(world2, dim: int) -> None:  # type: ignore[no-untyped-def]
    for ours, theirs, param, stats, comm in world2.run(_train_conv_bn, dim):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
        assert param < 1e-5 and stats < 1e-5, (param, stats)
        if dim == 0:
            # SyncBatchNorm: per BatchNorm one all-reduce of its statistics forward and one of its
            # gradient sums backward; the loss's mean and the gradient bucket: 2 more, no gather
            assert comm == {"all_reduce": 6}, comm
