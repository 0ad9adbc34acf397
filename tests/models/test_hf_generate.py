"""transformers' ``generate`` on a laid-out model equals one process (2 ranks): batched, left-padded
greedy generation of GPT-2 under tensor parallelism (``ap.plans.gpt2``) and data parallelism.

``generate`` reads ``inspect.signature(model.forward)`` to decide what it builds and passes
(position ids from the padding mask, ``logits_to_keep``): the wrapper local regions install as a
module's ``forward`` shows the module's own signature, so those inputs are passed as in one process.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest


def _generate(rank: int, layout: str) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from tests.models import zoo

    torch.manual_seed(0)
    model = zoo.gpt2()
    with torch.no_grad():  # make the logits depend on tokens and positions (a fresh init is nearly flat)
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    ref = copy.deepcopy(model)
    model.eval()
    ref.eval()
    mesh = ap.ProcessMesh([0, 1], dim_names=[layout])
    if layout == "tp":
        ap.parallelize(model, mesh, ap.plans.gpt2(model))
        place = [ap.Replicate()]
    else:
        ap.shard_layer(model, mesh)
        place = [ap.Shard(0)]
    ids = torch.randint(1, zoo.VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[3, :8] = 0  # left padding, as transformers recommends for batched generation
    ids[mask == 0] = 0
    kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        got = model.generate(input_ids=ap.shard_tensor(ids, mesh, place), attention_mask=ap.shard_tensor(mask, mesh, place), **kw)
    full = [s.full_tensor() if isinstance(s, ap.DistTensor) else s for s in got.scores]
    seq = got.sequences.full_tensor() if isinstance(got.sequences, ap.DistTensor) else got.sequences
    return {"same_signature": inspect.signature(model.forward) == inspect.signature(ref.forward),
            "tokens": torch.equal(seq, want.sequences),
            "score_err": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(full, want.scores))}


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_left_padded_generate_equals_one_process(world2: Any, layout: str) -> None:
    for res in world2.run(_generate, layout, timeout=300):
        assert res["same_signature"] and res["tokens"], res
        assert res["score_err"] < 1e-5, res
