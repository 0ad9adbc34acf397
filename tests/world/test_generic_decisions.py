"""Whole decisions reused across shapes (``decide._from_template``): a decision filled in from one
made at another sequence length is, field for field, the decision made afresh (2 ranks).

Each case is an op on DistTensors whose sizes include a varying length ``t`` (even and odd: a
length the mesh does not divide is generic from the mesh's size squared on, its pieces uneven
where ``t`` is sharded), in several layouts. Lengths run in a
shuffled order; at each, the decision from the caches (a template where one applies) is
compared with the one made after every shape-generic cache is forgotten. Also: what the filled-in
decisions keep is bounded, and sharding a batch or the loss at a new length keeps nothing below
the decision cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from autoparallel.engine import decide as deciding
from autoparallel.engine import generic
from autoparallel.engine.decide import LocalStep, decide
from autoparallel.engine.dtensor import DistTensor

aten = torch.ops.aten
FIELDS = ("mesh", "coord", "plans", "in_specs", "in_conform", "restore", "slots", "local_fn", "out_kind",
          "out_specs", "out_strides", "out_dense", "out_alias", "mutated", "fallback", "detached_view", "simple")
# a kernel's context (compared by identity): what it holds
CONTEXT = ("call", "out_shapes", "in_specs", "out_specs", "coord")


def _cases(mesh: Any, t: int) -> list[tuple[str, Any, Callable[[], tuple[Any, ...]]]]:
    """(name, op, a function making the call's args) at length ``t``."""
    def d(shape: tuple[int, ...], place: Any, transposed: bool = False) -> DistTensor:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(t))
        out = ap.shard_tensor(x, mesh, [place])
        return out.transpose(-1, -2).contiguous().transpose(-1, -2) if transposed else out  # type: ignore[no-any-return]

    def ids(shape: tuple[int, ...], place: Any) -> DistTensor:
        x = torch.randint(0, 10, shape, generator=torch.Generator().manual_seed(t))
        return ap.shard_tensor(x, mesh, [place])  # type: ignore[no-any-return]

    R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
    cases: list[tuple[str, Any, Callable[[], tuple[Any, ...]]]] = []
    for name, p in (("R", R), ("S0", S0), ("S1", S1), ("S2", S2)):
        cases += [
            (f"add {name}", aten.add.Tensor, lambda p=p: (d((4, t, 6), p), d((4, t, 6), p))),
            (f"add bias {name}", aten.add.Tensor, lambda p=p: (d((4, t, 6), p), d((6,), R))),
            (f"mul scalar {name}", aten.mul.Tensor, lambda p=p: (d((4, t, 6), p), 0.5)),
            (f"gelu {name}", aten.gelu.default, lambda p=p: (d((4, t, 6), p),)),
            (f"gelu transposed {name}", aten.gelu.default, lambda p=p: (d((4, t, 6), p, True),)),
            (f"transpose {name}", aten.transpose.int, lambda p=p: (d((4, t, 6), p), 1, 2)),
            (f"permute {name}", aten.permute.default, lambda p=p: (d((4, t, 6), p), [2, 0, 1])),
            (f"unsqueeze {name}", aten.unsqueeze.default, lambda p=p: (d((4, t, 6), p), 1)),
            (f"unsqueeze transposed {name}", aten.unsqueeze.default, lambda p=p: (d((4, t, 6), p, True), -1)),
            (f"alias {name}", aten.alias.default, lambda p=p: (d((4, t, 6), p),)),
            (f"clone transposed {name}", aten.clone.default, lambda p=p: (d((4, t, 6), p, True),)),
            (f"mul transposed by a row {name}", aten.mul.Tensor, lambda p=p: (d((4, t, 6), p, True), d((6,), R))),
            (f"neg transposed {name}", aten.neg.default, lambda p=p: (d((4, t, 6), p, True),)),
            (f"sum {name}", aten.sum.dim_IntList, lambda p=p: (d((4, t, 6), p), [1])),
            (f"mean keepdim {name}", aten.mean.dim, lambda p=p: (d((4, t, 6), p), [-1], True)),
            (f"view merge {name}", aten.view.default, lambda p=p: (d((4, t, 6), p), [-1, 6])),
            (f"view heads {name}", aten.view.default, lambda p=p: (d((4, t, 6), p), [4, t, 2, 3])),
            (f"log_softmax {name}", aten._log_softmax.default, lambda p=p: (d((4, t, 6), p), -1, False)),
            (f"cat {name}", aten.cat.default, lambda p=p: ([d((4, t, 6), p), d((4, t, 6), p)], 2 if p != S2 else 1)),
            (f"cat transposed {name}", aten.cat.default,  # (a rotary embedding's halves, transposed heads)
             lambda p=p: ([d((4, t, 6), p, True), d((4, t, 6), p)], 2 if p != S2 else 1)),
            (f"cat after a legacy empty {name}", aten.cat.default,  # (a key/value cache's first update)
             lambda p=p: ([ap.shard_tensor(torch.empty(0), mesh, [R]), d((4, t, 6), p)], -2 if p != S1 else -1)),
            (f"pad {name}", aten.constant_pad_nd.default, lambda p=p: (d((4, t, 6), p), [0, 1] if p != S2 else [0, 0, 0, 1])),
            (f"bmm {name}", aten.bmm.default, lambda p=p: (d((4, t, 6), p), d((4, 6, t), p if p != S2 else S1))),
        ]
    for name, (pa, pb) in {"RR": (R, R), "S0R": (S0, R), "RS1": (R, S1), "S1S0": (S1, S0)}.items():
        cases += [
            (f"mm {name}", aten.mm.default, lambda pa=pa, pb=pb: (d((t, 6), pa), d((6, 8), pb))),
            (f"t {name}", aten.t.default, lambda pa=pa: (d((t, 6), pa),)),
        ]
    for name, p in (("R", R), ("S0", S0), ("S1", S1)):
        cases += [
            (f"embedding {name}", aten.embedding.default, lambda p=p: (d((10, 6), R), ids((4, t), p))),
            (f"embedding backward {name}", aten.embedding_dense_backward.default,
             lambda p=p: (d((4, t, 6), p), ids((4, t), p), 10, -1, False)),
        ]
    for name, p in (("R", R), ("S0", S0), ("S1", S1)):
        cases += [  # arguments naming the length, read by the rules only through the output's shape
            (f"slice table {name}", aten.slice.Tensor, lambda p=p: (d((40, 6), p), 0, 0, t)),
            (f"slice whole {name}", aten.slice.Tensor, lambda p=p: (d((t, 6), p), 0, 0, t)),
            (f"slice tail {name}", aten.slice.Tensor, lambda p=p: (d((t, 6), p), 0, 2, t)),
            (f"split {name}", aten.split.Tensor, lambda p=p: (d((t, 6), p), t // 2, 0)),
            (f"split last {name}", aten.split.Tensor, lambda p=p: (d((t, 6), p), 2, 1)),
            (f"slice backward {name}", aten.slice_backward.default,
             lambda p=p: (d((t, 6), p if p != S0 else R), [40, 6], 0, 0, t, 1)),
        ]
    for name, p in (("R", R), ("S0", S0), ("S1", S1)):
        cases += [  # tuple outputs
            (f"nll_loss {name}", aten.nll_loss_forward.default,
             lambda p=p: (d((2 * t, 10), p), ids((2 * t,), p if p != S1 else R), None, 1, -100)),
            (f"layer_norm {name}", aten.native_layer_norm.default,
             lambda p=p: (d((4, t, 6), p if p != S1 else S0), [6], d((6,), R), d((6,), R), 1e-5)),
        ]
    sdpa, sdpa_backward = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for name, p in (("R", R), ("S0", S0), ("S1", S1)):
        def heads(p: Any = p) -> DistTensor:  # (B, H, t, E) as attention gets it: (B, t, H, E) transposed
            return d((4, t, 2, 4), p if p != S1 else S2).transpose(1, 2)  # type: ignore[no-any-return]

        def backward(p: Any = p) -> tuple[Any, ...]:
            q, k, v = heads(), heads(), heads()
            out, lse = sdpa(q, k, v, 0.0, True)
            return (d((4, 2, t, 4), p), q, k, v, out, lse, 0.0, True)

        cases += [
            (f"attention {name}", sdpa, lambda p=p: (d((4, 2, t, 4), p), d((4, 2, t, 4), p), d((4, 2, t, 4), p), 0.0, True)),
            (f"attention heads {name}", sdpa, lambda heads=heads: (heads(), heads(), heads(), 0.0, True)),
            (f"attention backward {name}", sdpa_backward, backward),
        ]
    cases += [
        ("add partial", aten.add.Tensor, lambda: (d((4, t, 6), P), d((4, t, 6), P))),
        ("addmm row parallel", aten.addmm.default, lambda: (d((8,), R), d((t, 6), S1), d((6, 8), S0))),
    ]
    return cases


# calls filled in from another length's decision at some length (the rest may be too)
TEMPLATED = {"addmm row parallel", "slice table R", "slice tail R", "split last R", "split last S0",
             "slice backward R", "attention R", "attention S1", "attention heads S0", "attention backward R",
             "attention backward S1", "embedding backward R", "cat transposed R", "cat transposed S1",
             "cat after a legacy empty S0", "pad R", "pad S0"}


@contextmanager
def _counting_fills() -> Iterator[list[Any]]:
    """Within the block, the templates of the decisions filled in from another shape's, in order."""
    filled: list[Any] = []
    original = deciding._from_template

    def counted(*args: Any) -> Any:
        filled.append(args[0])
        return original(*args)

    deciding._from_template = counted  # type: ignore[assignment]
    try:
        yield filled
    finally:
        deciding._from_template = original  # type: ignore[assignment]


def _compare(rank: int) -> tuple[int, int, set[str], set[str]]:
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    lengths = [6, 7, 8, 10, 11, 12, 14, 16, 18, 20, 6, 21, 24]
    random.Random(0).shuffle(lengths)
    made = fresh = 0
    names: set[str] = set()
    odd: set[str] = set()  # filled in at an odd length
    with _counting_fills() as filled:
        for t in lengths:
            for name, op, make in _cases(mesh, t):
                args = make()
                dts = [a for x in args for a in (x if isinstance(x, list) else [x]) if isinstance(a, DistTensor)]
                calls = len(filled)
                got = decide(DistTensor, op, args, {}, dts)
                used = len(filled) > calls  # filled in from a decision made at another length
                kept = [dict(c) for c in (generic._CHOICES, generic._OUT_DTYPES, generic._TEMPLATES)]
                generic.forget()
                want = decide(DistTensor, op, args, {}, dts)
                assert isinstance(got, LocalStep) and isinstance(want, LocalStep), name
                for f in FIELDS:
                    assert getattr(got, f) == getattr(want, f), (name, t, f, getattr(got, f), getattr(want, f))
                assert (got.context is None) == (want.context is None), name
                assert got.call == want.call or (used and got.context is None and got.call is None), name
                if got.context is not None:
                    for f in CONTEXT:
                        assert getattr(got.context, f) == getattr(want.context, f), (name, t, f)
                for cache, old in zip((generic._CHOICES, generic._OUT_DTYPES, generic._TEMPLATES), kept):
                    cache.update(old)
                made += used
                fresh += not used
                if used:
                    names.add(name)
                    if t % 2:
                        odd.add(name)
    return made, fresh, names, odd


def test_a_decision_from_another_shape_is_the_fresh_decision(world2) -> None:  # type: ignore[no-untyped-def]
    for made, fresh, names, odd in world2.run(_compare):
        assert made > 0 and fresh > 0
        assert TEMPLATED <= names, sorted(TEMPLATED - names)
        # odd lengths too, their pieces uneven where t is sharded (S1 on (4, t, 6))
        assert {"addmm row parallel", "attention R", "gelu S1", "add S1", "unsqueeze S1", "alias S0", "clone transposed S1",
                "mul transposed by a row S1", "mul transposed by a row R", "cat transposed S1", "pad S1",
                "embedding backward R"} <= odd, sorted(odd)


def _bounded(rank: int) -> tuple[list[int], bool]:
    from autoparallel.engine import dispatch

    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    dispatch.clear_cache()
    bound, dispatch.MAX_SHAPES_PER_TEMPLATE = dispatch.MAX_SHAPES_PER_TEMPLATE, 3
    view = aten.view.default
    try:
        held: list[int] = []
        exact = True
        for t in [*range(4, 28, 2), 8, 4]:  # then back to lengths whose decisions were dropped
            x = torch.randn(4, t, 6, generator=torch.Generator().manual_seed(t))
            y = ap.shard_tensor(x, mesh, [Shard(1)]).view(4, t, 2, 3)
            exact = exact and bool(torch.equal(y.full_tensor(), x.view(4, t, 2, 3)))
            held.append(sum(k[0] is view for k in dispatch._CACHE))
        return held, exact
    finally:
        dispatch.MAX_SHAPES_PER_TEMPLATE = bound
        dispatch.clear_cache()


def test_filled_in_decisions_are_kept_for_the_latest_shapes_only(world2) -> None:  # type: ignore[no-untyped-def]
    """With lengths that keep changing, the dispatcher keeps a template's decisions for its
    latest ``MAX_SHAPES_PER_TEMPLATE`` shapes: what a new length adds is bounded. A length
    whose decisions were dropped is filled in again and computes the same."""
    for held, exact in world2.run(_bounded):
        assert exact
        # lengths where t meets another size (4, 6) key templates of their own and stay; every
        # other length shares one template, which keeps its latest 3 shapes (the one decided
        # afresh that made it included): from the fifth length on, nothing more is kept, new
        # lengths and returns alike
        assert held[:5] == [1, 2, 3, 4, 5] and set(held[5:]) == {5}, held


def _bounded_all(rank: int) -> tuple[list[int], bool, bool]:
    from autoparallel.engine import dispatch

    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    dispatch.clear_cache()
    bound, dispatch.MAX_FILLED_DECISIONS = dispatch.MAX_FILLED_DECISIONS, 5
    try:
        held: list[int] = []
        exact = consistent = True
        for t in [*range(4, 40, 2), 8, 4]:  # two templates filled per length; then back to dropped lengths
            x = torch.randn(4, t, 6, generator=torch.Generator().manual_seed(t))
            y = ap.shard_tensor(x, mesh, [Shard(1)]).view(4, t, 2, 3) * 2
            exact = exact and bool(torch.equal(y.full_tensor(), x.view(4, t, 2, 3) * 2))
            filled = [k for keys in dispatch._FILLED.values() for k in keys]
            held.append(len(dispatch._FILLED_ALL))
            consistent = consistent and sorted(map(repr, filled)) == sorted(map(repr, dispatch._FILLED_ALL)) \
                and all(k in dispatch._CACHE for k in filled) and all(dispatch._FILLED.values()) \
                and all(dispatch._FILLED[s.template] is s for s in dispatch._FILLED_ALL.values())
        return held, exact, consistent
    finally:
        dispatch.MAX_FILLED_DECISIONS = bound
        dispatch.clear_cache()


def test_filled_in_decisions_of_all_templates_are_bounded_together(world2) -> None:  # type: ignore[no-untyped-def]
    """Beyond each template's bound, all filled-in decisions together are kept for the latest
    ``MAX_FILLED_DECISIONS`` only (a size ordering that rarely recurs fills its template's
    bound slowly): from then on a new length keeps nothing more, and a dropped length computes
    the same when it comes back."""
    for held, exact, consistent in world2.run(_bounded_all):
        assert exact and consistent
        assert max(held) == 5 and held[-8:] == [5] * 8, held


def _gpt_lengths(rank: int, lengths: list[int]) -> tuple[list[tuple[float, float]], float, int]:
    """The example GPT under TP (2 ranks) trained at these lengths (odd ones too: the decisions
    outside regions are filled in from templates there) and in one process: (per step the two
    losses, the largest relative parameter difference, the decisions filled in)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "examples"))
    import train_gpt
    from gpt_model import GPT, GPTConfig, lm_loss

    mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
    cfg = GPTConfig(vocab=24, seq=32, layers=1, width=16, heads=2)
    torch.manual_seed(0)
    model, ref = GPT(cfg), GPT(cfg)
    ref.load_state_dict(model.state_dict())
    train_gpt.parallelize_gpt(model, mesh, sp=False)
    opt = ap.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with _counting_fills() as filled:
        for t in lengths:
            x = torch.randint(0, 24, (3, t + 1), generator=torch.Generator().manual_seed(t))
            xi, yi = x[:, :-1].contiguous(), x[:, 1:].contiguous()
            loss = lm_loss(model(ap.shard_tensor(xi, mesh, [Replicate()])), ap.shard_tensor(yi, mesh, [Replicate()]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref_loss = lm_loss(ref(xi), yi)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            losses.append((float(loss.detach().full_tensor()), float(ref_loss.detach())))
    worst = max(float((p.detach().full_tensor() - q.detach()).norm() / q.detach().norm())
                for p, q in zip(model.parameters(), ref.parameters()))
    return losses, worst, len(filled)


def test_tensor_parallel_training_at_odd_lengths_matches_one_process(world2) -> None:  # type: ignore[no-untyped-def]
    for losses, worst, filled in world2.run(_gpt_lengths, [6, 8, 9, 11, 7, 13, 10, 15, 9]):
        assert filled > 0  # decisions were filled in at new lengths
        for ours, ref in losses:
            assert ours == pytest.approx(ref, rel=1e-5)
        assert worst <= 1e-5


def _kept_per_shape(rank: int) -> dict[str, int]:
    import torch.nn.functional as F

    import reshard.planner as planner
    import spmd_rules.nn as nn_rules

    mesh = ap.ProcessMesh([0, 1], ["dp"])
    w = ap.shard_tensor(torch.randn(8, 12, generator=torch.Generator().manual_seed(0)), mesh, [Replicate()])

    def batch(t: int) -> None:
        gen = torch.Generator().manual_seed(t)
        x = ap.shard_tensor(torch.randn(2 * t, 8, generator=gen), mesh, [Shard(0)])
        y = ap.shard_tensor(torch.randint(0, 12, (2 * t,), generator=gen), mesh, [Shard(0)])
        F.cross_entropy(x @ w, y).full_tensor()

    for t in (3, 4, 5):  # the first shapes: templates, one-time
        batch(t)
    before = (planner._plan.cache_info().currsize, nn_rules._axes_sharding.cache_info().currsize)
    for t in range(6, 36):
        batch(t)
    after = (planner._plan.cache_info().currsize, nn_rules._axes_sharding.cache_info().currsize)
    return {"plans": after[0] - before[0], "axes": after[1] - before[1],
            "nll_cached": int(hasattr(nn_rules.nll_layout, "cache_info"))}


def test_sharding_batches_and_the_loss_keep_nothing_per_shape(world2) -> None:  # type: ignore[no-untyped-def]
    # a new batch shape is sharded by each rank's box (no reshard plan kept per shape), and the
    # NLL kernels read their layout without a memo keyed by the call (which kept every length's
    # call after the decision cache let it go): 30 new lengths add no entry
    for kept in world2.run(_kept_per_shape):
        assert kept == {"plans": 0, "axes": 0, "nll_cached": 0}, kept
