"""Parallel styles on layer types models bring (found by the model zoo), from metadata alone.

* GPT-2's ``Conv1D`` stores its weight ``(in, out)``: column-parallel shards weight dim 1, row-
  parallel dim 0 (detected from ``nf``/``nx``; ``transposed=True`` states it for any module).
* A model's own RMSNorm (transformers' ``LlamaRMSNorm`` is not ``nn.RMSNorm``) is accepted by
  ``SequenceParallel``; a layer mixing features (``nn.Linear``) is not.
* ``ap.plans`` refuse, before anything is laid out, sizes that do not divide by the tp degree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel.nn.styles import in_out_weight, per_position


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, as GPT-2 has it: weight (nx, nf), ``addmm(b, x, w)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


class MyRMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


def test_conv1d_is_detected_and_laid_out_transposed() -> None:
    conv = Conv1D(12, 8)
    assert in_out_weight(conv) and not in_out_weight(nn.Linear(8, 12))
    assert ap.ColWiseParallel().param_placements(conv) == {"weight": ap.Shard(1), "bias": ap.Shard(0)}
    assert ap.RowWiseParallel().param_placements(conv) == {"weight": ap.Shard(0), "bias": ap.Replicate()}
    # nn.Linear unchanged
    assert ap.ColWiseParallel().param_placements(nn.Linear(8, 12)) == {"weight": ap.Shard(0), "bias": ap.Shard(0)}
    mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
    ap.ColWiseParallel().check("c_fc", conv, mesh, 0)  # accepted
    with pytest.raises(TypeError, match="supports nn.Linear"):
        ap.ColWiseParallel().check("norm", MyRMSNorm(4), mesh, 0)


def test_transposed_option_states_it() -> None:
    class InOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 12))

    assert ap.ColWiseParallel(transposed=True).param_placements(InOut()) == {"weight": ap.Shard(1), "bias": ap.Shard(0)}
    with pytest.raises(TypeError, match="transposed must be None or a bool"):
        ap.RowWiseParallel(transposed="yes")  # type: ignore[arg-type]


def test_sequence_parallel_takes_a_models_own_norm() -> None:
    mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
    assert per_position(MyRMSNorm(4)) and not per_position(nn.Linear(4, 4))
    ap.SequenceParallel().check("input_layernorm", MyRMSNorm(4), mesh, 0)
    with pytest.raises(TypeError, match="SequenceParallel on module 'proj'"):
        ap.SequenceParallel().check("proj", nn.Linear(4, 4), mesh, 0)


def test_plans_check_divisibility_up_front() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=48, vocab_size=64))
    plan = ap.plans.llama(model)
    assert isinstance(plan, dict) and plan["*.self_attn.q_proj"].__class__ is ap.ColWiseParallel
    assert plan["lm_head"].__class__ is ap.ColWiseParallel
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
    with pytest.raises(ValueError, match=r"key/value heads \(num_key_value_heads\) = 2"):
        plan.check_degree(mesh, 0)
    plan.check_degree(ap.ProcessMesh([0, 1], dim_names=["tp"]), 0)  # 4 heads, 2 kv heads, 48, 64: fine
    with pytest.raises(ValueError, match="is it a gpt2 model"):
        ap.plans.gpt2(model)


def test_vit_plan_splits_heads_and_mlp_and_checks_them() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, intermediate_size=6, num_labels=3))
    plan = ap.plans.vit(model)
    assert plan["*.attention.attention.query"].__class__ is ap.ColWiseParallel
    assert plan["*.attention.output.dense"].__class__ is ap.RowWiseParallel
    assert plan["*.layer.*[0-9].output.dense"].__class__ is ap.RowWiseParallel
    assert not any("classifier" in k or "embeddings" in k for k in plan)  # replicated
    with pytest.raises(ValueError, match=r"MLP width \(intermediate_size\) = 6"):
        plan.check_degree(ap.ProcessMesh([0, 1, 2, 3], dim_names=["tp"]), 0)
    plan.check_degree(ap.ProcessMesh([0, 1], dim_names=["tp"]), 0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=48, vocab_size=64))
    with pytest.raises(ValueError, match="is it a vit model"):
        ap.plans.vit(llama)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Mlp()


class _Tiny(nn.Module):
    """``layers.{0,1}.mlp.{gate,up,down}_proj`` and ``lm_head``: the names a plan typo misses."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(4, 16)


@pytest.mark.parametrize("pattern, suggestion", [
    ("layers.*.mlp.gate", "did you mean 'layers.*.mlp.gate_proj' or 'layers.*.mlp'?"),
    ("*.mlp.up", "did you mean '*.mlp.up_proj' or '*.mlp'"),
    ("layers.1.mlp.down", "did you mean 'layers.1.mlp.down_proj'"),
    ("lmhead", "did you mean 'lm_head'?"),
])
def test_a_plan_pattern_matching_nothing_names_the_closest_patterns(pattern: str, suggestion: str) -> None:
    mesh = ap.ProcessMesh([0], dim_names=["tp"])
    model = _Tiny()
    with pytest.raises(ValueError, match="plan pattern") as err:
        ap.parallelize(model, mesh, {pattern: ap.ColWiseParallel()})
    assert str(err.value).startswith(f"parallelize: plan pattern {pattern!r} matches no module of _Tiny; {suggestion}"), \
        str(err.value)
    assert not isinstance(model.lm_head.weight, ap.DistTensor)  # refused before any layout


def test_a_recompute_pattern_matching_nothing_names_the_closest_patterns() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["tp"])
    with pytest.raises(ValueError) as err:
        ap.parallelize(_Tiny(), mesh, {}, recompute={"layer.*": "full"})
    assert str(err.value) == "parallelize: recompute pattern 'layer.*' matches no module of _Tiny; did you mean 'layers.*' or 'layers'?"


def test_a_pattern_with_no_close_name_shows_a_sample_of_the_names() -> None:
    mesh = ap.ProcessMesh([0], dim_names=["tp"])
    with pytest.raises(ValueError, match=r"plan pattern 'zzz' matches no module of _Tiny \(module names look like \['layers', 'layers.0'"):
        ap.parallelize(_Tiny(), mesh, {"zzz": ap.ColWiseParallel()})
