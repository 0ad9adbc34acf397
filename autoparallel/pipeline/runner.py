"""``Pipeline``: run stages over micro-batches by a schedule; gradients accumulate in ``.grad``.

Every rank builds the same ``Pipeline`` and calls ``step`` at the same point. Before anything
is sent, all checks run on metadata (same error on every rank): stage meshes disjoint and
round robin, every parameter on its stage's mesh, the schedule simulated free of deadlock,
the batch divisible into micro-batches. The layouts crossing each stage boundary are found once
per input layout by a shape pass: every rank runs every stage on zeros under ``no_grad`` (ranks
outside a stage's mesh only propagate metadata), so sender and receiver agree on the plan of
every transfer without exchanging metadata. Then each rank runs its stage mesh's action list.

Loss: ``loss_fn(output, target)`` per micro-batch on the last stage, scaled by ``1 / M`` before
its backward, so the accumulated gradients are those of the mean loss over the whole batch
(a mean loss over equal micro-batches equals the full-batch mean).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import compat, runtime
from autoparallel.api import shard_tensor
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.memory import recomputation
from autoparallel.mesh import ProcessMesh
from autoparallel.pipeline import p2p, split_backward
from autoparallel.pipeline.local import LocalStage, runs_locally
from autoparallel.pipeline.memory import ActivationMeter
from autoparallel.pipeline.schedule import COMPUTE, RECV_B, RECV_F, Action, B, F, Schedule, build_schedule
from autoparallel.pipeline.simulate import simulate
from autoparallel.pipeline.stage import Stage, check_meshes
from autoparallel.placement import Partial, Replicate
from autoparallel.spec import DistSpec
from autoparallel.static.chunk import Replayed, StaticChunk

LossFn = Callable[..., torch.Tensor]
# Receives are posted this many actions before they are needed (the sender's data then moves
# while this rank computes); their buffers are allocated at posting time.
RECV_AHEAD_ACTIONS = 4


@dataclass(frozen=True, slots=True)
class Event:
    """One executed action on this rank: wall-clock ``start``/``end`` (``time.perf_counter``)."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class _Layouts:
    """Per chunk, the layout of each tensor crossing into it and out of it (a stage may take
    several tensors and return a tuple: each crosses the boundary as a message of its own)."""

    inputs: tuple[tuple[DistSpec, ...], ...]  # per chunk: layout of each of its inputs
    outputs: tuple[tuple[DistSpec, ...], ...]  # per chunk: layout of each of its outputs
    loss: DistSpec
    # per chunk: whether its forward writes one of its inputs in place (``nn.ReLU(inplace=True)``
    # first, ``x += ...``): a received input is a leaf of autograd, which refuses that, so the
    # chunk gets a copy, as it got the previous layer's output (not a leaf) in one process
    writes: tuple[bool, ...]

    def single(self, c: int) -> bool:
        """Whether chunk ``c`` takes one tensor that trains and returns one (what a static
        program captures; the other chunks run eagerly)."""
        last = c == len(self.inputs) - 1
        return (len(self.inputs[c]) == 1 and (c == 0 or _trains(self.inputs[c][0]))
                and (last or (len(self.outputs[c]) == 1 and _trains(self.outputs[c][0]))))


def _trains(spec: DistSpec) -> bool:
    """Whether a boundary tensor of layout ``spec`` carries a gradient back (floating point)."""
    return spec.dtype.is_floating_point or spec.dtype.is_complex


def _tensors(v: Any) -> tuple[Any, ...]:
    """A stage's input or output as a tuple of tensors (one tensor: a 1-tuple)."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _zeros(spec: DistSpec) -> DistTensor:
    coord = spec.mesh.coordinate_of(runtime.get_rank())
    local = torch.zeros(spec.local_shape(coord), dtype=spec.dtype, device=runtime.default_device())
    return layout.wrap(local, spec)


def _as_layout(t: torch.Tensor, spec: DistSpec) -> torch.Tensor:
    """This rank's local shard of ``t`` (a DistTensor on ``spec.mesh``) in layout ``spec``."""
    assert isinstance(t, DistTensor)
    local, src = layout.local_of(t).detach(), layout.spec_of(t)
    return local if src == spec else layout.move(local, src, spec)


@contextlib.contextmanager
def _shape_pass(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """No grad, eval mode (no dropout RNG, no batch-norm statistics), RNG state restored; not in
    inference mode, even in a step under it (the layouts, cached, serve training steps too, and
    an inference tensor has no version counter to see a stage write its input)."""
    modes = [(m, m.training) for mod in modules for m in mod.modules()]
    rng = torch.random.get_rng_state()
    try:
        for m, _ in modes:
            m.training = False
        with torch.inference_mode(False), torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode
        torch.random.set_rng_state(rng)


class Pipeline:
    """Stages (chunks, in forward order) run over ``num_microbatches`` by ``schedule``.

    ``schedule``: "FThenB" (GPipe), "1F1B", "Interleaved1F1B" (several chunks per mesh), or the
    zero-bubble "ZBH1" and "ZBV" (two chunks per mesh in a V: ``split_sequential(...,
    placement="v")``), which split each backward into the input's gradient, ``B``, and the
    weights', ``W``, run later where the stage would wait (``autoparallel.pipeline.split_backward``).
    ``loss_fn(output, target)`` (or ``loss_fn(output)`` when ``step`` gets no target) runs on
    the last stage for each micro-batch. A stage may return a tuple of DistTensors: the next
    stage gets them as its arguments, each crossing as a message of its own (integer ones
    forward only), and ``step`` takes a tuple of inputs for the first stage. ``static=True``:
    each chunk's forward and backward are captured once per input layout and replayed per
    micro-batch under the same schedule (``autoparallel.static.chunk``; the same values as
    eager, with one warning naming the reason where a chunk cannot be captured and stays eager).
    """

    def __init__(self, stages: Sequence[Stage], loss_fn: LossFn, *, num_microbatches: int, schedule: str = "1F1B",
                 static: bool = False) -> None:
        if not isinstance(static, bool):
            raise TypeError(f"Pipeline: static must be a bool, got {static!r}")
        if not isinstance(stages, (list, tuple)) or not stages or not all(isinstance(s, Stage) for s in stages):
            raise TypeError("Pipeline: stages must be a non-empty list of ap.pipeline.Stage")
        if not callable(loss_fn):
            raise TypeError(f"Pipeline: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.stages = list(stages)
        self.meshes = list(dict.fromkeys(s.mesh for s in self.stages))
        check_meshes(self.meshes)
        p = len(self.meshes)
        if len(self.stages) % p:
            raise ValueError(f"Pipeline: {len(self.stages)} stages do not visit the {p} stage meshes equally often")
        self.schedule: Schedule = build_schedule(schedule, p, num_microbatches, len(self.stages) // p)
        self._check_order()
        self._check_params()
        simulate(self.schedule)  # deadlock, order and matching checks before anything runs
        self._whole_why: dict[int, str] = {}  # chunks whose B must run their whole backward, and why
        if self.schedule.split_backward:
            self._check_split_backward()
        self.loss_fn = loss_fn
        rank = runtime.get_rank()
        self.rank = rank
        self.stage_index = next((i for i, m in enumerate(self.meshes) if rank in m), None)
        self.local = [runs_locally(st) for st in self.stages]
        self._layouts: dict[tuple[tuple[DistSpec, ...], bool, DistSpec | None], _Layouts] = {}
        self.events: list[Event] = []
        self.meter: ActivationMeter | None = None
        self.static = static
        self._whole_said: set[int] = set()  # chunks warned that B runs their whole backward
        self._eager_said: set[int] = set()  # static: chunks warned that they run eagerly
        # static: this rank's chunks (on its stage mesh, not one-rank local ones) as captured programs
        self.programs: dict[int, StaticChunk] = {
            c: StaticChunk(st.module, f"{c} ({st.name})", _as_layout, split_backward=self.schedule.split_backward)
            for c, st in enumerate(self.stages)
            if static and not self.local[c] and self.stage_index == self.schedule.stage_of(c)}

    # ---- checks (metadata only) -----------------------------------------------------------
    def _check_order(self) -> None:
        order = [self.meshes.index(s.mesh) for s in self.stages]
        want = [self.schedule.stage_of(c) for c in range(len(self.stages))]
        if order != want:
            p = len(self.meshes)
            how = ("in a V (chunk c on mesh c, then on mesh 2p - 1 - c: split_sequential(..., num_chunks=2, "
                   "placement='v'))" if self.schedule.name == "ZBV" else f"round robin (chunk c on mesh c % {p})")
            raise ValueError(f"Pipeline: {self.schedule.name} needs the stages to visit the {p} stage meshes {how}; "
                             f"got mesh order {order}, expected {want}")

    def _check_params(self) -> None:
        for c, st in enumerate(self.stages):
            for name, prm in st.module.named_parameters():
                if not isinstance(prm, DistTensor):
                    raise ValueError(
                        f"Pipeline: parameter {name!r} of stage {c} ({st.name}) is a plain tensor: that layer "
                        "is not assigned to a stage mesh (shard_tensor it, or build stages with split_sequential)"
                    )
                if prm.process_mesh != st.mesh:
                    raise ValueError(
                        f"Pipeline: parameter {name!r} of stage {c} lives on {prm.process_mesh!r}, not on the "
                        f"stage mesh {st.mesh!r}"
                    )

    def _say_whole(self, c: int, why: str) -> None:
        """One warning per chunk whose ``B`` must compute the weights' gradients too."""
        if c not in self._whole_said:
            self._whole_said.add(c)
            warnings.warn(f"autoparallel: {self.schedule.name}: stage {c} ({self.stages[c].name}) computes its weight "
                          f"gradients in B, not in a later W, because {why}; the values are the same", stacklevel=4)

    def _say_eager(self, c: int, why: str) -> None:
        """One warning per chunk that ``static=True`` does not capture (a chunk's program takes one
        input that trains, returns one output and does not write its input)."""
        if c not in self._eager_said:
            self._eager_said.add(c)
            warnings.warn(f"autoparallel: Pipeline(static=True): chunk {c} ({self.stages[c].name}) runs eagerly: "
                          f"{why}", stacklevel=4)

    def _check_split_backward(self) -> None:
        """A zero-bubble schedule computes weight gradients apart from the input's (``W``): every
        chunk needs parameters that train, and none may carry gradient hooks (they would not see
        ``W``'s gradients, which are added into ``.grad`` directly). A chunk with recomputed
        modules runs its whole backward in ``B`` (``_whole_why``: the reason its warning gives)."""
        name = self.schedule.name
        self._whole_why = {}
        for c, st in enumerate(self.stages):
            flagged = [n for n, m in st.module.named_modules()
                       if recomputation.policy_of(m) not in (None, "none") or getattr(m, "gradient_checkpointing", False) is True]
            recomputed = [n or "(the stage)" for n in flagged  # (innermost: a model's flag names its layers' too)
                          if not any(o != n and (not n or o.startswith(n + ".")) for o in flagged)]
            if recomputed:  # each autograd call recomputes a checkpointed region: B, then W once per weight group
                self._whole_why[c] = (f"its modules {recomputed[:3]} are recomputed in backward (ap.recompute or "
                                      "gradient checkpointing), which B and each W call would do again")
            params = [(n, p) for n, p in st.module.named_parameters() if p.requires_grad]
            if not params:
                raise ValueError(
                    f"Pipeline: {name} splits each backward into input and weight gradients, but stage {c} "
                    f"({st.name}) has no parameters that train; use 1F1B, or give every stage parameters"
                )
            hooked = [n for n, p in params if compat.has_tensor_hooks(p)]
            if hooked:
                raise ValueError(
                    f"Pipeline: {name} adds weight gradients into .grad outside autograd's accumulation, so "
                    f"gradient hooks on stage {c}'s parameters {hooked[:3]} would not run; use 1F1B here"
                )

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def split_inputs(self, inputs: Any) -> list[Any]:
        """The first stage's inputs cut into micro-batches: one tensor, or a tuple (or list) of
        tensors passed to the first stage as positional arguments, each cut along dim 0."""
        if isinstance(inputs, dict):
            raise TypeError("Pipeline.step: inputs must be a tensor or a tuple of tensors (the first stage's "
                            f"positional arguments), got a dict with keys {list(inputs)[:4]}")
        if not isinstance(inputs, (tuple, list)):
            return self.split(inputs, self.meshes[0], "inputs")
        if not inputs:
            raise ValueError("Pipeline.step: inputs is an empty sequence; pass a tensor or a tuple of tensors")
        parts = [self.split(x, self.meshes[0], f"inputs[{i}]") for i, x in enumerate(inputs)]
        if any(p[0] is None for p in parts):
            raise TypeError("Pipeline.step: inputs must be tensors; got None in the inputs tuple")
        return [tuple(mb) for mb in zip(*parts)]

    def split(self, x: Any, mesh: ProcessMesh, what: str) -> list[Any]:
        """``x`` cut into micro-batches along dim 0: each data-parallel shard cuts its own rows."""
        m = self.num_microbatches
        if x is None:
            return [None] * m
        if not isinstance(x, DistTensor):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"Pipeline.step: {what} must be a tensor, got {type(x).__name__}")
            x = shard_tensor(x.detach(), mesh, [Replicate()] * mesh.ndim)
        spec = layout.spec_of(x)
        if spec.mesh != mesh:
            raise ValueError(f"Pipeline.step: {what} live on {spec.mesh!r}; they must be on the stage mesh {mesh!r}")
        if not spec.shape:
            raise ValueError(f"Pipeline.step: {what} is a 0-d tensor; it needs a batch dim to split")
        if any(isinstance(pl, Partial) for pl in spec.placements):
            raise ValueError(f"Pipeline.step: {what} is Partial {list(spec.placements)}; reduce it first")
        shards = 1
        for a in spec.axes_of_dim(0):
            shards *= mesh.shape[a]
        batch = spec.shape[0]
        if batch % (m * shards):
            raise ValueError(
                f"Pipeline.step: {m} micro-batches do not divide the {what} batch of {batch} samples"
                + (f" split over {shards} data-parallel shards ({batch / shards:g} rows per shard)" if shards > 1 else "")
            )
        mb = DistSpec(mesh, spec.placements, (batch // m,) + tuple(spec.shape[1:]), spec.dtype, spec.shard_order)
        local = layout.local_of(x).detach()
        pieces = local.chunk(m) if mesh.coordinate_of(self.rank) is not None else [local] * m
        return [layout.wrap(piece, mb) for piece in pieces]

    def _rows_as_inputs(self, target: Any, x0: DistTensor) -> Any:
        """``target`` with its rows reordered where the inputs and the targets are split over
        different numbers of data-parallel shards (``split``: each shard cuts its own rows), so
        that each target micro-batch holds the rows of the input micro-batch it meets at the last
        stage, in their order. Rows move only then: the target is gathered on the last mesh,
        permuted and laid out again (decided from the layouts alone)."""
        m = self.num_microbatches
        if not isinstance(target, DistTensor) or m == 1:
            return target
        spec, x_spec = layout.spec_of(target), layout.spec_of(x0)
        if not spec.shape or any(isinstance(pl, Partial) for pl in spec.placements):
            return target  # ``split`` says why
        s_in, s_t = _shards(x_spec), _shards(spec)
        batch = spec.shape[0]
        if s_in == s_t or batch != x_spec.shape[0] * m or batch % (m * s_in) or batch % (m * s_t):
            return target  # the same rows already, or ``split`` / the loss says what is wrong
        # input micro-batch k's rows of the whole batch, in order: shard s's k-th piece, for each s
        rows = torch.arange(batch).view(s_in, m, batch // (s_in * m)).transpose(0, 1).reshape(m, batch // m)
        # the same rows as the targets' shards cut them: shard s's k-th piece is rows[k]'s s-th
        order = rows.view(m, s_t, batch // (m * s_t)).transpose(0, 1).reshape(batch)
        whole = layout.reshard(target, spec.with_placements([Replicate()] * spec.mesh.ndim))
        if spec.mesh.coordinate_of(self.rank) is None:
            return target  # holds nothing of it
        local = layout.local_of(whole).detach()
        moved = layout.wrap(local[order.to(local.device)], layout.spec_of(whole))
        return layout.reshard(moved, spec)

    # ---- layouts of the tensors crossing stage boundaries ---------------------------------
    def _next_spec(self, out: DistSpec, nxt: Stage) -> DistSpec:
        if nxt.input_placements is not None:
            placements = tuple(nxt.input_placements)
        elif nxt.mesh.dim_names == out.mesh.dim_names and nxt.mesh.shape == out.mesh.shape:
            placements = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in out.placements)
        else:
            placements = (Replicate(),) * nxt.mesh.ndim
        return DistSpec(nxt.mesh, placements, out.shape, out.dtype)

    def layouts(self, x_specs: tuple[DistSpec, ...], packed: bool, t_spec: DistSpec | None) -> _Layouts:
        """Input/output layouts of every chunk for a micro-batch laid out as ``x_specs`` (cached).

        ``packed``: the first stage's input is a tuple (its tensors are the stage's arguments)."""
        key = (x_specs, packed, t_spec)
        if key in self._layouts:
            return self._layouts[key]
        inputs: list[tuple[DistSpec, ...]] = [x_specs]
        outputs: list[tuple[DistSpec, ...]] = []
        writes: list[bool] = []
        with _shape_pass([s.module for s in self.stages]):
            y: Any = None
            for c, st in enumerate(self.stages):
                args = [_zeros(sp) for sp in inputs[c]]
                versions = [a._version for a in args]  # (an in-place op bumps it on every rank, in the mesh or not)
                y = st.module(*args)
                writes.append([a._version for a in args] != versions)
                y_specs = tuple(layout.spec_of(t) for t in self._check_output(c, y))
                outputs.append(tuple(sp.with_placements([Replicate()] * st.mesh.ndim) for sp in y_specs)
                               if self.local[c] else y_specs)
                if c + 1 < len(self.stages):
                    inputs.append(tuple(self._next_spec(sp, self.stages[c + 1]) for sp in y_specs))
            loss = self.loss_fn(y) if t_spec is None else self.loss_fn(y, _zeros(t_spec))
            if not isinstance(loss, DistTensor) or loss.numel() != 1:
                raise TypeError(f"Pipeline: loss_fn must return a one-element DistTensor, got {type(loss).__name__} {tuple(loss.shape)}")
        out = _Layouts(tuple(inputs), tuple(outputs), layout.spec_of(loss), tuple(writes))
        self._layouts[key] = out
        return out

    def _check_output(self, c: int, y: Any) -> tuple[DistTensor, ...]:
        """Stage ``c``'s output as a tuple of DistTensors on its mesh (one tensor, or a tuple or
        list of them: the next stage gets them as positional arguments, the loss as they are)."""
        st = self.stages[c]
        ys = _tensors(y)
        where = "" if not isinstance(y, (tuple, list)) else " in its output tuple"
        if not ys:
            raise TypeError(f"Pipeline: stage {c} ({st.name}) returned an empty {type(y).__name__}; it must return "
                            "a DistTensor or a tuple of them")
        for i, t in enumerate(ys):
            if not isinstance(t, DistTensor) or t.process_mesh != st.mesh:
                got = f"a DistTensor on {t.process_mesh!r}" if isinstance(t, DistTensor) else type(t).__name__
                at = f" (item {i})" if where else ""
                raise TypeError(f"Pipeline: stage {c} ({st.name}) must return DistTensors on its mesh {st.mesh!r} (one, "
                                f"or a tuple of them); got {got}{where}{at}")
        return ys

    # ---- one training step ----------------------------------------------------------------
    def step(self, inputs: Any, target: Any = None, *, record: bool = False) -> DistTensor:
        """Forward and backward of every micro-batch; returns the mean loss (on the last mesh).

        Parameter gradients are accumulated into ``.grad`` (call ``optimizer.zero_grad()``
        between steps as usual). With ``record``, ``self.events`` holds this rank's timeline.
        """
        if self.schedule.split_backward:  # (a hook may have been registered since the pipeline was built)
            self._check_split_backward()
        xs = self.split_inputs(inputs)
        ts = self.split(self._rows_as_inputs(target, _tensors(xs[0])[0]), self.stages[-1].mesh, "targets")
        packed = isinstance(xs[0], tuple)
        lay = self.layouts(tuple(layout.spec_of(x) for x in _tensors(xs[0])), packed,
                           None if ts[0] is None else layout.spec_of(ts[0]))
        self.events = []
        if self.stage_index is None:
            return _zeros(lay.loss)
        losses = _Run(self, lay, xs, ts, record).execute()
        if not losses:  # not the last stage mesh: the loss lives there
            return _zeros(lay.loss)
        total = losses[0]
        for extra in losses[1:]:
            total = total + extra
        total = total / len(losses)
        return layout.wrap(_as_layout(total, lay.loss), lay.loss)


class _Run:
    """One step's state on this rank: stashed activations, gradients, sends in flight."""

    def __init__(self, pipe: Pipeline, lay: _Layouts, xs: list[Any], ts: list[Any], record: bool) -> None:
        self.pipe, self.lay, self.xs, self.ts, self.record = pipe, lay, xs, ts, record
        self.v = len(pipe.stages)
        self.m = pipe.num_microbatches
        self.inputs: dict[tuple[int, int], tuple[DistTensor, ...]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grads_out: dict[tuple[int, int], dict[int, DistTensor]] = {}  # by the output's index
        self.grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}  # one per input that trains
        self.losses: dict[int, torch.Tensor] = {}
        self.weight_work: dict[tuple[int, int], Callable[[], Any] | None] = {}  # zero-bubble: W, kept by B
        self.saved: dict[tuple[int, int], split_backward.SavedByForward] = {}  # zero-bubble: what F saved, until B
        self.handoff: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # messages between two chunks of this mesh (a V)
        self.pending = p2p.PendingSends()
        self.posted: dict[tuple[str, int, int], list[p2p.PendingRecv]] = {}
        self.local = {c: LocalStage(st) for c, st in enumerate(pipe.stages)
                      if pipe.local[c] and pipe.stage_index == pipe.schedule.stage_of(c)}
        self.device = runtime.default_device()

    def execute(self) -> list[torch.Tensor]:
        pipe = self.pipe
        stage = pipe.stage_index
        assert stage is not None
        actions = pipe.schedule.actions[stage]
        recvs = [i for i, a in enumerate(actions) if a.kind in (RECV_F, RECV_B)]
        for i, a in enumerate(actions):
            t0 = time.perf_counter()
            while recvs and recvs[0] < i + RECV_AHEAD_ACTIONS:  # post receives early: data flows during compute
                ahead = actions[recvs.pop(0)]
                if ahead.peer != stage:  # (a message from this mesh's other chunk is handed over, not posted)
                    self._post(ahead)
            tag = a.tag(self.v, self.m) if a.kind not in COMPUTE else -1
            getattr(self, "_" + a.kind.lower())(a.microbatch, a.chunk, tag)
            if self.record:
                pipe.events.append(Event(pipe.rank, stage, a.kind, a.microbatch, a.chunk, t0, time.perf_counter()))
        self.pending.wait()  # not in a finally: after an error, unmatched sends would never complete
        for loc in self.local.values():
            loc.flush_grads()
        return [self.losses[i] for i in sorted(self.losses)]

    def _plan(self, c: int, backward: bool, k: int) -> Any:
        """Plan of tensor ``k`` of the boundary into chunk ``c`` (forward) or out of it (backward)."""
        src, dst = self.lay.outputs[c - 1][k], self.lay.inputs[c][k]
        return p2p.boundary_plan(layout.grad_spec(dst), layout.grad_spec(src)) if backward else p2p.boundary_plan(src, dst)

    def _tag(self, tag: int, k: int) -> int:
        """The tag of tensor ``k`` of a boundary message (tensor 0 keeps the action's own tag)."""
        return tag + k * 2 * self.v * self.m

    def _crossing(self, c: int, backward: bool) -> list[int]:
        """Which tensors of the boundary into chunk ``c`` cross it (backward: those that train)."""
        specs = self.lay.inputs[c]
        return [k for k, sp in enumerate(specs) if not backward or _trains(sp)]

    def _post(self, a: Action) -> None:
        c = a.chunk if a.kind == RECV_F else a.chunk + 1
        back = a.kind == RECV_B
        self.posted[(a.kind, a.microbatch, a.chunk)] = [
            p2p.post_recv(self._plan(c, back, k), self._tag(a.tag(self.v, self.m), k), self.device)
            for k in self._crossing(c, back)]

    def _here(self, c: int) -> bool:
        """Whether chunk ``c`` lives on this rank's stage mesh (the other side of a V's turn)."""
        return self.pipe.schedule.stage_of(c) == self.pipe.stage_index

    def _recv_f(self, mb: int, c: int, tag: int) -> None:
        locs = self.handoff.pop((F, mb, c)) if self._here(c - 1) else [r.wait() for r in self.posted.pop((RECV_F, mb, c))]
        self.inputs[(mb, c)] = tuple(layout.wrap(local, sp, requires_grad=_trains(sp))
                                     for local, sp in zip(locs, self.lay.inputs[c]))

    def _f(self, mb: int, c: int, tag: int) -> None:
        pipe = self.pipe
        x = self.xs[mb] if c == 0 else self.inputs[(mb, c)]
        args = _tensors(x)
        last = c == self.v - 1
        copy = c > 0 and self.lay.writes[c]  # (the first chunk's inputs are the caller's, written as in one process)

        def eager() -> Any:
            if pipe.schedule.split_backward:  # B releases what W does not read
                track: Any = self.saved.setdefault((mb, c), split_backward.SavedByForward(pipe.meter)).track()
            else:
                track = pipe.meter.track() if pipe.meter is not None else contextlib.nullcontext()
            with track:
                y: Any
                if c in self.local:
                    y = self.local[c].forward(*args, copy=copy)
                else:
                    y = pipe.stages[c].module(*(a.clone() for a in args) if copy else args)
                if last:
                    y = pipe.loss_fn(y) if self.ts[mb] is None else pipe.loss_fn(y, self.ts[mb])
            return y

        chunk = pipe.programs.get(c) if pipe.meter is None else None
        if chunk is not None and (copy or not self.lay.single(c)):
            pipe._say_eager(c, "it writes its input in place" if copy else
                            "it passes several tensors (or one that does not train) across a stage boundary")
            chunk = None
        if chunk is None:
            y = eager()
        else:
            y = chunk.forward(args[0], self.ts[mb] if last else None, pipe.loss_fn if last else None, self.m,
                              self.lay.outputs[c][0], layout.grad_spec(self.lay.inputs[c][0]) if c > 0 else None, eager)
        if last:
            self.losses[mb] = y.value if isinstance(y, Replayed) else y.detach()
        self.outputs[(mb, c)] = y

    def _send_f(self, mb: int, c: int, tag: int) -> None:
        y = self.outputs[(mb, c)]
        ys = _tensors(y.value if isinstance(y, Replayed) else y)
        locs = [_as_layout(t, sp) for t, sp in zip(ys, self.lay.outputs[c])]
        if self._here(c + 1):
            self.handoff[(F, mb, c + 1)] = [_moved(local, src, dst) for local, src, dst
                                            in zip(locs, self.lay.outputs[c], self.lay.inputs[c + 1])]
        else:
            for k, local in enumerate(locs):
                p2p.send(local, self._plan(c + 1, False, k), self._tag(tag, k), self.pending)

    def _recv_b(self, mb: int, c: int, tag: int) -> None:
        crossing = self._crossing(c + 1, True)
        if self._here(c + 1):
            locs = self.handoff.pop((B, mb, c + 1))
        else:
            locs = [r.wait() for r in self.posted.pop((RECV_B, mb, c))]
        self.grads_out[(mb, c)] = {k: layout.wrap(local, layout.grad_spec(self.lay.outputs[c][k]))
                                   for k, local in zip(crossing, locs)}

    def _b(self, mb: int, c: int, tag: int) -> None:
        y = self.outputs.pop((mb, c))
        saved = self.saved.pop((mb, c), None)
        if isinstance(y, Replayed):  # the forward ran as a program: its backward program runs
            g_out = None if c == self.v - 1 else layout.local_of(self.grads_out.pop((mb, c))[0])
            if self.pipe.schedule.split_backward:
                g_in, self.weight_work[(mb, c)] = self.pipe.programs[c].backward_input(y, g_out)
            else:
                g_in = self.pipe.programs[c].backward(y, g_out)
            if c > 0:
                self.inputs.pop((mb, c))
                self.grads_in[(mb, c)] = [g_in]  # type: ignore[list-item]
            return
        if self.pipe.schedule.split_backward:
            if self.lay.single(c):
                self._b_input(mb, c, y, saved)
                return
            self.pipe._say_whole(c, "it passes several tensors (or one that does not train) across a stage boundary")
            self.weight_work[(mb, c)] = None
        if c == self.v - 1:
            if y.requires_grad:
                (y / self.m).backward()
        else:
            ys = _tensors(y)
            pairs = [(ys[k], g) for k, g in self.grads_out.pop((mb, c)).items() if ys[k].requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if c > 0:
            xs = self.inputs.pop((mb, c))
            grads = []
            for k in self._crossing(c, True):
                spec = layout.grad_spec(self.lay.inputs[c][k])
                g = xs[k].grad
                grads.append(_as_layout(g if g is not None else _zeros(spec), spec))
            self.grads_in[(mb, c)] = grads

    def _b_input(self, mb: int, c: int, y: Any, saved: split_backward.SavedByForward | None) -> None:
        """Zero-bubble ``B``: the input's gradient now; what the weights need is kept for ``W``."""
        last = c == self.v - 1
        g_out = None if last else self.grads_out.pop((mb, c))[0]
        x = self.inputs.pop((mb, c))[0] if c > 0 else None
        out = y / self.m if last else _tensors(y)[0]
        params = list(self.local[c].leaves.values()) if c in self.local else list(self.pipe.stages[c].module.parameters())
        gx, work = split_backward.input_grad(out, g_out, x, params, saved, self.pipe._whole_why.get(c)) if out.requires_grad else (None, None)
        if work is not None and work.whole is not None:
            self.pipe._say_whole(c, work.whole)
        self.weight_work[(mb, c)] = None if work is None else (lambda: split_backward.weight_grads(work))
        if c > 0:
            spec = layout.grad_spec(self.lay.inputs[c][0])
            self.grads_in[(mb, c)] = [_as_layout(gx if gx is not None else _zeros(spec), spec)]

    def _w(self, mb: int, c: int, tag: int) -> None:
        work = self.weight_work.pop((mb, c))
        if work is not None:
            work()

    def _send_b(self, mb: int, c: int, tag: int) -> None:
        grads = self.grads_in.pop((mb, c))
        crossing = self._crossing(c, True)
        if self._here(c - 1):
            self.handoff[(B, mb, c)] = [_moved(g, layout.grad_spec(self.lay.inputs[c][k]),
                                               layout.grad_spec(self.lay.outputs[c - 1][k]))
                                        for k, g in zip(crossing, grads)]
        else:
            for k, g in zip(crossing, grads):
                p2p.send(g, self._plan(c, True, k), self._tag(tag, k), self.pending)


def _moved(local: torch.Tensor, src: DistSpec, dst: DistSpec) -> torch.Tensor:
    """This rank's shard in layout ``dst`` of a value it holds in ``src`` (same mesh)."""
    return local if src == dst else layout.move(local, src, dst)


def _shards(spec: DistSpec) -> int:
    """How many data-parallel pieces ``spec`` cuts dim 0 into."""
    n = 1
    for a in spec.axes_of_dim(0):
        n *= spec.mesh.shape[a]
    return n


__all__ = ["Event", "Pipeline"]

