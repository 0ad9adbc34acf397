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

Memory: a micro-batch waiting for its ``W`` keeps only what ``W`` reads. A forward run under
:class:`SavedByForward` puts each tensor it saves in a slot; ``B`` notes which autograd node read
each slot, and afterwards empties those read only by nodes ``W`` never runs (a GELU's input, a
softmax's output, the loss's operands), which is what lets a zero-bubble schedule hold more
micro-batches than 1F1B in the same memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from autoparallel import compat

GradientEdge = torch.autograd.graph.GradientEdge
get_gradient_edge = torch.autograd.graph.get_gradient_edge


class _Slot:
    # No reference to its SavedByForward nor to an autograd node: the graph holds the slot, and
    # either would make a reference cycle through autograd that Python's collector cannot see.
    __slots__ = ("held", "inner", "reader")

    def __init__(self, held: Any, inner: Any) -> None:
        self.held: Any = held  # the tensor (or the inner hooks' holder); None once released
        self.inner: Any = inner  # the inner hooks' unpack, or None
        self.reader: int | None = None  # id() of the autograd node that read it during B


class SavedByForward:
    """The tensors one forward saves for backward, in slots :func:`input_grad` can empty.

    ``inner``: hooks of the same shape (``pack``/``unpack``, e.g. an
    :class:`~autoparallel.pipeline.ActivationMeter`) the tensors pass through, so a meter counts
    a released tensor as freed.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.slots: list[_Slot] = []

    def pack(self, t: torch.Tensor) -> _Slot:
        slot = _Slot(t, None) if self.inner is None else _Slot(self.inner.pack(t), self.inner.unpack)
        self.slots.append(slot)
        return slot

    @staticmethod
    def unpack(slot: Any) -> torch.Tensor:
        if not isinstance(slot, _Slot):  # (packed after this object was dropped: kept as is)
            return slot
        if slot.held is None:  # (cannot happen: only what no node of W reads is released)
            raise RuntimeError("zero-bubble W: a tensor saved for backward was released after B, yet W reads it")
        node = compat.current_autograd_node()
        if node is not None:  # (B's walk of the graph keeps every node's Python object, so ids are stable)
            slot.reader = id(node)
        return slot.held if slot.inner is None else slot.inner(slot.held)

    @contextmanager
    def track(self) -> Iterator[SavedByForward]:
        """Run the forward inside this block."""
        me = weakref.ref(self)  # the graph keeps its hooks: a bound method would keep these slots

        @compat.mark_own_observer
        def pack(t: torch.Tensor) -> Any:
            saved = me()
            return saved.pack(t) if saved is not None else t

        with torch.autograd.graph.saved_tensors_hooks(pack, SavedByForward.unpack):
            yield self

    def release(self, keep: set[Any]) -> None:
        """Empty every slot read during ``B`` by a node outside ``keep`` (the nodes ``W`` runs);
        call it while the graph's nodes are alive."""
        ids = {id(n) for n in keep}
        for slot in self.slots:
            if slot.reader is not None and slot.reader not in ids:
                slot.held = None
        self.slots = []


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    nodes: list[Any] = field(default_factory=list)  # intermediates, autograd nodes
    grads: dict[Any, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # node -> kept grad_outputs
    root: tuple[Any, torch.Tensor] | None = None  # (the output's edge, its gradient) when the output's node starts it


@dataclass
class WeightWork:
    """What ``W`` needs of one micro-batch: the kept gradients at the intermediates, whose nodes
    keep the graph below them (what the weights' branches read) alive until ``W`` has run; the
    nodes above every intermediate (a loss, the output's last ops) are freed once ``B`` returns."""

    groups: list[_Group]
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
            children: dict[Any, list[Any]], parents: dict[Any, list[Any]]) -> list[_Group]:
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


def _weight_nodes(groups: list[_Group], children: dict[Any, list[Any]], parents: dict[Any, list[Any]]) -> set[Any]:
    """Every node ``W`` may run: below a group's intermediates and above one of its parameters."""
    out: set[Any] = set()
    for group in groups:
        up = _above([get_gradient_edge(p).node for p in group.params], parents)
        seen: set[Any] = set()
        todo = [n for n in group.nodes if n in up]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(k for k in children[n] if k in up)
        out |= seen
    return out


def input_grad(out: torch.Tensor, grad_out: torch.Tensor | None, x: torch.Tensor | None,
               params: Sequence[torch.Tensor], saved: SavedByForward | None = None,
               whole: str | None = None) -> tuple[torch.Tensor | None, WeightWork]:
    """``B``: the gradient of ``x`` (None when ``x`` is None or unused) from ``out``'s gradient
    ``grad_out`` (None: ``out`` is a scalar loss, gradient 1), and the work ``W`` needs.

    ``saved``: the tensors ``out``'s forward saved (run under it); those read by ``B`` only are
    released when ``B`` returns. ``whole``: why this backward must run whole now (the caller
    knows; ``W`` then has nothing left to do)."""
    root = out.grad_fn
    if root is None:
        return None, WeightWork([])
    g = torch.ones_like(out) if grad_out is None else grad_out
    children = _children(root)
    if whole is None and any(n.name() == compat.REENTRANT_CHECKPOINT_NODE for n in children):  # (refuses autograd.grad)
        whole = "it runs a reentrant torch.utils.checkpoint (use_reentrant=True), which computes all its gradients at once"
    if whole is not None:
        torch.autograd.backward(out, g)
        return (x.grad if x is not None else None), WeightWork([], whole)
    x_node = get_gradient_edge(x).node if x is not None and x.requires_grad else None
    trained = [p for p in params if p.requires_grad]
    parents = _parents(children)
    groups = _groups(root, x_node, trained, children, parents)
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
    if saved is not None:
        saved.release(_weight_nodes(groups, children, parents))
    return gx, WeightWork(groups)


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


__all__ = ["SavedByForward", "WeightWork", "input_grad", "weight_grads"]
