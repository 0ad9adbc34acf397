"""Passes over a captured program (a ``torch.fx.GraphModule`` of one rank's local step).

Each pass keeps the program's values (the same ops on the same inputs; a merged all-reduce sums
the same terms); what changes is when things happen. ``Strategy.overlap`` switches them on or
off. No node moves across an op that writes a tensor in place (a merged all-reduce: across none
that writes the inputs it reads), and random ops never move (the draws keep eager's order).

- ``sink_waits``: a functional collective's ``wait_tensor`` moves down to just before the first
  op that needs its result — together with the cheap ops that only rearrange that result
  (views, ``cat``, ``split``...: our collectives reorder their result from group order to mesh
  order at once), so the compute in between overlaps the communication ("wait at first use").
  Small pure ops computed from a result that only the program's outputs read (a mean loss's sum
  divided by its count) move to the end with it: the step does not wait for the loss.
- ``hoist_starts``: a functional collective (with the cheap ops packing its input) moves up to
  just after the op producing its input, but never above another collective ("start early"): a gradient bucket's all-reduce starts
  as soon as its last gradient exists, overlapping the rest of the backward. A collective
  whose input is only program inputs (a ZeRO-3 parameter all-gather) is a *prefetch*: it moves
  up at most to just after the wait of the previous such collective, so at most one unit ahead
  is gathered early and ZeRO-3 keeps its memory bound. A small collective computed from
  program inputs by a few pure ops (``SMALL_BYTES``, ``SMALL_CHAIN``: a mean loss's token count,
  from the targets) moves up with those ops, so it is reduced while the forward runs and the
  backward, which needs it first, does not wait.
- ``drop_detaches`` (always, whatever ``overlap`` says): a program run without autograd (a local
  region's, a step's whose inputs need no gradient) reads each ``detach``'s input in its place:
  there a detach is only a new alias, and the backward formulas detach what they save (~40 op
  calls per GPT step).
- ``merge_all_reduces``: two all-reduces over the same group, with the same reduction and dtype,
  become one (their inputs flattened into one buffer, the result split back) where neither
  result is needed before both inputs exist: a small reduction is latency-bound, and one start
  instead of two saves a round trip (DDP's bucketing, across whatever the program reduces: a
  LayerNorm weights' bucket with the activation gradient reduced beside it, a loss with the
  backward's first reduction). Up to ``MERGE_BYTES`` in all: above that, copying into one buffer
  costs about what a start does. Runs after ``sink_waits`` and ``hoist_starts`` (a start sits where its input is complete, a wait at its first use).
  A start moved up for its own sake (the count above) is merged into a later one only when
  nothing else merged with that one (then the two are what eager issues: one collective).
  Elementwise the sums are the same; a backend may add each element's terms in another order
  inside a larger buffer (on three or more ranks: the last bit of a float sum).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from autoparallel import compat
from autoparallel.runtime.debug import CommRecord
from spmd_rules.random_ops import draws_random

_FC = torch.ops._c10d_functional
_WAIT = _FC.wait_tensor.default
_AR = _FC.all_reduce.default
MERGE_BYTES = 1 << 20  # all-reduces merge up to this many bytes in all
SMALL_BYTES = 1 << 10  # a collective of at most this many bytes computed from inputs alone starts first; one read only by outputs is waited last
SMALL_CHAIN = 16  # ... by at most this many ops
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


def collectives(gm: torch.fx.GraphModule) -> int:
    """How many collectives ``gm`` issues (its functional collectives' starts)."""
    return sum(_is_start(n) for n in gm.graph.nodes)


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


def drop_detaches(gm: torch.fx.GraphModule, recompile: bool = True) -> int:
    """Read each ``detach``'s input in place of its result, for a program run without autograd
    (a local region's forward inside its autograd node, its backward): there a detach is only a
    new alias (the backward formulas of torch detach what they saved: ~40 per GPT step, each
    an op call). Kept where the result is a program output (a separate tensor object) or an
    in-place op writes it or its metadata. Returns how many went; the graph is recompiled
    (``recompile=False``: the caller does, after its last pass)."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.detach.default or not isinstance(node.args[0], torch.fx.Node):
            continue
        if any(u.op == "output" or _writes(u) for u in node.users):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return dropped


def sink_waits(gm: torch.fx.GraphModule, recompile: bool = True) -> int:
    """Move every ``wait_tensor``, and the cheap ops rearranging its result, to just before the
    first op needing them (see the module docstring); returns how many waits moved. The graph is
    recompiled (``recompile=False``: the caller does, after its last pass)."""
    nodes = list(gm.graph.nodes)
    waits = {n for n in nodes if n.op == "call_function" and n.target is _WAIT}
    chain: set[torch.fx.Node] = set(waits)
    for n in nodes:  # the cheap ops reading only a wait's result (or program inputs)
        if n not in chain and _cheap(n) and any(i in chain for i in n.all_input_nodes) and all(
                i in chain or i.op in ("placeholder", "get_attr") for i in n.all_input_nodes):
            chain.add(n)
    chain |= _read_last(nodes, chain)
    moved = 0
    for node in reversed(nodes):
        if node in chain and _sink(gm, node):
            moved += node in waits
    gm.graph.lint()
    if recompile:
        gm.recompile()
    return moved


def _read_last(nodes: list[torch.fx.Node], chain: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The small pure ops computed from a collective's result (``chain``) that only the
    program's outputs read (a loss divided by its reduced count): they run last, so the
    collective's wait is at the end."""
    reading: set[torch.fx.Node] = set()
    for n in nodes:
        if (n not in chain and not _fixed(n) and _value_bytes(n) <= SMALL_BYTES
                and any(i in chain or i in reading for i in n.all_input_nodes)):
            reading.add(n)
    last: set[torch.fx.Node] = set()
    for n in reversed(nodes):
        if n in reading and n.users and all(u.op == "output" or u in last for u in n.users):
            last.add(n)
    return last


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


def hoist_starts(gm: torch.fx.GraphModule, recompile: bool = True) -> int:
    """Move every functional collective (and the cheap ops packing its input) up to just after
    what it needs, a prefetch at most one collective ahead (see the module docstring); returns
    how many collectives moved. The graph is recompiled (``recompile=False``: the caller does,
    after its last pass)."""
    moved = 0
    prev_prefetch_wait: torch.fx.Node | None = None
    for start in [n for n in gm.graph.nodes if _is_start(n)]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        prefetch = _only_inputs(start)
        floor = prev_prefetch_wait if prefetch else None
        before = order[start]
        computed = not prefetch and _small_of_inputs(start)
        if computed:
            start.meta["ap_early"] = True  # (merging it into a later start would undo this)
        _hoist(start, order, floor, set(), computed)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        moved += order[start] < before
        if prefetch:
            waits = [u for u in start.users if u.target is _WAIT]
            if waits:
                prev_prefetch_wait = waits[0]
    gm.graph.lint()
    if recompile:
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


def _small_of_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node``'s inputs are small (at most ``SMALL_BYTES``) values computed from program
    inputs by a few pure ops (at most ``SMALL_CHAIN``) that nothing else reads but through views:
    a token count from the targets, not a loss from the forward's activations. Those ops may run
    first: no value but their own lives longer."""
    if sum(_value_bytes(i) for i in node.all_input_nodes) > SMALL_BYTES:
        return False
    todo, chain = list(node.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n in chain or n.op in ("placeholder", "get_attr"):
            continue
        chain.add(n)
        if _fixed(n) or len(chain) > SMALL_CHAIN:
            return False
        todo.extend(n.all_input_nodes)
    return all(u is node or u in chain for n in chain if not _alias(n) for u in n.users)


def _alias(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a view of its first input (moving it holds no memory longer)."""
    return _cheap(node) and node.target not in _CHEAP


def _value_bytes(node: torch.fx.Node) -> float:
    """Bytes of ``node``'s value; infinite where it is no tensor or its size is open."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or isinstance(val.numel(), torch.SymInt):
        return float("inf")
    return val.numel() * val.element_size()


def _hoist(node: torch.fx.Node, order: dict[torch.fx.Node, int], floor: torch.fx.Node | None,
           seen: set[torch.fx.Node], computed: bool = False) -> None:
    """Move ``node`` (a collective or a cheap op) up to just after the latest of: its inputs
    (hoisted first when cheap, or with ``computed`` when pure: ``_small_of_inputs``), the last
    write before it, and ``floor``."""
    if node in seen:
        return
    seen.add(node)
    for i in node.all_input_nodes:
        if _cheap(i) or (computed and not _fixed(i)):
            _hoist(i, order, floor, seen, computed)
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


# ---- merging all-reduces ---------------------------------------------------------------------
def tag_records(gm: torch.fx.GraphModule, records: Sequence[CommRecord]) -> bool:
    """Note on each all-reduce node the index of its record in ``records`` (the capture's
    collectives in issue order, one record per functional collective); False, tagging nothing,
    where the two do not correspond one to one."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _AR]
    index = [i for i, r in enumerate(records) if r.kind == "all_reduce"]
    if len(nodes) != len(index):
        return False
    for n, i in zip(nodes, index):
        n.meta["ap_record"] = i
    return True


def reduce_output(gm: torch.fx.GraphModule, index: int, reduce_op: str, group_name: str) -> torch.fx.Node:
    """Reduce the program's output ``index`` over a group before it is returned: the all-reduce
    node (untagged: the caller notes its record)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    value = values[index]
    while isinstance(value, torch.fx.Node) and value.target is _aten.detach.default:  # the program has no autograd
        value = value.args[0]
    with gm.graph.inserting_before(out):
        start = gm.graph.call_function(_AR, (value, reduce_op, group_name))
        values[index] = gm.graph.call_function(_WAIT, (start,))
    out.args = (values, *out.args[1:])
    return start


def merge_all_reduces(gm: torch.fx.GraphModule, records: Sequence[CommRecord],
                      optional: Collection[torch.fx.Node] = (), limit: int = MERGE_BYTES, recompile: bool = True,
                      ) -> tuple[list[CommRecord], set[torch.fx.Node]]:
    """Merge all-reduces (see the module docstring); the nodes must carry their records' indices
    (``tag_records``). An ``optional`` all-reduce (one the caller added, such as a loss reduced
    for free) is kept only if it merged into another; otherwise it is taken out again, its
    input returned as it was. Returns the records of the collectives the program now issues
    and the optional nodes that merged. The graph is recompiled (``recompile=False``: the caller
    does, after its last pass)."""
    kept: list[CommRecord | None] = list(records)
    merged_optional: set[torch.fx.Node] = set()
    delay_early = False  # first without delaying an early start (``hoist_starts``), then with
    while True:
        found = _mergeable_pair(gm, limit, delay_early)
        if found is None and not delay_early:
            delay_early = True
            continue
        if found is None:
            break
        x, y, at = found
        merged_optional |= {n for n in (x, y) if n in optional}
        node = _merge(gm, x, y, at)
        ix, iy = x.meta["ap_record"], y.meta["ap_record"]
        rx, ry = kept[ix], kept[iy]
        assert rx is not None and ry is not None
        kept[min(ix, iy)] = replace(rx, sent_bytes=rx.sent_bytes + ry.sent_bytes, recv_bytes=rx.recv_bytes + ry.recv_bytes,
                                    module=rx.module if rx.module == ry.module else None,
                                    op=rx.op if rx.op == ry.op else None)
        kept[max(ix, iy)] = None
        node.meta["ap_record"] = min(ix, iy)
    for n in optional:
        if n in merged_optional:
            continue
        wait, value = next(iter(n.users)), n.args[0]
        assert isinstance(value, torch.fx.Node)
        wait.replace_all_uses_with(value)
        gm.graph.erase_node(wait)
        gm.graph.erase_node(n)
        kept[n.meta["ap_record"]] = None
    gm.graph.lint()
    if recompile:
        gm.recompile()
    return [r for r in kept if r is not None], merged_optional


def _reduction(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """(group, reduction, dtype) of an all-reduce that may merge: tagged, read by one wait, its
    input's metadata known and contiguous; None otherwise."""
    if node.op != "call_function" or node.target is not _AR or "ap_record" not in node.meta:
        return None
    if len(node.users) != 1 or next(iter(node.users)).target is not _WAIT:
        return None
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_contiguous():
        return None
    return (node.args[2], node.args[1], val.dtype)


def _nbytes(node: torch.fx.Node) -> int:
    val = node.args[0].meta["val"]  # type: ignore[union-attr]
    return compat.whole(val.numel() * val.element_size())  # type: ignore[no-any-return]


def _mergeable_pair(gm: torch.fx.GraphModule, limit: int, delay_early: bool = True,
                    ) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """The first two all-reduces ``x`` before ``y`` that may become one, and the node the merged
    one starts at: ``y`` when ``x``'s result is first needed after ``y`` starts, ``x`` when
    ``y``'s input exists before ``x`` starts. The input read later (or earlier) than before must
    not be written in place in between (through any view of it): decided from the program's
    structure, the same on every rank (a kernel's writes to its own fresh buffers, which may
    differ with a rank's local sizes, are not the inputs' aliases). ``delay_early=False``: not
    by delaying a start ``hoist_starts`` made early (a count the backward needs, started before the
    forward: merged with a later reduction only where nothing else merged with that one)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    starts = [(n, k) for n in nodes if (k := _reduction(n)) is not None]
    for i, (x, kx) in enumerate(starts):
        for y, ky in starts[i + 1:]:
            if ky != kx or _nbytes(x) + _nbytes(y) > limit:
                continue
            wx = next(iter(x.users))
            # x's result not needed before y starts (and x does not start early for its own sake)
            later = order[wx] > order[y] and (delay_early or not x.meta.get("ap_early"))
            earlier = all(order[a] < order[x] for a in y.all_input_nodes)  # y's input there when x starts
            if not (later or earlier):
                continue
            between = nodes[order[x] + 1:order[y]]
            if later and not _written_in(between, x.args[0]):
                return x, y, y
            if earlier and not _written_in(between, y.args[0]):
                return x, y, x
    return None


def _view_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node ``node`` is a view of (its first argument), if it is a view op or a getitem."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, torch.fx.Node) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return None
    if all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        src = node.args[0] if node.args else None
        return src if isinstance(src, torch.fx.Node) else None
    return None


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The indices of ``gm``'s inputs it may write in place (or a view of them)."""
    nodes = list(gm.graph.nodes)
    return [k for k, p in enumerate(n for n in nodes if n.op == "placeholder") if _written_in(nodes, p)]


def _written_in(span: list[torch.fx.Node], value: Any) -> bool:
    """Whether a node of ``span`` may write ``value`` (or a view of it, or what it views) in place."""
    if not isinstance(value, torch.fx.Node):
        return False
    base = value
    while (up := _view_of(base)) is not None:
        base = up
    aliases, todo = {base}, [base]
    while todo:
        for u in todo.pop().users:
            if u not in aliases and _view_of(u) is not None:
                aliases.add(u)
                todo.append(u)
    for n in span:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if n.op != "call_function":
            return True  # a module or method call: anything may be written
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        for k, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                arg = n.args[k] if k < len(n.args) else n.kwargs.get(a.name)
                if arg in aliases:
                    return True
    return False


def _merge(gm: torch.fx.GraphModule, x: torch.fx.Node, y: torch.fx.Node, at: torch.fx.Node) -> torch.fx.Node:
    """One all-reduce of ``x``'s and ``y``'s inputs, flattened and joined, started at ``at`` and
    waited for where the first of the two was; each old result is its piece, viewed back."""
    g = gm.graph
    wx, wy = next(iter(x.users)), next(iter(y.users))
    order = {n: i for i, n in enumerate(g.nodes)}
    first_wait = wx if order[wx] < order[wy] else wy
    vals = [x.args[0].meta["val"], y.args[0].meta["val"]]  # type: ignore[union-attr]
    with g.inserting_before(at):
        flat = [g.call_function(_aten.reshape.default, (n.args[0], [-1])) for n in (x, y)]
        # (a size of a capture's open sizes is read from the tensor here, as the program runs)
        shapes = [[d if isinstance(d, int) else g.call_function(_aten.sym_size.int, (n.args[0], k))
                   for k, d in enumerate(v.shape)] for n, v in zip((x, y), vals)]
        numels = [v.numel() if isinstance(v.numel(), int) else g.call_function(_aten.sym_numel.default, (n.args[0],))
                  for n, v in zip((x, y), vals)]
        start = g.call_function(_AR, (g.call_function(_aten.cat.default, (flat,)), x.args[1], x.args[2]))
    start.args[0].meta["val"] = torch.empty(sum(v.numel() for v in vals), dtype=vals[0].dtype, device="meta")  # type: ignore[union-attr]
    with g.inserting_before(first_wait):
        wait = g.call_function(_WAIT, (start,))
        parts = g.call_function(_aten.split_with_sizes.default, (wait, numels))
        views = [g.call_function(_aten.view.default, (g.call_function(operator.getitem, (parts, k)), shape))
                 for k, shape in enumerate(shapes)]
    wx.replace_all_uses_with(views[0])
    wy.replace_all_uses_with(views[1])
    for n in (wx, wy, x, y):
        g.erase_node(n)
    return start
