"""World part of ``tests/pure/test_shape_rules.py``: shape ops against plain torch.

One 4-rank gloo world runs every op on DistTensors (mesh [0,1,2,3] and
[[0,1],[2,3]], Replicate / Shard on each dim / uneven sizes / Partial) and compares forward
values and gradients with plain torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autoparallel as ap
from autoparallel import ProcessMesh, Shard
from tests.pure.test_shape_rules import S0, P, R, _outs, perm_idx
from tests.treeutil import one_thread  # noqa: F401  (one_thread: autouse fixture)


# ---- the 4-rank world ------------------------------------------------------------------------
def _meshes() -> list[ProcessMesh]:
    return [ProcessMesh([0, 1, 2, 3], ["x"]), ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])]


def _layouts(ndim: int, mesh: ProcessMesh, inner: bool) -> list[tuple]:
    """Layouts of the float inputs: replicated, each dim sharded, Partial; mixes on 2-d.

    ``inner=False`` leaves out shards of dims other than 0 (see ``test_flatten_of_inner_shard``).
    """
    dims = range(ndim) if inner else range(1)
    if mesh.ndim == 1:
        return [(R,)] + [(Shard(d),) for d in dims] + [(P,)]
    last = ndim - 1 if inner else 0
    return [(Shard(0), Shard(last)), (Shard(last), P), (Shard(0), Shard(0))]


Case = tuple[str, Callable[..., Any], list[torch.Tensor], list[torch.Tensor]]


def _cases() -> list[Case]:
    """(name, fn(*floats, *indices), float inputs, index inputs). Float sizes are uneven over 4."""
    g = torch.Generator().manual_seed(7)

    def f(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    def i(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=g)

    x = f(5, 6)
    return [
        ("split", lambda a: a.split(2, 1), [x], []),
        ("split_sizes", lambda a: torch.split(a, [2, 3], 0), [x], []),
        ("chunk", lambda a: a.chunk(3, 1), [x], []),
        ("unbind", lambda a: a.unbind(1), [f(5, 3)], []),
        ("cat", lambda a, b: torch.cat([a, b], 1), [x, f(5, 3)], []),
        ("cat0", lambda a, b: torch.cat([a, b], 0), [x, f(2, 6)], []),
        ("stack", lambda a, b: torch.stack([a, b], 1), [x, f(5, 6)], []),
        ("slice", lambda a: a[1:4, ::2], [x], []),
        ("narrow", lambda a: a.narrow(1, 2, 3), [x], []),
        ("select", lambda a: a[:, 2], [x], []),
        ("unflatten", lambda a: a.unflatten(1, (3, 2)), [x], []),
        ("roll", lambda a: a.roll(2, 1), [x], []),
        ("flip", lambda a: a.flip(0), [x], []),
        ("tril", lambda a: a.tril(1), [f(7, 5)], []),
        ("triu", lambda a: a.triu(-1), [f(5, 7)], []),
        ("pad", lambda a: F.pad(a, (1, 2)), [x], []),
        ("pad3", lambda a: F.pad(a, (1, 1), value=0.5), [f(3, 5, 2)], []),
        ("repeat", lambda a: a.repeat(1, 2), [x], []),
        ("index_select", lambda a, j: a.index_select(0, j), [x], [i(5, 7)]),
        ("gather", lambda a, j: a.gather(1, j), [x], [i(6, 5, 3)]),
        ("scatter_add", lambda a, b, j: a.scatter_add(1, j, b), [x, f(5, 3)], [i(6, 5, 3)]),
        ("scatter", lambda a, b, j: a.scatter(1, j, b), [x, f(5, 2)], [perm_idx(6, 5, 2, 1)]),
        ("index", lambda a, j: a[j], [x], [i(5, 7)]),
        ("index_col", lambda a, j: a[:, j], [x], [i(6, 5)]),
        ("index_put", lambda a, b, j: a.index_put((j,), b, accumulate=True), [x, f(7, 6)], [i(5, 7)]),
        ("setitem", _setitem, [x], [i(5, 3)]),
        ("tril_", lambda a: (a * 1).tril_(), [f(7, 5)], []),
    ]


def _setitem(a: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``z[j] = 0.5``: index_put_ with a plain 0-dim value, in place on a non-leaf."""
    z = a * 1
    z[j] = 0.5
    return z


def _flatten_cases() -> list[Case]:
    return [("flatten", lambda a: a.flatten(), [reference_tensor((4, 3, 2))], [])]


def reference_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(13))


def _index_layouts(mesh: ProcessMesh) -> list[tuple]:
    return [(R,) * mesh.ndim, (Shard(0),) + (R,) * (mesh.ndim - 1)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _check_cases(cases: list[Case], inner: bool) -> list[str]:
    """Every case on both meshes and its layouts: forward values and gradients vs plain torch."""
    from tests.layouts import make_dist

    failures: list[str] = []
    g = torch.Generator().manual_seed(11)
    for mesh in _meshes():
        for name, fn, floats, ints in cases:
            ref_in = [t.clone().requires_grad_(True) for t in floats]
            ref_out = _outs(fn(*ref_in, *ints))
            weights = [torch.randn(o.shape, generator=g) for o in ref_out]
            sum(((o * w).sum() for o, w in zip(ref_out, weights)), torch.zeros(())).backward()
            lays = _layouts(min(t.ndim for t in floats), mesh, inner)
            for lay, ilay in itertools.product(lays, _index_layouts(mesh) if ints else [()]):
                what = f"{name} {list(mesh.shape)} {lay} {ilay}"
                try:
                    dx = [make_dist(t, mesh, lay).requires_grad_(True) for t in floats]
                    di = [make_dist(t, mesh, ilay) for t in ints]
                    out = _outs(fn(*dx, *di))
                    if len(out) != len(ref_out) or not all(_close(o.full_tensor(), r) for o, r in zip(out, ref_out)):
                        failures.append(f"{what}: forward differs")
                        continue
                    dw = [make_dist(w, mesh, (R,) * mesh.ndim) for w in weights]
                    sum((o * w).sum() for o, w in zip(out, dw)).backward()
                    for k, (d, r) in enumerate(zip(dx, ref_in)):
                        if d.grad is None or not _close(d.grad.full_tensor(), r.grad):
                            failures.append(f"{what}: gradient of input {k} differs")
                except Exception as e:  # noqa: BLE001  (collect every failure, report them all)
                    failures.append(f"{what}: {type(e).__name__}: {e}")
    return failures


def _stays_local() -> dict[str, Any]:
    """Untouched sharded dims, Partial and sharded indices need no communication."""
    from tests.layouts import make_dist

    mesh = ProcessMesh([0, 1, 2, 3], ["x"])
    a = reference_tensor((6, 5))
    seen = {}
    d0, dp = make_dist(a, mesh, (Shard(0),)), make_dist(a, mesh, (P,))
    j = make_dist(torch.tensor([4, 0, 0, 3, 1, 2, 4]), mesh, (Shard(0),))
    for name, fn, src in [
        ("split", lambda t: t.split(2, 1)[1], d0), ("slice", lambda t: t[:, 1:3], d0),
        ("select", lambda t: t[:, 1], d0), ("pad", lambda t: F.pad(t, (1, 1)), d0),
        ("tril", lambda t: t.tril(), d0), ("partial-flip", lambda t: t.flip(1), dp),
        ("partial-slice", lambda t: t[2:5], dp), ("index", lambda t: t[j], make_dist(a, mesh, (R,))),
    ]:
        with ap.CommDebugMode() as comm:
            out = fn(src)
        seen[name] = (comm.get_total_counts(), list(out.placements))
    return seen


def _shape_ops_world(rank: int) -> dict[str, Any]:
    """All world checks in one call: value failures, ops that fell back, communication counts."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failures = _check_cases(_cases(), inner=True) + _check_cases(_flatten_cases(), inner=False)
    fallbacks = sorted({str(w.message).split(" runs replicated")[0] for w in caught if "runs replicated" in str(w.message)})
    return {"failures": failures, "fallbacks": fallbacks, "local": _stays_local()}


@pytest.fixture(scope="module")
def world_results(world4) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    results = world4.run(_shape_ops_world, timeout=600)
    assert all(r == results[0] for r in results[1:]), "ranks disagree"
    return results[0]


def test_shape_ops_match_torch_on_four_ranks(world_results: dict[str, Any]) -> None:
    assert world_results["failures"] == [], "\n".join(world_results["failures"])


def test_shape_ops_run_by_rules_not_fallback(world_results: dict[str, Any]) -> None:
    assert world_results["fallbacks"] == []


def test_untouched_dims_need_no_communication(world_results: dict[str, Any]) -> None:
    assert world_results["local"] == {
        "split": (0, [S0]), "slice": (0, [S0]), "select": (0, [S0]), "pad": (0, [S0]),
        "tril": (0, [S0]), "partial-flip": (0, [P]), "partial-slice": (0, [P]), "index": (0, [S0]),
    }


def _flatten_inner(rank: int) -> list[str]:
    return _check_cases(_flatten_cases(), inner=True)


def test_flatten_of_inner_shard(world4) -> None:  # type: ignore[no-untyped-def]
    assert world4.run(_flatten_inner)[0] == []
