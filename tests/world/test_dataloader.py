"""shard_dataloader on a world of 4: each rank loads only its slice; batches are DistTensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import autoparallel as ap
from autoparallel import Replicate, Shard

N, BATCH = 16, 8


class Pairs(Dataset):
    """Sample i: (x = [i, i+0.5, i+0.25], y = i); records which indices this process loaded."""

    def __init__(self, as_dict: bool = False) -> None:
        self.as_dict = as_dict
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        self.loaded.append(i)
        x = torch.tensor([i, i + 0.5, i + 0.25])
        y = torch.tensor(i)
        return {"x": x, "y": y, "name": f"s{i}"} if self.as_dict else (x, y)


def _reference(as_dict: bool = False) -> list[Any]:
    return list(DataLoader(Pairs(as_dict), batch_size=BATCH))


def _tuple_batches(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    ds = Pairs()
    loader = ap.shard_dataloader(DataLoader(ds, batch_size=BATCH), mesh, shard_dims="dp")
    locals_, fulls = [], []
    for x, y in loader():
        assert isinstance(x, ap.DistTensor) and list(x.placements) == [Shard(0), Replicate()]
        assert tuple(x.shape) == (BATCH, 3) and tuple(y.shape) == (BATCH,)
        locals_.append((x.to_local().clone(), y.to_local().clone()))
        fulls.append((x.full_tensor(), y.full_tensor()))
    return {"locals": locals_, "fulls": fulls, "loaded": sorted(ds.loaded), "len": len(loader)}


def test_tuple_batches_concatenate_to_single_process_batch(world4):  # type: ignore[no-untyped-def]
    out = world4.run(_tuple_batches)
    ref = _reference()
    assert all(o["len"] == len(ref) == 2 for o in out)
    for step, (rx, ry) in enumerate(ref):
        for dp_ranks in ((0, 2), (1, 3)):  # ranks at dp coordinate 0 and 1, along each mp column
            x = torch.cat([out[r]["locals"][step][0] for r in dp_ranks])
            y = torch.cat([out[r]["locals"][step][1] for r in dp_ranks])
            assert torch.equal(x, rx) and torch.equal(y, ry)
        for o in out:
            assert torch.equal(o["fulls"][step][0], rx) and torch.equal(o["fulls"][step][1], ry)
    # each rank loaded only its dp slice: rows 0-3 of each batch on dp 0, rows 4-7 on dp 1
    assert out[0]["loaded"] == out[1]["loaded"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert out[2]["loaded"] == out[3]["loaded"] == [4, 5, 6, 7, 12, 13, 14, 15]


def _dict_two_meshes(rank: int) -> list[Any]:
    mesh0 = ap.ProcessMesh([0, 1], dim_names=["dp"])    # first pipeline stage: inputs
    mesh1 = ap.ProcessMesh([2, 3], dim_names=["dp"])    # last pipeline stage: labels
    ds = Pairs(as_dict=True)
    loader = ap.shard_dataloader(DataLoader(ds, batch_size=BATCH), [mesh0, mesh1], input_keys=["x", "y"], shard_dims="dp")
    seen = []
    for batch in loader:
        x, y = batch["x"], batch["y"]
        assert x.process_mesh == mesh0 and y.process_mesh == mesh1
        assert isinstance(batch["name"], list)  # non-input keys pass through as loaded
        held = x if rank in (0, 1) else y
        other = y if rank in (0, 1) else x
        assert other.to_local().numel() == 0 and held.to_local().shape[0] == BATCH // 2
        seen.append((held.to_local().clone(), held.full_tensor()))
    return [seen, sorted(ds.loaded)]


def test_dict_batches_on_two_meshes(world4):  # type: ignore[no-untyped-def]
    out = world4.run(_dict_two_meshes)
    ref = _reference(as_dict=True)
    for step, rb in enumerate(ref):
        assert torch.equal(torch.cat([out[0][0][step][0], out[1][0][step][0]]), rb["x"])
        assert torch.equal(torch.cat([out[2][0][step][0], out[3][0][step][0]]), rb["y"])
        assert torch.equal(out[0][0][step][1], rb["x"]) and torch.equal(out[3][0][step][1], rb["y"])
    # ranks 0 and 2 (dp coordinate 0 of their stage) load the same half, 1 and 3 the other
    assert out[0][1] == out[2][1] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert out[1][1] == out[3][1] == [4, 5, 6, 7, 12, 13, 14, 15]


def _replicated_list(rank: int) -> bool:
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    loader = ap.shard_dataloader(DataLoader(Pairs(), batch_size=BATCH, collate_fn=lambda s: [torch.stack([a for a, _ in s])]), mesh)
    ref = [torch.stack([Pairs()[i][0] for i in range(k, k + BATCH)]) for k in (0, BATCH)]
    for (x,), r in zip(loader, ref):
        assert list(x.placements) == [Replicate()] and torch.equal(x.to_local(), r)
    return True


def test_replicated_list_batches(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_replicated_list))


# ---- bad input: the same clear error on every rank, world healthy afterwards ---------------
def _missing_axis(rank: int) -> None:
    ap.shard_dataloader(DataLoader(Pairs(), batch_size=BATCH), ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), shard_dims="x")


def _indivisible(rank: int) -> None:
    ap.shard_dataloader(DataLoader(Pairs(), batch_size=6), ap.ProcessMesh([0, 1, 2, 3], ["dp"]), shard_dims="dp")


def _short_last_batch(rank: int) -> None:
    data = torch.utils.data.Subset(Pairs(), range(14))  # batches of 4, 4, 4, 2
    loader = ap.shard_dataloader(DataLoader(data, batch_size=4), ap.ProcessMesh([0, 1, 2, 3], ["dp"]), shard_dims="dp")
    for _ in loader:
        pass


def _missing_key(rank: int) -> None:
    loader = ap.shard_dataloader(DataLoader(Pairs(as_dict=True), batch_size=4), ap.ProcessMesh([0, 1, 2, 3], ["dp"]),
                                 input_keys=["x", "label"], shard_dims="dp")
    next(iter(loader))


def _mesh_count(rank: int) -> None:
    meshes = [ap.ProcessMesh([0, 1], ["dp"]), ap.ProcessMesh([2, 3], ["dp"]), ap.ProcessMesh([0, 1], ["dp"])]
    next(iter(ap.shard_dataloader(DataLoader(Pairs(), batch_size=4), meshes, shard_dims="dp")))


def _healthy(rank: int) -> bool:
    x = ap.shard_tensor(torch.arange(8.0), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)])
    return bool(torch.equal(x.full_tensor(), torch.arange(8.0)))


@pytest.mark.parametrize("fn, match", [
    (_missing_axis, r"shard_dims 'x' is not a mesh axis .* \['dp', 'mp'\]"),
    (_indivisible, r"batch_size 6 is not divisible by the data-parallel degree 4"),
    (_short_last_batch, r"batch 3 has 2 samples, not divisible by the data-parallel degree 4.*drop_last"),
    (_missing_key, r"input_keys \['label'\] are not in the batch keys \['x', 'y', 'name'\]"),
    (_mesh_count, r"3 meshes for 2 batch elements"),
])
def test_bad_input_same_error_on_every_rank(world4, fn, match):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match) as info:
        world4.run(fn)
    assert "[all 4 ranks raised]" in str(info.value)
    assert all(world4.run(_healthy))
