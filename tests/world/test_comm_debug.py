"""``ap.CommDebugMode`` names who issued each collective: the module (its path in the root model)
whose forward or backward ran, the aten op whose dispatch issued it (None: an explicit reshard,
such as a parallel style's output move), and the wall time of the call; ``summary(by=...)``
tabulates count, bytes and time per module, op or kind.

World part (2 gloo ranks): a tensor-parallel Linear pair (column- then row-parallel) inside an
MLP, laid out by hand and by ``ap.parallelize``. Pure part: the module stack, a module's own
forward hooks, the backward, and the tables, on records made by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Replicate as R
from autoparallel import Shard as S
from autoparallel.runtime import debug


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.norm = MLP(), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.mlp(x))


def _rows(comm: ap.CommDebugMode) -> list[tuple[str, str | None, str | None]]:
    return [(r.kind, r.module, r.op) for r in comm.records]


def _by_hand(rank: int) -> dict[str, Any]:
    """fc1 column-parallel, fc2 row-parallel (its output Partial): the LayerNorm that takes it
    all-reduces it; in the backward, the LayerNorm's backward all-reduces, and fc1's backward
    leaves the input's gradient Partial, all-reduced as it is accumulated into ``x.grad``."""
    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    net = Net()
    net.mlp.fc1.weight = ap.shard_tensor(net.mlp.fc1.weight, mesh, [S(0)])
    net.mlp.fc1.bias = ap.shard_tensor(net.mlp.fc1.bias, mesh, [S(0)])
    net.mlp.fc2.weight = ap.shard_tensor(net.mlp.fc2.weight, mesh, [S(1)])
    for owner, name in ((net.mlp.fc2, "bias"), (net.norm, "weight"), (net.norm, "bias")):
        setattr(owner, name, ap.shard_tensor(getattr(owner, name), mesh, [R()]))
    x = ap.shard_tensor(torch.randn(1, 8), mesh, [R()]).requires_grad_()  # one row: nothing to scatter
    with ap.CommDebugMode() as fwd:
        y = net(x)
    with ap.CommDebugMode() as bwd:
        y.sum().backward()
    assert all(r.seconds > 0 for r in fwd.records + bwd.records), fwd.summary()
    return {"fwd": _rows(fwd), "bwd": _rows(bwd), "by_module": fwd.summary(by="module"),
            "by_op": fwd.summary(by="op"), "by_kind": bwd.summary(by="kind"), "lines": fwd.summary()}


def _styled(rank: int, regions: bool) -> list[tuple[str, str | None, str | None, float]]:
    """The same pair laid out by ``ap.parallelize``: fc2's style all-reduces its output in its
    own forward hook (an explicit reshard: no op); op by op (``regions`` False), or as the model's
    captured program, which holds that move."""
    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    net = ap.parallelize(Net(), mesh, {"mlp.fc1": ap.ColWiseParallel(), "mlp.fc2": ap.RowWiseParallel()})
    if not regions:
        ap.disable_local_regions(net)
    x = ap.shard_tensor(torch.randn(6, 8), mesh, [R()]).requires_grad_()
    with ap.CommDebugMode() as comm:
        net(x).sum().backward()
    return [(r.kind, r.module, r.op, r.seconds) for r in comm.records]


def test_a_tensor_parallel_pair_is_attributed_to_its_modules_and_ops(world2: Any) -> None:
    for got in world2.run(_by_hand):
        assert got["fwd"] == [("all_reduce", "norm", "aten.native_layer_norm.default")], got["fwd"]
        assert got["bwd"] == [("all_reduce", "norm", "aten.native_layer_norm_backward.default"),
                              ("all_reduce", "mlp.fc1", None)], got["bwd"]  # (the input's gradient: no op)
        head, rule, row, total = got["by_module"].splitlines()
        assert head.split() == ["module", "count", "sent", "B", "received", "B", "ms", "kinds"], head
        assert set(rule) <= {"-", " "} and row.split()[:4] == ["norm", "1", "16", "16"], row
        assert row.endswith("all_reduce x1") and total.split()[:4] == ["total", "1", "16", "16"], total
        assert "aten.native_layer_norm.default" in got["by_op"].splitlines()[2], got["by_op"]
        assert got["by_kind"].splitlines()[0].split()[0] == "kind" and "all_reduce" in got["by_kind"], got["by_kind"]
        assert "(in norm, by aten.native_layer_norm.default)" in got["lines"], got["lines"]
    for rows in world2.run(_styled, False):
        rows3 = [r[:3] for r in rows]
        assert ("all_reduce", "mlp.fc2", None) in rows3, rows  # the row-parallel output, in fc2's hook
        assert ("all_reduce", "mlp.fc1", None) in rows3, rows  # the input's gradient, fc1's backward
        assert all(r[3] > 0 for r in rows), rows
    for rows in world2.run(_styled, True):
        # in the model's program: the output's all-reduce named by the submodule that makes it, with
        # no time of its own (the program runs as a whole); the input's gradient leaves the program
        # Partial and is all-reduced where it is accumulated, after the module's backward
        assert rows[0] == ("all_reduce", "mlp.fc2", None, 0.0), rows
        assert len(rows) == 2 and rows[1][:3] == ("all_reduce", None, None) and rows[1][3] > 0, rows


# ---- pure: the module stack, hooks, backward and tables on records made by hand ----------------------
class _Issuing(nn.Module):
    """Records a collective in its forward (as an op would) and has a style-like output hook
    that records another; its output's gradient hook records one more in the backward (where
    ``lin``, the innermost module returning that tensor, has begun its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_forward_hook(lambda m, a, out: debug.record("all_reduce", None, 0, (0, 1), 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with debug.attributed(torch.ops.aten.mm.default):
            debug.record("all_gather", None, 0, (0, 1), 8, 8)
        y = self.lin(x)
        y.register_hook(lambda g: debug.record("reduce_scatter", None, 0, (0, 1), 2, 2))
        return y


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Issuing()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        debug.record("broadcast", None, 0, (0, 1), 1, 1)  # after inner's hooks: the outer module's
        return y * 2


@pytest.mark.pure
def test_records_name_the_module_whose_forward_or_backward_runs() -> None:
    net = _Outer()
    with ap.CommDebugMode() as comm:
        net(torch.randn(2, 3, requires_grad=True)).sum().backward()
        debug.record("all_reduce", None, 0, (0, 1), 1, 1)  # outside any module and backward
    assert _rows(comm) == [("all_gather", "inner", "aten.mm.default"), ("all_reduce", "inner", None),
                           ("broadcast", "_Outer", None), ("reduce_scatter", "inner.lin", None),
                           ("all_reduce", None, None)]
    assert not debug.active() and not debug.attributing(torch.ops.aten.mm.default)
    import torch.nn.modules.module as module_module
    assert not module_module._global_forward_hooks and not module_module._global_forward_pre_hooks
    assert len(net.inner._forward_hooks) == 1  # only its own: the mode's hooks are gone


@pytest.mark.pure
def test_summary_tables_and_a_bad_grouping() -> None:
    comm = ap.CommDebugMode()
    comm.records += [debug.CommRecord("all_reduce", None, 0, (0, 1), 96, 96, "blocks.0.mlp", "aten.addmm.default", 0.002),
                     debug.CommRecord("all_gather", None, 0, (0, 1), 1000, 1000, None, None, 0.001),
                     debug.CommRecord("all_reduce", None, 0, (0, 1), 4, 4, "blocks.0.mlp", None, 0.0005)]
    assert comm.summary(by="module").splitlines() == [
        "module        count  sent B  received B     ms  kinds",
        "------------  -----  ------  ----------  -----  -------------",
        "blocks.0.mlp      2     100         100  2.500  all_reduce x2",
        "-                 1   1,000       1,000  1.000  all_gather x1",
        "total             3   1,100       1,100  3.500",
    ]
    assert comm.summary(by="op").splitlines()[2].split() == ["aten.addmm.default", "1", "96", "96", "2.000",
                                                              "all_reduce", "x1"]
    assert comm.summary(by="kind").splitlines()[2:4] == ["all_reduce      2     100         100  2.500",
                                                         "all_gather      1   1,000       1,000  1.000"]
    assert comm.summary().splitlines()[0] == (
        "all_reduce(axis 0, ranks [0, 1]): sent 96 B, received 96 B (in blocks.0.mlp, by aten.addmm.default), 2.000 ms")
    with pytest.raises(ValueError, match=r"summary\(by='rank'\): expected one of \('module', 'op', 'kind'\)"):
        comm.summary(by="rank")
