"""Paddle's static semi-auto form on the dynamic engine: ``shard_tensor`` with a dims mapping as a
bare annotation in ``forward`` (the parameter laid out in place, once), ``shard_op`` laying an
op's inputs and outputs out, and the errors — each the same on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel import Replicate, Shard

R = Replicate()
STEPS, BATCH, IN, INNER, OUT = 3, 8, 8, 16, 4


class SimpleNet(nn.Module):
    """The primer's SimpleNet, written as Paddle's static program: layouts annotated in forward.

    torch's Linear weight is (out_features, in_features), Paddle's is (in, out): Paddle's
    column-parallel ``[None, "mp"]`` on linear1's weight is ``["mp", None]`` here, and its
    row-parallel ``["mp", None]`` on linear2's weight is ``[None, "mp"]``. ``mesh=None``: the
    single-device program (no annotations) the parallel one must equal.
    """

    def __init__(self, mesh: ap.ProcessMesh | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.linear1 = nn.Linear(IN, INNER)
        self.linear2 = nn.Linear(INNER, IN)
        self.linear3 = nn.Linear(IN, OUT)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh
        if mesh is None:
            return self.relu(self.linear3(self.linear2(self.linear1(x))))
        ap.shard_tensor(self.linear1.weight, mesh, ["mp", None])  # column-parallel: out features split
        ap.shard_tensor(self.linear1.bias, mesh, ["mp"])
        ap.shard_tensor(self.linear2.weight, mesh, [None, "mp"])  # row-parallel: in features split
        x = self.linear1(x)
        x = self.linear2(x)
        matmul = ap.shard_op(torch.matmul, mesh, [[None, None], [None, None]])
        x = matmul(x, self.linear3.weight.t()) + self.linear3.bias  # [batch, IN] @ [IN, OUT]
        return self.relu(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(_full(loss)))
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, ap.DistTensor) else t).detach().clone()


def _static_simplenet(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    torch.manual_seed(0)
    model = SimpleNet(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built BEFORE the first forward
    before = dict(model.named_parameters())
    losses = _train(model, opt)
    after = dict(model.named_parameters())
    w1 = model.linear1.weight
    again = ap.shard_tensor(w1, mesh, ["mp", None])  # an annotation of a laid-out parameter: itself
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in after.items()},
        "same_objects": all(after[n] is before[n] for n in before),
        "optimizer_holds_them": [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in before.values()],
        "placements": {n: list(p.placements) for n, p in after.items() if isinstance(p, ap.DistTensor)},
        "is_parameter": all(isinstance(p, nn.Parameter) for p in after.values()),
        "again_is_it": again is w1,
        "local_w1": tuple(w1.to_local().shape),
    }


def test_the_static_simplenet_trains_like_one_process(world2: Any) -> None:
    torch.manual_seed(0)
    ref = SimpleNet(None)
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    for o in world2.run(_static_simplenet):
        assert o["same_objects"] and o["optimizer_holds_them"] and o["is_parameter"] and o["again_is_it"]
        assert o["placements"]["linear1.weight"] == [Shard(0)] and o["placements"]["linear1.bias"] == [Shard(0)]
        assert o["placements"]["linear2.weight"] == [Shard(1)]
        assert o["local_w1"] == (INNER // 2, IN)
        for got, want in zip(o["losses"], ref_losses, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (o["losses"], ref_losses)
        for n, want in ref_params.items():
            rel = (o["params"][n] - want).norm() / want.norm()
            assert rel <= 1e-5, (n, float(rel))


def _shard_op(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    torch.manual_seed(0)
    x, w = torch.randn(4, 6), torch.randn(6, 8)
    col = ap.shard_op(torch.matmul, mesh, [[None, None], [None, "mp"]])(x, w)  # plain in, laid out
    full = ap.shard_op(torch.matmul, mesh, [None, [None, "mp"]], [[None, None]])(ap.shard_tensor(x, mesh, [R]), w)
    lin = nn.Linear(6, 8)
    want = lin(x).detach()
    y = ap.shard_op(lin, mesh, [["mp", None]], [[None, "mp"]])(x)  # a module; its output laid out
    pair = ap.shard_op(torch.chunk, mesh, [[None, None]], [[None, "mp"], None])(x, 2, dim=0)
    return {
        "col": (list(col.placements), col.full_tensor()), "full": (list(full.placements), full.full_tensor()),
        "y": (list(y.placements), y.full_tensor().detach(), want), "ref": x @ w,
        "pair": (type(pair).__name__, list(pair[0].placements), list(pair[1].placements)),
        "name": ap.shard_op(torch.matmul, mesh).__name__,
    }


def test_shard_op_lays_inputs_and_outputs_out(world2: Any) -> None:
    for o in world2.run(_shard_op):
        assert o["col"][0] == [Shard(1)] and o["full"][0] == [R] and o["y"][0] == [Shard(1)]
        torch.testing.assert_close(o["col"][1], o["ref"])
        torch.testing.assert_close(o["full"][1], o["ref"])
        torch.testing.assert_close(o["y"][1], o["y"][2])
        assert o["pair"] == ("tuple", [Shard(1)], [R]) and o["name"] == "shard_op(matmul)"


# ---- errors: each the same on every rank, before any collective; the world survives --------------
def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1], dim_names=["mp"])


def _wrong_length(rank: int) -> None:
    ap.shard_tensor(torch.ones(4, 6), _mesh(), [None])


def _unknown_axis(rank: int) -> None:
    ap.shard_tensor(torch.ones(4, 6), _mesh(), ["dp", None])


def _axis_twice(rank: int) -> None:
    ap.shard_tensor(torch.ones(4, 6), _mesh(), ["mp", "mp"])


def _mixed(rank: int) -> None:
    ap.shard_tensor(torch.ones(4, 6), _mesh(), [Shard(0), None])


def _reshard_wrong_length(rank: int) -> None:
    ap.reshard(ap.shard_tensor(torch.ones(4, 6), _mesh(), [R]), _mesh(), ["mp"])


def _annotated_twice(rank: int) -> None:
    lin = nn.Linear(6, 4)
    ap.shard_tensor(lin.weight, _mesh(), ["mp", None])
    ap.shard_tensor(lin.weight, _mesh(), [None, "mp"])


def _annotated_then_placements(rank: int) -> tuple[bool, list[Any], list[Any], bool]:
    """Placements on a laid-out parameter reshard a copy (``ap.reshard``); the parameter stays."""
    lin = nn.Linear(6, 4)
    w = ap.shard_tensor(lin.weight, _mesh(), ["mp", None])
    copy = ap.shard_tensor(lin.weight, _mesh(), [R])
    return copy is w, list(w.placements), list(copy.placements), bool(torch.equal(copy.full_tensor(), w.full_tensor()))


def _annotated_after_use(rank: int) -> None:
    lin = nn.Linear(6, 4)
    y = lin(torch.ones(2, 6, requires_grad=True))  # its graph holds the weight until backward
    ap.shard_tensor(lin.weight, _mesh(), ["mp", None])
    del y


def _shard_op_inputs(rank: int) -> None:
    ap.shard_op(torch.matmul, _mesh(), [[None, None]])(torch.ones(4, 6), torch.ones(6, 2))


def _shard_op_outputs(rank: int) -> None:
    ap.shard_op(torch.matmul, _mesh(), None, [[None, None], [None, None]])(torch.ones(4, 6), torch.ones(6, 2))


def _shard_op_bad_output_mapping(rank: int) -> None:
    ap.shard_op(torch.matmul, _mesh(), None, [[None, "pp"]])(torch.ones(4, 6), torch.ones(6, 2))


def _catch(rank: int, fn: Any) -> str:
    try:
        fn(rank)
    except ValueError as e:
        return str(e)
    return "no error"


CASES = [
    (_wrong_length, "dims mapping [None] has 1 entries for a 2-d tensor of shape (4, 6)"),
    (_unknown_axis, "names mesh axis 'dp', which mesh ProcessMesh([0, 1], dim_names=['mp']) lacks; its axes are ['mp']"),
    (_axis_twice, "uses mesh axis 'mp' for tensor dims [0, 1]"),
    (_mixed, "mixes placements [Shard(0)] with mesh-axis names/None"),
    (_reshard_wrong_length, "reshard: dims mapping ['mp'] has 1 entries for a 2-d tensor"),
    (_annotated_twice, "already laid out as [Shard(0)] on ProcessMesh([0, 1], dim_names=['mp']); annotating it as [Shard(1)]"),
    (_annotated_after_use, "something besides its Python object holds this parameter's tensor"),
    (_shard_op_inputs, "1 in_dims_mappings [[None, None]] for 2 tensor inputs"),
    (_shard_op_outputs, "2 out_dims_mappings [[None, None], [None, None]] for 1 tensor outputs"),
    (_shard_op_bad_output_mapping, "shard_op (out_dims_mappings[0]): dims mapping [None, 'pp'] names mesh axis 'pp'"),
]


def _healthy(rank: int) -> bool:
    x = ap.shard_tensor(torch.arange(8.0), _mesh(), ["mp"])
    return bool(torch.equal(x.full_tensor(), torch.arange(8.0)))


@pytest.mark.parametrize("fn,text", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_bad_input_raises_the_same_error_on_every_rank(world2: Any, fn: Any, text: str) -> None:
    messages = world2.run(_catch, fn, timeout=60)
    assert len(set(messages)) == 1, messages
    assert text in messages[0], messages[0]
    assert all(world2.run(_healthy))


def test_placements_on_an_annotated_parameter_reshard_a_copy(world2: Any) -> None:
    for same, own, copy, equal in world2.run(_annotated_then_placements):
        assert not same and own == [Shard(0)] and copy == [R] and equal
