"""``ap.memory.held_bytes`` and ``ap.memory.peak_rise`` in one process."""

from __future__ import annotations

import torch
from torch import nn

import autoparallel as ap


def test_held_bytes_counts_parameters_once_and_optimizer_states() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied: held once
    params = (8 * 8 + 8 + 8) * 4
    opt = torch.optim.Adam(model.parameters())
    assert ap.memory.held_bytes(model) == params
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    states = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert ap.memory.held_bytes(model, opt) == params + states and states >= 2 * params


def test_peak_rise_sees_a_temporary() -> None:
    def step() -> None:
        a = torch.empty(1 << 18)  # 1 MiB, freed before b is made
        del a
        b = torch.empty(1 << 17)
        del b

    rise = ap.memory.peak_rise(step)
    assert 1 << 20 <= rise < (1 << 20) + (1 << 17)
