"""``ap.to_static`` and ``DistModel``: a training step captured once per input signature, replayed.

    dist_model = ap.to_static(model, loader=None, loss=loss_fn, optimizer=opt, strategy=None)
    dist_model.train();   loss = dist_model(x, y)   # forward, loss, backward, step, zero_grad
    dist_model.eval();    loss = dist_model(x, y)   # forward + loss
    dist_model.predict(); out = dist_model(x)       # forward only

    ap.to_static(model, loss=loss_fn, optimizer=opt, outputs=True)(x, y)  # (loss, the model's outputs)

Per input signature (``static.signature``: mode, autograd on/off, each input's layout or plain
shape and dtype, nested ones leaf by leaf, other input values as they are, the parameters' layouts
and ``requires_grad``, the buffers' layouts, the modules' hooks, train/eval flags and plain
attribute values) the first call captures the step on fake tensors (``autoparallel.static.capture``:
nothing runs for real) and runs the program; later calls run the same program on the current
local shards. A call that differs from a captured one only in the sizes of the arguments' evenly
split dims (a new batch size or sequence length) is captured with those sizes open
(``autoparallel.static.sizes``): every later such call runs that program where its guards hold at
its sizes. What the program covers: forward, loss, backward and (for a ``shard_optimizer``
optimizer, without gradient merge) its bucketed gradient reductions (for a torch optimizer, each
Partial gradient reduced, the reductions merged); a buffer or tensor attribute
the forward assigns anew is one more output, assigned at every call. A program whose capture
wrote a plain attribute (a counter) is run for that call only, not kept. The optimizer step runs
after the program as in eager mode, on the same parameter and state objects, so LR
schedulers, ``param_groups``, ``model.state_dict()`` and ``ap.save_state_dict`` see exactly
what eager training gives them, and Python scalars of the step (lr, betas, weight decay) are
read at every step, never baked into the program.

A signature whose capture is refused runs eagerly from then on, after one warning that names
the reason (``capture.Capture.refused``). Eager and replayed calls compute the same local ops,
so static training equals eager training.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel import compat, cost
from autoparallel.attributes import Alike, Reads
from autoparallel.compat import tree_flatten, tree_unflatten
from autoparallel.engine import layout
from autoparallel.log import logger
from autoparallel.runtime import comm
from autoparallel.runtime.debug import CommRecord, replay
from autoparallel.spec import DistSpec
from autoparallel.static import signature
from autoparallel.static.capture import Capture, PlainValues, TensorSlots, capture, draws, plain_trained, plain_trained_reason, standing_in
from autoparallel.static.passes import MERGE_BYTES, drop_detaches, hoist_starts, merge_all_reduces, reduce_output, sink_waits, tag_records
from autoparallel.static.sizes import OpenPrograms, OpenSizes, bind_free_sizes, masked, open_dims, open_spec
from autoparallel.static.strategy import Strategy

TRAIN, EVAL, PREDICT = "train", "eval", "predict"
MAX_PROGRAMS = 16  # signatures kept; more distinct ones than this in use warns (and recaptures)


@dataclass
class _Program:
    """A captured step: the program, and how to read its outputs."""

    run: Callable[..., Any]
    out_specs: tuple[tuple[DistSpec, tuple[int, ...]] | None, ...]  # per output: layout (None: plain)
    grad_index: tuple[int, ...]                                     # parameters that get a gradient, in order
    records: tuple[CommRecord, ...]
    tree: Any = None                                                 # how the model's outputs nest
    n_out: int = 0                                                   # train/eval with outputs: their leaves
    # the module slots the step assigns (module, name, whether a buffer): the last outputs, in order
    assigned: tuple[tuple[torch.nn.Module, str, bool], ...] = ()
    sizes: OpenSizes | None = None  # a program of open sizes: the inputs' sizes it serves
    served: int = 0                 # (kept with open sizes) calls at other sizes it ran

    def at(self, binding: dict[Any, Any]) -> _Program:
        """This program of open sizes for one binding of them: its layouts and records in numbers."""
        specs = tuple(None if s is None else (OpenSizes.value(s[0], binding), OpenSizes.value(s[1], binding))
                      for s in self.out_specs)
        return dataclasses.replace(self, out_specs=specs, records=tuple(OpenSizes.record(r, binding) for r in self.records),
                                   sizes=None)


class DistModel:
    """A model, its loss and optimizer run as one captured step per input signature.

    Build it with ``ap.to_static``. ``train()``, ``eval()`` and ``predict()`` choose what a call
    does; ``loader`` is the loader given to ``to_static``. Parameters and optimizer states are
    the model's and the optimizer's own objects, updated in place. With ``outputs=True`` a train
    or eval call returns ``(loss, outputs)``: the model's outputs too (detached), for metrics;
    the program then keeps them alive to its end. ``captures`` counts the captures made so far (a
    call no kept program serves: a capture refused, whose call then ran eagerly, included).
    """

    def __init__(self, model: torch.nn.Module, loader: Any, loss: Callable[..., Any] | None,
                 optimizer: Any, strategy: Strategy | None, *, outputs: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"to_static: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss is not None and not callable(loss):
            raise TypeError(f"to_static: loss must be callable, got {type(loss).__name__}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"to_static: strategy must be an ap.Strategy, got {type(strategy).__name__}")
        if not isinstance(outputs, bool):
            raise TypeError(f"to_static: outputs must be a bool, got {outputs!r}")
        self.network = model
        self.outputs = outputs
        self.loss = loss
        self.optimizer = optimizer
        self.strategy = strategy or Strategy()
        self._loader = loader
        self._mode = TRAIN if loss is not None and optimizer is not None else EVAL if loss is not None else PREDICT
        self._programs: OrderedDict[Any, _Program | str] = OrderedDict()  # signature -> program, or why eager
        self._sizes = OpenPrograms(MAX_PROGRAMS)  # per signature with its open sizes left out: programs of open sizes
        # programs by signature without the modules' attribute values, for a call whose values
        # differ only where the step reads none (a counter the training loop keeps on the model)
        self._alike = Alike(MAX_PROGRAMS, 4 * MAX_PROGRAMS)
        self.captures = 0  # steps captured so far (a new signature its kept programs do not serve)
        self._warned: set[str] = set()
        self._micro = 0                    # calls since the last optimizer step (gradient merge)
        if self.strategy.bucket_bytes is not None and hasattr(optimizer, "bucket_bytes"):
            optimizer.bucket_bytes = self.strategy.bucket_bytes
        hook_model = getattr(optimizer, "hook_model", None)
        if callable(hook_model):  # ZeRO-3's / mixed precision's module hooks, before the first call
            hook_model(model)
        self._apply_mode()

    # ---- modes -------------------------------------------------------------------------------
    def train(self) -> DistModel:
        """Calls train: forward, loss, backward, optimizer step (every ``accumulate_steps`` calls)."""
        if self.loss is None or self.optimizer is None:
            raise ValueError("DistModel.train(): to_static was given no loss or no optimizer")
        self._mode = TRAIN
        self._apply_mode()
        return self

    def eval(self) -> DistModel:
        """Calls evaluate: forward and loss, no update."""
        if self.loss is None:
            raise ValueError("DistModel.eval(): to_static was given no loss")
        self._mode = EVAL
        self._apply_mode()
        return self

    def predict(self) -> DistModel:
        """Calls predict: forward only; returns the model's outputs."""
        self._mode = PREDICT
        self._apply_mode()
        return self

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def loader(self) -> Any:
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        if self._loader is None:
            raise TypeError("DistModel: to_static was given no loader")
        return iter(self._loader)

    def _apply_mode(self) -> None:
        self.network.train(self._mode == TRAIN)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.network.state_dict(*args, **kwargs)

    # ---- calls ---------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if self._mode != PREDICT and len(args) < 2:
            raise TypeError(f"DistModel in {self._mode} mode takes the inputs and then the label: dist_model(x, y)")
        if self._mode == TRAIN:
            return self._call(args)
        with torch.no_grad():  # evaluation and prediction build no autograd graph
            return self._call(args)

    def _call(self, args: tuple[Any, ...]) -> Any:
        with compat.attribute_access():  # (metadata only: ``.requires_grad`` of each parameter, not an op)
            tree = signature.tree(self.network)
            key = self._signature(args, tree)
        params, buffers = tree.params, tree.buffers
        entry = self._programs.get(key)
        if entry is not None:
            self._programs.move_to_end(key)
        else:  # a program of open sizes made for these sizes too, or of a signature differing only
            # in attribute values the step does not read, or a new signature: captured on fake
            # tensors, then run (or refused: eager)
            entry = (self._of_open_sizes(key, args) or self._of_alike(key, tree)
                     or self._capture(key, args, params, buffers, tree))
        if isinstance(entry, _Program):
            return self._replay(entry, args, params, buffers)
        return self._eager(args, params)

    def _signature(self, args: tuple[Any, ...], tree: signature.Tree) -> Any:
        """The mode, autograd on/off, each argument, and the parameters, buffers and modules of
        ``tree`` (the network read: ``signature``; the parts in ``signature.PARTS`` order)."""
        return (self._mode, torch.is_grad_enabled(), tuple(signature.value(a) for a in args), *tree.key)

    def _second_size(self, key: Any, args: tuple[Any, ...]) -> bool:
        """Whether a step of this signature but for its open sizes was captured before (at fixed
        sizes): a step whose sizes change is then captured with them open. The first capture of a
        signature is at fixed sizes: a capture with open sizes takes longer (symbolic meta
        kernels, guards), paid only by a step that is called at more than one size, and not again
        where the signature's open programs served no size but their own."""
        return self._sizes.second_size(self._open_signature(key, args))

    def _open_signature(self, key: Any, args: tuple[Any, ...]) -> Any:
        """``key`` with the arguments' open sizes left out (``static.sizes``): the programs of open
        sizes kept under it may serve the call."""
        leaves, tree = tree_flatten(list(args))
        return (key[0], key[1], tree, tuple(masked(a) if layout.is_dist(a) else signature.leaf(a) for a in leaves), *key[3:])

    def _of_open_sizes(self, key: Any, args: tuple[Any, ...]) -> _Program | None:
        """A kept program of open sizes whose guards hold for ``args``, made for their sizes and
        kept under ``key`` (None: none)."""
        if not self._sizes.open:
            return None
        shapes = [tuple(x.shape) for x in self._inputs(args)[0]]
        entry = self._sizes.serve(self._open_signature(key, args), shapes)
        if entry is not None:
            self._keep(key, entry)
            logger.debug("static: a program of open sizes serves new sizes %s", shapes)
        return entry

    def _of_alike(self, key: Any, tree: signature.Tree) -> _Program | None:
        """The program captured for a signature equal to ``key`` but in module attribute values its
        capture did not read (None: none). Not kept under ``key``: a value that changes at every
        call would fill the table."""
        return self._alike.find(*signature.alike_parts(key[:-1], tree.module_parts))  # type: ignore[no-any-return]

    # ---- eager ---------------------------------------------------------------------------------
    def _eager(self, args: tuple[Any, ...], params: list[torch.Tensor]) -> Any:
        if self._mode == PREDICT:
            return self.network(*args)
        out = self.network(*args[:-1])
        loss = self.loss(out, args[-1])  # type: ignore[misc]
        if self._mode == TRAIN:
            grads = torch.autograd.grad(loss, [p for p in params if p.requires_grad], allow_unused=True)
            self._accumulate([p for p in params if p.requires_grad], list(grads))
            loss = loss.detach()
        if self.outputs:
            leaves, tree = tree_flatten(out)
            return loss, tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], tree)
        return loss

    # ---- capture -------------------------------------------------------------------------------
    def _inputs(self, args: tuple[Any, ...], opened: list[tuple[int, ...]] | None = None
                ) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], list[Any]]]:
        """The tensors of ``args`` (nested in lists, tuples, dicts: any pytree) as program inputs,
        and how to rebuild the args from them (other leaves as they are: the signature holds them).
        ``opened`` (when given) gets each input's open dims (``static.sizes``), and a rebuilt
        DistTensor takes the symbolic sizes of the fake shard there."""
        leaves, tree = tree_flatten(list(args))
        flat: list[torch.Tensor] = []
        how: list[Any] = []
        for a in leaves:
            if layout.is_dist(a):
                dims = open_dims(a) if opened is not None else ()
                how.append(("dist", len(flat), layout.spec_of(a), layout.stride_of(a), dims))
                flat.append(layout.local_of(a))
                if opened is not None:
                    opened.append(dims)
            elif isinstance(a, torch.Tensor):
                how.append(("plain", len(flat)))
                flat.append(a)
                if opened is not None:
                    opened.append(())
            else:
                how.append(("value", a))

        def rebuild(xs: list[torch.Tensor]) -> list[Any]:
            out: list[Any] = []
            for h in how:
                if h[0] == "dist":
                    spec, stride = open_spec(h[2], xs[h[1]], h[4]) if h[4] else (h[2], h[3])
                    out.append(layout.wrap(xs[h[1]], spec, stride))
                elif h[0] == "plain":
                    out.append(xs[h[1]])
                else:
                    out.append(h[1])
            return tree_unflatten(out, tree)  # type: ignore[no-any-return]  # a list, as flattened

        return flat, rebuild

    def _capture(self, key: Any, args: tuple[Any, ...], params: list[torch.Tensor],
                 buffers: list[torch.Tensor], tree: signature.Tree, fixed: bool = False) -> _Program | str:
        """Capture this signature's step on fake tensors (nothing runs for real); returns the
        program kept for it, or why it runs eagerly. The arguments' open sizes
        (``static.sizes``) stay symbolic unless ``fixed`` (or under inductor), so that the program
        serves every size its guards admit; a step they trip is captured at its sizes."""
        plain = plain_trained(self.network) if self._mode == TRAIN else None
        why = plain_trained_reason(plain, self.network) if plain is not None else signature.unkeyed(args)
        if why:
            self._refuse(key, why)
            return why
        owners = params + buffers
        state = [layout.local_or_plain(t) for t in owners]
        opened: list[tuple[int, ...]] = []  # each input's open dims (none under inductor: static shapes)
        open_sizes = (self.strategy.compile != "inductor" and not fixed and os.environ.get("AUTOPARALLEL_OPEN_SIZES", "1") != "0"
                      and self._second_size(key, args))
        xs, rebuild = self._inputs(args, opened if open_sizes else None)
        trained = [p for p in params if p.requires_grad] if self._mode == TRAIN else []
        reduce_here = self._reduces_in_program(trained)
        got: dict[str, Any] = {}

        def step(*flat: torch.Tensor) -> list[torch.Tensor]:
            # The parameters and buffers take the traced (fake) shards flat[:len(state)] for the
            # trace; the inputs are rebuilt around theirs. A buffer or tensor attribute the step
            # assigns is one more output, assigned at every run; the trace leaves the old one.
            with standing_in(owners, self.network.modules(), flat[:len(state)]):
                slots = TensorSlots(self.network.modules())
                try:
                    outs = self._traced(rebuild(list(flat[len(state):])), trained, reduce_here, got)
                    assigned = slots.assigned()
                finally:
                    slots.restore()
            odd = [f"{type(m).__name__}.{k}" for m, k, _, t in assigned if not isinstance(t, torch.Tensor)]
            if odd:
                raise comm.CaptureError(f"the step sets {odd[0]} to a value that is no tensor (a program assigns tensors)")
            got["assigned"] = tuple((m, k, buffer) for m, k, buffer, _ in assigned)
            got["outs"] = outs + [t for *_, t in assigned]
            return [layout.local_of(t) if layout.is_dist(t) else t for t in got["outs"]]

        values = PlainValues(self.network)
        self.captures += not fixed
        # reductions a kernel makes together are issued apart where the passes place them (``passes``)
        overlap = self.strategy.overlap and self._may_overlap()
        start = time.perf_counter()
        reads = Reads(tree.modules)  # which attribute values of the modules the step reads
        # (the program's code is generated once, after the passes)
        with reads:
            result: Capture = capture(step, state + xs, [()] * len(state) + opened if any(opened) else None,
                                      recompile=False, apart=overlap)
        if result.program is None and result.open_sizes is not None or result.refused.startswith("tracing with open"):
            # a step the open sizes trip (a size read as a Python value where no guard can say
            # so): captured at these sizes
            logger.debug("static: capturing at fixed sizes (%s)", result.refused)
            values.restore()
            got.clear()
            xs, rebuild = self._inputs(args)
            with reads:
                result = capture(step, state + xs, recompile=False, apart=overlap)
        took = time.perf_counter() - start
        if result.program is None:
            values.restore()  # the eager call writes them itself
            self._refuse(key, result.refused)
            return result.refused
        outs = got["outs"]
        grad_index = tuple(i for i, g in enumerate(got.get("grads", ())) if g is not None)
        specs = tuple((layout.spec_of(o), layout.stride_of(o)) if layout.is_dist(o) else None for o in outs)
        records = result.records
        if not any(t.requires_grad for t in state + xs if isinstance(t, torch.Tensor)):
            drop_detaches(result.program, recompile=False)  # (it builds no autograd graph: a detach is an alias)
        if overlap:
            sink_waits(result.program, recompile=False)
            hoist_starts(result.program, recompile=False)
            records, specs = self._merge_reductions(result.program, records, specs)
        result.program.recompile()
        if result.open_sizes is not None:  # the sizes the passes' new nodes take, from the inputs too
            why = bind_free_sizes(result.program, result.symbols, [()] * len(state) + opened)
            if why:
                logger.debug("static: capturing at fixed sizes (%s)", why)
                values.restore()
                return self._capture(key, args, params, buffers, tree, fixed=True)
        run: Callable[..., Any] = result.program
        if self.strategy.compile == "inductor":
            run = self._compiled(result.program)
            if draws(result.program):
                self._warn("compile='inductor': the step draws random numbers (dropout); inductor draws them with its "
                           "own generator, so masks differ from eager's for the same seed (compile=None keeps them)")
        program = _Program(run, specs, grad_index, records, got.get("tree"), got.get("n_out", 0), got["assigned"])
        if result.open_sizes is not None:  # kept for the sizes its guards admit; run at these ones
            program = self._open_sizes(key, args, program, result, opened, xs)
        written = values.written()
        if written:  # the trace's writes stand for this call's own; a replay would not repeat them: not kept
            self._warn(f"to_static: the step writes the module attribute{'s' if len(written) > 1 else ''} "
                       f"{', '.join(written)} (a plain Python value), which a program cannot repeat: each call that "
                       "writes it is captured anew; keep such state in a buffer (a tensor), or set it outside the step")
            return program
        self._keep(key, program)
        self._alike.keep(*signature.alike_parts(key[:-1], tree.module_parts), reads, program)
        logger.info("static: captured the %s step in %.2f s (a program of %d nodes, %d collectives%s; %d signatures kept)",
                    self._mode, took, len(result.program.graph.nodes), len(records),
                    ", open sizes" if result.open_sizes is not None else "", len(self._programs))
        return program

    def _open_sizes(self, key: Any, args: tuple[Any, ...], program: _Program, result: Capture,
                    dims: list[tuple[int, ...]], inputs: list[torch.Tensor]) -> _Program:
        """``program`` (captured with open sizes) kept for every size its guards admit, and at
        this call's sizes (``OpenSizes``): returns the latter. ``dims``: each argument input's open
        dims; ``inputs``: the argument inputs."""
        assert result.open_sizes is not None
        symbols = result.symbols[len(result.symbols) - len(dims):]  # (the arguments': the state's are fixed)
        sizes = OpenSizes.of(symbols, dims, result.open_sizes)
        shapes = [tuple(x.shape) for x in inputs]
        binding = sizes.bind(shapes) if sizes is not None else None
        if sizes is None or binding is None:  # its guards speak of other sizes: at these sizes only
            return program.at(OpenSizes.hints(symbols, dims, shapes))
        self._sizes.keep(self._open_signature(key, args), dataclasses.replace(program, sizes=sizes))
        return program.at(binding)

    def _traced(self, inputs: list[Any], trained: list[torch.Tensor], reduce_here: bool,
                got: dict[str, Any]) -> list[Any]:
        """The step on ``inputs`` (under the trace): the program's outputs before the assigned
        slots — predict: the model's output leaves; else the loss, the model's outputs (with
        ``outputs=True``) and in train mode the gradients present. Notes in ``got`` how to read them."""
        if self._mode == PREDICT:
            leaves, got["tree"] = tree_flatten(self.network(*inputs))
            return leaves
        out = self.network(*inputs[:-1])
        loss = self.loss(out, inputs[-1])  # type: ignore[misc]
        shown: list[Any] = []
        if self.outputs:  # the model's outputs, detached, after the loss
            leaves, got["tree"] = tree_flatten(out)
            shown = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            odd = [t for t in shown if not isinstance(t, torch.Tensor)]
            if odd:  # refused: this signature runs eagerly (which returns them as they are)
                raise comm.CaptureError(
                    f"to_static(outputs=True): the model's outputs hold a {type(odd[0]).__name__}, not only tensors, "
                    "and a program returns tensors (transformers models: config.use_cache = False)")
        got["n_out"] = len(shown)
        if self._mode != TRAIN:
            return [loss, *shown]
        grads: Any = torch.autograd.grad(loss, trained, grad_outputs=_seed(loss), allow_unused=True)
        if reduce_here:  # the optimizer's bucketed reductions, as part of the program
            grads = self._reduced(trained, grads)
        elif self._reduces_plainly(trained):  # a torch optimizer would reduce each one at its first read
            grads = tuple(g if g is None or not layout.spec_of(g).has_partial
                          else layout.reshard(g, layout.spec_of(g).without_partial()) for g in grads)
        got["grads"] = grads
        return [loss.detach(), *shown] + [g for g in grads if g is not None]

    def _merge_reductions(self, gm: torch.fx.GraphModule, records: tuple[CommRecord, ...], specs: tuple[Any, ...]
                          ) -> tuple[tuple[CommRecord, ...], tuple[Any, ...]]:
        """Merge the program's all-reduces (``passes.merge_all_reduces``). A loss left Partial on
        one mesh axis (class-split logits) is reduced in the program when that reduction rides
        along another all-reduce over the same group (no collective of its own): the loss then
        comes back Replicate, and reading it costs nothing. Returns the records of what the
        program issues and the outputs' layouts."""
        recs = list(records)
        if not tag_records(gm, recs):
            return records, specs
        optional = []
        loss = specs[0][0] if self._mode != PREDICT and specs and specs[0] is not None else None
        if loss is not None and len(loss.partial_axes()) == 1 and loss.dtype in (torch.float32, torch.float64):
            axis = loss.partial_axes()[0]
            reduce_type = loss.placements[axis].reduce_type
            if reduce_type in ("sum", "max", "min") and loss.mesh.shape[axis] > 1:  # (one member: no group, no sum)
                name, line = comm.captured_group(loss.mesh, axis)
                node = reduce_output(gm, 0, reduce_type, name)
                node.meta["ap_record"] = len(recs)
                recs.append(CommRecord("all_reduce", loss.mesh, axis, line,
                                       *cost.all_reduce_bytes(loss.itemsize * loss.numel, len(line))))
                optional.append(node)
        limit = MERGE_BYTES if self.strategy.bucket_bytes is None else self.strategy.bucket_bytes
        kept, merged = merge_all_reduces(gm, recs, optional, limit, recompile=False)
        if loss is not None and optional and optional[0] in merged:
            specs = ((loss.without_partial(), specs[0][1]), *specs[1:])
        return tuple(kept), specs

    def _may_overlap(self) -> bool:
        """Whether the program's collectives may move (``Strategy.overlap``): not under a ZeRO-3
        optimizer without ``overlap``, whose eager step completes each collective where it is
        issued. A unit gathered ahead of its turn, or a reduction waited for a unit later, holds
        a unit's buffers longer: the program keeps eager's order, and so its peak."""
        stage = getattr(self.optimizer, "stage", None)
        return getattr(stage, "stage", None) != 3 or bool(getattr(stage, "overlap", True))

    def _reduces_in_program(self, trained: list[torch.Tensor]) -> bool:
        """Whether the optimizer's gradient reductions go into the program: a ``shard_optimizer``
        optimizer (``reduce_gradients``), one call per step (no gradient merge: merged gradients
        are reduced once, at the step) and no gradient left over from outside the step."""
        return (self.strategy.accumulate_steps == 1 and callable(getattr(self.optimizer, "reduce_gradients", None))
                and all(p.grad is None for p in trained))

    def _reduces_plainly(self, trained: list[torch.Tensor]) -> bool:
        """Whether a Partial gradient is reduced in the program for an optimizer that does not
        reduce them itself (a torch optimizer: its first op on a gradient would all-reduce it
        alone, after the program): one call per step, no gradient from outside the step. The
        reductions then join the program's merged all-reduces; the gradients the step sees are
        the reduced values, as the optimizer's ops would read them."""
        return (self.optimizer is not None and not callable(getattr(self.optimizer, "reduce_gradients", None))
                and self.strategy.accumulate_steps == 1 and all(p.grad is None for p in trained))

    def _reduced(self, trained: list[torch.Tensor], grads: tuple[Any, ...]) -> list[Any]:
        """``grads`` reduced by the optimizer's own bucketed plan (the collectives its step would
        issue, in the same buckets), as the gradients the step then sees."""
        for p, g in zip(trained, grads):
            p.grad = g
        try:
            self.optimizer.reduce_gradients()
            return [p.grad for p in trained]
        finally:
            for p in trained:
                p.grad = None

    def _compiled(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        """``gm`` compiled by inductor; where compiling fails (at its first call, before anything
        runs), the plain program, after a warning naming the error."""
        try:
            compiled = torch.compile(gm, backend="inductor")
        except Exception as e:  # noqa: BLE001  (any compiler failure: replay the plain program)
            self._warn(f"compile='inductor' failed ({type(e).__name__}: {e}); replaying the captured program as it is")
            return gm
        state: dict[str, Callable[..., Any] | None] = {"run": None}

        def run(*flat: torch.Tensor) -> Any:
            if state["run"] is not None:
                return state["run"](*flat)
            logger.info("static: compiling the %s program with inductor (%d nodes; its first call compiles)",
                        self._mode, len(gm.graph.nodes))
            start = time.perf_counter()
            try:
                out = compiled(*flat)
            except Exception as e:  # noqa: BLE001  (the same on every rank: the same program and compiler)
                self._warn(f"compile='inductor' failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                           "replaying the captured program as it is")
                state["run"] = gm
                return gm(*flat)
            logger.info("static: compiled the %s program with inductor in %.2f s (and ran it once)", self._mode,
                        time.perf_counter() - start)
            state["run"] = compiled
            return out

        return run

    def _keep(self, key: Any, program: _Program | str) -> None:
        last = next(reversed(self._programs), None)  # the signature used last
        self._programs[key] = program
        if len(self._programs) > MAX_PROGRAMS:
            self._programs.popitem(last=False)
            what = signature.changed(last, key, self.network) if last is not None else "the signature"
            self._warn(f"more than {MAX_PROGRAMS} call signatures in use: each new one is captured again and the "
                       f"oldest program dropped (this call's differs from the last one in: {what}); pad or bucket "
                       "the inputs, and keep a value that changes at every step (a counter, an annealed temperature) "
                       "in a tensor (a buffer) the step reads", once="programs")

    def _refuse(self, key: Any, reason: str) -> None:
        logger.debug("static: signature refused (%s): %s", self._mode, reason)
        self._keep(key, reason)
        self._warn(f"to_static: this step runs eagerly: {reason}")

    def _warn(self, message: str, once: str | None = None) -> None:
        """Warn ``message`` once (per ``once`` when given, else per message)."""
        if (once or message) not in self._warned:
            self._warned.add(once or message)
            warnings.warn(f"autoparallel: {message}", stacklevel=3)

    # ---- replay --------------------------------------------------------------------------------
    def _replay(self, prog: _Program, args: tuple[Any, ...], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> Any:
        state = [layout.local_or_plain(t) for t in params + buffers]
        xs, _ = self._inputs(args)
        outs = prog.run(*state, *xs)
        replay(prog.records)
        wrapped = [o if s is None else layout.wrap(o, s[0], s[1]) for o, s in zip(outs, prog.out_specs)]
        if prog.assigned:  # the buffers and tensor attributes the step assigns: as eager leaves them
            wrapped, values = wrapped[:-len(prog.assigned)], wrapped[-len(prog.assigned):]
            for (m, name, buffer), t in zip(prog.assigned, values):
                if buffer:
                    compat.own_buffers(m)[name] = t
                else:
                    m.__dict__[name] = t
        if self._mode == PREDICT:
            return tree_unflatten(wrapped, prog.tree)
        if self._mode == TRAIN:
            trained = [p for p in params if p.requires_grad]
            grads: list[Any] = [None] * len(trained)
            for i, g in zip(prog.grad_index, wrapped[1 + prog.n_out:]):
                grads[i] = g
            self._accumulate(trained, grads)
        if self.outputs:
            return wrapped[0], tree_unflatten(wrapped[1:1 + prog.n_out], prog.tree)
        return wrapped[0]

    # ---- gradients and the optimizer step --------------------------------------------------------
    def _accumulate(self, params: list[torch.Tensor], grads: list[Any]) -> None:
        """Add this call's gradients to ``.grad``; on the last call of a merge group, average and
        step the optimizer, then clear the gradients."""
        with compat.attribute_access():  # (``.grad`` of each parameter: attributes, and a sum of DistTensors)
            for p, g in zip(params, grads):
                if g is None:
                    continue
                if g.requires_grad:
                    g = g.detach()
                p.grad = g if p.grad is None else p.grad + g
        self._micro += 1
        k = self.strategy.accumulate_steps
        if self._micro < k:
            return
        self._micro = 0
        if k > 1:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(k)
        self.optimizer.step()
        self.optimizer.zero_grad()


def to_static(model: torch.nn.Module, loader: Any = None, loss: Callable[..., Any] | None = None,
              optimizer: Any = None, strategy: Strategy | None = None, *, outputs: bool = False) -> DistModel:
    """Wrap ``model`` (laid out with the eager API), ``loss`` and ``optimizer`` so that each call
    runs one captured step (see ``DistModel``). The mode starts as ``train`` when a loss and an
    optimizer are given, ``eval`` with a loss only, else ``predict``. ``outputs=True``: train and
    eval calls return ``(loss, the model's outputs)``."""
    return DistModel(model, loader, loss, optimizer, strategy, outputs=outputs)


def _seed(loss: Any) -> Any:
    """The backward's seed for a whole scalar loss: ones made from its layout rather than from
    its value (autograd's default, ``ones_like(loss)``, reads the loss), so the backward does not
    wait for the loss itself: a loss reduced over ranks is then waited for at the end (``passes``).
    None (autograd's default) for anything else."""
    if not layout.is_dist(loss) or loss.dim() != 0:
        return None
    spec = layout.spec_of(loss)
    if spec.has_partial:
        return None
    return layout.wrap(torch.ones((), dtype=loss.dtype, device=layout.local_of(loss).device), spec)
