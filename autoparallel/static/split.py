"""Split a captured forward-and-backward program into a forward program and a backward program.

A pipeline schedule runs a chunk's forward and its backward at different times (1F1B), so a
chunk captured as one joint program (forward, then ``autograd.grad`` of its output) is cut in
two: the forward program computes the forward outputs and returns, next to them, the values the
backward needs (*saved* values: activations, and program inputs the backward reads); the
backward program takes the saved values and the output gradients ("tangents") and returns the
gradients. Every node runs in exactly one of the two, in its original order, so the two
programs together compute what the joint one computes, op for op.

Which side a node is on: the forward side is every node recorded before the last forward output
(the forward phase of the trace) or before a write that comes ahead of the first read of an
output gradient (a batch norm's running statistics, updated after its output); the rest is the
backward, so each side keeps its in-place writes in their order. The forward outputs must not read an output gradient (``SplitError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SplitError(ValueError):
    """The joint program cannot be split safely (the reason is the message)."""


@dataclass(frozen=True)
class Split:
    """The two programs: ``forward(*primals) -> (*outputs, *saved)`` and
    ``backward(*saved, *tangents) -> grads``."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    num_outputs: int
    num_saved: int


def split_joint(gm: torch.fx.GraphModule, num_primals: int, num_outputs: int) -> Split:
    """Cut ``gm`` (placeholders: ``num_primals`` primals, then tangents; output: a flat tuple of
    ``num_outputs`` forward outputs, then the gradients) into forward and backward programs."""
    graph = gm.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    primals, tangents = places[:num_primals], places[num_primals:]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    fwd_outs, grads = outs[:num_outputs], outs[num_outputs:]
    # the forward side: every node recorded before the last forward output (the forward phase of
    # the joint trace; autograd.grad starts after it), so in-place writes stay on their side and
    # in their order
    order = {n: i for i, n in enumerate(graph.nodes)}
    bound = max((order[o] for o in fwd_outs if isinstance(o, torch.fx.Node)), default=-1)
    # and every write recorded after it but before the backward reads an output gradient: a
    # forward's last writes (a batch norm's running statistics, updated after its output) are
    # the forward's
    first_read = min((order[u] for t in tangents for u in t.users), default=len(order))
    bound = max([bound] + [order[n] for n in graph.nodes if bound < order[n] < first_read and _writes(n)])
    forward = {n for n in graph.nodes if order[n] <= bound and n.op == "call_function"}
    if any(t in forward or any(u in forward for u in t.users) for t in tangents):
        raise SplitError("a forward output depends on an output gradient")
    backward = [n for n in graph.nodes if n.op == "call_function" and n not in forward]
    needed = {i for n in backward for i in n.all_input_nodes} | {g for g in grads if isinstance(g, torch.fx.Node)}
    saved = [n for n in graph.nodes if n in needed and (n in forward or n in primals)]

    fg = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in primals:
        env[p] = fg.placeholder(p.name)
    for n in graph.nodes:
        if n in forward:
            env[n] = fg.node_copy(n, lambda a: _value(fg, env, a))
    fg.output(tuple(_value(fg, env, o) if isinstance(o, torch.fx.Node) else o for o in fwd_outs)
              + tuple(env[s] for s in saved))

    bg = torch.fx.Graph()
    benv: dict[torch.fx.Node, torch.fx.Node] = {}
    for s in saved:
        benv[s] = bg.placeholder("saved_" + s.name)
    for t in tangents:
        benv[t] = bg.placeholder(t.name)
    for n in backward:
        benv[n] = bg.node_copy(n, lambda a: _value(bg, benv, a))
    bg.output(tuple(_value(bg, benv, g) if isinstance(g, torch.fx.Node) else g for g in grads))
    return Split(torch.fx.GraphModule(gm, fg), torch.fx.GraphModule(gm, bg), len(fwd_outs), len(saved))


def _writes(n: torch.fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _value(g: torch.fx.Graph, env: dict[torch.fx.Node, torch.fx.Node], a: torch.fx.Node) -> torch.fx.Node:
    """``a``'s node in ``g``: a constant the trace kept as an attribute (``get_attr``: a tensor a
    model builds in its forward, as ``torch.tensor(...)``) is read in each program that uses it,
    not carried from the forward to the backward."""
    if a not in env and a.op == "get_attr":
        env[a] = g.get_attr(str(a.target))
    return env[a]


@dataclass(frozen=True)
class InputWeightSplit:
    """A backward program cut for a zero-bubble schedule: ``input_grad(*args) -> (g_in, *carry)``
    and ``weight_grads(*carry) -> weight grads``."""

    input_grad: torch.fx.GraphModule
    weight_grads: torch.fx.GraphModule
    num_carry: int


def split_input_weight(gm: torch.fx.GraphModule) -> InputWeightSplit:
    """Cut a backward program whose last output is the input's gradient (the others: the
    weights' gradients) into the part that computes the input's gradient and the rest.

    The input-gradient part is every op the last output depends on; the weight part is every
    other op, run later on the values it reads from the first part (the *carry*: computed
    values and program inputs). Each op runs once, on one side, in its original order there.
    Refused (``SplitError``) where moving the weight part after the input part could change a
    value: an op writing a tensor in place, or a random draw."""
    from spmd_rules.random_ops import draws_random

    graph = gm.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    if not outs or not isinstance(outs[-1], torch.fx.Node):
        raise SplitError("the backward program returns no input gradient to split on")
    calls = [n for n in graph.nodes if n.op == "call_function"]
    for n in calls:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            raise SplitError(f"the backward writes a tensor in place ({n.target}): its ops keep their order")
        if draws_random(n.target, n.args, n.kwargs):
            raise SplitError(f"the backward draws random numbers ({n.target}): its ops keep their order")
    first: set[torch.fx.Node] = set()
    todo = [outs[-1]]
    while todo:
        n = todo.pop()
        if n in first or n.op != "call_function":
            continue
        first.add(n)
        todo.extend(n.all_input_nodes)
    later = [n for n in calls if n not in first]
    needed = {i for n in later for i in n.all_input_nodes} | {o for o in outs[:-1] if isinstance(o, torch.fx.Node)}
    carry = [n for n in graph.nodes if n in needed and (n in first or n in places or n.op == "get_attr")]
    carry = [n for n in carry if n.op != "get_attr"]  # constants are read where used

    ig = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in places:
        env[p] = ig.placeholder(p.name)
    for n in calls:
        if n in first:
            env[n] = ig.node_copy(n, lambda a: _value(ig, env, a))
    ig.output((_value(ig, env, outs[-1]),) + tuple(_value(ig, env, c) for c in carry))

    wg = torch.fx.Graph()
    wenv: dict[torch.fx.Node, torch.fx.Node] = {}
    for c in carry:
        wenv[c] = wg.placeholder("carry_" + c.name)
    for n in later:
        wenv[n] = wg.node_copy(n, lambda a: _value(wg, wenv, a))
    wg.output(tuple(_value(wg, wenv, o) if isinstance(o, torch.fx.Node) else o for o in outs[:-1]))
    return InputWeightSplit(torch.fx.GraphModule(gm, ig), torch.fx.GraphModule(gm, wg), len(carry))
