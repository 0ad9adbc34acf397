"""Local regions around parallel styles (autoparallel.regions.moves, docs/local_regions.md): the
styles' hooks move data through ``to_layout`` (the row-parallel projection's all-reduce closing an
MLP or an attention block, the sequence-parallel all-gather at its start), so a model laid out by
them is one captured program, those moves in it, served at new lengths by its program of open
sizes. Each test compares the region run with the DistTensor run (regions disabled): losses,
parameters, the report and the collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.placement import Replicate, Shard
from autoparallel.regions import disable_local_regions, local_regions_report

R, S0 = Replicate(), Shard(0)
WIDTH, HEADS, BATCH = 16, 4, 6  # sizes that coincide with no sequence length below


class Attention(nn.Module):
    """Fused head-major qkv (column-parallel: whole heads per rank), causal SDPA, projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape[0], x.shape[1], WIDTH // HEADS
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x).view(b, t, -1, 3 * d).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ScaledMLP(MLP):
    """An op after the row-parallel projection's all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class PeekingMLP(MLP):
    """Reads its input as it is and keeps a statistic of it as an attribute (module state a
    program does not keep)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.peak = x.detach().abs().amax()
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, mlp: type[nn.Module] = MLP) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), mlp()
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return self.head(x + self.mlp(self.ln2(x)))


PLAN = {"attn.qkv": ap.ColWiseParallel(), "attn.proj": ap.RowWiseParallel(),
        "mlp.fc": ap.ColWiseParallel(), "mlp.proj": ap.RowWiseParallel()}
SP = {"ln1": ap.SequenceParallel(), "ln2": ap.SequenceParallel()}
LENGTHS = (20, 28, 36, 44, 52, 28, 60)  # multiples of 4: sequence parallelism splits them


def _train(rank: int, layout: str, mlp: type[nn.Module] = MLP) -> dict[str, Any]:
    """AdamW steps of ``Net`` laid out by ``PLAN`` at changing sequence lengths, with and without
    regions: losses and parameters compared here; the report, collectives, region counters out."""
    dp = layout.startswith("dp")
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]) if dp else ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
    batch = [S0, R] if dp else [R]
    sp = layout.endswith("sp")
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(BATCH, t, WIDTH, generator=g), torch.randn(BATCH, t, 5, generator=g)) for t in LENGTHS]
    runs = []
    for local in (False, True):
        torch.manual_seed(0)
        model = Net(mlp)
        ap.parallelize(model, mesh, {**PLAN, **SP} if sp else PLAN, axis="tp",
                       recompute={"mlp": "full"} if layout == "tp_recompute" else None)
        if not local:
            disable_local_regions(model)
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        out: dict[str, Any] = {"losses": [], "comm": []}
        for x, y in data:
            with ap.CommDebugMode() as c:
                pred = model(ap.shard_tensor(x, mesh, batch))
                loss = F.mse_loss(pred, ap.shard_tensor(y, mesh, batch))
                opt.zero_grad()
                loss.backward()
            opt.step()
            out["losses"].append(float(loss.detach().full_tensor()))
            out["comm"].append(c.get_comm_counts())
        out["params"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        out["report"] = local_regions_report(model)
        runs.append(out)
    plain, regions = runs
    assert regions["losses"] == pytest.approx(plain["losses"], rel=1e-5), (regions["losses"], plain["losses"])
    for n, p in plain["params"].items():
        torch.testing.assert_close(regions["params"][n], p, rtol=1e-5, atol=1e-6)
    return {"report": regions["report"], "comm": regions["comm"], "plain_comm": plain["comm"]}


@pytest.mark.parametrize("layout", ["tp", "dp_tp", "tp_sp", "tp_recompute"])
def test_a_model_between_styles_moves_is_one_region(world4: Any, layout: str) -> None:
    # attention and MLP with the projection's all-reduce (under SP: reduce-scatter) and the
    # column-parallel input's all-gather: all in the model's program; lengths after the second
    # served by the program of open sizes (the styles' hooks run in the capture only: marked)
    results = world4.run(_train, layout)
    r = results[0]
    root = r["report"]["<root>"]
    assert root[:2] == ["local", "local"], r["report"]
    # (under tp_sp the loss flattens [batch, sequence pieces]: a strided shard whose factor, the
    # batch, the program holds at its value; the lengths stay open)
    assert all(v == "local (open sizes)" for v in root[2:]), r["report"]
    for x in results:
        assert x["report"] == r["report"]
        # a warm length (28 again) and a served one (60): no collective kind more often than op by op
        for got, plain in zip(x["comm"][-2:], x["plain_comm"][-2:]):
            assert all(got.get(k, 0) <= n for k, n in plain.items()) and set(got) <= set(plain), (x["comm"], x["plain_comm"])


def test_an_op_after_a_move_is_in_the_program_and_state_kept_by_a_module_refuses_it(world4: Any) -> None:
    # an op after the projection's all-reduce: part of the program like any other; an MLP that
    # keeps a statistic of its input as an attribute: the model and the MLP are refused (a program
    # keeps no module state), the attention a region of its own; the values those op by op
    r = world4.run(_train, "tp", ScaledMLP)[0]
    assert all(v.startswith("local") for v in r["report"]["<root>"]), r["report"]
    s = world4.run(_train, "tp_sp", PeekingMLP)[0]
    for name in ("<root>", "mlp"):
        assert all("assigns the tensor attribute PeekingMLP.peak" in v for v in s["report"][name]), s["report"]
    assert s["report"]["attn"][:2] == ["local", "local"], s["report"]
    assert all(v.startswith("local") for v in s["report"]["mlp.fc"]), s["report"]
