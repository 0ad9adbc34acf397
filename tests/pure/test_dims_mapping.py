"""Pure tests of Paddle's static layout form: a dims mapping (one mesh-axis name or None per
tensor dim) -> placements (one per mesh axis), and the errors that name what is wrong.

No processes: a mesh built without a world is metadata only, and the conversion reads only it.
"""

from __future__ import annotations

import itertools

import pytest

from autoparallel import ProcessMesh, Replicate, Shard
from autoparallel.api import dims_mapping_to_placements, is_dims_mapping

R = Replicate()
MESH2 = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


@pytest.mark.parametrize("mapping,shape,placements", [
    ([None, "mp"], (4, 6), (R, Shard(1))),
    (["mp", None], (4, 6), (R, Shard(0))),
    (["dp", "mp"], (4, 6), (Shard(0), Shard(1))),
    (["mp", "dp"], (4, 6), (Shard(1), Shard(0))),
    ([None, None], (4, 6), (R, R)),
    ([None, None, "dp"], (2, 3, 4), (Shard(2), R)),
    (["mp"], (8,), (R, Shard(0))),
])
def test_a_dims_mapping_becomes_one_placement_per_mesh_axis(mapping: list[str | None], shape: tuple[int, ...],
                                                            placements: tuple[object, ...]) -> None:
    assert dims_mapping_to_placements(mapping, MESH2, shape) == placements


def test_every_mapping_of_a_small_mesh_against_a_reference() -> None:
    """Every mapping of a 3-d tensor on the 2-d mesh: mesh axis a is Shard(d) exactly where
    mapping[d] names a (each axis used at most once)."""
    for mapping in itertools.product([None, "dp", "mp"], repeat=3):
        used = [e for e in mapping if e is not None]
        if len(used) != len(set(used)):
            continue
        got = dims_mapping_to_placements(list(mapping), MESH2, (2, 2, 2))
        for a, name in enumerate(MESH2.dim_names):
            want = Shard(mapping.index(name)) if name in mapping else R
            assert got[a] == want, (mapping, got)


def test_default_axis_names_work_too() -> None:
    mesh = ProcessMesh([0, 1, 2, 3])  # axis "d0"
    assert dims_mapping_to_placements(["d0", None], mesh, (4, 4)) == (Shard(0),)


@pytest.mark.parametrize("layout,expected", [
    ([None, "mp"], True),
    ([None, None], True),       # all None: fully replicated, still a dims mapping
    (["mp"], True),
    ([Shard(0)], False),
    ([R, Shard(1)], False),
    ([], False),                # nothing to tell apart: placements, padded with Replicate
    ([Shard(0), None], True),   # a mix: refused by the conversion
])
def test_the_two_forms_are_told_apart_by_their_elements(layout: list[object], expected: bool) -> None:
    assert is_dims_mapping(layout) is expected


@pytest.mark.parametrize("mapping,shape,text", [
    ([None], (4, 6), "dims mapping [None] has 1 entries for a 2-d tensor of shape (4, 6)"),
    ([None, "mp", None], (4, 6), "has 3 entries for a 2-d tensor"),
    (["pp", None], (4, 6), "names mesh axis 'pp', which mesh ProcessMesh([[0, 1], [2, 3]], dim_names=['dp', 'mp']) "
                           "lacks; its axes are ['dp', 'mp']"),
    (["mp", "mp"], (4, 6), "uses mesh axis 'mp' for tensor dims [0, 1]"),
    ([Shard(0), None], (4, 6), "mixes placements [Shard(0)] with mesh-axis names/None"),
    (["mp", R], (4, 6), "mixes placements [Replicate()] with mesh-axis names/None"),
    ([0, None], (4, 6), "holds [0], neither a mesh-axis name (str) nor None"),
])
def test_bad_mappings_name_the_values(mapping: list[object], shape: tuple[int, ...], text: str) -> None:
    with pytest.raises(ValueError) as info:
        dims_mapping_to_placements(mapping, MESH2, shape)  # type: ignore[arg-type]  # bad on purpose
    assert text in str(info.value), str(info.value)
    assert str(info.value).startswith("shard_tensor: ")
