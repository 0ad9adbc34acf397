"""Reshapes of co-sharded dims keep their shards (``StridedShard``), and so does what runs on them.

Found by the model zoo: eager attention (BERT, GPT-2, ViT) under tensor parallelism computes
``matmul(q, k.transpose(-1, -2))`` with the heads (dim 1) sharded; matmul flattens the batch dims
to ``b*h`` below Python for its ``bmm``. With the heads an inner factor of that dim and no
placement for it, both operands were all-gathered at every attention matmul. The flattened heads
are ``StridedShard(0, split_factor=b)``: ``bmm`` runs on the shards, the view back gives
``Shard(1)`` again; with the batch on ``dp`` too (DP x TP) the batch stays ``Shard(0)`` of the
flat dim, an uneven batch included. ``F.linear`` of a sequence-sharded ``[B, S, W]`` (context or
sequence parallelism) flattens ``[B * S, W]`` alike and stays on the token shards.
"""

from __future__ import annotations

from typing import Any

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


def _reshape_keeps(rank: int, batch: int) -> tuple[list[str], list[str], dict[str, int], bool, bool]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    x = torch.randn(batch, 6, 5, 3)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    xd = ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Shard(1)])
    with ap.CommDebugMode() as comm:
        flat = xd.reshape(batch * 6, 5, 3)
        back = (flat * 2).view(batch, 6, 5, 3)
    return ([str(p) for p in flat.placements], [str(p) for p in back.placements], comm.get_comm_counts(),
            torch.equal(flat.full_tensor(), x.reshape(batch * 6, 5, 3)), torch.equal(back.full_tensor(), x * 2))


@pytest.mark.parametrize("batch", [4, 3], ids=["even", "uneven"])
def test_reshape_of_co_sharded_dims_keeps_the_shards(world4, batch: int) -> None:  # type: ignore[no-untyped-def]
    for flat, back, comm, flat_ok, back_ok in world4.run(_reshape_keeps, batch):
        assert flat == ["S(0)", f"S(0/{batch})"] and back == ["S(0)", "S(1)"], (flat, back)
        assert comm == {} and flat_ok and back_ok, comm


def _sequence_linear(rank: int) -> tuple[dict[str, int], list[str], float, float, float]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 8, 6), torch.randn(5, 6), torch.randn(5)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    xd = ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Shard(1)]).requires_grad_()
    wd = ap.shard_tensor(w, mesh, [ap.Replicate(), ap.Replicate()]).requires_grad_()
    bd = ap.shard_tensor(b, mesh, [ap.Replicate(), ap.Replicate()]).requires_grad_()
    with ap.CommDebugMode() as comm:
        y = torch.nn.functional.linear(xd, wd, bd)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    want = torch.nn.functional.linear(xr, wr, br)
    (y * y).sum().backward()
    (want * want).sum().backward()
    # (the weight's and bias's gradients are sums over the token shards: relative to their size)
    grads = max(((wd.grad.full_tensor() - wr.grad).abs().max() / wr.grad.abs().max()).item(),
                ((bd.grad.full_tensor() - br.grad).abs().max() / br.grad.abs().max()).item())
    return (comm.get_comm_counts(), [str(p) for p in y.placements], (y.full_tensor() - want).abs().max().item(),
            (xd.grad.full_tensor() - xr.grad).abs().max().item(), grads)


def test_linear_of_sequence_shards_stays_on_them(world4) -> None:  # type: ignore[no-untyped-def]
    for comm, placements, err, gx, gw in world4.run(_sequence_linear):
        assert comm == {} and placements == ["S(0)", "S(1)"], (comm, placements)
        assert max(err, gx, gw) < 1e-5, (err, gx, gw)


def _write_through_flat_view(rank: int) -> bool:
    import torch

    import autoparallel as ap

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    t = torch.arange(72.0).reshape(4, 6, 3)
    xd = ap.shard_tensor(t.clone(), mesh, [ap.Shard(0), ap.Shard(1)])
    flat = xd.view(24, 3)
    flat.add_(1)
    flat[5:9].mul_(2)  # a view of the strided view, written too
    want = t.clone()
    want.view(24, 3).add_(1)
    want.view(24, 3)[5:9].mul_(2)
    return torch.equal(xd.full_tensor(), want) and list(xd.placements) == [ap.Shard(0), ap.Shard(1)]


def test_a_write_through_a_strided_view_lands(world4) -> None:  # type: ignore[no-untyped-def]
    """The flat view's shard may be a copy (a shard sliced from a larger tensor cannot be viewed
    as one flat dim): a write through it is carried back into the original, as plain torch's lands."""
    assert all(world4.run(_write_through_flat_view))


# ---- ops whose reduced dim is strided: the divisor and the row statistics are global ----------
_MESH2 = ([[0, 1], [2, 3]], ["x", "y"])
_STRIDED_CASES = {
    # name: (global shape, mesh (1-D or 2-D), placements, flat shape the reshape makes)
    "uneven": ((4, 3), 1, ("S1",), (-1,)),             # 3 columns over 4 ranks: one empty piece
    "even": ((3, 8), 1, ("S1",), (-1,)),
    "mesh2": ((4, 6), 2, ("S0", "S1"), (-1,)),
    "rows": ((2, 4, 3), 1, ("S2",), (2, 12)),         # a batch of strided rows
}
_STRIDED_OPS = {
    "mean": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(-1),
    "var": lambda x: x.var(-1),
    "std": lambda x: x.std(-1),
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(-1),
}


def _strided_ops(rank: int, case: str) -> dict[str, Any]:
    import torch

    import autoparallel as ap

    shape, nd, pl, flat = _STRIDED_CASES[case]
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"]) if nd == 1 else ap.ProcessMesh(*_MESH2)
    placements = [ap.Shard(int(p[1])) for p in pl]
    torch.manual_seed(0)
    t = torch.randn(*shape)
    out: dict[str, Any] = {}
    for name, fn in _STRIDED_OPS.items():
        xd = ap.shard_tensor(t, mesh, placements).requires_grad_()
        xr = t.clone().requires_grad_()
        fd = xd.reshape(*flat)
        assert any(isinstance(p, ap.StridedShard) for p in fd.placements), fd.placements
        yd, yr = fn(fd), fn(xr.reshape(*flat))
        w = torch.randn(yr.shape)
        (yd * ap.shard_tensor(w, mesh, [ap.Replicate()] * nd)).sum().backward()
        (yr * w).sum().backward()
        assert xd.grad is not None and xr.grad is not None
        out[name] = ((yd.full_tensor() - yr).abs().max().item(), (xd.grad.full_tensor() - xr.grad).abs().max().item())
    if case == "rows":  # cross entropy over strided classes: log_softmax, then nll on them
        tgt = torch.tensor([5, 11])
        xd = ap.shard_tensor(t, mesh, placements).requires_grad_()
        xr = t.clone().requires_grad_()
        ld = torch.nn.functional.cross_entropy(xd.reshape(2, 12), tgt)
        lr = torch.nn.functional.cross_entropy(xr.reshape(2, 12), tgt)
        ld.backward()
        lr.backward()
        assert xd.grad is not None and xr.grad is not None
        out["cross_entropy"] = ((ld.full_tensor() - lr).abs().item(), (xd.grad.full_tensor() - xr.grad).abs().max().item())
    return out


@pytest.mark.parametrize("case", list(_STRIDED_CASES))
def test_reductions_over_a_strided_dim_match_torch(world4, case: str) -> None:  # type: ignore[no-untyped-def]
    """mean divides by the global count (not the piece's), softmax/log_softmax merge every
    piece's row statistics, and var/std's backward (which takes a mean) follows: values and
    gradients equal plain torch, on an empty piece too."""
    for got in world4.run(_strided_ops, case, timeout=60):
        bad = {k: v for k, v in got.items() if not max(v) < 1e-5}
        assert not bad, bad


def _strided_expand(rank: int, nd: int, cols: int) -> tuple[list[str], float, float]:
    import torch

    import autoparallel as ap

    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"]) if nd == 1 else ap.ProcessMesh(*_MESH2)
    placements = [ap.Shard(1)] if nd == 1 else [ap.Shard(0), ap.Shard(1)]
    torch.manual_seed(0)
    t = torch.randn(4, cols)
    xd = ap.shard_tensor(t, mesh, placements).requires_grad_()
    xr = t.clone().requires_grad_()
    n = 4 * cols
    yd = xd.reshape(-1).unsqueeze(1).expand(n, 3)
    yr = xr.reshape(-1).unsqueeze(1).expand(n, 3)
    w = torch.randn(n, 3)
    (yd * ap.shard_tensor(w, mesh, [ap.Replicate()] * nd)).sum().backward()
    (yr * w).sum().backward()
    assert xd.grad is not None and xr.grad is not None
    return ([str(p) for p in yd.placements], (yd.full_tensor() - yr).abs().max().item(),
            (xd.grad.full_tensor() - xr.grad).abs().max().item())


@pytest.mark.parametrize(("nd", "cols"), [(1, 3), (1, 8), (2, 6)], ids=["uneven", "even", "mesh2"])
def test_expand_of_a_strided_dim(world4, nd: int, cols: int) -> None:  # type: ignore[no-untyped-def]
    """``expand``'s local step broadcasts to the local shape (a reshape there failed on the
    ranks with a piece while an empty piece's rank went on to the next collective)."""
    for placements, err, grad in world4.run(_strided_expand, nd, cols, timeout=60):
        assert any("/" in p for p in placements), placements  # (it stays strided)
        assert max(err, grad) < 1e-6, (err, grad)
