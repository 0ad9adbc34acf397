"""``shard_layer``: turn every parameter and buffer of a module into a DistTensor on a mesh.

Paddle's ``paddle.distributed.shard_layer`` contract: ``shard_fn(name, sublayer, mesh)`` runs
for every sublayer and may replace its parameters with ``ap.shard_tensor(...)``; whatever it
leaves as a plain tensor becomes Replicate on every mesh axis. Tied parameters (one Parameter
object reachable from several modules) stay tied: they are converted once and the same
DistTensor Parameter is put back everywhere.
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoparallel import compat, runtime
from autoparallel.api import shard_tensor
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Placement, Replicate
from autoparallel.regions import enable_local_regions, moves
from autoparallel.regions.moves import style_hook

ShardFn = Callable[[str, nn.Module, ProcessMesh], None]
InputFn = Callable[[Any, ProcessMesh], Any]
OutputFn = Callable[[Any, ProcessMesh], Any]


class ParamSharder:
    """Converts parameters/buffers to DistTensors once each, keeping tied parameters tied.

    ``converted`` maps ``id`` of an original (plain) tensor to its DistTensor replacement, so a
    tensor reached through several modules gets one replacement; asking for two different
    layouts of one tied tensor raises ``ValueError`` naming both.

    A parameter is converted **in place** (``swap_in``): the Parameter object the module held
    becomes the DistTensor Parameter, so an optimizer built before the layout (its
    ``param_groups``), a gradient-clipping list or any reference the user kept sees the
    DistTensor, not a plain tensor nothing trains any more. Buffers are replaced.
    """

    def __init__(self, mesh: ProcessMesh) -> None:
        self.mesh = mesh
        self.converted: dict[int, torch.Tensor] = {}
        self._originals: dict[int, torch.Tensor] = {}  # keep originals alive: ids stay unique
        self._where: dict[int, str] = {}
        self._stateful: set[int] | None = None  # ids of tensors some live optimizer holds state for

    def check_swappable(self, root: nn.Module) -> None:
        """Raise ``ValueError`` before anything is laid out if some plain parameter of ``root``
        cannot become its DistTensor in place (the same verdict on every rank: metadata only)."""
        if self._stateful is None and _outside_references(root) < 2:
            # a torch optimizer with state for a parameter references it twice (a param group's
            # list and its state's key): with at most one other reference, none has state for it
            self._stateful = set()
        for name, module in root.named_modules(remove_duplicate=False):
            for attr, t in compat.own_parameters(module).items():
                if t is not None and not isinstance(t, DistTensor):
                    self._check_swap(t, _qual(name, attr))

    def _check_swap(self, old: torch.Tensor, where: str) -> None:
        if self._stateful is None:
            self._stateful = _optimizer_state_ids()
        if id(old) in self._stateful:
            raise ValueError(
                f"{where}: an optimizer already holds state (e.g. Adam's moments) for this plain parameter; "
                "laying it out in place would leave that full-size state next to a sharded parameter. "
                "Lay the model out (ap.shard_layer / ap.parallelize) before the optimizer's first step, "
                "or build the optimizer afterwards"
            )
        if weakref.getweakrefs(old):
            raise ValueError(
                f"{where}: this parameter has weak references, so it cannot become its DistTensor in place "
                "(torch.utils.swap_tensors refuses); references built before the layout (an optimizer) "
                "would keep the plain tensor. Lay the model out before creating what holds them"
            )
        if old._use_count() > 2:  # type: ignore[attr-defined]  # torch's private refcount of the TensorImpl
            raise ValueError(
                f"{where}: something besides its Python object holds this parameter's tensor (a view of it, "
                "or the graph of a forward whose backward has not run), so it cannot become its DistTensor "
                "in place; lay the model out before that"
            )

    def swap_in(self, old: torch.Tensor, new: torch.Tensor, where: str) -> torch.Tensor:
        """``old`` (a plain Parameter) takes the contents of ``new`` (its DistTensor Parameter):
        the same object, now the DistTensor. Returns it."""
        if not isinstance(old, nn.Parameter) or isinstance(old, DistTensor) or old is new:
            return new
        self._check_swap(old, where)
        try:
            torch.utils.swap_tensors(old, new)
        except RuntimeError as e:  # the checks above should have said why; never a silent no-op
            raise ValueError(f"{where}: cannot make this parameter its DistTensor in place: {e}") from e
        return old

    def place(self, module: nn.Module, attr: str, placements: Sequence[Placement], where: str) -> None:
        """Set ``module.<attr>`` (a parameter or buffer) to its DistTensor in ``placements``."""
        t, is_param = compat.own_tensor(module, attr)
        if t is None:
            return
        placements = tuple(placements)
        new = self.converted.get(id(t))
        if new is None:
            if isinstance(t, DistTensor):
                if t.process_mesh != self.mesh or tuple(t.placements) != placements:
                    raise ValueError(
                        f"{where}: {attr} is already a DistTensor laid out as {list(t.placements)} on "
                        f"{t.process_mesh!r}; this style lays it out as {list(placements)} on {self.mesh!r}: "
                        "parallelize a module whose parameters are still plain tensors"
                    )
                new = t
            else:
                if is_param:
                    self._check_swap(t, where)  # before any collective: every rank raises alike
                new = shard_tensor(t, self.mesh, list(placements))
                if is_param:
                    if not isinstance(new, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    new = self.swap_in(t, new, where)
            self.record(t, new, where)
        if tuple(new.placements) != placements:  # type: ignore[attr-defined]
            raise ValueError(
                f"{where}: {attr} is tied to {self._where.get(id(t), '?')}, which lays it out as "
                f"{list(new.placements)}; it cannot also be {list(placements)}"  # type: ignore[attr-defined]
            )
        compat.put_tensor(module, attr, new)

    def record(self, old: torch.Tensor, new: torch.Tensor, where: str) -> None:
        self.converted[id(old)] = new
        self._originals[id(old)] = old
        self._where[id(old)] = where

    def replicate_rest(self, root: nn.Module) -> None:
        """Every parameter/buffer not converted yet becomes Replicate on every mesh axis."""
        for name, module in root.named_modules(remove_duplicate=False):
            for attr, t in [*compat.own_parameters(module).items(), *compat.own_buffers(module).items()]:
                if t is None:
                    continue
                done = self.converted.get(id(t))
                if done is not None:
                    compat.put_tensor(module, attr, done)
                elif isinstance(t, DistTensor):  # laid out by the caller (any mesh): keep it
                    self.record(t, t, _qual(name, attr))
                else:
                    self.place(module, attr, [Replicate()] * self.mesh.ndim, _qual(name, attr))


def _record_replacement(sharder: ParamSharder, module: nn.Module, attr: str, old: torch.Tensor, new: torch.Tensor, where: str) -> None:
    """Note that ``shard_fn`` replaced ``old`` by ``new``; a tied ``old`` replaced twice must agree.
    A plain Parameter replaced by a DistTensor Parameter takes it in place (``swap_in``)."""
    first = sharder.converted.get(id(old))
    if first is None:
        if isinstance(new, DistTensor) and isinstance(new, nn.Parameter):
            new = sharder.swap_in(old, new, where)
            compat.put_tensor(module, attr, new)
        sharder.record(old, new, where)
        return
    if _layout(first) != _layout(new):
        raise ValueError(
            f"shard_layer: {where} is tied to {sharder._where[id(old)]}, which shard_fn laid out as "
            f"{_layout(first)}; it cannot also be {_layout(new)}"
        )
    compat.put_tensor(module, attr, first)  # same layout: keep the tie (one Parameter)


def _ref_counts(objs: list[Any]) -> list[int]:
    """Python reference counts of ``objs``' items, each counted while ``objs`` and the call hold it."""
    return [sys.getrefcount(objs[i]) for i in range(len(objs))]


def _outside_references(root: nn.Module) -> int:
    """The most references some plain parameter of ``root`` has besides its modules' slots (an
    optimizer's ``param_groups`` and state, a list the user kept, ...). Below two proves that no
    torch optimizer holds state for any of them without walking the heap (``_optimizer_state_ids``
    reads every object of the process: ~0.3 s in a process with a few models' worth of objects).

    The baseline is measured, not assumed: an object held by one dict slot, counted the same way.
    A reference above it may be anything (the heap walk then decides); the count is never below it.
    """
    found = [t for module in root.modules() for t in compat.own_parameters(module).values()
             if t is not None and not isinstance(t, DistTensor)]  # one entry per slot
    slots: dict[int, int] = {}
    params: dict[int, torch.Tensor] = {}
    for i in range(len(found)):
        slots[id(found[i])] = slots.get(id(found[i]), 0) + 1
        params[id(found[i])] = found[i]
    del found
    probe: dict[str, Any] = {"slot": object()}
    base = _ref_counts([probe["slot"]])[0]  # one dict slot + the list + the call
    del probe
    ids = list(params)
    objs = [params.pop(i) for i in ids]
    return max((n - base - slots[i] + 1 for i, n in zip(ids, _ref_counts(objs))), default=0)


def _optimizer_state_ids() -> set[int]:
    """ids of the tensors some live ``torch.optim.Optimizer`` holds state for (one heap walk:
    an optimizer built before the layout is found from nothing but the parameter)."""
    kinds: set[type] = set()
    todo: list[type] = [torch.optim.Optimizer]
    while todo:
        k = todo.pop()
        if k not in kinds:
            kinds.add(k)
            todo += k.__subclasses__()
    return {id(p) for o in gc.get_objects() if type(o) in kinds for p, st in o.state.items() if st}


def _layout(t: torch.Tensor) -> str:
    if isinstance(t, DistTensor):
        return f"{list(t.placements)} on {t.process_mesh!r}"
    return "a plain tensor"


def _qual(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _check_callable(fn: Any, name: str) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"shard_layer: {name} must be callable or None, got {type(fn).__name__}")


def shard_layer(
    layer: nn.Module,
    mesh: ProcessMesh,
    shard_fn: ShardFn | None = None,
    input_fn: InputFn | None = None,
    output_fn: OutputFn | None = None,
) -> nn.Module:
    """Make ``layer``'s parameters and buffers DistTensors on ``mesh``, in place; return ``layer``.

    ``shard_fn(name, sublayer, mesh)`` is called for every sublayer (the root has name ``""``)
    and may replace its parameters with ``ap.shard_tensor(...)``; every parameter and buffer
    it leaves plain becomes Replicate on every mesh axis (parameters stay ``nn.Parameter``).
    ``input_fn(inputs, mesh)`` runs as a forward pre-hook on ``layer`` (``inputs`` is the tuple
    of positional arguments; a returned value replaces them) and ``output_fn(outputs, mesh)``
    as a forward hook (a returned value replaces the output). Submodules that compute without
    moving data run on local shards (``autoparallel.regions``).
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"shard_layer: layer must be an nn.Module, got {type(layer).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"shard_layer: mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    for fn, name in [(shard_fn, "shard_fn"), (input_fn, "input_fn"), (output_fn, "output_fn")]:
        _check_callable(fn, name)
    sharder = ParamSharder(mesh)
    sharder.check_swappable(layer)
    if shard_fn is not None:
        for name, sub in layer.named_modules():
            before = {a: t for a, t in [*compat.own_parameters(sub).items(), *compat.own_buffers(sub).items()]
                      if t is not None}
            shard_fn(name, sub, mesh)
            for a, old in before.items():
                new = compat.own_parameters(sub).get(a, compat.own_buffers(sub).get(a))
                if new is not None and new is not old:
                    _record_replacement(sharder, sub, a, old, new, _qual(name, a))
    sharder.replicate_rest(layer)
    install_io_hooks(layer, mesh, input_fn, output_fn)
    watch_batch_split(layer, mesh)
    enable_local_regions(layer)
    return layer


DP_AXIS = "dp"  # the mesh axis name that says "data parallel"


def watch_batch_split(layer: nn.Module, mesh: ProcessMesh) -> None:
    """Warn once (rank 0) when the first call of ``layer`` gets a batch that the data-parallel
    axis (``"dp"``, of more than one rank) does not split: every tensor argument is Replicate
    on it (or plain), so every rank would compute the whole batch — no data parallelism.
    Metadata only. A forward pre-hook that stays (a hook removed after the first call would make
    the second call differ from the first: a static capture's signature, a region's hooks); it
    reads nothing after its first call and changes nothing, as a style's hook (``moves.style_hook``)."""
    if DP_AXIS not in mesh.dim_names or mesh.get_dim_size(DP_AXIS) == 1:
        return
    first = [True]

    def first_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # (a run on whole tensors, ap.auto_parallel recording the step, is not the first batch)
        if first[0] and not isinstance(moves.current(), moves.Whole):
            first[0] = False
            _warn_unsplit(module, mesh, (*args, *kwargs.values()))

    layer.register_forward_pre_hook(style_hook(first_call, ("batch split warning", mesh)), with_kwargs=True)


def _warn_unsplit(module: nn.Module, mesh: ProcessMesh, values: tuple[Any, ...]) -> None:
    tensors = [t for t in values if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors or runtime.get_rank() != 0:
        return
    for t in tensors:
        if not isinstance(t, DistTensor):
            continue
        m = t.process_mesh
        if DP_AXIS not in m.dim_names or not isinstance(t.placements[m.axis_index(DP_AXIS)], Replicate):
            return  # split on the data-parallel axis (or laid out where it has none): nothing to say
    warnings.warn(
        f"{type(module).__name__}: its first batch is not split on the data-parallel mesh axis {DP_AXIS!r} "
        f"({mesh.get_dim_size(DP_AXIS)} ranks): every rank computes the whole batch (no data parallelism). "
        f"Split it with ap.shard_dataloader(loader, mesh, shard_dims={DP_AXIS!r}) or "
        f"ap.shard_tensor(batch, mesh, placements) with Shard(0) on {DP_AXIS!r}", stacklevel=3)


def install_io_hooks(layer: nn.Module, mesh: ProcessMesh, input_fn: InputFn | None, output_fn: OutputFn | None) -> None:
    """Register ``input_fn``/``output_fn`` as forward pre/post hooks of ``layer``."""
    if input_fn is not None:
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
            return input_fn(args, mesh)

        layer.register_forward_pre_hook(pre_hook)
    if output_fn is not None:
        def post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return output_fn(output, mesh)

        layer.register_forward_hook(post_hook)
