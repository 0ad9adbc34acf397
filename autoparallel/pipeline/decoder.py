"""Pipeline stages of an unmodified decoder-only language model, split at its decoder layers.

    split = ap.pipeline.decoder_stages(model, meshes, plan=ap.plans.llama(model))
    pipe = ap.pipeline.Pipeline(split.stages, split.loss_fn, num_microbatches=4)
    loss = pipe.step(input_ids, labels)      # input_ids on meshes[0], labels on meshes[-1]
    split.sync_tied_grads()                  # a tied embedding / LM head split across stages
    opt.step()                               # opt built on split.parameters() (tied copies included)
    opt.step()

Stage 0 holds the input embeddings and the first layers, the last stage the last layers, the
final norm and the LM head; the loss is the model's own (``model.loss_function``, transformers'
shifted cross-entropy). Everything a transformers model computes in its top-level forward and
hands to every layer (positions, rotary embeddings, the causal mask) is computed per stage by
the model's own code, so nothing of the model is rewritten:

* Llama family (``model.model.layers``: Llama, Mistral, Qwen2, Mixtral): each stage runs a
  shallow copy of ``model.model`` (the same layer objects) whose ``layers`` hold only its slice;
  stage 0 calls it with ``input_ids``, later stages with ``inputs_embeds`` (the hidden states:
  the model then skips its embedding and derives positions, the rotary embeddings and the mask
  from them, exactly as it does for the whole model). Non-last stages replace the final norm
  by ``nn.Identity``; each stage owns a copy of the (parameter-free) rotary embedding.
* GPT-2 (``model.transformer.h``): stage 0 runs a shallow copy of ``model.transformer`` (token +
  position embeddings, dropout, its blocks); later stages call their blocks directly (GPT-2's
  attention applies its causal mask itself; the top-level mask adds nothing without padding).

Other models with ``model.layers`` or ``transformer.h`` are refused with a ``TypeError`` where the
stages above would not run them as they are (Gemma scales ``inputs_embeds``; GPT-J, Falcon and
BLOOM have other embeddings and blocks that need positions).

Weights tied across stages (GPT-2's LM head is its token embedding, as Llama's with
``tie_word_embeddings``) cannot be one parameter on
two stage meshes: the last stage gets its own copy, and ``sync_tied_grads()`` (after
``Pipeline.step``, before the optimizer step) adds each copy's gradient to the other's, so both
take the same update — the tied gradient of one process. Build the optimizer on
``split.parameters()``, which includes the copy (``model.parameters()`` does not). Padding masks are not supported (the
micro-batch carries only the input ids); the loss is a mean over equal micro-batches, exact when
no label is ``-100``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from autoparallel import compat, runtime
from autoparallel.api import reshard, shard_tensor
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.nn import parallelize, shard_layer
from autoparallel.optim.clip import clip_grad_norm_
from autoparallel.pipeline.stage import Absent, Stage, _stage_plans, check_meshes
from autoparallel.placement import Partial, Replicate
from autoparallel.runtime import comm


def _shallow(module: nn.Module, **children: nn.Module | None) -> nn.Module:
    """A copy of ``module`` sharing its parameters and children, with ``children`` replaced."""
    out = copy.copy(module)
    compat.set_child_modules(out, dict(compat.child_modules(module)))  # copy.copy shares the dict: the original keeps its children
    for name, child in children.items():
        compat.child_modules(out)[name] = child
    return out


def _layers(blocks: nn.ModuleList, lo: int, hi: int) -> nn.ModuleList:
    """Blocks ``lo:hi`` keeping their names (``layers.2`` stays ``layers.2`` in the stage)."""
    out = nn.ModuleList()
    for name, block in list(blocks.named_children())[lo:hi]:
        out.add_module(name, block)
    return out


class LlamaStage(nn.Module):
    """Layers ``lo:hi`` of a Llama-family model (+ embeddings on the first, norm + head on the last;
    ``lm_head``: the head, or the last stage's copy of one tied to the embedding)."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool, lm_head: nn.Module | None = None) -> None:
        super().__init__()
        inner: Any = model.model
        self.first, self.last = first, last
        self.model = _shallow(inner, layers=_layers(inner.layers, lo, hi),
                              embed_tokens=inner.embed_tokens if first else None,
                              norm=inner.norm if last else Absent(),
                              rotary_emb=copy.deepcopy(inner.rotary_emb))  # buffers only; laid out per stage
        self.lm_head = (lm_head if lm_head is not None else model.lm_head) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: input ids [b, s] on the first stage, hidden states [b, s, h] on the others
        io = {"input_ids": x} if self.first else {"inputs_embeds": x}
        h = self.model(**io, use_cache=False).last_hidden_state  # [b, s, h]
        return self.lm_head(h) if self.lm_head is not None else h  # logits [b, s, vocab] on the last


class GPT2Stage(nn.Module):
    """Blocks ``lo:hi`` of GPT-2 (+ token/position embeddings on the first, ``ln_f`` + head on the last)."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool, lm_head: nn.Module | None) -> None:
        super().__init__()
        inner: Any = model.transformer
        self.first = first
        blocks = _layers(inner.h, lo, hi)
        if first:  # GPT2Model.forward: embeddings, dropout, the blocks; ln_f on the last stage only
            self.transformer = _shallow(inner, h=blocks, ln_f=inner.ln_f if last else Absent())
        else:
            self.transformer = nn.Module()
            self.transformer.h = blocks
            self.transformer.ln_f = inner.ln_f if last else Absent()
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.transformer(input_ids=x, use_cache=False).last_hidden_state  # [b, s, h]
        else:
            h, blocks = x, self.transformer.h
            assert isinstance(blocks, nn.ModuleList)
            for block in blocks:
                h = block(h)[0]  # GPT2Block returns (hidden_states, ...)
            h = self.transformer.ln_f(h)  # type: ignore[operator]  # a submodule set by name
        return self.lm_head(h) if self.lm_head is not None else h


@dataclass
class DecoderStages:
    """The stages, the model's loss on the last stage, and the weights tied across stages."""

    stages: list[Stage]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None  # (None: the caller's own, ``split_at_blocks``)
    # (module, attribute) pairs holding one tied weight on two stage meshes
    tied: list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]] = field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        """Every stage's parameters, once each (with the copies of tied weights): give these to the optimizer."""
        out: dict[int, nn.Parameter] = {}
        for st in self.stages:
            for p in st.module.parameters():
                out.setdefault(id(p), p)
        return list(out.values())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every stage's gradients by their global norm, as one process clips the model's
        (``ap.clip_grad_norm_``; a tied weight counted once): call it on every rank after
        ``sync_tied_grads``, before the optimizer's step."""
        copies = {id(getattr(mb, b)) for _, (mb, b) in self.tied}
        params = [p for p in self.parameters() if id(p) not in copies]
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, copies=[p for p in self.parameters() if id(p) in copies])

    def sync_tied_grads(self) -> None:
        """Give each copy of a tied weight the sum of both copies' gradients (every rank calls it).

        A gradient exists only on the ranks of its stage mesh (the others never ran that stage's
        backward), so a missing one counts as zeros: every rank still joins both moves.
        """
        for (ma, a), (mb, b) in self.tied:
            pa, pb = getattr(ma, a), getattr(mb, b)
            pair = _paired(pa, pb)
            if pair is not None:  # each rank adds its local gradient to its counterpart's: one collective
                mine = pa if runtime.get_rank() in pa.process_mesh else pb
                reduced = _reduced(_grad(mine))
                summed = comm.all_reduce(layout.local_of(reduced), pair, 0, "sum")
                mine.grad = layout.from_local(summed, layout.spec_of(reduced))
                continue
            ga, gb = _moved(_grad(pb), pa), _moved(_grad(pa), pb)
            for p, g in ((pa, ga), (pb, gb)):
                if runtime.get_rank() in p.process_mesh:  # elsewhere the moved value is an empty shard
                    p.grad = g if p.grad is None else _reduced(p.grad) + g


def _paired(pa: torch.Tensor, pb: torch.Tensor) -> ProcessMesh | None:
    """A mesh whose axis 0 pairs each rank of ``pa``'s mesh with the rank at the same place in
    ``pb``'s, where both copies are laid out alike (the same placements, no Partial, on meshes of
    one shape): there each rank's shard is its counterpart's. None otherwise."""
    assert isinstance(pa, DistTensor) and isinstance(pb, DistTensor)
    ma, mb = pa.process_mesh, pb.process_mesh
    if ma.shape != mb.shape or tuple(pa.placements) != tuple(pb.placements) or any(isinstance(q, Partial) for q in pa.placements):
        return None
    return ProcessMesh(np.stack([ma.mesh, mb.mesh]).tolist(), ["pair", *ma.dim_names])


def _grad(p: torch.Tensor) -> DistTensor:
    """``p.grad``, or zeros laid out as ``p`` where this rank has none."""
    g = p.grad if p.grad is not None else torch.zeros_like(p.detach())
    assert isinstance(g, DistTensor)
    return g


def _reduced(t: DistTensor) -> DistTensor:
    """``t`` with its Partial axes reduced (Replicate), on its own mesh."""
    placements = [Replicate() if isinstance(p, Partial) else p for p in t.placements]
    return reshard(t, t.process_mesh, placements)


def _moved(grad: DistTensor, to: torch.Tensor) -> torch.Tensor:
    """``grad`` (of a copy on another stage mesh) reduced, then moved onto ``to``'s mesh and layout."""
    assert isinstance(to, DistTensor)
    placements = [Replicate() if isinstance(p, Partial) else p for p in to.placements]
    return reshard(_reduced(grad), to.process_mesh, placements)


def keep_the_copy_in_state_dicts(model: nn.Module, original: tuple[nn.Module, str], source: nn.Module,
                                 twin: tuple[nn.Module, str]) -> None:
    """``model.state_dict()`` names a tied weight twice (the embedding's key and the LM head's);
    under pp the later stage's copy (``twin``: module, attribute) is a parameter of its own,
    updated alike. The key of ``source`` (the model's own module the copy's holder was copied
    from: its LM head) holds the copy, so a checkpoint keeps the copy's value too and training
    resumes from both (the copy was otherwise left at its first value). ``model.load_state_dict``
    and ``ap.load_state_dict(model.state_dict(), ...)`` load that key into the copy (or the
    original's key, when only that one is given), and the model's own (tied) weight from the
    original's key. Which path runs depends on the entry's
    layout only (metadata: the same on every rank)."""
    names = {id(m): n for n, m in model.named_modules()}
    attr = twin[1]
    head_key = f"{names[id(source)]}.{attr}" if names[id(source)] else attr
    embed_key = f"{names[id(original[0])]}.{original[1]}" if names[id(original[0])] else original[1]

    def saved(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if prefix + head_key in state:
            state[prefix + head_key] = getattr(*twin).detach()

    def loading(module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        own = state.get(prefix + head_key)
        value = own if own is not None else state.get(prefix + embed_key)  # (one key given: both are its value)
        if value is None:
            return
        copy_ = getattr(*twin)
        assert isinstance(copy_, DistTensor)
        with torch.no_grad():
            if isinstance(value, DistTensor) and value.dist_spec == copy_.dist_spec:
                layout.local_of(copy_).copy_(layout.local_of(value))  # the copy's own layout: no collective
            else:  # another layout, or a whole tensor (a pretrained checkpoint)
                moved = reshard(value, copy_.process_mesh, list(copy_.placements)) if isinstance(value, DistTensor) \
                    else shard_tensor(value, copy_.process_mesh, list(copy_.placements))
                layout.local_of(copy_).copy_(layout.local_of(moved))
        if own is not None:  # the model's own head is the embedding: loaded from the embedding's entry
            state[prefix + head_key] = state.get(prefix + embed_key, getattr(*original).detach())

    model.register_state_dict_post_hook(saved)
    model.register_load_state_dict_pre_hook(loading)


# Llama-family models whose forward does more to ``inputs_embeds`` than use them (Gemma scales
# them by sqrt(hidden_size)): a later stage's hidden states would be changed again
_EMBEDS_TRANSFORMED = ("gemma",)


def is_decoder(model: Any) -> bool:
    """Whether ``decoder_stages`` splits ``model`` (a transformers decoder-only LM it knows)."""
    try:
        _family(model)
    except TypeError:
        return False
    return True


def _family(model: Any) -> str:
    kind = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    if isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList) and hasattr(model, "lm_head"):
        missing = [a for a in ("embed_tokens", "norm", "rotary_emb") if not hasattr(model.model, a)]
        if missing or kind.startswith(_EMBEDS_TRANSFORMED):
            why = (f"its model.{missing[0]} is missing" if missing else
                   f"its forward transforms inputs_embeds ({kind}), which later stages pass hidden states as")
            raise TypeError(f"decoder_stages: {type(model).__name__} has model.layers but is not split like Llama: "
                            f"{why}; lay it out with ap.pipeline.Pipeline and stage modules of your own")
        return "llama"
    if isinstance(getattr(getattr(model, "transformer", None), "h", None), nn.ModuleList) and hasattr(model, "lm_head"):
        if kind not in ("gpt2", ""):  # GPT-J, Falcon, BLOOM: other embeddings, blocks that need positions
            raise TypeError(f"decoder_stages: {type(model).__name__} ({kind}) has transformer.h but is not GPT-2; "
                            "lay it out with ap.pipeline.Pipeline and stage modules of your own")
        return "gpt2"
    names = [n for n, _ in model.named_modules() if n][:8]
    raise TypeError(
        f"decoder_stages: {type(model).__name__} is not a decoder-only LM with model.layers (Llama family) or "
        f"transformer.h (GPT-2) and lm_head; its modules look like {names}"
    )


def _bounds(n: int, count: int, split_points: Sequence[int] | None) -> list[int]:
    """Layer index where each stage starts, plus ``n`` at the end."""
    if split_points is None:
        if n < count:
            raise ValueError(f"decoder_stages: {n} decoder layers cannot fill {count} stages")
        base, extra = divmod(n, count)
        sizes = [base + (1 if c < extra else 0) for c in range(count)]
        return [sum(sizes[:c]) for c in range(count + 1)]
    points = list(split_points)
    if len(points) != count - 1 or points != sorted(set(points)) or (points and (points[0] < 1 or points[-1] >= n)):
        raise ValueError(
            f"decoder_stages: split_points {points} must be {count - 1} increasing layer indices in 1..{n - 1} "
            f"(stage c starts at layer split_points[c - 1])"
        )
    return [0, *points, n]


def decoder_stages(
    model: Any,  # a transformers model: its submodules are reached by name
    meshes: Sequence[ProcessMesh],
    *,
    split_points: Sequence[int] | None = None,
    num_chunks: int = 1,
    plan: dict[str, Any] | None = None,
) -> DecoderStages:
    """Split a transformers decoder-only LM at its decoder layers into ``len(meshes) * num_chunks`` stages.

    ``split_points``: the layer index each stage after the first starts at (evenly without).
    Stage ``c`` runs on ``meshes[c % len(meshes)]``; its parameters are laid out by
    ``ap.parallelize(stage, mesh, <the part of plan matching it>)`` or, without ``plan``,
    Replicate. The model's modules are shared, not copied: ``model.named_parameters()`` shows
    the laid-out parameters afterwards. Checks are on metadata only (same error on every rank).
    """
    check_meshes(meshes)
    family = _family(model)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"decoder_stages: num_chunks must be a positive int, got {num_chunks!r}")
    count = len(meshes) * num_chunks
    blocks = model.model.layers if family == "llama" else model.transformer.h
    bounds = _bounds(len(blocks), count, split_points)
    tied: list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]] = []
    modules: list[nn.Module] = []
    embed = model.model.embed_tokens if family == "llama" else model.transformer.wte
    for c in range(count):
        first, last = c == 0, c == count - 1
        head = model.lm_head if last else None
        if last and not first and model.lm_head.weight is embed.weight:  # tied across stages: a copy
            head = copy.copy(model.lm_head)
            compat.set_own_parameters(head, {**compat.own_parameters(model.lm_head),
                                             "weight": nn.Parameter(embed.weight.detach().clone())})
            tied.append(((embed, "weight"), (head, "weight")))
        if family == "llama":
            modules.append(LlamaStage(model, bounds[c], bounds[c + 1], first, last, head))
        else:
            modules.append(GPT2Stage(model, bounds[c], bounds[c + 1], first, last, head))
    plans = _stage_plans(modules, plan)
    stages = []
    for c, module in enumerate(modules):
        mesh = meshes[c % len(meshes)]
        if plans[c]:
            parallelize(module, mesh, plans[c])
        else:
            shard_layer(module, mesh)
        stages.append(Stage(module, mesh, None, f"layers {bounds[c]}..{bounds[c + 1] - 1}"))
    if tied:
        keep_the_copy_in_state_dicts(model, (embed, "weight"), model.lm_head, tied[0][1])
    vocab = model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab)  # type: ignore[operator]

    return DecoderStages(stages, loss_fn, tied)


__all__ = ["DecoderStages", "GPT2Stage", "LlamaStage", "decoder_stages"]
