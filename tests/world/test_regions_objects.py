"""Local regions given an object argument they write into (``autoparallel.regions.objects``):
transformers' ``DynamicCache``, here a small one of the same shape (a list of layers, each
initialized lazily with an empty tensor, then holding keys and values set as attributes). The
tensors the object holds are the captured program's inputs, the ones it writes its outputs, put
back as DistTensors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autoparallel as ap
from autoparallel.placement import Shard
from autoparallel.regions import local_regions_report, objects

pytestmark = pytest.mark.pure  # single process, no world

S0 = Shard(0)


class Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.initialized = False

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.initialized:  # as transformers' DynamicLayer: a legacy empty tensor, then cat
            self.dtype, self.device = k.dtype, k.device
            self.keys = torch.tensor([], dtype=k.dtype)
            self.values = torch.tensor([], dtype=k.dtype)
            self.initialized = True
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)
        return self.keys, self.values


class Cache:
    def __init__(self, layers: int) -> None:
        self.layers = [Layer() for _ in range(layers)]
        self.replicate = None


class Attention(nn.Module):
    """Projects keys and values, writes them into its layer of the cache, attends over them."""

    def __init__(self, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        k, v = cache.layers[self.idx].update(self.k(x), self.v(x))
        w = torch.softmax(self.q(x) @ k.transpose(-1, -2), dim=-1)
        return x + w @ v


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Attention(0), Attention(1)])

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, cache)
        return x


def _train(lengths: list[int]) -> tuple[nn.Module, list[tuple[Cache, Cache]]]:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    ap.shard_layer(model, mesh)
    caches = []
    for t in lengths:
        x = torch.randn(4, t, 8, generator=torch.Generator().manual_seed(t))
        cache, ref_cache = Cache(2), Cache(2)
        y = model(ap.shard_tensor(x, mesh, [S0]), cache)
        want = ref(x, ref_cache)
        torch.testing.assert_close(y.full_tensor(), want)
        # a loss reading the cache: the written keys carry their gradient back
        (y.sum() + cache.layers[0].keys.pow(2).sum()).backward()
        (want.sum() + ref_cache.layers[0].keys.pow(2).sum()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
            p.grad, q.grad = None, None
        caches.append((cache, ref_cache))
    return model, caches


def test_a_module_writing_into_a_cache_is_a_region_and_its_writes_are_dist_tensors() -> None:
    model, caches = _train([6])
    for cache, ref_cache in caches:
        for ours, theirs in zip(cache.layers, ref_cache.layers):
            for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert isinstance(a, ap.DistTensor) and a.placements == (S0,)
                torch.testing.assert_close(a.full_tensor(), b)
            assert ours.initialized and ours.dtype == theirs.dtype and ours.device == theirs.device
    report = local_regions_report(model)
    assert report["<root>"] == ["local"], report


def test_new_lengths_of_a_cache_writing_module_are_served_by_its_open_program() -> None:
    model, caches = _train([6, 7, 9, 10, 11, 12, 13])
    for cache, ref_cache in caches:
        torch.testing.assert_close(cache.layers[1].values.full_tensor(), ref_cache.layers[1].values)
    verdicts = local_regions_report(model)["<root>"]
    assert verdicts == ["local", "local"] + ["local (open sizes)"] * 5, verdicts


class Slotted:
    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: Any = None


class Holder:
    def __init__(self) -> None:
        self.extra: Any = None


class WritesSlotted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        y = self.lin(x)
        if isinstance(cache, Slotted):
            cache.keys = y
        else:
            cache.extra = [y]  # a new container written into the object
        return y * 2


@pytest.mark.parametrize("kind", ["slotted", "container"])
def test_writes_a_region_cannot_follow_run_on_dist_tensors(kind: str) -> None:
    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(WritesSlotted(), mesh)
    x = torch.randn(4, 8)
    cache = Slotted() if kind == "slotted" else Holder()
    y = model(ap.shard_tensor(x, mesh, [S0]), cache)
    torch.testing.assert_close(y.full_tensor(), model.lin.weight.full_tensor().matmul(x.T).T * 2
                               + model.lin.bias.full_tensor() * 2)
    written = cache.keys if kind == "slotted" else cache.extra[0]  # type: ignore[union-attr]
    assert isinstance(written, ap.DistTensor)  # the DistTensor run's write stands
    report = local_regions_report(model)["<root>"]
    want = ("refused: an argument is a Slotted object whose entries a region cannot follow" if kind == "slotted"
            else "refused: it writes an object or container into an argument object")
    assert len(report) == 1 and report[0].startswith(want), report


def test_entries_are_walked_with_paths_that_do_not_name_objects() -> None:
    cache = Cache(2)
    found = objects.entries([3, cache])
    assert found is not None
    assert (1, ("a", "layers"), ("i", 1), ("a", "keys")) in found
    sig = objects.signature(cache)
    assert sig == objects.signature(Cache(2)) and sig != objects.signature(Cache(3))
    loop = Holder()
    loop.extra = loop  # a cycle: not followed
    assert objects.signature(loop) is None
