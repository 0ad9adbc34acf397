"""Passes over a captured program (a ``torch.fx.GraphModule`` of one rank's local step).

Each pass keeps the program's values exactly (the same ops on the same inputs); what changes is
when things happen. ``Strategy.overlap`` switches them on or off. No node moves across an op
that writes a tensor in place, and random ops never move (the draws keep eager's order).

- ``sink_waits``: a functional collective's ``wait_tensor`` moves down to just before the first
  op that needs its result — together with the cheap ops that only rearrange that result
  (views, ``cat``, ``split``...: our collectives reorder their result from group order to mesh
  order at once), so the compute in between overlaps the communication ("wait at first use").
- ``hoist_starts``: a functional collective (with the cheap ops packing its input) moves up to
  just after the op producing its input, but never above another collective ("start early"): a gradient bucket's all-reduce starts
  as soon as its last gradient exists, overlapping the rest of the backward. A collective
  whose input is only program inputs (a ZeRO-3 parameter all-gather) is a *prefetch*: it moves
  up at most to just after the wait of the previous such collective, so at most one unit ahead
  is gathered early and ZeRO-3 keeps its memory bound.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd_rules.random_ops import draws_random

_FC = torch.ops._c10d_functional
_WAIT = _FC.wait_tensor.default
_aten = torch.ops.aten
# ops that only move or repack data: cheap to run a little earlier or later
_CHEAP = {
    _aten.cat.default, _aten.stack.default, _aten.clone.default, _aten._to_copy.default,
    _aten.constant_pad_nd.default, _aten.new_zeros.default, _aten.contiguous.default,
    _aten.flatten.using_ints, _aten._unsafe_view.default, _aten.permute.default,
}


def _is_start(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is not _WAIT
            and getattr(node.target, "namespace", None) == "_c10d_functional")


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write a tensor in place (a mutable schema, or not an aten-style op)."""
    if node.op != "call_function":
        return node.op not in ("placeholder", "get_attr", "output")
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False  # operator.getitem and other pure Python functions
    return bool(schema.is_mutable)


def _fixed(node: torch.fx.Node) -> bool:
    """A node that never moves: not a call, a write, or a random draw."""
    return node.op != "call_function" or _writes(node) or draws_random(node.target, node.args, node.kwargs)


def _cheap(node: torch.fx.Node) -> bool:
    """A pure op that only views, moves or repacks data (``getitem`` included)."""
    if _fixed(node):
        return False
    if node.target in _CHEAP:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True  # operator.getitem of a multi-output op
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Move every ``wait_tensor``, and the cheap ops rearranging its result, to just before the
    first op needing them (see the module docstring); returns how many waits moved. The graph is
    recompiled."""
    nodes = list(gm.graph.nodes)
    waits = {n for n in nodes if n.op == "call_function" and n.target is _WAIT}
    chain: set[torch.fx.Node] = set(waits)
    for n in nodes:  # the cheap ops reading only a wait's result (or program inputs)
        if n not in chain and _cheap(n) and any(i in chain for i in n.all_input_nodes) and all(
                i in chain or i.op in ("placeholder", "get_attr") for i in n.all_input_nodes):
            chain.add(n)
    moved = 0
    for node in reversed(nodes):
        if node in chain and _sink(gm, node):
            moved += node in waits
    gm.graph.lint()
    gm.recompile()
    return moved


def _sink(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Move ``node`` down to just before its first user, never past a write; True if it moved."""
    users = set(node.users)
    if not users:
        return False
    stop = cur = node.next
    while cur not in users and cur.op != "output":
        if _writes(cur):
            break
        cur = cur.next
        stop = cur
    if stop is node.next:
        return False
    stop.prepend(node)
    return True


def hoist_starts(gm: torch.fx.GraphModule) -> int:
    """Move every functional collective (and the cheap ops packing its input) up to just after
    what it needs, a prefetch at most one collective ahead (see the module docstring); returns
    how many collectives moved. The graph is recompiled."""
    moved = 0
    prev_prefetch_wait: torch.fx.Node | None = None
    for start in [n for n in gm.graph.nodes if _is_start(n)]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        prefetch = _only_inputs(start)
        floor = prev_prefetch_wait if prefetch else None
        before = order[start]
        _hoist(start, order, floor, set())
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        moved += order[start] < before
        if prefetch:
            waits = [u for u in start.users if u.target is _WAIT]
            if waits:
                prev_prefetch_wait = waits[0]
    gm.graph.lint()
    gm.recompile()
    return moved


def _only_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads program inputs only, through cheap ops."""
    todo, seen = list(node.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if not _cheap(n):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _hoist(node: torch.fx.Node, order: dict[torch.fx.Node, int], floor: torch.fx.Node | None,
           seen: set[torch.fx.Node]) -> None:
    """Move ``node`` (a collective or a cheap op) up to just after the latest of: its inputs
    (hoisted first when cheap), the last write before it, and ``floor``."""
    if node in seen:
        return
    seen.add(node)
    for i in node.all_input_nodes:
        if _cheap(i):
            _hoist(i, order, floor, seen)
            order.update({n: k for k, n in enumerate(node.graph.nodes)})
    after: Any = max(node.all_input_nodes, key=lambda i: order[i], default=None)
    cur = node.prev
    start = _is_start(node)
    while cur.op != "root" and cur is not after and cur is not floor and not _writes(cur) and not (start and _is_start(cur)):
        cur = cur.prev
    # ``cur``: the latest of the inputs, the floor, the last write and (for a collective) the
    # last collective before ``node``: collectives keep their order, so every rank issues them
    # in the same order whatever its local shapes made of the ops around them
    if cur.op == "root":
        cur = _last_placeholder(node.graph)
    if cur is not node.prev:
        cur.append(node)


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    last = None
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        last = n
    assert last is not None
    return last
