"""A stage's backward in two parts, for zero-bubble schedules: ``B`` now, ``W`` later.

``B`` (:func:`input_grad`) computes the gradient of the stage's input — what the previous stage
waits for — and keeps, for each group of parameters, the gradient that reached the autograd
nodes where the parameters' branches leave the input's path (the *intermediates*).
``W`` (:func:`weight_grads`) starts autograd at those intermediates with the kept gradients and
runs only the parameters' branches, adding the results into ``.grad``.

Which nodes are intermediates is read from the autograd graph of the stage's output: the input's
path is every node from which the input's gradient edge can be reached; walking up from each
parameter's accumulator, the first nodes on that path (or the output's own node) are where its
gradient must start. Parameters that meet at a common intermediate form one group; each group is
one ``autograd.grad`` call whose inputs are that group's parameters only, so ``W`` never redoes
the input's path. Where one group starts at two nodes and one lies below the other, the lower
one's kept gradient replaces what flows into it (a pre-hook), so nothing is counted twice.

The arithmetic is autograd's own: each node computes the same gradients as in one backward, and
the parameters' gradients are added into ``.grad`` in the order the schedule runs ``W``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoparallel import compat

GradientEdge = torch.autograd.graph.GradientEdge
get_gradient_edge = torch.autograd.graph.get_gradient_edge


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    nodes: list[Any] = field(default_factory=list)  # intermediates, autograd nodes
    grads: dict[Any, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # node -> kept grad_outputs
    root: tuple[Any, torch.Tensor] | None = None  # (the output's edge, its gradient) when the output's node starts it


@dataclass
class WeightWork:
    """What ``W`` needs of one micro-batch: the kept gradients, and the output keeping the graph."""

    groups: list[_Group]
    keep: Any  # the output (and so the autograd graph) until W has run
    whole: str | None = None  # why B already ran the whole backward (W has nothing left to do)


def _children(root: Any) -> dict[Any, list[Any]]:
    """Every autograd node below ``root`` with its next functions (iterative: deep stages)."""
    out: dict[Any, list[Any]] = {}
    todo = [root]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        kids = [f for f, _ in n.next_functions if f is not None]
        out[n] = kids
        todo.extend(kids)
    return out


def _parents(children: dict[Any, list[Any]]) -> dict[Any, list[Any]]:
    up: dict[Any, list[Any]] = {n: [] for n in children}
    for n, kids in children.items():
        for k in kids:
            up[k].append(n)
    return up


def _above(starts: Sequence[Any], parents: dict[Any, list[Any]]) -> set[Any]:
    """``starts`` and every node from which one of them can be reached."""
    seen = {s for s in starts if s in parents}
    todo = list(seen)
    while todo:
        for q in parents[todo.pop()]:
            if q not in seen:
                seen.add(q)
                todo.append(q)
    return seen


def _groups(root: Any, x_node: Any | None, params: Sequence[torch.Tensor],
            children: dict[Any, list[Any]]) -> list[_Group]:
    parents = _parents(children)
    rank = {n: i for i, n in enumerate(children)}  # the walk's order: the same graph gives it on every rank
    on_path = _above([x_node], parents) if x_node is not None else set()
    on_path.add(root)
    by_node: dict[Any, _Group] = {}
    groups: list[_Group] = []
    for prm in params:
        acc = get_gradient_edge(prm).node
        if acc not in parents:
            continue  # not used by this output: no gradient, as in one backward
        found: set[Any] = set()
        seen = {acc}
        todo = [acc]
        while todo:
            for q in parents[todo.pop()]:
                if q in seen:
                    continue
                seen.add(q)
                if q in on_path:
                    found.add(q)
                else:
                    todo.append(q)
        joined = list(dict.fromkeys(by_node[n] for n in sorted(found, key=rank.__getitem__) if n in by_node))
        group = joined[0] if joined else _Group([])
        for other in joined[1:]:  # one parameter joins two groups: they become one
            group.params.extend(other.params)
            for n in other.nodes:
                by_node[n] = group
            group.nodes.extend(other.nodes)
            groups.remove(other)
        if not joined:
            groups.append(group)
        group.params.append(prm)
        for n in sorted(found, key=rank.__getitem__):
            if n not in by_node:
                by_node[n] = group
                group.nodes.append(n)
    return groups


def input_grad(out: torch.Tensor, grad_out: torch.Tensor | None, x: torch.Tensor | None,
               params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, WeightWork]:
    """``B``: the gradient of ``x`` (None when ``x`` is None or unused) from ``out``'s gradient
    ``grad_out`` (None: ``out`` is a scalar loss, gradient 1), and the work ``W`` needs."""
    root = out.grad_fn
    if root is None:
        return None, WeightWork([], None)
    g = torch.ones_like(out) if grad_out is None else grad_out
    children = _children(root)
    if any(n.name() == compat.REENTRANT_CHECKPOINT_NODE for n in children):  # (refuses autograd.grad: whole in B)
        torch.autograd.backward(out, g)
        why = "it runs a reentrant torch.utils.checkpoint (use_reentrant=True), which computes all its gradients at once"
        return (x.grad if x is not None else None), WeightWork([], None, why)
    x_node = get_gradient_edge(x).node if x is not None and x.requires_grad else None
    trained = [p for p in params if p.requires_grad]
    groups = _groups(root, x_node, trained, children)
    out_edge = get_gradient_edge(out)
    handles = []
    try:
        for group in groups:
            for n in group.nodes:
                if n is root:  # the output's own node: its gradient is the one given
                    group.root = (out_edge, g)
                    continue

                def keep(grad_outputs: tuple[torch.Tensor | None, ...], group: _Group = group, n: Any = n) -> None:
                    group.grads[n] = tuple(grad_outputs)

                handles.append(n.register_prehook(keep))
        gx = None
        if x_node is not None:
            assert x is not None
            (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return gx, WeightWork(groups, out)


def weight_grads(work: WeightWork) -> None:
    """``W``: every parameter group's gradients from its kept intermediates, added into ``.grad``."""
    for group in work.groups:
        edges, grads = ([group.root[0]], [group.root[1]]) if group.root is not None else ([], [])
        for n in group.nodes:
            for i, gi in enumerate(group.grads.get(n, ())):
                if gi is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(gi)
        if not edges:
            continue
        handles = []
        try:
            if len(group.nodes) > 1:  # a lower intermediate takes its kept gradient, not also what flows in
                for n in group.nodes:  # (the output's node is the top: nothing flows into it)
                    kept = group.grads.get(n)
                    if kept is not None:
                        handles.append(n.register_prehook(lambda _g, kept=kept: kept))
            dws = torch.autograd.grad(edges, group.params, grads, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            for prm, dw in zip(group.params, dws):
                if dw is None:
                    continue
                prm.grad = dw if prm.grad is None else prm.grad + dw
    work.groups = []
    work.keep = None


__all__ = ["WeightWork", "input_grad", "weight_grads"]
