"""A module call as one captured program: the engine of local regions.

For one call signature (the layouts of the arguments, parameters and buffers, the non-tensor
arguments, train/eval flags, plain attribute values, grad mode: the region's key), the module's
forward is recorded once on fake tensors (``static.capture``: nothing runs for real) with the
engine planning every op as in eager mode, collectives included. With autograd on, the record is
*joint*: the forward, then ``autograd.grad`` of its differentiable outputs with respect to the
parameters and arguments that require a gradient, the output gradients standing as inputs in
the layouts the backward takes them in (``tangent_spec``); it is cut into a forward and a backward
program (``static.split``).

Every call of the signature — the first, the hundredth, and a recomputation inside
``torch.utils.checkpoint`` — then runs the same thing: the forward program on the local shards,
inside one autograd node (``regions.node``) whose backward runs the backward program on the values the
forward kept (saved as autograd saves tensors, so checkpoint's hooks see them) and the output
gradients (moved to the layouts the capture assumed when they arrive in others). The parameters'
and arguments' gradients leave the node as DistTensors in the layouts the DistTensor path gives
them; a parameter without a gradient yet takes it directly
(``node.give_directly``), the others through autograd's accumulation.

The output holds what the forward returned: tensors it computed (the program's outputs), an
argument returned as it is (that argument itself), an object argument (itself), an object the
forward made (``objects.Made``: a new one per call, its tensors among the program's outputs).

A call that is not captured (``refusal``, or what the capture refuses: ``Calls`` keeps the reason)
runs on DistTensors: a Python value read from a tensor, an op without a rule, a forward that
assigns module state or writes an argument in place, a plain tensor that requires a gradient, an
object argument or an object returned whose entries cannot be walked (``regions.objects``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autoparallel import compat, runtime
from autoparallel.attributes import Alike, Reads
from autoparallel.compat import tree_flatten, tree_unflatten
from autoparallel.engine import layout
from autoparallel.log import logger
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.regions import moves, objects
from autoparallel.runtime import comm
from autoparallel.runtime.debug import CommRecord, named_within
from autoparallel.spec import DistSpec
from autoparallel.static.capture import PlainValues, capture, kept_in_place, plain_trained, plain_trained_reason
from autoparallel.static.passes import collectives, drop_detaches, hoist_starts, sink_waits, written_inputs
from autoparallel.static.sizes import OpenPrograms, OpenSizes, masked, open_dims, open_spec
from autoparallel.static.split import SplitError, split_joint

# per output leaf: ("dist", spec, stride, differentiable) | ("plain",) | ("value", v)
#   | ("input", k): the call's input ``k`` (``Inputs.tensors``) itself, returned as it is
#   | ("given", j): the object argument ``j`` (a leaf of the call) itself
#   | ("made", objects.Made, start): an object the forward made, rebuilt around the tensors of the
#     kinds from ``start`` on (after the leaves' kinds, in order: ``objects.Made.build``'s)
#   | ("same", i): the object made at output leaf ``i``, returned there too
Out = tuple[Any, ...]


def computed(o: Out) -> bool:
    """Whether an output leaf is one the forward program computes (a tensor that is no input)."""
    return o[0] == "dist" or o[0] == "plain"


@dataclass
class Programs:
    """One signature's captured programs."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None   # None: nothing differentiable (no grad mode, or no input needs one)
    outs: tuple[Out, ...]                   # per output leaf
    tree: Any                               # the output's nesting
    wrt: tuple[int, ...]                    # the inputs differentiated (indices into ``Inputs.tensors``)
    grad_specs: tuple[DistSpec | None, ...]  # per ``wrt``: its gradient's layout (None: no gradient)
    tangents: tuple[int, ...]               # the output leaves whose gradients the backward takes
    records: tuple[CommRecord, ...]         # the collectives of the forward, then of the backward
    n_forward: int                          # of which the forward's
    redundant: tuple[int, ...] = ()         # mesh axes along which every input is Replicate (``tangent_spec``)
    sizes: OpenSizes | None = None          # captured with open sizes: the inputs' sizes it serves
    served: int = 0                         # (kept with open sizes) calls at other sizes it ran
    reads: tuple[objects.Path, ...] = ()    # the tensor entries of object arguments (inputs after the leaves')
    writes: tuple[objects.Path, ...] = ()   # the entries the forward writes tensors into (the last outputs)
    sets: tuple[tuple[objects.Path, Any], ...] = ()  # ... and other values into
    objects: bool = False                   # the call has object arguments: its output is ``(output, written)``
    boxed: bool = False                     # the backward takes its inputs as one list it empties

    def run_backward(self, args: list[Any]) -> Any:
        """The backward program on ``args`` (the list is emptied: each input goes after its last use)."""
        assert self.backward is not None
        return self.backward(args) if self.boxed else self.backward(*args)

    @property
    def n_tensors(self) -> int:
        """The forward program's outputs that are the call's (the rest it keeps for the backward)."""
        return sum(computed(o) for o in self.outs)

    def at(self, binding: dict[Any, Any]) -> Programs:
        """These programs of open sizes for one binding of them: layouts and records in numbers."""
        outs = tuple(("dist", OpenSizes.value(o[1], binding), OpenSizes.value(o[2], binding), o[3]) if o[0] == "dist"
                     else o for o in self.outs)
        specs = tuple(OpenSizes.value(s, binding) for s in self.grad_specs)
        return replace(self, outs=outs, grad_specs=specs, records=tuple(OpenSizes.record(r, binding) for r in self.records),
                       sizes=None)


@dataclass
class Inputs:
    """A call's tensors in program order: what the module's parameter and buffer slots hold
    (``state``: a ZeRO-3 unit's gathered parameter where it is seated), then the argument leaves
    that are tensors (each tensor once)."""

    tensors: list[torch.Tensor]   # the DistTensors and plain tensors themselves
    n_state: int                  # of which the first are parameters and buffers
    leaf_slot: list[int | None]   # per argument leaf: its index in ``tensors`` (None: not a tensor)

    @classmethod
    def of(cls, state: Sequence[torch.Tensor], leaves: Sequence[Any]) -> Inputs:
        tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}
        for t in state:
            if id(t) not in index:
                index[id(t)] = len(tensors)
                tensors.append(t)
        n_state = len(tensors)
        slots: list[int | None] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                k = index.get(id(x))
                if k is None:
                    k = index[id(x)] = len(tensors)
                    tensors.append(x)
                slots.append(k)
            else:
                slots.append(None)
        return cls(tensors, n_state, slots)

    def locals(self) -> list[torch.Tensor]:
        return [layout.local_or_plain(t) for t in self.tensors]


def capture_call(module: nn.Module, run: Callable[..., Any], state: Sequence[torch.Tensor], leaves: list[Any],
                 tree: Any, open_sizes: bool = False) -> Programs | str:
    """``run(*args, **kwargs)`` (the module's forward, its child regions plain) for the call of
    ``leaves``/``tree``, captured (see the module docstring); ``state``: what the module's
    parameter and buffer slots hold. A string: why it is refused."""
    grad = torch.is_grad_enabled()
    if grad:
        plain = plain_trained(module)
        if plain is not None:
            return plain_trained_reason(plain)
    found: dict[objects.Path, Any] = {}
    if objects.any_object(leaves):
        walked = objects.entries(leaves)
        if walked is None:
            kind = next(type(x).__name__ for x in leaves if objects.is_object(x) and objects.entries([x]) is None)
            return f"an argument is a {kind} object whose entries a region cannot follow"
        found = walked
    reads = tuple(p for p, v in found.items() if isinstance(v, torch.Tensor))
    inputs = Inputs.of(state, [*leaves, *(found[p] for p in reads)])
    if grad and any(t.requires_grad and not layout.is_dist(t) for t in inputs.tensors[inputs.n_state:]):
        return "a plain tensor argument requires a gradient"
    n_state = inputs.n_state
    redundant = _redundant(inputs.tensors)
    # open sizes: the evenly split dims of the DistTensor arguments (``static.sizes``)
    argument = {k for k in inputs.leaf_slot if k is not None and k >= n_state}  # (object entries too)
    dims = [_open_dims(t) if open_sizes and k in argument else () for k, t in enumerate(inputs.tensors)]
    modules = list(module.modules())
    got: dict[str, Any] = {}
    tangent_nodes: list[Any] = []

    def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
        return kept_in_place(inputs.tensors[:n_state], modules, flat[:n_state], lambda: traced(flat))

    def traced(flat: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        made: dict[int, torch.Tensor] = {}
        for k in range(n_state, len(flat)):
            t = inputs.tensors[k]
            if not layout.is_dist(t):
                made[k] = flat[k]
                continue
            spec, stride = open_spec(layout.spec_of(t), flat[k], dims[k]) if dims[k] else (layout.spec_of(t), layout.stride_of(t))
            made[k] = layout.wrap(flat[k], spec, stride, requires_grad=grad and t.requires_grad)
        args = [x if s is None else made[s] for x, s in zip(leaves, inputs.leaf_slot)]
        a, kw = tree_unflatten(args, tree)
        if found:  # the objects hold the trace's inputs while it runs, and are given back as they were
            held = {**found, **{p: made[s] for p, s in zip(reads, inputs.leaf_slot[len(leaves):]) if s is not None}}
            saved = objects.snapshot(leaves, found)
            objects.put(leaves, list(held), list(held.values()))
            writing = objects.Writing(run, leaves, held)
            try:
                out, written = writing(*a, **kw)
            finally:
                objects.restore(saved)
            if writing.why:
                raise comm.CaptureError(writing.why)
            if not all(layout.is_dist(t) for t in written):
                raise comm.CaptureError("it writes a plain tensor into an argument object")
            if not all(_constant(v) for _, v in writing.values):
                raise comm.CaptureError("it writes an object into an argument object")
            got["writes"], got["sets"] = writing.paths, writing.values
            out = (out, written)
        else:
            out = run(*a, **kw)
        leaf_outs, out_tree = tree_flatten(out)
        kinds: list[Out] = []
        outs: list[Any] = []  # per kind: the leaf, or a tensor of an object made (after the leaves)
        locs: list[torch.Tensor] = []
        diff: list[int] = []
        # an argument returned as it is (a position bias handed on) is that argument at every call,
        # not a program's output: its gradient reaches it through autograd as it does op by op
        argument = {id(t): k for k, t in made.items()}
        given = {id(x): j for j, x in enumerate(leaves) if objects.is_object(x)}

        def add(o: Any) -> bool:
            if isinstance(o, torch.Tensor) and id(o) in argument:
                kinds.append(("input", argument[id(o)]))
            elif layout.is_dist(o):
                d = grad and o.requires_grad
                if d:
                    diff.append(len(kinds))
                kinds.append(("dist", layout.spec_of(o), layout.stride_of(o), d))
                locs.append(layout.local_of(o))
            elif isinstance(o, torch.Tensor):
                if o.requires_grad:
                    raise comm.CaptureError("the forward returns a plain tensor that requires a gradient")
                kinds.append(("plain",))
                locs.append(o)
            elif _constant(o):
                kinds.append(("value", o))
            else:
                return False
            outs.append(o)
            return True

        made_objects: list[tuple[int, list[torch.Tensor]]] = []
        first: dict[int, int] = {}  # per object made: the kind of its first place in the output
        for o in leaf_outs:
            if add(o):
                continue
            outs.append(o)
            if id(o) in given:  # an object argument returned (what the forward wrote into it is put there)
                kinds.append(("given", given[id(o)]))
                continue
            if id(o) in first:  # the same object at another place of the output: the same object again
                kinds.append(("same", first[id(o)]))
                continue
            first[id(o)] = len(kinds)
            # an object the forward made (a key/value cache): its tensors are outputs too, and
            # every call gets a new object of its structure holding its own
            shaped = objects.Made.of(o)
            if shaped is None:
                raise comm.CaptureError(f"the forward returns a {type(o).__name__} object whose entries a region "
                                        "cannot follow")
            kinds.append(("made", shaped[0], 0))
            made_objects.append((len(kinds) - 1, shaped[1]))
        for j, tensors in made_objects:
            kinds[j] = (*kinds[j][:2], len(kinds))  # where its tensors' kinds start
            for t in tensors:
                add(t)
        got["outs"], got["tree"] = tuple(kinds), out_tree
        wrt = [k for k, t in enumerate(inputs.tensors) if grad and t.requires_grad and layout.is_dist(t)]
        got["wrt"], got["tangents"] = tuple(wrt), tuple(diff)
        got["specs"] = ()
        if not diff or not wrt:
            got["wrt"], got["tangents"] = (), ()
            return locs
        wrt_dist = [inputs.tensors[k] if k < n_state else made[k] for k in wrt]
        gouts = []
        for i in diff:
            spec = tangent_spec(kinds[i][1], redundant)
            g = torch.empty(spec.local_shape(coordinate(spec)), dtype=spec.dtype, device=locs[0].device)
            tangent_nodes.append(compat.traced_node(g))
            gouts.append(layout.wrap(g, spec))
        grads = torch.autograd.grad([outs[i] for i in diff], wrt_dist, gouts, allow_unused=True)
        got["specs"] = tuple(layout.spec_or_none(g) for g in grads)
        return locs + [layout.local_of(g) for g in grads if g is not None]  # type: ignore[arg-type]  # DistTensor grads

    values = PlainValues(module)
    with named_within(module):  # (its collectives are named by the submodule that issues them)
        result = capture(joint, inputs.locals(), dims if any(dims) else None, recompile=False)
    written = values.written()
    values.restore()
    if result.program is None:
        return result.refused
    sizes, why = result.sizes(dims)
    if why:
        return why
    if written:
        return f"the forward writes the module attribute{'s' if len(written) > 1 else ''} {', '.join(written)}"
    gm = result.program
    n_out = sum(computed(o) for o in got["outs"])
    unmarked = _unmarked_write(gm)
    if unmarked:
        return unmarked
    for k in written_inputs(gm):
        if k >= n_state:
            return "the forward writes one of its arguments in place"
        if inputs.tensors[k].requires_grad:
            return "the forward writes a parameter in place"
    if any(n.op == "placeholder" for n in _output_nodes(gm)[:n_out]):
        return "the forward returns one of its inputs as it is"
    try:
        backward = None
        forward = gm
        if got["wrt"]:
            _tangents_as_inputs(gm, tangent_nodes)
            parts = split_joint(gm, len(inputs.tensors), n_out)
            forward, backward = parts.forward, parts.backward
        for g in (forward, backward):
            if g is not None:  # (the code of each is generated once, after the last pass)
                drop_detaches(g, recompile=False)  # (both run without autograd: in the node, or without a backward)
                sink_waits(g, recompile=False)
                hoist_starts(g, recompile=False)
        boxed = backward is not None and compat.boxed(backward)  # (its saved inputs let go as it runs; generated)
        for g in (forward, None if boxed else backward):
            if g is not None:
                g.recompile()
    except SplitError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001  (a program the passes cannot handle: the same on every rank)
        return f"the captured program could not be split ({type(e).__name__}: {e})"
    n_forward = collectives(forward)
    if backward is not None and n_forward + collectives(backward) != len(result.records):
        n_forward = len(result.records)  # (not told apart: all said at the forward)
    return Programs(forward, backward, got["outs"], got["tree"], got["wrt"], got["specs"], got["tangents"], result.records,
                    n_forward, redundant, sizes, reads=reads, writes=got.get("writes", ()), sets=got.get("sets", ()),
                    objects=bool(found), boxed=boxed)


def _constant(v: Any) -> bool:
    """Whether ``v`` is a value every call may share: None, a number, a string, a dtype, a device
    (or a tuple of those)."""
    if isinstance(v, tuple):
        return all(_constant(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout))


def _redundant(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The mesh axes along which every DistTensor input is Replicate: the ranks along them are
    given the same values."""
    specs = [layout.spec_of(t) for t in tensors if layout.is_dist(t)]
    if not specs or any(s.mesh != specs[0].mesh for s in specs):
        return ()
    return tuple(a for a in range(specs[0].mesh.ndim) if all(isinstance(s.placements[a], Replicate) for s in specs))


def tangent_spec(out: DistSpec, redundant: tuple[int, ...]) -> DistSpec:
    """The layout a call's backward takes an output's gradient in: ``grad_spec`` of the output,
    Partial(sum) on the mesh axes along which the call is given the same values (``_redundant``)
    where the output is whole. A value computed alike along an axis is most often read there by
    work split along it (a position table added to a batch-sharded activation, a layer norm
    before a column-parallel Linear), whose gradient comes back Partial(sum): the backward then
    runs on the summands as an op by op backward would, and the gradients it gives stay Partial
    (reduced once, bucketed, by ``shard_optimizer``). A gradient that comes whole is made
    Partial there without communication (zeros on all but one rank)."""
    return with_partial(layout.grad_spec(out), redundant)


MAX_SIGNATURES = 16  # per module; beyond that, the least recently used one is dropped


class Calls:
    """One module's captured calls by signature (a refusal kept as its reason), with open sizes
    (``static.sizes.OpenPrograms``): a signature met at a second size is captured with the
    arguments' evenly split dims open, and serves the sizes its guards admit."""

    def __init__(self) -> None:
        self.programs: dict[Any, Programs | str] = {}  # least recently used first
        self.fixed: dict[Any, str] = {}  # families whose capture with open sizes failed: why
        self.open = OpenPrograms(MAX_SIGNATURES // 2)
        self.captures = 0
        self.reused = 0  # calls answered by a kept or an open program
        # by signature but its modules' plain values, for calls whose values differ only where none is read
        self.alike = Alike(MAX_SIGNATURES, 8 * MAX_SIGNATURES)

    def find(self, key: Any, leaves: list[Any], tree: Any, state: Sequence[torch.Tensor], module: nn.Module,
             run: Callable[..., Any], held: dict[objects.Path, Any] | None = None,
             values: tuple[Any, tuple[Any, ...]] | None = None, inherited: str = "") -> tuple[Programs | str, str]:
        """(the programs or refusal of the call of ``key``, how: ``kept`` (by this signature, or
        by one that differs only in plain values its capture did not read), ``open`` (served by a
        program of open sizes of its family) or ``captured`` now (``run``: the module's
        forward, its submodules' regions plain; ``held``: the entries of its object arguments,
        whose tensors' sizes are part of the signature, and open like the arguments'; ``values``:
        ``key`` without the modules' plain values, and those values, ``state.TreeReader``'s).
        ``inherited``: the refusal a parent's capture met inside this call (its trace failed in
        this module's forward), taken for a new signature instead of capturing it again."""
        entries = [v for v in held.values() if isinstance(v, torch.Tensor)] if held else []
        if entries:
            key = (*key, tuple(tuple(t.shape) for t in entries))
            if values is not None:
                values = ((values[0], key[-1]), values[1])
        entry = self.programs.get(key)
        if entry is None and values is not None:
            entry = self.alike.find(*values)
            if entry is not None:
                self._keep(key, entry)
                self.reused += 1
                return entry, "kept"
        if entry is not None:
            self.reused += 1
            if len(self.programs) > 1:
                self.programs[key] = self.programs.pop(key)  # now the most recently used
            return entry, "kept"
        fam = family(key[:-1] if entries else key, leaves)
        if entries:
            fam = (fam, tuple(_masked(t, None) for t in entries))
        shapes = _shapes(state, [*leaves, *entries])
        served = self.open.serve(fam, shapes) if self.open.open else None
        if served is not None:
            self.reused += 1
            self._keep(key, served)
            return served, "open"
        began = time.perf_counter()
        progs: Programs | str | None = refusal(leaves, state, module)
        if not progs and inherited:  # (as a capture at fixed sizes refused: its later sizes too)
            progs = self.fixed[fam] = inherited
        if not progs and self.captures >= MAX_SIGNATURES and self.reused < self.captures:
            # signatures that do not come back (a cache that grows, a changing value argument):
            # a capture per call would not pay
            progs = "its signatures keep changing (a capture per call would not pay)"
        reads = Reads(list(module.modules()))  # what the captures below read of the modules
        if not progs:
            progs = None
            self.captures += 1
            why_open = ""
            pinned = self.open.pinned(fam)
            if pinned is not None and fam not in self.fixed:
                self.fixed[fam] = f"its captured program's guards fix its sizes ({_guards(pinned.sizes)}): its submodules are regions"
            if fam in self.fixed:  # (a third size, or refused at two: a capture per size would not pay)
                progs = self.fixed[fam]
            elif self.open.second_size(fam):
                with reads:
                    progs = capture_call(module, run, state, leaves, tree, open_sizes=True)
                binding = progs.sizes.bind(shapes) if isinstance(progs, Programs) and progs.sizes else None
                if (binding is not None and isinstance(progs, Programs)
                        and not _runs_at(progs.at(binding), state, [*leaves, *entries])):
                    binding, progs = None, "its program of open sizes does not run at its own sizes"
                if binding is not None and isinstance(progs, Programs):
                    self.open.keep(fam, progs)
                    progs = progs.at(binding)
                else:  # (the open sizes tripped the trace, or guards that exclude its own sizes: at fixed sizes)
                    why_open = progs if isinstance(progs, str) else "a guard excludes its own sizes"
                    progs = None
            if progs is None:
                with reads:
                    progs = capture_call(module, run, state, leaves, tree)
                # its later sizes are not captured where a capture at fixed sizes was refused (what
                # refuses one, an object returned or a Python value read, does not depend on the
                # sizes) or where its sizes cannot be open (refused at two sizes: alike)
                if why_open or isinstance(progs, str):
                    if len(self.fixed) > 8 * MAX_SIGNATURES:
                        self.fixed.clear()
                    self.fixed[fam] = (progs if isinstance(progs, str) else
                                       f"its forward fixes its arguments' sizes ({why_open}): its submodules are regions")
        logger.debug("local region %s: %s (%.2f s)", type(module).__name__,
                     f"refused: {progs}" if isinstance(progs, str) else "captured", time.perf_counter() - began)
        self._keep(key, progs)
        if isinstance(progs, Programs) and values is not None:
            self.alike.keep(*values, reads, progs)
        return progs, "captured"

    def _keep(self, key: Any, entry: Programs | str) -> None:
        if len(self.programs) >= MAX_SIGNATURES:
            del self.programs[next(iter(self.programs))]
        self.programs[key] = entry


def family(key: Any, leaves: list[Any]) -> Any:
    """A region's signature (``(tree, per argument leaf, *rest)``) with its tensor arguments'
    open sizes left out (``static.sizes``; ``_open_dims``)."""
    tree, parts, *rest = key
    return (tree, tuple(_masked(x, p) for x, p in zip(leaves, parts)), *rest)


def _masked(x: Any, part: Any) -> Any:
    if layout.is_dist(x):
        return masked(x) + (x.requires_grad,)
    if isinstance(x, torch.Tensor):
        dims = _open_dims(x)
        return ("plain", tuple(None if d in dims else n for d, n in enumerate(x.shape)), x.dtype, x.requires_grad)
    return part


def _open_dims(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of a tensor argument a capture leaves open: a DistTensor's evenly split ones
    (``static.sizes.open_dims``), a contiguous plain tensor's of two or more (a mask, a position
    table the caller made for this length)."""
    if layout.is_dist(t):
        return open_dims(t)
    if not t.is_contiguous() or t.is_sparse:
        return ()
    return tuple(d for d, n in enumerate(t.shape) if n >= 2)


def refusal(leaves: list[Any], state: Sequence[torch.Tensor], module: nn.Module) -> str:
    """Why a call is not captured, from metadata ('' when it may be): pieces of unequal sizes
    (ranks would run programs of different shapes), a rank outside the mesh, ZeRO-3 sharded
    parameters (their unit gathers them around its forward), forward hooks on its submodules that
    are not quiet (``compat.QuietHook``: they would run at the capture only)."""
    why = _uneven(leaves)
    if why:
        return why
    dist = next(x for x in (*leaves, *state) if layout.is_dist(x))
    if layout.spec_of(dist).mesh.coordinate_of(runtime.get_rank()) is None:
        return "this rank is outside the mesh"
    if any(getattr(t, "_ap_zero3", None) is not None for t in state):
        return "it owns ZeRO-3 sharded parameters (gathered by their unit)"
    if any(moves.foreign_hooks(m) for m in list(module.modules())[1:]) or compat.global_module_hooks():
        return "a submodule has a forward hook"
    return ""


def _runs_at(progs: Programs, state: Sequence[torch.Tensor], leaves: list[Any]) -> bool:
    """Whether ``progs`` (captured with open sizes) runs on fake shards of this call's sizes:
    forward, then backward on what it keeps and on output gradients in their layouts. A program
    whose recorded size arithmetic does not hold (a size made outside the trace, recorded by
    another expression) fails here, before it runs for real."""
    fakes = compat.static_fake_mode()
    try:
        with fakes:
            locs = [fakes.from_tensor(t) for t in Inputs.of(state, leaves).locals()]
            outs = progs.forward(*locs)
            if progs.backward is not None:
                tangents = []
                for i in progs.tangents:
                    spec = tangent_spec(progs.outs[i][1], progs.redundant)
                    tangents.append(torch.empty(spec.local_shape(coordinate(spec)), dtype=spec.dtype))
                progs.run_backward([*outs[progs.n_tensors:], *tangents])
    except Exception as e:  # noqa: BLE001  (the same failure on every rank: sizes only)
        logger.debug("a program of open sizes fails at its own sizes: %s", e)
        return False
    return True


def _guards(sizes: OpenSizes | None, most: int = 2) -> str:
    guards = [str(g) for g in (sizes.guards if sizes is not None else [])]
    return ", ".join(guards[:most]) + (", ..." if len(guards) > most else "")


def _uneven(leaves: list[Any]) -> str:
    """Why a DistTensor argument splits unevenly ('' when none does): ranks would hold shards of
    different sizes, and run programs of different shapes."""
    for x in leaves:
        if layout.is_dist(x):
            spec = layout.spec_of(x)
            for p in spec.placements:
                if isinstance(p, Shard) and spec.shape[p.dim] % spec.pieces(p.dim):
                    return (f"an input's dim {p.dim} of size {spec.shape[p.dim]} is split unevenly "
                            f"({spec.pieces(p.dim)} pieces)")
    return ""


def with_partial(spec: DistSpec, axes: tuple[int, ...]) -> DistSpec:
    """``spec`` with Replicate made Partial(sum) on ``axes`` (a gradient summed over them)."""
    pl = [Partial("sum") if a in axes and isinstance(p, Replicate) else p for a, p in enumerate(spec.placements)]
    return spec.with_placements(pl, spec.shard_order)


def _shapes(state: Sequence[torch.Tensor], leaves: list[Any]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in Inputs.of(state, leaves).locals()]


def _unmarked_write(gm: torch.fx.GraphModule) -> str:
    """Why the program cannot run as captured ('' when it can): an op that writes an argument its
    schema declares read-only (``native_batch_norm``'s running statistics in training), whose
    write the engine makes good on DistTensors, op by op."""
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        marked = sum(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if len(layout.written_args(n.target, tuple(n.args), dict(n.kwargs))) > marked:
            return f"{n.target} writes an argument its schema declares read-only (it runs op by op)"
    return ""


def coordinate(spec: DistSpec) -> tuple[int, ...]:
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    assert coord is not None  # (a rank outside the mesh is refused first)
    return coord


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0])


def _tangents_as_inputs(gm: torch.fx.GraphModule, nodes: list[Any]) -> None:
    """The output gradients' stand-ins (empty tensors made in the trace) become the program's
    last inputs, in order."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for k, node in enumerate(nodes):
        with gm.graph.inserting_after(last):
            p = gm.graph.placeholder(f"tangent_{k}")
        p.meta.update(node.meta)
        node.replace_all_uses_with(p)
        gm.graph.erase_node(node)
        last = p
    gm.graph.lint()  # (not recompiled: the program is split into forward and backward next)
