"""Optimizer ops: ``_foreach_*`` and fused steps on DistTensors, rules and end to end.

Pure part: every foreach/fused rule's single strategy is exact, checked by simulating the
ranks of a 1-d mesh (pieces per placement, the op on each rank's pieces, recombined).
World part: ``tests/world/test_optim_ops_world.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from spmd_rules.base import LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import get_local_impl, get_rule
from tests.pure.test_rules import combine, shard
from tests.treeutil import map_tensors, tensors_in

aten = torch.ops.aten
R = Replicate()
S0, S1 = Shard(0), Shard(1)
P, PAVG, PMAX = Partial(), Partial("avg"), Partial("max")


# ---- pure: the single strategy of a foreach / fused rule is exact ------------------------------
def _rnd(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _make_call(op: Any, args: tuple, kwargs: dict, placements: list, n: int, scalars: set[int]) -> OpCall:
    """The ``OpCall`` the dispatcher would build; tensors in ``scalars`` are plain 0-dim scalars."""
    out = op(*map_tensors(args, lambda t: t.clone()), **map_tensors(kwargs, lambda t: t.clone()))
    outs = [] if out is None else [out] if isinstance(out, torch.Tensor) else list(out)
    inputs = [t for t in tensors_in(args) + tensors_in(kwargs) if id(t) not in scalars]
    metas = {id(t): TensorMeta(tuple(t.shape), t.dtype) for t in inputs}

    def to_meta(t: torch.Tensor) -> Any:
        return metas[id(t)] if id(t) in metas else ScalarMeta(t.dtype)

    return OpCall(op, map_tensors(args, to_meta), map_tensors(kwargs, to_meta), tuple(metas[id(t)] for t in inputs),
                  tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outs), tuple((p,) for p in placements), (n,))


def _ctx(call: OpCall, s: Strategy, rank: int, n: int) -> LocalContext:
    mesh = ap.ProcessMesh(list(range(n)))
    in_specs = tuple(ap.DistSpec(mesh, p, m.shape, m.dtype) for m, p in zip(call.inputs, s.inputs))
    out_specs = tuple(ap.DistSpec(mesh, p, m.shape, m.dtype) for m, p in zip(call.out, s.outputs) if m is not None)
    shapes = tuple(sp.local_shape((rank,)) for sp in out_specs)
    return LocalContext(call, shapes, in_specs, out_specs, (rank,))


def _simulate(call: OpCall, args: tuple, kwargs: dict, s: Strategy, n: int, scalars: set[int]) -> tuple[list, list]:
    """Run the op on every simulated rank's pieces; return (outputs, inputs after the op) recombined."""
    inputs = [t for t in tensors_in(args) + tensors_in(kwargs) if id(t) not in scalars]
    gen = torch.Generator().manual_seed(1)
    pieces = {id(t): shard(t, p[0], n, gen) for t, p in zip(inputs, s.inputs)}
    impl = get_local_impl(call.op)
    outs, after = [], []
    for i in range(n):
        local = {k: [x.clone() for x in v] for k, v in pieces.items()}

        def piece(t: torch.Tensor) -> torch.Tensor:
            return local[id(t)][i] if id(t) in local else t.clone()

        largs, lkw = map_tensors(args, piece), map_tensors(kwargs, piece)
        out = impl(_ctx(call, s, i, n), *largs, **lkw) if impl is not None else call.op(*largs, **lkw)
        outs.append([] if out is None else [out] if isinstance(out, torch.Tensor) else list(out))
        after.append([local[id(t)][i] for t in inputs])
    got_out = [combine([o[k] for o in outs], s.outputs[k][0]) for k in range(len(s.outputs))]
    got_in = [combine([a[k] for a in after], s.inputs[k][0]) for k in range(len(inputs))]
    return got_out, got_in


def _lists(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [_rnd(*sh, seed=seed + k) for k, sh in enumerate(shapes)]


SHAPES = [(5, 3), (4,), (3, 7)]
CURRENT = [R, S0, S1, P, PAVG, PMAX]


def _foreach_cases() -> list[tuple[Any, tuple, dict]]:
    a, b, c = _lists(0, SHAPES), _lists(10, SHAPES), [t.abs() + 1 for t in _lists(20, SHAPES)]
    coef = torch.tensor(0.7)
    return [
        (aten._foreach_add_.List, (a, b), {"alpha": -0.1}),
        (aten._foreach_add.List, (a, b), {"alpha": 0.5}),
        (aten._foreach_add_.Scalar, (a, 2.0), {}),
        (aten._foreach_mul_.Scalar, (a, 0.9), {}),
        (aten._foreach_mul_.ScalarList, (a, [0.5, 2.0, 3.0]), {}),
        (aten._foreach_mul_.List, (a, b), {}),
        (aten._foreach_div_.ScalarList, (a, [0.5, 2.0, 3.0]), {}),
        (aten._foreach_lerp_.Scalar, (a, b, 0.1), {}),
        (aten._foreach_addcmul_.Scalar, (a, b, b, 0.01), {}),
        (aten._foreach_addcdiv_.ScalarList, (a, b, c, [-0.1, -0.2, -0.3]), {}),
        (aten._foreach_sqrt.default, (c,), {}),
        (aten._foreach_neg.default, (a,), {}),
        (aten._foreach_maximum_.List, (a, b), {}),
        (aten._foreach_copy_.default, (a, b), {}),
        (aten._foreach_zero_.default, (a,), {}),
        (aten._foreach_norm.Scalar, (a, 2), {}),
        (aten._foreach_norm.Scalar, (a, 1), {}),
        (aten._foreach_norm.Scalar, (a, math.inf), {}),
        (aten._foreach_norm.Scalar, (a, -math.inf), {}),
        (aten._foreach_powsum.Scalar, (a, 2), {}),
        (aten._foreach_max.default, (a,), {}),
        (aten._foreach_mul_.Tensor, (a, coef), {}),
    ]


def _fused_cases() -> list[tuple[Any, tuple, dict]]:
    p, g = _lists(30, SHAPES), _lists(40, SHAPES)
    m, v = _lists(50, SHAPES), [t.abs() for t in _lists(60, SHAPES)]
    steps = [torch.tensor(3.0) for _ in SHAPES]
    adam = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "eps": 1e-8, "amsgrad": False, "maximize": False}
    sgd = {"weight_decay": 0.01, "momentum": 0.9, "lr": 0.1, "dampening": 0.0, "nesterov": False, "maximize": False,
           "is_first_step": False}
    return [
        (aten._fused_adam_.default, (p, g, m, v, [], steps), adam),
        (aten._fused_adamw_.default, (p, g, m, v, [], steps), adam),
        (aten._fused_sgd_.default, (p, g, m), sgd),
    ]


def _check_exact(op: Any, args: tuple, kwargs: dict, n: int) -> int:
    """For several current layouts of the inputs: the rule's one strategy computes the right thing."""
    scalars = {id(t) for t in tensors_in(args) if t.dim() == 0 and op.overloadpacket.__name__.startswith("_fused")}
    inputs = [t for t in tensors_in(args) + tensors_in(kwargs) if id(t) not in scalars]
    expected_args, expected_kw = map_tensors(args, lambda t: t.clone()), map_tensors(kwargs, lambda t: t.clone())
    expected = op(*expected_args, **expected_kw)
    want_out = [] if expected is None else list(expected)
    want_in = [t for t in tensors_in(expected_args) + tensors_in(expected_kw) if t.dim() or not scalars]
    checked = 0
    for k in range(len(CURRENT)):
        placements = []
        for j, t in enumerate(inputs):
            p = CURRENT[(k + j) % len(CURRENT)]
            placements.append(R if t.dim() == 0 or (isinstance(p, Shard) and p.dim >= t.dim()) else p)
        call = _make_call(op, args, kwargs, placements, n, scalars)
        rule = get_rule(op)
        assert rule is not None, op
        strategies = list(rule(call))
        assert len(strategies) == 1, (op, strategies)
        s = strategies[0]
        assert len(s.inputs) == len(inputs) and len(s.outputs) == len(call.out)
        got_out, got_in = _simulate(call, args, kwargs, s, n, scalars)
        for g, w in zip(got_out, want_out, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m: f"{op} {placements} -> {s}: {m}")
        for g, w in zip(got_in, want_in, strict=True):
            torch.testing.assert_close(g, w, msg=lambda m: f"{op} {placements} -> {s} (written): {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", range(len(_foreach_cases()) + len(_fused_cases())))
def test_foreach_and_fused_strategies_are_exact(case: int, n: int) -> None:
    op, args, kwargs = (_foreach_cases() + _fused_cases())[case]
    assert _check_exact(op, args, kwargs, n) == len(CURRENT)


def test_foreach_keeps_written_layout_and_reduces_partial_grads() -> None:
    params, grads = _lists(0, SHAPES), _lists(10, SHAPES)
    call = _make_call(aten._foreach_add_.List, (params, grads), {"alpha": -0.1}, [S0, R, S1, P, P, P], 2, set())
    (s,) = get_rule(call.op)(call)  # type: ignore[misc]
    assert s.inputs == ((S0,), (R,), (S1,), (S0,), (R,), (S1,))  # grads reduced into the params' layouts
    bufs = _lists(20, SHAPES)
    call = _make_call(aten._foreach_mul_.Scalar, (bufs, 0.9), {}, [P, P, PAVG], 2, set())
    (s,) = get_rule(call.op)(call)  # type: ignore[misc]
    assert s.inputs == ((P,), (P,), (PAVG,))  # scaling a Partial momentum buffer stays Partial
