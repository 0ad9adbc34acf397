"""Static mode (``ap.to_static``) and what a step depends on besides its tensors.

World part (4 gloo ranks, data parallel, SGD with momentum): each case trains a few steps eagerly
and with ``to_static`` from the same start, and the losses, parameters, buffers and module
attributes must be equal (the same local ops run: checked at rtol 1e-6).

* arguments nested in tuples, lists and dicts are one signature (one program for every call),
  with a number inside a dict part of it and an unhashable object refused (eager, one warning);
* a forward that assigns a buffer (``self.scale = self.scale * 0.5 + ...``) or a tensor
  attribute: the program returns the new value and every call assigns it, as eager does, and no
  fake tensor of the capture is left in the module;
* plain Python attributes (a temperature, a flag) set between steps take effect (a new
  signature), a counter the forward increments counts as on one device (one warning), and more
  signatures than a ``DistModel`` keeps warn once, naming the attribute that keeps changing;
* objects a module holds (a config whose value changes, a config replaced, a function
  swapped) are read by content, and plain class values (set on the class) by value: eager and
  static both train as one device does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import Shard, compat
from autoparallel.engine import layout
from autoparallel.static import model as static_model

S0 = Shard(0)
STEPS = 4


class Pair(nn.Module):
    """Two inputs in one argument: a tuple, a list or a dict (with a scale: a number, or an object)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(8, 5)

    def forward(self, xs: Any) -> torch.Tensor:
        if isinstance(xs, dict):
            scale = xs["scale"]
            return (self.a(xs["a"]) + self.b(xs["b"])) * getattr(scale, "value", scale)
        return self.a(xs[0]) + self.b(xs[1])


class Scale:
    """A mutable object (no hash): it cannot be part of a signature."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: float) -> None:
        self.value = value


class Decay(nn.Module):
    """Reassigns its buffers in training (an elementwise decay, a batch maximum, a step count) and
    keeps the last hidden state's batch sum as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 5)
        self.register_buffer("scale", torch.ones(12))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.training:
            self.steps = self.steps + 1
            self.scale = self.scale * 0.5 + 0.75 + 0.1 * h.detach().abs().amax(0)
            self.seen = h.detach().sum(0)
        return self.fc2(h / self.scale)


class Tempered(nn.Module):
    """Reads plain Python attributes: a temperature, a centering flag, and a call counter (the
    forward centers from its third call on)."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 5)
        self.temp = 1.0
        self.center = False
        self.count = count
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.calls += 1
        h = torch.tanh(self.fc1(x))
        if self.center or self.calls > 2:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h) / self.temp


class Settings:
    """A config object a module holds: its values are read by the forward."""

    def __init__(self, scale: float = 1.0, center: bool = False) -> None:
        self.scale = scale
        self.center = center
        self.sizes = {"hidden": 12}


class Configured(nn.Module):
    """Reads a held config object's values, calls a held function and reads a class value."""

    shift = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 5)
        self.cfg = Settings()
        self.act = torch.tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x)) * self.cfg.scale
        if self.cfg.center:
            h = h - h.mean(0, keepdim=True)
        return self.fc2(h + self.shift) * (self.cfg.sizes["hidden"] / 12)


class Noted(nn.Module):
    """Reads its own ``scale``; the training loop keeps notes on it that no forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 5)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def _xy(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def _args(case: str, i: int, lay: Callable[[torch.Tensor], Any]) -> tuple[Any, ...]:
    """The call's arguments (before the label) at step ``i``."""
    x1, x2, _ = _xy(i)
    a, b = lay(x1), lay(x2)
    if case == "tuple":
        return ((a, b),)
    if case == "list":
        return ([a, b],)
    if case == "dict":
        return ({"a": a, "b": b, "scale": 1.0 if i < 2 else 0.5},)  # a number: a new signature at step 2
    if case == "object":
        return ({"a": a, "b": b, "scale": Scale(1.0 if i < 2 else 0.5)},)
    return (a,)


def _before(case: str, model: nn.Module, i: int) -> None:
    """What the training loop changes between steps."""
    if case == "values":  # a temperature annealed every step, a flag set from step 2 on
        model.temp = 1.0 + 0.5 * i
        model.center = i >= 2
    if case == "overflow":
        model.temp = 1.0 + 0.5 * i
    if case == "held":  # step 1: a config value changed in place; 2: another config; 3: another function
        Configured.shift = 0.0 if i < 2 else 0.25  # and from step 2 a class value
        if i == 1:
            model.cfg.scale = 0.5
        if i == 2:
            model.cfg = Settings(scale=2.0, center=True)
        if i == 3:
            model.act = torch.sigmoid
            model.cfg.sizes["hidden"] = 6


    if case == "notes":  # a step counter, a log of what ran, a note on a submodule: never read by a forward
        model.step = i
        model.log = {"step": i, "lr": [0.1] * (i + 1)}
        model.fc1.seen = i


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "notes":
        return Noted()
    if case in ("tuple", "list", "dict", "object"):
        return Pair()
    if case == "buffers":
        return Decay()
    if case == "held":
        return Configured()
    return Tempered(count=case == "counter")


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if layout.is_dist(t) else t


def _train(rank: int, case: str, static: bool, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` training steps of ``case``, eagerly or with ``to_static``."""
    model = _model(case)
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    ap.shard_layer(model, mesh)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def lay(t: torch.Tensor) -> Any:
        return ap.shard_tensor(t, mesh, [S0])

    dm = ap.to_static(model, loss=F.cross_entropy, optimizer=opt) if static else None
    losses, kinds = [], []
    captures = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            _before(case, model, i)
            args, y = _args(case, i, lay), lay(_xy(i)[2])
            if dm is not None:
                loss = dm(*args, y)
                kinds.append(sorted(type(v).__name__ for v in dm._programs.values()))
                captures = dm.captures
            else:
                loss = F.cross_entropy(model(*args), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(_full(loss.detach())))
    held = {**dict(model.named_buffers()), **{k: v for k, v in vars(model).items() if isinstance(v, torch.Tensor)}}
    return {"losses": losses, "params": [_full(p).detach().clone() for p in model.parameters()],
            "held": {k: _full(v).clone() for k, v in held.items()},
            "fake": [k for k, v in held.items() if compat.is_fake(layout.local_or_plain(v))],
            "calls": getattr(model, "calls", None), "kinds": kinds, "captures": captures,
            "warnings": [str(w.message) for w in caught if "autoparallel" in str(w.message)]}


def _compare(rank: int, case: str) -> dict[str, Any]:
    return {"eager": _train(rank, case, False), "static": _train(rank, case, True)}


def _one_process(case: str, steps: int = STEPS) -> dict[str, Any]:
    """``case`` trained on one device (plain tensors, the whole batch)."""
    model = _model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(steps):
        _before(case, model, i)
        loss = F.cross_entropy(model(*_args(case, i, lambda t: t)), _xy(i)[2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "calls": getattr(model, "calls", None)}


def _against_one_process(rank: int, case: str) -> dict[str, Any]:
    return {"one": _one_process(case), "static": _train(rank, case, True)}


def _assert_equal(eager: dict[str, Any], static: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(static["losses"]), torch.tensor(eager["losses"]), rtol=1e-6, atol=0)
    for a, b in zip(static["params"], eager["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert static["held"].keys() == eager["held"].keys()
    for k, b in eager["held"].items():
        torch.testing.assert_close(static["held"][k], b, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    assert static["calls"] == eager["calls"]
    assert static["fake"] == [], static["fake"]  # nothing of the capture is left in the module


@pytest.mark.parametrize("case", ["tuple", "list", "dict"])
def test_nested_arguments_are_one_signature(world4: Any, case: str) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, case):
        st = res["static"]
        _assert_equal(res["eager"], st)
        assert st["warnings"] == [], st["warnings"]
        # every call replays the program its signature captured (the dict's scale: a second one)
        assert st["kinds"][-1] == ["_Program"] * (2 if case == "dict" else 1), st["kinds"]


def test_an_unhashable_argument_runs_eagerly_with_one_warning(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, "object"):
        st = res["static"]
        _assert_equal(res["eager"], st)  # the object's new value at step 2 is read, as eager reads it
        assert len(st["warnings"]) == 1 and "neither a tensor nor hashable" in st["warnings"][0], st["warnings"]
        assert st["kinds"][-1] == ["str"]


def test_reassigned_buffers_and_attributes_follow_eager(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, "buffers"):
        st = res["static"]
        _assert_equal(res["eager"], st)
        assert set(st["held"]) == {"scale", "steps", "seen"} and int(st["held"]["steps"]) == STEPS
        assert st["warnings"] == [], st["warnings"]
        assert all(k == "_Program" for k in st["kinds"][-1]), st["kinds"]


def test_plain_attribute_values_are_part_of_the_signature(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for res in world4.run(_compare, "values"):
        st = res["static"]
        _assert_equal(res["eager"], st)
        assert st["warnings"] == [], st["warnings"]
        assert st["kinds"][-1] == ["_Program"] * STEPS  # a temperature per step: a program per step


def test_a_counter_written_by_the_forward_counts_as_on_one_device(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """Each call's capture runs the forward's Python once (the increment); its program is not
    kept, since a replay would not count: one warning names the attribute."""
    for res in world4.run(_against_one_process, "counter"):
        st, one = res["static"], res["one"]
        assert st["calls"] == one["calls"] == STEPS  # centering from the third call on
        torch.testing.assert_close(torch.tensor(st["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
        for a, b in zip(st["params"], one["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert len(st["warnings"]) == 1 and "writes the module attribute calls" in st["warnings"][0], st["warnings"]
        assert st["fake"] == [] and st["kinds"][-1] == []


def _overflow(rank: int) -> dict[str, Any]:
    kept = static_model.MAX_PROGRAMS
    static_model.MAX_PROGRAMS = 2
    try:
        return _train(rank, "overflow", True)
    finally:
        static_model.MAX_PROGRAMS = kept


def test_too_many_signatures_warn_once_naming_what_changes(world4: Any) -> None:  # type: ignore[no-untyped-def]
    for st in world4.run(_overflow):
        assert len(st["warnings"]) == 1, st["warnings"]
        assert "more than 2 call signatures" in st["warnings"][0] and "attribute temp of the model" in st["warnings"][0]
        assert st["kinds"][-1] == ["_Program"] * 2


def _three_ways(rank: int, case: str) -> dict[str, Any]:
    """``case`` on one device, static and eager."""
    return {**_against_one_process(rank, case), "eager": _train(rank, case, False)}


def _assert_like_one_device(res: dict[str, Any]) -> None:
    """Eager and static (``_three_ways``) trained as one device did, with no warning."""
    one = res["one"]
    for side in ("eager", "static"):
        got = res[side]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
        for a, b in zip(got["params"], one["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert got["warnings"] == [], got["warnings"]


def test_objects_a_module_holds_are_read_by_content(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """A value changed inside a held config, a config replaced, a function swapped: each is a new
    signature (static) and a new program (eager's local region), never a replay of the old one."""
    for res in world4.run(_three_ways, "held"):
        _assert_like_one_device(res)
        assert res["static"]["kinds"][-1] == ["_Program"] * STEPS  # a program per setting


def test_values_the_step_never_reads_keep_its_program(world4: Any) -> None:  # type: ignore[no-untyped-def]
    """A counter, a log and a note the training loop writes on the model at every step, which no
    forward reads: the step is captured once and replayed (eager and static), results as on one
    device."""
    for res in world4.run(_three_ways, "notes"):
        _assert_like_one_device(res)
        assert res["static"]["captures"] == 1, res["static"]["kinds"]
