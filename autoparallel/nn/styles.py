"""Parallel styles: how one module is laid out on the tensor-parallel ("tp") mesh axis.

A style shards its module's own parameters (``weight``, ``bias``) on the tp axis — every other
mesh axis stays Replicate — and installs forward hooks that bring the module's input and
output to the layouts the style stands for. The hooks only call ``ap.reshard`` /
``ap.shard_tensor``, so the collectives a model issues are exactly those moves (and their
autograd reverses), visible in ``ap.CommDebugMode``:

==========================  ===============================  ==============================
style                       forward                          backward
==========================  ===============================  ==============================
ColWiseParallel             input -> R on tp (all-gather      input grad P -> S(seq)
                            when it arrived S(seq), else      (reduce-scatter) or P -> R
                            nothing)                          (all-reduce)
RowWiseParallel             output P -> R (all-reduce) or     output grad: S(seq) -> R
                            P -> S(seq) (reduce-scatter)      (all-gather) or nothing
SequenceParallel            input -> S(seq) (a local slice    nothing for a slice
                            of a replicated input)
VocabParallelEmbedding      output P -> R / S(seq)            as RowWiseParallel
==========================  ===============================  ==============================

Divisibility: the core handles uneven shards exactly, so no style requires a parameter dim to
divide by the tp degree (uneven out-features, in-features or vocabularies work). The one check
is ``SequenceParallel``'s: the sequence dim of an activation entering a sequence-parallel region
must divide by the tp degree, because Megatron-SP's point is equal-size all-gathers and
reduce-scatters (uneven pieces would make the all-gather an all-to-all and pad the
reduce-scatter). It raises ``ValueError`` at the forward pre-hook, from the global shape alone,
on every rank before any collective of that step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoparallel.mesh import ProcessMesh
from autoparallel.nn.layout import Layout, check_layout, map_layouts, to_layout
from autoparallel.nn.shard_layer import ParamSharder
from autoparallel.placement import Partial, Placement, Replicate, Shard
from autoparallel.regions import moves


@dataclass(frozen=True)
class PlanContext:
    """What every style of one ``parallelize`` call shares: mesh, tp axis, SP sequence dim."""

    mesh: ProcessMesh
    axis: int
    seq_dim: int | None  # the sequence dim when the plan has SequenceParallel styles
    sharder: ParamSharder

    @property
    def degree(self) -> int:
        return self.mesh.shape[self.axis]

    def on_axis(self, p: Placement) -> list[Placement]:
        """``p`` on the tp axis, Replicate on every other mesh axis."""
        out: list[Placement] = [Replicate()] * self.mesh.ndim
        out[self.axis] = p
        return out

    def shard_param(self, module: nn.Module, attr: str, p: Placement, where: str) -> None:
        if getattr(module, attr, None) is not None:
            self.sharder.place(module, attr, self.on_axis(p), f"{where}.{attr}" if where else attr)


def in_out_weight(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight ``(in_features, out_features)`` and computes ``x @ weight``.

    ``nn.Linear`` stores ``(out, in)``; GPT-2's ``transformers.pytorch_utils.Conv1D`` (``nx`` in,
    ``nf`` out: ``addmm(bias, x, weight)``) stores it transposed. Detected from the module's
    attributes (``nf``/``nx`` and a 2-d ``(nx, nf)`` weight), so the library never imports
    ``transformers``; a style's ``transposed=True`` states it for any other such module.
    """
    w = getattr(module, "weight", None)
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", None)
    return (not isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(nf, int) and isinstance(nx, int)
            and isinstance(w, torch.Tensor) and tuple(w.shape) == (nx, nf))


def _transposed(style: Any, module: nn.Module) -> bool:
    return bool(style.transposed) if style.transposed is not None else in_out_weight(module)


def per_position(module: nn.Module) -> bool:
    """Whether ``module`` looks like a norm/dropout a model wrote itself: a leaf module whose
    parameters are all 1-d (per-feature scales and shifts) and that has at least one, or whose
    class name ends in ``Norm``/``Dropout``. ``SequenceParallel`` accepts these besides
    ``nn.LayerNorm``/``nn.RMSNorm``/``nn.Dropout`` — it needs a module that treats each position
    alone, which per-feature parameters (no mixing matrix) make the rule for a norm."""
    if any(True for _ in module.children()):
        return False
    params = [p for p in module.parameters(recurse=False)]
    if params:
        return all(p.dim() == 1 for p in params)
    return type(module).__name__.endswith(("Norm", "Dropout"))


class _LinearLike:
    """Mixin of the Linear styles: also accept a module with an ``(in, out)`` weight (GPT-2 Conv1D)."""

    transposed: bool | None = None

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        if _transposed(self, module):
            w = getattr(module, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                raise TypeError(f"{type(self).__name__}(transposed=True) on module {name!r}: needs a 2-d weight")
            return
        ParallelStyle.check(self, name, module, mesh, axis)  # type: ignore[arg-type]


class ParallelStyle:
    """Base of the styles: ``check`` (pure, before anything runs) then ``apply`` (in place)."""

    module_types: tuple[type[nn.Module], ...] = (nn.Module,)
    shards_parameters = True  # at most one parameter-sharding style per module
    uses_tp_axis = True  # False: works on an axis of its own (``parallelize`` needs no tp axis for it)

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        """Raise ``TypeError``/``ValueError`` if this style cannot apply to ``module``."""
        if not isinstance(module, self.module_types):
            kinds = ", ".join(f"nn.{t.__name__}" for t in self.module_types)
            raise TypeError(
                f"{type(self).__name__} on module {name!r}: supports {kinds}, got {type(module).__name__}"
            )

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement on the tp axis of each parameter this style lays out (pure)."""
        return {}

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        """(first input's layout, output's layout) this style brings ``module`` to, ``None``
        where it leaves the value (pure: ``seq_dim`` is the plan's SP sequence dim or None)."""
        return None, None

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        raise NotImplementedError

    def shard_params(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        for attr, p in self.param_placements(module).items():
            ctx.shard_param(module, attr, p, name)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _input_hook(module: nn.Module, layout: Layout, ctx: PlanContext, where: str, check: Any = None) -> None:
    """Forward pre-hook: the first positional input to ``layout`` (after ``check(x)``, a
    ``_seq_check``)."""
    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args:
            return args
        if check is not None:
            check(args[0])
        return (to_layout(args[0], ctx.mesh, ctx.axis, layout, where), *args[1:])

    module.register_forward_pre_hook(moves.style_hook(hook, ("input", layout_key(layout), *_check_key(ctx, check))))


def _output_hook(module: nn.Module, layout: Layout, ctx: PlanContext, where: str, check: Any = None) -> None:
    """Forward hook: the output (a tensor) to ``layout`` (after ``check(out)``)."""
    def hook(_: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if check is not None:
            check(out)
        return to_layout(out, ctx.mesh, ctx.axis, layout, where)

    module.register_forward_hook(moves.style_hook(hook, ("output", layout_key(layout), *_check_key(ctx, check))))


def layout_key(layout: Layout) -> Any:
    """A hashable form of ``layout`` (a style hook's key, ``moves.style_hook``)."""
    return tuple(layout) if isinstance(layout, (list, tuple)) else layout


def _check_key(ctx: PlanContext, check: Any) -> tuple[Any, ...]:
    return ctx.mesh, ctx.axis, getattr(check, "seq_dim", None) if check is not None else None


def _seq_check(ctx: PlanContext, seq_dim: int, where: str) -> Any:
    """A check that a tensor's sequence dim exists and divides by the tp degree (its
    ``seq_dim`` attribute: what it checks, for a hook's key)."""
    def check(x: Any) -> None:
        if not isinstance(x, torch.Tensor):
            return
        if not -x.dim() <= seq_dim < x.dim():
            raise ValueError(
                f"{where}: sequence dim {seq_dim} does not exist on an activation of shape {tuple(x.shape)}"
            )
        n = x.shape[seq_dim]
        if n % ctx.degree:
            raise ValueError(
                f"{where}: sequence length {n} (dim {seq_dim} of shape {tuple(x.shape)}) does not divide "
                f"by the tensor-parallel degree {ctx.degree} (mesh axis {ctx.mesh.dim_names[ctx.axis]!r}); "
                "sequence parallelism needs equal pieces"
            )

    check.seq_dim = seq_dim  # type: ignore[attr-defined]
    return check


def _reduced_layout(layout: Layout, seq_dim: int | None) -> Layout:
    """Where a Partial output goes: ``layout``, or by default S(seq) under SP, else R."""
    if layout is not None:
        return layout
    return Shard(seq_dim) if seq_dim is not None else Replicate()


def _reduced_output(layout: Layout, ctx: PlanContext, where: str) -> tuple[Layout, Any]:
    """``_reduced_layout`` and the sequence check it needs (S(seq) by default under SP)."""
    if layout is None and ctx.seq_dim is not None:
        return Shard(ctx.seq_dim), _seq_check(ctx, ctx.seq_dim, where)
    return _reduced_layout(layout, ctx.seq_dim), None


class ColWiseParallel(_LinearLike, ParallelStyle):
    """Column parallel: ``nn.Linear`` weight ``Shard(0)`` (out-features) and bias ``Shard(0)``.

    A module storing its weight ``(in, out)`` (GPT-2's ``Conv1D``, detected; or any module with
    ``transposed=True``) gets weight ``Shard(1)`` — its out-features — and bias ``Shard(0)``.

    Input: made Replicate on the tp axis (an all-gather when it arrives sequence-sharded, a
    no-op when it is replicated). Output: sharded on its last dim; ``gather_output=True``
    all-gathers it to Replicate. On ``nn.Embedding`` the weight is ``Shard(1)`` (embedding dim)
    and the output is sharded on its last dim likewise. On an LM head, ``gather_output=False``
    gives class-sharded logits that ``F.cross_entropy`` consumes directly (loss parallel: each
    rank scores its class range; only ``[rows]``-sized all-reduces, the logits are never gathered).
    """

    module_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)

    def __init__(self, gather_output: bool = False, transposed: bool | None = None) -> None:
        if not isinstance(gather_output, bool):
            raise TypeError(f"ColWiseParallel: gather_output must be a bool, got {gather_output!r}")
        if transposed is not None and not isinstance(transposed, bool):
            raise TypeError(f"ColWiseParallel: transposed must be None or a bool, got {transposed!r}")
        self.gather_output = gather_output
        self.transposed = transposed

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        if _transposed(self, module):
            return {"weight": Shard(1), "bias": Shard(0)}
        return {"weight": Shard(0), "bias": Shard(0)}

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        return Replicate(), Replicate() if self.gather_output else None

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        self.shard_params(name, module, ctx)
        into, out = self.io_layouts(module, ctx.seq_dim)
        _input_hook(module, into, ctx, f"ColWiseParallel({name!r}) input")
        if out is not None:
            _output_hook(module, out, ctx, f"ColWiseParallel({name!r}) output")


class RowWiseParallel(_LinearLike, ParallelStyle):
    """Row parallel: ``nn.Linear`` weight ``Shard(1)`` (in-features), bias Replicate.

    A module storing its weight ``(in, out)`` (GPT-2's ``Conv1D``, detected; or any module with
    ``transposed=True``) gets weight ``Shard(0)`` — its in-features — and bias Replicate.

    Input: brought to ``Shard(-1)`` on the tp axis from whatever arrives. ``is_input_parallel``
    (Paddle's flag) only documents what is expected: ``True`` (the default), sharded by a
    preceding ``ColWiseParallel`` (nothing moves); ``False``, replicated (each rank slices its
    part locally, still no collective); anything else is resharded. The local matmuls
    give a Partial sum, reduced to ``output_layout``: by default ``Replicate()`` (one
    all-reduce), or ``Shard(seq_dim)`` (one reduce-scatter) when the plan has
    ``SequenceParallel`` styles; pass ``Partial()`` to leave it unreduced, or any layout.
    On ``nn.Embedding`` this is ``VocabParallelEmbedding``.
    """

    module_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)

    def __init__(self, is_input_parallel: bool = True, output_layout: Layout = None,
                 transposed: bool | None = None) -> None:
        if not isinstance(is_input_parallel, bool):
            raise TypeError(f"RowWiseParallel: is_input_parallel must be a bool, got {is_input_parallel!r}")
        if transposed is not None and not isinstance(transposed, bool):
            raise TypeError(f"RowWiseParallel: transposed must be None or a bool, got {transposed!r}")
        self.is_input_parallel = is_input_parallel
        self.output_layout = output_layout
        self.transposed = transposed

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        super().check(name, module, mesh, axis)
        check_layout(self.output_layout, mesh, f"{type(self).__name__}({name!r}).output_layout")
        if isinstance(module, nn.Embedding):
            _check_embedding(name, module, type(self).__name__)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        if _transposed(self, module):
            return {"weight": Shard(0), "bias": Replicate()}
        return {"weight": Shard(1), "bias": Replicate()}

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        out = _reduced_layout(self.output_layout, seq_dim)
        # token ids whole on tp for an embedding; a Linear's input split on its features
        return (Replicate() if isinstance(module, nn.Embedding) else Shard(-1)), (None if isinstance(out, Partial) else out)

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        where = f"{type(self).__name__}({name!r})"
        self.shard_params(name, module, ctx)
        _input_hook(module, self.io_layouts(module, ctx.seq_dim)[0], ctx, f"{where} input")
        layout, check = _reduced_output(self.output_layout, ctx, f"{where} output")
        if not isinstance(layout, Partial):
            _output_hook(module, layout, ctx, f"{where} output", check)


class VocabParallelEmbedding(RowWiseParallel):
    """Vocab parallel ``nn.Embedding``: weight ``Shard(0)`` (rows), masked lookup, Partial reduced.

    Token ids are made Replicate on the tp axis; each rank looks up the ids in its row range
    (zeros elsewhere), giving a Partial sum reduced to ``output_layout`` (as ``RowWiseParallel``:
    Replicate by default, ``Shard(seq_dim)`` — a reduce-scatter — under SequenceParallel).
    An uneven vocabulary is fine. ``max_norm`` and ``sparse`` embeddings are refused.
    """

    module_types: tuple[type[nn.Module], ...] = (nn.Embedding,)

    def __init__(self, output_layout: Layout = None) -> None:
        super().__init__(is_input_parallel=True, output_layout=output_layout, transposed=False)

    def __repr__(self) -> str:
        return f"VocabParallelEmbedding(output_layout={self.output_layout!r})"


def _check_embedding(name: str, module: nn.Embedding, style: str) -> None:
    if module.max_norm is not None:
        raise ValueError(f"{style} on {name!r}: max_norm={module.max_norm} renormalises rows in place; not supported")
    if module.sparse:
        raise ValueError(f"{style} on {name!r}: sparse=True gradients are not supported")


class SequenceParallel(ParallelStyle):
    """Megatron sequence parallel region: LayerNorm/RMSNorm/Dropout on sequence-sharded input.

    Besides the ``nn`` classes it accepts a model's own norm (``per_position``: a leaf module
    with only 1-d parameters, e.g. transformers' ``LlamaRMSNorm``).

    Parameters stay Replicate; the input is made ``Shard(seq_dim)`` on the tp axis (a local
    slice when it is replicated, a reduce-scatter when it is Partial) and so is the output.
    With ``ColWiseParallel`` after it (all-gather on entry) and ``RowWiseParallel`` before it
    (reduce-scatter on exit, chosen automatically when a plan has SequenceParallel styles),
    each transformer sub-block issues one all-gather and one reduce-scatter forward and the
    same backward, instead of two all-reduces. The sequence length must divide by the tp
    degree (``ValueError`` otherwise; see the module docstring).
    """

    module_types: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.Dropout)

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        if not isinstance(module, self.module_types) and per_position(module):
            return  # a model's own norm (transformers' LlamaRMSNorm, T5LayerNorm...)
        super().check(name, module, mesh, axis)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {"weight": Replicate(), "bias": Replicate()}

    def __init__(self, seq_dim: int = 1) -> None:
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise TypeError(f"SequenceParallel: seq_dim must be an int tensor dim, got {seq_dim!r}")
        self.seq_dim = seq_dim

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        return Shard(self.seq_dim), Shard(self.seq_dim)

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        where = f"SequenceParallel({name!r})"
        self.shard_params(name, module, ctx)
        _input_hook(module, Shard(self.seq_dim), ctx, f"{where} input", _seq_check(ctx, self.seq_dim, f"{where} input"))
        _output_hook(module, Shard(self.seq_dim), ctx, f"{where} output")


class PrepareLayerInput(ParallelStyle):
    """Declare/reshard a module's inputs: ``input_layouts[i]`` for positional input ``i``.

    Input ``i`` passed by keyword (the ``i``-th parameter of ``module.forward``, as transformers
    calls ``self_attn(hidden_states=h, ...)``) gets ``input_layouts[i]`` too; more layouts than
    the inputs given are ignored for the missing ones.

    Each layout is ``None`` (leave it), a placement for the tp axis, or a list of placements
    (one per mesh axis). Plain tensors are taken as the full value and laid out
    (``ap.shard_tensor``); DistTensors are resharded. ``kwarg_layouts`` does the same for
    keyword arguments. Applies to any module and combines with a parameter style.
    """

    shards_parameters = False

    def __init__(self, input_layouts: Sequence[Layout], kwarg_layouts: dict[str, Layout] | None = None) -> None:
        if not isinstance(input_layouts, (list, tuple)):
            raise TypeError(f"PrepareLayerInput: input_layouts must be a list (one layout per input), got {input_layouts!r}")
        self.input_layouts = list(input_layouts)
        self.kwarg_layouts = dict(kwarg_layouts or {})

    def _layouts(self, name: str, mesh: ProcessMesh) -> tuple[list[Layout], dict[str, Layout]]:
        where = f"PrepareLayerInput({name!r})"
        return ([check_layout(x, mesh, where) for x in self.input_layouts],
                {k: check_layout(v, mesh, where) for k, v in self.kwarg_layouts.items()})

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        self._layouts(name, mesh)

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        return (self.input_layouts[0] if self.input_layouts else None), None

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        where = f"PrepareLayerInput({name!r})"
        layouts, kw_layouts = self._layouts(name, ctx.mesh)

        names = positional_names(module)

        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            # input i passed by keyword (``self_attn(hidden_states=h)``) gets layouts[i] all the same
            by_name = {names[i]: lay for i, lay in enumerate(layouts) if i >= len(args) and i < len(names)}
            args = map_layouts(args, layouts[:len(args)], ctx.mesh, ctx.axis, where)
            kwargs = {k: to_layout(v, ctx.mesh, ctx.axis, kw_layouts.get(k, by_name.get(k)), where) for k, v in kwargs.items()}
            return args, kwargs

        key = ("inputs", tuple(map(layout_key, layouts)), tuple((k, layout_key(v)) for k, v in kw_layouts.items()),
               tuple(names), ctx.mesh, ctx.axis)
        module.register_forward_pre_hook(moves.style_hook(hook, key), with_kwargs=True)


def positional_names(module: nn.Module) -> list[str]:
    """The names of ``module.forward``'s parameters that may be passed by position, in order."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin forward: no names, positional layouts only
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


class PrepareLayerOutput(ParallelStyle):
    """Declare/reshard a module's outputs: ``output_layouts[i]`` for output ``i``.

    A module returning one tensor has one output. Layouts as in ``PrepareLayerInput``.
    """

    shards_parameters = False

    def __init__(self, output_layouts: Sequence[Layout]) -> None:
        if not isinstance(output_layouts, (list, tuple)):
            raise TypeError(f"PrepareLayerOutput: output_layouts must be a list (one layout per output), got {output_layouts!r}")
        self.output_layouts = list(output_layouts)

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        for x in self.output_layouts:
            check_layout(x, mesh, f"PrepareLayerOutput({name!r})")

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Layout, Layout]:
        return None, (self.output_layouts[0] if self.output_layouts else None)

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        where = f"PrepareLayerOutput({name!r})"
        layouts = [check_layout(x, ctx.mesh, where) for x in self.output_layouts]

        def hook(_: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if isinstance(out, tuple):
                return map_layouts(out, layouts, ctx.mesh, ctx.axis, where)
            return map_layouts((out,), layouts, ctx.mesh, ctx.axis, where)[0]

        module.register_forward_hook(moves.style_hook(hook, ("outputs", tuple(map(layout_key, layouts)), ctx.mesh, ctx.axis)))


__all__ = [
    "ColWiseParallel",
    "ParallelStyle",
    "PlanContext",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallel",
    "VocabParallelEmbedding",
]
