"""A captured call run: the forward program on the call's shards, and, where it has a backward,
one autograd node (``_Node``) whose backward runs the backward program on the values the forward
kept and the output gradients (``regions.program`` captures the programs).

The forward's values are saved as autograd saves tensors, so checkpoint's and ZeRO-3's hooks see
them. The call's output is assembled as the capture found it: tensors the program computed
(wrapped in their layouts), arguments and object arguments returned as they are, objects the
forward made rebuilt around this call's tensors (``objects.Made``). A backward that keeps its graph
(``create_graph=True``) runs the module again op by op (``Again``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.compat import tree_flatten, tree_unflatten
from autoparallel.engine import layout
from autoparallel.regions import objects
from autoparallel.regions.program import Inputs, Programs, computed, coordinate, tangent_spec
from autoparallel.runtime.debug import replay


def run_call(progs: Programs, state: Sequence[torch.Tensor], leaves: list[Any], module: nn.Module,
             again: Again | None = None) -> Any:
    """The call of ``module``: its output, the forward program on this call's shards, one
    autograd node when it has a backward; what it writes into object arguments is put there.
    ``again``: how to run the call op by op (for a backward that keeps its graph)."""
    inputs = Inputs.of(state, [*leaves, *(objects.get(leaves, p) for p in progs.reads)])
    locs = inputs.locals()
    if progs.backward is None or not torch.is_grad_enabled():
        outs = progs.forward(*locs)
        replay(progs.records[:progs.n_forward], within=module)
        out = _assemble(progs, list(outs[:progs.n_tensors]), {}, inputs.tensors, leaves)
    else:
        call = _Call(progs, locs, module)
        if again is not None and not progs.objects:  # (held weakly: kept only where something else keeps them)
            call.again, call.leaves, call.state = again, [_weak(x) for x in leaves], [id(t) for t in state]
        diff = _Node.apply(call, *[inputs.tensors[k] for k in progs.wrt])
        out = _assemble(progs, call.outs, dict(zip(progs.tangents, diff)), inputs.tensors, leaves)
        call.outs = []  # (the node keeps the call until its backward: not its outputs)
    if not progs.objects:
        return out
    out, written = out
    objects.put(leaves, progs.writes, written)
    objects.put(leaves, [p for p, _ in progs.sets], [v for _, v in progs.sets])
    return out


@dataclass
class Again:
    """A call run op by op: ``run(*args, **kwargs)`` the module's forward on DistTensors (its
    submodules' regions plain), ``tree`` the call's argument nesting, ``state()`` what the
    module's parameter and buffer slots hold now, ``modules`` the module and its submodules."""

    run: Callable[..., Any]
    tree: Any
    state: Callable[[], list[torch.Tensor]]
    modules: list[nn.Module]


class _Call:
    def __init__(self, progs: Programs, locs: list[torch.Tensor], module: nn.Module) -> None:
        self.progs = progs
        self.module = module
        self.locs = locs
        self.device: torch.device | None = None
        self.outs: list[torch.Tensor] = []
        self.again: Again | None = None  # (with the arguments and state of the call, for ``_graph_kept``)
        self.leaves: list[Any] = []      # the arguments, tensors as weak references
        self.state: list[int] = []       # ids of what the slots held
        self.wrt: list[Any] = []         # weak references to the inputs differentiated


def _graph_kept(call: _Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    """The backward of a call with its graph kept (``create_graph=True``: a gradient penalty): the
    module's forward again, op by op on DistTensors from the call's arguments and parameters, and
    autograd's backward of it, differentiable (the backward program has no backward of its own)."""
    again = call.again
    leaves = [x() if isinstance(x, weakref.ref) else x for x in call.leaves]
    wrt = [r() for r in call.wrt]
    if (again is None or [id(t) for t in again.state()] != call.state
            or any(x is None for x, w in zip(leaves, call.leaves) if isinstance(w, weakref.ref)) or any(t is None for t in wrt)):
        # (no way back to the call: an object argument written, parameters a ZeRO-3 unit gathered
        # and let go, an argument nothing else kept)
        raise RuntimeError(
            f"a local region's backward cannot keep its graph (create_graph=True) here: run "
            f"{type(call.module).__name__} op by op for it (ap.disable_local_regions(module), or "
            "AUTOPARALLEL_LOCAL_REGIONS=0)")
    # the inputs differentiated enter as aliases (``view_as``): the gradients taken here are the
    # node's, and the tensors' own hooks run once, when autograd hands them on
    alias = {id(t): t.view_as(t) for t in wrt}
    leaves = [alias.get(id(x), x) for x in leaves]
    a, kw = tree_unflatten(leaves, again.tree)
    with compat.tensors_stood_in(again.modules, alias):
        outs = _flat_outputs(call.progs, again.run(*a, **kw))
    pairs = [(outs[i], g) for i, g in zip(call.progs.tangents, grads) if g is not None]
    if not pairs:
        return (None,) * len(wrt)
    got = torch.autograd.grad([o for o, _ in pairs], [alias[id(t)] for t in wrt], [g for _, g in pairs],
                              create_graph=True, allow_unused=True)
    return tuple(got)


def _weak(x: Any) -> Any:
    return weakref.ref(x) if isinstance(x, torch.Tensor) else x


def _assemble(progs: Programs, locs: list[torch.Tensor], diff: dict[int, torch.Tensor],
              inputs: list[torch.Tensor], call_leaves: list[Any]) -> Any:
    """The call's output: ``locs`` (the forward program's outputs) wrapped in their layouts (the
    differentiable ones, ``diff``, as the node gave them), values, arguments (``inputs``) and
    object arguments (``call_leaves``) returned as they are, objects made rebuilt."""
    got: list[Any] = []
    k = 0
    for i, o in enumerate(progs.outs):
        if o[0] == "value":
            got.append(o[1])
        elif o[0] == "input":
            got.append(inputs[o[1]])
        elif o[0] == "given":
            got.append(call_leaves[o[1]])
        elif o[0] == "made" or o[0] == "same":
            got.append(None)  # (below: its tensors come after the leaves)
        else:
            loc = locs[k]
            k += 1
            got.append(diff[i] if i in diff else layout.wrap(loc, o[1], o[2]) if o[0] == "dist" else loc)
    for i, o in enumerate(progs.outs):
        if o[0] == "made":
            got[i] = o[1].build(got[o[2]:o[2] + o[1].n])
        elif o[0] == "same":
            got[i] = got[o[1]]
    return tree_unflatten(got[:progs.tree.num_leaves], progs.tree)


def _flat_outputs(progs: Programs, out: Any) -> list[Any]:
    """An output of the call run op by op, flattened as the capture flattened its own: the leaves,
    then the tensors of the objects the forward made."""
    leaves, _ = tree_flatten(out)
    return leaves + [t for o, x in zip(progs.outs, leaves) if o[0] == "made" for t in o[1].tensors(x)]


def give_directly(ctx: Any, grads: list[Any]) -> None:
    """Give each parameter without a gradient its gradient directly, in place of autograd's
    accumulation node (whose ``detach`` of a DistTensor gradient costs a trip through
    ``__torch_dispatch__`` per parameter per step). The node then receives no gradient.

    Only where the node would store the gradient as it is: this ``backward()`` runs the node
    (not ``autograd.grad``, which captures gradients instead, nor ``backward(inputs=...)``
    without this parameter), the parameter has no gradient yet (accumulating into one is the
    node's job) and no tensor hook (hooks see the gradient on its way to the node). Hooks
    registered on the node object itself are not visible from Python: they are called with
    None in place of the gradient (docs/local_regions.md)."""
    with compat.attribute_access():
        for k, ((node, _), g) in enumerate(zip(ctx.next_functions, grads)):
            leaf = getattr(node, "variable", None)  # set on accumulation nodes only: a parameter's
            if g is None or leaf is None or leaf.grad is not None or compat.has_tensor_hooks(leaf):
                continue
            try:
                if not compat.will_engine_execute_node(node):
                    continue
            except RuntimeError:  # autograd.grad(): it asks nothing of leaves (they are captured)
                continue
            leaf.grad = g
            grads[k] = None


class _Node(torch.autograd.Function):
    """The captured call as one autograd node: forward program in, backward program out."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *wrt: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        progs = call.progs
        outs = progs.forward(*call.locs)
        call.device = call.locs[0].device if call.locs else None
        call.locs = []  # (the inputs' shards are not held until the backward)
        replay(progs.records[:progs.n_forward], within=call.module)
        n = progs.n_tensors
        call.outs = list(outs[:n])
        # tensors are saved as autograd saves them (the hooks of checkpoint and of ZeRO-3's units see
        # them); other values (a collective's handle) are kept as they are
        saved = outs[n:]
        ctx.save_for_backward(*[v for v in saved if isinstance(v, torch.Tensor)])
        ctx.others = [(k, v) for k, v in enumerate(saved) if not isinstance(v, torch.Tensor)]
        ctx.call = call
        if call.again is not None:
            call.wrt = [weakref.ref(t) for t in wrt]
        ctx.set_materialize_grads(False)
        at = [sum(computed(o) for o in progs.outs[:i]) for i in progs.tangents]  # their places among the outputs
        return tuple(layout.wrap(call.outs[k], progs.outs[i][1], progs.outs[i][2]) for i, k in zip(progs.tangents, at))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # (create_graph=True: the backward program has no backward of its own)
            return (None, *_graph_kept(ctx.call, grads))
        call: _Call = ctx.call
        progs = call.progs
        tangents = []
        for i, g in zip(progs.tangents, grads):
            spec = tangent_spec(progs.outs[i][1], progs.redundant)
            if g is None:
                tangents.append(torch.zeros(spec.local_shape(coordinate(spec)), dtype=spec.dtype,
                                            device=call.device))
                continue
            if not layout.is_dist(g):  # (a whole value: autograd's zeros for an output nothing read)
                g = layout.shard_full(g, spec)
            src, loc = layout.spec_of(g), layout.local_of(g)
            if src != spec:
                loc = layout.move(loc.detach(), src, spec)
            tangents.append(loc.contiguous())
        assert progs.backward is not None
        saved = list(ctx.saved_tensors)
        compat.release_saved(ctx)  # (the program lets each go after its last use)
        for k, v in ctx.others:
            saved.insert(k, v)
        saved += tangents
        del tangents
        out = progs.run_backward(saved)
        replay(progs.records[progs.n_forward:], within=call.module)
        result: list[Any] = []
        k = 0
        for gspec in progs.grad_specs:
            if gspec is None:
                result.append(None)
            else:
                result.append(layout.wrap(out[k], gspec))
                k += 1
        give_directly(ctx, result)
        return (None, *result)
