"""Static pipeline chunks: a stage chunk's forward and backward captured once, replayed per micro-batch.

A pipeline schedule runs each chunk's forward (F) and backward (B) at different times, with
point-to-point transfers in between; the transfers stay with the runner, the compute is
captured. Per chunk and input signature (the input's and target's layouts, the parameters'
layouts and ``requires_grad``, the buffers' layouts, the chunk's hooks, train/eval flags and plain
attribute values: ``static.signature``):

1. at the chunk's first F, one *joint* program is captured on fake tensors
   (``static.capture``: nothing runs for real) — forward, the loss on the last chunk,
   ``autograd.grad`` of the output (a zero output gradient stands in for the one the schedule
   will receive) — and cut into a forward program and a backward program (``static.split``);
2. that F and every later one runs the forward program on the current local shards and keeps the values the
   backward needs; the matching B runs the backward program on them and the received output
   gradient, adds the parameters' gradients into ``.grad`` and returns the input's gradient.
   Both programs get the overlap passes (``static.passes``: collectives inside the stage start
   early and are waited for late).
3. under a zero-bubble schedule (``split_backward``) the backward program of a chunk with an input
   gradient is cut once more (``static.split.split_input_weight``): ``B`` runs the ops the input's
   gradient needs and keeps what the rest reads; ``W`` runs the rest, the weights' gradients.

``Pipeline(..., static=True)`` builds one ``StaticChunk`` per chunk of this rank's stage mesh
(one-rank stages already run on plain tensors, ``pipeline.local``, and stay as they are); with
an ``ActivationMeter`` attached the chunks run eagerly (the meter counts autograd's saved tensors).

A chunk whose capture is refused (``.item()`` in the step, an op without a rule, a forward
output reading the output gradient, a forward assigning a buffer) runs eagerly from then on,
after one warning naming why.

New sizes (``static.sizes``): the first forward of a signature is captured at its sizes; a
forward that differs from a captured one only in the open sizes of its input, target and output
gradient is captured with them open, and those programs serve every later such forward whose
guards hold (as ``DistModel``'s do); where the open capture fails, at fixed sizes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoparallel.attributes import Alike, Reads
from autoparallel.engine import layout
from autoparallel.log import logger
from autoparallel.runtime.debug import CommRecord, replay
from autoparallel.spec import DistSpec, shape_key
from autoparallel.static import signature
from autoparallel.static.capture import PlainValues, capture, kept_in_place, plain_trained, plain_trained_reason
from autoparallel.static.passes import drop_detaches, hoist_starts, sink_waits
from autoparallel.static.sizes import OpenPrograms, OpenSizes, masked, open_dims, open_spec, spec_open_dims
from autoparallel.static.split import SplitError, split_input_weight, split_joint

MAX_FAMILIES = 16  # per chunk: signatures (open sizes left out) whose programs of open sizes are kept


@dataclass
class _Programs:
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    n_saved: int
    grad_specs: tuple[DistSpec | None, ...]   # per trained parameter: its gradient's layout (None: no gradient)
    records: tuple[CommRecord, ...]
    out: tuple[DistSpec, tuple[int, ...]] | None  # the output's layout and strides (None: a plain loss)
    # zero-bubble: the backward cut into the input gradient's ops and the weights' (None: not cut)
    input_grad: torch.fx.GraphModule | None = None
    weight_grads: torch.fx.GraphModule | None = None
    sizes: OpenSizes | None = None  # captured with open sizes: the inputs' sizes it serves
    served: int = 0                 # (kept with open sizes) forwards at other sizes it ran

    def at(self, binding: dict[Any, Any]) -> _Programs:
        """These programs of open sizes for one binding of them: the output's layout and the
        records in numbers."""
        out = None if self.out is None else (OpenSizes.value(self.out[0], binding), OpenSizes.value(self.out[1], binding))
        return replace(self, out=out, records=tuple(OpenSizes.record(r, binding) for r in self.records), sizes=None)


@dataclass
class Replayed:
    """A forward run by the program: its output (a DistTensor without autograd history) and
    the values its backward needs."""

    value: Any
    saved: tuple[torch.Tensor, ...]
    programs: _Programs


class StaticChunk:
    """One chunk's captured programs, by input signature (see the module docstring).

    ``out_spec``: the layout the runner sends the output in (the chunk's output layout);
    ``in_grad_spec``: the layout of the input's gradient it sends back (None: first chunk);
    ``loss_fn`` and ``divide``: the last chunk's loss and the number of micro-batches its
    backward divides it by.
    """

    def __init__(self, module: torch.nn.Module, name: str, as_layout: Callable[[torch.Tensor, DistSpec], torch.Tensor],
                 warn: Callable[[str], None] | None = None, split_backward: bool = False) -> None:
        self.module = module
        self.split_backward = split_backward
        self.name = name
        self._as_layout = as_layout
        self._programs: dict[Any, _Programs | str] = {}
        self._sizes = OpenPrograms(MAX_FAMILIES)  # per signature with its open sizes left out: programs of open sizes
        self._alike = Alike()  # programs a call differing only in attribute values nothing read may run
        self._warn = warn or (lambda m: warnings.warn(f"autoparallel: {m}", stacklevel=4))

    # ---- signature -------------------------------------------------------------------------
    # a key: (input, target, output layout, input gradient layout, parameters, buffers, modules, autograd)
    def _key(self, x: Any, t: Any, out_spec: DistSpec, in_grad_spec: DistSpec | None, tree: signature.Tree) -> Any:
        return (signature.value(x), signature.value(t), out_spec, in_grad_spec, *tree.key, torch.is_grad_enabled())

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: Any, t: Any, loss_fn: Any, divide: int, out_spec: DistSpec,
                in_grad_spec: DistSpec | None, eager: Callable[[], Any]) -> Any:
        """The chunk's forward: a ``Replayed`` when a program ran, else ``eager()``'s result.

        ``loss_fn`` is None except on the last chunk (then ``t`` is its target or None)."""
        tree = signature.tree(self.module)  # (read once: the key's parts, and the state a program reads)
        key = self._key(x, t, out_spec, in_grad_spec, tree)
        entry = self._programs.get(key)
        last = loss_fn is not None
        if entry is None:  # programs of open sizes made for these sizes too
            entry = self._of_open_sizes(key, x, t, out_spec, last)
        if entry is None:  # of a signature differing only in attribute values the forward does not read
            entry = self._alike.find(*signature.alike_parts(_without_modules(key), tree.module_parts))
        if isinstance(entry, _Programs):
            return self._run(entry, x, t, tree)
        if isinstance(entry, str):
            return eager()
        start = time.perf_counter()
        values = PlainValues(self.module)
        family = self._family(key, x, t)
        progs = None
        reads = Reads(tree.modules)  # which attribute values of the modules the forward reads
        if self._sizes.second_size(family):  # a second size: opened
            with reads:
                progs = self._capture(x, t, loss_fn, divide, out_spec, in_grad_spec, open_sizes=True)
            if isinstance(progs, str):  # (the open sizes tripped the trace: at fixed sizes)
                logger.debug("static: pipeline chunk %s captured at fixed sizes (%s)", self.name, progs)
                values.restore()
                progs = None
        if progs is None:
            with reads:
                progs = self._capture(x, t, loss_fn, divide, out_spec, in_grad_spec)
        if isinstance(progs, str):
            values.restore()  # the eager forward writes them itself
            self._refuse(key, progs)
            return eager()
        logger.info("static: captured pipeline chunk %s in %.2f s (forward %d nodes, backward %d nodes, %d collectives)",
                    self.name, time.perf_counter() - start, len(progs.forward.graph.nodes),
                    len(progs.backward.graph.nodes), len(progs.records))
        written = values.written()
        if written:  # the trace's writes stand for this forward's own; a replay would not repeat them: not kept
            self._warn(f"Pipeline(static=True): chunk {self.name}'s forward writes the module attribute"
                       f"{'s' if len(written) > 1 else ''} {', '.join(written)} (a plain Python value), which a program "
                       "cannot repeat: each forward that writes it is captured anew; keep such state in a buffer")
        else:
            binding = progs.sizes.bind(self._shapes(x, t, out_spec, last)) if progs.sizes is not None else None
            if progs.sizes is not None and binding is not None:
                self._sizes.keep(family, progs)
                progs = progs.at(binding)
            elif progs.sizes is not None:  # (not its own sizes: at fixed sizes)
                with reads:
                    progs = self._capture(x, t, loss_fn, divide, out_spec, in_grad_spec)
                if isinstance(progs, str):
                    self._refuse(key, progs)
                    return eager()
            self._programs[key] = progs
            self._alike.keep(*signature.alike_parts(_without_modules(key), tree.module_parts), reads, progs)
        return self._run(progs, x, t, tree)

    # ---- open sizes --------------------------------------------------------------------------
    def _family(self, key: Any, x: Any, t: Any) -> Any:
        """``key`` with the open sizes of the input and target left out (and the boundary layouts'
        shapes, which follow from them)."""
        out_spec, in_grad_spec = key[2], key[3]
        return (masked(x), masked(t) if layout.is_dist(t) else key[1], _placed(out_spec), _placed(in_grad_spec), *key[4:])

    def _shapes(self, x: Any, t: Any, out_spec: DistSpec, last: bool) -> list[tuple[int, ...]]:
        """The program inputs' shapes of a forward: state, input, target, output gradient."""
        _, state = self._state()
        shapes = [tuple(s.shape) for s in state] + [tuple(layout.local_of(x).shape)]
        if t is not None:
            shapes.append(tuple(layout.local_or_plain(t).shape))
        if not last:
            gspec = layout.grad_spec(out_spec)
            shapes.append(tuple(gspec.local_shape(gspec.mesh.coordinate_of(self._rank()))))
        return shapes

    def _of_open_sizes(self, key: Any, x: Any, t: Any, out_spec: DistSpec, last: bool) -> _Programs | None:
        """Kept programs of open sizes whose guards hold for this forward, made for its sizes and
        kept under ``key`` (None: none)."""
        if not self._sizes.open:
            return None
        entry = self._sizes.serve(self._family(key, x, t), self._shapes(x, t, out_spec, last))
        if entry is not None:
            self._programs[key] = entry
        return entry

    def _refuse(self, key: Any, reason: str) -> None:
        self._programs[key] = reason
        self._warn(f"Pipeline(static=True): chunk {self.name} runs eagerly: {reason}")

    def _state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the parameters, the shards the programs read: the parameters' and buffers')."""
        params: list[torch.Tensor] = list(self.module.parameters())
        return params, [layout.local_or_plain(t) for t in params + list(self.module.buffers())]

    def _capture(self, x: Any, t: Any, loss_fn: Any, divide: int, out_spec: DistSpec,
                 in_grad_spec: DistSpec | None, open_sizes: bool = False) -> _Programs | str:
        plain = plain_trained(self.module) if torch.is_grad_enabled() else None
        if plain is not None:
            return plain_trained_reason(plain)
        params, state = self._state()
        owners = params + list(self.module.buffers())
        trained = [p for p in params if p.requires_grad]
        x_spec, x_stride = layout.spec_of(x), layout.stride_of(x)
        t_how = None if t is None else (layout.spec_of(t), layout.stride_of(t)) if layout.is_dist(t) else "plain"
        inputs = state + [layout.local_of(x)] + ([] if t is None else [layout.local_or_plain(t)])
        n_primals = len(inputs)
        last = loss_fn is not None
        gspec = layout.grad_spec(out_spec)
        if not last:
            coord = gspec.mesh.coordinate_of(self._rank())
            inputs.append(torch.zeros(gspec.local_shape(coord), dtype=gspec.dtype, device=layout.local_of(x).device))
        # open sizes: the input's and target's evenly split dims, and the output gradient's
        x_dims = open_dims(x) if open_sizes else ()
        t_dims = open_dims(t) if open_sizes and layout.is_dist(t) else ()
        g_dims = spec_open_dims(gspec, inputs[-1]) if open_sizes and not last else ()
        dims = [()] * len(state) + [x_dims] + ([] if t is None else [t_dims]) + ([] if last else [g_dims])
        got: dict[str, Any] = {}

        def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
            return kept_in_place(owners, self.module.modules(), flat[:len(state)], lambda: traced(flat))

        def traced(flat: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
            xs, xst = open_spec(x_spec, flat[len(state)], x_dims) if x_dims else (x_spec, x_stride)
            xd = layout.wrap(flat[len(state)], xs, xst, requires_grad=in_grad_spec is not None)
            td: Any = None
            if t is not None:
                tl = flat[len(state) + 1]
                if isinstance(t_how, tuple):
                    ts, tst = open_spec(t_how[0], tl, t_dims) if t_dims else t_how
                    td = layout.wrap(tl, ts, tst)
                else:
                    td = tl
            y = self.module(xd)
            # the boundary layouts over the traced sizes (the same ones at fixed sizes)
            boundary = out_spec if not open_sizes else _over(out_spec, layout.spec_of(y) if layout.is_dist(y) else None)
            in_grad = None if in_grad_spec is None else _over(in_grad_spec, xs) if open_sizes else in_grad_spec
            wrt = trained + ([xd] if in_grad_spec is not None else [])
            if last:
                loss = loss_fn(y) if td is None else loss_fn(y, td)
                got["out"] = (layout.spec_of(loss), layout.stride_of(loss)) if layout.is_dist(loss) else None
                out = layout.local_of(loss.detach()) if layout.is_dist(loss) else loss.detach()  # type: ignore[arg-type]
                grads = torch.autograd.grad(loss / divide, wrt, allow_unused=True) if wrt else ()
            else:
                out = self._as_layout(y, boundary)
                got["out"] = (boundary, tuple(out.stride()))
                g_out = layout.wrap(flat[-1], layout.grad_spec(boundary))
                grads = torch.autograd.grad(y, wrt, g_out, allow_unused=True) if wrt else ()
            pgrads = list(grads[:len(trained)])
            got["specs"] = tuple(layout.spec_or_none(g) for g in pgrads)
            locs = [layout.local_of(g) for g in pgrads if g is not None]  # type: ignore[arg-type]  # DistTensor grads
            if in_grad is not None:
                gx = grads[-1]
                if gx is None:
                    gx_local = torch.zeros(in_grad.local_shape(in_grad.mesh.coordinate_of(self._rank())),
                                           dtype=in_grad.dtype, device=out.device)
                else:
                    gx_local = self._as_layout(gx, in_grad)
                locs.append(gx_local)
            return [out] + locs

        result = capture(joint, inputs, dims if open_sizes else None, recompile=False)  # (only split: not run)
        if result.program is None:
            return result.refused
        sizes, why = result.sizes(dims)
        if why:
            return why
        try:
            parts = split_joint(result.program, n_primals, 1)
            cut = split_input_weight(parts.backward) if self.split_backward and in_grad_spec is not None else None
            programs = [parts.forward, parts.backward] + ([cut.input_grad, cut.weight_grads] if cut else [])
            alias_only = not any(t.requires_grad for t in inputs if isinstance(t, torch.Tensor))
            for gm in programs:  # collectives inside the stage: start early, wait late
                if alias_only:  # (no autograd graph is built: a detach is an alias)
                    drop_detaches(gm, recompile=False)
                sink_waits(gm, recompile=False)
                hoist_starts(gm, recompile=False)
                gm.recompile()  # (once, after the passes)
        except SplitError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001  (a program the passes cannot handle: the same on every rank of the stage)
            return f"the captured program could not be split ({type(e).__name__}: {e})"
        return _Programs(parts.forward, parts.backward, parts.num_saved, got["specs"], result.records, got["out"],
                         cut.input_grad if cut else None, cut.weight_grads if cut else None, sizes)

    @staticmethod
    def _rank() -> int:
        from autoparallel import runtime
        return runtime.get_rank()

    def _run(self, progs: _Programs, x: Any, t: Any, tree: signature.Tree) -> Replayed:
        state = [layout.local_or_plain(s) for s in tree.params + tree.buffers]
        inputs = state + [layout.local_of(x)] + ([] if t is None else [layout.local_or_plain(t)])
        outs = progs.forward(*inputs)
        replay(progs.records)
        value = outs[0] if progs.out is None else layout.wrap(outs[0], progs.out[0], progs.out[1])
        return Replayed(value, tuple(outs[1:]), progs)

    # ---- backward ----------------------------------------------------------------------------
    def backward(self, done: Replayed, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """The backward of a replayed forward: parameters' gradients added into ``.grad``; returns
        the input's gradient (this rank's shard in the layout the runner sends; None: first chunk)."""
        grads = done.programs.backward(*done.saved, *([] if grad_out is None else [grad_out]))
        k = self._add_grads(done.programs, grads)
        return grads[k] if k < len(grads) else None

    def backward_input(self, done: Replayed, grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, Callable[[], None]]:
        """Zero-bubble ``B``: the input's gradient now, and ``W``, a call adding the parameters'
        gradients later (a first chunk, with no input gradient, runs its whole backward in ``W``)."""
        progs = done.programs
        args = (*done.saved, *([] if grad_out is None else [grad_out]))
        if progs.input_grad is None or progs.weight_grads is None:
            program, g_in, later = progs.backward, None, args
        else:
            program, (g_in, *carry) = progs.weight_grads, progs.input_grad(*args)
            later = tuple(carry)

        def weights() -> None:
            self._add_grads(progs, program(*later))

        return g_in, weights

    def _add_grads(self, progs: _Programs, grads: Any) -> int:
        """Add the parameters' gradients (the first outputs of ``grads``) into ``.grad``; returns
        how many there were."""
        params, _ = self._state()
        trained = [p for p in params if p.requires_grad]
        k = 0
        with torch.no_grad():
            for p, spec in zip(trained, progs.grad_specs):
                if spec is None:
                    continue
                g = grads[k]
                k += 1
                if p.grad is None:
                    p.grad = layout.wrap(g, spec)
                elif layout.spec_or_none(p.grad) == spec:
                    layout.set_local_(p.grad, layout.local_of(p.grad) + g)  # type: ignore[arg-type]  # a DistTensor grad
                else:
                    p.grad = p.grad + layout.wrap(g, spec)
        return k


def _placed(spec: DistSpec | None) -> Any:
    """A boundary layout without its shape (a signature of open sizes)."""
    return None if spec is None else (spec.mesh, spec.placements, spec.shard_order, spec.dtype, spec.ndim)


def _over(spec: DistSpec, like: DistSpec | None) -> DistSpec:
    """``spec`` over ``like``'s (symbolic) shape: a boundary layout in a capture of open sizes."""
    if like is None or like.ndim != spec.ndim or shape_key(like.shape) == shape_key(spec.shape):
        return spec
    return spec.with_shape(like.shape)


def _without_modules(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A chunk's key (``StaticChunk._key``) without its modules' part."""
    return (*key[:6], *key[7:])
