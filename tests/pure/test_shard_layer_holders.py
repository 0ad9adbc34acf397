"""Whether a module's plain parameters are held by anything but their modules' slots.

``shard_layer``/``parallelize`` must refuse a parameter some optimizer already holds state for;
proving that none can (nothing but the modules references the parameters) spares the walk over
every object of the process. The proof must never miss a holder: a tie or a shared module is not
one, an optimizer (with or without state) or a reference the user kept is.
"""

from __future__ import annotations

import torch
from torch import nn

from autoparallel.nn.shard_layer import _held_outside_modules


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_parameters_held_by_their_modules_alone() -> None:
    assert not _held_outside_modules(_model())
    assert not _held_outside_modules(nn.Sequential())


def test_ties_and_shared_modules_are_not_outside_holders() -> None:
    tied = _model()
    tied[2].weight = tied[0].weight
    assert not _held_outside_modules(tied)
    shared = nn.Linear(4, 4)
    assert not _held_outside_modules(nn.Sequential(shared, nn.ReLU(), shared))


def test_an_optimizer_or_a_kept_reference_is_an_outside_holder() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    assert _held_outside_modules(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert _held_outside_modules(model)
    del opt
    assert not _held_outside_modules(model)
    kept = model[2].bias
    assert _held_outside_modules(model)
    del kept
    assert not _held_outside_modules(model)
