"""``ap.pipeline.decoder_stages``' metadata side, no world: layer bounds, family detection, stage modules.

The split trains equal to one process in the zoo (``tests/models/zoo.py``, strategy ``pp``); here
the checks that raise before anything is laid out, and that a stage shares the model's layers
(keeping their names) without taking the modules of other stages.
"""

from __future__ import annotations

import pytest
from torch import nn

from autoparallel.pipeline.decoder import GPT2Stage, LlamaStage, _bounds, _family


def test_bounds_even_and_given() -> None:
    assert _bounds(4, 2, None) == [0, 2, 4]
    assert _bounds(5, 2, None) == [0, 3, 5]
    assert _bounds(4, 2, [1]) == [0, 1, 4]
    with pytest.raises(ValueError, match="3 decoder layers cannot fill 4 stages"):
        _bounds(3, 4, None)
    with pytest.raises(ValueError, match=r"split_points \[0\] must be 1 increasing layer indices in 1..3"):
        _bounds(4, 2, [0])


def test_not_a_decoder_lm() -> None:
    with pytest.raises(TypeError, match="Sequential is not a decoder-only LM"):
        _family(nn.Sequential(nn.Linear(2, 2)))


def test_stages_share_layers_and_keep_names() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=32, vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    assert _family(model) == "llama"
    first, last = LlamaStage(model, 0, 1, True, False), LlamaStage(model, 1, 2, False, True)
    names0 = {n for n, _ in first.named_parameters()}
    names1 = {n for n, _ in last.named_parameters()}
    assert "model.embed_tokens.weight" in names0 and "model.layers.0.mlp.up_proj.weight" in names0
    assert "model.layers.1.mlp.up_proj.weight" in names1 and "lm_head.weight" in names1 and "model.norm.weight" in names1
    assert not names0 & names1
    assert first.model.layers[0] is model.model.layers[0]  # shared, not copied
    assert model.model.layers is not first.model.layers and len(model.model.layers) == 2  # the model is intact
    assert first.model.rotary_emb is not last.model.rotary_emb  # each stage lays out its own buffers
    g = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32))
    assert _family(g) == "gpt2"
    later = GPT2Stage(g, 1, 2, False, True, g.lm_head)
    assert {n for n, _ in later.named_parameters()} >= {"transformer.h.1.attn.c_attn.weight", "transformer.ln_f.weight"}
    assert not any("wte" in n or "h.0." in n for n, _ in later.named_parameters())


def test_families_the_stages_cannot_run_are_refused_clearly() -> None:
    # a later stage hands hidden states to the model as inputs_embeds (Gemma would scale them
    # again) or calls GPT-2's blocks directly (GPT-J's need positions): refused before any layout
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=32)
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(num_key_value_heads=1, head_dim=8, **small))
    with pytest.raises(TypeError, match=r"transforms inputs_embeds \(gemma\)"):
        _family(gemma)
    phi = transformers.PhiForCausalLM(transformers.PhiConfig(**small))
    with pytest.raises(TypeError, match="its model.norm is missing"):
        _family(phi)
    gptj = transformers.GPTJForCausalLM(transformers.GPTJConfig(n_embd=16, n_layer=2, n_head=2, vocab_size=32, rotary_dim=4))
    with pytest.raises(TypeError, match=r"\(gptj\) has transformer.h but is not GPT-2"):
        _family(gptj)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True, **small))
    assert _family(tied) == "llama"  # a tied head is split like GPT-2's (tests/models/zoo.py: llama_tied x pp)
    head = nn.Linear(16, 32, bias=False)
    assert LlamaStage(tied, 1, 2, False, True, head).lm_head is head


def test_a_plan_naming_the_final_norm_goes_to_the_last_stage_only() -> None:
    # a stage before the last holds no final norm (an ``Absent`` pass-through under its name):
    # a sequence-parallel plan's "model.norm" entry is the last stage's, not a style refused
    # on the first stage's pass-through
    transformers = pytest.importorskip("transformers")
    import autoparallel as ap
    from autoparallel.pipeline.stage import Absent, _stage_plans

    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                   intermediate_size=32, vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    first, last = LlamaStage(model, 0, 1, True, False), LlamaStage(model, 1, 2, False, True)
    assert isinstance(first.model.norm, Absent) and first.model.norm(3) == 3
    plan = ap.plans.llama(model, sp=True)
    plans = _stage_plans([first, last], plan)
    assert "model.norm" in plan and "model.norm" not in plans[0] and "model.norm" in plans[1]
