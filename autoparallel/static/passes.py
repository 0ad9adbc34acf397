"""Passes over a captured program (a ``torch.fx.GraphModule`` of one rank's local step).

Each pass keeps the program's values exactly (the same ops on the same inputs); what changes is
when things happen. ``Strategy`` switches them on or off.

- ``sink_waits`` (``Strategy.overlap``): a functional collective starts where the capture
  issued it, and its ``wait_tensor`` moves down to just before the first op that needs its
  result, so the compute in between overlaps the communication ("start early, wait at first
  use"). A wait never moves past an op that writes a tensor in place (the collective may still
  be reading it) or past the program's end.
"""

from __future__ import annotations


import torch

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write a tensor in place (a mutable schema, or not an aten-style op)."""
    if node.op != "call_function":
        return node.op not in ("placeholder", "get_attr", "output")
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False  # operator.getitem and other pure Python functions
    return bool(schema.is_mutable)


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Move every ``wait_tensor`` to just before its first user (see the module docstring);
    returns how many moved. The graph is recompiled."""
    nodes = list(gm.graph.nodes)
    moved = 0
    for wait in [n for n in nodes if n.op == "call_function" and n.target is _WAIT]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        users = [u for u in wait.users]
        if not users:
            continue
        first = min(users, key=lambda u: order[u])
        stop = first
        cur = wait.next
        while cur is not first:  # the first op in between that writes bounds the move
            if _writes(cur):
                stop = cur
                break
            cur = cur.next
        if stop is not wait.next:
            stop.prepend(wait)
            moved += 1
    gm.graph.lint()
    gm.recompile()
    return moved

