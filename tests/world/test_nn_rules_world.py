"""World part of ``tests/pure/test_nn_rules.py``: nn ops against plain torch.

One ``world4``: forward and backward values against plain torch under several
placements, on a 1-d mesh of 4 and the 2-d mesh [[0, 1], [2, 3]], and a vocab-parallel
embedding + loss-parallel cross-entropy training step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import autoparallel as ap
from tests.layouts import make_dist, reference
from tests.pure.test_nn_rules import S0, S1, S2, P, R, aten
from tests.treeutil import one_thread  # noqa: F401  (one_thread: autouse fixture)


def _gathered(comm: Any) -> int:
    """Bytes this rank received by all-gathers (a loss-parallel softmax gathers its row statistics)."""
    return sum(r.recv_bytes for r in comm.records if r.kind == "all_gather")


# ---- multi-process: values against plain torch -------------------------------------------------
def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True), f"{name}: max error {(got - want).abs().max()}"


def _leaf(full: torch.Tensor, mesh: ap.ProcessMesh, placements: tuple) -> ap.DistTensor:
    """A DistTensor leaf holding ``full`` (its gradient comes back as a DistTensor)."""
    return make_dist(full, mesh, placements).requires_grad_()


def _softmax_world(rank: int) -> bool:
    torch.set_num_threads(1)
    m1, m2 = _mesh1(), _mesh2()
    x, c = reference((5, 7), 10), reference((5, 7), 11)
    layouts = [
        (m1, (S0,), 1), (m1, (S1,), 1), (m1, (S0,), 0), (m1, (P,), 1),
        (m2, (S0, S1), 1), (m2, (S1, S1), 1), (m2, (S1, S0), 0), (m2, (R, S1), 1),
    ]
    for mesh, pl, dim in layouts:
        for fn in (F.softmax, F.log_softmax):
            d = _leaf(x, mesh, pl)
            y = fn(d, dim)
            (y.full_tensor() * c).sum().backward()
            ref = x.clone().requires_grad_()
            want = fn(ref, dim)
            (want * c).sum().backward()
            name = f"{fn.__name__} dim {dim} {pl}"
            _close(name, y.full_tensor(), want)
            _close(name + " grad", d.grad.full_tensor(), ref.grad)
    # loss parallel: softmax over the sharded dim moves only row statistics
    d = _leaf(x, m1, (S1,))
    with ap.CommDebugMode() as comm:
        y = F.log_softmax(d, 1)
        y.backward(make_dist(c, m1, (S1,)))
    # forward: one all-gather of each piece's (row max, row sum of exponentials); backward: the
    # row sum of the gradient
    assert list(y.placements) == [S1] and comm.get_comm_counts() == {"all_gather": 1, "all_reduce": 1}, comm.summary()
    assert _gathered(comm) <= 2 * (x.numel() // x.shape[1]) * x.element_size() * 4, comm.summary()  # stats only
    ref = x.clone().requires_grad_()
    F.log_softmax(ref, 1).backward(c)
    _close("loss-parallel grad", d.grad.full_tensor(), ref.grad)
    return True


def test_softmax_forward_backward(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_softmax_world))


def _norm_world(rank: int) -> bool:
    torch.set_num_threads(1)
    m1, m2 = _mesh1(), _mesh2()
    x, c = reference((5, 3, 4), 20), reference((5, 3, 4), 23)
    w, b = reference((4,), 21), reference((4,), 22)
    layouts = [(m1, (S0,)), (m1, (S1,)), (m1, (S2,)), (m1, (R,)), (m1, (P,)), (m2, (S0, S1)), (m2, (S1, S0)), (m2, (S0, S0))]
    for mesh, pl in layouts:
        rep = tuple(R for _ in pl)
        d, dw, db = _leaf(x, mesh, pl), _leaf(w, mesh, rep), _leaf(b, mesh, rep)
        y = F.layer_norm(d, (4,), dw, db)
        (y.full_tensor() * c).sum().backward()
        rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
        want = F.layer_norm(rx, (4,), rw, rb)
        (want * c).sum().backward()
        _close(f"layer_norm {pl}", y.full_tensor(), want)
        for name, got, ref in [("x", d, rx), ("w", dw, rw), ("b", db, rb)]:
            _close(f"layer_norm {pl} grad {name}", got.grad.full_tensor(), ref.grad)
        if pl[0] == S0:
            assert y.placements[0] == S0, y.placements
        # no affine, two normalized dims
        d2 = _leaf(x, mesh, pl)
        y2 = F.layer_norm(d2, (3, 4))
        (y2.full_tensor() * c).sum().backward()
        rx2 = x.clone().requires_grad_()
        want2 = F.layer_norm(rx2, (3, 4))
        (want2 * c).sum().backward()
        _close(f"layer_norm (3, 4) {pl}", y2.full_tensor(), want2)
        _close(f"layer_norm (3, 4) {pl} grad", d2.grad.full_tensor(), rx2.grad)
        # fused RMS norm forward (its backward has no CPU kernel)
        out, rstd = aten._fused_rms_norm.default(make_dist(x, mesh, pl), [4], make_dist(w, mesh, rep), 1e-6)
        ref_out, ref_rstd = aten._fused_rms_norm.default(x, [4], w, 1e-6)
        _close(f"fused rms {pl}", out.full_tensor(), ref_out)
        _close(f"fused rms rstd {pl}", rstd.full_tensor(), ref_rstd)
    return True


def test_layer_norm_forward_backward(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_norm_world))


def _embedding_world(rank: int) -> bool:
    torch.set_num_threads(1)
    m1, m2 = _mesh1(), _mesh2()
    weight, c = reference((11, 6), 30), reference((3, 5, 6), 31)
    idx = torch.tensor([[0, 10, 3, 2, 7], [2, 2, 9, 5, 1], [8, 4, 2, 6, 10]])
    layouts = [
        (m1, (R,), (S0,)), (m1, (R,), (S1,)), (m1, (S1,), (R,)), (m1, (S0,), (R,)), (m1, (S0,), (S1,)),
        (m2, (S0, S0), (R, R)), (m2, (S0, S1), (R, R)), (m2, (S0, R), (R, S0)), (m2, (R, R), (S0, S1)), (m2, (S1, S0), (R, R)),
    ]
    for mesh, wpl, ipl in layouts:
        for padding_idx, scale in [(None, False), (2, False), (2, True)]:
            dw, di = _leaf(weight, mesh, wpl), make_dist(idx, mesh, ipl)
            y = F.embedding(di, dw, padding_idx=padding_idx, scale_grad_by_freq=scale)
            (y.full_tensor() * c).sum().backward()
            rw = weight.clone().requires_grad_()
            want = F.embedding(idx, rw, padding_idx=padding_idx, scale_grad_by_freq=scale)
            (want * c).sum().backward()
            name = f"embedding w {wpl} idx {ipl} pad {padding_idx} scale {scale}"
            _close(name, y.full_tensor(), want)
            _close(name + " grad", dw.grad.full_tensor(), rw.grad)
            if mesh is m1 and wpl == (S0,) and ipl == (R,):
                assert list(y.placements) == [P], y.placements  # vocab parallel: no gather of rows
                assert list(dw.grad.placements) == [S0], dw.grad.placements
    # a replicated table's gradient comes out replicated, as its parameter (not row-sharded, to
    # be gathered back: no all-gather); a row-sharded table's by rows (vocabulary parallel). A
    # leaf's gradient is reduced on dp where it accumulates
    for mesh, wpl, ipl, want_pl in [(m1, (R,), (R,), [R]), (m1, (S0,), (R,), [S0]),
                                    (m2, (R, R), (S0, R), [R, R]), (m2, (R, S0), (S0, R), [R, S0])]:
        dw, di = _leaf(weight, mesh, wpl), make_dist(idx, mesh, ipl)
        y = F.embedding(di, dw)
        with ap.CommDebugMode() as comm:
            (y * y).sum().backward()
        rw = weight.clone().requires_grad_()
        (F.embedding(idx, rw) ** 2).sum().backward()
        _close(f"embedding w {wpl} idx {ipl} grad", dw.grad.full_tensor(), rw.grad)
        assert list(dw.grad.placements) == want_pl, (wpl, ipl, dw.grad.placements)
        assert _gathered(comm) == 0, (wpl, ipl, comm.get_comm_counts())
    return True


def test_embedding_forward_backward(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_embedding_world))


def _nll_world(rank: int) -> bool:
    torch.set_num_threads(1)
    m1, m2 = _mesh1(), _mesh2()
    x, t = reference((6, 5), 40), torch.tensor([0, 4, -100, 1, 1, 3])
    cw = reference((5,), 41).abs() + 0.5
    x4 = reference((2, 5, 3, 3), 42)
    t4 = torch.tensor([[[0, 4, 1], [2, -100, 3], [1, 1, 0]], [[4, 4, 3], [2, 0, 1], [3, -100, 2]]])
    c6, c4 = reference((6,), 43), reference((2, 3, 3), 44)
    layouts = [
        (x, t, c6, m1, (S0,), (S0,)), (x, t, c6, m1, (S1,), (R,)), (x, t, c6, m1, (R,), (R,)),
        (x, t, c6, m2, (S0, S1), (S0, R)), (x, t, c6, m2, (S1, S1), (R, R)), (x, t, c6, m2, (S0, S0), (S0, S0)),
        (x, t, c6, m2, (S1, S0), (R, S0)),
        (x4, t4, c4, m1, (S1,), (R,)), (x4, t4, c4, m1, (S2,), (S1,)), (x4, t4, c4, m2, (S0, S1), (S0, R)),
    ]
    for full, target, c, mesh, xpl, tpl in layouts:
        rep = tuple(R for _ in xpl)
        for reduction, weight in [("mean", None), ("mean", cw), ("sum", cw), ("none", None)]:
            dx, dt = _leaf(full, mesh, xpl), make_dist(target, mesh, tpl)
            dwt = None if weight is None else make_dist(weight, mesh, rep)
            loss = F.cross_entropy(dx, dt, weight=dwt, reduction=reduction)
            lf = loss.full_tensor()
            (lf * c if reduction == "none" else lf).sum().backward()
            rx = full.clone().requires_grad_()
            want = F.cross_entropy(rx, target, weight=weight, reduction=reduction)
            (want * c if reduction == "none" else want).sum().backward()
            name = f"cross_entropy {tuple(full.shape)} {xpl} {tpl} {reduction} weight={weight is not None}"
            _close(name, lf, want)
            _close(name + " grad", dx.grad.full_tensor(), rx.grad)
    # loss parallel: class-sharded logits are never gathered
    dx, dt = _leaf(x, m1, (S1,)), make_dist(t, m1, (R,))
    with ap.CommDebugMode() as comm:
        loss = F.cross_entropy(dx, dt)
        loss.backward()
    assert list(loss.placements) == [P], loss.placements
    assert set(comm.get_comm_counts()) <= {"all_gather", "all_reduce"}, comm.summary()
    assert _gathered(comm) <= 2 * (x.numel() // x.shape[1]) * x.element_size() * 4, comm.summary()  # stats only
    rx = x.clone().requires_grad_()
    F.cross_entropy(rx, t).backward()
    _close("loss parallel", loss.full_tensor(), F.cross_entropy(x, t))
    _close("loss parallel grad", dx.grad.full_tensor(), rx.grad)
    # label smoothing decomposes into reductions and pointwise ops around the NLL
    dx = _leaf(x, m1, (S1,))
    loss = F.cross_entropy(dx, make_dist(t, m1, (R,)), label_smoothing=0.1)
    loss.full_tensor().backward()
    rx = x.clone().requires_grad_()
    want = F.cross_entropy(rx, t, label_smoothing=0.1)
    want.backward()
    _close("label smoothing", loss.full_tensor(), want)
    _close("label smoothing grad", dx.grad.full_tensor(), rx.grad)
    return True


def test_cross_entropy_forward_backward(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_nll_world))


def _dropout_world(rank: int) -> bool:
    torch.set_num_threads(1)
    m1, m2 = _mesh1(), _mesh2()
    g = reference((5, 7), 50)
    mask = reference((5, 7), 51) > 0
    for mesh, gpl, mpl in [(m2, (S0, S1), (S0, S1)), (m1, (P,), (R,)), (m1, (S1,), (R,))]:
        out = aten.native_dropout_backward.default(make_dist(g, mesh, gpl), make_dist(mask, mesh, mpl), 2.0)
        _close(f"dropout backward {gpl}", out.full_tensor(), g * mask * 2.0)
    d = make_dist(g, m1, (S0,))
    y = F.dropout(d, 0.5, training=False)  # eval mode: identity, no op
    _close("eval dropout", y.full_tensor(), g)
    assert list(y.placements) == [S0]
    return True


def test_dropout_backward_and_eval_dropout(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_dropout_world))


def _vocab_parallel_training(rank: int) -> bool:
    """Vocab-parallel embedding, layer norm, class-sharded head, cross-entropy: 2 SGD steps."""
    torch.set_num_threads(1)
    V, D, N = 13, 8, 10  # N tokens (a flattened batch)
    g = torch.Generator().manual_seed(7)
    init = {
        "emb": torch.randn(V, D, generator=g), "ln_w": torch.randn(D, generator=g), "ln_b": torch.randn(D, generator=g),
        "head": torch.randn(V, D, generator=g) * 0.3,
    }
    idx, tgt = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    tgt[1] = -100

    def forward(p: dict, idx: Any, tgt: Any) -> Any:
        h = F.layer_norm(F.embedding(idx, p["emb"]), (D,), p["ln_w"], p["ln_b"])
        return F.cross_entropy(F.linear(h, p["head"]), tgt)

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref_opt = torch.optim.SGD(list(ref.values()), lr=0.5)
    ref_losses = []
    for _ in range(2):
        ref_opt.zero_grad()
        loss = forward(ref, idx, tgt)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    m1, m2 = _mesh1(), _mesh2()
    for mesh, vocab, rep, data in [(m1, (S0,), (R,), (R,)), (m2, (R, S0), (R, R), (S0, R))]:
        layout = {"emb": vocab, "ln_w": rep, "ln_b": rep, "head": vocab}
        p = {k: ap.shard_tensor(torch.nn.Parameter(v.clone()), mesh, list(layout[k])) for k, v in init.items()}
        opt = torch.optim.SGD(list(p.values()), lr=0.5, foreach=False)
        di, dt = ap.shard_tensor(idx, mesh, list(data)), ap.shard_tensor(tgt, mesh, list(data))
        for step in range(2):
            opt.zero_grad()
            loss = forward(p, di, dt)
            loss.backward()
            opt.step()
            _close(f"loss step {step} on {list(mesh.shape)}", loss.detach().full_tensor(), ref_losses[step])
        for k in init:
            assert list(p[k].placements) == list(layout[k]), (k, p[k].placements)
            _close(f"{k} after 2 steps on {list(mesh.shape)}", p[k].detach().full_tensor(), ref[k].detach())
    return True


def test_vocab_parallel_embedding_cross_entropy_training(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_vocab_parallel_training))


def _out_of_range_world(rank: int) -> bool:
    """An index outside the table (an id ``>= vocab`` or negative) in a vocab-parallel embedding,
    and a target outside the classes of a class-sharded cross-entropy, raise ``IndexError`` as on
    one device on every rank that holds it (here all: the indices and the rows are replicated)
    — they used to read as a row of zeros / an ignored target — in eager and in a captured
    program's replay; ``ignore_index`` targets still count as ignored."""
    import warnings

    import pytest

    torch.set_num_threads(1)
    V, D = 13, 8
    g = torch.Generator().manual_seed(3)
    table, head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    for mesh, vocab in [(_mesh1(), (S0,)), (_mesh2(), (R, S0))]:
        rep = [R] * mesh.ndim
        w = ap.shard_tensor(table, mesh, list(vocab))
        for bad in (V, V + 5, -1):
            ids = ap.shard_tensor(torch.tensor([[1, bad, 2]]), mesh, rep)
            with pytest.raises(IndexError, match="out of range"):
                F.embedding(ids, w)
            with pytest.raises(IndexError):  # one device raises too
                F.embedding(torch.tensor([[1, bad, 2]]), table)
        full = F.linear(F.embedding(torch.tensor([0, 4, 9]), table), head)
        logits = ap.shard_tensor(full, mesh, [*rep[:-1], S1])  # class-sharded, every row on every rank
        for bad in (V, -1):
            for reduction in ("mean", "sum", "none"):
                with pytest.raises(IndexError, match="out of bounds"):
                    F.cross_entropy(logits, ap.shard_tensor(torch.tensor([1, bad, 2]), mesh, rep), reduction=reduction)
        ok = F.cross_entropy(logits, ap.shard_tensor(torch.tensor([1, -100, 2]), mesh, rep))
        want = F.cross_entropy(full, torch.tensor([1, -100, 2]))
        _close("ignored target", ok.full_tensor(), want)

    # a captured program checks its targets at every replay
    mesh = _mesh1()
    model = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Linear(D, V, bias=False))
    ap.parallelize(model, mesh, {"0": ap.VocabParallelEmbedding(), "1": ap.ColWiseParallel()})
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt)
    x = ap.shard_tensor(torch.tensor([0, 4, 9, 3]), mesh, [R])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # warm, capture, replay
            dm(x, ap.shard_tensor(torch.tensor([1, 2, 12, 0]), mesh, [R]))
    assert not [str(m.message) for m in caught if "autoparallel" in str(m.message)]
    assert dm._programs, "the step was not captured"
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        dm(x, ap.shard_tensor(torch.tensor([1, 2, V, 0]), mesh, [R]))
    return True


def test_out_of_range_indices_and_targets_raise_on_every_rank(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_out_of_range_world))
