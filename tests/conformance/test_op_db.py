"""op_db conformance (float32, CPU, 4 gloo ranks): ops on DistTensors vs plain tensors.

The harness is ``tests/conformance/harness.py``. CI runs a fixed subset (``CI_OPS``) under the
``replicate``, ``shard0`` and ``uneven`` layouts, forward and backward, one test per
(op, layout), each asserting

(a) no WRONG (silently incorrect) result, and no local shard that contradicts its layout;
(b) every clear failure (error/hang) is listed in ``tests/conformance/known_failures.py`` with a
    reason: the test then reports ``xfail`` with that reason (never a silent skip);
(c) a listed failure that now passes fails the test: its entry must be removed.

The whole op_db under all four layouts, side by side with ``torch.distributed.tensor``, is
``benchmarks/op_coverage.py`` (minutes; for measuring, not for CI).

The harness itself is checked too: pure tests of the comparison and of the known-failures
bookkeeping, and planted faults (a wrong value, an error on one rank only, a shard that
contradicts its layout) that it must classify correctly. Direct checks of the silently wrong
results the full run once found (each is now right, or a clear error) close this module.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.conformance import harness as oc

# Common ops across the rule families: pointwise, reductions, matmul, nn, views and shapes; and
# ops whose backward mixes plain tensors torch makes (zeros/ones) with DistTensors.
CI_OPS = (
    "add", "mul", "div.no_rounding_mode", "exp", "tanh", "pow", "where", "clamp",
    "sum", "mean", "max.reduction_with_dim", "argmax", "var", "cumsum", "norm", "prod", "cumprod",
    "mm", "matmul", "bmm", "addmm", "addmv", "einsum", "nn.functional.linear",
    "softmax", "log_softmax", "nn.functional.relu", "nn.functional.gelu",
    "nn.functional.layer_norm", "nn.functional.batch_norm", "nn.functional.embedding",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.dropout",
    "cat", "stack", "split", "transpose", "permute", "view", "reshape", "squeeze", "unsqueeze",
    "expand", "index_select", "gather", "masked_fill", "index_put", "slice_scatter", "fft.hfftn",
)
CI_VARIANTS = ("replicate", "shard0", "uneven")
CI_SAMPLES = oc.DEFAULT_SAMPLES  # as many as the known-failures run, so stale entries are real


@pytest.fixture(scope="module")
def world(world4: Any) -> Any:
    world4.run(oc.worker_op_names, timeout=oc.WARMUP_TIMEOUT)  # import op_db in the workers, untimed
    return world4


def test_ci_ops_exist_and_are_not_excluded() -> None:
    excluded, _ = oc.known_failures()
    names = set(oc.all_op_names())
    assert [n for n in CI_OPS if n not in names] == []
    assert [n for n in CI_OPS if n in excluded] == []


@pytest.mark.parametrize("variant", CI_VARIANTS)
@pytest.mark.parametrize("op", CI_OPS)
def test_op(world: Any, op: str, variant: str) -> None:
    rec = oc.run_ops(world, [op], [variant], ("ours",), CI_SAMPLES, timeout=120)[0]
    assert rec["forward"] != "skip", f"nothing compared: {rec['forward_reason']}"
    _, known = oc.known_failures()
    problems, expected = [], []
    for phase in oc.PHASES:
        status, why, where = rec[phase], rec[phase + "_reason"], rec[phase + "_where"]
        listed = oc.listed_reason(known, op, variant, phase)
        if status == "WRONG":
            problems.append(f"{phase}: silently WRONG at {where}: {why}")
        elif oc.needs_entry(rec, phase):
            if listed is None:
                problems.append(f"{phase}: {status} not in tests/conformance/known_failures.py at {where}: {why}")
            else:
                expected.append(f"{phase}: {listed}")
        elif listed is not None and status in ("pass", "skip"):
            problems.append(f"{phase}: listed as a known failure but now {status}: remove the entry ({listed})")
    assert not problems, "\n".join(problems)
    if expected:
        pytest.xfail("known failure: " + "; ".join(expected))


def test_known_failures_have_reasons_and_valid_keys() -> None:
    excluded, known = oc.known_failures()
    for (op, variant, phase), why in known.items():
        assert variant in (*oc.VARIANTS, "*"), (op, variant, phase)
        assert phase in oc.PHASES, (op, variant, phase)
        assert isinstance(why, str) and why.strip(), (op, variant, phase)
    for op, why in excluded.items():
        assert isinstance(why, str) and why.strip(), op


# ---- the harness's own checks -------------------------------------------------------------
def test_compare() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert oc.compare(a, a.clone()) is None
    assert oc.compare(a, a + 1e-7) is None
    m = oc.compare(a, torch.tensor([1.0, float("nan"), 3.5]))
    assert m is not None and math.isclose(m.max_err, 0.5)
    assert oc.compare(a, torch.tensor([1.0, 2.0, 3.0])) is not None  # NaN pattern
    assert oc.compare(a, a[:2]) is not None  # shape
    assert oc.compare(a, a.double()) is not None  # dtype
    assert oc.compare(torch.tensor([1, 2]), torch.tensor([1, 3])) is not None  # ints exactly
    assert oc.compare((a, 2), [a.clone(), 2]) is None
    assert oc.compare((a, 2), (a.clone(), 3)) is not None
    assert oc.compare(torch.ones(2), torch.zeros(2), values=False) is None  # random ops: shapes only


def test_shard_dim() -> None:
    assert oc.shard_dim((5, 8), "replicate") is None
    assert oc.shard_dim((), "shard0") is None
    assert oc.shard_dim((5, 8), "shard0") == 0
    assert oc.shard_dim((5, 8), "shard_last") == 1
    assert oc.shard_dim((8, 5, 3), "uneven") == 2  # the smallest uneven dim
    assert oc.shard_dim((5, 5, 5), "uneven") == 1  # ties: a middle dim
    assert oc.shard_dim((5, 5), "uneven") == 1
    assert oc.shard_dim((8, 4), "uneven") == 0


def test_known_failure_bookkeeping() -> None:
    def rec(op: str, variant: str, fwd: str, bwd: str, fr: str = "boom", br: str = "forward failed") -> dict[str, Any]:
        return {"op": op, "variant": variant, "backend": "ours", "forward": fwd, "backward": bwd,
                "forward_reason": fr, "backward_reason": br, "forward_where": "", "backward_where": ""}

    known = {("a", "shard0", "forward"): "x", ("b", "*", "forward"): "y", ("c", "shard0", "forward"): "z"}
    records = [
        rec("a", "shard0", "error", "error"),          # listed; backward covered by the forward
        rec("b", "uneven", "error", "error"),          # listed by "*"
        rec("c", "shard0", "pass", "pass"),            # stale
        rec("d", "shard0", "pass", "error", br="RuntimeError: no backward"),  # unlisted
        rec("e", "shard0", "WRONG", "error", br="forward was wrong"),  # WRONG is never listed
    ]
    assert oc.unlisted(records, known) == [(("d", "shard0", "backward"), "error: RuntimeError: no backward []")]
    assert oc.stale(records, known) == [("c", "shard0", "forward")]
    every = [rec("f", v, "error", "error", fr=f"boom {v}") for v in oc.VARIANTS]
    merged = oc.updated_known_failures(every + records, known)
    assert merged[("f", "*", "forward")] == "boom replicate"
    assert ("c", "shard0", "forward") not in merged and ("d", "shard0", "backward") in merged
    # A "*" entry of a partly re-run op is kept for the variants not run; all four fail: "*" again.
    assert merged[("b", "*", "forward")] == "y"
    partial = oc.updated_known_failures([rec("b", "uneven", "pass", "pass")], known)
    assert ("b", "*", "forward") not in partial and partial[("b", "shard0", "forward")] == "y"
    assert ("b", "uneven", "forward") not in partial


class _PlantedOp:
    """A minimal OpInfo whose distributed run is deliberately broken in one way."""

    def __init__(self, fault: str) -> None:
        self.name, self.variant_test_name = f"planted_{fault}", ""
        self.supports_autograd, self.has_nondeterministic_output = True, False
        self.fault = fault

    def supported_dtypes(self, device: str) -> set[torch.dtype]:
        return {torch.float32}

    def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> Any:
        oc.op_table()  # imports torch.testing._internal (with its expecttest stand-in when needed)
        from torch.testing._internal.opinfo.core import SampleInput

        yield SampleInput(torch.randn(6, 5, requires_grad=requires_grad))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import autoparallel as ap

        if not isinstance(x, ap.DistTensor):
            return x * 2
        if self.fault == "wrong":
            return x * 2 + 1e-3
        if self.fault == "one_rank_raises" and ap.get_rank() == 1:
            raise RuntimeError("planted failure")
        if self.fault == "bad_layout":
            local = x._local if ap.get_rank() != 0 else x._local[:0]
            return ap.DistTensor._wrap(local, x._spec)  # rank 0's shard contradicts its layout
        return x * 2


def _planted(rank: int) -> dict[str, tuple[str, str, str]]:
    out = {}
    for fault in ("none", "wrong", "one_rank_raises", "bad_layout"):
        r = oc.run_opinfo(_PlantedOp(fault), "shard0", "ours", 1)
        out[fault] = (r.forward, r.backward, r.forward_reason)
    return out


def test_harness_classifies_planted_faults(world: Any) -> None:
    res = world.run(_planted)[0]
    assert res["none"][:2] == ("pass", "pass"), res["none"]
    assert res["wrong"][0] == "WRONG" and "max err 0.001" in res["wrong"][2], res["wrong"]
    assert res["one_rank_raises"][:2] == ("error", "error"), res["one_rank_raises"]
    assert "rank(s) [1] only" in res["one_rank_raises"][2], res["one_rank_raises"]
    assert res["bad_layout"][0] == "WRONG" and "rank(s) [0]" in res["bad_layout"][2], res["bad_layout"]


# ---- silently wrong results the full op_db run once found (each now right, or a clear error) ----
def _mesh() -> Any:
    import autoparallel as ap

    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _regressions(rank: int) -> dict[str, Any]:
    import autoparallel as ap
    from autoparallel import Replicate, Shard

    mesh, R = _mesh(), Replicate()
    out: dict[str, Any] = {}
    got: Any
    torch.manual_seed(0)
    # addmv with a size-1 bias and rows sharded unevenly: the CPU kernel returns the un-broadcast
    # bias for an empty shard (rank 3 held (1,) under a (0,) layout).
    bias, mat, vec = torch.randn(1), torch.randn(5, 10), torch.randn(10)
    got = torch.addmv(ap.shard_tensor(bias, mesh, [R]), ap.shard_tensor(mat, mesh, [Shard(0)]),
                      ap.shard_tensor(vec, mesh, [R]))
    out["addmv"] = (got.placements[0] == Shard(0), tuple(got._local.shape) == got._spec.local_shape((rank,)),
                    torch.allclose(got.full_tensor(), torch.addmv(bias, mat, vec), atol=1e-5))
    # Eval-mode batch norm: the kernel's saved statistics are empty, the meta kernel says (C,).
    x, w = torch.randn(3, 2, 4), torch.ones(2)
    ref = torch.ops.aten.native_batch_norm(x, w, w, w, w, False, 0.1, 1e-5)
    got = torch.ops.aten.native_batch_norm(*(ap.shard_tensor(t, mesh, [R]) for t in (x, w, w, w, w)), False, 0.1, 1e-5)
    out["batch_norm_eval"] = [tuple(g.shape) == tuple(r.shape) == tuple(g._local.shape) for g, r in zip(got, ref)]
    # An op writing some inputs and returning new tensors returns the new ones (was: the written).
    stats, dstats = (torch.zeros(2), torch.ones(2)), [ap.shard_tensor(t, mesh, [R]) for t in (torch.zeros(2), torch.ones(2))]
    ref = torch.ops.aten._native_batch_norm_legit(x, w, w, *stats, True, 0.1, 1e-5)
    got = torch.ops.aten._native_batch_norm_legit(ap.shard_tensor(x, mesh, [Shard(1)]), *(ap.shard_tensor(w, mesh, [R]),) * 2,
                                                  *dstats, True, 0.1, 1e-5)
    out["batch_norm_legit"] = ([torch.allclose(g.full_tensor(), r, atol=1e-5) for g, r in zip(got, ref)]
                               + [torch.allclose(d.full_tensor(), s) for d, s in zip(dstats, stats)])
    # The replicate fallback wraps what the kernel returned (_embedding_bag's shapes differ from meta).
    weight, idx, offsets = torch.randn(10, 5), torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2])
    ref = torch.ops.aten._embedding_bag(weight, idx, offsets, False, 0, False, torch.ones(5))
    got = torch.ops.aten._embedding_bag(ap.shard_tensor(weight, mesh, [Shard(0)]), ap.shard_tensor(idx, mesh, [R]),
                                        ap.shard_tensor(offsets, mesh, [R]), False, 0, False,
                                        ap.shard_tensor(torch.ones(5), mesh, [R]))
    out["embedding_bag"] = [tuple(g.shape) == tuple(r.shape) == tuple(g._local.shape) for g, r in zip(got, ref)]
    # A lazy conj bit must not be lost in the wrapper (hfftn read un-conjugated values).
    z = torch.randn(5, 6, 7)
    out["hfftn"] = torch.allclose(torch.fft.hfftn(ap.shard_tensor(z, mesh, [Shard(0)]), norm="ortho").full_tensor(),
                                  torch.fft.hfftn(z, norm="ortho"), atol=1e-4)
    c = torch.randn(5, 6, dtype=torch.complex64)
    real: Any = torch.view_as_real(ap.shard_tensor(c, mesh, [R]))  # was labelled Shard(1)
    got = torch.view_as_real(ap.shard_tensor(c, mesh, [Shard(1)]))
    out["view_as_real"] = (real.placements[0] == R, torch.equal(real.full_tensor(), torch.view_as_real(c)),
                           got.placements[0] == Shard(1))
    # In-place writes reach the base: through a sharded diagonal (householder/ormqr backward) and
    # through a view whose in-place op had to move it (its result used to be re-bound, not copied back).
    a = torch.randn(6, 5)
    base = ap.shard_tensor(a.clone(), mesh, [Shard(0)])  # (a Shard(0) local may alias its input)
    base.diagonal().fill_(7.0)
    want = a.clone()
    want.diagonal().fill_(7.0)
    row = ap.shard_tensor(a, mesh, [Shard(1)])
    row[1].cumsum_(0)  # the select is a view sharded on its only dim; cumsum_ must gather it
    want_row = a.clone()
    want_row[1].cumsum_(0)
    out["writes"] = (torch.equal(base.full_tensor(), want), torch.allclose(row.full_tensor(), want_row))
    # In-place views (matmul of a vector squeezes its result in place) re-point the wrapper.
    x = ap.shard_tensor(a.clone()[None], mesh, [Shard(2)])
    view: Any = x[0]
    x.squeeze_(0).t_().mul_(2.0)
    out["inplace_view"] = (tuple(x.shape), x.stride(), x.placements[0], torch.equal(x.full_tensor(), 2 * a.t()),
                           torch.equal(view.full_tensor(), 2 * a))
    return out


def test_silently_wrong_results_found_by_op_db_stay_fixed(world: Any) -> None:
    from autoparallel import Shard

    for res in world.run(_regressions):
        assert res["addmv"] == (True, True, True), res
        assert all(res["batch_norm_eval"]) and all(res["embedding_bag"]) and all(res["batch_norm_legit"]), res
        assert res["hfftn"] and res["view_as_real"] == (True, True, True), res
        assert res["writes"] == (True, True), res
        assert res["inplace_view"] == ((5, 6), (1, 5), Shard(0), True, True), res


def test_diagonal_keeps_a_row_sharding_only_when_pieces_line_up() -> None:
    from autoparallel import Replicate, Shard
    from spmd_rules import OpCall, TensorMeta, get_rule

    def out_placement(shape: tuple[int, ...], offset: int, dim: int) -> Any:
        diag = torch.empty(shape, device="meta").diagonal(offset)
        call = OpCall(torch.ops.aten.diagonal.default, (TensorMeta(shape, torch.float32), offset),
                      {}, (TensorMeta(shape, torch.float32),), (TensorMeta(tuple(diag.shape), torch.float32),),
                      ((Shard(dim),),), (4,))
        (s,) = get_rule(call.op)(call)  # type: ignore[misc]
        return s.inputs[0][0], s.outputs[0][0]

    assert out_placement((5, 5), 0, 0) == (Shard(0), Shard(0))
    assert out_placement((6, 5), 0, 0) == (Shard(0), Shard(0))  # pieces 2,2,2,0 and 2,2,1,0
    assert out_placement((8, 5), 0, 0) == (Shard(0), Shard(0))  # pieces 2,2,2,2 and 2,2,1,0
    assert out_placement((9, 5), 0, 0) == (Replicate(), Replicate())  # pieces 3,3,3,0 and 2,2,1,0
    assert out_placement((5, 5), 1, 0) == (Replicate(), Replicate())  # 4 diagonal elements
    assert out_placement((5, 5), -1, 1) == (Replicate(), Replicate())
    assert out_placement((5, 6), 1, 0) == (Shard(0), Shard(0))
