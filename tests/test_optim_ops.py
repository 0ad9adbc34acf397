"""Optimizer ops: ``_foreach_*`` and fused steps on DistTensors, rules and end to end.

Pure part: every foreach/fused rule's single strategy is exact, checked by simulating the
ranks of a 1-d mesh (pieces per placement, the op on each rank's pieces, recombined).
World part (4 gloo ranks): unmodified ``torch.optim`` SGD (momentum + weight decay), Adam and
AdamW — default, ``foreach=False``, ``foreach=True`` and ``fused=True`` — take 3 steps on
DistTensor parameters whose gradients have other layouts (Partial included) on a 4-rank and a
2x2 mesh, match plain torch, keep the parameters' layouts and emit no fallback warning.
``clip_grad_norm_`` gives the global norm.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard, dispatch
from spmd_rules.base import LocalContext, OpCall, ScalarMeta, Strategy, TensorMeta
from spmd_rules.registry import get_local_impl, get_rule
from tests.layouts import make_dist
from tests.treeutil import map_tensors, tensors_in
from tests.test_rules import combine, shard

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


# ---- world: unmodified torch.optim optimizers on DistTensors -----------------------------------
def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


# (shape, param placements, grad placements) per mesh; 7 rows over 4 ranks is uneven
LAYOUTS = {
    1: [((6, 5), (S0,), (P,)), ((5,), (R,), (P,)), ((4, 7), (S1,), (S0,)), ((7, 3), (S0,), (R,)), ((3, 4), (R,), (S1,))],
    2: [((6, 5), (S0, R), (P, P)), ((5,), (R, R), (P, R)), ((4, 7), (R, S1), (S0, P)), ((7, 3), (S0, S1), (R, R)),
        ((3, 4), (R, R), (S1, S0))],
}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
}
MODES: list[dict[str, Any]] = [{}, {"foreach": False}, {"foreach": True}, {"fused": True}]


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "autoparallel" in str(w.message)]


def _optimizer_run(rank: int, name: str, mode: dict[str, Any], mesh_ndim: int) -> list[str]:
    mesh = _mesh1() if mesh_ndim == 1 else _mesh2()
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(0)
    layouts = LAYOUTS[mesh_ndim]
    full = [torch.randn(sh) for sh, _, _ in layouts]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    params = [ap.shard_tensor(torch.nn.Parameter(t.clone()), mesh, list(pl)) for t, (_, pl, _) in zip(full, layouts)]
    opt, ref_opt = cls(params, **kw, **mode), cls(ref, **kw, **mode)
    for step in range(3):
        grads = [torch.randn(sh) for sh, _, _ in layouts]
        for p, q, g, (_, _, gpl) in zip(params, ref, grads, layouts):
            p.grad = make_dist(g, mesh, gpl)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, q, (_, pl, _) in zip(params, ref, layouts):
        assert isinstance(p, ap.DistTensor) and tuple(p.placements) == pl, (p.placements, pl)
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {mode} mesh{mesh_ndim} {pl}: {m}")
    return []


def _optimizers(rank: int) -> list[str]:
    """Every optimizer x mode x mesh; returns the fallback warnings seen (must be none)."""
    dispatch.clear_cache()
    dispatch._warned.clear()
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in OPTIMIZERS:
            for mode in MODES:
                if name == "adam_amsgrad" and mode.get("fused"):
                    continue
                for nd in (1, 2):
                    _optimizer_run(rank, name, mode, nd)
    seen += _fallback_warnings(caught)
    return seen


def test_torch_optimizers_step_dist_tensors(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_optimizers, timeout=300):
        assert warned == [], warned


def _clip(rank: int) -> dict[str, Any]:
    """``clip_grad_norm_`` with foreach=True: the global norm; which ops (not ours) fell back."""
    dispatch.clear_cache()
    dispatch._warned.clear()
    mesh = _mesh2()
    torch.manual_seed(3)
    layouts = LAYOUTS[2]
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for norm_type in (2.0, math.inf):
            for foreach in (True, None):
                grads = [torch.randn(sh) for sh, _, _ in layouts]
                ref = [torch.nn.Parameter(torch.zeros(sh)) for sh, _, _ in layouts]
                params = [ap.shard_tensor(torch.nn.Parameter(torch.zeros(sh)), mesh, list(pl)) for sh, pl, _ in layouts]
                for p, q, g, (_, _, gpl) in zip(params, ref, grads, layouts):
                    p.grad = make_dist(g, mesh, gpl)
                    q.grad = g.clone()
                total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=norm_type, foreach=foreach)
                want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach)
                got = total.full_tensor() if isinstance(total, ap.DistTensor) else total
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                for p, q in zip(params, ref):
                    torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    out["fallbacks"] = sorted({m.split(" runs replicated")[0].removeprefix("autoparallel: ") for m in _fallback_warnings(caught)})
    return out


def test_clip_grad_norm_is_global(world4):  # type: ignore[no-untyped-def]
    res = world4.run(_clip)
    # ours (_foreach_norm, _foreach_mul_) never fall back; linalg_vector_norm/stack belong to other families
    assert not [f for f in res[0]["fallbacks"] if "_foreach" in f], res[0]["fallbacks"]
