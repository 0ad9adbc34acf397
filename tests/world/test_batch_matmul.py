"""``torch.matmul`` of ``[b, h, s, d]`` DistTensors sharded on the heads stays sharded.

Found by the model zoo: eager attention (BERT, GPT-2, ViT) under tensor parallelism computes
``matmul(q, k.transpose(-1, -2))`` with the heads (dim 1) sharded; matmul's flatten of the batch
dims to ``b*h`` could not keep an inner-dim shard, so both operands were all-gathered at every
attention matmul. ``engine.batch_matmul`` moves the sharded batch dims first: no collective
forward, the same values and gradients as one process, a contiguous result.

Two batch dims sharded on two mesh axes (DP x TP: batch on ``dp``, heads on ``tp``) merge into
no placement: the flatten gathered both operands there (the zoo's ``dp_tp`` counts showed it).
Laid out alike, each rank's batch elements are its own: ``matmul`` runs on the shards
(``batch_matmul.per_shard``), uneven batch shards included. So it does for one sharded inner
batch dim (data-parallel attention as ``[h, b, s, *]``): autograd saves the operands themselves,
no permuted copy of them.
"""

from __future__ import annotations

import pytest


def _attention_matmul(rank: int, dp: bool) -> tuple[float, float, float, dict[str, int], list[str], bool]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    if dp:
        mesh = ap.ProcessMesh([[0], [1]], dim_names=["dp", "tp"])
        pl = [ap.Shard(0), ap.Shard(1)]
    else:
        mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
        pl = [ap.Shard(1)]
    qd = ap.shard_tensor(q, mesh, pl).requires_grad_()
    kd = ap.shard_tensor(k, mesh, pl).requires_grad_()
    with ap.CommDebugMode() as comm:
        s = torch.matmul(qd, kd.transpose(-1, -2))
        s2 = qd @ kd.transpose(-1, -2)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = torch.matmul(qr, kr.transpose(-1, -2))
    (s * s).sum().backward()
    (want * want).sum().backward()
    err = max((s.full_tensor() - want).abs().max().item(), (s2.full_tensor() - want).abs().max().item())
    return (err, (qd.grad.full_tensor() - qr.grad).abs().max().item(), (kd.grad.full_tensor() - kr.grad).abs().max().item(),
            comm.get_comm_counts(), [str(p) for p in s.placements], s.is_contiguous())


def test_head_sharded_matmul_moves_nothing(world2) -> None:  # type: ignore[no-untyped-def]
    for err, gq, gk, comm, placements, contiguous in world2.run(_attention_matmul, False):
        assert max(err, gq, gk) < 1e-5, (err, gq, gk)
        assert comm == {}, comm
        assert placements == ["S(1)"] and contiguous, placements


def _dp_tp_matmul(rank: int, batch: int) -> tuple[float, float, float, dict[str, int], list[str]]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    q, k = torch.randn(batch, 4, 6, 8), torch.randn(batch, 4, 6, 8)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    pl = [ap.Shard(0), ap.Shard(1)]
    qd = ap.shard_tensor(q, mesh, pl).requires_grad_()
    kd = ap.shard_tensor(k, mesh, pl).requires_grad_()
    with ap.CommDebugMode() as comm:
        s = torch.matmul(qd, kd.transpose(-1, -2))
        p = s.softmax(-1) @ kd  # [b, h, s, s] @ [b, h, s, d]
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    ws = torch.matmul(qr, kr.transpose(-1, -2))
    wp = ws.softmax(-1) @ kr
    ((s * s).sum() + p.sum()).backward()
    ((ws * ws).sum() + wp.sum()).backward()
    err = max((s.full_tensor() - ws).abs().max().item(), (p.full_tensor() - wp).abs().max().item())
    return (err, (qd.grad.full_tensor() - qr.grad).abs().max().item(), (kd.grad.full_tensor() - kr.grad).abs().max().item(),
            comm.get_comm_counts(), [str(x) for x in p.placements])


@pytest.mark.parametrize("batch", [4, 3], ids=["even", "uneven"])
def test_batch_and_head_sharded_matmul_runs_on_the_shards(world4, batch: int) -> None:  # type: ignore[no-untyped-def]
    for err, gq, gk, comm, placements in world4.run(_dp_tp_matmul, batch):
        assert max(err, gq, gk) < 1e-5, (err, gq, gk)
        assert comm == {}, comm  # forward: nothing moves
        assert placements == ["S(0)", "S(1)"], placements


def _saved_copies(rank: int) -> tuple[bool, int, float]:
    """``probs @ v`` of ``[h, b, s, *]`` attention with the batch (dim 1) sharded, as the example
    GPT's math attention runs under data parallelism: whether autograd saves the operands' own
    storages (no copy of them), how many tensors it saves, the error against one process."""
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    probs, v = torch.randn(4, 6, 8, 8), torch.randn(4, 6, 8, 5)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    pd = ap.shard_tensor(probs, mesh, [ap.Shard(1)]).requires_grad_()
    vd = ap.shard_tensor(v, mesh, [ap.Shard(1)]).requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, ap.DistTensor) else t
        saved.append(local.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pd @ vd
    own = {x.to_local().untyped_storage().data_ptr() for x in (pd, vd)}
    return set(saved) <= own, len(saved), (out.full_tensor() - probs @ v).abs().max().item()


def test_batch_sharded_attention_matmul_saves_no_copy(world2) -> None:  # type: ignore[no-untyped-def]
    # one inner batch dim sharded and both operands alike: the matmul runs on the shards, so
    # autograd keeps the operands themselves, not permuted contiguous copies of them
    for own, count, err in world2.run(_saved_copies):
        assert err < 1e-6, err
        assert own and count >= 2, (own, count)


def _off_mesh_layouts(rank: int) -> list[str]:
    import torch

    import autoparallel as ap

    mesh = ap.ProcessMesh([[0, 1]], dim_names=["dp", "cp"])  # ranks 2 and 3 are off the mesh
    x = ap.shard_tensor(torch.randn(2, 6, 4), mesh, [ap.Replicate(), ap.Shard(1)]).requires_grad_()
    w = ap.shard_tensor(torch.randn(3, 4), mesh, [ap.Replicate(), ap.Replicate()]).requires_grad_()
    q = ap.shard_tensor(torch.randn(2, 4, 6, 8), mesh, [ap.Shard(0), ap.Shard(1)])
    y = torch.nn.functional.linear(x, w)
    s = torch.matmul(q, q.transpose(-1, -2))
    y.sum().backward()
    return [str(y.placements), str(s.placements), str(w.grad.placements), str(x.grad.placements)]


def test_off_mesh_ranks_derive_the_same_layouts(world4) -> None:  # type: ignore[no-untyped-def]
    """``F.linear`` and ``matmul`` on the shards: a rank outside the mesh takes the same path (an
    empty shard) and so the same layouts — a pipeline's shape pass runs every stage everywhere."""
    got = world4.run(_off_mesh_layouts)
    assert all(g == got[0] for g in got), got
