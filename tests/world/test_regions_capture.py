"""Local regions as captured programs (``regions.program``).

The example GPT (dropout on) on 4 gloo ranks: a region is the module's forward and backward captured
once per signature on fake tensors and run as one autograd node, collectives included, so under
every layout the whole model is one region. Two SGD steps train bitwise as op by op
(``AUTOPARALLEL_LOCAL_REGIONS=0``) under DP, TP, TP + SP, DP x TP and ZeRO-3, with and without
``torch.utils.checkpoint`` around each block (non-reentrant: bitwise; reentrant: within rounding),
and every call of a signature — the first, later ones and a checkpoint's recomputation — runs the
same program. New sequence lengths: the second length of a signature is captured with its sizes
open, and that program serves the lengths after it (two captures for five lengths), equal to op
by op. Object arguments (a key/value cache), objects returned, a forward whose guards fix its sizes,
ZeRO-3 blocks and where the collectives of a program are attributed, as ``regions.program`` says.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.world.test_torch_checkpoint import MESHES, _bitwise, _close, _gpt


def _with(mode: str, fn: Any, *args: Any) -> Any:
    old = os.environ.get("AUTOPARALLEL_LOCAL_REGIONS")
    os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = mode
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["AUTOPARALLEL_LOCAL_REGIONS"]
        else:
            os.environ["AUTOPARALLEL_LOCAL_REGIONS"] = old


def _run(rank: int, mode: str, layout: str, how: str) -> dict[str, Any]:
    return _with(mode, _gpt, rank, layout, how)


@pytest.mark.parametrize("layout", list(MESHES))
def test_captured_regions_train_bitwise_as_op_by_op(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_run, "0", layout, "none")
    got = world4.run(_run, "1", layout, "none")
    for r in range(4):
        _bitwise(base[r], got[r], f"{layout} captured rank {r}")
    got = world4.run(_run, "1", layout, "nonreentrant")
    for r in range(4):
        _bitwise(base[r], got[r], f"{layout} captured, checkpointed blocks, rank {r}")
    if layout in ("tp", "dp_tp"):
        got = world4.run(_run, "1", layout, "reentrant")
        for r in range(4):
            _close(base[r], got[r], f"{layout} captured, reentrant checkpoint, rank {r}")


def _report(rank: int, layout: str) -> dict[str, Any]:
    import autoparallel as ap
    from tests.world.test_torch_checkpoint import CFG, GPT, lm_loss

    def run() -> dict[str, Any]:
        import train_gpt

        torch.manual_seed(0)
        model = GPT(CFG)
        dp, tp = MESHES[layout]
        mesh = ap.ProcessMesh(torch.arange(4).reshape(dp, tp).tolist(), dim_names=["dp", "mp"])
        ap.parallelize(model, mesh, {} if layout == "dp" else train_gpt.gpt_plan(layout == "tp_sp"))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = (torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g) for _ in range(2))
            with ap.CommDebugMode() as comm:
                loss = lm_loss(model(ap.shard_tensor(x, mesh, [ap.Shard(0), ap.Replicate()])),
                               ap.shard_tensor(y, mesh, [ap.Shard(0), ap.Replicate()]))
                loss.backward()
            model.zero_grad(set_to_none=True)
        return {"report": ap.local_regions_report(model), "comms": comm.get_comm_counts()}

    return _with("1", run)


@pytest.mark.parametrize("layout", ["dp", "tp", "dp_tp"])
def test_the_whole_model_is_one_region_collectives_included(world4, layout: str) -> None:  # type: ignore[no-untyped-def]
    for got in world4.run(_report, layout):
        assert got["report"] == {"<root>": ["local"]}, got["report"]
        if layout == "dp":  # the gradients' reduction is the optimizer's: a step of the model alone issues
            assert set(got["comms"]) <= {"all_reduce"}, got["comms"]  # the loss's mean count only
        else:
            assert got["comms"].get("all_reduce", 0) > 0, got["comms"]


def _lengths(rank: int, mode: str) -> dict[str, Any]:
    import autoparallel as ap
    from tests.world.test_torch_checkpoint import CFG, GPT, lm_loss

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        model = GPT(CFG)
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        ap.parallelize(model, mesh, {})
        opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(7)
        g = torch.Generator().manual_seed(1)
        losses = []
        for seq in (8, 6, 4, 7, 5, 8):
            x, y = (torch.randint(0, CFG.vocab, (8, seq), generator=g) for _ in range(2))
            loss = lm_loss(model(ap.shard_tensor(x, mesh, [ap.Shard(0)])), ap.shard_tensor(y, mesh, [ap.Shard(0)]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.full_tensor().item())
        region = model.__dict__.get("_ap_region")
        return {"losses": losses, "captures": None if region is None else region.calls.captures}

    return _with(mode, run)


def test_new_lengths_are_served_by_a_program_of_open_sizes(world4) -> None:  # type: ignore[no-untyped-def]
    base = world4.run(_lengths, "0")
    got = world4.run(_lengths, "1")
    for r in range(4):
        torch.testing.assert_close(got[r]["losses"], base[r]["losses"], rtol=1e-5, atol=0)
        assert got[r]["captures"] == 2, got[r]["captures"]  # lengths 8 and 6; 4, 7, 5 by the open program


# ---- object arguments, returned objects, sizes the forward fixes (one process) --------------------
@pytest.mark.pure
def test_writes_into_a_cache_argument_are_the_programs_outputs_put_back_at_every_length() -> None:
    # a small DynamicCache (tests/world/test_regions_objects.py): the entries it holds are program
    # inputs, the keys and values the forward writes are outputs, put back as DistTensors; they carry
    # their gradients; new lengths are served by the program of open sizes
    from tests.world import test_regions_objects as objects_test

    model, caches = _with("1", objects_test._train, [6, 7, 9, 10, 11])
    for cache, ref_cache in caches:
        for ours, theirs in zip(cache.layers, ref_cache.layers):
            for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert isinstance(a, ap_DistTensor()) and a.placements == (objects_test.S0,)
                torch.testing.assert_close(a.full_tensor(), b)
            assert ours.initialized and ours.dtype == theirs.dtype
    verdicts = _report_of(model)["<root>"]
    assert verdicts[:2] == ["local", "local"] and all(v == "local (open sizes)" for v in verdicts[2:]), verdicts


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.items = [t * 3, {"n": 2}]


class _Slotted:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsAnObject(torch.nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any, dict[str, Any]]:
        y = self.lin(x)
        box = self.kind(y * 2)
        return y, box, {"again": box}


def _returns_an_object(kind: type) -> tuple[list[Any], dict[str, list[str]]]:
    import autoparallel as ap

    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(_ReturnsAnObject(kind), mesh)
    got: list[Any] = []
    for _ in range(3):
        y, box, again = model(ap.shard_tensor(torch.randn(4, 4), mesh, [ap.Shard(0)]))
        assert again["again"] is box  # one object, as op by op
        got.append(box)
        loss = (y * y).sum() + (box.t * box.t).sum()  # the object's tensor carries a gradient back
        if kind is _Box:
            loss = loss + box.items[0].sum()
        loss.backward()
        got.append((y.full_tensor().detach(), box.t.full_tensor().detach()))  # (a fake tensor would raise here)
    got += [p.grad.full_tensor() for p in model.parameters()]
    return got, _report_of(model)


@pytest.mark.pure
def test_a_forward_returning_an_object_it_made_gives_each_call_its_own() -> None:
    base, _ = _with("0", _returns_an_object, _Box)
    got, report = _with("1", _returns_an_object, _Box)
    assert report == {"<root>": ["local"]}, report
    boxes = [b for b in got if isinstance(b, _Box)]
    assert len({id(b) for b in boxes}) == 3 and len({id(b.items) for b in boxes}) == 3  # a new object per call
    assert all(b.items[1] == {"n": 2} and torch.equal(b.items[0].full_tensor(), 3 * b.t.full_tensor()) for b in boxes)
    for a, b in zip(base, got):
        if isinstance(a, _Box):
            continue
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.pure
def test_a_forward_returning_an_object_it_cannot_follow_is_refused_and_its_tensors_are_real() -> None:
    base, _ = _with("0", _returns_an_object, _Slotted)
    got, report = _with("1", _returns_an_object, _Slotted)
    assert report == {"<root>": ["refused: the forward returns a _Slotted object whose entries a region cannot follow"],
                      "lin": ["local"]}, report
    for a, b in zip(base, got):
        if isinstance(a, _Slotted):
            continue
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


class _HandsOn(torch.nn.Module):
    """Returns one of its arguments as it is, beside what it computes (as a T5 block hands on
    the position bias it was given)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x) + bias, bias


def _hands_on(layout: str) -> tuple[list[torch.Tensor], dict[str, list[str]]]:
    import autoparallel as ap

    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(_HandsOn(), mesh)
    scale = torch.ones(4, requires_grad=True)
    got: list[torch.Tensor] = []
    for _ in range(2):
        x = ap.shard_tensor(torch.randn(4, 4), mesh, [ap.Shard(0)])
        bias = ap.shard_tensor(torch.randn(4, 4), mesh, [ap.Shard(0) if layout == "shard" else ap.Replicate()])
        bias = bias * ap.shard_tensor(scale, mesh, [ap.Replicate()])  # (a gradient flows back through it)
        y, same = model(x, bias)
        assert same is bias  # the argument itself, as op by op
        ((y * y).sum() + (same * 3).sum()).backward()
        got += [y.full_tensor().detach()]
    got += [scale.grad, *(p.grad.full_tensor() for p in model.parameters())]
    return got, _report_of(model)


@pytest.mark.pure
@pytest.mark.parametrize("layout", ["shard", "replicate"])
def test_an_argument_returned_as_it_is_is_the_argument_and_its_gradient_flows(layout: str) -> None:
    base, _ = _with("0", _hands_on, layout)
    got, report = _with("1", _hands_on, layout)
    assert report == {"<root>": ["local"]}, report
    for a, b in zip(base, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _FixesItsLength(torch.nn.Module):
    """Its forward branches on the sequence length as a Python int (a guard per length); its
    child is a module like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * float(x.shape[1]) if x.shape[1] % 2 else y


@pytest.mark.pure
def test_a_module_whose_guards_fix_its_sizes_lets_its_children_serve_new_lengths() -> None:
    import autoparallel as ap

    def run() -> tuple[dict[str, list[str]], list[float]]:
        mesh = ap.ProcessMesh([0], dim_names=["dp"])
        torch.manual_seed(0)
        model = ap.shard_layer(_FixesItsLength(), mesh)
        ref = _FixesItsLength()
        ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
        errors = []
        for t in (3, 5, 7, 9, 11):
            x = torch.randn(2, t, 4, generator=torch.Generator().manual_seed(t))
            y = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
            errors.append(float((y.full_tensor() - ref(x)).abs().max()))
        return _report_of(model), errors

    report, errors = _with("1", run)
    assert max(errors) < 1e-6, errors
    root = report["<root>"]
    assert root[:2] == ["local", "local"] and all("guards fix its sizes" in v for v in root[2:]), root
    assert report["inner"] == ["local", "local", "local (open sizes)"], report


class _PadsItsLabels(torch.nn.Module):
    """A causal LM's loss in small: the labels padded by one and shifted (``F.pad``, whose fake
    kernel alone would fix the length), a mean over every position."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


@pytest.mark.pure
def test_a_padded_length_stays_open() -> None:
    """A forward that pads its labels is one program of open sizes for every later length, equal
    to the module run in one process (loss and gradients)."""
    import autoparallel as ap

    def run() -> tuple[dict[str, list[str]], list[float]]:
        mesh = ap.ProcessMesh([0], dim_names=["dp"])
        torch.manual_seed(0)
        model = ap.shard_layer(_PadsItsLabels(), mesh)
        ref = _PadsItsLabels()
        ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
        errors = []
        for t in (3, 5, 7, 9, 11):
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(2, t, 4, generator=g), torch.randint(0, 6, (2, t), generator=g)
            loss = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]), ap.shard_tensor(y, mesh, [ap.Shard(0)]))
            loss.backward()
            want = ref(x, y)
            want.backward()
            errors.append(abs(float(loss.full_tensor()) - float(want)))
            errors.append(float((model.head.weight.grad.full_tensor() - ref.head.weight.grad).abs().max()))
            model.zero_grad()
            ref.zero_grad()
        return _report_of(model), errors

    report, errors = _with("1", run)
    assert max(errors) < 1e-6, errors
    assert report["<root>"] == ["local", "local", "local (open sizes)", "local (open sizes)", "local (open sizes)"], report


def _report_of(model: torch.nn.Module) -> dict[str, list[str]]:
    import autoparallel as ap

    return ap.local_regions_report(model)


def ap_DistTensor() -> type:  # noqa: N802
    import autoparallel as ap

    return ap.DistTensor


# ---- where a region's collectives are attributed --------------------------------------------------
def _attributed(rank: int) -> list[tuple[str, str | None, str | None, float]]:
    import autoparallel as ap
    from tests.world.test_comm_debug import Net

    def run() -> list[tuple[str, str | None, str | None, float]]:
        torch.manual_seed(0)
        mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
        net = ap.parallelize(Net(), mesh, {"mlp.fc1": ap.ColWiseParallel(), "mlp.fc2": ap.RowWiseParallel()})
        x = ap.shard_tensor(torch.randn(6, 8), mesh, [ap.Replicate()])
        for _ in range(2):
            with ap.CommDebugMode() as comm:
                net(x).sum().backward()
        return [(r.kind, r.module, r.op, r.seconds) for r in comm.records]

    return _with("1", run)


def test_a_captured_regions_collectives_are_named_by_the_submodule_that_issues_them(world2) -> None:  # type: ignore[no-untyped-def]
    # the row-parallel output's all-reduce, made by fc2's style, inside the root's program: named by
    # fc2's path from the root, as op by op; a program's collective has no time of its own
    for rows in world2.run(_attributed):
        assert ("all_reduce", "mlp.fc2", None, 0.0) in rows, rows


def _zero3_lengths(rank: int) -> dict[str, Any]:
    from tests.world.test_zero import _zero3_lengths as lengths

    return _with("1", lengths, rank)


def test_zero3_blocks_are_captured_and_serve_new_lengths(world4) -> None:  # type: ignore[no-untyped-def]
    # ZeRO-3's hooks on a block's submodules do nothing while the block's unit has gathered
    # (``compat.QuietHook``): the block is a captured program (equal to one process at six lengths,
    # checked in the run), the model itself is not (it owns the blocks' sharded parameters)
    for r in world4.run(_zero3_lengths):
        blocks = r["report"]["blocks.0"]
        assert blocks[:2] == ["local", "local"] and "local (open sizes)" in blocks, r["report"]
        assert r["report"]["<root>"][0] == "refused: it owns ZeRO-3 sharded parameters (gathered by their unit)"
        assert r["warnings"] == [], r["warnings"]


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x) * scale


@pytest.mark.pure
def test_signatures_that_never_come_back_stop_being_captured() -> None:
    # a value argument that changes at every call makes every call a new signature: after 16
    # captures none of which served a second call, new signatures run on DistTensors
    import autoparallel as ap

    def run() -> tuple[list[str], float]:
        mesh = ap.ProcessMesh([0], dim_names=["dp"])
        torch.manual_seed(0)
        model = ap.shard_layer(_Scaled(), mesh)
        x = torch.randn(4, 4)
        worst = 0.0
        for k in range(20):
            y = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]), 1.0 + k / 8)
            want = (x @ model.lin.weight.full_tensor().T + model.lin.bias.full_tensor()) * (1.0 + k / 8)
            worst = max(worst, float((y.full_tensor() - want).abs().max()))
        return _report_of(model)["<root>"], worst

    verdicts, worst = _with("1", run)
    assert worst < 1e-6
    # (the report keeps the 16 latest signatures: 12 of the captured ones, then the 4 refused)
    assert verdicts[:12] == ["local"] * 12, verdicts
    assert len(verdicts) == 16 and all(v.startswith("refused: its signatures keep changing") for v in verdicts[12:]), verdicts


class _Twin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Stack(torch.nn.Module):
    """Three identical blocks and a Linear, behind a Python value read from the batch (the stack
    itself is refused: its blocks are regions)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Twin(), _Twin(), _Twin()])
        self.other = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.other(x) * float(x.abs().amax() > 0)


def _one_rank_pair(make: Any) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """(a one-rank mesh, ``make()`` laid out on it by ``shard_layer``, a plain ``make()`` holding
    the same values)."""
    import autoparallel as ap

    mesh = ap.ProcessMesh([0], dim_names=["dp"])
    torch.manual_seed(0)
    model = ap.shard_layer(make(), mesh)
    ref = make()
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    return mesh, model, ref


@pytest.mark.pure
def test_identical_modules_share_their_captured_calls() -> None:
    import autoparallel as ap
    from autoparallel.regions.region import _ATTR

    def run() -> tuple[dict[str, list[str]], list[int], float]:
        mesh, model, ref = _one_rank_pair(_Stack)
        worst = 0.0
        for _ in range(2):
            x = torch.randn(4, 4)
            y = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
            worst = max(worst, float((y.full_tensor() - ref(x)).abs().max()))
        regions = [m.__dict__[_ATTR] for m in (*model.blocks, model.other)]
        calls = [r.shared[r.class_key()] for r in regions]
        return _report_of(model), [len({id(c) for c in calls[:3]}), calls[0].captures, calls[3].captures], worst

    report, (distinct, captures, other), worst = _with("1", run)
    assert worst < 1e-6
    assert report["blocks.0"] == report["blocks.1"] == report["blocks.2"] == ["local"], report
    # the blocks' calls in one table: two signatures (the first block's input needs no gradient,
    # the others' do), two captures for three blocks; the Linear its own
    assert distinct == 1 and captures == 2 and other == 1, (distinct, captures, other)


class _Opts:
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.notes: dict[str, int] = {}


class _Numbered(_Twin):
    """A block that knows its place (``layer_idx``, as transformers' layers do) and has a scale
    of its own; ``reads``: what its forward reads of them (``"none"``, ``"scale"``, or ``"dict"``:
    the scale through ``vars(self)``)."""

    def __init__(self, index: int, scale: float, reads: str) -> None:
        super().__init__()
        self.layer_idx, self.scale, self.reads = index, scale, reads
        if reads == "held":  # a config object of its own, holding the scale
            self.opts = _Opts(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.reads == "held":
            return y * self.opts.scale
        if self.reads == "scale":
            return y * self.scale
        if self.reads == "dict":
            return y * vars(self)["scale"]
        return y


class _NumberedStack(_Stack):
    def __init__(self, scales: list[float], reads: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Numbered(k, s, reads) for k, s in enumerate(scales)])


@pytest.mark.pure
@pytest.mark.parametrize("scales,reads,captures", [
    ([1.0, 1.0, 1.0], "none", 2),    # only layer_idx differs, never read: as identical blocks
    ([1.0, 0.5, 0.5], "scale", 2),   # a value read: blocks 1 and 2 (equal scales) share
    ([1.0, 0.5, 2.0], "scale", 3),   # a value read and different in each: one capture per block
    ([1.0, 0.5, 2.0], "dict", 3),    # read through vars(self): every value counts as read
    ([1.0, 1.0, 1.0], "held", 2),    # a config object each, equal by content: as identical blocks
    ([1.0, 0.5, 2.0], "held", 3),    # configs that differ: one capture per block
])
def test_modules_differing_in_values_their_forward_never_reads_share_a_program(
        scales: list[float], reads: str, captures: int) -> None:
    """Blocks whose plain values differ where their captured forward never reads them (a
    decoder layer's ``layer_idx`` without a cache) share one program; a value it reads keeps
    programs apart. Each block's output equals one process's."""
    import autoparallel as ap
    from autoparallel.regions.region import _ATTR

    def run() -> tuple[dict[str, list[str]], int, float]:
        mesh, model, ref = _one_rank_pair(lambda: _NumberedStack(scales, reads))
        worst = 0.0
        for _ in range(2):
            x = torch.randn(4, 4)
            y = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
            worst = max(worst, float((y.full_tensor() - ref(x)).abs().max()))
            y.sum().backward()
            ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            worst = max(worst, float((p.grad.full_tensor() - q.grad).abs().max()))
        tables = {id(m.__dict__[_ATTR].shared[m.__dict__[_ATTR].class_key()]) for m in model.blocks}
        assert len(tables) == (1 if reads != "held" or len(set(scales)) == 1 else 3)
        assert all(type(m) is type(b) for m, b in zip(model.modules(), ref.modules()))  # classes as they were
        blocks = {id(c): c for c in (m.__dict__[_ATTR].shared[m.__dict__[_ATTR].class_key()] for m in model.blocks)}
        return _report_of(model), sum(c.captures for c in blocks.values()), worst

    report, got, worst = _with("1", run)
    assert worst < 1e-6, worst
    assert report["blocks.0"] == report["blocks.1"] == report["blocks.2"] == ["local"], report
    assert got == captures, (got, captures)


class _Noted(_Twin):
    """Holds a config; its forward reads the gain in it, or (``reads_notes`` False) nothing of it."""

    def __init__(self, reads_gain: bool) -> None:
        super().__init__()
        self.opts, self.reads_gain = _Opts(1.0), reads_gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * self.opts.scale if self.reads_gain else y


@pytest.mark.pure
@pytest.mark.parametrize("reads_gain,captures", [(False, 1), (True, 3)])
def test_a_held_object_changing_between_calls_is_a_new_signature_where_the_forward_reads_it(
        reads_gain: bool, captures: int) -> None:
    """A held config changed between calls (a note written into it, its scale set): a new
    signature, captured anew where the forward reads the object, the same program where it
    never does. Each call equals one process's."""
    import autoparallel as ap
    from autoparallel.regions.region import _ATTR

    def run() -> tuple[int, float]:
        mesh, model, ref = _one_rank_pair(lambda: _Noted(reads_gain))
        worst = 0.0
        for step in range(3):
            for m in (model, ref):
                m.opts.notes["step"] = step
                m.opts.scale = 1.0 + step
            x = torch.randn(4, 4)
            y = model(ap.shard_tensor(x, mesh, [ap.Shard(0)]))
            worst = max(worst, float((y.full_tensor() - ref(x)).abs().max()))
        return model.__dict__[_ATTR].calls.captures, worst

    got, worst = _with("1", run)
    assert worst < 1e-6, worst
    assert got == captures, (got, captures)


def _styled_stack(rank: int) -> tuple[dict[str, list[str]], int, int, float]:
    import autoparallel as ap
    from autoparallel.regions.region import _ATTR

    mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
    torch.manual_seed(0)
    ref = _Stack()
    model = _Stack()
    model.load_state_dict(ref.state_dict())
    ap.parallelize(model, mesh, {"blocks.*.fc1": ap.ColWiseParallel(), "blocks.[01].fc2": ap.RowWiseParallel(),
                                 "blocks.2.fc2": ap.RowWiseParallel(output_layout=ap.Partial())})
    worst = 0.0
    for n in (4, 6):
        x = torch.randn(n, 4)
        y = model(ap.shard_tensor(x, mesh, [ap.Replicate()]))
        worst = max(worst, float((y.full_tensor() - ref(x)).abs().max()))
    regions = [m.__dict__[_ATTR] for m in model.blocks]
    tables = [id(r.shared[r.class_key()]) for r in regions]
    own = tables[2] not in tables[:2]
    return _report_of(model), len(set(tables[:2])) if own else 0, regions[0].shared[regions[0].class_key()].captures, worst


def test_identically_styled_modules_share_their_captured_calls(world2) -> None:  # type: ignore[no-untyped-def]
    """Blocks whose submodules carry the same styles (a column- then a row-parallel Linear, on one
    mesh axis) share one table of captured calls; a block styled otherwise (its output left
    Partial) has its own. Equal to one process at both batch sizes."""
    for report, distinct, captures, worst in world2.run(_styled_stack):
        assert worst < 1e-5
        assert report["blocks.0"][0] == report["blocks.1"][0] == "local", report
        # two blocks, two sizes (the first block's input needs no gradient, the second's does):
        # one table; captures: 2 at the first size, then 2 of open sizes at the second
        assert distinct == 1 and captures <= 4, (distinct, captures)


_PICKS_RUNS: list[int] = []  # one entry per run of ``_Picks.forward`` (a capture undoes the module's own writes)


class _Picks(torch.nn.Module):
    """The rows of ``x`` whose first entry is positive: an output whose size depends on the data
    (as a mixture of experts routes tokens), which no capture can follow."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _PICKS_RUNS.append(1)
        y = self.lin(x)
        return y[(y[:, 0] > 0).nonzero().squeeze(1)].sum(0, keepdim=True) + y


class _Nest(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.lin(x))


@pytest.mark.pure
def test_a_refusal_met_inside_nested_modules_costs_one_trace_and_refuses_each() -> None:
    """The whole model's capture fails inside ``_Picks`` (a data-dependent output size): the modules
    the failure passed through are refused with it, without a capture each, their other children
    are regions, and the values and gradients are bitwise op by op."""
    import autoparallel as ap

    def run() -> tuple[list[torch.Tensor], dict[str, list[str]], int]:
        mesh = ap.ProcessMesh([0], dim_names=["dp"])
        torch.manual_seed(0)
        model = ap.shard_layer(_Nest(_Nest(_Picks())), mesh)
        _PICKS_RUNS.clear()
        x = ap.shard_tensor(torch.randn(8, 4), mesh, [ap.Shard(0)])
        y = model(x)
        y.sum().backward()
        return [y.full_tensor().detach(), *(p.grad.full_tensor() for p in model.parameters())], _report_of(model), len(_PICKS_RUNS)

    base, _, _ = _with("0", run)
    got, report, runs = _with("1", run)
    why = "refused: tracing the step failed (DynamicOutputShapeException: aten.nonzero.default)"
    assert report == {"<root>": [why], "inner": [why], "inner.inner": [why], "lin": ["local"], "inner.lin": ["local"],
                      "inner.inner.lin": ["local"]}, report
    assert runs == 2, runs  # the root's trace, then op by op (a capture per level: 4)
    for a, b in zip(base, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
