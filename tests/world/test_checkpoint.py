"""Distributed checkpoints in a 4-rank gloo world: reshard on load, safety, errors, export, RNG.

Every load is checked against the reference values (``tests.layouts.reference``): each target
rank's shard (or ``full_tensor()`` for Partial targets) equals the corresponding region.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from autoparallel.checkpoint import CheckpointError
from autoparallel.checkpoint import save as save_mod
from tests.layouts import make_dist, reference

R = Replicate()
DP_TP = ([[0, 1], [2, 3]], ["dp", "tp"])
TP4 = ([0, 1, 2, 3], ["tp"])
DP2 = ([0, 1], ["dp"])  # ranks 2 and 3 are outside
MESH3D = ([[[0], [1]], [[2], [3]]], ["pp", "dp", "tp"])
MESHES = [TP4, DP_TP, ([[0, 2], [1, 3]], ["a", "b"]), ([3, 1], ["x"]), ([1, 2, 3], ["x"]),
          ([[[0, 1]], [[2, 3]]], ["a", "b", "c"]), MESH3D, ([2], ["x"])]


# ---- helpers run on every rank --------------------------------------------------------------
def _mesh(desc: tuple) -> ap.ProcessMesh:
    return ap.ProcessMesh(desc[0], desc[1])


def _make(full: torch.Tensor, layout: tuple | None) -> torch.Tensor:
    """``full`` laid out as ``layout`` = (mesh desc, placements, shard order) or a plain copy."""
    if layout is None:
        return full.clone()
    desc, placements, order = layout
    return make_dist(full, _mesh(desc), tuple(placements), order)


def _value(t: torch.Tensor) -> torch.Tensor | None:
    """The global value of ``t`` on ranks that can see it (None off the mesh)."""
    if isinstance(t, ap.DistTensor):
        return t.full_tensor() if ap.get_rank() in t.process_mesh else None
    return t


def _same(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """Values equal (exactly; floats up to rounding, as Partial sources are reduced summands)."""
    v = _value(t)
    if v is None:
        return True
    ref = ref.to(v.dtype)
    if v.shape != ref.shape:
        return False
    return torch.allclose(v, ref, rtol=1e-5, atol=1e-6) if v.is_floating_point() else torch.equal(v, ref)


def _roundtrip(rank: int, folder: str, tensors: list) -> list[str]:
    """Save tensors (shape, seed, save layout, load layout), load into the load layouts, compare."""
    refs = [reference(shape, seed) for shape, seed, _, _ in tensors]
    sd = {"t": {str(i): _make(r, t[2]) for i, (r, t) in enumerate(zip(refs, tensors))}, "step": 7}
    ap.save_state_dict(sd, folder)
    target = {"t": {str(i): _make(torch.zeros_like(r), t[3]) for i, (r, t) in enumerate(zip(refs, tensors))},
              "step": 0}
    ptrs = [getattr(x, "_local", x).data_ptr() for x in target["t"].values()]
    ap.load_state_dict(target, folder)
    bad = [f"{i}: {tensors[i]}" for i, r in enumerate(refs) if not _same(target["t"][str(i)], r)]
    if target["step"] != 7 or ptrs != [getattr(x, "_local", x).data_ptr() for x in target["t"].values()]:
        bad.append("step or identity")
    return bad


def _healthy(rank: int) -> float:
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return t.item()


# ---- reshard on load: hypothesis over meshes and placements -----------------------------------
@st.composite
def _layout(draw: st.DrawFn, ndim: int, partial: tuple[str, ...]) -> tuple | None:
    if draw(st.integers(0, 7)) == 0:
        return None
    desc = draw(st.sampled_from(MESHES))
    axes = np.array(desc[0]).ndim
    kind = draw(st.sampled_from(partial)) if partial else None
    choices = [R] + [Shard(d) for d in range(ndim)] + ([Partial(kind)] if kind else [])
    placements = [draw(st.sampled_from(choices)) for _ in range(axes)]
    order = {}
    for d in range(ndim):
        by = [a for a, p in enumerate(placements) if p == Shard(d)]
        if len(by) > 1:
            order[d] = draw(st.permutations(by))
    return desc, placements, order


@st.composite
def _case(draw: st.DrawFn) -> list:
    out = []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
        out.append((shape, 100 + i, draw(_layout(len(shape), ("sum", "avg", "max"))), draw(_layout(len(shape), ("sum",)))))
    return out


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=_case())
def test_reshard_on_load_property(world4, case):  # type: ignore[no-untyped-def]
    folder = tempfile.mkdtemp(prefix="ap_ckpt_")
    try:
        assert world4.run(_roundtrip, folder, case) == [[]] * 4
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_strided_layouts_save_and_load(world4, tmp_path):  # type: ignore[no-untyped-def]
    """A StridedShard tensor is saved gathered on its strided axes and loaded into any layout; a
    strided target is filled from the pieces that hold it (no box of its own)."""
    ss = ap.StridedShard
    case = [
        ((12, 5), 1, (DP_TP, [Shard(0), ss(0, 3)], {}), (DP_TP, [Shard(1), R], {})),  # 3 blocks over 2: uneven
        ((12, 5), 2, (TP4, [Shard(0)], {}), (TP4, [ss(0, 4)], {})),
        ((12, 5), 3, (DP_TP, [Partial(), ss(0, 2)], {}), (DP_TP, [ss(0, 6), R], {})),
        ((4, 6), 4, (DP_TP, [ss(1, 2), ss(1, 2)], {}), None),
    ]
    assert world4.run(_roundtrip, str(tmp_path), case) == [[]] * 4


# ---- a model + ZeRO optimizer state saved on dp x tp, loaded on other layouts --------------------
SHAPES = {"w1": (8, 6), "b1": (8,), "w2": (5, 8)}


def _train_state(layouts: dict) -> dict:
    """Model params, Adam-like ZeRO states (Shard(0) on the data-parallel axis) and step counters."""
    sd: dict = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0, 1, 2]}]},
                "step": 11, "meta": {"name": "gpt", "loss": 2.5, "done": False, "note": None}}
    for i, (name, shape) in enumerate(SHAPES.items()):
        sd["model"][name] = _make(reference(shape, i), layouts["model"][name])
        sd["optim"]["state"][i] = {"exp_avg": _make(reference(shape, 10 + i), layouts["optim"][name]),
                                   "exp_avg_sq": _make(reference(shape, 20 + i).abs(), layouts["optim"][name]),
                                   "step": torch.tensor(11.0)}
    return sd


def _zeroed(sd: dict) -> dict:
    def z(x):  # type: ignore[no-untyped-def]
        if isinstance(x, torch.Tensor):
            getattr(x, "_local", x).zero_()
            return x
        if isinstance(x, dict):
            return {k: z(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(z(v) for v in x)
        return {str: "", float: 0.0, int: 0, bool: True}.get(type(x), x)
    return z(sd)


def _layouts(kind: str) -> dict:
    if kind == "dp_tp":  # TP column/row, ZeRO states sharded further on dp
        model = {"w1": (DP_TP, [R, Shard(0)], None), "b1": (DP_TP, [R, Shard(0)], None), "w2": (DP_TP, [R, Shard(1)], None)}
        optim = {"w1": (DP_TP, [Shard(1), Shard(0)], None), "b1": (DP_TP, [Shard(0), Shard(0)], {0: [1, 0]}),
                 "w2": (DP_TP, [Shard(0), Shard(1)], None)}
    elif kind == "tp4":
        model = {n: (TP4, [Shard(0)], None) for n in SHAPES}
        optim = {n: (TP4, [Shard(len(s) - 1)], None) for n, s in SHAPES.items()}
    elif kind == "dp2":
        model = {n: (DP2, [R], None) for n in SHAPES}
        optim = {n: (DP2, [Shard(0)], None) for n in SHAPES}
    else:  # 3-d mesh pp x dp x tp of shape 2 x 2 x 1
        model = {n: (MESH3D, [Shard(0), R, Shard(0)], None) for n in SHAPES}
        optim = {n: (MESH3D, [R, Shard(0), R], None) for n in SHAPES}
    return {"model": model, "optim": optim}


def _save_train(rank: int, folder: str) -> None:
    ap.save_state_dict(_train_state(_layouts("dp_tp")), folder)


def _load_train(rank: int, folder: str, kind: str) -> bool:
    target = _zeroed(_train_state(_layouts(kind)))
    ap.load_state_dict(target, folder)
    return _equal_state(target, _train_state({"model": dict.fromkeys(SHAPES), "optim": dict.fromkeys(SHAPES)}))


def _equal_state(got: object, want: object) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and _same(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_equal_state(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(_equal_state, got, want))
    return type(got) is type(want) and got == want


def test_save_dp_tp_load_tp4_dp2_3d_and_single_process(world4, tmp_path):  # type: ignore[no-untyped-def]
    folder = str(tmp_path / "ckpt")
    world4.run(_save_train, folder)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    w1 = meta["entries"]["model.w1"]["chunks"]  # [R, S(0)] on dp x tp: 2 boxes, one writer each
    assert sorted(c["offset"] for c in w1) == [[0, 0], [4, 0]]
    assert len({c["file"] for c in w1}) == 2, "replicas should be spread over different ranks"
    for kind in ("tp4", "dp2", "3d", "dp_tp"):
        assert world4.run(_load_train, folder, kind) == [True] * 4, kind
    # this test process is a world of one: plain tensors
    plain = _zeroed(_train_state({"model": dict.fromkeys(SHAPES), "optim": dict.fromkeys(SHAPES)}))
    ap.load_state_dict(plain, folder)
    assert _equal_state(plain, _train_state({"model": dict.fromkeys(SHAPES), "optim": dict.fromkeys(SHAPES)}))


def test_every_byte_written_once(world4, tmp_path):  # type: ignore[no-untyped-def]
    world4.run(_save_train, str(tmp_path))
    data = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".bin"))
    want = sum(4 * int(np.prod(s)) * 3 for s in SHAPES.values()) + 4 * 3  # params, 2 moments, steps
    assert want <= data < want + 64 * 40  # alignment padding only


def _partial_and_dtypes(rank: int, folder: str) -> bool:
    """Partial(sum/max) values are reduced before save; int/bf16/bool and 0-size tensors load back."""
    full = reference((6, 4), 3)
    sd = {"p": make_dist(full, _mesh(DP_TP), (Partial("sum"), Shard(1))),
          "m": make_dist(full, _mesh(DP_TP), (Shard(0), Partial("max"))),
          "i": _make(torch.arange(10), (TP4, [Shard(0)], None)), "h": full.to(torch.bfloat16),
          "b": _make(full > 0, (DP_TP, [Shard(1), R], None)), "e": _make(torch.zeros(0, 3), (TP4, [Shard(0)], None))}
    ap.save_state_dict(sd, folder)
    target = {"p": _make(torch.zeros(6, 4), (TP4, [Shard(0)], None)), "m": torch.zeros(6, 4),
              "i": _make(torch.zeros(10, dtype=torch.long), (([[0, 1], [2, 3]], ["a", "b"]), [Shard(0), Shard(0)], {0: [1, 0]})),
              "h": _make(torch.zeros(6, 4, dtype=torch.bfloat16), (TP4, [Partial("sum")], None)),
              "b": _make(torch.zeros(6, 4, dtype=torch.bool), (TP4, [Shard(1)], None)), "e": torch.ones(0, 3)}
    ap.load_state_dict(target, folder)
    return (_same(target["p"], full) and _same(target["m"], full) and _same(target["i"], torch.arange(10))
            and _same(target["h"], full.to(torch.bfloat16)) and _same(target["b"], full > 0))


def test_partial_dtypes_and_empty(world4, tmp_path):  # type: ignore[no-untyped-def]
    assert world4.run(_partial_and_dtypes, str(tmp_path)) == [True] * 4


# ---- safety: a failed save keeps the previous checkpoint ------------------------------------
def _crash_during_save(rank: int, folder: str) -> str:
    ap.save_state_dict({"w": _make(reference((8, 4), 1), (DP_TP, [R, Shard(0)], None)), "step": 1}, folder)
    orig = save_mod.write_owned

    def write_then_fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig(*args, **kwargs)  # rank 2's data file is written, then it fails before the commit
        if rank == 2:
            raise OSError("No space left on device (injected)")
        return out

    save_mod.write_owned = write_then_fail
    try:
        ap.save_state_dict({"w": _make(reference((8, 4), 2), (DP_TP, [R, Shard(0)], None)), "step": 2}, folder)
        msg = "no error"
    except CheckpointError as e:
        msg = str(e)
    finally:
        save_mod.write_owned = orig
    target = {"w": _make(torch.zeros(8, 4), (TP4, [Shard(1)], None)), "step": 0}
    ap.load_state_dict(target, folder)
    assert _same(target["w"], reference((8, 4), 1)) and target["step"] == 1
    return msg


def test_crash_during_save_keeps_previous_checkpoint(world4, tmp_path):  # type: ignore[no-untyped-def]
    msgs = world4.run(_crash_during_save, str(tmp_path))
    assert all("rank(s) [2] failed" in m and "No space left" in m for m in msgs), msgs[0]
    files = sorted(os.listdir(tmp_path))
    meta = (tmp_path / "metadata.json").read_text()
    assert all(f == "metadata.json" or f in meta for f in files), files  # the failed save left nothing


# ---- errors: damaged checkpoints and state dicts that do not fit --------------------------------
def _load_kind(rank: int, folder: str, kind: str, strict: bool = True) -> bool:
    target = _zeroed(_train_state(_layouts(kind)))
    ap.load_state_dict(target, folder, strict=strict)
    return True


def _load_other_model(rank: int, folder: str, change: str) -> bool:
    target = _zeroed(_train_state(_layouts("tp4")))
    if change == "extra":
        target["model"]["w3"] = torch.zeros(2)
    elif change == "missing":
        del target["optim"]["state"][2]
    elif change == "shape":
        target["model"]["w1"] = torch.zeros(8, 7)
    elif change == "fresh optimizer":
        target["optim"]["state"] = {}
    else:  # non-strict: the extra key is left alone, the rest loads
        target["model"]["w3"] = torch.full((2,), 5.0)
        del target["optim"]["state"][2]
        ap.load_state_dict(target, folder, strict=False)
        return _same(target["model"]["w2"], reference(SHAPES["w2"], 2)) and torch.equal(target["model"]["w3"], torch.full((2,), 5.0))
    ap.load_state_dict(target, folder)
    return True


def _file_of(tmp_path, key: str) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    meta = json.loads((tmp_path / "metadata.json").read_text())
    return meta["entries"][key]["chunks"][0]["file"], meta


def test_damaged_checkpoints_raise_on_every_rank(world4, tmp_path):  # type: ignore[no-untyped-def]
    folder = str(tmp_path)
    world4.run(_save_train, folder)
    name, meta = _file_of(tmp_path, "model.w1")
    path = tmp_path / name
    good = path.read_bytes()
    at = meta["entries"]["model.w1"]["chunks"][0]["start"] + 5
    path.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1:])  # one flipped bit
    with pytest.raises(CheckpointError, match=f"{name}.*corrupted: checksum mismatch"):
        world4.run(_load_kind, folder, "tp4")
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=f"{name}.* is truncated"):
        world4.run(_load_kind, folder, "tp4")
    path.unlink()
    with pytest.raises(CheckpointError, match=f"{name}.* is missing"):
        world4.run(_load_kind, folder, "dp2")
    path.write_bytes(good)
    assert world4.run(_load_kind, folder, "tp4") == [True] * 4
    outside = tmp_path.parent / "outside.bin"
    outside.write_bytes(good)
    (tmp_path / "link.bin").symlink_to(outside)
    meta_path = tmp_path / "metadata.json"
    for evil, why in [("../outside.bin", "not a plain file name"), (str(outside), "not a plain file name"),
                      ("link.bin", "outside the checkpoint folder")]:
        meta["entries"]["model.w1"]["chunks"][0]["file"] = evil
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=why):
            world4.run(_load_kind, folder, "tp4")
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        world4.run(_load_kind, folder, "tp4")
    meta_path.unlink()
    with pytest.raises(CheckpointError, match="metadata.json is missing"):
        world4.run(_load_kind, folder, "tp4")
    assert world4.run(_healthy) == [4.0] * 4


@pytest.mark.parametrize("change,exc,text", [
    ("extra", ValueError, r"1 key\(s\) of the target state dict are not in .*'model.w3'"),
    ("missing", ValueError, r"3 key\(s\) in .* are not in the target state dict of any rank.*'optim.state.2.exp_avg'"),
    ("shape", ValueError, r"'model.w1': shape mismatch: the target has shape \[8, 7\], .* has \[8, 6\]"),
    ("fresh optimizer", ValueError, r"'optim' holds no tensors in the target .*init_optimizer_state"),
])
def test_different_model_raises_on_every_rank(world4, tmp_path, change, exc, text):  # type: ignore[no-untyped-def]
    world4.run(_save_train, str(tmp_path))
    with pytest.raises(exc, match=text):
        world4.run(_load_other_model, str(tmp_path), change)
    assert world4.run(_load_other_model, str(tmp_path), "non-strict") == [True] * 4
    assert world4.run(_healthy) == [4.0] * 4


# ---- export to one plain file, import into any layout ----------------------------------------
def _export(rank: int, file: str) -> None:
    sd = _train_state(_layouts("dp_tp"))
    sd["model"]["p"] = make_dist(reference((4, 3), 9), _mesh(DP_TP), (Partial("sum"), Shard(0)))
    ap.checkpoint.export_state_dict(sd, file)


def _import(rank: int, file: str) -> bool:
    target = _zeroed(_train_state(_layouts("tp4")))
    target["model"]["p"] = _make(torch.zeros(4, 3), (([1, 2], ["x"]), [Shard(1)], None))
    ap.load_state_dict(target, file)
    want = _train_state({"model": dict.fromkeys(SHAPES), "optim": dict.fromkeys(SHAPES)})
    want["model"]["p"] = reference((4, 3), 9)
    return _equal_state(target, want)


def _export_safetensors(rank: int, file: str) -> None:
    sd = _train_state(_layouts("dp_tp"))
    sd["model"]["p"] = make_dist(reference((4, 3), 9), _mesh(DP_TP), (Partial("sum"), Shard(0)))
    ap.checkpoint.export_state_dict(sd, file, format="safetensors")


def test_export_safetensors(world4, tmp_path):  # type: ignore[no-untyped-def]
    safetensors = pytest.importorskip("safetensors.torch")
    file = str(tmp_path / "model.safetensors")
    world4.run(_export_safetensors, file)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    tensors = safetensors.load_file(file)
    torch.testing.assert_close(tensors["model.p"], reference((4, 3), 9))  # a Partial(sum) reduced: rounding
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    with pytest.raises(ValueError, match="format must be one of"):
        ap.checkpoint.export_state_dict({}, file, format="onnx")


def test_export_single_file_and_import_into_any_layout(world4, tmp_path):  # type: ignore[no-untyped-def]
    file = str(tmp_path / "model.pt")
    world4.run(_export, file)
    assert os.listdir(tmp_path) == ["model.pt"]
    plain = torch.load(file, weights_only=True)  # an ordinary state dict of full plain tensors
    want = _train_state({"model": dict.fromkeys(SHAPES), "optim": dict.fromkeys(SHAPES)})
    want["model"]["p"] = reference((4, 3), 9)
    assert type(plain["model"]["w1"]) is torch.Tensor and _equal_state(plain, want)
    assert world4.run(_import, file) == [True] * 4


def _export_a_later_stage(rank: int, file: str) -> None:
    # a pipeline's later stage: tensors on a mesh without rank 0 (the writer) move whole onto it
    later = ap.ProcessMesh([2, 3], dim_names=["dp"])
    sd = {"first": make_dist(reference((4, 3), 5), ap.ProcessMesh([0, 1], dim_names=["dp"]), (Shard(0),)),
          "later": make_dist(reference((5, 2), 6), later, (Shard(0),)),
          "partial": make_dist(reference((3,), 7), later, (Partial("sum"),))}
    ap.checkpoint.export_state_dict(sd, file)


def test_export_moves_a_later_stage_onto_the_writer(world4, tmp_path):  # type: ignore[no-untyped-def]
    file = str(tmp_path / "stages.pt")
    world4.run(_export_a_later_stage, file)
    plain = torch.load(file, weights_only=True)
    assert torch.equal(plain["first"], reference((4, 3), 5)) and torch.equal(plain["later"], reference((5, 2), 6))
    torch.testing.assert_close(plain["partial"], reference((3,), 7))  # a Partial(sum) reduced: rounding


# ---- resume helpers: RNG states and materialised optimizer state ----------------------------
def _draw(g: torch.Generator) -> list:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand()), torch.randint(100, (4,), generator=g).tolist()]


def _rng_roundtrip(rank: int, folder: str) -> bool:
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    g = torch.Generator().manual_seed(50 + rank)
    _draw(g)
    ap.save_state_dict({"rng": ap.checkpoint.rng_state({"loader": g})}, folder)
    expected = _draw(g)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    g.manual_seed(99)
    target = {"rng": ap.checkpoint.rng_state({"loader": g})}
    ap.load_state_dict(target, folder)
    ap.checkpoint.set_rng_state(target["rng"], {"loader": g})
    return _draw(g) == expected


def test_rng_state_roundtrip_per_rank(world4, tmp_path):  # type: ignore[no-untyped-def]
    assert world4.run(_rng_roundtrip, str(tmp_path)) == [True] * 4


def _model(layout: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    col = [Shard(0)] if layout == "tp4" else [R, Shard(0)]
    row = [Shard(1)] if layout == "tp4" else [Shard(1), R]
    mesh = _mesh(TP4 if layout == "tp4" else DP_TP)
    for lin, pl in ((m[0], col), (m[2], row)):
        lin.weight = ap.shard_tensor(lin.weight, mesh, pl)
        lin.bias = ap.shard_tensor(lin.bias, mesh, [R] * mesh.ndim)
    return m


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(s))
        loss = m(ap.shard_tensor(x, m[0].weight.process_mesh, [R] * m[0].weight.process_mesh.ndim)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.full_tensor().item())
    return losses


def _resume(rank: int, folder: str) -> list:
    """Train 2 steps on tp4, checkpoint, train 2 more; resume on dp x tp + ZeRO-2: same losses, params."""
    m = _model("tp4")
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    _train(m, opt, 2, 0)
    ap.save_state_dict({"model": m.state_dict(), "optim": opt.state_dict(), "data": {"step": 2}}, folder)
    straight = _train(m, opt, 2, 2)
    m2 = _model("dp_tp")  # resumed on dp x tp with ZeRO-2: optimizer states Shard on "dp"
    opt2 = ap.shard_optimizer(torch.optim.AdamW(m2.parameters(), lr=0.05, weight_decay=0.1, foreach=False),
                              ap.ShardingStage2(m2[0].weight.process_mesh, "dp"))
    before = [p.full_tensor().clone() for p in m2.parameters()]
    ap.checkpoint.init_optimizer_state(opt2)
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(m2.parameters(), before)), "init changed params"
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict(), "data": {"step": 0}}
    ap.load_state_dict(sd, folder)
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    resumed = _train(m2, opt2, 2, sd["data"]["step"])
    same = all(torch.allclose(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6)
               for p, q in zip(m.parameters(), m2.parameters()))
    zero = opt2.state_dict()["state"][0]["exp_avg"]
    return [straight, resumed, same, opt2.state_dict()["state"][0]["step"].item(), str(zero.placements[0])]


def test_resume_training_on_another_layout(world4, tmp_path):  # type: ignore[no-untyped-def]
    straight, resumed, same, step, zero_placement = world4.run(_resume, str(tmp_path))[0]
    assert np.allclose(straight, resumed, rtol=1e-5), (straight, resumed)
    assert same and step == 4.0 and zero_placement.startswith("S("), zero_placement


# ---- pure: plan, metadata, flatten, timeout --------------------------------------------------
@pytest.mark.pure  # single process, no world
def test_plan_one_writer_per_box_balanced() -> None:
    from autoparallel.checkpoint.planner import Item, plan_save

    box = lambda r0, n: ((r0, n), (0, 4))  # noqa: E731
    ranks = [[Item("w", "float32", (8, 4), box(0 if r < 2 else 4, 4)), Item("b", "float32", (8, 4), ((0, 8), (0, 4))),
              Item("s", value=3)] for r in range(4)]
    plan = plan_save(ranks)
    w = plan.entries["w"].chunks
    assert [c.box for c in w] == [box(0, 4), box(4, 4)] and {c.writer for c in w} <= {0, 1, 2, 3}
    assert len(plan.entries["b"].chunks) == 1 and plan.entries["s"] == 3
    written = [sum(1 for _ in plan.chunks_of(r)) for r in range(4)]
    assert sorted(written) == [0, 1, 1, 1]  # 3 chunks, 3 different writers
    bad = [[Item("w", "float32", (8, 4), box(0, 4))], [Item("w", "float32", (8, 5), box(0, 4))]]
    with pytest.raises(ValueError, match=r"'w' differs between ranks"):
        plan_save(bad)
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        plan_save([[Item("w", "float32", (8, 4), box(0, 4))]])


@pytest.mark.pure  # single process, no world
def test_each_block_read_is_verified_by_exactly_one_reader() -> None:
    from autoparallel.checkpoint.planner import blocks_to_verify

    claims = [[("w", 0, 0, 8), ("b", 0, 0, 1)], [("w", 0, 0, 8)], [("w", 0, 4, 6), ("w", 1, 0, 3)], []]
    mine = [blocks_to_verify(claims, r) for r in range(4)]
    read = {(k, c, b) for cl in claims for k, c, b0, b1 in cl for b in range(b0, b1)}
    assert sorted(x for m in mine for x in m) == sorted(read)  # every block once, by one reader
    for r, m in enumerate(mine):
        assert all(any(k == x[0] and c == x[1] and b0 <= x[2] < b1 for k, c, b0, b1 in claims[r]) for x in m)
    assert min(len(m) for m in mine[:3]) >= 3  # spread: the 8 shared blocks of w go to 0, 1 and 2


@pytest.mark.pure  # single process, no world
def test_metadata_rejects_bad_fields() -> None:
    from autoparallel.checkpoint.metadata import Chunk as C
    from autoparallel.checkpoint.metadata import TensorEntry, from_json, to_json

    good = to_json({"w": TensorEntry((4,), torch.float32, (C((0,), (4,), "d.bin", 0, 16, (1,)),))})
    assert from_json(good, "m")["w"].chunks[0].file == "d.bin"
    for field, value, text in [("file", "/abs.bin", "not a plain file name"), ("file", "a/../b", "not a plain"),
                               ("file", "..", "not a plain"), ("nbytes", 15, "expected 16"),
                               ("offset", [1], "lies outside"), ("start", -1, "non-negative int"),
                               ("crc32", [], "crc32 must be a list of 1")]:
        doc = json.loads(good)
        doc["entries"]["w"]["chunks"][0][field] = value
        with pytest.raises(CheckpointError, match=text):
            from_json(json.dumps(doc), "m")
    doc = json.loads(good)
    doc["entries"]["w"]["dtype"] = "object"
    with pytest.raises(CheckpointError, match="unknown dtype 'object'"):
        from_json(json.dumps(doc), "m")


@pytest.mark.pure  # single process, no world
def test_flatten_rejects_unsupported_values_and_clashes() -> None:
    from autoparallel.checkpoint.flat import flatten

    with pytest.raises(TypeError, match=r"'a.b' is a set"):
        flatten({"a": {"b": {1}}}, "save_state_dict")
    with pytest.raises(ValueError, match="same key 'a.b'"):
        flatten({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "save_state_dict")
    flat = flatten({"s": {0: {"m": torch.ones(1), "k": 2}}, "g": [{"betas": (0.9, 0.99), 3: None}], "e": {}}, "x")
    assert list(flat) == ["s.0.m", "s.0.k", "g", "e"]  # containers without tensors are single values


@pytest.mark.pure  # single process, no world
def test_plain_value_containers_roundtrip_whatever_the_target_holds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    train = {"step": 5, "losses": [2.5, float("inf"), 1e-300], "sampler": {"epoch": 1, 7: (2, "x")}, "flag": None}
    ap.save_state_dict({"w": torch.arange(3.0), "train": train}, str(tmp_path))  # a world of one
    target = {"w": torch.zeros(3), "train": {"step": 0, "losses": [], "sampler": {}, "flag": True}}
    ap.load_state_dict(target, str(tmp_path))
    assert target["train"] == train and type(target["train"]["sampler"][7]) is tuple
    assert torch.equal(target["w"], torch.arange(3.0))


@pytest.mark.pure  # single process, no world
def test_collective_timeout_from_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from autoparallel import runtime

    monkeypatch.setenv("AUTOPARALLEL_TIMEOUT", "2.5")
    assert runtime.collective_timeout().total_seconds() == 2.5  # type: ignore[union-attr]
    monkeypatch.setenv("AUTOPARALLEL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="AUTOPARALLEL_TIMEOUT='soon'"):
        runtime.collective_timeout()
    monkeypatch.delenv("AUTOPARALLEL_TIMEOUT")
    assert runtime.collective_timeout() is None
