"""The per-module wrapper of local regions: the signature of a call, and the call run as the
module's captured program (``regions.program``) or, refused, on DistTensors with the module's
children tried as regions. See ``autoparallel.regions``."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoparallel import compat
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.regions import moves, node, objects, program
from autoparallel.regions.state import TreeReader, autocast_state, flatten_call, ties
from autoparallel.regions.state import current as _current
from autoparallel.regions.state import slots as _slots
from autoparallel.regions.state import structure as _structure
from autoparallel.runtime import agree

_ATTR = "_ap_region"
_INHERITED = "_ap_refused"  # a refusal passed on to a module not wrapped yet (``_Region._pass_on``)
_MODE: list[str] = []  # "trace": a parent's capture runs this module as part of its program
_MISSING = object()
_SHARED_CLASSES = 256  # class keys kept per root (``_Region.class_key``)
# marks an object argument's part of a signature: (_OBJECT, its class, its entries'
# ``objects.signature``, None where a region cannot follow them)
_OBJECT = object()


def _enabled() -> bool:
    return os.environ.get("AUTOPARALLEL_LOCAL_REGIONS", "1") not in ("0", "false", "off")


# ---- public API ----------------------------------------------------------------------------
def enable_local_regions(module: nn.Module) -> nn.Module:
    """Let ``module`` (and, where it is refused, its submodules) run as captured programs on
    local shards; in place."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"enable_local_regions: expected an nn.Module, got {type(module).__name__}")
    if _enabled():
        _install(module)
    return module


def disable_local_regions(module: nn.Module) -> nn.Module:
    """Remove the wrappers from ``module`` and every submodule; in place."""
    for m in module.modules():
        region = m.__dict__.pop(_ATTR, None)
        if region is not None:
            m.__dict__.pop("forward", None)
            if region.own_forward is not _MISSING:  # an instance forward set before ours
                m.__dict__["forward"] = region.own_forward
    return module


def local_regions_report(module: nn.Module) -> dict[str, list[str]]:
    """Per wrapped submodule name: one line per signature seen — ``local`` (captured by its
    first call), ``local (open sizes)`` (run by a program captured with its sizes open, at other
    sizes) or ``refused: why`` (run on DistTensors)."""
    out: dict[str, list[str]] = {}
    for name, m in module.named_modules():
        region = m.__dict__.get(_ATTR)
        if region is not None:
            out[name or "<root>"] = list(region.verdicts.values())
    return out


# ---- installing ------------------------------------------------------------------------------
def _install(module: nn.Module, shared: dict[Any, program.Calls] | None = None) -> None:
    """Wrap ``module`` (or, a container, its children); ``shared``: the captured calls of the
    modules installed from one root, by class (``_Region.class_key``)."""
    shared = {} if shared is None else shared
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers are never called
        for child in module.children():
            _install(child, shared)
        return
    if _ATTR in module.__dict__ or not _has_dist_state(module):
        return
    region = _Region(module, shared)
    module.__dict__[_ATTR] = region
    module.__dict__["forward"] = _Forward(region)


def _has_dist_state(module: nn.Module) -> bool:
    return any(isinstance(t, DistTensor) for t in [*module.parameters(), *module.buffers()])


class _Forward:
    """A wrapped module's ``forward``: calls its region, and shows the module's own signature
    (``inspect.signature(model.forward)``: transformers' ``generate`` and ``Trainer`` decide from it
    which inputs to build and pass, e.g. position ids from a padding mask). An object, not a
    closure: ``copy.deepcopy`` of the module gives the copy its own."""

    def __init__(self, region: _Region) -> None:
        self.region = region
        self.__signature__: inspect.Signature | None = None
        try:
            self.__signature__ = inspect.signature(region.forward)
        except (TypeError, ValueError):  # (a forward without one: a builtin)
            pass
        self.__doc__ = getattr(region.forward, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.region.call(args, kwargs)


# ---- the per-module wrapper --------------------------------------------------------------------
class _Region:
    """The wrapper state of one module: its original forward, slots, captured calls and the
    report's line per signature."""

    def __init__(self, module: nn.Module, shared: dict[Any, program.Calls] | None = None) -> None:
        self.module = module
        self.shared: dict[Any, program.Calls] = {} if shared is None else shared
        self.forward: Callable[..., Any] = module.forward
        self.own_forward = module.__dict__.get("forward", _MISSING)
        self.modules = list(module.modules())
        self.shape = _structure(self.modules)
        self.slots = _slots(module)
        self._read_tree()
        self.verdicts: dict[Any, str] = {}  # per signature, the report's line (least recently met first)
        self.children_done = False
        self.calls = program.Calls()
        # a refusal a parent's capture met inside this module, for its next call (the plain run of
        # that parent's call: ``_pass_on``), and the submodules the last capture's error left
        self.inherited: str = module.__dict__.pop(_INHERITED, "")
        self.escaped: list[nn.Module] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _Region:
        """A copied module's wrapper (``copy.deepcopy(model)``: an EMA or reference copy) starts
        with no programs: they are caches, and name the original's objects."""
        new = _Region.__new__(_Region)
        memo[id(self)] = new
        fresh = {"verdicts": {}, "calls": program.Calls(), "shared": {}, "inherited": "", "escaped": []}
        for k, v in self.__dict__.items():
            if k not in ("reader", "slot_names"):
                new.__dict__[k] = fresh[k] if k in fresh else copy.deepcopy(v, memo)
        new._read_tree()
        return new

    def _read_tree(self) -> None:
        """What a call reads of the tree as it is now (after a change of its structure: anew)."""
        self.reader = TreeReader(self.modules)
        self.slot_names = _slot_names(self.modules, self.slots)

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _MODE:  # inside a parent's capture: the plain module, part of the parent's program
            return self.forward(*args, **kwargs)
        ran = self._call(args, kwargs)
        return self._plain(args, kwargs) if ran is None else ran[0]

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any] | None:
        """``(output,)`` of a call run as a captured program; None: take the DistTensor path."""
        leaves, tree = flatten_call(args, kwargs)
        if _structure(self.modules) != self.shape:  # a submodule, parameter or buffer was added or removed
            self.modules = list(self.module.modules())
            self.shape, self.slots = _structure(self.modules), _slots(self.module)
            self._read_tree()
            self.verdicts.clear()
            self.calls = program.Calls()
        tensors = [_current(m, a) for m, a in self.slots]
        _agree_plain(self.module, leaves, tensors)
        values, attrs = self.reader.read()
        key, held = self._key(leaves, tree, tensors, values)
        if key is None or compat.foreign_dispatch_modes():  # (a trace of the caller's: make_fx, a static capture)
            return None
        shape = self.class_key(attrs)
        calls = self.calls if shape is None else self.shared.get(shape)
        if calls is None:
            calls = self.calls
            if len(self.shared) < _SHARED_CLASSES:  # (held objects that change every call: not a key each)
                self.shared[shape] = calls
        inherited, self.inherited = self.inherited, ""
        self.escaped = []
        try:
            progs, how = calls.find(key, leaves, tree, tensors, self.module, self._inside, held,
                                    (key[:4] + key[5:], values), inherited)
        except TypeError:  # an unhashable non-tensor argument: no signature
            return None
        if isinstance(progs, str) and how == "captured":
            self._pass_on(progs)
        if key not in self.verdicts:
            if len(self.verdicts) >= program.MAX_SIGNATURES:
                del self.verdicts[next(iter(self.verdicts))]
            self.verdicts[key] = (f"refused: {progs}" if isinstance(progs, str) else
                                  "local (open sizes)" if how == "open" else "local")
        if isinstance(progs, str):
            return None
        again = node.Again(self._inside, tree, self._state_now, self.modules)
        return (node.run_call(progs, tensors, leaves, self.module, again),)

    def _state_now(self) -> list[torch.Tensor]:
        return [_current(m, a) for m, a in self.slots]

    def class_key(self, attrs: tuple[Any, ...] | None = None) -> Any:
        """What makes two modules' calls of one signature the same program: the classes and
        structure of the module tree, and every attribute that is not a plain value (kept in the
        signature), a tensor slot (or what shadows one) or a submodule, by content
        (``attributes.describe``: two equal configs, or one shared, are the same).
        A submodule's forward hooks are part of it by their style keys (``moves.style_key``: two
        column-parallel Linears on one mesh axis move alike), quiet ones left out. None where
        calls are not shared: an instance ``forward`` of its own, or a submodule's forward hook
        that is neither quiet nor a style's with a key (a closure may know its module). ``attrs``:
        what ``self.reader`` read of those attributes for this call (read now where not given)."""
        if self.own_forward is not _MISSING:
            return None
        if attrs is None:
            attrs = self.reader.read()[1]
        parts = []
        for m, held in zip(self.modules, attrs):
            hooks: list[Any] = []
            for h in compat.forward_hook_fns(m) if m is not self.module else ():
                if compat.quiet_hook(h, m):
                    continue
                key = moves.style_key(h)
                if key is None:
                    return None
                hooks.append(key)
            parts.append((type(m), held, tuple(hooks)))
        return tuple(parts), self.slot_names

    def _inside(self, *args: Any, **kwargs: Any) -> Any:
        """The forward as a capture runs it: its submodules' regions plain. Where the trace fails
        inside submodules' calls (an op with a data-dependent output shape), ``escaped`` lists
        those submodules, outermost first: captured on their own, they would fail alike."""
        self.escaped = []
        try:
            with _mode("trace"):  # (its submodules' regions: plain)
                return self.forward(*args, **kwargs)
        except BaseException as e:
            inside = {id(m) for m in self.modules[1:]}
            self.escaped = [m for m in compat.called_modules(e.__traceback__) if id(m) in inside]
            raise

    def _pass_on(self, refusal: str) -> None:
        """Give the refusal of a call whose trace failed inside submodules' calls to those
        submodules, for their next call: this call's plain run, which calls them as the trace did
        (their own captures would fail alike). Refusing is the safe way to be wrong: a module
        refused runs on DistTensors, its children tried as regions."""
        for m in self.escaped:
            region = m.__dict__.get(_ATTR)
            if region is not None:
                region.inherited = refusal
            elif _has_dist_state(m):  # (wrapped by its parent's plain run: ``_Region`` takes it)
                m.__dict__[_INHERITED] = refusal
        self.escaped = []

    def _plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The usual DistTensor path; submodules get their own chance to be regions."""
        if not self.children_done:
            self.children_done = True
            for child in self.module.children():
                _install(child, self.shared)
        return self.forward(*args, **kwargs)

    def _key(self, leaves: list[Any], tree: Any, tensors: list[torch.Tensor],
             values: tuple[Any, ...]) -> tuple[Any, dict[Any, Any] | None]:
        """(the signature, or None when this call cannot be a region (no DistTensor at all); the
        entries of its object arguments, as ``objects.entries`` walks them, where it has some).
        ``values``: what the modules' forwards may read by name (plain values, held objects'
        descriptions, class values), as ``self.reader`` read them for this call (a config's
        value changed: a new signature)."""
        parts: list[Any] = []
        held: dict[Any, Any] | None = None
        spec_of, stride_of = layout.spec_of, layout.stride_of  # bound once: every call of the module asks
        for i, x in enumerate(leaves):
            if isinstance(x, DistTensor):
                parts.append((spec_of(x), stride_of(x), x.requires_grad))
            elif isinstance(x, torch.Tensor):
                parts.append(("plain", tuple(x.shape), x.dtype, x.requires_grad))
            elif objects.is_object(x):  # keyed by its class and entries: its identity would make
                # every call a new signature (None: entries a region cannot follow)
                sig, found = objects.walked(x, i)
                parts.append((_OBJECT, type(x), sig))
                if sig is not None and found is not None:
                    held = found if held is None else {**held, **found}
            else:
                parts.append(("value", x))
        with compat.attribute_access():
            slot_parts = tuple(
                (spec_of(t), t.requires_grad) if isinstance(t, DistTensor) else ("plain", tuple(t.shape), t.requires_grad)
                for t in tensors
            )
        if not any(isinstance(x, DistTensor) for x in leaves) and not any(isinstance(t, DistTensor) for t in tensors):
            return None, None
        return (tree, tuple(parts), slot_parts, ties(tensors), values, torch.is_grad_enabled(), autocast_state()), held


def _slot_names(modules: list[nn.Module], slots: list[tuple[nn.Module, str]]) -> tuple[tuple[int, str], ...]:
    """The tensor slots by (module's place in the tree, attribute): the order of a program's inputs."""
    place = {id(m): k for k, m in enumerate(modules)}
    return tuple((place[id(m)], a) for m, a in slots)


def _agree_plain(module: nn.Module, leaves: list[Any], tensors: list[torch.Tensor]) -> None:
    """The plain tensor arguments of a call that holds DistTensors are Replicate (the same value
    on every rank), whichever path the call takes: checked as an op checks them
    (``agree.check_plain``), since a captured program issues no op that would."""
    plain = [x for x in leaves if type(x) is torch.Tensor and x.dim() != 0]
    if not plain:
        return
    dist = next((t for t in (*leaves, *tensors) if isinstance(t, DistTensor)), None)
    if dist is not None:
        agree.check_plain(f"a plain argument of {type(module).__name__}", layout.spec_of(dist).mesh, plain)


class _mode:
    """Push ``name`` on the region mode stack for the duration of a ``with`` block."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _MODE.append(self.name)

    def __exit__(self, *exc: object) -> None:
        _MODE.pop()
