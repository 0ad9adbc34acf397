"""The zoo under ``ap.auto_parallel``'s plan: an unmodified transformers model (GPT-2, BERT, Llama,
Mixtral, ViT; tiny configs), the plan searched on its first batch for 4 ranks and applied with
``plan.apply(model, optimizer)`` (``auto_dp_tp``: the best plan on a fixed 2 x 2 data x tensor
mesh, the model family's tensor-parallel plan), trains like one process (2 SGD steps, losses and every
parameter to rtol 1e-5 on every rank; tests/models/zoo.py). The collectives are not pinned: they
are the chosen plan's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.models import zoo  # noqa: E402


@pytest.mark.parametrize("strategy", ["auto", "auto_dp_tp"])
@pytest.mark.parametrize("model", ["gpt2", "bert", "llama", "mixtral", "vit"])
def test_auto_plan_trains_like_one_process(world4, model: str, strategy: str) -> None:  # type: ignore[no-untyped-def]
    results = world4.run(zoo.run_case, model, strategy, timeout=600)
    zoo.check(results)
