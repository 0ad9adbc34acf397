"""The checks behind a local region's verdict: layouts before the trace, the trace itself (every
dispatch decision and the aten calls made on local shards), and the classification of its
outputs into gradient layouts. See ``autoparallel.regions``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.compat import TorchDispatchMode, tree_flatten
from autoparallel.engine import dispatch as _dispatch
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.regions.crossing import with_partial
from autoparallel.regions.generic import Made, Record, mutable
from autoparallel.spec import DistSpec
from reshard.plan import SLICE, TO_PARTIAL
from spmd_rules.random_ops import draws_random


# ---- verdicts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Verdict:
    """What the trace of one signature found: refused (``reason``) or how to run locally."""

    reason: str = ""
    out_tree: Any = None
    out_specs: tuple[DistSpec | None, ...] = ()      # per output leaf (None: not a DistTensor)
    arg_grads: tuple[DistSpec | None, ...] = ()      # per argument leaf: its gradient's layout
    slot_grads: tuple[DistSpec | None, ...] = ()     # per parameter/buffer slot
    out_local_shapes: tuple[tuple[int, ...] | None, ...] = ()  # per output leaf, on this rank
    summand_slots: tuple[DistSpec | None, ...] = ()  # per slot: the Partial(sum) layout its ops take it in
    sharded_axes: tuple[int, ...] = ()               # mesh axes the outputs are sharded (or Partial(sum)) on
    generic: bool = False                            # answered by its family (``regions.generic``)
    out_moves: tuple[DistSpec | None, ...] = ()      # per output leaf: the layout a style's epilogue moves it to
    in_moves: tuple[DistSpec | None, ...] = ()       # per argument leaf: the layout a style's prologue (or an op's slice) moves it to
    style_moves: int = 0                             # moves its styles' hooks make (``regions.moves``)
    # where an argument is an object (``regions.objects``): the paths of the tensors the module
    # writes into it (its last output leaves: the output is ``(output, written)``), and the
    # other values it writes; None: no object argument
    writes: tuple[Any, ...] | None = None
    written_values: tuple[Any, ...] = ()

    @property
    def local(self) -> bool:
        return not self.reason

    def summary(self) -> str:
        said = "local" if self.local else f"refused: {self.reason}"
        return f"{said} (as its proven lengths)" if self.generic else said


def _refused(reason: str, generic: bool = False) -> _Verdict:
    return _Verdict(reason=reason, generic=generic)


# ---- checks on metadata --------------------------------------------------------------------------
def _precheck(leaves: list[Any], tensors: list[torch.Tensor]) -> str:
    """Why this signature cannot be a region, from layouts alone ('' when it may be one)."""
    dts = [x for x in [*leaves, *tensors] if isinstance(x, DistTensor)]
    mesh = layout.spec_of(dts[0]).mesh
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, DistTensor) and x.requires_grad:
            return "a plain tensor argument requires grad"
    for t in dts:
        spec = layout.spec_of(t)
        if spec.mesh != mesh:
            return "its DistTensors live on several meshes"
        if spec.has_partial:
            return f"an input is Partial ({spec})"
        if getattr(t, "_ap_zero3", None) is not None:
            return "it owns ZeRO-3 sharded parameters (gathered by their unit)"
        why = _uneven_spec(spec)
        if why:
            return why
    if mesh.coordinate_of(runtime.get_rank()) is None:
        return "this rank is outside the mesh"
    return ""


def _uneven(leaves: list[Any]) -> str:
    """Why a DistTensor argument splits unevenly ('' when none does): the part of ``_precheck``
    that changes with sizes alone."""
    for x in leaves:
        if isinstance(x, DistTensor):
            why = _uneven_spec(layout.spec_of(x))
            if why:
                return why
    return ""


def _uneven_spec(spec: DistSpec) -> str:
    for p in spec.placements:
        if isinstance(p, Shard):
            pieces = _pieces(spec, p.dim)
            if spec.shape[p.dim] % pieces:
                return f"an input's dim {p.dim} of size {spec.shape[p.dim]} is split unevenly ({pieces} pieces)"
    return ""


def _pieces(spec: DistSpec, dim: int) -> int:
    """How many pieces ``spec`` splits tensor dim ``dim`` into (the product of its mesh axes)."""
    n = 1
    for a in spec.axes_of_dim(dim):
        n *= spec.mesh.shape[a]
    return n


def _classify(out: Any, leaves: list[Any], tensors: list[torch.Tensor],
              summands: dict[int, DistSpec] | None = None, reads: set[int] | None = None) -> _Verdict:
    """Output layouts -> gradient layouts of the inputs, or why the outputs do not allow it.
    ``summands``: slot index -> the Partial(sum) layout every op of the trace took that
    replicated parameter in (``_Trace.summands``): the local run makes it a summand first.
    ``reads``: ids of the DistTensors some op of the trace took (``_Trace.reads``); an input no
    op took (a hidden state a rotary embedding reads only the dtype of) bears on no output."""
    summands = summands or {}
    outs, out_tree = tree_flatten(out)
    specs = tuple(layout.spec_or_none(o) for o in outs)
    dist_out = [s for s in specs if s is not None]
    if not dist_out:
        return _refused("it returns no DistTensor")
    for o, s in zip(outs, specs):
        if s is None and isinstance(o, torch.Tensor):
            return _refused("it returns a plain tensor")
    mesh = dist_out[0].mesh
    if any(s.mesh != mesh for s in dist_out):
        return _refused("its outputs live on another mesh")
    inputs = [x for x in [*leaves, *tensors] if isinstance(x, DistTensor) and (reads is None or id(x) in reads)]
    sharded: list[int] = []
    for a in range(mesh.ndim):
        partial = [isinstance(s.placements[a], Partial) for s in dist_out]
        if any(partial):
            # Partial(sum) outputs (a row-parallel product): each rank computed its summand from
            # its own shards and the replicated inputs, so with the whole gradient of the sum
            # (Replicate: ``_Out`` moves it there) the local backward gives each sharded input
            # its exact shard and each replicated one its summand (Partial(sum), as on a sharded
            # axis). A sharded output beside them gives the same (each rank's shard of its
            # gradient, through its own shards: exact for sharded inputs, a summand for
            # replicated ones: the keys and values an attention writes into its cache beside its
            # row-parallel output). A replicated one would add its replicated part to every
            # summand of an input's gradient.
            if any(s.placements[a] != Partial("sum") and not isinstance(s.placements[a], Shard) for s in dist_out):
                return _refused(f"its outputs are Partial on mesh axis {a} and neither Partial(sum) nor sharded "
                                "there (a replicated one beside a summand)")
            sharded.append(a)
            continue
        kinds = {isinstance(s.placements[a], Shard) for s in dist_out}
        if kinds == {True, False}:
            return _refused(f"its outputs are sharded on mesh axis {a} and replicated on it")
        if True in kinds:
            sharded.append(a)
        elif any(not isinstance(layout.spec_of(t).placements[a], Replicate) for t in inputs):
            return _refused(f"an input is sharded on mesh axis {a} but no output is")

    for a in sharded:
        split = _split_inside(a, leaves, tensors, summands, reads)
        if split > 1:
            # every argument whole on the axis and the outputs split there (a column-parallel
            # layer inside the module): each replicated tensor taking a gradient would take it
            # Partial, while op by op the backward reduces the one gradient where the split
            # begins and keeps the rest whole (a layer norm's backward: ``reshard.choice``)
            return _refused(f"its outputs are split on mesh axis {a} inside it and {split} replicated tensors "
                            "it reads take gradients there (op by op, one reduction keeps them whole)")

    def grad_of(x: Any) -> DistSpec | None:
        return with_partial(layout.spec_of(x), tuple(sharded)) if isinstance(x, DistTensor) else None

    # A parameter made a summand on some axes has its whole gradient there on every rank
    # (``as_summand``'s backward is the identity: each summand sees the whole gradient of the
    # sum): Replicate on those axes, Partial(sum) on the other axes the outputs are split on.
    def summand_grad(t: DistTensor, summand: DistSpec) -> DistSpec:
        return with_partial(layout.spec_of(t), tuple(a for a in sharded if summand.placements[a] != Partial("sum")))

    slot_grads = tuple(summand_grad(t, summands[k]) if k in summands and isinstance(t, DistTensor) else grad_of(t)
                       for k, t in enumerate(tensors))
    return _Verdict(out_tree=out_tree, out_specs=specs, arg_grads=tuple(grad_of(x) for x in leaves),
                    slot_grads=slot_grads, sharded_axes=tuple(sharded),
                    summand_slots=tuple(summands.get(k) for k in range(len(tensors))) if summands else ())


def _split_inside(a: int, leaves: list[Any], tensors: list[torch.Tensor], summands: dict[int, DistSpec],
                  reads: set[int] | None) -> int:
    """How many replicated tensors taking a gradient a region reads (arguments, parameters),
    where every argument it reads is whole (Replicate) on mesh axis ``a``; 0 where one is not (the
    split came in with an argument, as a data-parallel batch's). A summand parameter (a
    row-parallel bias) takes its gradient whole and is not counted."""
    def read(x: Any) -> bool:
        return isinstance(x, DistTensor) and (reads is None or id(x) in reads)

    if any(read(x) and not isinstance(layout.spec_of(x).placements[a], Replicate) for x in leaves):
        return 0
    with compat.attribute_access():
        return sum(1 for k, x in enumerate([*leaves, *tensors])
                   if read(x) and isinstance(layout.spec_of(x).placements[a], Replicate) and x.requires_grad
                   and not (k >= len(leaves) and k - len(leaves) in summands))


# ---- recording aten calls ------------------------------------------------------------------------
def _describe(x: Any) -> Any:
    """An aten argument as comparable metadata: tensors by shape and dtype, the rest by value."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_describe(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _describe(v)) for k, v in x.items()))
    return x


_aten = torch.ops.aten
_SIZED = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default})


class _Trace:
    """Aten calls on local tensors, in order, and the first reason to refuse the region.

    In a trace, DistTensor ops go through dispatch, which reports each decision (``observe``)
    and runs the local computation under the spy; plain ops (factories) are recorded directly.
    In a replay every op must be on plain tensors.
    """

    def __init__(self, replay: bool = False, slots: dict[int, int] | None = None,
                 args: list[Any] | None = None) -> None:
        self.replay = replay
        self.ops: list[tuple[Any, ...]] = []
        self.reason = ""
        # a replay's calls with their sizes, for the signature's family (``regions.generic``)
        self.split: Record | None = Record() if replay else None
        # Replicated parameters the ops take as summands: id of a slot's DistTensor -> its slot
        # index; slot index -> the Partial(sum) layout every such op takes it in; the slots some
        # op takes as they are (a parameter may not be both)
        self.slots = slots or {}
        self.summands: dict[int, DistSpec] = {}
        self.as_is: set[int] = set()
        # The module's DistTensor arguments and the views the trace took of them as they are
        # (id -> (the tensor, its argument's leaf indices, per dim the argument's dim it spans
        # whole or None)); per leaf, the layout an op slices it (or such a view of it) to: a
        # replicated mask taken batch-sharded, which the region slices once, before the module
        # runs (``arg_moves``: a second trace with them sliced proves it)
        # (a plain tensor argument too: an op adopts it Replicate, its shard is the tensor itself;
        # and what the ops derive from them elementwise: ``_follow``)
        self.args: dict[int, tuple[Any, tuple[int, ...], tuple[int | None, ...]]] = {}
        for k, x in enumerate(args or ()):
            if isinstance(x, torch.Tensor) and (isinstance(x, DistTensor) or not x.requires_grad):
                _, ks, dims = self.args.get(id(x), (x, (), tuple(range(x.dim()))))
                self.args[id(x)] = (x, (*ks, k), dims)
        self.arg_moves: dict[int, DistSpec] = {}
        self.quiet = False  # inside an op's input moves (or a style's move): not the op's own local calls
        # the storages its recorded calls made, and whether one wrote a tensor they did not make
        # (a module attribute, an argument, a parameter): a trace that wrote nothing else may
        # run again (``region._first_call``)
        self.made = Made()
        self.writes = False
        self.reads: set[int] = set()  # ids of the DistTensors the ops read (not inside moves)

    def refuse(self, reason: str) -> None:
        self.reason = self.reason or reason

    def spy(self) -> _Spy:
        return _Spy(self)

    def observe(self, func: Any, decision: Any, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[..., Any]) -> Any:
        """Called by dispatch for each DistTensor op of a trace: check, then run under the spy
        (the inputs' moves unrecorded: the only ones a region keeps are its parameters made
        summands, which its local run does once, before the module runs)."""
        if not self.quiet:
            self.reads.update(id(t) for t in _dist_args(args, kwargs))
        if compat.observed():
            # (a region proves a signature only where nothing watches: this one came from inside)
            self.refuse("it runs torch's checkpoint inside (the recompute in the backward would run "
                        "outside the local run)")
        # (an op returning a Python value, as ``item()``, is decided as a fallback: it reads
        # the whole value, which a shard does not hold)
        if decision.fallback:
            self.refuse(f"{func} runs replicated or returns a Python value")
        elif not self._takes(decision, args, kwargs):
            self.refuse(f"{func} moves an input")
        elif draws_random(func, args, kwargs):
            self.refuse(f"{func} is random (its DistTensor result is the single-device draw)")
        with _Spy(self):
            out = run(_Quiet(self))
        if self.args and not self.quiet and all(p is None for p in decision.plans):
            self._follow(func, args, kwargs, out)
        return out

    def _source(self, t: Any) -> tuple[Any, tuple[int, ...], tuple[int | None, ...]] | None:
        """What ``t`` is of the arguments (``args``' entry), if anything: itself, or for a
        replicated DistTensor, the plain tensor an op adopted (its shard is that tensor)."""
        src = self.args.get(id(t))
        if src is None and isinstance(t, DistTensor):
            spec = layout.spec_of(t)
            if spec.is_replicated():
                src = self.args.get(id(layout.local_of(t)))
        return src

    def _follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Track ``out`` (the op's one output) where an argument slices into it the way the
        output is sliced: a view of a tracked tensor (``_ARG_VIEWS``), or an elementwise value
        of tracked tensors of its own shape (and 0-d ones): pointwise ops, ``*_like``
        factories, ``masked_fill`` (SDPA turning a boolean mask into an additive one). Only a
        guess of which arguments to slice first: the second trace proves it (it moves nothing)."""
        if not isinstance(out, torch.Tensor):
            return
        tensors = _tensors(args, kwargs)
        if not tensors:
            return
        srcs = [self._source(t) for t in tensors]
        if func in _ARG_VIEWS:
            if srcs[0] is not None:
                dims = _view_dims(func, args, srcs[0][2], _shape(tensors[0]), _shape(out))
                self.args[id(out)] = (out, srcs[0][1], dims)
            return
        shape = _shape(out)
        found = [s for s in srcs if s is not None]
        if (not found or not _elementwise(func)
                or any(s is None and _shape(t) != () for s, t in zip(srcs, tensors))
                or any(s is not None and (_shape(t) != shape or s[2] != found[0][2]) for s, t in zip(srcs, tensors))):
            if mutable(func):  # written with what no argument slices: no longer the argument's
                self.args.pop(id(tensors[0]), None)
            return
        self.args[id(out)] = (out, tuple(sorted({k for s in found for k in s[1]})), found[0][2])

    def _arg_target(self, plan: Any, src: tuple[Any, tuple[int, ...], tuple[int | None, ...]]) -> DistSpec | None:
        """The layout of the argument behind ``src`` that ``plan`` (slicing it, or a view of it)
        asks for: each mesh axis the plan slices on a view dim, sliced on the argument dim that
        view dim spans; None where a view dim spans none or the pieces would be uneven."""
        arg, _, dims = src
        spec = layout.spec_of(arg) if isinstance(arg, DistTensor) else DistSpec(
            plan.src.mesh, tuple(Replicate() for _ in plan.src.placements), tuple(arg.shape), arg.dtype)
        if plan.dst.shard_order:
            return None
        placements = list(spec.placements)
        for a, (p, q) in enumerate(zip(plan.src.placements, plan.dst.placements)):
            if p == q:
                continue
            if not (isinstance(p, Replicate) and isinstance(q, Shard) and isinstance(placements[a], Replicate)):
                return None
            d = dims[q.dim] if q.dim < len(dims) else None
            if d is None:
                return None
            placements[a] = Shard(d)
        dst = spec.with_placements(tuple(placements))
        return None if _uneven_spec(dst) else dst

    def _takes(self, decision: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the op takes every input as it is, as a summand of a replicated parameter
        of the region (``R -> Partial(sum)``: a local step, kept on one rank, zero on the others)
        that every op of the trace takes in that one layout, or as an argument of the module
        (or a view of one) sliced (``R -> S``, local, even pieces) to one layout of the argument
        every op asks for (noted in ``arg_moves``: this trace then proves nothing, a second
        one with those arguments sliced first does)."""
        plans = decision.plans
        dts = _dist_args(args, kwargs)
        if any(p is not None for p in plans) and (len(dts) != len(plans) or decision.mutated):
            return False
        for t, p in zip(dts, plans or [None] * len(dts)):
            k = self.slots.get(id(t))
            if p is None:
                if k is not None:
                    self.as_is.add(k)
                continue
            src = self._source(t) if k is None and _slice_move(p) else None
            if src is not None:
                dst = self._arg_target(p, src)
                # (the layout asked of a view or an elementwise value of the argument: its
                # placements are the argument's; its shape and dtype ``moves.remake`` takes from it)
                if dst is None or any(self.arg_moves.setdefault(a, dst).placements != dst.placements for a in src[1]):
                    return False
                continue
            if k is None or not _summand_move(p) or self.summands.setdefault(k, p.dst) != p.dst:
                return False
        return True

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.quiet:
            return
        self.writes = self.writes or self.made.writes_outside(func, args, kwargs)
        self.made.add(out)
        if self.args and not self.replay:
            self._follow(func, args, kwargs, out)
        if self.split is not None:
            self.split.add(func, args, kwargs, out)
        if func in _SIZED:  # the size may say -1 where the other side says the number
            args = args[:1] + args[2:]
        self.ops.append((func, _describe(args), _describe(kwargs), _describe(out)))


class _Quiet:
    """While an op's inputs move inside a trace: their local calls are not the op's."""

    def __init__(self, trace: _Trace) -> None:
        self.trace = trace

    def __enter__(self) -> None:
        self.trace.quiet = True

    def __exit__(self, *exc: object) -> None:
        self.trace.quiet = False


def _dist_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DistTensor]:
    """The DistTensors of a call in the order its decision's plans follow."""
    return layout.dist_args(args, kwargs)


def _only_steps(plan: Any, ok: Callable[[Any], bool]) -> bool:
    """Whether ``plan`` (a one-mesh plan) has steps, and each is ``ok``."""
    steps = getattr(plan, "steps", None)
    if not steps:
        return False
    return all(ok(st) for st in steps)


def _summand_move(plan: Any) -> bool:
    """Whether ``plan`` only makes a replicated tensor a summand (``R -> Partial(sum)`` on some
    mesh axes: kept where the axis coordinate is 0, zero elsewhere)."""
    return _only_steps(plan, lambda st: st.kind == TO_PARTIAL and st.dst.placements[st.axis] == Partial("sum")
                       and isinstance(st.src.placements[st.axis], Replicate))


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments (one level of lists), in order."""
    out: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
    return out


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """A tensor's (global) shape; a DistTensor's from its spec."""
    return tuple(layout.spec_of(t).shape) if isinstance(t, DistTensor) else tuple(t.shape)


_LIKE = frozenset({_aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
                   _aten.empty_like.default, _aten.masked_fill.Scalar, _aten.masked_fill_.Scalar,
                   _aten.masked_fill.Tensor, _aten.masked_fill_.Tensor, _aten._to_copy.default})


def _elementwise(func: Any) -> bool:
    """An op whose output (of its inputs' shape) is computed element by element."""
    return func in _LIKE or torch.Tag.pointwise in getattr(func, "tags", ())


# views a trace follows from a module's arguments (``_Trace.args``): what an argument's slice
# must reach through (transformers' attention takes ``mask[:, :, :, :kv_len]``)
_ARG_VIEWS = frozenset({_aten.slice.Tensor, _aten.alias.default, _aten.detach.default, _aten.expand.default})


def _view_dims(func: Any, args: tuple[Any, ...], dims: tuple[int | None, ...], shape: tuple[int, ...],
               out: tuple[int, ...]) -> tuple[int | None, ...]:
    """Per dim of the view ``func(*args)`` (of a tensor of ``shape`` whose dims span ``dims``
    of an argument): the argument dim it spans whole, or None."""
    if func is _aten.slice.Tensor:
        d = args[1] % len(shape) if len(args) > 1 and len(shape) else 0
        return tuple(None if i == d and out[i] != shape[i] else m for i, m in enumerate(dims))
    if func is _aten.expand.default:
        lead = len(out) - len(shape)
        return (*([None] * lead), *(m if out[lead + i] == n else None for i, (m, n) in enumerate(zip(dims, shape))))
    return dims


def _slice_move(plan: Any) -> bool:
    """Whether ``plan`` only slices a replicated tensor (``R -> S(d)`` on some mesh axes: each
    rank keeps its piece, no communication)."""
    return _only_steps(plan, lambda st: st.kind == SLICE)


def as_summand(local: torch.Tensor, spec: DistSpec, summand: DistSpec) -> torch.Tensor:
    """A replicated parameter's shard as the summand ``summand`` (Partial(sum) where ``spec``
    is Replicate): itself where this rank's coordinate on those axes is 0, zeros elsewhere;
    its gradient is the incoming one on every rank (each summand sees the whole gradient of
    the sum)."""
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    assert coord is not None
    keep = all(coord[a] == 0 for a, (p, q) in enumerate(zip(spec.placements, summand.placements))
               if isinstance(p, Replicate) and q == Partial("sum"))
    return _Summand.apply(local, keep)  # type: ignore[no-any-return]


class _Summand(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x) if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _Spy(TorchDispatchMode):
    """Records plain aten calls into a trace; hands DistTensor calls on to dispatch."""

    _ap_own_observer = True  # (``compat.OWN_OBSERVER``)

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __enter__(self) -> _Spy:
        self._door = _dispatch.observed_by(self.trace)  # the engine's door for observers
        self._door.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._door.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DistTensor) for t in types):
            if self.trace.replay:
                self.trace.refuse(f"{func} meets a DistTensor on local tensors")
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.trace.record(func, args, kwargs, out)
        return out


# ---- refusals read from a finished trace -------------------------------------------------
def reentrant_checkpoint_refusal(outs: list[Any], leaves: list[Any]) -> str:
    """Why a region whose forward ran a reentrant ``torch.utils.checkpoint`` is refused: its
    recompute runs in the backward, outside the local run, on the shards the local run saved
    (non-reentrant checkpoints are seen while tracing, ``_Trace.observe``). Found in the outputs' autograd
    graph, walked down to the inputs' own history."""
    stop = {t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        if node.name() == compat.REENTRANT_CHECKPOINT_NODE:
            return ("it runs torch's reentrant checkpoint inside (the recompute in the backward would run "
                    "outside the local run)")
        todo.extend(f for f, _ in node.next_functions if f is not None)
    return ""


def summands_refusal(trace: _Trace, leaves: list[Any], tensors: list[torch.Tensor]) -> str:
    """Why the parameters the trace's ops took as summands cannot be made summands once, before
    the local run ('' when they can): another op takes one as it is, or it is also an argument."""
    if not trace.summands:
        return ""
    if trace.summands.keys() & trace.as_is:
        return "a parameter is taken as it is by one op and as a summand (moved) by another"
    args = {id(x) for x in leaves if isinstance(x, DistTensor)}
    if any(id(tensors[k]) in args for k in trace.summands):
        return "a parameter taken as a summand is also an argument"
    return ""
