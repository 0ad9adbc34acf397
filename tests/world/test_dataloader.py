"""shard_dataloader on a world of 4: each rank loads only its slice; batches are DistTensors."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
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


# ---- nested inputs: every tensor under an input key is laid out -----------------------------
class AB(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ABData:
    a: torch.Tensor
    b: torch.Tensor
    tag: str = "ab"  # a str leaf passes through


class Token:
    """A leaf that is neither a tensor nor a str/number: cannot be laid out."""


def _pack(kind: str, a: torch.Tensor, b: torch.Tensor) -> Any:
    if kind == "list":
        return [a, b]
    if kind == "tuple":
        return (a, b)
    if kind == "dict":
        return {"a": a, "rest": {"b": b, "note": None}}  # two levels, a None leaf
    if kind == "namedtuple":
        return AB(a, b)
    return ABData(a, b)


def _unpack(kind: str, inputs: Any) -> tuple[Any, Any]:
    """(a, b) of a packed input, checking its container type was kept."""
    want = {"list": list, "tuple": tuple, "dict": dict, "namedtuple": AB, "dataclass": ABData}[kind]
    assert type(inputs) is want, (kind, type(inputs))
    if kind == "dict":
        assert inputs["rest"]["note"] is None
        return inputs["a"], inputs["rest"]["b"]
    if kind == "dataclass":
        assert inputs.tag == "ab"
        return inputs.a, inputs.b
    return inputs[0], inputs[1]


def _collate(kind: str, samples: list[Any]) -> dict[str, Any]:
    """{"inputs": packed (a, b) of the samples, "label": y, "name": [...]}; a[i] = x_i, b[i] = 2 x_i."""
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return {"inputs": _pack(kind, x, 2 * x), "label": y, "name": [f"s{int(v)}" for v in y]}


def _nested(rank: int, kind: str) -> dict[str, Any]:
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    ds = Pairs()
    collate = functools.partial(_collate, kind)
    loader = ap.shard_dataloader(DataLoader(ds, batch_size=BATCH, collate_fn=collate), mesh,
                                 input_keys=["inputs", "label"], shard_dims="dp")
    steps = []
    for batch in loader:
        a, b = _unpack(kind, batch["inputs"])
        for t, cols in ((a, 3), (b, 3), (batch["label"], None)):
            assert isinstance(t, ap.DistTensor) and t.process_mesh == mesh
            assert list(t.placements) == [Shard(0), Replicate()]
            assert tuple(t.shape) == ((BATCH, cols) if cols else (BATCH,))
            assert t.to_local().shape[0] == BATCH // 2
        assert batch["name"] == [f"s{i}" for i in sorted(ds.loaded)[len(steps) * 4:len(steps) * 4 + 4]]
        steps.append([a.full_tensor(), b.full_tensor(), batch["label"].full_tensor(), a.to_local().clone()])
    return {"steps": steps, "loaded": sorted(ds.loaded)}


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "namedtuple", "dataclass"])
def test_nested_inputs_under_a_key_are_laid_out(world4, kind):  # type: ignore[no-untyped-def]
    out = world4.run(_nested, kind)
    ref = list(DataLoader(Pairs(), batch_size=BATCH, collate_fn=functools.partial(_collate, kind)))
    for step, rb in enumerate(ref):
        ra, rbb = _unpack(kind, rb["inputs"])
        for o in out:
            a, b, y, _ = o["steps"][step]
            assert torch.equal(a, ra) and torch.equal(b, rbb) and torch.equal(y, rb["label"])
        for dp_ranks in ((0, 2), (1, 3)):  # the dp shards concatenate to the batch along each mp column
            assert torch.equal(torch.cat([out[r]["steps"][step][3] for r in dp_ranks]), ra)
    assert out[0]["loaded"] == out[1]["loaded"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert out[2]["loaded"] == out[3]["loaded"] == [4, 5, 6, 7, 12, 13, 14, 15]


def _positional_with_keys(rank: int) -> list[Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    ds = Pairs()
    nested = lambda s: ([torch.stack([x for x, _ in s]), torch.stack([-x for x, _ in s])],  # noqa: E731
                        torch.stack([y for _, y in s]))
    seen = []
    for collate in (None, nested):  # (x, y) batches, then ([x, -x], y) batches
        kwargs = {} if collate is None else {"collate_fn": collate}
        loader = ap.shard_dataloader(DataLoader(ds, batch_size=BATCH, **kwargs), mesh,
                                     input_keys=["x", "y"], shard_dims="dp")
        for first, y in loader:
            leaves = [first] if collate is None else first
            assert isinstance(leaves, list)
            for t in [*leaves, y]:
                assert isinstance(t, ap.DistTensor) and list(t.placements) == [Shard(0)]
                assert t.to_local().shape[0] == BATCH // 2
            seen.append([t.full_tensor() for t in [*leaves, y]])
    return [seen, sorted(set(ds.loaded))]


def test_positional_batches_ignore_input_keys(world2):  # type: ignore[no-untyped-def]
    out = world2.run(_positional_with_keys)
    ref = [[x, y] for x, y in _reference()] + [[x, -x, y] for x, y in _reference()]
    for o in out:
        assert len(o[0]) == len(ref)
        for got, want in zip(o[0], ref):
            assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    assert out[0][1] == [0, 1, 2, 3, 8, 9, 10, 11] and out[1][1] == [4, 5, 6, 7, 12, 13, 14, 15]


# ---- a model with two inputs from one nested key, DP on 2 ranks == one process -------------
STEPS = 3


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fa, self.fb = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fa(a) + torch.tanh(self.fb(b))  # (B, 3), (B, 3) -> (B, 2)


class Regression(Dataset):
    """Sample i: {"inputs": {"a": a_i, "b": b_i}, "label": y_i}, fixed random values."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.a, self.b, self.y = (torch.randn(STEPS * BATCH, k, generator=g) for k in (3, 3, 2))

    def __len__(self) -> int:
        return STEPS * BATCH

    def __getitem__(self, i: int) -> Any:
        return {"inputs": {"a": self.a[i], "b": self.b[i]}, "label": self.y[i]}


def _train_two_inputs(loader: Any, model: nn.Module, opt: Any) -> list[Any]:
    losses = []
    for batch in loader:
        loss = F.mse_loss(model(batch["inputs"]["a"], batch["inputs"]["b"]), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _dp_two_inputs(rank: int) -> dict[str, Any]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(TwoInputs(), mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ap.shard_dataloader(DataLoader(Regression(), batch_size=BATCH), mesh,
                                 input_keys=["inputs", "label"], shard_dims="dp")
    losses = _train_two_inputs(loader, model, opt)
    return {"losses": [x.full_tensor() for x in losses],
            "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def test_two_input_model_trains_as_in_one_process(world2):  # type: ignore[no-untyped-def]
    out = world2.run(_dp_two_inputs)
    torch.manual_seed(0)
    model = TwoInputs()
    losses = _train_two_inputs(DataLoader(Regression(), batch_size=BATCH), model,
                               torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(losses) == STEPS
    for o in out:
        for got, want in zip(o["losses"], losses, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        for n, p in model.named_parameters():
            torch.testing.assert_close(o["params"][n], p.detach(), rtol=1e-5, atol=1e-7)


# ---- nested values that cannot be laid out: the same error on every rank -------------------
def _bad_nested(rank: int, case: str) -> None:
    meshes = [ap.ProcessMesh([0, 1], ["dp"]), ap.ProcessMesh([2, 3], ["dp"])]
    shard_dims: list[str | None] = ["dp", None]  # ranks 0, 1 load 4 rows of a batch, ranks 2, 3 all 8

    def collate(samples: list[Any]) -> dict[str, Any]:
        x = torch.stack([s[0] for s in samples])
        odd = {"token": Token(), "table": torch.zeros(5, 3), "scalar": torch.tensor(1.0)}[case]
        return {"inputs": [x, {"extra": odd}], "label": torch.stack([s[1] for s in samples])}

    loader = ap.shard_dataloader(DataLoader(Pairs(), batch_size=BATCH, collate_fn=collate), meshes,
                                 input_keys=["inputs", "label"], shard_dims=shard_dims)
    next(iter(loader))


@pytest.mark.parametrize("case, error, match", [
    ("token", TypeError, r"batch\['inputs'\]\[1\]\['extra'\] is a [\w.]*Token, which cannot be laid out"),
    ("table", ValueError, r"batch\['inputs'\]\[1\]\['extra'\] is a torch\.float32 tensor of shape \(\*, 3\) "
                          r"whose dim 0 is not the batch dim.*8 samples"),
    ("scalar", ValueError, r"batch\['inputs'\]\[1\]\['extra'\] is a 0-d torch\.float32 tensor"),
], ids=["token", "table", "scalar"])
def test_nested_values_that_cannot_be_laid_out_are_refused(world4, case, error, match):  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match) as info:
        world4.run(_bad_nested, case)
    assert "[all 4 ranks raised]" in str(info.value)
    assert len({f.message for f in info.value.rank_failures.values()}) == 1  # word for word
    assert all(world4.run(_healthy))
