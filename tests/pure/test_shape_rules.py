"""Shape ops (split, cat, slice, index, gather, scatter, pad, ...): rules and values.

Pure part: every strategy the rules offer is checked by brute force on a 1-d mesh of 4 ranks
and on a 2x2 mesh — shard the global inputs as the strategy asks (random summands for
Partial), run the op (or its local implementation) on every rank's pieces, and put the local
outputs back together as the strategy claims; the result must be the op on the global inputs,
for every output of multi-output ops. Pinned cases check that the useful strategies are there.

World part: ``tests/world/test_shape_rules_world.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch

from autoparallel import DistSpec, Partial, ProcessMesh, Replicate, Shard
from autoparallel.placement import partials_compatible
from spmd_rules import LocalContext, OpCall, Strategy, TensorMeta, get_local_impl, get_rule
from tests.treeutil import map_tensors, one_thread, tensors_in  # noqa: F401  (one_thread: autouse fixture)

aten = torch.ops.aten
R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P = Partial()
PLACEMENTS = [R, S0, S1, S2, P, Partial("avg"), Partial("max"), Partial("min")]
_GEN = torch.Generator().manual_seed(0)



def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN)


def idx(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_GEN)


def perm_idx(high: int, rows: int, cols: int, dim: int) -> torch.Tensor:
    """An index of shape (rows, cols) without repeats along ``dim`` (for overwriting scatters)."""
    n = cols if dim == 1 else rows
    lines = [torch.randperm(high, generator=_GEN)[:n] for _ in range(rows if dim == 1 else cols)]
    t = torch.stack(lines)
    return t if dim == 1 else t.t().contiguous()


# ---- building calls --------------------------------------------------------------------------


def _outs(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def run_op(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The op on fresh copies (in-place ops must not write the test's tensors)."""
    args, kwargs = map_tensors(args, torch.clone), map_tensors(kwargs, torch.clone)
    return _outs(op(*args, **kwargs))


def make_call(op: Any, args: tuple, placements: list, mesh_shape: tuple[int, ...], kwargs: dict | None = None) -> OpCall:
    kwargs = kwargs or {}
    outs = run_op(op, args, kwargs)
    inputs = tensors_in(args) + tensors_in(kwargs)
    assert len(placements) == len(inputs)
    metas = {id(t): TensorMeta(tuple(t.shape), t.dtype) for t in inputs}
    return OpCall(
        op,
        map_tensors(args, lambda t: metas[id(t)]),
        map_tensors(kwargs, lambda t: metas[id(t)]),
        tuple(metas[id(t)] for t in inputs),
        tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outs),
        tuple(tuple(p) for p in placements),
        mesh_shape,
    )


def strategies(call: OpCall) -> list[Strategy]:
    rule = get_rule(call.op)
    assert rule is not None, call.op
    return list(rule(call))


def offers(op: Any, args: tuple, inputs: list, outputs: list, kwargs: dict | None = None) -> bool:
    """Whether the rule offers inputs -> outputs on a 1-d mesh of 2 (one placement each)."""
    call = make_call(op, args, [(p,) for p in inputs], (2,), kwargs)
    want = Strategy(tuple((p,) for p in inputs), tuple((p,) for p in outputs))
    return want in strategies(call)


def outputs_for(op: Any, args: tuple, inputs: list, kwargs: dict | None = None) -> list[tuple]:
    call = make_call(op, args, [(p,) for p in inputs], (2,), kwargs)
    key = tuple((p,) for p in inputs)
    return [s.outputs for s in strategies(call) if s.inputs == key]


# ---- brute force on any mesh -----------------------------------------------------------------
def _coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def _split(x: torch.Tensor, t: str, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n pieces reducing (by ``t``) to ``x``."""
    noise = [torch.randint(-4, 5, x.shape, generator=gen).to(x.dtype) for _ in range(n)]
    if t == "sum":
        return [x - sum(noise[1:])] + noise[1:]
    if t == "avg":
        mean = sum(noise) / n
        return [x + e - mean for e in noise]
    sign = -1 if t == "max" else 1
    return [x] + [x + sign * e.abs() for e in noise[1:]]


def local_pieces(x: torch.Tensor, pl: tuple, mesh: ProcessMesh, gen: torch.Generator) -> dict:
    """Per mesh coordinate, the local tensor of ``x`` laid out by ``pl`` (Partial: random summands)."""
    mesh_shape = tuple(mesh.shape)
    partial_axes = [a for a, p in enumerate(pl) if isinstance(p, Partial)]
    values: dict[tuple, torch.Tensor] = {(): x}
    for a in partial_axes:  # a tree of splits: reducing siblings gives the parent
        values = {k + (c,): v for k, parent in values.items()
                  for c, v in enumerate(_split(parent, pl[a].reduce_type, mesh_shape[a], gen))}
    spec = DistSpec(mesh, pl, tuple(x.shape), x.dtype)
    out = {}
    for coord in _coords(mesh_shape):
        piece = values[tuple(coord[a] for a in partial_axes)]
        for d, (off, length) in enumerate(spec.local_box(coord)):
            piece = piece.narrow(d, off, length)
        out[coord] = piece.clone()
    return out


def assemble(pieces: dict, pl: tuple, shape: tuple, mesh: ProcessMesh) -> torch.Tensor:
    """The global tensor the local ``pieces`` stand for under ``pl`` (checks Replicate agreement)."""
    reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}
    for a, p in enumerate(pl):
        if isinstance(p, Partial):
            groups: dict[tuple, list[torch.Tensor]] = {}
            for coord, v in pieces.items():
                groups.setdefault(coord[:a] + (0,) + coord[a + 1:], []).append(v)
            pieces = {k: reduce[p.reduce_type](torch.stack(vs), 0) for k, vs in groups.items()}
    some = next(iter(pieces.values()))
    full = torch.zeros(shape, dtype=some.dtype)
    written = torch.zeros(shape, dtype=torch.bool)
    spec = DistSpec(mesh, pl, shape, some.dtype)
    for coord, v in pieces.items():
        region = tuple(slice(o, o + n) for o, n in spec.local_box(coord))
        assert tuple(v.shape) == tuple(full[region].shape), (pl, coord, v.shape)
        old = written[region]
        assert _same(v[old], full[region][old]), f"replicas differ under {pl}"
        full[region] = v
        written[region] = True
    assert bool(written.all()), f"{pl} leaves elements unwritten"
    return full


def check_strategy(op: Any, args: tuple, kwargs: dict, s: Strategy, mesh: ProcessMesh, gen: torch.Generator) -> None:
    inputs = tensors_in(args) + tensors_in(kwargs)
    expected = run_op(op, args, kwargs)
    call = make_call(op, args, list(s.inputs), tuple(mesh.shape), kwargs)
    pieces = [local_pieces(t, pl, mesh, gen) for t, pl in zip(inputs, s.inputs)]
    in_specs = tuple(DistSpec(mesh, pl, tuple(t.shape), t.dtype) for t, pl in zip(inputs, s.inputs))
    out_specs = tuple(DistSpec(mesh, pl, tuple(o.shape), o.dtype) for o, pl in zip(expected, s.outputs))
    impl = get_local_impl(op)
    local_outs: list[dict] = [{} for _ in expected]
    for coord in _coords(tuple(mesh.shape)):
        it = iter([pc[coord] for pc in pieces])
        largs = map_tensors(args, lambda _t: next(it))
        lkwargs = map_tensors(kwargs, lambda _t: next(it))
        if impl is None:
            res = _outs(op(*largs, **lkwargs))
        else:
            shapes = tuple(sp.local_shape(coord) for sp in out_specs)
            res = _outs(impl(LocalContext(call, shapes, in_specs, out_specs, coord), *largs, **lkwargs))
        for i, r in enumerate(res):
            local_outs[i][coord] = r
    for i, (e, pl) in enumerate(zip(expected, s.outputs)):
        got = assemble(local_outs[i], pl, tuple(e.shape), mesh)
        assert _same(got, e), f"{op} {s} output {i}:\n{got}\n!=\n{e}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _mesh(mesh_shape: tuple[int, ...]) -> ProcessMesh:
    return ProcessMesh(np.arange(math.prod(mesh_shape)).reshape(mesh_shape))


def _fits(p: Any, t: torch.Tensor) -> bool:
    if isinstance(p, Shard):
        return p.dim < t.ndim
    return not isinstance(p, Partial) or t.is_floating_point()


def offered(op: Any, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> set[Strategy]:
    """Every strategy offered when any one input currently has any placement on any axis."""
    inputs = tensors_in(args) + tensors_in(kwargs)
    seen: set[Strategy] = set()
    base = [(R,) * len(mesh_shape) for _ in inputs]
    seen.update(strategies(make_call(op, args, base, mesh_shape, kwargs)))
    for i, t in enumerate(inputs):
        for a in range(len(mesh_shape)):
            for p in PLACEMENTS:
                if not _fits(p, t):
                    continue
                cur = list(base)
                cur[i] = tuple(p if b == a else R for b in range(len(mesh_shape)))
                seen.update(strategies(make_call(op, args, cur, mesh_shape, kwargs)))
    for s in seen:  # well-formed: one placement per axis for each input and output
        assert len(s.inputs) == len(inputs) and all(len(p) == len(mesh_shape) for p in s.inputs + s.outputs)
        assert all(partials_compatible(p) for p in s.inputs + s.outputs)
    return seen


def _fill(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


BRUTE: list[tuple[str, Any, tuple, dict]] = [
    ("split", aten.split.Tensor, (rnd(5, 4, 3), 2, 1), {}),
    ("split-dim0", aten.split.Tensor, (rnd(7, 3), 3), {}),
    ("split_with_sizes", aten.split_with_sizes.default, (rnd(5, 4), [1, 3], 1), {}),
    ("split_with_sizes-neg", aten.split_with_sizes.default, (rnd(5, 4), [2, 3], -2), {}),
    ("unbind", aten.unbind.int, (rnd(3, 5, 2), 1), {}),
    ("cat-1", aten.cat.default, ([rnd(5, 3), rnd(5, 2)], 1), {}),
    ("cat-0", aten.cat.default, ([rnd(2, 4), rnd(3, 4), rnd(1, 4)], 0), {}),
    ("cat-legacy-empty", aten.cat.default, ([rnd(4, 3), torch.empty(0), rnd(4, 2)], 1), {}),
    ("cat-onto-empty", aten.cat.default, ([torch.empty(0), rnd(2, 5, 3)], 1), {}),  # a cache's first cat
    ("cat-onto-empty-3d", aten.cat.default, ([rnd(2, 0, 3), rnd(2, 5, 3)], 1), {}),
    ("stack", aten.stack.default, ([rnd(5, 3), rnd(5, 3)], 1), {}),
    ("stack-last", aten.stack.default, ([rnd(5, 3), rnd(5, 3), rnd(5, 3)], -1), {}),
    ("slice", aten.slice.Tensor, (rnd(6, 5), 1, 1, 4), {}),
    ("slice-whole", aten.slice.Tensor, (rnd(6, 5), 0, 0, 6), {}),
    ("slice-step", aten.slice.Tensor, (rnd(6, 5), 0, 1, 6, 2), {}),
    ("select", aten.select.int, (rnd(4, 5, 3), 1, 2), {}),
    ("select-neg", aten.select.int, (rnd(4, 5, 3), -1, -1), {}),
    ("slice_backward", aten.slice_backward.default, (rnd(6, 3), [6, 5], 1, 1, 4, 1), {}),
    ("slice_backward-whole", aten.slice_backward.default, (rnd(6, 5), [6, 5], 0, 0, 6, 1), {}),
    ("select_backward", aten.select_backward.default, (rnd(4, 3), [4, 5, 3], 1, 2), {}),
    ("slice_scatter", aten.slice_scatter.default, (rnd(6, 5), rnd(6, 3), 1, 1, 4), {}),
    ("select_scatter", aten.select_scatter.default, (rnd(4, 5), rnd(4), 1, 2), {}),
    ("flip", aten.flip.default, (rnd(5, 4, 3), [0, 2]), {}),
    ("roll", aten.roll.default, (rnd(5, 4), [2], [1]), {}),
    ("roll-flat", aten.roll.default, (rnd(5, 4), [3]), {}),
    ("roll-two", aten.roll.default, (rnd(5, 4, 3), [1, -2], [0, 2]), {}),
    ("tril", aten.tril.default, (rnd(5, 6),), {}),
    ("tril-k", aten.tril.default, (rnd(7, 5), 1), {}),
    ("triu-batch", aten.triu.default, (rnd(3, 5, 6), -2), {}),
    ("tril_", aten.tril_.default, (rnd(6, 7), -1), {}),
    ("pad", aten.constant_pad_nd.default, (rnd(5, 4), [1, 2]), {}),
    ("pad-value", aten.constant_pad_nd.default, (rnd(5, 4, 3), [0, 0, 1, 1], 1.5), {}),
    ("pad-crop", aten.constant_pad_nd.default, (rnd(5, 4), [-1, 0]), {}),
    ("repeat", aten.repeat.default, (rnd(5, 4), [1, 2]), {}),
    ("repeat-lead", aten.repeat.default, (rnd(5, 4), [2, 1, 1]), {}),
    ("index_select", aten.index_select.default, (rnd(5, 4), 0, idx(5, 6)), {}),
    ("index_select-1", aten.index_select.default, (rnd(5, 4), 1, idx(4, 3)), {}),
    ("index_add", aten.index_add.default, (rnd(5, 4), 0, idx(5, 6), rnd(6, 4)), {}),
    ("index_add-alpha", aten.index_add.default, (rnd(5, 4), 1, idx(4, 5), rnd(5, 5)), {"alpha": 2.0}),
    ("gather", aten.gather.default, (rnd(5, 4), 1, idx(4, 5, 3)), {}),
    ("gather-0", aten.gather.default, (rnd(5, 4), 0, idx(5, 3, 4)), {}),
    ("gather-small", aten.gather.default, (rnd(5, 4), 1, idx(4, 4, 3)), {}),
    ("scatter_add", aten.scatter_add.default, (rnd(5, 4), 1, idx(4, 5, 3), rnd(5, 3)), {}),
    ("scatter_add-0", aten.scatter_add.default, (rnd(5, 4), 0, idx(5, 6, 4), rnd(6, 4)), {}),
    ("scatter_add-bigsrc", aten.scatter_add.default, (rnd(5, 4), 0, idx(5, 3, 4), rnd(4, 4)), {}),
    ("scatter_add_", aten.scatter_add_.default, (rnd(5, 4), 1, idx(4, 5, 3), rnd(5, 3)), {}),
    ("scatter-src", aten.scatter.src, (rnd(5, 4), 1, perm_idx(4, 5, 2, 1), rnd(5, 2)), {}),
    ("scatter-value0", aten.scatter.value, (rnd(5, 4), 1, idx(4, 5, 2), 0.0), {}),
    ("scatter-value", aten.scatter.value, (rnd(5, 4), 0, idx(5, 3, 4), 2.0), {}),
    ("scatter_reduce", aten.scatter_reduce.two, (rnd(5, 4), 1, idx(4, 5, 3), rnd(5, 3), "amax"), {}),
    ("index", aten.index.Tensor, (rnd(5, 4, 3), [idx(5, 6)]), {}),
    ("index-mid", aten.index.Tensor, (rnd(5, 4, 3), [None, idx(4, 2, 3)]), {}),
    ("index-apart", aten.index.Tensor, (rnd(5, 4, 3), [idx(5, 6), None, idx(3, 6)]), {}),
    ("index-bcast", aten.index.Tensor, (rnd(5, 4, 3), [idx(5, 2, 1), idx(4, 1, 3)]), {}),
    ("index_put-acc", aten.index_put.default, (rnd(5, 4, 3), [idx(5, 6)], rnd(6, 4, 3), True), {}),
    ("index_put-acc-mid", aten.index_put.default, (rnd(5, 4, 3), [None, idx(4, 3)], rnd(5, 3, 3), True), {}),
    ("index_put-acc-bcast-v", aten.index_put.default, (rnd(5, 4, 3), [idx(5, 2, 1), idx(4, 1, 3)], rnd(3, 3), True), {}),
    ("index_put-set", aten.index_put.default, (rnd(5, 4, 3), [torch.tensor([4, 0, 2])], rnd(3, 4, 3)), {}),
    ("index_put_", aten.index_put_.default, (rnd(5, 4, 3), [None, torch.tensor([3, 1])], rnd(5, 2, 3), True), {}),
    ("new_zeros-index_put", aten.index_put.default, (_fill(6, 4), [idx(6, 7)], rnd(7, 4), True), {}),
    ("new_zeros-same", aten.new_zeros.default, (rnd(6, 4), [6, 4]), {}),
    ("new_full-same", aten.new_full.default, (rnd(5, 3), [5, 3], 2.5), {}),
    ("new_ones-other", aten.new_ones.default, (rnd(6, 4), [3, 4]), {}),
    ("new_ones-more-dims", aten.new_ones.default, (rnd(6, 4), [6, 4, 2]), {}),
]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
@pytest.mark.parametrize("name, op, args, kwargs", BRUTE, ids=[c[0] for c in BRUTE])
def test_offered_strategies_are_exact(name: str, op: Any, args: tuple, kwargs: dict, mesh_shape: tuple) -> None:
    gen = torch.Generator().manual_seed(1)
    mesh = _mesh(mesh_shape)
    seen = offered(op, args, kwargs, mesh_shape)
    assert seen
    for s in sorted(seen, key=str):
        check_strategy(op, args, kwargs, s, mesh, gen)


# ---- pinned strategies -----------------------------------------------------------------------
X = rnd(5, 4)


def test_new_tensors_are_replicated() -> None:
    # even of x's shape: the writes that follow (``buf[0] = v``) may slice a sharded dim, which a
    # sharded buffer could not take (tests/world/test_factory_random.py::test_new_tensors_take_writes_through_any_view)
    assert outputs_for(aten.new_zeros.default, (X, [5, 4]), [S0]) == [((R,),)]
    assert outputs_for(aten.new_full.default, (X, [5, 4], 1.0), [S1]) == [((R,),)]
    assert outputs_for(aten.new_zeros.default, (X, [5, 4]), [P]) == [((R,),)]
    assert outputs_for(aten.new_empty_strided.default, (X, [5, 4], [4, 1]), [S0]) == [((R,),)]


def test_split_keeps_other_dims_and_partial() -> None:
    assert offers(aten.split.Tensor, (X, 2, 1), [S0], [S0, S0])
    assert offers(aten.split.Tensor, (X, 2, 1), [P], [P, P])
    assert offers(aten.split.Tensor, (X, 2, 1), [Partial("max")], [Partial("max")] * 2)
    assert outputs_for(aten.split.Tensor, (X, 2, 1), [S1]) == []  # the split dim replicates
    assert offers(aten.unbind.int, (X, 0), [S1], [S0] * 5)


def test_cat_and_stack_need_all_inputs_alike() -> None:
    a, b = rnd(5, 3), rnd(5, 2)
    assert offers(aten.cat.default, ([a, b], 1), [S0, S0], [S0])
    assert offers(aten.cat.default, ([a, b], 1), [P, P], [P])
    assert outputs_for(aten.cat.default, ([a, b], 1), [S1, S1]) == []
    assert outputs_for(aten.cat.default, ([a, b], 1), [P, R]) == []
    assert offers(aten.stack.default, ([a, a], 0), [S1, S1], [S2])


def test_slice_select_need_replicated_dim() -> None:
    assert offers(aten.slice.Tensor, (X, 1, 1, 3), [S0], [S0])
    assert outputs_for(aten.slice.Tensor, (X, 1, 1, 3), [S1]) == []
    assert offers(aten.slice.Tensor, (X, 1, 0, 4), [S1], [S1])  # the whole dim: identity
    assert offers(aten.select.int, (X, 0, 2), [S1], [S0])
    assert offers(aten.slice_backward.default, (rnd(5, 2), [5, 4], 1, 1, 3, 1), [S0], [S0])
    assert offers(aten.select_backward.default, (rnd(4), [5, 4], 0, 1), [S0], [S1])


def test_pad_keeps_sum_partial_only_for_zero() -> None:
    assert offers(aten.constant_pad_nd.default, (X, [1, 1]), [P], [P])
    assert outputs_for(aten.constant_pad_nd.default, (X, [1, 1], 1.0), [P]) == []
    assert offers(aten.constant_pad_nd.default, (X, [1, 1], 1.0), [Partial("avg")], [Partial("avg")])
    assert offers(aten.constant_pad_nd.default, (X, [1, 1]), [S0], [S0])
    assert outputs_for(aten.constant_pad_nd.default, (X, [1, 1]), [S1]) == []


def test_tril_keeps_any_shard() -> None:
    assert offers(aten.tril.default, (X,), [S0], [S0]) and offers(aten.tril.default, (X,), [S1], [S1])


def test_index_ops_shard_the_index() -> None:
    i = idx(5, 6)
    assert offers(aten.index_select.default, (X, 0, i), [R, S0], [S0])
    assert offers(aten.index_select.default, (X, 0, i), [S1, R], [S1])
    assert outputs_for(aten.index_select.default, (X, 0, i), [S0, R]) == []
    # the gradient of index_select with a sharded index: every rank adds its rows into P(sum)
    assert offers(aten.index_add.default, (X, 0, i, rnd(6, 4)), [P, S0, S0], [P])
    assert offers(aten.index.Tensor, (X, [i]), [R, S0], [S0])
    assert offers(aten.index.Tensor, (X, [i]), [S1, R], [S1])
    assert offers(aten.index_put.default, (X, [i], rnd(6, 4), True), [P, S0, S0], [P])
    assert outputs_for(aten.index_put.default, (X, [i], rnd(6, 4)), [P, S0, S0]) == []  # overwrite


def test_gather_scatter_positional_dims_line_up() -> None:
    i = idx(4, 5, 3)
    assert offers(aten.gather.default, (X, 1, i), [S0, S0], [S0])
    assert offers(aten.gather.default, (X, 1, i), [R, S1], [S1])
    assert outputs_for(aten.gather.default, (X, 1, i), [S1, S1]) == []
    small = idx(4, 3, 3)  # index rows 0-2 of x's 5: pieces would not line up
    assert outputs_for(aten.gather.default, (X, 1, small), [S0, S0]) == []
    assert offers(aten.scatter_add.default, (X, 1, i, rnd(5, 3)), [P, S1, S1], [P])
    assert offers(aten.scatter.value, (X, 1, i, 0.0), [P, R], [P])
    assert outputs_for(aten.scatter.value, (X, 1, i, 1.0), [P, R]) == []
    assert outputs_for(aten.scatter.src, (X, 1, i, rnd(5, 3)), [P, R, P]) == []


def test_as_strided_is_left_to_the_fallback() -> None:
    assert get_rule(aten.as_strided.default) is None
