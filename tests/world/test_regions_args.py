"""Local regions (autoparallel.regions) whose module slices an argument: a replicated mask (a
DistTensor, or a plain tensor an op adopts) that the attention takes batch-sharded is sliced by the
captured program, and new lengths are served by its program of open sizes. Each test trains at
changing lengths against the DistTensor run (regions disabled) and one process (4 ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoparallel as ap
from autoparallel.placement import Replicate, Shard
from autoparallel.regions import disable_local_regions, local_regions_report

R, S0 = Replicate(), Shard(0)


def _mesh() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])


class MaskedAttention(nn.Module):
    """Attention over an additive key-padding mask argument, cut to the keys' length inside (as
    transformers' SDPA attention takes ``mask[:, :, :, :kv_len]``): batch-sharded queries take
    the replicated mask batch-sharded, a local slice of an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, :, :t])
        return self.out(y.transpose(1, 2).reshape(b, t, 8))


def _masked(rank: int, lengths: list[int], square: bool = False, plain_bool: bool = False) -> dict[str, Any]:
    """MaskedAttention trained at ``lengths`` with and without regions, and in one process
    (``square``: the mask is ``(B, 1, t, t)``, contiguous, as transformers' causal masks are;
    ``plain_bool``: a causal boolean mask, given as a plain tensor, as transformers' models
    build it from plain tensors)."""
    mesh = _mesh()
    runs = []
    for local in (False, True, None):
        torch.manual_seed(0)
        model = MaskedAttention()
        if local is not None:
            ap.shard_layer(model, mesh)
            if not local:
                disable_local_regions(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, comms = [], []
        for t in lengths:
            g = torch.Generator().manual_seed(t)
            x = torch.randn(8, t, 8, generator=g)
            # a padding mask, longer than the keys: cut inside; or a square one (strides t * t, t, 1)
            mask = torch.randn(8, 1, t, t, generator=g) if square else torch.randn(8, 1, 1, t + 2, generator=g)
            if plain_bool:  # (keys that see no query would make NaN rows: a causal mask has none)
                mask = torch.ones(t, t + 2, dtype=torch.bool).tril(2)[None, None].expand(8, 1, t, t + 2).contiguous()
            with ap.CommDebugMode() as comm:
                if local is None:
                    y = model(x, mask)
                else:
                    y = model(ap.shard_tensor(x, mesh, [S0]), mask if plain_bool else ap.shard_tensor(mask, mesh, [R]))
            loss = (y * y).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach().full_tensor() if isinstance(loss, ap.DistTensor) else loss.detach()))
            comms.append(comm.get_comm_counts())
        params = {n: (p.detach().full_tensor() if isinstance(p, ap.DistTensor) else p.detach())
                  for n, p in model.named_parameters()}
        runs.append({"losses": losses, "params": params, "comm": comms,
                     "report": local_regions_report(model) if local else {}})
    return {"runs": runs}


def test_an_argument_sliced_inside_is_sliced_before_a_local_run(world4: Any) -> None:
    """A replicated mask argument that the attention takes batch-sharded (through a view of it):
    the program slices it (no communication); new lengths are served by the program of open
    sizes (the mask's length and the keys' are two sizes). Equal to the DistTensor run and to one
    process."""
    lengths = [6, 8, 10, 12, 6, 14]
    for res in world4.run(_masked, lengths):
        on_dist, local, one = res["runs"]
        assert local["report"]["<root>"][0] == "local", local["report"]
        assert local["report"]["<root>"][1:] == ["local"] + ["local (open sizes)"] * 3, local["report"]
        assert all(c == {} for c in local["comm"]), local["comm"]  # a forward moves nothing
        for run in (on_dist, local):
            assert run["losses"] == pytest.approx(one["losses"], rel=1e-5)
            for n, p in one["params"].items():
                torch.testing.assert_close(run["params"][n], p, rtol=1e-5, atol=1e-6)


def test_a_square_mask_argument_is_answered_by_its_family(world4: Any) -> None:
    """A contiguous ``(B, 1, t, t)`` mask argument: its sizes are open like the input's, so new
    lengths are served by the program of open sizes. Equal to the DistTensor run and to one
    process."""
    lengths = [6, 10, 14, 18, 22, 6, 26]  # (no coincidence: 12 would be 2 * 12 == 24 features)
    for res in world4.run(_masked, lengths, True):
        on_dist, local, one = res["runs"]
        assert local["report"]["<root>"][0] == "local", local["report"]
        assert sum(v == "local (open sizes)" for v in local["report"]["<root>"]) >= 4, local["report"]
        for run in (on_dist, local):
            assert run["losses"] == pytest.approx(one["losses"], rel=1e-5)
            for n, p in one["params"].items():
                torch.testing.assert_close(run["params"][n], p, rtol=1e-5, atol=1e-6)


def test_a_plain_boolean_mask_argument_is_sliced_before_a_local_run(world4: Any) -> None:
    """A plain boolean mask argument (transformers builds its causal mask from plain tensors):
    SDPA adopts it Replicate, makes it additive (``zeros_like``, ``logical_not``, ``masked_fill_``
    on that new tensor: a write to nothing the module did not make) and takes it batch-sharded.
    The program slices it; its sizes are open as a DistTensor's, so new lengths are served by the
    program of open sizes. Equal to the DistTensor run and to one process."""
    lengths = [6, 10, 14, 18, 6, 26]  # (no coincidence: 22 + 2 would meet 24 features)
    for res in world4.run(_masked, lengths, False, True):
        on_dist, local, one = res["runs"]
        assert all(v.startswith("local") for v in local["report"]["<root>"]), local["report"]
        assert sum(v == "local (open sizes)" for v in local["report"]["<root>"]) >= 3, local["report"]
        assert all(c == {} for c in local["comm"]), local["comm"]  # a forward moves nothing
        for run in (on_dist, local):
            assert run["losses"] == pytest.approx(one["losses"], rel=1e-5)
            for n, p in one["params"].items():
                torch.testing.assert_close(run["params"][n], p, rtol=1e-5, atol=1e-6)
