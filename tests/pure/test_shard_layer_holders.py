"""How many references a module's plain parameters have besides their modules' slots.

``shard_layer``/``parallelize`` must refuse a parameter some optimizer already holds state for;
a torch optimizer with state for a parameter references it twice (a param group's list and its
state's key), so fewer than two outside references prove that none has, sparing the walk over
every object of the process. The count must never miss a holder: a tie or a shared module is not
one; an optimizer (one reference before its first step, two after) or a kept reference is.
"""

from __future__ import annotations

import torch
from torch import nn

from autoparallel.nn.shard_layer import _outside_references


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_parameters_held_by_their_modules_alone() -> None:
    assert _outside_references(_model()) == 0
    assert _outside_references(nn.Sequential()) == 0


def test_ties_and_shared_modules_are_not_outside_references() -> None:
    tied = _model()
    tied[2].weight = tied[0].weight
    assert _outside_references(tied) == 0
    shared = nn.Linear(4, 4)
    assert _outside_references(nn.Sequential(shared, nn.ReLU(), shared)) == 0


def test_an_optimizer_with_state_references_its_parameters_twice() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    assert _outside_references(model) == 1  # its param group: no state yet
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert _outside_references(model) == 2  # and its state's keys
    del opt
    assert _outside_references(model) == 0
    kept = model[2].bias
    assert _outside_references(model) == 1
    del kept
