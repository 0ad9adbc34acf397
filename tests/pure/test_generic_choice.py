"""Shape-generic decisions (``autoparallel.engine.generic``): a strategy stored at one shape of a
signature is the one a fresh decision picks at any other shape of it, and an output known from
an op's definition is the one its meta kernel gives.

Random calls of a few op families (broadcasting pointwise, matmul, linear, reductions, softmax,
layer norm) on random meshes and placements; each size is either exact (1, 2, 3, 5: uneven and
size-1 cases) or generic (a multiple of the mesh's size, or any size from its square on: an odd
sequence length). Two instances of one template share a
signature; wherever the first's choice would be stored, the second's fresh choice must equal it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel.engine import generic
from autoparallel.engine.decide import _generic_best
from autoparallel.engine.generic import choice_key
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.spec import DistSpec
from reshard.choice import cheapest
from spmd_rules.base import OpCall, TensorMeta
from spmd_rules.registry import get_rule

aten = torch.ops.aten
# op, the input shapes as letters (a shared letter is one size), extra arguments after the tensors
TEMPLATES: list[tuple[Any, tuple[str, ...], tuple[Any, ...]]] = [
    (aten.add.Tensor, ("ab", "ab"), ()),
    (aten.mul.Tensor, ("abc", "1c"), ()),
    (aten.mul.Tensor, ("abc", "b1"), ()),
    (aten.mm.default, ("ab", "bc"), ()),
    (aten.bmm.default, ("abc", "acd"), ()),
    (aten.addmm.default, ("c", "ab", "bc"), ()),
    (aten.sum.dim_IntList, ("abc",), ([1],)),
    (aten._softmax.default, ("abc",), (2, False)),
    (aten.native_layer_norm.default, ("abc", "c", "c"), ([None], 1e-5)),
    (aten.gelu.default, ("abc",), ()),
    (aten.t.default, ("ab",), ()),
    (aten.transpose.int, ("abc",), (0, 2)),
    (aten.mean.dim, ("abc",), ([-1], True)),
    (aten.sub.Tensor, ("abc", "c"), ()),
    (aten.embedding.default, ("ab", "cd"), ()),
    (aten.embedding_dense_backward.default, ("abc", "ab"), (None, -1, False)),  # num_weights: size c
]
EXACT = (1, 2, 3, 5)


def _dtype(op: Any, i: int) -> torch.dtype:
    if op is aten.where.self and i == 0:
        return torch.bool
    if op in (aten.embedding.default, aten.embedding_dense_backward.default) and i == 1:
        return torch.long  # the indices
    return torch.float32


def _placement(draw: Any, ndim: int) -> Any:
    return draw(st.sampled_from([Replicate(), Partial("sum")] + [Shard(d) for d in range(ndim)]))


@st.composite
def _pair(draw: Any) -> tuple[Any, ...]:
    op, shapes, extra = draw(st.sampled_from(TEMPLATES))
    mesh_shape = draw(st.sampled_from([(2,), (4,), (2, 2)]))
    n = 1
    for a in mesh_shape:
        n *= a
    letters = sorted({c for s in shapes for c in s if c != "1"})
    generic = [c for c in letters if draw(st.booleans())]
    exact = {c: draw(st.sampled_from(EXACT)) for c in letters if c not in generic}
    # generic sizes: distinct sizes n * v + r above every exact size (v >= n: from n * n on),
    # in the same order twice, each with its residue r modulo n (0: a multiple) both times
    order = draw(st.permutations(generic))
    residue = {c: draw(st.sampled_from([0, 0, 1, n - 1])) for c in order}
    first = sorted(draw(st.lists(st.integers(max(3, n), 20), min_size=len(order), max_size=len(order), unique=True)))
    second = sorted(draw(st.lists(st.integers(max(3, n), 20), min_size=len(order), max_size=len(order), unique=True)))
    sizes = [{**exact, **{c: n * v + residue[c] for c, v in zip(order, vals)}, "1": 1} for vals in (first, second)]
    placements = [tuple(_placement(draw, len(s)) for _ in mesh_shape) for s in shapes]
    return op, shapes, extra, mesh_shape, sizes, placements


def _call(op: Any, shapes: tuple[str, ...], extra: tuple[Any, ...], mesh: ProcessMesh, size: dict[str, int],
          placements: list[Any]) -> tuple[OpCall, list[DistSpec]] | None:
    metas = [TensorMeta(tuple(size[c] for c in s), _dtype(op, i)) for i, s in enumerate(shapes)]
    if op is aten.native_layer_norm.default:
        extra = ([size[shapes[0][-1]]], 1e-5)
    if op is aten.embedding_dense_backward.default:
        extra = (size["c"], -1, False)
    try:
        specs = [DistSpec(mesh, pl, m.shape, m.dtype) for m, pl in zip(metas, placements)]
        fake = op(*[torch.empty(m.shape, device="meta", dtype=m.dtype) for m in metas], *extra)
    except (ValueError, RuntimeError):
        return None
    outs = fake if isinstance(fake, tuple) else (fake,)
    out = tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outs)
    call = OpCall(op, (*metas, *extra), {}, tuple(metas), out, tuple(placements), tuple(mesh.shape))
    return call, specs


@settings(max_examples=50, deadline=None)
@given(_pair())
def test_a_stored_choice_is_the_fresh_choice_at_another_shape(pair: tuple[Any, ...]) -> None:
    op, shapes, extra, mesh_shape, sizes, placements = pair
    n = 1
    for a in mesh_shape:
        n *= a
    mesh = ProcessMesh(torch.arange(n).reshape(mesh_shape).tolist())
    made = [_call(op, shapes, extra, mesh, s, placements) for s in sizes]
    if made[0] is None or made[1] is None:
        return
    (call_a, specs_a), (call_b, specs_b) = made[0], made[1]
    assert choice_key(call_a, specs_a) == choice_key(call_b, specs_b)
    rule = get_rule(op)
    assert rule is not None
    strategies_a, strategies_b = rule(call_a), rule(call_b)
    if not strategies_a:
        return
    best_a = cheapest(strategies_a, specs_a, tuple(mesh.shape), call_a.out)
    if _generic_best(strategies_a, specs_a, mesh, call_a.out) is not best_a:
        return  # not stored: decided afresh at every shape
    assert strategies_b and cheapest(strategies_b, specs_b, tuple(mesh.shape), call_b.out) == best_a


OUT_OPS: list[tuple[Any, tuple[str, ...], tuple[Any, ...]]] = [
    (aten.add.Tensor, ("abc", "abc"), ()),
    (aten.add.Tensor, ("abc", "bc"), ()),  # broadcasting
    (aten.mul.Tensor, ("ab", "b"), ()),
    (aten.sub.Tensor, ("abc", "a"), ()),
    (aten.where.self, ("ab", "b", "ab"), ()),
    (aten.mul.Scalar, ("ab",), (0.5,)),
    (aten.gelu_backward.default, ("abc", "abc"), ()),
    (aten.gelu.default, ("abc",), ()),
    (aten.clone.default, ("abc",), ()),  # known where its input is dense (preserved strides)
    (aten.where.self, ("ab", "ab", "ab"), ()),
    (aten._log_softmax.default, ("abc",), (2, False)),
    (aten._softmax_backward_data.default, ("abc", "abc"), (1, torch.float32)),
    (aten.mm.default, ("ab", "bc"), ()),
    (aten.addmm.default, ("c", "ab", "bc"), ()),
    (aten.bmm.default, ("abc", "acd"), ()),
    (aten.sum.dim_IntList, ("abc",), ([1],)),
    (aten.sum.dim_IntList, ("abc",), ([0, -1], True)),
    (aten.mean.dim, ("abc",), ([-1], True)),
    (aten.amax.default, ("abc",), ([2],)),
    (aten.sum.dim_IntList, ("abc",), ([],)),  # every dim: left to the meta kernel
    (aten.transpose.int, ("abc",), (0, 2)),
    (aten.transpose.int, ("abc",), (-1, 1)),
    (aten.t.default, ("ab",), ()),
    (aten.permute.default, ("abcd",), ([2, 0, 3, 1],)),
    (aten.unsqueeze.default, ("abc",), (1,)),
    (aten.unsqueeze.default, ("abc",), (-1,)),
    (aten.unsqueeze.default, ("abc",), (0,)),
    (aten.unsqueeze.default, ("abc",), (3,)),
    (aten.alias.default, ("abc",), ()),
    (aten.embedding.default, ("ab", "cd"), ()),  # (weight, int64 indices)
    (aten.embedding.default, ("ab", "c"), ()),
    (aten.embedding_dense_backward.default, ("abc", "ab"), (7, -1, False)),
    (aten.cat.default, ("abc", "adc", "abc"), (1,)),  # tensors in a list (``_args``)
    (aten.cat.default, ("ab", "cb"), (0,)),
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(OUT_OPS), st.lists(st.dictionaries(st.sampled_from("abcd"), st.integers(0, 9), min_size=4),
                                          min_size=2, max_size=3), st.booleans())
def test_a_known_output_is_what_the_meta_kernel_gives(case: Any, sizes: list[dict[str, int]], transposed: bool) -> None:
    op, shapes, extra = case
    generic.forget()
    for size in sizes:
        fakes = [torch.empty([size[c] for c in s], device="meta", dtype=_dtype(op, i)) for i, s in enumerate(shapes)]
        if transposed:  # non-contiguous inputs (all alike: a permuted-dense pointwise op is known)
            fakes = [f.transpose(-1, -2).contiguous().transpose(-1, -2) if f.ndim >= 2 else f for f in fakes]
        inputs = [(tuple(f.shape), tuple(f.stride())) for f in fakes]
        args = ([*fakes], *extra) if op is aten.cat.default else (*fakes, *extra)
        key = generic.out_key(op, args, {}, lambda a: isinstance(a, torch.Tensor))
        known = generic.known_out(op, key, inputs, args)
        try:
            real = op(*args)
        except RuntimeError:  # shapes that do not broadcast: never known
            assert known is None
            continue
        if known is not None:
            assert (known.shape, known.stride(), known.dtype) == (real.shape, real.stride(), real.dtype)
        generic.learn_out(op, key, inputs, real, args)


@st.composite
def _strided(draw: Any, ndim: int) -> torch.Tensor:
    """A meta tensor of ``ndim`` dims with any strides: dims nested in a random order, gaps
    between them, sometimes a dim's stride replaced (0: broadcast; a repeat: overlapping)."""
    shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
    order = draw(st.permutations(range(ndim)))
    stride, acc = [0] * ndim, 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1) * draw(st.sampled_from([1, 1, 2, 3]))
    if ndim and draw(st.integers(0, 4)) == 0:
        stride[draw(st.integers(0, ndim - 1))] = draw(st.sampled_from([0, 1, *stride]))
    return torch.empty_strided(shape, stride, device="meta")


def _known_vs_meta(op: Any, args: tuple[Any, ...], tensors: list[torch.Tensor], kwargs: dict[str, Any] | None = None) -> Any:
    """The meta kernel's result of ``op(*args, **kwargs)`` (None where it raises), checked against
    ``known_out`` from the dtypes learned at earlier calls (of other shapes and strides), then
    learned from."""
    kwargs = kwargs or {}
    inputs = [(tuple(t.shape), tuple(t.stride())) for t in tensors]
    key = generic.out_key(op, args, kwargs, lambda t: isinstance(t, torch.Tensor))
    known = generic.known_out(op, key, inputs, args, kwargs)
    try:
        real = op(*args, **kwargs)
    except RuntimeError:
        return None
    rs = real if isinstance(real, (tuple, list)) else [real]
    if known is not None:
        ks = known if isinstance(known, (tuple, list)) else [known]
        assert type(known) is type(real), (op, type(known), type(real))
        assert [(k.shape, k.stride(), k.dtype) for k in ks] == [(r.shape, r.stride(), r.dtype) for r in rs], op
    layouts = generic._outs(op, inputs, args, kwargs)  # the definition itself, dtypes aside (learning checks it too)
    if layouts is not None:
        assert list(layouts) == [(tuple(r.shape), tuple(r.stride())) for r in rs], (op, inputs, args[1:], kwargs)
    generic.learn_out(op, key, inputs, real, args, kwargs)
    return real


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 4).flatmap(lambda n: st.tuples(_strided(n), st.integers(-n, n - 1))), min_size=3,
                max_size=3),
       st.sampled_from([None, -9, -3, -1, 0, 1, 2, 7]), st.sampled_from([None, -9, -2, 0, 1, 3, 8, 2**62]),
       st.integers(1, 3), st.integers(1, 6))
def test_known_slices_and_splits_are_the_meta_kernels(calls: Any, start: Any, end: Any, step: int, size: int) -> None:
    """``slice``/``split`` (views: the input's strides, any strides) and ``slice_backward`` (a
    new contiguous tensor) at three shapes: known layouts are the meta kernels'."""
    generic.forget()
    for x, dim in calls:
        real = _known_vs_meta(aten.slice.Tensor, (x, dim, start, end, step), [x])
        if real is None:
            continue
        grad = torch.empty(real.shape, device="meta")
        _known_vs_meta(aten.slice_backward.default, (grad, list(x.shape), dim % x.dim(), 0, 2**62, step), [grad])
        _known_vs_meta(aten.split.Tensor, (x, size, dim), [x])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4).flatmap(lambda n: st.tuples(_strided(n), st.integers(-n - 1, n))), min_size=3,
                max_size=3))
def test_known_unsqueezes_aliases_and_clones_are_the_meta_kernels(calls: Any) -> None:
    """``unsqueeze`` (a size-1 dim whose stride is the next dim's extent), ``alias`` and
    ``clone`` (each memory format) of tensors of any strides, at three shapes: known layouts
    are the meta kernels'."""
    generic.forget()
    for x, dim in calls:
        _known_vs_meta(aten.unsqueeze.default, (x, dim), [x])
        _known_vs_meta(aten.alias.default, (x,), [x])
        for fmt in ({}, {"memory_format": torch.contiguous_format}, {"memory_format": torch.preserve_format},
                    {"memory_format": torch.channels_last} if x.dim() == 4 else {}):
            _known_vs_meta(aten.clone.default, (x,), [x], fmt)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(st.lists(_strided(n), min_size=1, max_size=3),
                                                     st.integers(-n, n - 1), st.booleans(), st.booleans())),
       st.lists(st.sampled_from([-1, 0, 0, 1, 2]), min_size=2, max_size=6))
def test_known_cats_and_pads_are_the_meta_kernels(case: Any, pad: list[int]) -> None:
    """``cat`` of tensors of any strides (channels-last ones too; a legacy empty ``(0,)`` tensor
    among them, as a cache starts from) and ``constant_pad_nd`` of any strides: known layouts
    are the meta kernels'."""
    generic.forget()
    tensors, dim, legacy, channels_last = case
    if channels_last and tensors[0].dim() in (4, 5):
        fmt = torch.channels_last if tensors[0].dim() == 4 else torch.channels_last_3d
        tensors = [t.contiguous(memory_format=fmt) for t in tensors]
    d = dim % tensors[0].dim()
    joinable = [torch.empty_strided([*t.shape[:d], k + 1, *t.shape[d + 1:]], t.stride(), device="meta") if t.numel() == 0
                else t for k, t in enumerate(tensors)]  # (empty pieces aside: sizes that join on dim d)
    joinable = [t if t.shape[:d] + t.shape[d + 1:] == joinable[0].shape[:d] + joinable[0].shape[d + 1:]
                else torch.empty_strided([*joinable[0].shape[:d], t.shape[d], *joinable[0].shape[d + 1:]], t.stride(),
                                         device="meta") for t in joinable]
    for ts in (tensors, joinable, [torch.empty(0, device="meta"), *joinable] if legacy else joinable):
        _known_vs_meta(aten.cat.default, (ts, dim), ts)
    for t in tensors:
        n = min(len(pad) // 2, t.dim()) * 2
        _known_vs_meta(aten.constant_pad_nd.default, (t, pad[:n], 0.0), [t])


@st.composite
def _broadcasting(draw: Any) -> list[torch.Tensor]:
    """Meta tensors for one pointwise call: an output shape of 1-4 dims, each input spanning its
    trailing dims or a size 1 there (broadcast), with any strides: dims nested in a random order,
    gaps between them, sometimes a dim expanded (stride 0)."""
    out = [draw(st.sampled_from([1, 2, 3, 4, 2, 3])) for _ in range(draw(st.integers(1, 4)))]
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, len(out)))
        shape = [draw(st.sampled_from([o, o, 1])) for o in out[len(out) - n:]]
        order = draw(st.permutations(range(n)))
        stride, acc = [0] * n, 1
        for d in reversed(order):
            stride[d] = acc
            acc *= shape[d] * draw(st.sampled_from([1, 1, 2]))
        if n and draw(st.integers(0, 3)) == 0:
            stride[draw(st.integers(0, n - 1))] = 0
        tensors.append(torch.empty_strided(shape, stride, device="meta"))
    return tensors


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(generic._ITERATED, key=str)), _broadcasting())
def test_iterated_pointwise_outputs_are_the_meta_kernels(op: Any, tensors: list[torch.Tensor]) -> None:
    """A TensorIterator op's output layout (``generic._iterated``: broadcasting, transposed,
    sliced and expanded inputs) is its meta kernel's wherever it is claimed."""
    schema = op._schema
    tensor_args = [a for a in schema.arguments if not a.kwarg_only and str(a.type) == "Tensor"]
    scalars = [a for a in schema.arguments if not a.kwarg_only and str(a.type) == "Scalar"]
    args: list[Any] = list(tensors[:len(tensor_args)])
    while len(args) < len(tensor_args):
        args.append(torch.empty((), device="meta"))
    if op is aten.where.self:
        args[0] = args[0].to(torch.bool)
    args += [2.0] * len(scalars)
    inputs = [(tuple(t.shape), tuple(t.stride())) for t in args if isinstance(t, torch.Tensor) and t.dim()]
    if not inputs:
        return
    try:
        real = op(*args)
    except RuntimeError:
        return
    known = generic._outs(op, inputs, args, {})
    if known is not None:
        assert list(known) == [(tuple(real.shape), tuple(real.stride()))], (op, inputs)


@settings(max_examples=150, deadline=None)
@given(st.lists(_strided(4), min_size=4, max_size=4), st.booleans())
def test_known_cpu_flash_attention_outputs_are_the_meta_kernels(queries: list[torch.Tensor], causal: bool) -> None:
    """The CPU flash attention forward (``empty_like(query)``: known where the query's nesting
    is unambiguous) and backward (gradients stored ``(B, L, H, E)``) at four shapes and strides."""
    generic.forget()
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for q in queries:
        real = _known_vs_meta(fwd, (q, q, q, 0.0, causal), [q, q, q])
        if real is not None:
            _known_vs_meta(bwd, (q, q, q, q, real[0], real[1], 0.0, causal), [q, q, q, q, real[0], real[1]])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_a_known_view_is_what_the_meta_kernel_gives(shape: list[int], data: Any) -> None:
    """``view``/``_unsafe_view`` to a regrouping of the same elements (with or without -1), or
    to a wrong size: known only where valid, and then exactly the meta kernel's output."""
    generic.forget()
    numel = math.prod(shape)
    divisors = [d for d in range(1, numel + 1) if numel % d == 0]
    for _ in range(3):
        a = data.draw(st.sampled_from(divisors))
        size: list[int] = data.draw(st.sampled_from([[a, numel // a], [-1, a], [a, -1, 1], [numel], [-1], [a, numel]]))
        op = data.draw(st.sampled_from([aten.view.default, aten._unsafe_view.default]))
        x = torch.empty(shape, device="meta")
        inputs = [(tuple(x.shape), tuple(x.stride()))]
        key = generic.out_key(op, (x, size), {}, lambda t: isinstance(t, torch.Tensor))
        known = generic.known_out(op, key, inputs, (x, size))
        try:
            real = op(x, size)
        except RuntimeError:
            assert known is None  # an invalid size is never "known": the meta kernel raises it
            continue
        if known is not None:
            assert (known.shape, known.stride(), known.dtype) == (real.shape, real.stride(), real.dtype)
        generic.learn_out(op, key, inputs, real, (x, size))


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("batched", [True, False])
def test_known_nll_loss_outputs_are_the_meta_kernels(reduction: int, batched: bool) -> None:
    generic.forget()
    for n in (3, 5, 8):
        x = torch.empty((n, 7) if batched else (7,), device="meta")
        target = torch.empty((n,) if batched else (), dtype=torch.long, device="meta")
        fwd = (x, target, None, reduction, -100)
        inputs = [(tuple(t.shape), tuple(t.stride())) for t in (x, target)]
        key = generic.out_key(aten.nll_loss_forward.default, fwd, {}, lambda t: isinstance(t, torch.Tensor))
        known = generic.known_out(aten.nll_loss_forward.default, key, inputs, fwd)
        real = aten.nll_loss_forward.default(*fwd)
        if n > 3:
            assert known is not None
            assert [(k.shape, k.dtype) for k in known] == [(r.shape, r.dtype) for r in real]
        generic.learn_out(aten.nll_loss_forward.default, key, inputs, real, fwd)
        grad_out = torch.empty(real[0].shape, device="meta")
        bwd = (grad_out, x, target, None, reduction, -100, real[1])
        binputs = [(tuple(t.shape), tuple(t.stride())) for t in (grad_out, x, target, real[1])]
        bkey = generic.out_key(aten.nll_loss_backward.default, bwd, {}, lambda t: isinstance(t, torch.Tensor))
        bknown = generic.known_out(aten.nll_loss_backward.default, bkey, binputs, bwd)
        breal = aten.nll_loss_backward.default(*bwd)
        if n > 3:
            assert bknown is not None and (bknown.shape, bknown.stride(), bknown.dtype) == (breal.shape, breal.stride(), breal.dtype)
        generic.learn_out(aten.nll_loss_backward.default, bkey, binputs, breal, bwd)


@pytest.mark.parametrize("transposed", [False, True])
def test_known_layer_norm_and_product_outputs_are_the_meta_kernels(transposed: bool) -> None:
    """layer_norm forward/backward (on contiguous inputs) and mm (on any strides) across shapes."""
    generic.forget()

    def check(op: Any, args: tuple[Any, ...]) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        inputs = [(tuple(t.shape), tuple(t.stride())) for t in tensors]
        key = generic.out_key(op, args, {}, lambda t: isinstance(t, torch.Tensor))
        known = generic.known_out(op, key, inputs, args)
        real = op(*args)
        if known is not None:
            flat_k = known if isinstance(known, tuple) else (known,)
            flat_r = real if isinstance(real, tuple) else (real,)
            assert [(k.shape, k.stride(), k.dtype) for k in flat_k] == [(r.shape, r.stride(), r.dtype) for r in flat_r]
        generic.learn_out(op, key, inputs, real, args)
        return known, real

    for t in (3, 5, 8):
        x = torch.empty(2, t, 6, device="meta")
        if transposed:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # never known: the outputs follow strides
        w, b = torch.empty(6, device="meta"), torch.empty(6, device="meta")
        known, (out, mean, rstd) = check(aten.native_layer_norm.default, (x, [6], w, b, 1e-5))
        assert (known is None) == (t == 3 or transposed)
        known, _ = check(aten.native_layer_norm_backward.default, (out, x, [6], mean, rstd, w, b, [True, True, True]))
        assert (known is None) == (t == 3 or transposed)
        m = torch.empty(7, t, device="meta")
        weight = torch.empty(t, 4, device="meta")
        known, _ = check(aten.mm.default, (m, weight.t().contiguous().t() if transposed else weight))
        assert (known is None) == (t == 3)


def _view_sizes(kind: str, s: dict[str, int]) -> tuple[tuple[int, ...], list[int]]:
    """(input shape, view size) of a view template over letter sizes ``s``."""
    a, b, c = s["a"], s["b"], s["c"]
    return {
        "merge01": ((a, b, c), [a * b, c]),
        "merge12": ((a, b, c), [a, b * c]),
        "split0": ((a * b, c), [a, b, c]),
        "split1": ((a, b * c), [a, b, c]),
        "heads": ((a, b, c * 2), [a, b, 2, c]),
        "flat": ((a, b, c), [a * b * c]),
    }[kind]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["merge01", "merge12", "split0", "split1", "heads", "flat"]),
       st.sampled_from([(2,), (4,), (2, 2)]), st.data())
def test_a_stored_view_choice_is_the_fresh_choice_at_another_shape(kind: str, mesh_shape: tuple[int, ...], data: Any) -> None:
    """A view's choice is keyed by its output shape and where its dims regroup (not its size
    argument): wherever two shapes share the key, the fresh choice at the second is the one
    stored at the first."""
    n = 1
    for a in mesh_shape:
        n *= a
    mesh = ProcessMesh(torch.arange(n).reshape(mesh_shape).tolist())
    made = []
    pl = None
    first = {c: data.draw(st.sampled_from([1, 2, 3, 5, n, 2 * n, 3 * n, 4 * n, 6 * n, n * n + 1, 2 * n * n - 1, 3 * n * n + 1]))
             for c in "abc"}
    f = data.draw(st.sampled_from([2, 3, 5]))  # the second shape: every generic size scaled alike, its residue kept
    for s in (first, {c: v * f if v >= 2 and v % n == 0 else (v // n) * n * f + v % n if v >= n * n else v
                      for c, v in first.items()}):
        shape, size = _view_sizes(kind, s)
        if pl is None:
            pl = tuple(_placement(data.draw, len(shape)) for _ in mesh_shape)
        meta = TensorMeta(shape, torch.float32)
        try:
            spec = DistSpec(mesh, pl, shape, torch.float32)
        except ValueError:
            return
        out = TensorMeta(tuple(torch.empty(shape, device="meta").view(size).shape), torch.float32)
        made.append((OpCall(aten.view.default, (meta, size), {}, (meta,), (out,), (pl,), tuple(mesh.shape)), [spec]))
    (call_a, specs_a), (call_b, specs_b) = made
    if choice_key(call_a, specs_a) != choice_key(call_b, specs_b):
        return  # another signature: decided afresh
    rule = get_rule(aten.view.default)
    assert rule is not None
    strategies_a = rule(call_a)
    if not strategies_a:
        return
    best_a = cheapest(strategies_a, specs_a, tuple(mesh.shape), call_a.out)
    if _generic_best(strategies_a, specs_a, mesh, call_a.out) is not best_a:
        return  # not stored
    strategies_b = rule(call_b)
    assert strategies_b and cheapest(strategies_b, specs_b, tuple(mesh.shape), call_b.out) == best_a, (call_a, call_b)
