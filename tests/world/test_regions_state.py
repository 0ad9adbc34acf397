"""Local regions and the modules' own state: plain attribute values are part of a region's
signature (a forward branching on a flag is captured again when the flag changes), and a forward
assigning a buffer or an attribute is not a region (a program keeps no module state it assigns):
it runs on DistTensors, once per call. Each trains as one process does.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.regions import local_regions_report

S0 = ap.Shard(0)


class Flagged(nn.Module):
    """Centers its hidden state over the batch when ``center`` is set (a batch mean: data moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.center = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.center:
            h = h - h.mean(0)
        return self.fc2(h)


class Counted(Flagged):
    """Counts its calls in a plain attribute and centers over the batch from the third on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.center = self.calls > 2
        return super().forward(x)


class Rescaled(nn.Module):
    """Assigns a new value to a buffer in each training forward, and counts its calls in a plain
    (integer) buffer written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.training:
            self.scale = self.scale * 0.5 + 0.75
        self.calls += 1
        return self.fc2(h / self.scale)


def _train(rank: int, cls: Any, flip: bool) -> dict[str, Any]:
    """4 SGD steps of ``cls`` data parallel on 4 ranks (``flip``: ``center`` set from step 2)
    against one process: losses, parameters, buffers and the report."""
    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        if flip:
            model.center = ref.center = step >= 2
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = F.cross_entropy(model(ap.shard_tensor(x, mesh, [S0])), ap.shard_tensor(y, mesh, [S0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss.detach().full_tensor()) == pytest.approx(float(want.detach()), rel=1e-5), step
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        got = b.full_tensor() if isinstance(b, ap.DistTensor) else b
        torch.testing.assert_close(got, c, msg=name)
    return local_regions_report(model)


def test_a_flag_the_forward_branches_on_is_part_of_the_signature(world4: Any) -> None:
    # captured with the flag off; set, a new signature: captured anew, the batch mean's
    # all-reduce in its program, so the mean is over the global batch, as in one process
    for report in world4.run(_train, Flagged, True):
        assert report["<root>"] == ["local", "local"], report


def test_a_forward_assigning_a_buffer_is_no_region_and_writes_once_per_call(world4: Any) -> None:
    # the trace is the call's run: the buffer is assigned once and the counter counts 4 calls
    for report in world4.run(_train, Rescaled, False):
        assert "assigns the buffer Rescaled.scale" in report["<root>"][0], report


def test_a_counter_the_forward_branches_on_counts_once_per_call(world4: Any) -> None:
    # read and written by the forward: the capture's writes are undone, the call refused and run on
    # DistTensors, which counts once, as one process does (the parameters agree at every step)
    for report in world4.run(_train, Counted, False):
        assert report["<root>"] and all(v == "refused: the forward writes the module attributes calls, center"
                                        or v == "refused: the forward writes the module attribute calls"
                                        for v in report["<root>"]), report
        assert report["fc1"] == ["local"] and report["fc2"] == ["local"], report


def _deep_copied(rank: int) -> bool:
    """``copy.deepcopy`` of a laid-out model after its regions ran (an EMA copy): the copy computes
    the same, is independent, and its regions start with no verdicts (quietly: no torch warning
    from copying cached pytree specs)."""
    import warnings

    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    ap.parallelize(model, mesh, {"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
    x = ap.shard_tensor(torch.randn(4, 8), mesh, [ap.Replicate()])
    y = model(x).full_tensor()
    assert any(local_regions_report(model).values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin = copy.deepcopy(model)
    assert not any(local_regions_report(twin).values())  # no verdict copied
    assert torch.equal(twin(x).full_tensor(), y)
    with torch.no_grad():
        twin[0].weight.mul_(0.5)
    assert torch.equal(model(x).full_tensor(), y) and not torch.equal(twin(x).full_tensor(), y)
    return True


def test_a_deep_copy_of_a_model_with_regions_is_independent_and_starts_afresh(world4: Any) -> None:
    assert all(world4.run(_deep_copied))
