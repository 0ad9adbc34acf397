"""User extension points: register_rule for a custom op, local_map, LocalLayer (whichever of them a script names first, `ap.local_map` stays the function)."""

from __future__ import annotations

import warnings

import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from spmd_rules import AxisStrategy, OpCall
from tests.layouts import make_dist, reference


@torch.library.custom_op("ap_test::scan_scale", mutates_args=())
def scan_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.cumsum(x, dim=1) * scale


@scan_scale.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@ap.register_axis_rule(torch.ops.ap_test.scan_scale.default)
def scan_scale_rule(call: OpCall, axis: int, axis_size: int) -> list[AxisStrategy]:
    x = call.inputs[0]
    options = [AxisStrategy((Replicate(),), (Replicate(),)), AxisStrategy((Partial(),), (Partial(),))]
    return options + [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != 1]


@torch.library.custom_op("ap_test::row_norm", mutates_args=())
def row_norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@row_norm.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@ap.register_axis_rule(torch.ops.ap_test.row_norm.default)
@ap.with_strided  # rows are independent: a strided row split stays where it is
def row_norm_rule(call: OpCall, axis: int, axis_size: int) -> list[AxisStrategy]:
    x = call.inputs[0]
    return [AxisStrategy((Replicate(),), (Replicate(),))] + [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(x.ndim - 1)]


def _custom_rule_keeps_strided(rank: int) -> bool:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]])
    a = reference((4, 6, 5), 3)
    flat = ap.shard_tensor(a, mesh, [Shard(0), Shard(1)]).view(24, 5)  # [S(0), S(0/4)]
    with ap.CommDebugMode() as comm:
        out = row_norm(flat)
    assert comm.get_total_counts() == 0 and list(out.placements) == list(flat.placements), comm.summary()
    assert torch.allclose(out.full_tensor(), a.view(24, 5) / a.view(24, 5).norm(dim=-1, keepdim=True), atol=1e-6)
    return True


def _custom_rule(rank: int) -> bool:
    mesh = ap.ProcessMesh([0, 1, 2, 3])
    a = reference((7, 5), 1)
    for pl in [(Shard(0),), (Partial(),), (Shard(1),)]:
        d = make_dist(a, mesh, pl)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a registered rule must not fall back
            with ap.CommDebugMode() as comm:
                out = scan_scale(d, 3.0)
        expected_comm = 1 if pl == (Shard(1),) else 0  # the scan dim must be gathered first
        assert comm.get_total_counts() == expected_comm, (pl, comm.summary())
        if pl == (Shard(1),):  # moved off the scan dim: an all-to-all to S(0) beats gathering
            assert out.placements[0] == Shard(0) and comm.get_comm_counts() == {"all_to_all": 1}
        else:
            assert out.placements[0] == pl[0]
        assert torch.allclose(out.full_tensor(), torch.cumsum(a, 1) * 3.0, atol=1e-5)
    return True


def _local_map(rank: int) -> bool:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]])
    a = reference((8, 6), 2).requires_grad_(True)
    x = ap.shard_tensor(a, mesh, [Shard(0), Shard(1)])

    def rowsum_sq(t: torch.Tensor) -> torch.Tensor:  # per shard: partial row sums
        return (t * t).sum(dim=1)

    f = ap.local_map(rowsum_sq, out_placements=[Shard(0), Partial()])
    y = f(x)
    assert list(y.placements) == [Shard(0), Partial()] and tuple(y.shape) == (8,)
    ref = (a.detach() * a.detach()).sum(1)
    assert torch.allclose(y.full_tensor(), ref, atol=1e-5)
    y.full_tensor().sum().backward()
    assert torch.allclose(a.grad, 2 * a.detach(), atol=1e-5)
    g = ap.local_map(lambda t: t * 2, out_placements=[Replicate(), Replicate()], in_placements=[[Replicate(), Replicate()]])
    assert torch.allclose(g(x).full_tensor(), a.detach() * 2)

    class LocalNorm(ap.LocalLayer):
        def __init__(self) -> None:
            super().__init__([(mesh, [Shard(0), Partial()])])

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t.square().sum(dim=1)

    z = LocalNorm()(x)
    assert torch.allclose(z.full_tensor(), ref, atol=1e-5)
    return True


def _softmax_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.softmax(a @ b, -1)


def _local_map_grad_placements(rank: int) -> bool:
    """A Replicate input used against a sharded one: its local gradient is a per-rank
    contribution, declared Partial with in_grad_placements; the default warns."""
    x0, w0 = reference((8, 6), 4), reference((6, 5), 5)
    xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (_softmax_mm(xr, wr) ** 2).sum().backward()

    mesh = ap.ProcessMesh([0, 1, 2, 3])  # 1-d: x split by rows, w whole on every rank
    f = ap.local_map(_softmax_mm, [Shard(0)], [[Shard(0)], [Replicate()]],
                     in_grad_placements=[None, [Partial()]])
    x = ap.shard_tensor(x0.clone(), mesh, [Shard(0)]).requires_grad_(True)
    w = ap.shard_tensor(w0.clone(), mesh, [Replicate()]).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declared: nothing to warn about
        y = f(x, w)
    assert torch.allclose(y.full_tensor(), _softmax_mm(x0, w0), atol=1e-6)
    (y**2).sum().backward()
    assert torch.allclose(x.grad.full_tensor(), xr.grad, atol=1e-6)
    assert torch.allclose(w.grad.full_tensor(), wr.grad, atol=1e-6), (w.grad, wr.grad)

    # 2-d, Megatron-like: x rows on axis 0 and whole along axis 1, w columns on axis 1 and whole
    # along axis 0: each input's gradient is a contribution on the axis where it is whole
    mesh2 = ap.ProcessMesh([[0, 1], [2, 3]])
    mm = ap.local_map(torch.matmul, [Shard(0), Shard(1)], [[Shard(0), Replicate()], [Replicate(), Shard(1)]],
                      in_grad_placements=[[Shard(0), Partial()], [Partial(), Shard(1)]])
    x, w = (ap.shard_tensor(x0.clone(), mesh2, [Shard(0), Replicate()]).requires_grad_(True),
            ap.shard_tensor(w0[:, :4].clone(), mesh2, [Replicate(), Shard(1)]).requires_grad_(True))
    xr, wr = x0.clone().requires_grad_(True), w0[:, :4].clone().requires_grad_(True)
    (torch.sin(xr @ wr)).sum().backward()
    y = mm(x, w)
    assert torch.allclose(y.full_tensor(), x0 @ w0[:, :4], atol=1e-5)
    torch.sin(y).sum().backward()
    assert torch.allclose(x.grad.full_tensor(), xr.grad, atol=1e-5)
    assert torch.allclose(w.grad.full_tensor(), wr.grad, atol=1e-5)

    # the default (torch's: the gradient in the input's own placements) warns, once per function
    g = ap.local_map(_softmax_mm, [Shard(0)], [[Shard(0)], [Replicate()]])
    x = ap.shard_tensor(x0.clone(), mesh, [Shard(0)]).requires_grad_(True)
    w = ap.shard_tensor(w0.clone(), mesh, [Replicate()]).requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g(x, w), g(x, w)
    said = [str(c.message) for c in caught if "in_grad_placements" in str(c.message)]
    assert len(said) == 1 and "in_grad_placements=[None, [Partial('sum')]]" in said[0], said
    return True


class _SoftmaxMM(ap.LocalLayer):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _softmax_mm(a, b)


def _local_layer_grad_dist_attrs(rank: int) -> bool:
    """LocalLayer's grad_dist_attrs (Paddle's): the Replicate weight's local gradient declared
    Partial equals one process; left out, the layer warns once; a mesh other than the argument's
    raises before any collective."""
    x0, w0 = reference((8, 6), 4), reference((6, 5), 5)
    xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (_softmax_mm(xr, wr) ** 2).sum().backward()
    mesh = ap.ProcessMesh([0, 1, 2, 3])
    layer = _SoftmaxMM([(mesh, [Shard(0)])], grad_dist_attrs=[None, (mesh, [Partial()])])
    x = ap.shard_tensor(x0.clone(), mesh, [Shard(0)]).requires_grad_(True)
    w = ap.shard_tensor(w0.clone(), mesh, [Replicate()]).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = layer(x, w)
    (y**2).sum().backward()
    assert torch.allclose(y.full_tensor(), _softmax_mm(x0, w0), atol=1e-6)
    assert torch.allclose(x.grad.full_tensor(), xr.grad, atol=1e-6)
    assert torch.allclose(w.grad.full_tensor(), wr.grad, atol=1e-6)

    plain = _SoftmaxMM([(mesh, [Shard(0)])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain(x, w), plain(x, w)
    said = [str(c.message) for c in caught if "grad_dist_attrs" in str(c.message)]
    assert len(said) == 1 and "grad_dist_attrs=[None, (mesh, [Partial('sum')])]" in said[0], said

    other = ap.ProcessMesh([[0, 1], [2, 3]])
    bad = _SoftmaxMM([(mesh, [Shard(0)])], grad_dist_attrs=[None, (other, [Partial(), Replicate()])])
    try:
        bad(x, w)
    except ValueError as e:
        assert "grad_dist_attrs[1]" in str(e)
    else:
        raise AssertionError("a gradient mesh other than the argument's must raise")
    return True


def _local_map_call_errors(rank: int) -> bool:
    """A DistTensor by keyword and a tuple result against one placement list raise clearly,
    the same error on every rank, before any output is assembled."""
    mesh = ap.ProcessMesh([0, 1, 2, 3])
    x0, b0 = reference((8, 6), 6), reference((6,), 7)
    x = ap.shard_tensor(x0, mesh, [Shard(0)])
    b = ap.shard_tensor(b0.clone(), mesh, [Replicate()]).requires_grad_(True)

    add = ap.local_map(lambda a, bias=None: a + bias, [Shard(0)], [[Shard(0)]])
    try:
        add(x, bias=b)
        raise AssertionError("a DistTensor keyword argument was accepted")
    except TypeError as e:
        assert "keyword argument bias= is a DistTensor" in str(e) and "pass it positionally" in str(e), e
    # positionally, with its placements (and its gradient's) at its position, it works
    add = ap.local_map(lambda a, bias=None: a + bias, [Shard(0)], [[Shard(0)], [Replicate()]],
                       in_grad_placements=[None, [Partial()]])
    y = add(x, b)
    assert torch.allclose(y.full_tensor(), x0 + b0)
    y.sum().backward()
    assert torch.allclose(b.grad.full_tensor(), torch.full((6,), 8.0))

    pair = ap.local_map(lambda a: (a, a * 2), [Shard(0)])
    with ap.CommDebugMode() as comm:
        try:
            pair(x)
            raise AssertionError("a tuple result was accepted against one placement list")
        except ValueError as e:
            assert "returned a tuple of 2 values" in str(e) and "out_placements=[[S(0)], [S(0)]]" in str(e), e
    assert comm.get_total_counts() == 0, comm.summary()
    number = ap.local_map(lambda a: (a, 3), [[Shard(0)], [Replicate()]])
    try:
        number(x)
        raise AssertionError("a non-tensor output with placements was accepted")
    except ValueError as e:
        assert "output 1 has type int" in str(e), e
    return True


def test_registered_rule_for_custom_op(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_custom_rule))


def test_local_map_and_local_layer(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_local_map))


def test_local_map_in_grad_placements(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_local_map_grad_placements))


def test_local_layer_grad_dist_attrs(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_local_layer_grad_dist_attrs))


def test_local_map_call_errors(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_local_map_call_errors))


def test_custom_rule_keeps_a_strided_input(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_custom_rule_keeps_strided))
