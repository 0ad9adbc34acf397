"""``torch.save`` / ``torch.load`` (pickling) of DistTensors on 4 gloo ranks: each rank's file holds
its shard, its layout and the rank that saved it. Loaded on that rank (in a world of the same size)
it is the same DistTensor (values, placements, strides, ``requires_grad``; a parameter stays a
parameter); loaded on another rank, or in a process without the world, it raises a ``ValueError``
that says what the file holds instead of returning a shard that is not the loader's own."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest


def _saved(rank: int, folder: str) -> dict[str, Any]:
    import torch

    import autoparallel as ap
    from autoparallel import Replicate as R
    from autoparallel import Shard as S

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    torch.manual_seed(0)
    full = torch.randn(8, 6)
    lin = torch.nn.Linear(6, 4)
    lin.weight = ap.shard_tensor(lin.weight, mesh, [R(), S(0)])
    state = {"x": ap.shard_tensor(full, mesh, [S(0), S(1)]), "t": ap.shard_tensor(full, mesh, [S(1), R()]).t(),
             "w": lin.weight, "sd": lin.state_dict()}
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(os.path.join(folder, f"rank{rank}.pt"), "wb") as f:
        f.write(buf.getvalue())
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    out: dict[str, Any] = {}
    for name in ("x", "t", "w"):
        a, b = state[name], back[name]
        out[name] = (type(b).__name__, torch.equal(a.to_local(), b.to_local()), a.placements == b.placements,
                     a.stride() == b.stride(), tuple(a.shape) == tuple(b.shape), b.requires_grad == a.requires_grad,
                     torch.equal(a.full_tensor(), b.full_tensor()))
    out["param"] = (isinstance(state["w"], torch.nn.Parameter), isinstance(back["w"], torch.nn.Parameter),
                    type(back["w"]) is type(state["w"]))
    out["sd"] = torch.equal(back["sd"]["weight"].full_tensor(), state["sd"]["weight"].full_tensor())
    return out


def _load_other(rank: int, folder: str) -> str:
    import torch

    with open(os.path.join(folder, f"rank{(rank + 1) % 4}.pt"), "rb") as f:
        try:
            torch.load(f, weights_only=False)
        except ValueError as e:
            return str(e)
    return "loaded"


def test_a_rank_loads_what_it_saved(world4: Any, tmp_path: Any) -> None:
    for res in world4.run(_saved, str(tmp_path)):
        for name in ("x", "t", "w"):
            assert res[name] == ("DistTensor", True, True, True, True, True, True), (name, res[name])
        assert res["param"] == (True, True, True)
        assert res["sd"]


def test_another_ranks_file_raises(world4: Any, tmp_path: Any) -> None:
    world4.run(_saved, str(tmp_path))
    for rank, msg in enumerate(world4.run(_load_other, str(tmp_path))):
        assert f"saved by rank {(rank + 1) % 4} of a world of 4" in msg and f"loaded by rank {rank}" in msg, msg
        assert "ap.save_state_dict" in msg
    import torch

    with pytest.raises(ValueError, match="saved by rank 0 of a world of 4 .* loaded by rank 0 of a world of 1"):
        torch.load(str(tmp_path / "rank0.pt"), weights_only=False)  # (this process has no world)
