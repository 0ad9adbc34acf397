"""Rules for nn ops (softmax, layer/RMS norm, embedding, NLL loss, dropout backward).

Pure part: every strategy a rule offers is checked by brute force on 1-d meshes of 2, 3 and 4
ranks (uneven and empty pieces) and a 2x2 mesh. Each simulated rank runs the op's local
implementation on its pieces; when that issues a collective the ranks rerun in threads, with
the kernel's collectives (``ctx.comm``) given as a barrier that reduces the members' tensors, so
the loss-parallel collectives are simulated exactly. The local outputs, combined as the
strategy claims, must equal the op on the global inputs.

World part: ``tests/world/test_nn_rules_world.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from autoparallel.engine.kernels import kernel_for
from autoparallel.spec import DistSpec
from spmd_rules import LocalContext, OpCall, Strategy, TensorMeta, get_rule
from tests.simcomm import SimComm as _SimComm
from tests.treeutil import map_tensors, one_thread, tensors_in  # noqa: F401  (one_thread: autouse fixture)

aten = torch.ops.aten
R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P = Partial()
PMAX = Partial("max")
_GEN = torch.Generator().manual_seed(0)



def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_GEN, dtype=torch.float64)




def meta(t: torch.Tensor | None) -> TensorMeta | None:
    return None if t is None else TensorMeta(tuple(t.shape), t.dtype)


def make_call(
    op: Any, args: tuple, placements: list, mesh_shape: tuple[int, ...] = (2,), fn: Callable[..., Any] | None = None
) -> OpCall:
    """An ``OpCall`` for ``op(*args)`` on real tensors (outputs from ``fn`` when given)."""
    out = (fn or op)(*args)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    inputs = tensors_in(args)
    placements = [tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in placements]
    assert len(placements) == len(inputs)
    metas = {id(t): meta(t) for t in inputs}
    return OpCall(
        op, map_tensors(args, lambda t: metas[id(t)]), {}, tuple(metas[id(t)] for t in inputs),
        tuple(meta(o) for o in outs), tuple(placements), mesh_shape,
    )


def strategies(call: OpCall) -> list[Strategy]:
    rule = get_rule(call.op)
    assert rule is not None, call.op
    return list(rule(call))


def outputs_for(call: OpCall, inputs: list) -> list[tuple]:
    key = tuple((p,) for p in inputs)
    return [s.outputs for s in strategies(call) if s.inputs == key]


def offers(call: OpCall, inputs: list, outputs: list) -> bool:
    return tuple((p,) for p in outputs) in outputs_for(call, inputs)


# ---- pinned strategies -----------------------------------------------------------------------
def test_softmax_strategies() -> None:
    x = rnd(4, 6)
    call = make_call(aten._log_softmax.default, (x, 1, False), [S0])
    assert offers(call, [S0], [S0])
    assert offers(call, [S1], [S1])  # loss parallel: the local implementation all-reduces
    assert outputs_for(call, [P]) == []
    safe = make_call(aten._safe_softmax.default, (x, 1), [S1])
    assert offers(safe, [S0], [S0]) and outputs_for(safe, [S1]) == []
    y = torch.log_softmax(x, 1)
    back = make_call(aten._log_softmax_backward_data.default, (rnd(4, 6), y, 1, torch.float64), [P, R])
    assert offers(back, [P, R], [P]) and offers(back, [S1, S1], [S1])
    assert outputs_for(back, [R, P]) == []


def test_layer_norm_strategies() -> None:
    x, w, b = rnd(4, 3, 6), rnd(6), rnd(6)
    call = make_call(aten.native_layer_norm.default, (x, [6], w, b, 1e-5), [S0, R, R])
    assert offers(call, [S0, R, R], [S0, S0, S0]) and offers(call, [S1, R, R], [S1, S1, S1])
    assert outputs_for(call, [S2, R, R]) == [] and outputs_for(call, [R, S0, S0]) == []
    assert outputs_for(call, [P, R, R]) == []
    call2 = make_call(aten.native_layer_norm.default, (x, [3, 6], w.expand(3, 6).contiguous(), None, 1e-5), [S1, R])
    assert outputs_for(call2, [S1, R]) == [] and offers(call2, [S0, R], [S0, S0, S0])
    _, mean, rstd = aten.native_layer_norm.default(x, [6], w, b, 1e-5)
    args = (rnd(4, 3, 6), x, [6], mean, rstd, w, b, [True, True, True])
    back = make_call(aten.native_layer_norm_backward.default, args, [S0] * 4 + [R, R])
    assert offers(back, [S0] * 4 + [R, R], [S0, P, P])
    assert offers(back, [P] + [R] * 5, [P, P, P])
    assert outputs_for(back, [R, P] + [R] * 4) == []


def test_embedding_strategies() -> None:
    w, idx = rnd(7, 4), torch.tensor([[0, 6, 3], [2, 2, 5]])
    call = make_call(aten.embedding.default, (w, idx), [S0, R])
    assert offers(call, [S0, R], [P])  # vocab parallel
    assert offers(call, [S1, R], [S2])
    assert offers(call, [R, S1], [S1])
    assert offers(call, [PMAX, R], [PMAX])
    assert outputs_for(call, [S0, S0]) == [] and outputs_for(call, [P, S0]) == []
    g = rnd(2, 3, 4)
    back = make_call(aten.embedding_dense_backward.default, (g, idx, 7, -1, False), [R, R])
    assert offers(back, [R, R], [S0]) and offers(back, [S2, R], [S1]) and offers(back, [S1, S1], [P])
    assert offers(back, [P, R], [P]) and outputs_for(back, [PMAX, R]) == []
    scaled = make_call(aten.embedding_dense_backward.default, (g, idx, 7, -1, True), [R, R])
    assert outputs_for(scaled, [S1, S1]) == []  # frequencies are global counts


def test_nll_strategies() -> None:
    x, t = rnd(6, 5), torch.tensor([0, 4, -100, 1, 1, 3])
    for reduction, loss, tw in [(0, S0, R), (1, R, R), (2, P, P)]:  # mean: sum and weight reduced together
        call = make_call(aten.nll_loss_forward.default, (x, t, None, reduction, -100), [S0, S0])
        assert offers(call, [S0, S0], [loss, tw]), reduction
        assert offers(call, [S1, R], [P, R])  # class-sharded: loss parallel
        assert outputs_for(call, [S1, S0]) == [] and outputs_for(call, [S0, R]) == []
    lp = aten.nll_loss_forward.default(x, t, None, 1, -100)
    back = make_call(aten.nll_loss_backward.default, (lp[0], x, t, None, 1, -100, lp[1]), [R, S0, S0, R])
    assert offers(back, [R, S0, S0, R], [S0]) and offers(back, [R, S1, R, R], [S1])
    assert offers(back, [P, R, R, R], [P])
    assert outputs_for(back, [R, S0, S0, P]) == []  # mean needs the global total weight
    sp = aten.nll_loss_forward.default(x, t, None, 2, -100)
    back = make_call(aten.nll_loss_backward.default, (sp[0], x, t, None, 2, -100, sp[1]), [R, S0, S0, P])
    assert offers(back, [R, S0, S0, P], [S0])  # sum never reads total_weight: left in place


# ---- brute force with simulated collectives --------------------------------------------------
def _summand(x: torch.Tensor, placements: tuple, coord: tuple[int, ...], mesh_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The piece at ``coord`` of a Partial-on-some-axes value ``x`` (random integer summands)."""
    for a, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        n, i = mesh_shape[a], coord[a]
        g = torch.Generator().manual_seed(seed * 31 + a)
        noise = [torch.randint(0, 5, x.shape, generator=g).to(x.dtype) for _ in range(n)]
        if p.reduce_type == "sum":
            x = x - sum(noise[1:]) if i == 0 else noise[i]
        elif p.reduce_type == "avg":
            x = x + noise[i] - sum(noise) / n
        elif i:
            x = x - noise[i] if p.reduce_type == "max" else x + noise[i]
    return x


def _local_piece(x: torch.Tensor, spec: DistSpec, coord: tuple[int, ...], seed: int) -> torch.Tensor:
    piece = _summand(x, spec.placements, coord, tuple(spec.mesh.shape), seed)
    for d, (off, length) in enumerate(spec.local_box(coord)):
        piece = piece.narrow(d, off, length)
    return piece.clone()


def _combine(locals_: dict[tuple[int, ...], torch.Tensor], spec: DistSpec) -> torch.Tensor:
    """The global value the local outputs stand for under ``spec``."""
    vals = dict(locals_)
    for a, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}[p.reduce_type]
            line = {c: [o for o in vals if all(o[b] == c[b] for b in range(len(c)) if b != a)] for c in vals}
            vals = {c: reduce(torch.stack([vals[o] for o in line[c]]), 0) for c in vals}
    full = torch.zeros(spec.shape, dtype=spec.dtype)
    for c, v in vals.items():
        box = spec.local_box(c)
        region = full
        for d, (off, length) in enumerate(box):
            region = region.narrow(d, off, length)
        assert tuple(v.shape) == tuple(region.shape), (c, v.shape, region.shape)
        region.copy_(v)  # replicated copies overwrite each other; checked equal by the caller
    return full


def _check_strategy(op: Any, fn: Callable[..., Any], args: tuple, s: Strategy, call: OpCall, mesh: ap.ProcessMesh) -> None:
    inputs = tensors_in(args)
    in_specs = tuple(DistSpec(mesh, p, tuple(t.shape), t.dtype) for t, p in zip(inputs, s.inputs))
    out_specs = tuple(None if m is None else DistSpec(mesh, p, m.shape, m.dtype) for m, p in zip(call.out, s.outputs))
    coords = [tuple(int(v) for v in c) for c in np.ndindex(*mesh.shape)]
    sim = _SimComm(coords)
    impl = kernel_for(op)

    def rank(c: tuple[int, ...]) -> Any:
        pieces = iter([_local_piece(t, sp, c, i) for i, (t, sp) in enumerate(zip(inputs, in_specs))])
        largs = map_tensors(args, lambda _t: next(pieces))
        if impl is None:
            return fn(*largs)
        shapes = tuple(None if sp is None else sp.local_shape(c) for sp in out_specs)
        return impl(LocalContext(call, shapes, in_specs, out_specs, c, sim), *largs)

    results = sim.run(rank)
    expected = fn(*args)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    for o, (spec, want) in enumerate(zip(out_specs, expected)):
        if spec is None or want is None:
            continue
        locals_ = {c: (r if isinstance(r, torch.Tensor) else r[o]) for c, r in results.items()}
        assert all(tuple(v.shape) == spec.local_shape(c) for c, v in locals_.items()), (op, s, o)
        if not any(isinstance(p, Partial) for p in spec.placements):  # every piece, copies included
            for c, v in locals_.items():
                ref = _local_piece(want, spec, c, 0)
                if not torch.allclose(v, ref, equal_nan=True):
                    torch.testing.assert_close(v, ref, equal_nan=True, msg=lambda m: f"{op} {s} out {o} at {c}: {m}")
            continue
        got = _combine(locals_, spec)
        if not torch.allclose(got, want, equal_nan=True):
            torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{op} {s} out {o}: {m}")


def _rms_backward(g: torch.Tensor, x: torch.Tensor, shape: list, rstd: torch.Tensor, w: torch.Tensor | None, mask: list) -> tuple:
    """Reference for ``_fused_rms_norm_backward`` (no CPU kernel), from the saved ``rstd``."""
    lead = x.ndim - len(shape)
    xhat = x * rstd
    gw = g if w is None else g * w
    gx = rstd * (gw - xhat * (gw * xhat).mean(tuple(range(lead, x.ndim)), keepdim=True))
    return gx, (g * xhat).sum(tuple(range(lead))) if w is not None and mask[1] else None


@dataclass
class Case:
    op: Any
    args: tuple
    fn: Callable[..., Any] | None = None            # stand-in for an op with no CPU kernel
    currents: list = field(default_factory=list)    # extra current placements (per input)


def _cases() -> list[Case]:
    x2, x3 = rnd(5, 7), rnd(5, 3, 4)
    w4, b4 = rnd(4), rnd(4)
    ln_out, ln_mean, ln_rstd = aten.native_layer_norm.default(x3, [4], w4, b4, 1e-5)
    _, m2, r2 = aten.native_layer_norm.default(x3, [3, 4], w4.expand(3, 4).contiguous(), None, 1e-5)
    _, rms_rstd = aten._fused_rms_norm.default(x3, [4], w4, None)
    emb_w, idx = rnd(7, 3), torch.tensor([[0, 6, 3, 2, 2], [5, 1, 6, 0, 4]])
    logits, tgt = rnd(6, 5), torch.tensor([0, 4, -100, 1, 1, 3])
    cls_w = rnd(5).abs() + 0.5
    x4, t4 = rnd(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3), generator=_GEN)
    t4[0, 0, 0] = -100
    cases = [
        Case(aten._softmax.default, (x2, 1, False)),
        Case(aten._softmax.default, (x3, 0, False)),
        Case(aten._log_softmax.default, (x2, 1, False)),
        Case(aten._log_softmax.default, (x3, -1, False)),
        Case(aten._safe_softmax.default, (x2, 1)),
        Case(aten._softmax_backward_data.default, (rnd(5, 7), torch.softmax(x2, 1), 1, torch.float64)),
        Case(aten._log_softmax_backward_data.default, (rnd(5, 7), torch.log_softmax(x2, 1), 1, torch.float64)),
        Case(aten._log_softmax_backward_data.default, (rnd(5, 3, 4), torch.log_softmax(x3, 2), 2, torch.float64)),
        Case(aten.native_layer_norm.default, (x3, [4], w4, b4, 1e-5)),
        Case(aten.native_layer_norm.default, (x3, [3, 4], None, None, 1e-5)),
        Case(aten.native_layer_norm_backward.default, (rnd(5, 3, 4), x3, [4], ln_mean, ln_rstd, w4, b4, [True, True, True])),
        Case(aten.native_layer_norm_backward.default, (rnd(5, 3, 4), x3, [4], ln_mean, ln_rstd, w4, b4, [True, False, True])),
        Case(aten.native_layer_norm_backward.default, (rnd(5, 3, 4), x3, [3, 4], m2, r2, None, None, [True, False, False])),
        Case(aten._fused_rms_norm.default, (x3, [4], w4, None)),
        Case(aten._fused_rms_norm_backward.default, (rnd(5, 3, 4), x3, [4], rms_rstd, w4, [True, True]), fn=_rms_backward),
        Case(aten.embedding.default, (emb_w, idx)),
        Case(aten.embedding.default, (emb_w, idx, 2)),
        Case(aten.embedding_dense_backward.default, (rnd(2, 5, 3), idx, 7, -1, False)),
        Case(aten.embedding_dense_backward.default, (rnd(2, 5, 3), idx, 7, 2, False)),
        Case(aten.embedding_dense_backward.default, (rnd(2, 5, 3), idx, 7, 6, True)),
        Case(aten.nll_loss_forward.default, (logits, tgt, None, 0, -100)),
        Case(aten.nll_loss_forward.default, (logits, tgt, None, 1, -100)),
        Case(aten.nll_loss_forward.default, (logits, tgt, cls_w, 1, -100)),
        Case(aten.nll_loss_forward.default, (logits, tgt.clamp(min=0), cls_w, 2, 4)),
        Case(aten.nll_loss_forward.default, (logits[0], torch.tensor(3), None, 1, -100)),
        Case(aten.nll_loss2d_forward.default, (x4, t4, None, 1, -100)),
        Case(aten.nll_loss2d_forward.default, (x4, t4, cls_w, 0, -100)),
        Case(aten.native_dropout_backward.default, (rnd(5, 7), torch.rand(5, 7, generator=_GEN) > 0.5, 2.0)),
    ]
    for op, big in [(aten.nll_loss_forward.default, (logits, tgt)), (aten.nll_loss2d_forward.default, (x4, t4))]:
        back = aten.nll_loss_backward.default if op is aten.nll_loss_forward.default else aten.nll_loss2d_backward.default
        for weight, reduction in [(None, 0), (None, 1), (cls_w, 1), (cls_w, 2)]:
            loss, tw = op(*big, weight, reduction, -100)
            g = rnd(*loss.shape)
            currents = [[R, R, R] + ([R] if weight is not None else []) + [P]] if reduction != 1 else []
            cases.append(Case(back, (g, *big, weight, reduction, -100, tw), currents=currents))
    # elementwise losses (spmd_rules.losses): none / mean / sum, broadcast weights
    prob = torch.rand(5, 7, generator=_GEN, dtype=torch.float64) * 0.9 + 0.05
    lab, sign = torch.rand(5, 7, generator=_GEN, dtype=torch.float64), rnd(5, 7).sign()
    for red in (0, 1, 2):
        t, g = rnd(5, 7), (rnd(5, 7) if red == 0 else rnd())
        cases += [
            Case(aten.mse_loss.default, (x2, t, red)),
            Case(aten.huber_loss.default, (x2, t, red, 0.5)),
            Case(aten.smooth_l1_loss.default, (x2, t, red, 0.5)),
            Case(aten.soft_margin_loss.default, (x2, sign, red)),
            Case(aten.binary_cross_entropy.default, (prob, lab, rnd(7).abs(), red)),
            Case(aten.binary_cross_entropy_with_logits.default, (x2, lab, rnd(5, 1).abs(), rnd(7).abs(), red)),
            Case(aten.mse_loss_backward.default, (g, x2, t, red)),
            Case(aten.huber_loss_backward.default, (g, x2, t, red, 0.5)),
            Case(aten.smooth_l1_loss_backward.default, (g, x2, t, red, 0.5)),
            Case(aten.soft_margin_loss_backward.default, (g, x2, sign, red)),
            Case(aten.binary_cross_entropy_backward.default, (g, prob, lab, rnd(7).abs(), red)),
        ]
    buffer = aten.log_sigmoid_forward.default(x2)[1]
    cases += [Case(aten.log_sigmoid_forward.default, (x2,)),
              Case(aten.log_sigmoid_backward.default, (rnd(5, 7), x2, buffer)),
              Case(aten.softplus_backward.default, (rnd(5, 7), x2, 1.5, 20.0)),
              Case(aten.hardswish_backward.default, (rnd(5, 7), x2)),
              Case(aten.hardsigmoid_backward.default, (rnd(5, 7), x2)),
              Case(aten.mish_backward.default, (rnd(5, 7), x2))]
    return cases


CASES = _cases()
MESHES = [(2,), (3,), (4,), (2, 2)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=[str(m) for m in MESHES])
@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{i}" for i, c in enumerate(CASES)])
def test_offered_strategies_are_exact(case: Case, mesh_shape: tuple[int, ...]) -> None:
    inputs = tensors_in(case.args)
    mesh = ap.ProcessMesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape))
    seen: set[Strategy] = set()
    calls = []
    currents = [[p] + [R] * (len(inputs) - 1) for p in [R, S0, S1, S2, P]] + case.currents
    for cur in currents:
        if isinstance(cur[0], Shard) and cur[0].dim >= inputs[0].ndim:
            continue
        placements = [tuple(p for _ in mesh_shape) for p in cur]
        call = make_call(case.op, case.args, placements, mesh_shape, fn=case.fn)
        for s in strategies(call):
            if s not in seen:
                seen.add(s)
                calls.append((s, call))
    assert seen
    for s, call in calls:
        _check_strategy(case.op, case.fn or case.op, case.args, s, call, mesh)


@pytest.mark.parametrize("src, dst, sums", [
    (torch.float32, torch.float16, True), (torch.float32, torch.float64, True), (torch.int32, torch.int64, True),
    (torch.int64, torch.float32, True), (torch.float32, torch.int64, False), (torch.float32, torch.bool, False),
    (torch.int64, torch.bool, False),
])
def test_a_cast_keeps_a_partial_sum_only_where_summands_add_up(src: torch.dtype, dst: torch.dtype, sums: bool) -> None:
    # 1.6 + -0.4 = 1.2 -> 1, but the summands cast are 1 + 0: a cast to an integer type takes a
    # reduced value; a monotone cast keeps a max or min (one to bool is not monotone)
    x = torch.ones(4, 3, dtype=src)
    call = make_call(aten._to_copy.default, (x,), [Partial()], fn=lambda t: t.to(dst))
    outs = {s.outputs[0] for s in get_rule(aten._to_copy.default)(call)}
    assert ((Partial("sum"),) in outs) == sums and ((Partial("avg"),) in outs) == sums, outs
    kept = dst != torch.bool  # bool is not monotone: -5 -> True, 0 -> False
    assert ((Partial("max"),) in outs) == kept and ((Partial("min"),) in outs) == kept, outs
