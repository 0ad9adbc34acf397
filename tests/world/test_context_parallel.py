"""Context parallelism (``ap.ContextParallel``): the sequence sharded through attention.

4 gloo ranks. Our GPT (learned position table, causal SDPA) and an unmodified ``transformers``
Llama (rotary positions, grouped-query attention, its own loss) train three AdamW steps with
their sequence sharded along a ``cp`` mesh axis — ring attention (load-balanced: the sequence
divides into ``2 * cp`` halves) and all-to-all (Ulysses) — alone, with data parallelism (ZeRO-3
on it), with tensor parallelism, in pipeline stages and under gradient checkpointing, and equal
one process: every step's loss (rtol 1e-5), the first step's
gradients (rtol 1e-5) and the parameters after three steps. The collectives are the plan's:
ring attention's rotations and balancing moves only, Ulysses' four all-to-alls per layer. A
captured step (``ap.to_static``) equals the eager one bitwise. Bad input raises the same
``ValueError`` on every rank before any collective.

AdamW divides each gradient by its running RMS plus ``eps``, so an element whose gradient is
near ``eps`` moves by an amount its rounding decides (``d update / d grad`` is up to ``lr / eps``):
with the default ``eps = 1e-8``, gradients equal to 3e-7 of their largest element still move
single elements by up to 5e-5 differently (one summation order against another, on one CPU
and not on another). Both sides therefore run AdamW with ``eps = 1e-6``: the gradients before any
step are compared at rtol 1e-5, the parameters after three steps at ``atol = lr / 20`` (measured:
at most 5e-6 for lr 1e-3).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

RTOL = 1e-5
LR = 1e-3
EPS = 1e-6  # AdamW's eps on both sides (see above)


def _gpt(seq: int = 16, heads: int = 4) -> Any:
    from examples.gpt_model import GPT, GPTConfig

    return GPT(GPTConfig(vocab=64, seq=seq, width=32, heads=heads, layers=2, dropout=0.0))


def _compare(model: Any, ref: Any, grads: list[tuple[str, Any, Any]]) -> list[str]:
    """Mismatches: first-step gradients (rtol 1e-5) and parameters now (atol lr / 20)."""
    import torch

    bad = []
    for name, got, want in grads:
        if not torch.allclose(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max())):
            bad.append(f"grad {name}: {float((got - want).abs().max()):.3g}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.detach().full_tensor()
        if not torch.allclose(full, q.detach(), rtol=RTOL, atol=LR / 20):
            bad.append(f"param {name}: {float((full - q.detach()).abs().max()):.3g}")
    return bad


def _train(model: Any, ref: Any, mesh: Any, batches: list[Any], step_fn: Any, ref_fn: Any,
           placements: list[Any], zero3: bool = False) -> dict[str, Any]:
    """Three AdamW steps of ``model`` (laid out; ``zero3``: ZeRO-3 on the ``dp`` axis) and ``ref``
    (one process) on the same batches."""
    import torch

    import autoparallel as ap

    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    opt = ap.shard_optimizer(opt, ap.ShardingStage3(mesh, "dp")) if zero3 else ap.shard_optimizer(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    losses, grads, counts = [], [], []
    for i, (x, y) in enumerate(batches):
        xd, yd = ap.shard_tensor(x, mesh, placements), ap.shard_tensor(y, mesh, placements)
        with ap.CommDebugMode() as comm:
            loss = step_fn(model, xd, yd)
            loss.backward()
        counts.append(comm.get_comm_counts())
        ref_loss = ref_fn(ref, x, y)
        ref_loss.backward()
        if i == 0:
            grads = [(n, p.grad.full_tensor(), q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.detach().full_tensor()), float(ref_loss.detach())))
    return {"losses": losses, "bad": _compare(model, ref, grads), "counts": counts[0]}


def _gpt_case(rank: int, comm: str, layout: str) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from examples.gpt_model import lm_loss

    torch.manual_seed(0)
    ref = _gpt()
    model = copy.deepcopy(ref)
    if layout == "cp4":
        mesh, placements, batch = ap.ProcessMesh([0, 1, 2, 3], dim_names=["cp"]), [ap.Shard(1)], 1
    else:  # dp x cp, the batch split on dp (ZeRO-3 there); the sequence enters replicated on cp
        mesh, placements, batch = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"]), [ap.Shard(0), ap.Replicate()], 4
    ap.parallelize(model, mesh, {"blocks.*.attn": ap.ContextParallel(comm=comm)})
    batches = [(torch.randint(0, 64, (batch, 16)), torch.randint(0, 64, (batch, 16))) for _ in range(3)]
    return _train(model, ref, mesh, batches, lambda m, x, y: lm_loss(m(x), y), lambda m, x, y: lm_loss(m(x), y),
                  placements, zero3=layout == "dp_cp")


@pytest.mark.parametrize("comm", ["ring", "all_to_all"])
def test_gpt_trains_equal_to_one_process(world4: Any, comm: str) -> None:
    """CP 4 (the batch's sequence sharded from the start) and DP 2 x CP 2 with ZeRO-3 on dp (the
    hook slices the sequence)."""
    for layout in ("cp4", "dp_cp"):
        for res in world4.run(_gpt_case, comm, layout):
            for got, want in res["losses"]:
                assert got == pytest.approx(want, rel=RTOL), (layout, res["losses"])
            assert not res["bad"], (layout, res["bad"])
            counts = res["counts"]
            if layout == "cp4" and comm == "ring":
                # per layer: forward 1 balancing move + 3 rotations + 1 move back; backward 1 move,
                # 3 rotations, 1 rotation home, 1 move back — and nothing else (batch 1: no gather)
                assert counts == {"all_to_all": 2 * (5 + 6), "all_reduce": 1}, counts
            if layout == "dp_cp":
                # ZeRO-3: the gradients' cp sums are reduced after the dp reduce-scatter, one bucket
                # per unit (2 blocks and the root), not one all-reduce per parameter; besides, the
                # loss's statistic over dp and cp: the loss flattens [batch, seq] with the sequence
                # split (a StridedShard), so its tokens are never gathered (log_softmax's backward
                # takes its row sums over the classes from the NLL backward: autoparallel.known_sums)
                assert counts.get("all_reduce") == 5, counts
            if layout == "cp4" and comm == "all_to_all":
                assert counts == {"all_to_all": 2 * 4, "all_reduce": 1}, counts  # q, k, v in; out back; x2 backward


def _llama_case(rank: int, comm: str) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from tests.models.test_hf_llama import tiny_llama

    torch.manual_seed(0)
    ref = tiny_llama(kv_heads=2 if comm == "ring" else 4)
    model = copy.deepcopy(ref)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["tp", "cp"])
    ap.parallelize(model, mesh, ap.plans.llama(model, cp=comm))
    ids = torch.randint(0, 128, (3, 2, 16))

    def step(m: Any, x: Any, y: Any) -> Any:
        return m(input_ids=x, labels=y, use_cache=False).loss

    return _train(model, ref, mesh, [(ids[i], ids[i]) for i in range(3)], step, step,
                  [ap.Replicate(), ap.Replicate()])


@pytest.mark.parametrize("comm", ["ring", "all_to_all"])
def test_transformers_llama_tp_x_cp_trains_equal_to_one_process(world4: Any, comm: str) -> None:
    """``ap.plans.llama(model, cp=...)`` on a tp 2 x cp 2 mesh: rotary positions, grouped-query
    attention (ring: 2 key/value heads, one per tp rank; all-to-all: 4, one per tp x cp rank),
    transformers' own causal mask tensor."""
    for res in world4.run(_llama_case, comm, timeout=300):
        for got, want in res["losses"]:
            assert got == pytest.approx(want, rel=RTOL), res["losses"]
        assert not res["bad"], res["bad"]
        # attention's all-to-alls only: the ring's rotation per layer forward, rotation and
        # return home backward (transformers passes its causal mask as a tensor without a cache:
        # every block is computed, in contiguous order); Ulysses' 4 per layer and direction
        assert res["counts"]["all_to_all"] == (2 * 3 if comm == "ring" else 2 * 8), res["counts"]


def _static_case(rank: int) -> dict[str, Any]:
    import warnings

    import torch

    import autoparallel as ap
    from examples.gpt_model import lm_loss

    torch.manual_seed(0)
    base = _gpt()
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(3)]  # eager, capture, replay
    out: dict[str, Any] = {}
    for mode in ("eager", "static"):
        model = ap.parallelize(copy.deepcopy(base), mesh, {"blocks.*.attn": ap.ContextParallel()})
        opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
        step = ap.to_static(model, loss=lm_loss, optimizer=opt) if mode == "static" else None
        losses = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in batches:
                xd, yd = (ap.shard_tensor(t, mesh, [ap.Shard(0), ap.Replicate()]) for t in (x, y))
                if step is None:
                    loss = lm_loss(model(xd), yd)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    loss = step(xd, yd)
                losses.append(float(loss.detach().full_tensor()))
        out[mode] = {"losses": losses, "params": [p.detach().full_tensor() for p in model.parameters()],
                     "eager_warnings": [str(w.message) for w in seen if "eager" in str(w.message)]}
    return out


def test_captured_ring_step_equals_eager_bitwise(world4: Any) -> None:
    import torch

    for res in world4.run(_static_case):
        assert res["static"]["eager_warnings"] == []  # the ring captured: no call fell back to eager
        assert res["static"]["losses"] == res["eager"]["losses"]
        for a, b in zip(res["static"]["params"], res["eager"]["params"]):
            assert torch.equal(a, b)


def _bad(rank: int, case: str) -> str:
    import torch

    import autoparallel as ap
    from examples.gpt_model import lm_loss

    torch.manual_seed(0)
    if case == "no cp axis":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    else:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["cp"])
    try:
        if case == "comm":
            ap.ContextParallel(comm="ulysses")
        model = _gpt(seq=18 if case == "length" else 16, heads=2 if case == "heads" else 4)
        ap.parallelize(model, mesh, {"blocks.*.attn": ap.ContextParallel(comm="all_to_all" if case == "heads" else "ring")})
        x = ap.shard_tensor(torch.randint(0, 64, (1, 18 if case == "length" else 16)), mesh, [ap.Replicate()])
        with ap.CommDebugMode() as comm:
            try:
                lm_loss(model(x), x)
            except ValueError as e:
                return f"{e} | collectives before: {len(comm.records)}"
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case, words", [
    ("length", "sequence length 18 (dim 1 of shape (1, 18, 32)) does not divide by the context-parallel degree 4"),
    ("heads", "2 heads, which do not divide by 4"),
    ("comm", "comm must be one of ('ring', 'all_to_all'), got 'ulysses'"),
    ("no cp axis", "context-parallel axis 'cp'"),
])
def test_bad_input_raises_the_same_error_on_every_rank(world4: Any, case: str, words: str) -> None:
    msgs = world4.run(_bad, case)
    assert len(set(msgs)) == 1, msgs
    assert words in msgs[0], msgs[0]
    if case in ("length", "heads"):
        assert msgs[0].endswith("collectives before: 0"), msgs[0]


def _masked(rank: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import autoparallel as ap

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: Any, attn_mask: Any = None) -> Any:
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.qkv(x).split(16, dim=-1))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(b, t, 16)

    torch.manual_seed(0)
    ref = Attention()
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["cp"])
    model = ap.parallelize(copy.deepcopy(ref), mesh, {"": ap.ContextParallel()})
    x = torch.randn(2, 8, 16)
    masks = [torch.ones(8, 8, dtype=torch.bool).tril(), torch.randn(2, 1, 8, 8)]  # boolean; additive, per sample
    errs, kinds = [], set()
    for mask in masks:
        xd = ap.shard_tensor(x, mesh, [ap.Replicate()]).requires_grad_()
        with ap.CommDebugMode() as comm:
            out = model(xd, attn_mask=ap.shard_tensor(mask, mesh, [ap.Replicate()]))
            out.sum().backward()
        kinds |= {f"{r.kind} {r.op}" for r in comm.records if r.op is not None}  # (not the input's gradient)
        xr = x.clone().requires_grad_()
        want = ref(xr, attn_mask=mask)
        want.sum().backward()
        errs.append(max(float((out.detach().full_tensor() - want.detach()).abs().max()),
                        float((xd.grad.full_tensor() - xr.grad).abs().max())))
        ref.zero_grad()
    return {"errs": errs, "kinds": kinds}


def test_a_mask_tensor_runs_the_ring_exactly(world4: Any) -> None:
    """A mask is sharded by its query rows and read piece by piece (transformers passes its
    causal mask as a tensor): the same output and input gradient, and no op but attention's ring
    moves data (the replicated input's gradient is gathered, as for any replicated input)."""
    for res in world4.run(_masked):
        assert max(res["errs"]) < 1e-5, res["errs"]
        assert all(k.startswith("all_to_all aten._scaled_dot_product") for k in res["kinds"]), res["kinds"]


def _pipelined(rank: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import autoparallel as ap
    from autoparallel.pipeline import Pipeline, split_sequential
    from examples.gpt_model import GPT, GPTConfig, lm_loss

    class Embed(nn.Module):
        def __init__(self, gpt: Any) -> None:
            super().__init__()
            self.tok, self.pos = gpt.tok, gpt.pos

        def forward(self, idx: Any) -> Any:
            return self.tok(idx) + self.pos.weight[: idx.shape[1]]

    class Head(nn.Module):
        def __init__(self, gpt: Any) -> None:
            super().__init__()
            self.ln, self.head = gpt.ln_f, gpt.head

        def forward(self, x: Any) -> Any:
            return self.head(self.ln(x))

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=4, tied=False))
    model = nn.Sequential(Embed(gpt), *gpt.blocks, Head(gpt))
    ref = copy.deepcopy(model)
    meshes = [ap.ProcessMesh([0, 1], dim_names=["cp"]), ap.ProcessMesh([2, 3], dim_names=["cp"])]
    pipe = Pipeline(split_sequential(model, meshes, plan={"*.attn": ap.ContextParallel()}), lm_loss,
                    num_microbatches=2, schedule="1F1B")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
        loss = pipe.step(ap.shard_tensor(x, meshes[0], [ap.Shard(1)]), ap.shard_tensor(y, meshes[-1], [ap.Shard(1)]))
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.detach().full_tensor()) if rank in meshes[-1] else None, float(ref_loss.detach())))
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if rank in p.process_mesh and not torch.allclose(p.detach().full_tensor(), q.detach(), rtol=RTOL, atol=1e-6):
            bad.append(name)
    return {"losses": losses, "bad": bad}


def test_pipeline_stages_with_context_parallelism_train_equal_to_one_process(world4: Any) -> None:
    """pp 2 x cp 2: each stage mesh's attention modules context-parallel (ring), 1F1B, SGD."""
    for rank, res in enumerate(world4.run(_pipelined)):
        for got, want in res["losses"]:
            if rank >= 2:
                assert got == pytest.approx(want, rel=RTOL), res["losses"]
        assert not res["bad"], res["bad"]


def _decoder_pipelined(rank: int) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from tests.models.test_hf_llama import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(kv_heads=2)
    ref = copy.deepcopy(model)
    meshes = [ap.ProcessMesh([0, 1], dim_names=["cp"]), ap.ProcessMesh([2, 3], dim_names=["cp"])]
    split = ap.pipeline.decoder_stages(model, meshes, plan={"*.self_attn": ap.ContextParallel()})
    pipe = ap.pipeline.Pipeline(split.stages, split.loss_fn, num_microbatches=2, schedule="1F1B")
    opt = ap.shard_optimizer(torch.optim.SGD(split.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (3, 4, 16))
    losses = []
    for k in range(3):
        with ap.CommDebugMode() as comm:
            loss = pipe.step(ap.shard_tensor(ids[k], meshes[0], [ap.Replicate()]),
                             ap.shard_tensor(ids[k], meshes[-1], [ap.Replicate()]))
        split.sync_tied_grads()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids[k], labels=ids[k]).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.detach().full_tensor()) if rank in meshes[-1] else None, float(ref_loss.detach())))
    return {"losses": losses, "counts": comm.get_comm_counts()}


def test_transformers_decoder_stages_with_context_parallelism(world4: Any) -> None:
    """``decoder_stages(model, meshes, plan={"*.self_attn": ContextParallel()})``: pp 2 x cp 2, one
    decoder layer per stage, ring attention inside each (6 all-to-alls per stage and step: two
    micro-batches x a forward rotation, a backward rotation and the way home)."""
    for rank, res in enumerate(world4.run(_decoder_pipelined)):
        for got, want in res["losses"]:
            if rank >= 2:
                assert got == pytest.approx(want, rel=RTOL), res["losses"]
        assert res["counts"]["all_to_all"] == 6, res["counts"]


def _idle_axis(rank: int) -> list[str]:
    import warnings

    import autoparallel as ap

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["tp", "cp"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ap.parallelize(_gpt(), mesh, {"blocks.*.mlp.fc": ap.ColWiseParallel(), "blocks.*.mlp.proj": ap.RowWiseParallel()})
    return [str(w.message) for w in seen if "context-parallel" in str(w.message)]


def test_a_cp_axis_without_the_style_warns_once(world4: Any) -> None:
    """Never silent: a ``cp`` axis nothing is laid out on would have every rank of it compute the
    whole sequence."""
    got = world4.run(_idle_axis)
    assert len(got[0]) == 1 and "no ContextParallel style" in got[0][0], got
    assert got[1:] == [[]] * 3  # (rank 0 speaks for all)


def _recomputed(rank: int) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from tests.models.test_hf_llama import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(kv_heads=2)
    ref = copy.deepcopy(model)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    ap.parallelize(model, mesh, {"model.layers.*.self_attn": ap.ContextParallel()})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 128, (4, 16))
        x = ap.shard_tensor(ids, mesh, [ap.Shard(0), ap.Replicate()])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.detach().full_tensor()), float(ref_loss.detach())))
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters())
           if not torch.allclose(p.detach().full_tensor(), q.detach(), rtol=RTOL, atol=1e-6)]
    return {"losses": losses, "bad": bad}


def test_transformers_gradient_checkpointing_recomputes_the_ring(world4: Any) -> None:
    """dp 2 x cp 2 with ``model.gradient_checkpointing_enable()``: each layer's forward, ring
    attention included, runs again in the backward (its rotations too, on every rank alike)."""
    for res in world4.run(_recomputed):
        for got, want in res["losses"]:
            assert got == pytest.approx(want, rel=RTOL), res["losses"]
        assert not res["bad"], res["bad"]
