"""User extension points: register_rule for a custom op, local_map, LocalLayer."""

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


def test_registered_rule_for_custom_op(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_custom_rule))


def test_local_map_and_local_layer(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_local_map))


def test_custom_rule_keeps_a_strided_input(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_custom_rule_keeps_strided))
