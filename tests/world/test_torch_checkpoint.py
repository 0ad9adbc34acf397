"""torch's own activation checkpoint on laid-out models, written as users write it.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=...)`` around each block's call (its
hooks inside: ZeRO-3's gather is redone by the recompute) and transformers'
``model.gradient_checkpointing_enable()``: every call of a signature takes one path, the first
and the recomputation in the backward included (a local region does not prove a new signature
under a checkpoint, and refuses one whose forward checkpoints inside it). Non-reentrant: the
losses and every parameter after 2 SGD steps are bitwise those without checkpointing under DP,
TP, TP + SP, DP x TP and ZeRO-3 (4 gloo ranks, the example GPT with dropout), and for an
unmodified transformers Llama under TP, DP x TP, DP x TP + SP (``ap.plans.llama(sp=True)``) and
ZeRO-3. Reentrant (transformers' default): equal within float rounding. ``ap.recompute`` of the last Linear of a ``shard_layer``'d network trains
as without (losses bitwise; the region it refuses runs op by op instead, parameters within rounding).
Inside pipeline stages (1F1B and the zero-bubble ZBH1): both kinds train as without, and ZBH1 as 1F1B.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(vocab=32, seq=8, layers=2, width=32, heads=4, dropout=0.1, attention="math")
STEPS = 2
MESHES = {"dp": (4, 1), "tp": (1, 4), "tp_sp": (1, 4), "dp_tp": (2, 2), "zero3": (2, 2)}


def _checkpointed(module: nn.Module, reentrant: bool) -> None:
    """Every call of ``module`` runs inside ``torch.utils.checkpoint.checkpoint`` (hooks included)."""
    import torch.utils.checkpoint as tuc

    cls = type(module)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return tuc.checkpoint(cls.__call__.__get__(self), *args, use_reentrant=reentrant, **kwargs)

    module.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def _gpt(rank: int, layout: str, how: str) -> dict[str, Any]:
    """2 SGD steps of the example GPT laid out as ``layout``; ``how``: none, reentrant, nonreentrant."""
    import train_gpt

    import autoparallel as ap

    torch.manual_seed(0)
    model = GPT(CFG)
    dp, tp = MESHES[layout]
    mesh = ap.ProcessMesh(torch.arange(4).reshape(dp, tp).tolist(), dim_names=["dp", "mp"])
    ap.parallelize(model, mesh, {} if layout == "dp" else train_gpt.gpt_plan(layout in ("tp_sp", "zero3")))
    if how != "none":
        for block in model.blocks:
            _checkpointed(block, how == "reentrant")
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             ap.ShardingStage3(mesh, "dp") if layout == "zero3" else None)
    torch.manual_seed(7)  # the dropout masks
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = (torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g) for _ in range(2))
        loss = lm_loss(model(ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])),
                       ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(train_gpt.scalar(loss))
    return {"losses": losses, "params": train_gpt.full_params(model), "rng": torch.get_rng_state()}


def _bitwise(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), (what, name, float((p - b["params"][name]).abs().max()))
    assert torch.equal(a["rng"], b["rng"]), (what, "the generator ends elsewhere")


def _close(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-5, atol=0, msg=what)
    for name, p in a["params"].items():
        torch.testing.assert_close(p, b["params"][name], rtol=1e-5, atol=1e-7, msg=f"{what} {name}")


@pytest.mark.parametrize("layout", list(MESHES))
def test_torch_checkpoint_is_bitwise_no_checkpoint(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_gpt, layout, "none")
    got = world4.run(_gpt, layout, "nonreentrant")
    for r in range(4):
        _bitwise(base[r], got[r], f"{layout} non-reentrant rank {r}")
    if layout in ("dp_tp", "zero3"):
        got = world4.run(_gpt, layout, "reentrant")
        for r in range(4):
            _close(base[r], got[r], f"{layout} reentrant rank {r}")


def _llama(rank: int, layout: str, checkpointing: dict[str, Any] | None | bool) -> dict[str, Any]:
    """2 SGD steps of an unmodified tiny Llama under TP (or DP x TP), with transformers' own
    gradient checkpointing (``checkpointing``: its kwargs; None: its default; False: off)."""
    import autoparallel as ap
    from tests.models.test_hf_llama import PLAN_NAMES, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    model.config.use_cache = False
    if checkpointing is not False:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    model.train()
    ids = torch.randint(0, 128, (STEPS, 4, 16))
    stage = None
    if layout == "tp":
        mesh, batch = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"]), [ap.Replicate()]
    elif layout == "zero3":
        mesh, batch = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]), [ap.Shard(0)]
        stage = ap.ShardingStage3(mesh)
    else:
        mesh, batch = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]), [ap.Shard(0), ap.Replicate()]
    if layout == "zero3":
        ap.shard_layer(model, mesh)
    elif layout == "dp_tp_sp":  # transformers' Llama with Megatron's sequence parallelism
        ap.parallelize(model, mesh, ap.plans.llama(model, sp=True))
    else:
        styles = {"col": ap.ColWiseParallel, "row": ap.RowWiseParallel}
        ap.parallelize(model, mesh, {k: styles[v]() for k, v in PLAN_NAMES.items()})
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stage)
    losses = []
    for step in range(STEPS):
        x = ap.shard_tensor(ids[step], mesh, batch)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return {"losses": losses, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "rng": torch.get_rng_state()}


@pytest.mark.parametrize("layout", ["tp", "dp_tp", "dp_tp_sp", "zero3"])
def test_transformers_gradient_checkpointing(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    base = world4.run(_llama, layout, False)
    got = world4.run(_llama, layout, {"use_reentrant": False})
    for r in range(4):
        _bitwise(base[r], got[r], f"llama {layout} non-reentrant rank {r}")
    got = world4.run(_llama, layout, None)  # transformers' default (reentrant)
    for r in range(4):
        _close(base[r], got[r], f"llama {layout} default rank {r}")


def _simple(rank: int, recompute: bool) -> list[float]:
    """A Linear-ReLU-Linear-Linear net, the first two tensor-parallel by ``shard_layer``."""
    import autoparallel as ap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 10))
    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])

    def shard_fn(name: str, layer: nn.Module, mesh: Any) -> None:
        if name == "0":
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])
            layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
        elif name == "2":
            layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])

    ap.shard_layer(model, mesh, shard_fn)
    if recompute:
        ap.recompute(model[3], "full")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor()))
    return losses + [float(p.full_tensor().sum()) for p in model.parameters()]


def test_recompute_inside_a_local_region(world2) -> None:  # type: ignore[no-untyped-def]
    # the whole network is a local region; its last Linear is recomputed: the region is refused
    # (its recompute would run outside the local run) and the network trains as without recompute.
    # The two runs take different paths by design (op by op on DistTensors, or one local run on the
    # shards), whose kernels may round differently on some CPUs (AMD EPYC: 1 ulp in a parameter
    # sum): the losses are compared bitwise, the parameter sums within float32 rounding.
    got, want = world2.run(_simple, True), world2.run(_simple, False)
    for g, w in zip(got, want, strict=True):
        assert g[:STEPS] == w[:STEPS]
        torch.testing.assert_close(g[STEPS:], w[STEPS:], rtol=1e-6, atol=1e-7)


# ---- pipelines: torch's checkpoint inside a stage, 1F1B and the zero-bubble split --------------
class _Blk(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.inner(x)
        import torch.utils.checkpoint as tuc
        return tuc.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _pipelined(rank: int, schedule: str, reentrant: bool | None) -> dict[str, Any]:
    import warnings

    import autoparallel as ap
    from autoparallel.pipeline import Pipeline, split_sequential

    torch.manual_seed(0)
    x, t = torch.randn(16, 8), torch.randn(16, 8)
    model = nn.Sequential(nn.Linear(8, 8), *[_Blk(reentrant) for _ in range(3)])  # (stage 1's input needs a gradient)
    meshes = [ap.ProcessMesh([0, 1], ["dp"]), ap.ProcessMesh([2, 3], ["dp"])]
    pipe = Pipeline(split_sequential(model, meshes), lambda y, z: (y - z).square().mean(), num_microbatches=4,
                    schedule=schedule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pipe.step(ap.shard_tensor(x, meshes[0], [ap.Shard(0)]), ap.shard_tensor(t, meshes[1], [ap.Shard(0)]))
            opt.step()
            losses.append(float(loss.full_tensor()) if rank in meshes[1] else None)
    return {"losses": losses, "params": [p.full_tensor() for p in model.parameters() if rank in p.process_mesh],
            "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}


_PIPELINED: dict[str, list[dict[str, Any]]] = {}


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_inside_pipeline_stages_1f1b_and_zero_bubble(world4, reentrant: bool) -> None:  # type: ignore[no-untyped-def]
    """A stage whose blocks run torch's checkpoint trains as without it under 1F1B (reentrant: a
    local region refuses a forward holding one, whose recompute would meet the shards it saved), and
    ZBH1 trains bitwise as 1F1B: a non-reentrant checkpoint splits into B and W like any graph; a
    reentrant one cannot compute the input's gradient alone, so its B computes all (one warning)."""
    if "base" not in _PIPELINED:  # (without a checkpoint: run once for both cases)
        _PIPELINED["base"] = world4.run(_pipelined, "1F1B", None)
    base = _PIPELINED["base"]
    one = world4.run(_pipelined, "1F1B", reentrant)
    zero = world4.run(_pipelined, "ZBH1", reentrant)
    for b, o, z in zip(base, one, zero):
        for p, q in zip(b["params"], o["params"]):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        assert z["losses"] == o["losses"] and all(torch.equal(p, q) for p, q in zip(o["params"], z["params"]))
        assert o["warnings"] == []
    said = [w for r in zero for w in r["warnings"]]
    if reentrant:  # once on every rank: both stages run checkpointed blocks
        assert len(said) == 4 and all("reentrant torch.utils.checkpoint" in w and "computes its weight gradients in B" in w
                                      for w in said), said
    else:
        assert said == []


def _llama_stages(rank: int, schedule: str) -> dict[str, Any]:
    """An unmodified tiny Llama with transformers' gradient checkpointing in two ``decoder_stages``
    (dp 2 inside each), 2 micro-batches, 2 SGD steps."""
    import warnings

    import autoparallel as ap
    from tests.models.test_hf_llama import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    meshes = [ap.ProcessMesh([0, 1], dim_names=["dp"]), ap.ProcessMesh([2, 3], dim_names=["dp"])]
    split = ap.pipeline.decoder_stages(model, meshes)
    pipe = ap.pipeline.Pipeline(split.stages, split.loss_fn, num_microbatches=2, schedule=schedule)
    opt = ap.shard_optimizer(torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9))
    ids = torch.randint(0, 128, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))
    losses, said = [], []
    for k in range(STEPS):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = pipe.step(ap.shard_tensor(ids[k], meshes[0], [ap.Shard(0)]),
                             ap.shard_tensor(ids[k], meshes[-1], [ap.Shard(0)]))
        said += [str(w.message) for w in seen if "computes its weight gradients in B" in str(w.message)]
        split.sync_tied_grads()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor()) if rank in meshes[-1] else None)
    params = [p.detach().full_tensor() for p in split.parameters() if rank in p.process_mesh]
    return {"losses": losses, "params": params, "warnings": said}


def test_transformers_gradient_checkpointing_in_zero_bubble_stages(world4) -> None:  # type: ignore[no-untyped-def]
    """transformers' ``gradient_checkpointing_enable()`` in ``decoder_stages`` under ZBH1: each stage's
    B runs its whole backward (B and every W call would recompute the layers again), after one
    warning naming the layer; bitwise as 1F1B with it."""
    base = world4.run(_llama_stages, "1F1B")
    zero = world4.run(_llama_stages, "ZBH1")
    for r, (b, z) in enumerate(zip(base, zero)):
        assert z["losses"] == b["losses"] and all(torch.equal(p, q) for p, q in zip(b["params"], z["params"]))
        assert len(z["warnings"]) == 1 and f"['model.layers.{r // 2}'] are recomputed" in z["warnings"][0], z["warnings"]
