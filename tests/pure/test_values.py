"""Pure tests of the value types: placements, ``ProcessMesh`` and ``DistSpec`` geometry.

No processes: a mesh built without a world is metadata only. ``local_box`` is checked against a
brute-force reference that applies ``torch.chunk`` to ``torch.arange(n)`` per tensor dim, one
mesh axis after another, for every mesh coordinate.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel import DistSpec, Partial, ProcessMesh, Replicate, Shard

R = Replicate()
F32 = torch.float32


OUR_PACKAGES = ("autoparallel", "spmd_rules", "reshard")


@pytest.mark.parametrize("name", ["spmd_rules", "reshard", "autoparallel"])
def test_each_package_imports_first(name: str) -> None:
    """``import <name>`` works as the first import of our packages (no circular import).

    Our modules are set aside, ``name`` is imported afresh, and the originals are put back.
    """
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] in OUR_PACKAGES}
    for k in saved:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in OUR_PACKAGES]:
            del sys.modules[k]
        sys.modules.update(saved)


# ---- placements ------------------------------------------------------------------------------
def test_placement_str_and_repr() -> None:
    assert str(Shard(0)) == "S(0)"
    assert str(R) == "R"
    assert str(Partial()) == "P(sum)"
    assert str(Partial("max")) == "P(max)"
    assert repr(Shard(1)) == "Shard(1)"
    assert repr(R) == "Replicate()"
    assert repr(Partial("avg")) == "Partial('avg')"
    # repr is the constructor form: it evaluates back to an equal value
    for p in (Shard(2), R, Partial("min")):
        assert eval(repr(p), {"Shard": Shard, "Replicate": Replicate, "Partial": Partial}) == p


def test_placement_equality_and_hash() -> None:
    assert Shard(0) == Shard(0) and hash(Shard(0)) == hash(Shard(0))
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and hash(Partial()) == hash(Partial("sum"))
    assert Partial("sum") != Partial("avg")
    assert Shard(0) != R and R != Partial() and Shard(0) != Partial()
    assert len({Shard(0), Shard(0), Shard(1), R, Replicate(), Partial(), Partial("sum")}) == 4


def test_placement_predicates() -> None:
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert R.is_replicate() and not R.is_shard() and not R.is_partial()
    assert Partial().is_partial() and not Partial().is_replicate()


def test_placements_are_immutable() -> None:
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]


def test_partial_unknown_reduce_type() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Partial("bogus")


@pytest.mark.parametrize("bad", ["a", 1.0, None, True])
def test_shard_needs_int_dim(bad: object) -> None:
    with pytest.raises(TypeError):
        Shard(bad)  # type: ignore[arg-type]


# ---- ProcessMesh -----------------------------------------------------------------------------
def test_mesh_values() -> None:
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    assert mesh.shape == (2, 2) and mesh.shape == [2, 2]
    assert mesh.ndim == 2
    assert mesh.size == 4
    assert mesh.dim_names == ["x", "y"]
    assert list(mesh.process_ids) == [0, 1, 2, 3]
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert 3 in mesh and 4 not in mesh
    assert mesh.coordinate_of(2) == (1, 0) and mesh.coordinate_of(7) is None
    assert mesh.rank_at((0, 1)) == 1


def test_mesh_default_names_and_numpy_input() -> None:
    mesh = ProcessMesh(np.arange(6).reshape(2, 3))
    assert mesh.shape == (2, 3) and len(mesh.dim_names) == 2
    assert len(set(mesh.dim_names)) == 2


def test_mesh_equality_and_hash() -> None:
    a = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    b = ProcessMesh(np.array([[0, 1], [2, 3]]), dim_names=["x", "y"])
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != ProcessMesh([[0, 1], [2, 3]], dim_names=["y", "x"])  # names matter
    assert a != ProcessMesh([[0, 2], [1, 3]], dim_names=["x", "y"])  # layout matters
    assert a != ProcessMesh([0, 1, 2, 3])  # shape matters
    assert a != [[0, 1], [2, 3]]


def test_mesh_dim_size_by_name_and_int() -> None:
    mesh = ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["dp", "mp"])
    assert mesh.get_dim_size("dp") == 2 and mesh.get_dim_size("mp") == 3
    assert mesh.get_dim_size(0) == 2 and mesh.get_dim_size(1) == 3
    assert mesh.get_dim_size(-1) == 3


def test_get_mesh_with_dim() -> None:
    mesh = ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    moved = mesh.get_mesh_with_dim("y")
    assert moved.mesh.tolist() == [[0, 3], [1, 4], [2, 5]]
    assert moved.dim_names == ["y", "x"]
    assert mesh.get_mesh_with_dim("x") == mesh
    stage = mesh.get_mesh_with_dim("y", 1)
    assert stage.mesh.tolist() == [1, 4] and stage.dim_names == ["x"]
    row = mesh.get_mesh_with_dim("x", 1)
    assert row.mesh.tolist() == [3, 4, 5] and row.dim_names == ["y"]
    with pytest.raises(ValueError):
        mesh.get_mesh_with_dim("x", 2)
    with pytest.raises(ValueError):
        mesh.get_mesh_with_dim("z")


def test_get_mesh_with_dim_3d() -> None:
    mesh = ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
    stage1 = mesh.get_mesh_with_dim("pp", 1)
    assert stage1.mesh.tolist() == [[4, 5], [6, 7]] and stage1.dim_names == ["dp", "mp"]
    mp0 = mesh.get_mesh_with_dim("mp", 0)
    assert mp0.mesh.tolist() == [[0, 2], [4, 6]] and mp0.dim_names == ["pp", "dp"]


def test_mesh_int_and_slice_indexing() -> None:
    mesh = ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])
    row = mesh[1]
    assert row.mesh.tolist() == [3, 4, 5] and row.dim_names == ["y"]
    top = mesh[0:1]
    assert top.mesh.tolist() == [[0, 1, 2]] and top.dim_names == ["x", "y"]
    col = mesh[:, 2]
    assert col.mesh.tolist() == [2, 5] and col.dim_names == ["x"]
    sub = mesh[:, 1:]
    assert sub.mesh.tolist() == [[1, 2], [4, 5]] and sub.dim_names == ["x", "y"]
    one = mesh[1, 2]
    assert list(one.process_ids) == [5] and one.ndim == 1


@pytest.mark.parametrize(
    "ranks, names, match",
    [
        ([[0, 1], [2]], None, "ragged"),
        ([[0, 1], [1, 2]], None, r"\[1\]"),
        ([0, 0], None, "more than once"),
        ([0, -1], None, "negative"),
        ([[0, 1], [2, 3]], ["x"], "dim_names"),
        ([0, 1], ["x", "y"], "dim_names"),
        ([[0, 1], [2, 3]], ["x", "x"], "repeat"),
        ([], None, "no ranks"),
    ],
)
def test_mesh_errors(ranks: object, names: list[str] | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProcessMesh(ranks, dim_names=names)


def test_mesh_unknown_axis_name() -> None:
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    with pytest.raises(ValueError, match="'z'"):
        mesh.get_dim_size("z")
    with pytest.raises(ValueError):
        mesh.get_dim_size(2)


# ---- DistSpec: validation --------------------------------------------------------------------
MESH4 = ProcessMesh([0, 1, 2, 3], dim_names=["x"])
MESH22 = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def spec(mesh: ProcessMesh, placements: list, shape: tuple[int, ...], order: tuple = ()) -> DistSpec:
    return DistSpec(mesh, tuple(placements), shape, F32, order)


def test_spec_needs_one_placement_per_axis() -> None:
    with pytest.raises(ValueError, match="placements"):
        spec(MESH22, [Shard(0)], (4, 6))
    with pytest.raises(ValueError, match="placements"):
        spec(MESH4, [R, R], (4, 6))


def test_spec_shard_dim_out_of_range() -> None:
    with pytest.raises(ValueError) as e:
        spec(MESH4, [Shard(3)], (4, 6))
    msg = str(e.value)
    assert "3" in msg and "(4, 6)" in msg
    with pytest.raises(ValueError, match=r"-3"):
        spec(MESH4, [Shard(-3)], (4, 6))
    with pytest.raises(ValueError):
        spec(MESH4, [Shard(0)], ())  # a 0-d tensor has no dim to shard


def test_spec_rejects_non_placements() -> None:
    with pytest.raises(TypeError):
        spec(MESH4, ["S(0)"], (4, 6))


def test_spec_negative_shard_dim_is_normalised() -> None:
    s = spec(MESH4, [Shard(-1)], (4, 6))
    assert s.placements == (Shard(1),)
    assert s == spec(MESH4, [Shard(1)], (4, 6))
    assert hash(s) == hash(spec(MESH4, [Shard(1)], (4, 6)))


def test_spec_shard_order_canonical_and_validated() -> None:
    default = spec(MESH22, [Shard(0), Shard(0)], (8,))
    assert default.shard_order == ()
    assert spec(MESH22, [Shard(0), Shard(0)], (8,), ((0, (0, 1)),)) == default  # default dropped
    swapped = spec(MESH22, [Shard(0), Shard(0)], (8,), ((0, (1, 0)),))
    assert swapped != default and swapped.axes_of_dim(0) == (1, 0)
    with pytest.raises(ValueError):
        spec(MESH22, [Shard(0), R], (8,), ((0, (0, 1)),))  # axis 1 does not shard dim 0
    with pytest.raises(ValueError):
        spec(MESH22, [Shard(0), Shard(0)], (8, 3), ((1, (0, 1)),))  # dim 1 is not sharded


def test_spec_partial_types_must_commute() -> None:
    spec(MESH22, [Partial("sum"), Partial("avg")], (4, 6))
    spec(MESH22, [Partial("max"), Partial("max")], (4, 6))
    with pytest.raises(ValueError, match="max"):
        spec(MESH22, [Partial("max"), Partial("sum")], (4, 6))
    with pytest.raises(ValueError):
        spec(MESH22, [Partial("min"), Partial("max")], (4, 6))


def test_spec_is_hashable_value() -> None:
    a = spec(MESH22, [Shard(0), Partial()], (4, 6))
    b = DistSpec(MESH22, [Shard(0), Partial()], [4, 6], F32)  # lists normalised to tuples
    assert a == b and hash(a) == hash(b)
    assert a.placements == (Shard(0), Partial()) and a.shape == (4, 6)
    assert str(a) == "[S(0), P(sum)] (4, 6)"


# ---- DistSpec: geometry ----------------------------------------------------------------------
def boxes(s: DistSpec) -> list:
    return [s.local_box(c) for c in itertools.product(*(range(n) for n in s.mesh.shape))]


def test_local_box_even_and_uneven() -> None:
    assert boxes(spec(MESH4, [Shard(0)], (8, 3))) == [((2 * i, 2), (0, 3)) for i in range(4)]
    # torch.chunk(10, 4) -> 3, 3, 3, 1
    assert [b[0] for b in boxes(spec(MESH4, [Shard(0)], (10,)))] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    # torch.chunk(6, 4) -> 2, 2, 2 and an empty fourth piece
    assert [b[0][1] for b in boxes(spec(MESH4, [Shard(0)], (6,)))] == [2, 2, 2, 0]
    # torch.chunk(5, 4) -> 2, 2, 1, (empty)
    assert [b[0][1] for b in boxes(spec(MESH4, [Shard(0)], (5,)))] == [2, 2, 1, 0]
    assert spec(MESH4, [Shard(1)], (3, 7)).local_shape((3,)) == (3, 1)
    assert spec(MESH4, [R], (3, 7)).local_shape((2,)) == (3, 7)
    assert spec(MESH4, [Partial()], (3, 7)).local_box((1,)) == ((0, 3), (0, 7))


def test_local_box_smaller_than_mesh_axis() -> None:
    s = spec(MESH4, [Shard(0)], (2, 5))
    assert [s.local_shape((i,)) for i in range(4)] == [(1, 5), (1, 5), (0, 5), (0, 5)]


def test_local_box_zero_size() -> None:
    s = spec(MESH4, [Shard(0)], (0, 5))
    assert [s.local_shape((i,)) for i in range(4)] == [(0, 5)] * 4
    s = spec(MESH22, [Shard(1), Shard(0)], (3, 0))
    assert {s.local_shape(c)[1] for c in itertools.product(range(2), range(2))} == {0}


def test_local_shape_outside_mesh() -> None:
    assert spec(MESH4, [Shard(0)], (8,)).local_shape(None) == (0,)


def test_two_axes_shard_one_dim_default_order() -> None:
    # axis 0 splits first (outer), axis 1 splits each half
    s = spec(MESH22, [Shard(0), Shard(0)], (8, 2))
    assert s.local_box((0, 0))[0] == (0, 2)
    assert s.local_box((0, 1))[0] == (2, 2)
    assert s.local_box((1, 0))[0] == (4, 2)
    assert s.local_box((1, 1))[0] == (6, 2)
    # uneven: 7 -> (4, 3) -> (2, 2), (2, 1)
    s = spec(MESH22, [Shard(0), Shard(0)], (7,))
    assert [b[0] for b in boxes(s)] == [(0, 2), (2, 2), (4, 2), (6, 1)]


def test_two_axes_shard_one_dim_explicit_order() -> None:
    # axis 1 splits first (outer): coordinate (i, j) holds piece 2 * j + i
    s = spec(MESH22, [Shard(0), Shard(0)], (8, 2), ((0, (1, 0)),))
    assert s.local_box((0, 0))[0] == (0, 2)
    assert s.local_box((1, 0))[0] == (2, 2)
    assert s.local_box((0, 1))[0] == (4, 2)
    assert s.local_box((1, 1))[0] == (6, 2)


# ---- brute-force reference -------------------------------------------------------------------
def reference_box(s: DistSpec, coord: tuple[int, ...]) -> list[list[int]]:
    """Global indices held at ``coord`` per tensor dim, by recursive ``torch.chunk``."""
    out = []
    for d, n in enumerate(s.shape):
        idx = torch.arange(n)
        for a in s.axes_of_dim(d):
            pieces = torch.chunk(idx, s.mesh.shape[a]) if idx.numel() else ()
            idx = pieces[coord[a]] if coord[a] < len(pieces) else idx[:0]
        out.append(idx.tolist())
    return out


@st.composite
def specs(draw: st.DrawFn) -> DistSpec:
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    ndim = len(shape)
    reduce_type = draw(st.sampled_from(["sum", "avg", "max", "min"]))  # one per layout
    placement = st.one_of(st.just(R), st.builds(Shard, st.integers(-ndim, ndim - 1)), st.just(Partial(reduce_type)))
    placements = [draw(placement) for _ in mesh_shape]
    order = []
    for d in range(ndim):
        axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == d]
        if len(axes) > 1:
            order.append((d, tuple(draw(st.permutations(axes)))))
    mesh = ProcessMesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape))
    return DistSpec(mesh, tuple(placements), shape, F32, tuple(order))


@settings(max_examples=60, deadline=None)
@given(specs())
def test_local_box_matches_torch_chunk(s: DistSpec) -> None:
    coords = list(itertools.product(*(range(n) for n in s.mesh.shape)))
    held = {}
    for c in coords:
        box = s.local_box(c)
        assert len(box) == s.ndim
        ref = reference_box(s, c)
        for (off, length), idx, size in zip(box, ref, s.shape):
            assert list(range(off, off + length)) == idx, (s, c)
            assert 0 <= off <= size
        assert s.local_shape(c) == tuple(len(i) for i in ref)
        held[c] = box
    # Ranks that differ only on non-shard axes hold the same box; the distinct boxes tile the tensor.
    shard_axes = [a for a, p in enumerate(s.placements) if isinstance(p, Shard)]
    distinct = {tuple(c[a] for a in shard_axes): held[c] for c in coords}
    cover = np.zeros(s.shape, dtype=np.int64)
    for box in distinct.values():
        cover[tuple(slice(o, o + n) for o, n in box)] += 1
    assert (cover == 1).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.lists(st.integers(1, 9), min_size=3, max_size=3),
       st.data())
def test_with_shape_is_the_constructed_spec(shape: list[int], other: list[int], data: object) -> None:
    """``DistSpec.with_shape`` (no re-validation) equals the spec the constructor builds, hash too."""
    mesh = ProcessMesh([[0, 1], [2, 3]])
    ndim = len(shape)
    choice = st.sampled_from([Replicate(), Partial("sum"), Shard(0), Shard(ndim - 1), Shard(-1)])
    placements = (data.draw(choice), data.draw(choice))  # type: ignore[attr-defined]
    orders: list[tuple[tuple[int, tuple[int, ...]], ...]] = [()]
    if all(isinstance(p, Shard) and p.dim % ndim == placements[0].dim % ndim for p in placements):  # type: ignore[attr-defined]
        orders.append(((placements[0].dim % ndim, (1, 0)),))  # type: ignore[attr-defined]
    for order in orders:
        spec = DistSpec(mesh, placements, tuple(shape), torch.float32, order)
        new = tuple(other[:ndim])
        for dtype in (None, torch.bfloat16):
            made = spec.with_shape(new, dtype)
            want = DistSpec(mesh, placements, new, dtype or torch.float32, order)
            assert made == want and hash(made) == hash(want) and made.has_partial == want.has_partial
            assert made.shard_order == want.shard_order and made.placements == want.placements
    with pytest.raises(ValueError, match="rank"):
        DistSpec(mesh, placements, tuple(shape), torch.float32).with_shape((*shape, 2))


def test_evolve_is_replace() -> None:
    """``engine.decide.evolve`` copies a decision like ``dataclasses.replace``."""
    import dataclasses

    from autoparallel.engine.decide import LocalStep, evolve

    mesh = ProcessMesh([0, 1])
    spec = DistSpec(mesh, (Shard(0),), (4, 6), torch.float32)
    step = LocalStep(mesh=mesh, coord=(1,), plans=(None,), in_specs=(spec,), out_specs=(spec,), out_strides=((6, 1),))
    changed = evolve(step, out_strides=((1, 4),), simple=True)
    assert changed == dataclasses.replace(step, out_strides=((1, 4),), simple=True)
    assert step.out_strides == ((6, 1),) and evolve(step) == step
    with pytest.raises(TypeError, match="no fields"):
        evolve(step, nonsense=1)
