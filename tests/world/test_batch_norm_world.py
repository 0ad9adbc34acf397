"""BatchNorm's running statistics under data parallelism equal one process.

``aten.native_batch_norm`` writes ``running_mean``/``running_var`` in training mode although its
schema marks them read-only. With the batch split (``Shard(0)``) the op moved the input to
channel shards and sliced the running statistics; the write landed in the slices only, so each
rank kept its 1/n of the update (found by the model zoo: transformers' ResNet under DP). The
engine now knows the op writes them (``engine.aliases.UNMARKED_WRITES``) and writes them back.
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
            # replicated: nothing moves; batch-split: the input is gathered once (the statistics
            # need the whole batch), the running statistics stay whole
            assert comm == ({"all_gather": 1} if split else {}), comm


@pytest.mark.pure
def test_unmarked_writes_are_known() -> None:
    import torch

    from autoparallel.engine.aliases import written_args

    aten = torch.ops.aten
    x, m, v = torch.zeros(2, 3), torch.zeros(3), torch.ones(3)
    args = (x, None, None, m, v, True, 0.1, 1e-5)
    assert [id(t) for t in written_args(aten.native_batch_norm.default, args, {})] == [id(m), id(v)]
    eval_args = args[:5] + (False,) + args[6:]
    assert written_args(aten.native_batch_norm.default, eval_args, {}) == []
