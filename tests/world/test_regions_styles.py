"""Local regions around parallel styles (autoparallel.regions.moves, docs/local_regions.md
"Which modules become regions"): a module whose styled submodules move data only at its end
(the row-parallel projection's all-reduce closing an MLP or an attention block) or move its
arguments (the sequence-parallel all-gather at its start) runs locally between those moves,
which the region makes on DistTensors. Each test compares the region run with the DistTensor
run (regions disabled): losses, parameters, the verdicts and the collectives.
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
from autoparallel.regions.region import _ATTR

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
    """An op after the row-parallel projection's all-reduce: the move is not an epilogue."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class PeekingMLP(MLP):
    """Reads its input as it is (a statistic of it, kept), beside the column-parallel input
    hook's move: under sequence parallelism a local run given the moved input would read the
    whole sequence there."""

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
        out["certified"] = {n: m.__dict__[_ATTR].certified for n, m in model.named_modules() if _ATTR in m.__dict__}
        runs.append(out)
    plain, regions = runs
    assert regions["losses"] == pytest.approx(plain["losses"], rel=1e-5), (regions["losses"], plain["losses"])
    for n, p in plain["params"].items():
        torch.testing.assert_close(regions["params"][n], p, rtol=1e-5, atol=1e-6)
    return {"report": regions["report"], "comm": regions["comm"], "plain_comm": plain["comm"],
            "certified": regions["certified"]}


@pytest.mark.parametrize("layout", ["tp", "dp_tp", "tp_sp", "tp_recompute"])
def test_a_module_between_styles_moves_is_a_region(world4: Any, layout: str) -> None:
    # attention and MLP: every op on shards, the projection's all-reduce (under SP: reduce-
    # scatter) at the very end, made by the region on its Partial(sum) output; under SP the
    # column-parallel input's all-gather at the start, made by the region on its argument; at
    # lengths after two proven ones answered by the family, through the symbolic certificate
    # (the styles' hooks hand fakes back as they are)
    results = world4.run(_train, layout)
    r = results[0]
    # (a recomputed module runs on DistTensors: regions are proven outside recomputation only)
    for name in ("attn",) if layout == "tp_recompute" else ("attn", "mlp"):
        verdicts = r["report"][name]
        assert verdicts and all(v.startswith("local") for v in verdicts), (name, r["report"])
        assert any("as its proven lengths" in v for v in verdicts), (name, r["report"])
        assert r["certified"][name] > 0, r["certified"]
    for x in results:
        # a length proven by a trace makes the epilogue's collective twice (the trace's, then
        # the local run's); a warm length (28 again) and one answered by the family (60) make
        # exactly the collectives of op by op
        assert x["comm"][-2:] == x["plain_comm"][-2:], (x["comm"], x["plain_comm"])


def test_a_move_before_the_last_op_or_of_an_argument_read_as_it_is_is_refused(world4: Any) -> None:
    # an op after the projection's all-reduce (the move is not the module's last word); under
    # sequence parallelism an op reading the argument the input hook all-gathers (a local run
    # given the gathered argument would read the whole sequence there).
    # Refused for that reason, their submodules regions of their own; the values those op by op
    r = world4.run(_train, "tp", ScaledMLP)[0]
    assert all("moves data before its last op" in v for v in r["report"]["mlp"]), r["report"]
    assert all(v.startswith("local") for v in r["report"]["mlp.fc"]), r["report"]
    assert all(v.startswith("local") for v in r["report"]["attn"]), r["report"]
    s = world4.run(_train, "tp_sp", PeekingMLP)[0]
    assert all("an op reads an argument a parallel style moves" in v for v in s["report"]["mlp"]), s["report"]
    assert all(v.startswith("local") for v in s["report"]["attn"]), s["report"]
