"""Shape-generic region verdicts (autoparallel.regions.generic): the affine model of two proven
lengths, what it refuses, and the recorder that stops a run before it leaves the proven calls."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoparallel.regions.generic import Family, Model, Proof, Recorder, Stop, point_of, sized_flags

pytestmark = pytest.mark.pure


class _Local:
    local, reason = True, ""


_LOCAL = _Local()


def _matmul(t: int) -> torch.Tensor:
    # mm's integers: [2, t] @ [t, 6] -> [2, 6]: lines 2, t, 6 cross t at 2 and 6
    return torch.ones(2, t) @ torch.ones(t, 6)


def _square(t: int) -> torch.Tensor:
    return torch.ones(t * t).view(t, t)  # t * t is no line through two lengths


def _recorded(fn: Any, t: int) -> tuple[Any, Any]:
    rec = Recorder()
    with rec:
        fn(t)
    return rec.record, (torch.empty(2, t),)


def _model(fn: Any, ta: int, tb: int) -> Model:
    proofs = []
    for t in (ta, tb):
        record, leaves = _recorded(fn, t)
        proofs.append(Proof(point_of(leaves), record, verdict=None))
    model = Model(*proofs)
    assert model.build() is None
    return model


def test_a_new_length_on_the_proven_lines_is_admitted() -> None:
    model = _model(_matmul, 4, 5)
    for t in (7, 9, 30):
        assert model.admits_point(point_of((torch.empty(2, t),))) == t
        assert model.admits_record(_recorded(_matmul, t)[0], t) is None


def test_a_length_where_sizes_coincide_is_refused() -> None:
    model = _model(_matmul, 4, 5)
    assert model.crossings >= {2, 6}
    assert model.admits_record(_recorded(_matmul, 6)[0], 6) == "sizes coincide at this length"
    assert model.admits_record(_recorded(_matmul, 1)[0], 1) == "a size becomes 0 or 1"
    # predicted before a run, with the same reasons; lengths on the lines are not refused
    assert model.refusal_at(6) == "sizes coincide at this length"
    assert model.refusal_at(1) == "a size becomes 0 or 1"
    assert all(model.refusal_at(t) is None for t in (7, 9, 30))
    assert all(model.refusal_at(t) == model.admits_record(_recorded(_matmul, t)[0], t) for t in range(1, 12) if t not in (4, 5))


def test_a_size_off_the_lines_is_refused() -> None:
    model = _model(_square, 3, 4)  # at 5 the line through 9 and 16 says 23, the run says 25
    assert model.admits_record(_recorded(_square, 5)[0], 5) == "a size is not the proven lengths' function"
    assert model.refusal_at(5) is None  # on integral lines: only the run tells

    def halves(t: int) -> torch.Tensor:
        return torch.ones(7, t)[:, : t // 2]  # a size t // 2: through 4 -> 2 and 6 -> 3, slope 1/2

    model = _model(halves, 4, 6)
    assert model.refusal_at(8) is None
    assert model.refusal_at(9) == "a size is not the proven lengths' function"  # 4.5: no run can match
    assert model.admits_record(_recorded(halves, 9)[0], 9) == "a size is not the proven lengths' function"


def test_arguments_that_vary_in_two_ways_are_refused() -> None:
    model = _model(_matmul, 4, 5)
    assert model.admits_point(point_of((torch.empty(3, 7),))) is None  # the batch changed too
    assert model.admits_point(point_of((torch.empty(2, 5),))) is None  # a proven length: its own verdict


def test_proven_lengths_with_a_coincidence_make_no_model() -> None:
    a, b = (Proof(point_of(leaves), rec, None) for rec, leaves in (_recorded(_matmul, 6), _recorded(_matmul, 8)))
    assert Model(a, b).build() == "sizes coincide at a proven length"


def test_a_coincident_proof_is_skipped_and_the_proofs_around_it_make_the_model() -> None:
    # _matmul's lines 2, t, 6: t = 6 is a coincidence. Proofs at 4, 6, 7 (the order a warm-up or
    # variable lengths bring them): 4 alone makes nothing, 6 with 4 none (no witness), 7 pairs
    # with 4 past it; a later coincident proof (2) leaves that model in place
    family = Family()

    def prove(t: int) -> None:
        record, leaves = _recorded(_matmul, t)
        family.add(Proof(point_of(leaves), record, verdict=_LOCAL))

    prove(4)
    assert family.model is None and family.why == "fewer than two proven lengths"
    prove(6)
    assert family.model is None and family.why == "sizes coincide at a proven length"
    prove(7)
    assert family.model is not None and (family.model.ta, family.model.tb) == (4, 7)
    built = family.model
    prove(2)
    assert family.model is built
    assert family.model.refusal_at(9) is None and family.model.refusal_at(6) == "sizes coincide at this length"
    for _ in range(Family.WITNESSES + 2):  # only the latest few proofs are kept to pair with
        prove(2)
    assert len(family.recorded) == Family.WITNESSES


def test_the_recorder_stops_before_an_unproven_or_in_place_op() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + 1) * 2

    def g(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        return y.mul_(2)

    x = torch.zeros(3)
    rec = Recorder()
    with rec:
        f(x)
    with pytest.raises(Stop, match="aten call 1"), Recorder(expect=rec.record.skeleton):
        g(x)
    with pytest.raises(Stop, match="aten call 0"), Recorder(expect=rec.record.skeleton):
        x.add_(1)
    assert x.eq(0).all()  # stopped before it wrote


def test_dim_indices_are_not_sizes() -> None:
    def f(t: int) -> torch.Tensor:
        return torch.ones(t, 3, 5).transpose(1, 2)

    record, _ = _recorded(f, 2)
    flags = sized_flags(record.skeleton)
    assert len(flags) == len(record.ints)
    k = [i for i, (func, *_rest) in enumerate(record.skeleton) if func is torch.ops.aten.transpose.int][0]
    start = record.bounds[k - 1] if k else 0
    # [t, 3, 5] in, dims 1 and 2 (indices), [t, 5, 3] out
    assert flags[start:record.bounds[k]] == [True, True, True, False, False, True, True, True]
    # at t = 2 the size t equals the index 2: no coincidence a rule could read, a model is made
    assert _model(f, 2, 4).crossings == {3, 5}


def _refusal_by_lines(model: Model, tc: int) -> str | None:
    """``Model.refusal_at`` evaluated line by line (what its precomputed bounds stand for)."""
    if tc in model.crossings:
        return "sizes coincide at this length"
    num, den = (model.ib - model.ia) * (tc - model.ta), model.tb - model.ta
    if (num % den).any():
        return "a size is not the proven lengths' function"
    if ((model.ia + num // den).clip(max=2) != model.small).any():
        return "a size becomes 0 or 1"
    return None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_refusals_from_bounds_are_the_lines_refusals(data: Any) -> None:
    ta = data.draw(st.integers(2, 40))
    tb = data.draw(st.integers(2, 40).filter(lambda t: t != ta))
    n = data.draw(st.integers(1, 6))
    ia = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    ib = [a if a < 2 else data.draw(st.integers(2, 60)) for a in ia]  # 0 and 1 stay (a model's rule)
    model = Model(Proof((ta,), _Ints(ia), None), Proof((tb,), _Ints(ib), None))
    model.ta, model.tb, model.small = ta, tb, np.minimum(model.ia, 2)
    model._bounds()
    for tc in range(-5, 100):
        assert model.refusal_at(tc) == _refusal_by_lines(model, tc), (ta, tb, ia, ib, tc)


class _Ints:
    """A record of integers only (the bounds read nothing else)."""

    def __init__(self, ints: list[int]) -> None:
        self.ints, self.skeleton, self.bounds = ints, [], [len(ints)]


def test_points_follow_the_lines_of_the_arguments() -> None:
    model = _model(_matmul, 4, 5)
    pa, pb = np.asarray(model.a.point), np.asarray(model.b.point)

    def by_lines(point: tuple[int, ...]) -> int | None:
        pc = np.asarray(point)
        tc = int(pc[model.p0])
        return None if tc in (4, 5) or ((pc - pa) * (5 - 4) != (pb - pa) * (tc - 4)).any() else tc

    points = [point_of((torch.empty(2, t),)) for t in range(0, 40)] + [(2, 9, 9, 1), (3, 9, 9, 1), (2, 9, 1, 1)]
    for point in points:
        assert model.admits_point(point) == by_lines(point), point
    assert model.admits_point(point_of((torch.empty(2, 9),))) == 9
    assert model.admits_point((2, 9, 9)) is None  # another rank


def _masked(t: int) -> torch.Tensor:
    return torch.ones(2, 1, t, t).sum(-1)


def test_a_dense_argument_is_given_by_its_layout_not_its_strides() -> None:
    """A contiguous ``(2, 1, t, t)`` mask argument: strides ``t * t`` are no line in ``t``, its layout
    (dense, row-major) is the same at every length: new lengths are admitted. Transposed it is
    another layout; sliced (not dense) its strides are coordinates again."""
    def mask(t: int) -> torch.Tensor:
        return torch.empty(2, 1, t, t)

    a, b = (Proof(point_of((mask(t),)), _recorded(_masked, t)[0], verdict=None) for t in (4, 5))
    model = Model(a, b)
    assert model.build() is None
    for t in (7, 9, 30):
        assert model.admits_point(point_of((mask(t),))) == t
    assert model.admits_point(point_of((mask(9).transpose(2, 3),))) is None  # another nesting
    assert model.admits_point(point_of((torch.empty(2, 1, 9, 10)[..., :9],))) is None  # sliced: its strides
    assert point_of((torch.empty(2, 1, 9, 10)[..., :9],))[4:] == (90, 90, 10, 1)
    # proven at two lengths with different layouts: no model
    c = Proof(point_of((mask(6).transpose(2, 3),)), _recorded(_masked, 6)[0], verdict=None)
    assert Model(a, c).build() == "an argument is laid out differently at the proven lengths"


def test_writes_to_what_the_run_made_are_no_writes() -> None:
    """A run that writes in place only tensors it made (SDPA's ``zeros_like`` then ``masked_fill_``)
    writes nothing outside (``Record.mutates`` False, the recorder does not stop); a write to an
    argument or a buffer does, a view of a made tensor is made too."""
    mask = torch.ones(2, 3, dtype=torch.bool).tril()
    buffer = torch.zeros(2, 3)

    def convert(m: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(m, dtype=torch.float32)
        out[:, :2].masked_fill_(m.logical_not()[:, :2], float("-inf"))
        return out

    rec = Recorder()
    with rec:
        convert(mask)
    assert not rec.record.mutates
    with Recorder(expect=rec.record.skeleton):  # a new run of it is not stopped
        convert(mask)
    rec = Recorder()
    with rec:
        buffer.add_(1.0)
    assert rec.record.mutates
    with pytest.raises(Stop):
        with Recorder(expect=rec.record.skeleton):
            buffer.add_(1.0)


def test_records_leave_aliases_out() -> None:
    """``alias`` (the tensor itself) is not recorded: a run that issues one and a run that does not
    (indexing a mask over its whole length on real and on symbolic sizes) record the same."""
    x = torch.ones(2, 3)
    a, b = Recorder(), Recorder()
    with a:
        torch.ops.aten.alias.default(x).exp()
    with b:
        x.exp()
    assert a.record.skeleton == b.record.skeleton and a.record.ints == b.record.ints
