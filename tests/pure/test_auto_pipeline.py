"""``ap.auto_parallel`` with a pipeline axis, in one process: the step priced by part (before the
blocks, each block, after them), the blocks cut into the stages whose slowest is fastest, 1F1B
over the micro-batches the batch allows, chosen where the network makes it pay, refused clearly
where the model cannot be cut. (Trained against one process: tests/world/test_auto_parallel_world.py.)"""

from __future__ import annotations

import itertools
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.auto import Profile  # noqa: E402
from autoparallel.auto.price import _balanced  # noqa: E402
from autoparallel.auto.repeat import record  # noqa: E402
from autoparallel.auto.simulate import POST, PRE  # noqa: E402

CFG = GPTConfig(vocab=128, width=64, heads=4, layers=6, seq=16, tied=False)
# nodes of two ranks joined by a slow network: data parallelism across nodes costs its gradients' bytes
SLOW_NETWORK = Profile("slow-network", 1e14, 2e12, 30e-6, 2e8, 1e-6, (), 2, 5e-6, 3e11, kernel_s=1e-6)


def _example(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (rows, 16), generator=g), torch.randint(0, 128, (rows, 16), generator=g)


@pytest.mark.parametrize("extrapolate", [True, False])
def test_the_step_is_priced_by_part_and_the_parts_add_up(extrapolate: bool) -> None:
    rec = record(GPT(CFG), _example(), lm_loss, extrapolate)
    mesh = ap.ProcessMesh.simulated((2, 2), ["dp", "mp"])
    sim = rec.simulate(mesh, {}, (ap.Shard(0), ap.Replicate()), None, 1, {})
    blocks = [k for k in sim.parts if k not in (PRE, POST)]
    assert blocks == [f"blocks.{i}" for i in range(6)] and list(sim.parts)[0] == PRE and list(sim.parts)[-1] == POST
    parts = sim.parts.values()
    assert sum(p.flops for p in parts) == pytest.approx(sim.flops)
    assert sum(p.ops for p in parts) == sim.ops
    assert sum(p.saved_bytes for p in parts) == sim.saved_bytes
    assert sum(len(p.collectives) for p in parts) == len(sim.collectives)
    # a block's backward is its own: every middle block costs the same, forward and backward
    middle = [sim.parts[b] for b in blocks[1:-1]]
    assert len({(p.flops, p.ops, p.saved_bytes) for p in middle}) == 1
    assert middle[0].flops > 2.5 * sum(op.flops for op in rec.short.ops if op.module.startswith("blocks.1") and not op.backward) / 4


def test_stages_are_cut_where_the_slowest_is_fastest() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n, p = rng.randint(2, 9), rng.randint(2, 4)
        if n < p:
            continue
        blocks = [rng.random() for _ in range(n)]
        pre, post = rng.random() * 2, rng.random() * 2

        def slowest(starts: list[int]) -> float:
            b = [*starts, n]
            return max(sum(blocks[b[s]:b[s + 1]]) + (pre if s == 0 else 0) + (post if s == p - 1 else 0) for s in range(p))

        best = min(slowest([0, *c]) for c in itertools.combinations(range(1, n), p - 1))
        starts = _balanced(pre, blocks, post, p)
        assert starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
        assert slowest(starts) == pytest.approx(best)


def test_pipeline_axes_are_priced_only_when_asked() -> None:
    x, y = _example()
    plain = ap.auto_parallel(GPT(CFG), world=8, example=(x, y), loss=lm_loss, profile="h100")
    assert not any(c.name.startswith("pp") for c in plain.candidates) and plain.pipeline is None
    asked = ap.auto_parallel(GPT(CFG), world=8, example=(x, y), loss=lm_loss, profile="h100", pipeline=True)
    names = [c.name for c in asked.candidates]
    assert any(n.startswith("pp2 x dp4") for n in names) and any(n.startswith("pp4 x dp1 x tp2") for n in names)
    assert not any(n.startswith("pp8") for n in names)  # 8 stages for 6 blocks: not a candidate
    assert all("micro-batches" in n for n in names if n.startswith("pp"))


def test_a_pipeline_is_chosen_where_the_network_makes_it_pay() -> None:
    """Across nodes on a slow network, data parallelism all-reduces every gradient there; a
    pipeline sends one activation per micro-batch: it wins, with data parallelism inside a node."""
    cfg = GPTConfig(vocab=128, width=512, heads=8, layers=8, seq=16, tied=False)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.randint(0, 128, (16, 16), device="meta")
    plan = ap.auto_parallel(model, world=8, example=(x, x), loss=lm_loss, pipeline=True, profile=SLOW_NETWORK,
                            optimizer="sgd")
    assert plan.pipeline is not None and plan.dim_names[0] == "pp", str(plan)
    pp = plan.pipeline["stages"]
    assert plan.mesh_shape[0] == pp and 8 % pp == 0
    starts = plan.pipeline["starts"]
    assert starts[0] == 0 and len(starts) == pp and plan.pipeline["blocks"] == "blocks"
    assert 16 % (plan.pipeline["microbatches"] * (plan.mesh_shape[1] if "dp" in plan.dim_names else 1)) == 0
    assert plan.prediction is not None and plan.prediction.bubble_s > 0
    assert "pipeline: " in str(plan) and "bubble" in str(plan)
    assert [m.process_ids for m in plan.stage_meshes] == [list(r) for r in torch.arange(8).reshape(pp, -1).tolist()]
    dp_only = next(c for c in plan.candidates if c.name == "dp8 x tp1")
    assert plan.prediction.time_s < dp_only.prediction.time_s


def test_a_pipeline_plan_saves_and_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x, y = _example()
    plan = ap.auto_parallel(GPT(CFG), world=4, example=(x, y), loss=lm_loss, profile="h100",
                            mesh=ap.ProcessMesh.simulated((2, 2), ["pp", "dp"]))
    assert plan.pipeline is not None and plan.mesh_shape == (2, 2)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    back = ap.Plan.load(path)
    assert back.pipeline == plan.pipeline and back.dim_names == ["pp", "dp"]
    with pytest.raises(ValueError, match="pass a mesh with a 'pp' axis"):
        back.apply(GPT(CFG), None, mesh=ap.ProcessMesh.simulated((4,), ["dp"]), loss=lm_loss)


def test_a_model_that_cannot_be_cut_is_said_so() -> None:
    flat = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 128))
    x, y = _example()
    with pytest.warns(UserWarning, match=r"no pipeline plan was priced: its repeated blocks \(0, ...\) are not the items"):
        plan = ap.auto_parallel(flat, world=4, example=(x, y), loss=lm_loss, profile="h100", pipeline=True)
    assert plan.pipeline is None and not any(c.name.startswith("pp") for c in plan.candidates)
    with pytest.raises(ValueError, match="pipeline axis cannot be used: its repeated blocks"):
        ap.auto_parallel(flat, example=(x, y), loss=lm_loss, profile="h100",
                         mesh=ap.ProcessMesh.simulated((2, 2), ["pp", "dp"]))
    with pytest.raises(ValueError, match=r"mesh axes \['dp', 'pp'\]"):
        ap.auto_parallel(GPT(CFG), example=(x, y), loss=lm_loss, profile="h100",
                         mesh=ap.ProcessMesh.simulated((2, 2), ["dp", "pp"]))


def test_a_weight_tied_across_stages_is_priced_with_its_gradients_summed() -> None:
    tied = GPTConfig(vocab=128, width=64, heads=4, layers=4, seq=16, tied=True)
    x, y = _example()
    kw = {"example": (x, y), "loss": lm_loss, "profile": "h100", "mesh": ap.ProcessMesh.simulated((2, 2), ["pp", "dp"])}
    with_tie = ap.auto_parallel(GPT(tied), **kw)
    untied = ap.auto_parallel(GPT(GPTConfig(vocab=128, width=64, heads=4, layers=4, seq=16, tied=False)), **kw)
    assert with_tie.pipeline is not None and untied.pipeline is not None
    assert with_tie.prediction is not None and untied.prediction is not None
    # one more collective (the copies' gradients summed), fewer parameter bytes held: a different prediction
    assert with_tie.prediction.collectives == untied.prediction.collectives + 1


class _Branching(torch.nn.Module):
    """Blocks a pipeline could cut between, but a forward that branches on a size in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 128)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if idx.shape[0] > 4:  # torch.fx cannot follow this
            x = x * 2
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_forward_torch_fx_cannot_trace_is_said_so() -> None:
    x, y = _example()
    with pytest.warns(UserWarning, match="no pipeline plan was priced: splitting the model into stages traces its "
                                         "forward with torch.fx, which failed"):
        plan = ap.auto_parallel(_Branching(), world=4, example=(x, y), loss=lm_loss, profile="h100", pipeline=True)
    assert plan.pipeline is None
