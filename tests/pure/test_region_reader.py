"""What a local region's signature reads of a module tree (``regions.state.TreeReader``): plain
values by value, other attributes by content (``attributes.describe``: a config's values, a
function itself, a tensor's identity), and every change of an attribute's name or type seen on
the next read, though names are worked out once per attribute layout."""

from __future__ import annotations

import torch
from torch import nn

from autoparallel import compat
from autoparallel.attributes import MAX_DEPTH, MAX_ITEMS, MAX_OBJECTS, describe
from autoparallel.regions.state import TreeReader


class _Config:
    def __init__(self, scale: float = 2.0) -> None:
        self.scale = scale
        self.rope = {"kind": "linear", "factor": 2.0}


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.scale = 2.0
        self.mask = None
        self.config = _Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.shape[0]  # written, never read: not part of a signature
        return self.proj(x) * self.scale


def _reader(m: nn.Module) -> TreeReader:
    return TreeReader(list(m.modules()))


def _values(r: TreeReader) -> dict[str, object]:
    """The root's plain values but nn.Module's own private fields (``_is_full_backward_hook``)."""
    names, kinds, vals = r.read()[0][0]
    return {k: v for k, t, v in zip(names, kinds, vals) if not k.startswith("_") and t in compat.PLAIN_VALUES}


def _held(r: TreeReader) -> dict[str, object]:
    """The root's held objects' descriptions; each is among its values too (what ``Reads`` sees)."""
    entry = r.read()[1][0]
    names, held = entry if entry else ((), ())
    values = dict(zip(r.read()[0][0][0], r.read()[0][0][2]))
    assert all(values[n] == h for n, h in zip(names, held))
    return dict(zip(names, held))


def test_plain_values_by_value_and_other_attributes_by_content() -> None:
    m = _Gate()
    r = _reader(m)
    assert _values(r) == {"training": True, "scale": 2.0, "mask": None}
    before = _held(r)["config"]
    m.scale = 3.0
    m.eval()
    assert _values(r) == {"training": False, "scale": 3.0, "mask": None}
    assert _held(r)["config"] == before
    m.config.scale = 4.0  # a value inside the held object: another reading
    assert _held(r)["config"] != before
    m.config = _Config(4.0)  # another object with the same values: the same reading
    m.config.scale = 4.0
    changed = _held(r)["config"]
    m.config = _Config(4.0)
    assert _held(r)["config"] == changed
    m.config.rope["factor"] = 4.0  # nested: seen too
    assert _held(r)["config"] != changed
    assert r.read() == r.read()  # no change, the same reading


def test_an_attribute_changing_kind_or_appearing_is_seen() -> None:
    m = _Gate()
    r = _reader(m)
    r.read()
    m.mask = torch.ones(2)  # None -> a tensor: from values to held objects (by identity)
    assert "mask" not in _values(r) and _held(r)["mask"] == ("id", id(m.mask))
    m.mask = 1  # -> a plain value again
    assert _values(r)["mask"] == 1 and "mask" not in _held(r)
    before = r.read()
    m.mask = True  # the same value of another type: another reading (1 == True)
    assert _values(r)["mask"] is True and r.read() != before
    m.extra = "on"  # a new attribute
    assert _values(r)["extra"] == "on"
    m.seen = 7  # written by the forward only: left out
    assert "seen" not in _values(r)
    del m.extra
    assert "extra" not in _values(r)


def test_a_tensor_shadowing_a_slot_is_not_read() -> None:
    m = _Gate()
    r = _reader(m)
    m.proj.__dict__["weight"] = torch.zeros(2, 2)  # (a ZeRO-3 unit's gathered weight: the module's state)
    assert r.read()[1][1] == ()
    m.proj.__dict__["table"] = torch.zeros(2, 2)  # a plain tensor attribute of another name: by identity
    assert r.read()[1][1] == (("table",), (("id", id(m.proj.table)),))


def test_descriptions_by_content_bounded_and_cycle_safe() -> None:
    memo: dict[int, object] = {}
    assert describe(1, memo) != describe(True, memo)  # 1 == True, but another type
    assert describe(torch.tanh, {}) == describe(torch.tanh, {}) != describe(torch.sigmoid, {})
    assert describe([1, {"a": (2.0, None)}], {}) == describe([1, {"a": (2.0, None)}], {})
    assert describe([1, {"a": (2.0, None)}], {}) != describe([1, {"a": (3.0, None)}], {})
    loop: list[object] = [1]
    loop.append(loop)  # a cycle ends where it is met again
    assert describe(loop, {})[0] is list
    big = list(range(MAX_ITEMS + 1))  # too long to read at every call: by identity and length
    assert describe(big, {}) == ("id", id(big), len(big))
    deep: list[object] = [0]
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    assert "id" in repr(describe(deep, {}))  # nested past the depth: by identity there
    wide = [[[i] for i in range(MAX_ITEMS)] for _ in range(MAX_OBJECTS // MAX_ITEMS + 1)]
    told = describe(wide, {})  # more objects than one signature follows: the rest by identity
    assert told[1][-1] == ("id", id(wide[-1]))
    shared = _Config()
    memo = {}
    assert describe([shared, shared], memo)[1][0] is describe(shared, memo)  # described once


def test_plain_class_values_are_read_and_follow_the_class() -> None:
    class Causal(_Gate):
        is_causal = True

    m = Causal()
    r = _reader(m)
    before = r.read()
    assert _values(r)["is_causal"] is True
    Causal.is_causal = False  # set on the class: another reading
    assert r.read() != before and _values(r)["is_causal"] is False
    Causal.window = 4  # a class value added: seen too
    assert _values(r)["window"] == 4
    m.window = 5  # an instance's own value shadows the class's: read once, as the instance's
    names = r.read()[0][0][0]
    assert names.count("window") == 1 and _values(r)["window"] == 5
