"""Ready-made tensor/sequence-parallel plans for ``transformers`` models: one line to parallelize.

    ap.parallelize(model, mesh, ap.plans.llama(model, sp=True))

Each function reads the module names and ``model.config`` of an unmodified model and returns an
``ModelPlan``: the plan dict ``{module-name pattern: style}`` (torchtitan's
``parallelize_llama`` shape) plus the sizes that must divide by the tensor-parallel degree
(heads, key/value heads, vocabulary, MLP width), which ``ap.parallelize`` checks from metadata
before anything is laid out, so every rank raises the same ``ValueError``. The dict is an
ordinary dict: edit it, or pass your own.

Common shape (Megatron): attention projections column-parallel (heads split across ranks),
the output projection row-parallel; MLP up column, down row; the input embedding
vocab-parallel and the LM head column-parallel, so the loss runs on class-sharded logits (loss
parallel: two row-sized all-reduces, the logits never gathered). ``sp=True`` adds Megatron
sequence parallelism: the norms run on sequence-sharded activations, a row-parallel layer
reduce-scatters instead of all-reducing, and each attention / MLP gathers its input once
(``PrepareLayerInput``) — the sequence length must then divide by the tp degree.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autoparallel.nn.context_parallel import COMMS, ContextParallel
from autoparallel.nn.parallelize import ModelPlan
from autoparallel.nn.styles import (
    ColWiseParallel,
    ParallelStyle,
    PrepareLayerInput,
    RowWiseParallel,
    SequenceParallel,
    VocabParallelEmbedding,
)
from autoparallel.placement import Replicate


def _config(model: nn.Module, fn: str) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise TypeError(f"ap.plans.{fn}: expects a transformers model (with .config), got {type(model).__name__}")
    return cfg


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def _name_of(model: nn.Module, module: Any) -> str | None:
    return _names(model).get(id(module)) if isinstance(module, nn.Module) else None


def _require(model: nn.Module, fn: str, suffixes: list[str]) -> None:
    """Raise ``ValueError`` unless some module name ends with each suffix (a model of another family)."""
    names = [n for n, _ in model.named_modules()]
    missing = [s for s in suffixes if not any(n == s or n.endswith("." + s) for n in names)]
    if missing:
        raise ValueError(
            f"ap.plans.{fn}: {type(model).__name__} has no module named *.{missing[0]} "
            f"(module names look like {[n for n in names if n][:8]}); is it a {fn} model?"
        )


def _gather_input() -> PrepareLayerInput:
    """A block's input made Replicate on tp once (the sequence all-gather under SP)."""
    return PrepareLayerInput([Replicate()])  # also when passed as hidden_states=


def _input_embeddings(model: nn.Module) -> str | None:
    """The name of the model's input embedding (transformers' ``get_input_embeddings()``)."""
    get = getattr(model, "get_input_embeddings", None)
    return _name_of(model, get()) if callable(get) else None


def _heads(model: nn.Module, plan: dict[str, ParallelStyle], embed: str | None, head: str | None) -> None:
    """Vocab-parallel input embedding and column-parallel LM head (loss parallel), in place."""
    if embed is not None:
        plan[embed] = VocabParallelEmbedding()
    if head is not None:
        plan[head] = ColWiseParallel()


def llama(model: nn.Module, sp: bool = False, cp: str | None = None) -> ModelPlan:
    """The Llama-family plan (Llama, Mistral, Qwen2: ``*.self_attn.{q,k,v,o}_proj``, ``*.mlp.{gate,up,down}_proj``).

    q/k/v/gate/up column-parallel, o/down row-parallel, ``embed_tokens`` vocab-parallel,
    ``lm_head`` column-parallel. ``sp=True``: the RMSNorms sequence-parallel. Needs the query
    heads, key/value heads, MLP width and vocabulary to divide by the tp degree.
    ``cp="ring"`` or ``"all_to_all"``: besides, context parallelism on the mesh axis ``"cp"``
    (``ContextParallel`` on every ``self_attn``); with ``"all_to_all"`` the heads must divide by
    tp x cp. Not with ``sp=True`` (one sequence split at a time).
    """
    cfg = _config(model, "llama")
    _require(model, "llama", ["self_attn.q_proj", "mlp.gate_proj"])
    if cp is not None and cp not in COMMS:
        raise ValueError(f"plans.llama: cp must be None or one of {COMMS}, got {cp!r}")
    if cp is not None and sp:
        raise ValueError("plans.llama: sp=True and cp= together are not supported: sequence parallelism splits "
                         "the sequence on the tp axis around the norms, context parallelism on the cp axis "
                         "everywhere; use cp= alone")
    plan: dict[str, ParallelStyle] = {}
    if cp is not None:
        plan["*.self_attn"] = ContextParallel(comm=cp)
    if sp:
        plan["*.self_attn"] = _gather_input()
        plan["*.mlp"] = _gather_input()
    for proj, style in (("q", ColWiseParallel), ("k", ColWiseParallel), ("v", ColWiseParallel), ("o", RowWiseParallel)):
        plan[f"*.self_attn.{proj}_proj"] = style()
    plan["*.mlp.gate_proj"] = ColWiseParallel()
    plan["*.mlp.up_proj"] = ColWiseParallel()
    plan["*.mlp.down_proj"] = RowWiseParallel()
    if sp:
        plan["*.input_layernorm"] = SequenceParallel()
        plan["*.post_attention_layernorm"] = SequenceParallel()
        norm = _name_of(model, getattr(getattr(model, "model", model), "norm", None))
        if norm:
            plan[norm] = SequenceParallel()
    _heads(model, plan, _input_embeddings(model), _name_of(model, getattr(model, "lm_head", None)))
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return ModelPlan(plan, {
        "attention heads (num_attention_heads)": cfg.num_attention_heads,
        "key/value heads (num_key_value_heads)": kv,
        "MLP width (intermediate_size)": cfg.intermediate_size,
        "vocabulary (vocab_size)": cfg.vocab_size,
    }, "llama")


def mixtral(model: nn.Module, sp: bool = False, experts: str = "tp") -> ModelPlan:
    """The Mixtral plan: attention as ``llama``; the experts by ``experts``.

    ``experts="tp"`` (default): every expert's w1/w3 column-parallel and w2 row-parallel (each
    rank holds a slice of every expert; the routing runs replicated on tp, so every rank visits
    the same experts in the same order). ``experts="replicate"``: the experts whole on every
    rank (the MoE block computed redundantly on tp; no collective in it). The router ``gate``
    stays replicated.
    """
    if experts not in ("tp", "replicate"):
        raise ValueError(f"ap.plans.mixtral: experts must be 'tp' or 'replicate', got {experts!r}")
    cfg = _config(model, "mixtral")
    _require(model, "mixtral", ["self_attn.q_proj", "block_sparse_moe.gate"])
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan["*.self_attn"] = _gather_input()
        plan["*.block_sparse_moe"] = _gather_input()
    for proj, style in (("q", ColWiseParallel), ("k", ColWiseParallel), ("v", ColWiseParallel), ("o", RowWiseParallel)):
        plan[f"*.self_attn.{proj}_proj"] = style()
    divisible = {
        "attention heads (num_attention_heads)": cfg.num_attention_heads,
        "key/value heads (num_key_value_heads)": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "vocabulary (vocab_size)": cfg.vocab_size,
    }
    if experts == "tp":
        plan["*.block_sparse_moe.experts.*.w1"] = ColWiseParallel()
        plan["*.block_sparse_moe.experts.*.w3"] = ColWiseParallel()
        plan["*.block_sparse_moe.experts.*.w2"] = RowWiseParallel()
        divisible["expert MLP width (intermediate_size)"] = cfg.intermediate_size
    if sp:
        plan["*.input_layernorm"] = SequenceParallel()
        plan["*.post_attention_layernorm"] = SequenceParallel()
        norm = _name_of(model, getattr(getattr(model, "model", model), "norm", None))
        if norm:
            plan[norm] = SequenceParallel()
    _heads(model, plan, _input_embeddings(model), _name_of(model, getattr(model, "lm_head", None)))
    return ModelPlan(plan, divisible, "mixtral")


def gpt2(model: nn.Module, sp: bool = False) -> ModelPlan:
    """The GPT-2 plan: MLP ``c_fc`` column / ``c_proj`` row, attention ``c_proj`` row, tied head column.

    GPT-2's ``Conv1D`` layers store ``(in, out)`` weights; the styles detect them. Its fused
    ``c_attn`` produces ``[q | k | v]`` along the features, so a column split does not give
    whole heads (rank 0 would hold all of q's first columns and none of v's): ``c_attn`` stays
    replicated, attention runs on every tp rank, and ``attn.c_proj`` slices its input locally
    (``is_input_parallel=False``: no collective) and reduces its output. The MLP is split as
    Megatron's. ``sp=True``: ``ln_1``/``ln_2``/``ln_f`` sequence-parallel.
    """
    cfg = _config(model, "gpt2")
    _require(model, "gpt2", ["attn.c_attn", "mlp.c_fc"])
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan["*.attn"] = _gather_input()
        plan["*.mlp"] = _gather_input()
    plan["*.attn.c_proj"] = RowWiseParallel(is_input_parallel=False)
    plan["*.mlp.c_fc"] = ColWiseParallel()
    plan["*.mlp.c_proj"] = RowWiseParallel()
    if sp:
        plan["*.ln_1"] = SequenceParallel()
        plan["*.ln_2"] = SequenceParallel()
        ln_f = _name_of(model, getattr(getattr(model, "transformer", model), "ln_f", None))
        if ln_f:
            plan[ln_f] = SequenceParallel()
    _heads(model, plan, _input_embeddings(model), _name_of(model, getattr(model, "lm_head", None)))
    n_inner = getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
    return ModelPlan(plan, {"MLP width (n_inner)": n_inner, "vocabulary (vocab_size)": cfg.vocab_size}, "gpt2")


def _encoder_layers(plan: dict[str, ParallelStyle], attention: str) -> None:
    """A BERT-shaped encoder layer's entries, in place: ``*.{attention}.{query,key,value}`` and
    ``*.intermediate.dense`` column-parallel, ``*.attention.output.dense`` and the MLP's
    ``*.layer.N.output.dense`` row-parallel (BERT: ``attention.self``; ViT: ``attention.attention``)."""
    for proj in ("query", "key", "value"):
        plan[f"*.{attention}.{proj}"] = ColWiseParallel()
    plan["*.attention.output.dense"] = RowWiseParallel()
    plan["*.intermediate.dense"] = ColWiseParallel()
    plan["*.layer.*[0-9].output.dense"] = RowWiseParallel()  # the MLP output, not *.attention.output.dense


def bert(model: nn.Module, sp: bool = False) -> ModelPlan:
    """The BERT plan: query/key/value and ``intermediate.dense`` column, the two ``output.dense`` row.

    ``word_embeddings`` vocab-parallel; the masked-LM ``cls.predictions.decoder`` (tied to it)
    column-parallel; position/token-type embeddings and the LM transform stay replicated.
    ``sp=True``: the post-residual LayerNorms (``*.output.LayerNorm``, ``embeddings.LayerNorm``,
    the transform's) sequence-parallel.
    """
    cfg = _config(model, "bert")
    _require(model, "bert", ["attention.self.query", "intermediate.dense"])
    plan: dict[str, ParallelStyle] = {}
    if sp:
        plan["*.attention.self"] = _gather_input()
    _encoder_layers(plan, "attention.self")
    if sp:
        plan["*LayerNorm"] = SequenceParallel()
    head = None
    predictions = getattr(getattr(model, "cls", None), "predictions", None)
    if predictions is not None:
        head = _name_of(model, getattr(predictions, "decoder", None))
    _heads(model, plan, _input_embeddings(model), head)
    return ModelPlan(plan, {
        "attention heads (num_attention_heads)": cfg.num_attention_heads,
        "MLP width (intermediate_size)": cfg.intermediate_size,
        "vocabulary (vocab_size)": cfg.vocab_size,
    }, "bert")


def vit(model: nn.Module) -> ModelPlan:
    """The ViT plan (ViT, DeiT: ``*.attention.attention.{query,key,value}``, ``*.intermediate.dense``).

    query/key/value and ``intermediate.dense`` column-parallel (heads and MLP width split), the
    two ``output.dense`` row-parallel; the patch embedding, position embeddings, [CLS] token,
    LayerNorms and the classifier stay replicated (the classifier reads the [CLS] token only:
    ``num_labels`` is small and need not divide). No ``sp``: the sequence (patches + [CLS]) is
    1 or 2 modulo 4, so it rarely divides by the tp degree. Needs the heads and the MLP width to
    divide by the tp degree.
    """
    cfg = _config(model, "vit")
    _require(model, "vit", ["attention.attention.query", "intermediate.dense"])
    plan: dict[str, ParallelStyle] = {}
    _encoder_layers(plan, "attention.attention")
    return ModelPlan(plan, {
        "attention heads (num_attention_heads)": cfg.num_attention_heads,
        "MLP width (intermediate_size)": cfg.intermediate_size,
    }, "vit")


__all__ = ["ModelPlan", "bert", "gpt2", "llama", "mixtral", "vit"]
