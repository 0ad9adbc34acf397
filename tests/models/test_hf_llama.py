"""An unmodified ``transformers.LlamaForCausalLM`` (tiny config, grouped-query attention, SDPA)
trains under tensor parallelism equal to one process.

4 gloo ranks: TP over 4 ranks (``tp``) and DP x TP 2 x 2 (``dp_tp``). q/k/v/gate/up are
column-parallel, o/down row-parallel, the LM head column-parallel (the loss runs on
class-sharded logits). With 4 query heads and 2 key/value heads over 4 ranks the key/value
heads cannot be split alike, so attention runs batch-sharded and the query moves: the case that
once failed at ``attn_output.reshape(*input_shape, -1)`` (the moved shard did not follow its
wrapper's strides, tests/world/test_strides_world.py). Three SGD (momentum) steps: the loss of
every step and every parameter (gathered) agree with one process to rtol 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("transformers")

RTOL = 1e-5
PLAN_NAMES = {
    "model.layers.*.self_attn.q_proj": "col", "model.layers.*.self_attn.k_proj": "col",
    "model.layers.*.self_attn.v_proj": "col", "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "col", "model.layers.*.mlp.up_proj": "col",
    "model.layers.*.mlp.down_proj": "row", "lm_head": "col",
}


def tiny_llama(kv_heads: int = 2):  # type: ignore[no-untyped-def]
    """hidden 64, 2 layers, 4 heads, 2 (``kv_heads``) key/value heads, MLP 128, vocabulary 128; no downloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                      intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _train(rank: int, layout: str, steps: int = 3) -> dict[str, object]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (steps, 4, 16))  # the same batches on every rank
    if layout == "tp":
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
        batch = [ap.Replicate()]
    else:
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
        batch = [ap.Shard(0), ap.Replicate()]
    styles = {"col": ap.ColWiseParallel, "row": ap.RowWiseParallel}
    ap.parallelize(model, mesh, {k: styles[v]() for k, v in PLAN_NAMES.items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if layout != "tp":
        opt = ap.shard_optimizer(opt)  # reduces the data-parallel gradients
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x = ap.shard_tensor(ids[step], mesh, batch)
        with ap.CommDebugMode() as comm:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids[step], labels=ids[step]).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.full_tensor().item(), ref_loss.item()))
    return {"losses": losses, "bad": _bad_parameters(model, ref), "counts": comm.get_comm_counts()}


def _bad_parameters(model, ref) -> list[tuple[str, float]]:  # type: ignore[no-untyped-def]
    """(name, largest difference) of each parameter (gathered) not equal to one process's."""
    import torch

    import autoparallel as ap

    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, ap.DistTensor), name
        full = p.detach().full_tensor()
        if not torch.allclose(full, q.detach(), rtol=RTOL, atol=RTOL * q.abs().max().item()):
            bad.append((name, (full - q).abs().max().item()))
    return bad


@pytest.mark.parametrize("layout", ["tp", "dp_tp"])
def test_llama_trains_equal_to_one_process(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    """Under dp x tp each tp rank holds 2 query heads and the 1 key/value head they read: attention
    runs on the heads as laid out, no all-to-all (the tp degree 2 divides the 2 key/value heads)."""
    for res in world4.run(_train, layout, timeout=300):
        for got, want in res["losses"]:
            assert got == pytest.approx(want, rel=RTOL), res["losses"]
        assert not res["bad"], res["bad"]
        if layout == "dp_tp":  # all-reduces, and the loss's row statistics gathered once
            assert set(res["counts"]) == {"all_reduce", "all_gather"} and res["counts"]["all_gather"] == 1, res["counts"]


def _decode(rank: int, layout: str, steps: int = 4) -> dict[str, object]:
    """A prompt, then ``steps`` tokens one at a time through the ``DynamicCache`` the model returns
    (``use_cache=True``, ``past_key_values``), next to one process doing the same."""
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    model = tiny_llama().eval()
    ref = copy.deepcopy(model)
    if layout == "dp":  # (the whole model is a region: it returns the cache it makes, or was given)
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        batch = [ap.Shard(0)]
    else:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
        styles = {"col": ap.ColWiseParallel, "row": ap.RowWiseParallel}
        ap.parallelize(model, mesh, {k: styles[v]() for k, v in PLAN_NAMES.items()})
        batch = [ap.Replicate()]
    ids = torch.randint(0, 128, (4, 6))
    errors, lengths = [], []
    with torch.no_grad():
        cache = ref_cache = None
        for _ in range(steps + 1):
            out = model(input_ids=ap.shard_tensor(ids, mesh, batch), past_key_values=cache, use_cache=True)
            want = ref(input_ids=ids, past_key_values=ref_cache, use_cache=True)
            cache, ref_cache = out.past_key_values, want.past_key_values
            got = out.logits.full_tensor()
            errors.append(((got - want.logits).abs().max() / want.logits.abs().max()).item())
            lengths.append((cache.get_seq_length(), ref_cache.get_seq_length()))
            ids = want.logits[:, -1].argmax(-1, keepdim=True)
    return {"errors": errors, "lengths": lengths, "report": ap.local_regions_report(model)}


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_llama_decodes_through_its_cache_equal_to_one_process(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    # the cache grows by one token per call on every rank: the model given it is a region whose
    # program takes the keys and values the cache holds and gives the ones it appends (its
    # capture's writes are undone: each call appends once); the prompt's call, given no cache,
    # returns the one it made (rebuilt around that call's tensors)
    for res in world4.run(_decode, layout, timeout=300):
        assert max(res["errors"]) < RTOL, res["errors"]
        assert res["lengths"] == [(6 + k, 6 + k) for k in range(5)], res["lengths"]
    if layout == "dp":
        root = res["report"]["<root>"]
        assert root and all(v.startswith("local") for v in root), res["report"]


def _clipped_pipeline(rank: int, schedule: str, static: bool = False, steps: int = 3) -> dict[str, object]:
    import warnings

    import torch

    import autoparallel as ap
    from tests.models import zoo

    torch.manual_seed(0)
    model = zoo.llama_tied()  # the LM head tied to the embedding: a copy on the last stage
    ref = copy.deepcopy(model)
    data = zoo.batches("llama_tied", steps)
    meshes = [ap.ProcessMesh([0, 1], dim_names=["dp"]), ap.ProcessMesh([2, 3], dim_names=["dp"])]
    split = ap.pipeline.decoder_stages(model, meshes)
    pipe = ap.pipeline.Pipeline(split.stages, split.loss_fn, num_microbatches=2, schedule=schedule, static=static)
    opt = ap.shard_optimizer(torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for batch in data:
        with warnings.catch_warnings():  # a chunk left eager (its program refused or not cut) fails the test
            warnings.filterwarnings("error", message=r".*Pipeline\(static=True\)")
            pipe.step(ap.shard_tensor(batch["input_ids"], meshes[0], [ap.Shard(0)]),
                      ap.shard_tensor(batch["labels"], meshes[-1], [ap.Shard(0)]))
        split.sync_tied_grads()
        got = float(split.clip_grad_norm_(0.5))  # every stage's gradients, the tied weight once
        opt.step()
        opt.zero_grad()
        ref(**batch).loss.backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append((got, want))
    world = zoo.mesh_of("pp")
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = zoo._gathered(p.detach(), world)
        if not torch.allclose(full, q.detach(), rtol=RTOL, atol=RTOL * q.abs().max().item()):
            bad.append((name, (full - q).abs().max().item()))
    cut = [c for c, chunk in pipe.programs.items() for v in chunk._programs.values()
           if getattr(v, "input_grad", None) is not None]
    return {"norms": norms, "bad": bad, "cut": cut}


@pytest.mark.parametrize("schedule, static", [("1F1B", False), ("ZBH1", False), ("ZBH1", True)],
                         ids=["1f1b", "zbh1", "zbh1-static"])
def test_a_tied_llama_pipeline_clips_by_the_global_norm_as_one_process(world4, schedule: str, static: bool) -> None:  # type: ignore[no-untyped-def]
    # (ZBH1: each stage's backward split into the input's gradient and the weights', run apart;
    # static: the captured backward program of the second stage cut in two)
    for rank, res in enumerate(world4.run(_clipped_pipeline, schedule, static, timeout=300)):
        for got, want in res["norms"]:
            assert want > 0.5 and got == pytest.approx(want, rel=RTOL), res["norms"]
        assert not res["bad"], res["bad"]
        assert res["cut"] == ([1] if static and rank >= 2 else [])


def _pp_resume(rank: int, path: str) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    import autoparallel as ap
    from tests.models import zoo

    data = zoo.batches("llama_tied", 4)
    meshes = [ap.ProcessMesh([0, 1], dim_names=["dp"]), ap.ProcessMesh([2, 3], dim_names=["dp"])]
    world = zoo.mesh_of("pp")

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = zoo.llama_tied()
        split = ap.pipeline.decoder_stages(model, meshes)
        pipe = ap.pipeline.Pipeline(split.stages, split.loss_fn, num_microbatches=2, schedule="1F1B")
        return model, split, pipe, ap.shard_optimizer(torch.optim.AdamW(split.parameters(), lr=1e-2))

    def step(split, pipe, opt, batch) -> float:  # type: ignore[no-untyped-def]
        loss = pipe.step(ap.shard_tensor(batch["input_ids"], meshes[0], [ap.Shard(0)]),
                         ap.shard_tensor(batch["labels"], meshes[-1], [ap.Shard(0)]))
        split.sync_tied_grads()
        opt.step()
        opt.zero_grad()
        return float(zoo._gathered(loss.detach(), world))

    whole, split, pipe, opt = build()
    straight = [step(split, pipe, opt, b) for b in data]
    first, split, pipe, opt = build()
    losses = [step(split, pipe, opt, b) for b in data[:2]]
    ap.save_state_dict({"model": first.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()
    again, split, pipe, opt = build()
    ap.checkpoint.init_optimizer_state(opt)
    sd = {"model": again.state_dict(), "optim": opt.state_dict()}
    ap.load_state_dict(sd, path)
    opt.load_state_dict(sd["optim"])
    losses += [step(split, pipe, opt, b) for b in data[2:]]
    bad = [name for (name, p), q in zip(again.named_parameters(), whole.parameters())
           if not torch.allclose(zoo._gathered(p.detach(), world), zoo._gathered(q.detach(), world), rtol=RTOL, atol=1e-7)]
    copies = [zoo._gathered(mb.weight.detach(), world) for _, (mb, _) in split.tied]
    return {"straight": straight, "resumed": losses, "bad": bad,
            "copy_equals_embedding": all(torch.equal(c, zoo._gathered(again.model.embed_tokens.weight.detach(), world))
                                         for c in copies)}


def test_a_tied_llama_pipeline_resumes_from_a_checkpoint_as_if_uninterrupted(world4, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the last stage's copy of the tied weight is in model.state_dict() (under the LM head's
    # key): a resumed pipeline starts from both saved values (the copy was left at its first)
    for res in world4.run(_pp_resume, str(tmp_path / "ckpt"), timeout=300):
        assert res["resumed"] == pytest.approx(res["straight"], rel=1e-6), (res["resumed"], res["straight"])
        assert not res["bad"] and res["copy_equals_embedding"], res


def _data_parallel_lengths(rank: int, lengths: list[int], use_cache: bool, tp: bool = False) -> dict[str, object]:
    """``shard_layer`` (data parallel) Llama, or with ``tp`` laid out by ``ap.plans.llama``
    (tensor parallel; 4 key/value heads), with or without its key/value cache (transformers' default
    ``use_cache=True``: a ``DynamicCache`` filled at every forward; ``False`` as fine-tuning
    scripts set it), trained at changing lengths: (losses, one process's, bad parameters, the
    decoder layers' (TP: attention modules') region report, whether every cached key and value
    equals one process's, in its batch-sharded (TP: head-sharded) layout)."""
    import torch

    import autoparallel as ap
    from autoparallel.regions import local_regions_report

    torch.manual_seed(0)
    model = tiny_llama(kv_heads=4 if tp else 2)
    model.config.use_cache = use_cache
    ref = copy.deepcopy(model)
    if tp:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
        ap.parallelize(model, mesh, ap.plans.llama(model))
        place, kept = [ap.Replicate()], (ap.Shard(1),)
    else:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.shard_layer(model, mesh)
        place, kept = [ap.Shard(0)], (ap.Shard(0),)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    losses = []
    cached = True
    for t in lengths:
        ids = torch.randint(0, 128, (8, t), generator=gen)
        out = model(input_ids=ap.shard_tensor(ids, mesh, place), labels=ap.shard_tensor(ids, mesh, place))
        loss = out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_out = ref(input_ids=ids, labels=ids)
        ref_loss = ref_out.loss
        if use_cache:  # (before the step: the cache holds what the forward computed)
            for ours, theirs in zip(out.past_key_values.layers, ref_out.past_key_values.layers):
                for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                    cached = (cached and isinstance(a, ap.DistTensor) and a.placements == kept
                              and torch.allclose(a.full_tensor(), b, rtol=RTOL, atol=RTOL * float(b.abs().max())))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.full_tensor().item(), ref_loss.item()))
    report = local_regions_report(model)
    return {"losses": losses, "bad": _bad_parameters(model, ref), "cached": cached, "report": report}


def _check_lengths(r: dict[str, Any], runs: str, served: int = 6) -> None:
    """One rank's ``_data_parallel_lengths``: losses, parameters and the cache equal one
    process; ``runs`` (the module that runs the decoder layers as its program) is local at every
    length it meets, at least ``served`` of them served by its program of open sizes."""
    for ours, theirs in r["losses"]:
        assert ours == pytest.approx(theirs, rel=RTOL)
    assert not r["bad"], r["bad"]
    assert r["cached"]
    verdicts = r["report"][runs]
    assert all(v.startswith("local") for v in verdicts), r["report"]
    assert sum(v == "local (open sizes)" for v in verdicts) >= served, r["report"]


@pytest.mark.parametrize("use_cache", [False, True])
def test_data_parallel_llama_runs_its_layers_locally_at_new_lengths(world4, use_cache: bool) -> None:  # type: ignore[no-untyped-def]
    """Its causal mask is a plain boolean tensor the decoder layers take and SDPA slices by the
    batch, inside the program; new lengths are served by the program of open sizes; loss and
    parameters equal one process. The causal LM with its loss is one region (its loss pads the
    labels: ``F.pad`` keeps the length open). With transformers' default cache the model returns
    the ``DynamicCache`` it made (``regions.objects.Made``): the keys and values its decoder layers
    write into it are the program's outputs, and each call returns a new cache holding its own, as
    DistTensors."""
    lengths = [9, 11, 13, 15, 17, 19, 21, 11, 25, 27]
    for r in world4.run(_data_parallel_lengths, lengths, use_cache):
        _check_lengths(r, "<root>", 7)


def test_tensor_parallel_llama_with_its_cache_is_a_region_at_new_lengths(world4) -> None:  # type: ignore[no-untyped-def]
    """Under ``ap.plans.llama`` the causal LM (each decoder layer's head-sharded products, the
    row-parallel ``o_proj``'s reduction, the MLP, the loss) is one program, whose outputs include
    the head-sharded keys and values of the cache it returns; new lengths are served by its
    program of open sizes; loss, parameters and the cache equal one process."""
    lengths = [9, 11, 13, 15, 17, 19, 21, 11, 25, 27, 29, 31]
    for r in world4.run(_data_parallel_lengths, lengths, True, True):
        _check_lengths(r, "<root>")


def _auto_pipeline(rank: int, steps: int = 3) -> dict[str, object]:
    """``ap.auto_parallel`` on a pp2 x dp2 mesh for a tied Llama, applied with ``plan.apply``: the
    head's copy on the last stage steps with the embedding (the optimizer given the model's
    parameters gets the copy too), clipped by the global norm."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoparallel as ap
    from autoparallel.engine.dtensor import DistTensor

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                                         tie_word_embeddings=True))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (steps, 8, 16))
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    plan = ap.auto_parallel(model, example={"input_ids": ids[0], "labels": ids[0]}, mesh=mesh, optimizer="sgd")
    pipe, opt = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    first, last = plan.stage_meshes
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for x in ids:
        opt.zero_grad()
        loss = pipe.step(ap.shard_tensor(x, first, [ap.Shard(0)]), ap.shard_tensor(x, last, [ap.Shard(0)]))
        norms.append(float(pipe.clip_grad_norm_(0.5)))
        opt.step()
        if rank in last.process_ids:
            losses.append(float(loss.detach().full_tensor()))
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss.detach()))
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()
              if isinstance(p, DistTensor) and rank in p.process_mesh.process_ids}
    copies = {n: p.detach().full_tensor() for n, p in pipe.pipeline.stages[-1].module.named_parameters()
              if n.endswith("lm_head.weight") and rank in last.process_ids}
    return {"plan": plan.candidates[0].name, "losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms, "params": params, "copies": copies,
            "ref": {n: p.detach() for n, p in ref.named_parameters()}}


def test_an_auto_pipeline_plan_for_a_tied_llama_trains_as_one_process(world4) -> None:  # type: ignore[no-untyped-def]
    import torch

    got = world4.run(_auto_pipeline, timeout=300)
    assert got[0]["plan"].startswith("pp2 x dp2"), got[0]["plan"]
    assert sum(1 for r in got if r["losses"]) == 2 and sum(1 for r in got if r["copies"]) == 2
    for r in got:
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=RTOL, atol=0)
        if r["losses"]:
            torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=RTOL, atol=0)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=RTOL, atol=1e-6, msg=name)
        for p in r["copies"].values():  # the copy of the tied weight equals the embedding
            torch.testing.assert_close(p, r["ref"]["model.embed_tokens.weight"], rtol=RTOL, atol=1e-6)


def _config_toggled(rank: int) -> list[tuple[bool, bool, float]]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    model = tiny_llama().eval()
    ref = copy.deepcopy(model)
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    ids = torch.randint(0, 128, (4, 8))
    xs = ap.shard_tensor(ids, mesh, [ap.Shard(0)])
    out = []
    for flag in (False, True, False):
        for m in (model, ref):
            m.config.output_hidden_states = flag  # read by the forward from the config it holds
        with torch.no_grad():
            got, want = model(xs, use_cache=False), ref(ids, use_cache=False)
        worst = float((got.logits.full_tensor() - want.logits).abs().max())
        if flag:
            worst = max(worst, *(float((a.full_tensor() - b).abs().max())
                                 for a, b in zip(got.hidden_states, want.hidden_states)))
        out.append((got.hidden_states is not None, want.hidden_states is not None, worst))
    return out


def test_a_config_value_set_between_calls_takes_effect(world4) -> None:  # type: ignore[no-untyped-def]
    """``model.config.output_hidden_states`` toggled between data-parallel calls: each call
    returns what one process returns (the hidden states appear and go), not a replay of the
    program captured at the first value."""
    for calls in world4.run(_config_toggled):
        for got, want, worst in calls:
            assert got == want and worst < 1e-5, calls
