"""Local regions under tensor parallelism: a row-parallel module's output is each rank's
summand (Partial(sum)) and its replicated bias is taken as a summand, in the module's captured
program (autoparallel.regions, docs/local_regions.md). Each test compares the region run with the
DistTensor run (regions disabled): values, gradient layouts, the report and the collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.regions import enable_local_regions, local_regions_report

R, S0 = Replicate(), Shard(0)


def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])


class RowParallel(nn.Module):
    """A tensor-parallel MLP: ``fc1`` column-parallel, ``fc2`` row-parallel; its output is each
    rank's summand (Partial(sum)), reduced by whoever uses it."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class BiasReadTwice(RowParallel):
    """Also scales by the bias's norm: an op taking the bias as it is, beside the ``addmm`` that
    takes it as a summand (the program holds both: the summand is made inside it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.fc2.bias.norm()


def _row_parallel(rank: int, bias: bool, dp: bool, cls: Any = RowParallel) -> dict[str, Any]:
    """SGD steps of ``RowParallel`` on a 4-rank tp mesh, or with ``dp`` on a 2 x 2 dp x tp mesh
    with the batch split over dp, with and without regions: losses and parameters, collectives,
    the report and the output's layout."""
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]) if dp else _mesh()
    rep = [R] if dp else []
    batch = [S0, R] if dp else [R]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, generator=g)
    runs = []
    for local in (False, True):
        torch.manual_seed(0)
        model = cls(bias)
        model.fc1.weight = nn.Parameter(ap.shard_tensor(model.fc1.weight.detach(), mesh, [*rep, S0]))
        model.fc1.bias = nn.Parameter(ap.shard_tensor(model.fc1.bias.detach(), mesh, [*rep, S0]))
        model.fc2.weight = nn.Parameter(ap.shard_tensor(model.fc2.weight.detach(), mesh, [*rep, Shard(1)]))
        if bias:
            model.fc2.bias = nn.Parameter(ap.shard_tensor(model.fc2.bias.detach(), mesh, [*rep, R]))
        if local:
            enable_local_regions(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        out: dict[str, Any] = {"losses": [], "comm": []}
        for _ in range(3):
            xs = ap.shard_tensor(x, mesh, batch)
            with ap.CommDebugMode() as c:
                y = model(xs)
                out["layout"] = list(y.placements)
                loss = ((y + xs) ** 2).mean()
                opt.zero_grad()
                loss.backward()
            out["grad_layouts"] = {n: list(p.grad.placements) for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            out["losses"].append(float(loss.detach().full_tensor()))
            out["comm"].append(c.get_comm_counts())
        out["params"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out["report"] = local_regions_report(model)
        runs.append(out)
    plain, regions = runs
    assert regions["losses"] == pytest.approx(plain["losses"], rel=1e-6), (regions["losses"], plain["losses"])
    for n, p in plain["params"].items():
        torch.testing.assert_close(regions["params"][n], p, rtol=1e-6, atol=1e-7)
    return {"report": regions["report"], "layout": regions["layout"], "comm": regions["comm"], "plain_comm": plain["comm"],
            "grad_layouts": regions["grad_layouts"], "plain_grad_layouts": plain["grad_layouts"]}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp_tp"])
def test_a_row_parallel_module_is_a_region_with_a_partial_output(world4: Any, dp: bool, bias: bool) -> None:
    # Every op takes its inputs as they are — but for a bias, which ``addmm`` takes as a summand
    # (kept on one rank, zero on the others: a local step), made so once before the local run;
    # the output is each rank's summand. Its gradient arrives whole (Replicate) and the local
    # backward gives every shard its exact gradient, the replicated input its summand and the
    # bias its whole gradient — the same values and layouts as op by op, and no collective more
    # (op by op, the backward's products also move their operands: two all-to-alls more here).
    results = world4.run(_row_parallel, bias, dp)
    r = results[0]
    assert r["report"] == {"<root>": ["local"]}, r["report"]
    assert r["layout"] == ([S0, Partial("sum")] if dp else [Partial("sum")])
    for x in results:
        # the sharded weights' gradients come out sharded (op by op: Partial); the replicated
        # bias's whole on the tp axis, summed over the batch shards on dp
        assert x["grad_layouts"]["fc2.weight"] == ([Partial("sum"), Shard(1)] if dp else [Shard(1)]), x["grad_layouts"]
        if bias:
            assert x["grad_layouts"]["fc2.bias"] == ([Partial("sum"), R] if dp else [R]), x["grad_layouts"]
        for got, plain in zip(x["comm"], x["plain_comm"]):
            assert all(n <= plain.get(kind, 0) for kind, n in got.items()), (x["comm"], x["plain_comm"])


def test_a_bias_read_as_it_is_and_as_a_summand_is_captured(world4: Any) -> None:
    for r in world4.run(_row_parallel, True, False, BiasReadTwice):  # (equal to op by op: in _row_parallel)
        assert r["report"] == {"<root>": ["local"]}, r["report"]
        for got, plain in zip(r["comm"], r["plain_comm"]):
            assert all(n <= plain.get(kind, 0) for kind, n in got.items()), (r["comm"], r["plain_comm"])


class NormedHead(nn.Module):
    """A replicated layer norm before a column-parallel Linear (BERT's masked-LM head): the
    output is split on tp inside the module, every argument is whole there."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def _normed_head(rank: int) -> dict[str, Any]:
    """3 SGD steps of ``NormedHead`` with regions on a 4-rank tp mesh: the report, the collectives
    per step and the layer norm's gradient layouts; losses and parameters against one process."""
    mesh = _mesh()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, generator=g)
    torch.manual_seed(0)
    model, ref = NormedHead(), NormedHead()
    ref.load_state_dict(model.state_dict())
    ap.parallelize(model, mesh, {"head": ap.ColWiseParallel()})
    enable_local_regions(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    comm, layouts = [], {}
    for _ in range(3):
        with ap.CommDebugMode() as c:
            xs = ap.shard_tensor(x, mesh, [R]).requires_grad_()  # (an earlier layer's output)
            loss = (model(xs) ** 2).mean()
            loss.backward()
        layouts = {n: list(p.grad.placements) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        want = (ref(x) ** 2).mean()
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss.detach().full_tensor()) == pytest.approx(float(want.detach()), rel=1e-5)
        comm.append(c.get_comm_counts())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    return {"report": local_regions_report(model), "comm": comm, "layouts": layouts}


def test_a_module_splitting_whole_arguments_after_replicated_weights_is_one_program(world4: Any) -> None:
    # The column-parallel Linear's backward gives the layer norm a Partial input gradient, which
    # the program's layer norm backward reduces once, first, as op by op: its weights' gradients
    # come out whole. Every step communicates alike.
    for r in world4.run(_normed_head):
        assert r["report"] == {"<root>": ["local"]}, r["report"]
        assert r["layouts"]["norm.weight"] == [R] and r["layouts"]["norm.bias"] == [R], r["layouts"]
        assert r["comm"][0] == r["comm"][1] == r["comm"][2], r["comm"]
