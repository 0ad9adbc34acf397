"""Ops on DistTensors in a 4-rank gloo world: values, placements and the collectives issued."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from tests.layouts import make_dist, reference

R = Replicate()


def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- MLP equivalence -----------------------------------------------------------------------
def _mlp(rank: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    fc1, fc2 = torch.nn.Linear(5, 8), torch.nn.Linear(8, 3)
    ref = fc2(F.relu(fc1(x)))
    ref.square().mean().backward()
    mesh = _mesh1()
    w1 = ap.shard_tensor(torch.nn.Parameter(fc1.weight.detach().clone()), mesh, [Shard(0)])
    b1 = ap.shard_tensor(torch.nn.Parameter(fc1.bias.detach().clone()), mesh, [Shard(0)])
    w2 = ap.shard_tensor(torch.nn.Parameter(fc2.weight.detach().clone()), mesh, [Shard(1)])
    b2 = ap.shard_tensor(torch.nn.Parameter(fc2.bias.detach().clone()), mesh, [R])
    dx = ap.shard_tensor(x, mesh, [R])
    with ap.CommDebugMode() as fwd:
        h = F.relu(F.linear(dx, w1, b1))
        out = F.linear(h, w2, b2)
    assert list(h.placements) == [Shard(1)], h.placements
    assert list(out.placements) == [Partial()], out.placements
    assert fwd.get_total_counts() == 0, fwd.summary()  # column -> row needs no communication
    loss = out.square().mean()
    loss.backward()
    assert _close(out.full_tensor(), ref)
    for p, q in [(w1, fc1.weight), (b1, fc1.bias), (w2, fc2.weight), (b2, fc2.bias)]:
        assert isinstance(p.grad, ap.DistTensor)
        assert _close(p.grad.full_tensor(), q.grad), (p.grad.placements, p.grad.full_tensor(), q.grad)
    return {"w1": list(w1.grad.placements), "w2": list(w2.grad.placements)}


def test_column_row_mlp_matches_single_process(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_mlp)
    assert res[0]["w1"] == [Shard(0)]  # column-parallel weight gets a column-sharded gradient
    # w2's gradient may stay Partial (cheapest); its value is checked on every rank above.


def _dp_tp_training(rank: int) -> bool:
    torch.manual_seed(1)
    x, t = torch.randn(8, 4), torch.randn(8, 2)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model.load_state_dict(ref.state_dict())
    mesh = _mesh2()
    model[0].weight = ap.shard_tensor(model[0].weight, mesh, [R, Shard(0)])
    model[0].bias = ap.shard_tensor(model[0].bias, mesh, [R, Shard(0)])
    model[2].weight = ap.shard_tensor(model[2].weight, mesh, [R, Shard(1)])
    model[2].bias = ap.shard_tensor(model[2].bias, mesh, [R, R])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)
    for _ in range(5):
        loss = (model(ap.shard_tensor(x, mesh, [Shard(0), R])) - ap.shard_tensor(t, mesh, [Shard(0), R])).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = (ref(x) - t).square().mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert _close(loss.detach().full_tensor(), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _close(p.detach().full_tensor(), q.detach())
    return True


def test_dp_tp_sgd_five_steps_match(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_dp_tp_training))


# ---- op rules ------------------------------------------------------------------------------
def _pointwise(rank: int) -> bool:
    mesh = _mesh2()
    a, b = reference((5, 6), 0), reference((6,), 1)
    da = make_dist(a, mesh, (Shard(0), Shard(1)))
    db = make_dist(b, mesh, (R, Shard(0)))
    out = da * db + da.exp() - 2.0
    assert _close(out.full_tensor(), a * b + a.exp() - 2.0)
    # Partial + scalar: the scalar must be added once, not once per rank
    p = make_dist(a, mesh, (Partial(), Partial()))
    assert _close((p + 1.0).full_tensor(), a + 1.0)
    assert _close((p * 3.0).full_tensor(), a * 3.0)
    q = make_dist(a, mesh, (Partial(), R))
    with ap.CommDebugMode() as comm:
        s = p + q.redistribute_like(p) if hasattr(q, "redistribute_like") else p + ap.reshard(q, mesh, [Partial(), Partial()])
    assert list(s.placements) == [Partial(), Partial()] and comm.get_total_counts() == 0
    assert _close(s.full_tensor(), 2 * a)
    assert _close((p + q).full_tensor(), 2 * a)
    assert _close(torch.relu(p).full_tensor(), torch.relu(a))
    assert _close(torch.where(da > 0, da, db).full_tensor(), torch.where(a > 0, a, b))
    z = torch.tensor(2.5)  # a 0-dim plain tensor behaves like a scalar
    assert _close((p * z + z).full_tensor(), a * 2.5 + 2.5)
    return True


def test_pointwise_broadcast_and_partial(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_pointwise))


def _isin(rank: int) -> bool:
    # ``isin`` (transformers' generation checks stop tokens with it): the output keeps the
    # elements' sharding, the tested values are made whole; no collective for sharded elements
    mesh = _mesh2()
    ids = torch.randint(0, 10, (5, 6), generator=torch.Generator().manual_seed(0))
    stop = torch.tensor([1, 3, 7])
    x = make_dist(ids, mesh, (Shard(0), Shard(1)))
    with ap.CommDebugMode() as comm:
        got = torch.isin(x, ap.shard_tensor(stop, mesh, [R, R]))
    assert list(got.placements) == [Shard(0), Shard(1)] and comm.get_total_counts() == 0
    assert torch.equal(got.full_tensor(), torch.isin(ids, stop))
    split = make_dist(stop, mesh, (Shard(0), R))  # tested values sharded: gathered first
    assert torch.equal(torch.isin(x, split, invert=True).full_tensor(), torch.isin(ids, stop, invert=True))
    assert torch.equal(torch.isin(x, 3).full_tensor(), torch.isin(ids, 3))
    return True


def test_isin_keeps_the_elements_sharding(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_isin))


def _buckets_and_histograms(rank: int) -> bool:
    # bucketize / searchsorted keep the values' sharding (boundaries whole), histc over a given
    # range sums the pieces' histograms (Partial), all without a collective; histc without a
    # range and bincount (its length is the largest value + 1) run replicated, by rule: no warning
    mesh = _mesh2()
    a = reference((6, 5), 9)
    bounds = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    x = make_dist(a, mesh, (Shard(0), Shard(1)))
    with warnings.catch_warnings(), ap.CommDebugMode() as comm:
        warnings.simplefilter("error")
        b = torch.bucketize(x, ap.shard_tensor(bounds, mesh, [R, R]), right=True)
        s = torch.searchsorted(ap.shard_tensor(bounds, mesh, [R, R]), x)
        h = torch.histc(x, bins=5, min=-2.0, max=2.0)
    assert comm.get_total_counts() == 0
    assert list(b.placements) == [Shard(0), Shard(1)] and torch.equal(b.full_tensor(), torch.bucketize(a, bounds, right=True))
    assert list(s.placements) == [Shard(0), Shard(1)] and torch.equal(s.full_tensor(), torch.searchsorted(bounds, a))
    assert list(h.placements) == [Partial(), Partial()] and torch.equal(h.full_tensor(), torch.histc(a, bins=5, min=-2.0, max=2.0))
    ints = torch.randint(0, 7, (12,), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _close(torch.histc(x, bins=4).full_tensor(), torch.histc(a, bins=4))
        assert torch.equal(torch.bincount(make_dist(ints, mesh, (Shard(0), R))).full_tensor(), torch.bincount(ints))
    return True


def test_bucketize_searchsorted_histc_bincount(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_buckets_and_histograms))


def _tensor_split(rank: int) -> bool:
    # split points given as a tensor: torch reads their values from memory, which a DistTensor
    # does not have ("data is not allocated"); as a DistTensor they are taken whole
    mesh = _mesh1()
    a = reference((5, 6, 5), 5)
    x = make_dist(a, mesh, (Shard(0),))
    for points in (torch.tensor([1, 4]), torch.tensor(3), [2, 3], 4):
        want = torch.tensor_split(a, points, dim=1)
        for at in (points, make_dist(points, mesh, (R,)) if isinstance(points, torch.Tensor) else points):
            for got in (torch.tensor_split(x, at, dim=1), x.tensor_split(at, dim=1)):
                assert len(got) == len(want) and all(_close(g.full_tensor(), w) for g, w in zip(got, want))
    return True


def test_tensor_split_at_a_dist_tensor_of_points(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_tensor_split))


def _reductions(rank: int) -> bool:
    mesh = _mesh1()
    a = reference((7, 5), 2)  # uneven over 4 ranks
    for pl in ([Shard(0)], [Shard(1)], [R], [Partial()]):
        d = make_dist(a, mesh, tuple(pl))
        assert _close(d.sum().full_tensor(), a.sum())
        assert _close(d.mean().full_tensor(), a.mean())
        assert _close(d.sum(0).full_tensor(), a.sum(0))
        assert _close(d.mean(1, keepdim=True).full_tensor(), a.mean(1, keepdim=True))
    d = make_dist(a, mesh, (Shard(0),))
    with ap.CommDebugMode() as comm:
        s = d.sum(0)
    assert list(s.placements) == [Partial()] and comm.get_total_counts() == 0
    return True


def test_sum_mean_uneven_and_partial(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_reductions))


def _matmuls(rank: int) -> bool:
    mesh = _mesh2()
    a, b, c = reference((4, 6), 3), reference((6, 5), 4), reference((5,), 5)
    for pa, pb in [((Shard(0), R), (R, Shard(1))), ((R, Shard(1)), (R, Shard(0))), ((Partial(), R), (R, R)), ((Shard(1), Shard(0)), (Shard(0), R))]:
        da, db = make_dist(a, mesh, pa), make_dist(b, mesh, pb)
        assert _close((da @ db).full_tensor(), a @ b), (pa, pb)
        dc = make_dist(c, mesh, (R, R))
        assert _close(torch.addmm(dc, da, db).full_tensor(), torch.addmm(c, a, b))
    x3, w = reference((2, 3, 6), 6), reference((5, 6), 7)
    dx, dw = make_dist(x3, mesh, (Shard(0), R)), make_dist(w, mesh, (R, Shard(0)))
    assert _close(F.linear(dx, dw).full_tensor(), F.linear(x3, w))
    y3 = reference((2, 6, 4), 8)
    dy = make_dist(y3, mesh, (Shard(0), Shard(2)))
    assert _close(torch.bmm(dx, dy).full_tensor(), torch.bmm(x3, y3))
    assert _close(torch.matmul(dx, dy).full_tensor(), torch.matmul(x3, y3))
    return True


def test_matmul_family(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_matmuls))


def _views(rank: int) -> bool:
    mesh = _mesh1()
    a = reference((8, 3, 2), 9)
    d = make_dist(a, mesh, (Shard(0),))
    with ap.CommDebugMode() as comm:
        v = d.view(8, 6)
        f = d.reshape(48)  # merging a sharded leading dim stays sharded when exact
    assert comm.get_total_counts() == 0 and list(f.placements) == [Shard(0)]
    assert _close(v.full_tensor(), a.view(8, 6)) and _close(f.full_tensor(), a.reshape(48))
    u = make_dist(reference((6, 4), 10), mesh, (Shard(0),))  # 6 rows over 4 ranks: not exact
    assert _close(u.reshape(24).full_tensor(), reference((6, 4), 10).reshape(24))
    t = d.transpose(0, 2)
    assert list(t.placements) == [Shard(2)] and _close(t.full_tensor(), a.transpose(0, 2))
    assert _close(d.permute(2, 0, 1).full_tensor(), a.permute(2, 0, 1))
    assert _close(d.unsqueeze(1).squeeze(1).full_tensor(), a)
    one_row = make_dist(reference((4, 3), 19), mesh, (Shard(0),))  # local shards are (1, 3)
    assert tuple(one_row.squeeze().shape) == (4, 3)
    assert _close(one_row.squeeze().full_tensor(), reference((4, 3), 19))
    m = make_dist(reference((5, 4), 11), mesh, (Shard(1),))
    assert _close(m.t().full_tensor(), reference((5, 4), 11).t())
    full = reference((4, 2, 6), 12)
    strided = full[rank:rank + 1, :, 1:5]  # a non-contiguous local shard: views must still work
    g = ap.dtensor_from_local(strided, mesh, [Shard(0)])
    assert _close(g.reshape(4, 8).full_tensor(), full[:, :, 1:5].reshape(4, 8))
    return True


def test_views_and_transposes(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_views))


@torch.library.custom_op("ap_test::scaled_cumsum", mutates_args=())
def scaled_cumsum(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A user op no rule knows: it must run replicated, be correct, and warn once."""
    return torch.cumsum(x, dim=1) * scale


@scaled_cumsum.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _fallback(rank: int) -> tuple[int, bool]:
    mesh = _mesh1()
    a = reference((6, 4), 12)
    d = make_dist(a, mesh, (Shard(0),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c1 = scaled_cumsum(d, 2.0)
        c2 = scaled_cumsum(d, 2.0)
    names = [str(w.message) for w in caught if "scaled_cumsum" in str(w.message)]
    expected = torch.cumsum(a, 1) * 2.0
    ok = _close(c1.full_tensor(), expected) and _close(c2.full_tensor(), expected)
    return len(names), ok


def test_op_without_rule_falls_back_and_warns_once(world4):  # type: ignore[no-untyped-def]
    for count, ok in world4.run(_fallback):
        assert ok and count == 1


def _outside_mesh(rank: int) -> bool:
    mesh = ap.ProcessMesh([1, 3], ["x"])
    a = reference((4, 6), 13)
    d = ap.shard_tensor(a, mesh, [Shard(1)])
    out = (d * 2).sum(0)
    assert tuple(out.shape) == (6,) and list(out.placements) == [Shard(0)]
    if rank in (1, 3):
        assert _close(out.full_tensor(), (a * 2).sum(0))
        assert out.to_local().shape == (3,)
    else:
        assert d.to_local().numel() == 0 and out.to_local().numel() == 0
    return True


def test_ranks_outside_mesh_hold_empty_and_skip(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_outside_mesh))


# ---- autograd through the conversions ------------------------------------------------------
def _conversion_grads(rank: int) -> bool:
    mesh = _mesh1()
    a = reference((8, 3), 14).requires_grad_(True)
    d = ap.shard_tensor(a, mesh, [Shard(0)])
    r = ap.reshard(d, mesh, [R])  # S -> R; backward R -> S
    (r * torch.arange(3.0).expand(8, 3).contiguous().sum() if False else r).sum().backward()
    assert _close(a.grad, torch.ones(8, 3))
    local = torch.ones(2, 3, requires_grad=True)
    d2 = ap.dtensor_from_local(local, mesh, [Shard(0)])
    (d2.full_tensor() * 3).sum().backward()
    assert _close(local.grad, torch.full((2, 3), 3.0))
    local_p = torch.full((2, 3), float(rank), requires_grad=True)
    p = ap.dtensor_from_local(local_p, mesh, [Partial()])
    rp = ap.reshard(p, mesh, [R])  # P -> R; the gradient of every summand is the full gradient
    assert _close(rp.full_tensor(), torch.full((2, 3), 6.0))
    (rp * 2).sum().backward()
    assert _close(local_p.grad, torch.full((2, 3), 2.0))
    b = ap.shard_tensor(reference((4, 4), 15), mesh, [Shard(1)]).requires_grad_(True)
    b.to_local().sum().backward()
    assert list(b.grad.placements) == [Shard(1)] and _close(b.grad.full_tensor(), torch.ones(4, 4))
    return True


def test_gradients_through_conversions(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_conversion_grads))


def _single_axis_collectives(rank: int) -> dict:
    mesh = _mesh1()
    a = reference((8, 8), 16)
    seen = {}
    for name, src, dst in [
        ("S->R", (Shard(0),), [R]), ("P->R", (Partial(),), [R]), ("P->S", (Partial(),), [Shard(1)]),
        ("S0->S1", (Shard(0),), [Shard(1)]), ("R->S", (R,), [Shard(0)]), ("R->P", (R,), [Partial()]),
    ]:
        x = make_dist(a, mesh, src)
        with ap.CommDebugMode() as comm:
            y = ap.reshard(x, mesh, dst)
        seen[name] = comm.get_comm_counts()
        assert _close(y.full_tensor(), a)
    return seen


def test_single_axis_transitions_issue_one_collective(world4):  # type: ignore[no-untyped-def]
    seen = world4.run(_single_axis_collectives)[0]
    assert seen == {
        "S->R": {"all_gather": 1}, "P->R": {"all_reduce": 1}, "P->S": {"reduce_scatter": 1},
        "S0->S1": {"all_to_all": 1}, "R->S": {}, "R->P": {},
    }


# ---- two stages on disjoint meshes (naive pipeline): forward and backward cross meshes ------
def _two_stage(rank: int) -> bool:
    torch.manual_seed(3)
    x, t = torch.randn(4, 6), torch.randn(4, 2)
    l1, l2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
    ref = (l2(torch.tanh(l1(x))) - t).square().mean()
    ref.backward()
    stage0, stage1 = ap.ProcessMesh([0, 1], ["mp"]), ap.ProcessMesh([2, 3], ["mp"])
    w1 = ap.shard_tensor(torch.nn.Parameter(l1.weight.detach().clone()), stage0, [Shard(0)])
    b1 = ap.shard_tensor(torch.nn.Parameter(l1.bias.detach().clone()), stage0, [Shard(0)])
    w2 = ap.shard_tensor(torch.nn.Parameter(l2.weight.detach().clone()), stage1, [Shard(1)])
    b2 = ap.shard_tensor(torch.nn.Parameter(l2.bias.detach().clone()), stage1, [R])
    h = torch.tanh(F.linear(ap.shard_tensor(x, stage0, [R]), w1, b1))   # stage 0
    h = ap.reshard(h, stage1, [Shard(1)])                                 # send to stage 1
    loss = (F.linear(h, w2, b2) - ap.shard_tensor(t, stage1, [R])).square().mean()
    loss.backward()
    if rank in (2, 3):
        assert _close(loss.detach().full_tensor(), ref.detach())
        assert _close(w2.grad.full_tensor(), l2.weight.grad) and _close(b2.grad.full_tensor(), l2.bias.grad)
    else:
        assert loss.to_local().numel() == 0
        assert _close(w1.grad.full_tensor(), l1.weight.grad) and _close(b1.grad.full_tensor(), l1.bias.grad)
    return True


def test_two_stage_pipeline_forward_backward_across_meshes(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_two_stage))


def _inplace_keeps_meaning(rank: int) -> bool:
    mesh = _mesh1()
    a, b = reference((4, 4), 20), reference((4, 4), 21)
    x = make_dist(a, mesh, (R,))
    y = make_dist(b, mesh, (Partial(),))
    x.mul_(y)  # (R, P) -> P is a valid out-of-place strategy but x must stay a true Replicate
    assert list(x.placements) == [R] and _close(x.full_tensor(), a * b)
    z = make_dist(a, mesh, (Shard(0),))
    out = make_dist(torch.zeros(4, 4), mesh, (Shard(1),))
    r = torch.add(z, y, out=out)
    assert r is out and list(out.placements) == [Shard(1)] and _close(out.full_tensor(), a + b)
    return True


def test_inplace_and_out_ops_keep_layout_and_value(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_inplace_keeps_meaning))


def _write_through_view(rank: int) -> str:
    mesh = _mesh1()
    z = ap.shard_tensor(torch.ones(8, 4), mesh, [Shard(1)])
    z[1:3] = 0  # slicing an unsharded dim: a true view, the write lands
    assert _close(z.full_tensor().sum(), torch.tensor(24.0))
    y = ap.shard_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    y[1:3] = 0  # slicing the sharded dim takes a gathered copy: the write is carried back, not lost
    want = torch.ones(8, 4)
    want[1:3] = 0
    return "landed" if torch.equal(y.full_tensor(), want) else "lost"


def test_write_through_a_moved_view_lands(world4):  # type: ignore[no-untyped-def]
    assert world4.run(_write_through_view) == ["landed"] * 4


def _mean_cross_entropy_with_ignored_targets(rank: int) -> tuple[bool, bool, dict[str, int], list[object]]:
    mesh = _mesh1()
    logits = reference((8, 5), 21).requires_grad_()
    target = torch.tensor([0, 4, 1, 3, -100, -100, -100, 2])  # rank 2 counts no token, rank 3 one
    d = make_dist(logits.detach(), mesh, (Shard(0),)).requires_grad_()
    t = make_dist(target, mesh, (Shard(0),))
    with ap.CommDebugMode() as comm:
        loss = F.cross_entropy(d, t)
    loss.backward()
    ref = F.cross_entropy(logits, target)
    ref.backward()
    assert d.grad is not None and logits.grad is not None
    same = _close(loss.full_tensor(), ref) and _close(d.grad.full_tensor(), logits.grad)
    return same, loss.to_local().numel() == 1, comm.get_comm_counts(), list(loss.placements)


def test_mean_cross_entropy_over_batch_shards_is_the_global_mean(world4):  # type: ignore[no-untyped-def]
    # the mean divides by the count of counted targets over every shard (not a mean of per-rank
    # means): the sum and the count travel in one all-reduce and the loss is Replicate
    for same, scalar, comm, placements in world4.run(_mean_cross_entropy_with_ignored_targets):
        assert same and scalar
        assert comm == {"all_reduce": 1} and placements == [Replicate()], (comm, placements)
