"""What a local region's signature reads of a module tree (``regions.state.TreeReader``): plain
values by value, other attributes by identity, and every change of an attribute's name or type
seen on the next read, though names are worked out once per attribute layout."""

from __future__ import annotations

import torch
from torch import nn

from autoparallel.regions.state import TreeReader


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.scale = 2.0
        self.mask = None
        self.config = object()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.shape[0]  # written, never read: not part of a signature
        return self.proj(x) * self.scale


def _reader(m: nn.Module, slotted: set[tuple[int, str]] | None = None) -> TreeReader:
    return TreeReader(list(m.modules()), slotted or set())


def _values(r: TreeReader) -> dict[str, object]:
    """The root's values but nn.Module's own private fields (``_is_full_backward_hook``)."""
    names, _, vals = r.read()[0][0]
    return {k: v for k, v in zip(names, vals) if not k.startswith("_")}


def _ids(r: TreeReader) -> dict[str, int]:
    names, ids = r.read()[1][0]
    return dict(zip(names, ids))


def test_plain_values_by_value_and_other_attributes_by_identity() -> None:
    m = _Gate()
    r = _reader(m)
    assert _values(r) == {"training": True, "scale": 2.0, "mask": None}
    assert _ids(r) == {"config": id(m.config)}
    m.scale = 3.0
    m.eval()
    assert _values(r) == {"training": False, "scale": 3.0, "mask": None}
    m.config = object()
    assert _ids(r) == {"config": id(m.config)}
    assert r.read() == r.read()  # no change, the same reading


def test_an_attribute_changing_kind_or_appearing_is_seen() -> None:
    m = _Gate()
    r = _reader(m)
    r.read()
    m.mask = torch.ones(2)  # None -> a tensor: from values to identities
    assert "mask" not in _values(r) and _ids(r)["mask"] == id(m.mask)
    m.mask = 1  # -> a plain value again
    assert _values(r)["mask"] == 1 and "mask" not in _ids(r)
    before = r.read()
    m.mask = True  # the same value of another type: another reading (1 == True)
    assert _values(r)["mask"] is True and r.read() != before
    m.extra = "on"  # a new attribute
    assert _values(r)["extra"] == "on"
    m.seen = 7  # written by the forward only: left out
    assert "seen" not in _values(r)
    del m.extra
    assert "extra" not in _values(r)


def test_a_tensor_shadowing_a_slot_is_not_read_by_identity() -> None:
    m = _Gate()
    slotted = {(id(m.proj), "weight")}
    r = _reader(m, slotted)
    m.proj.__dict__["weight"] = torch.zeros(2, 2)  # (a ZeRO-3 unit's gathered weight)
    assert r.read()[1][1] == ((), ())
    other = _reader(m)
    assert other.read()[1][1][0] == ("weight",)
