"""The static-mode scheduling passes (``autoparallel.static.passes``) on hand-built programs:
what moves, how far, and what bounds a move. Values never change (the same nodes, reordered
along their dependencies); the world tests in tests/world/test_static.py check the values."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from autoparallel.static.passes import drop_detaches, hoist_starts, sink_waits

fc, aten = torch.ops._c10d_functional, torch.ops.aten


def _order(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _backward_with_buckets() -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """grad2 is produced first, then grad1; each bucket's all-reduce was recorded at the end."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    n: dict[str, torch.fx.Node] = {}
    n["grad2"] = g.call_function(aten.mm.default, (x, w))
    n["more"] = g.call_function(aten.mul.Tensor, (x, 3))
    n["grad1"] = g.call_function(aten.mm.default, (n["more"], w))
    n["tail"] = g.call_function(aten.add.Tensor, (n["grad1"], 1))      # the rest of the backward
    n["flat2"] = g.call_function(aten.view.default, (n["grad2"], [-1]))
    n["ar2"] = g.call_function(fc.all_reduce.default, (n["flat2"], "sum", "0"))
    n["flat1"] = g.call_function(aten.view.default, (n["grad1"], [-1]))
    n["ar1"] = g.call_function(fc.all_reduce.default, (n["flat1"], "sum", "0"))
    n["w2"] = g.call_function(fc.wait_tensor.default, (n["ar2"],))
    n["w1"] = g.call_function(fc.wait_tensor.default, (n["ar1"],))
    g.output((n["w2"], n["w1"], n["tail"]))
    return torch.fx.GraphModule(torch.nn.Module(), g), n


def test_a_bucket_reduction_starts_as_soon_as_its_gradient_exists() -> None:
    gm, n = _backward_with_buckets()
    assert hoist_starts(gm) == 2
    order = _order(gm)

    def at(key: str) -> int:
        return order.index(n[key].name)
    # ar2 (with its packing view) right after grad2, before the rest of the backward
    assert at("flat2") == at("grad2") + 1 and at("ar2") == at("flat2") + 1
    assert at("ar2") < at("more")
    # ar1 right after grad1 and its view, before the tail; the collectives keep their order
    assert at("ar1") == at("flat1") + 1 and at("flat1") == at("grad1") + 1 and at("ar1") < at("tail")
    assert at("ar2") < at("ar1")


def test_collectives_keep_their_order_and_never_cross_a_write() -> None:
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    a = g.call_function(aten.mul.Tensor, (x, 2))
    first = g.call_function(fc.all_reduce.default, (a, "sum", "0"))   # needs ``a``
    write = g.call_function(aten.add_.Tensor, (buf, 1))
    second = g.call_function(fc.all_reduce.default, (x, "sum", "0"))  # needs only x, but...
    w1 = g.call_function(fc.wait_tensor.default, (first,))
    w2 = g.call_function(fc.wait_tensor.default, (second,))
    g.output((w1, w2, write))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    hoist_starts(gm)
    at = _order(gm).index
    assert at(second.name) > at(write.name) > at(first.name)  # ...stops at the write


def test_a_prefetch_runs_at_most_one_collective_ahead() -> None:
    """Three parameter all-gathers (inputs only): each moves up to the previous one's wait."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"p{i}") for i in range(3)]
    h = x
    names = []
    first_compute = None
    for p in shards:
        h = g.call_function(aten.relu.default, (h,))
        first_compute = first_compute or h                  # compute of the previous unit
        flat = g.call_function(aten.view.default, (p, [-1]))
        ag = g.call_function(fc.all_gather_into_tensor.default, (flat, 4, "0"))
        wt = g.call_function(fc.wait_tensor.default, (ag,))
        h = g.call_function(aten.mul.Tensor, (h, wt))                 # this unit uses its parameters
        names.append((flat.name, ag.name, wt.name, h.name))
    g.output((h,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    sink_waits(gm)
    hoist_starts(gm)
    at = _order(gm).index
    # the first gather has no floor: it goes to the top, before any compute
    assert at(names[0][1]) < at(first_compute.name)
    for prev, cur in itertools.pairwise(names):
        # the next unit's gather starts right after this unit's wait, before this unit's compute ends
        assert at(prev[2]) < at(cur[1]) < at(prev[3])


def test_sink_waits_moves_the_rearranging_ops_with_the_wait() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(fc.all_gather_into_tensor.default, (x, 2, "0"))
    wt = g.call_function(fc.wait_tensor.default, (ag,))
    parts = g.call_function(aten.split.Tensor, (wt, 4))
    p0 = g.call_function(__import__("operator").getitem, (parts, 0))
    p1 = g.call_function(__import__("operator").getitem, (parts, 1))
    whole = g.call_function(aten.cat.default, ([p1, p0], 1))        # group order -> mesh order
    work = g.call_function(aten.mul.Tensor, (x, 5))                   # independent compute
    use = g.call_function(aten.add.Tensor, (whole, 1))
    g.output((use, work))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert sink_waits(gm) == 1
    at = _order(gm).index
    assert at(work.name) < at(wt.name) < at(parts.name) < at(whole.name) < at(use.name)



def test_a_detach_is_read_through_where_only_an_op_reads_it() -> None:
    """A program run without autograd reads a detach's input in its place; a detach that is an
    output or that an in-place op writes stays (a separate tensor object, its own metadata)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    d1 = g.call_function(aten.detach.default, (x,))
    use = g.call_function(aten.mul.Tensor, (d1, 2))
    d2 = g.call_function(aten.detach.default, (use,))                 # an output: kept
    d3 = g.call_function(aten.detach.default, (use,))
    g.call_function(aten.t_.default, (d3,))                           # its metadata written: kept
    d4 = g.call_function(aten.detach.default, (x,))
    more = g.call_function(aten.add.Tensor, (d4, d3))
    g.output((d2, more))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    t = torch.randn(3, 3)
    want = [v.clone() for v in gm(t.clone())]
    assert drop_detaches(gm) == 2
    kept = [n for n in gm.graph.nodes if n.target is aten.detach.default]
    assert [n.name for n in kept] == [d2.name, d3.name]
    assert use.args[0] is x and more.args[0] is x
    for w, got in zip(want, gm(t.clone())):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def _joint_mlp(inplace: bool) -> tuple[Any, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach() for p in m.parameters()]

    def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
        ps = [p.requires_grad_() for p in flat[:6]]
        x, t = flat[6].requires_grad_(), flat[7]
        h = x * 1.0
        if inplace:
            h.add_(0.5)  # an in-place write in the forward phase
        y = torch.func.functional_call(m, dict(zip(names, ps)), (h,))
        out = y.detach()
        return [out, *torch.autograd.grad(y, ps + [x], t)]

    x, t = torch.randn(5, 4), torch.randn(5, 3)
    return make_fx(joint)(*params, x, t), params, x, t


@pytest.mark.parametrize("inplace", [False, True])
def test_split_joint_forward_then_backward_equals_the_joint_program(inplace: bool) -> None:
    from autoparallel.static.split import split_joint

    gm, params, x, t = _joint_mlp(inplace)
    parts = split_joint(gm, 7, 1)
    out = parts.forward(*params, x)
    grads = parts.backward(*out[1:], t)
    ref = gm(*params, x, t)
    assert len(out) == 1 + parts.num_saved and torch.equal(out[0], ref[0])
    assert len(grads) == 7 and all(torch.equal(a, b) for a, b in zip(grads, ref[1:]))
    # every node runs on exactly one side
    count = sum(n.op == "call_function" for n in gm.graph.nodes)
    assert count == sum(n.op == "call_function" for p in (parts.forward, parts.backward) for n in p.graph.nodes)


def test_split_joint_keeps_a_write_after_the_forward_output_in_the_forward() -> None:
    # a batch norm's running statistics are updated after its output is made: the update is the
    # forward's (a split at the last forward output alone ran it in the backward, or never)
    from autoparallel.static.split import split_joint

    g = torch.fx.Graph()
    x, stat, tangent = g.placeholder("x"), g.placeholder("stat"), g.placeholder("tangent")
    y = g.call_function(aten.mul.Tensor, (x, 2.0))
    mean = g.call_function(aten.mean.default, (x,))
    g.call_function(aten.add_.Tensor, (stat, mean))
    gx = g.call_function(aten.mul.Tensor, (tangent, 2.0))
    g.output((y, gx))
    parts = split_joint(torch.fx.GraphModule(torch.nn.Module(), g), 2, 1)
    xs, st = torch.arange(4.0), torch.zeros(())
    out = parts.forward(xs, st)
    assert torch.equal(out[0], xs * 2) and st.item() == 1.5  # written by the forward
    assert any(n.target is aten.add_.Tensor for n in parts.forward.graph.nodes)
    assert not any(n.target is aten.add_.Tensor for n in parts.backward.graph.nodes)


def test_split_joint_refuses_a_forward_output_that_reads_the_output_gradient() -> None:
    from autoparallel.static.split import SplitError, split_joint

    g = torch.fx.Graph()
    x, tangent = g.placeholder("x"), g.placeholder("tangent")
    y = g.call_function(aten.mul.Tensor, (x, tangent))
    g.output((y, x))
    with pytest.raises(SplitError, match="output gradient"):
        split_joint(torch.fx.GraphModule(torch.nn.Module(), g), 1, 1)


def test_split_joint_reads_a_constant_in_each_program_that_uses_it() -> None:
    # a tensor the forward builds (GPT-2's ``torch.tensor(...)`` mask value) is kept by the trace
    # as an attribute (``get_attr``); both programs read it, neither carries it to the other
    from autoparallel.static.split import split_joint

    root = torch.nn.Module()
    root._tensor_constant0 = torch.tensor(3.0)
    g = torch.fx.Graph()
    x, tangent = g.placeholder("x"), g.placeholder("tangent")
    c = g.get_attr("_tensor_constant0")
    y = g.call_function(aten.mul.Tensor, (x, c))
    gx = g.call_function(aten.mul.Tensor, (tangent, c))
    g.output((y, gx))
    parts = split_joint(torch.fx.GraphModule(root, g), 1, 1)
    xv, tv = torch.randn(4), torch.randn(4)
    out = parts.forward(xv)
    (grad,) = parts.backward(*out[1:], tv)
    assert torch.equal(out[0], xv * 3) and torch.equal(grad, tv * 3) and parts.num_saved == 0


# ---- merging all-reduces -------------------------------------------------------------------
class _TwoRanks(torch.fx.Interpreter):
    """Runs a program as each of two ranks holding the same values would: a sum is twice the value."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is fc.all_reduce.default:
            return args[0] * 2 if args[1] == "sum" else args[0].clone()
        if target is fc.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def _val(node: torch.fx.Node, *shape: int) -> torch.fx.Node:
    node.meta["val"] = torch.empty(shape)
    return node


def _two_reductions(dependent: bool = False, groups: tuple[str, str] = ("0", "0"),
                    ops: tuple[str, str] = ("sum", "sum"), write: str = "") -> torch.fx.GraphModule:
    """``x`` reduced, then ``y`` (from ``b``, or from ``x``'s result when ``dependent``) reduced;
    otherwise ``x``'s result is first used, and waited for, after ``y``'s reduction starts."""
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    x = _val(g.call_function(aten.mul.Tensor, (a, 2)), 2, 3)
    ax = g.call_function(fc.all_reduce.default, (x, ops[0], groups[0]))
    wx = g.call_function(fc.wait_tensor.default, (ax,)) if dependent else None
    if write == "own buffer":  # a kernel writing a buffer of its own (as the NLL backward's scatter_)
        g.call_function(aten.add_.Tensor, (g.call_function(aten.zeros_like.default, (a,)), 1))
    elif write == "x through a view":
        g.call_function(aten.add_.Tensor, (g.call_function(aten.view.default, (x, [-1])), 1))
    y = _val(g.call_function(aten.add.Tensor, (wx if dependent else b, 1)), 2, 3)
    wy = g.call_function(fc.wait_tensor.default, (g.call_function(fc.all_reduce.default, (y, ops[1], groups[1])),))
    if wx is None:  # where sink_waits would put it: at its first use, after y's reduction started
        wx = g.call_function(fc.wait_tensor.default, (ax,))
    g.output((g.call_function(aten.mul.Tensor, (wx, 3)), g.call_function(aten.mul.Tensor, (wy, 5))))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _records(n: int, nbytes: int = 24) -> list[Any]:
    from autoparallel.runtime.debug import CommRecord

    return [CommRecord("all_reduce", None, 0, (0, 1), nbytes, nbytes, op=f"op{i}") for i in range(n)]


def _reductions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is fc.all_reduce.default]


def test_independent_all_reduces_become_one_with_the_same_values() -> None:
    from autoparallel.static.passes import merge_all_reduces, tag_records

    gm = _two_reductions()
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    before = _TwoRanks(gm).run(a, b)
    assert tag_records(gm, _records(2))
    records, _ = merge_all_reduces(gm, _records(2))
    (merged,) = _reductions(gm)
    assert merged.args[0].target is aten.cat.default and merged.args[1:] == ("sum", "0")
    # one record: both payloads, the ops' names differ so none is named
    assert [(r.kind, r.sent_bytes, r.recv_bytes, r.op) for r in records] == [("all_reduce", 48, 48, None)]
    for got, want in zip(_TwoRanks(gm).run(a, b), before):
        assert torch.equal(got, want)


def test_a_write_between_them_blocks_a_merge_only_where_it_reaches_the_input_read_later() -> None:
    from autoparallel.static.passes import merge_all_reduces, tag_records

    for write, merges in (("own buffer", True), ("x through a view", False)):
        gm = _two_reductions(write=write)
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        before = _TwoRanks(gm).run(a, b)
        assert tag_records(gm, _records(2))
        merge_all_reduces(gm, _records(2))
        assert len(_reductions(gm)) == (1 if merges else 2), write
        for got, want in zip(_TwoRanks(gm).run(a, b), before):
            assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["dependent", "other group", "other reduction", "over the limit"])
def test_all_reduces_that_cannot_be_one_stay_two(case: str) -> None:
    from autoparallel.static.passes import merge_all_reduces, tag_records

    gm = _two_reductions(dependent=case == "dependent", groups=("0", "1") if case == "other group" else ("0", "0"),
                         ops=("sum", "max") if case == "other reduction" else ("sum", "sum"))
    assert tag_records(gm, _records(2))
    records, _ = merge_all_reduces(gm, _records(2), limit=47 if case == "over the limit" else 1 << 20)
    assert len(_reductions(gm)) == 2 and len(records) == 2


def test_a_loss_is_reduced_in_the_program_only_when_it_rides_along() -> None:
    from autoparallel.static.passes import merge_all_reduces, reduce_output, tag_records

    for partner in (True, False):
        g = torch.fx.Graph()
        a, b = g.placeholder("a"), g.placeholder("b")
        loss = _val(g.call_function(aten.sum.default, (a,)))  # scalar, computed first
        grad = _val(g.call_function(aten.mul.Tensor, (b, 2)), 2, 3)
        red = g.call_function(fc.all_reduce.default, (grad, "sum", "0" if partner else "1"))
        g.output((g.call_function(aten.detach.default, (loss,)), g.call_function(fc.wait_tensor.default, (red,))))
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        recs = _records(1)
        assert tag_records(gm, recs)
        node = reduce_output(gm, 0, "sum", "0")
        node.meta["ap_record"] = len(recs)
        recs = recs + _records(1, 4)
        records, merged = merge_all_reduces(gm, recs, [node])
        assert (node in merged) is partner
        assert len(_reductions(gm)) == 1 and len(records) == 1
        x, y = torch.randn(2, 3), torch.randn(2, 3)
        out = _TwoRanks(gm).run(x, y)
        # merged: the loss comes back reduced; alone: as it was (no collective of its own)
        torch.testing.assert_close(out[0], x.sum() * (2 if partner else 1), rtol=0, atol=0)
        torch.testing.assert_close(out[1], y * 2 * 2, rtol=0, atol=0)


def test_records_that_do_not_match_the_program_tag_nothing() -> None:
    from autoparallel.static.passes import tag_records

    gm = _two_reductions()
    assert not tag_records(gm, _records(3))
    assert all("ap_record" not in n.meta for n in _reductions(gm))


# ---- a mean loss: its count reduced first, its sum with the gradients ----------------------
def _mean_loss_step(with_gradients: bool) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """A step as a capture records a token-mean loss over batch shards: the forward, then the
    count (from the targets alone) and the sum reduced apart at the loss, the loss divided; the
    backward seeded with ones scaled by the count; with ``with_gradients`` a gradient reduced
    at the end."""
    g = torch.fx.Graph()
    w, x, t = g.placeholder("w"), g.placeholder("x"), g.placeholder("t")
    n: dict[str, torch.fx.Node] = {}
    n["h"] = _val(g.call_function(aten.mm.default, (x, w)), 4, 4)
    n["s"] = _val(g.call_function(aten.sum.default, (n["h"],)))
    n["valid"] = g.call_function(aten.ne.Scalar, (t, -100))
    n["valid"].meta["val"] = torch.empty(4, dtype=torch.bool)
    n["count"] = _val(g.call_function(aten.sum.default, (n["valid"],)))
    n["countf"] = _val(g.call_function(aten._to_copy.default, (n["count"],), {"dtype": torch.float32}))
    n["ar_count"] = g.call_function(fc.all_reduce.default, (n["countf"], "sum", "0"))
    n["ar_sum"] = g.call_function(fc.all_reduce.default, (n["s"], "sum", "0"))
    n["w_count"] = _val(g.call_function(fc.wait_tensor.default, (n["ar_count"],)))
    n["w_sum"] = _val(g.call_function(fc.wait_tensor.default, (n["ar_sum"],)))
    n["loss"] = _val(g.call_function(aten.div.Tensor, (n["w_sum"], n["w_count"])))
    n["seed"] = _val(g.call_function(aten.ones.default, ([],)))
    n["scale"] = _val(g.call_function(aten.div.Tensor, (n["seed"], n["w_count"])))
    n["grad"] = _val(g.call_function(aten.mul.Tensor, (n["h"], n["scale"])), 4, 4)  # (reads the activation)
    outs: list[Any] = [_val(g.call_function(aten.detach.default, (n["loss"],)))]
    if with_gradients:
        n["ar_grad"] = g.call_function(fc.all_reduce.default, (n["grad"], "sum", "0"))
        outs.append(g.call_function(fc.wait_tensor.default, (n["ar_grad"],)))
    else:
        outs.append(n["grad"])
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g), n


def test_a_mean_loss_count_is_reduced_during_the_forward_and_its_sum_rides_with_the_gradients() -> None:
    from autoparallel.static.passes import merge_all_reduces, tag_records

    gm, n = _mean_loss_step(with_gradients=True)
    w, x, t = torch.randn(4, 4), torch.randn(4, 4), torch.tensor([1, -100, 2, 3])
    before = _TwoRanks(gm).run(w, x, t)
    sink_waits(gm, recompile=False)
    hoist_starts(gm, recompile=False)
    order = _order(gm)
    # the count (with the ops computing it from the targets) starts before the forward's matmul
    assert order.index(n["ar_count"].name) < order.index(n["h"].name)
    assert order.index(n["valid"].name) < order.index(n["count"].name) < order.index(n["ar_count"].name)
    # the loss, which only an output reads, is computed (and its sum waited for) last
    assert order.index(n["loss"].name) > order.index(n["ar_grad"].name)
    assert order.index(n["w_count"].name) < order.index(n["scale"].name) < order.index(n["ar_grad"].name)
    assert tag_records(gm, _records(3))
    records, _ = merge_all_reduces(gm, _records(3))
    first, second = _reductions(gm)
    assert first is n["ar_count"] and len(records) == 2  # the count alone; the sum merged with the gradient
    assert second.args[0].target is aten.cat.default
    gm.recompile()
    for got, want in zip(_TwoRanks(gm).run(w, x, t), before):
        assert torch.equal(got, want)


def test_a_mean_loss_with_nothing_to_ride_along_reduces_its_sum_and_count_together() -> None:
    """Where no other reduction follows, the count and the sum become one collective again: the
    program issues what eager issues."""
    from autoparallel.static.passes import merge_all_reduces, tag_records

    gm, n = _mean_loss_step(with_gradients=False)
    w, x, t = torch.randn(4, 4), torch.randn(4, 4), torch.tensor([1, -100, 2, 3])
    before = _TwoRanks(gm).run(w, x, t)
    sink_waits(gm, recompile=False)
    hoist_starts(gm, recompile=False)
    assert tag_records(gm, _records(2))
    records, _ = merge_all_reduces(gm, _records(2))
    assert len(_reductions(gm)) == 1 and len(records) == 1
    for got, want in zip(_TwoRanks(gm).run(w, x, t), before):
        assert torch.equal(got, want)
