"""Open sizes: one captured program for every size of an input its guards admit.

A capture may leave some dims of its inputs open (``capture(..., open_dims=...)``): their fake
shards carry symbolic sizes, every DistTensor built on them a symbolic global shape, and every
branch the engine, the rules, the planner or a kernel takes on such a size is recorded as a
guard by the trace's shape environment (``compat.OpenSizeFakes``). The program then reads those
sizes from its inputs when it runs; ``OpenSizes`` says whether a call's inputs are ones it was
made for (each guard holds at their sizes) and turns the layouts and byte counts the capture
left symbolic into the call's numbers.

Which dims are open is decided from global metadata only (``open_dims``), the same on every
rank: a dim of a DistTensor argument that is split evenly over the mesh axes sharding it, with a
local size of at least 2 (torch fixes sizes 0 and 1), of a contiguous tensor. A dim split
unevenly has per-rank sizes: it stays the size it is, and is part of the signature.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import sympy
import torch

from autoparallel.engine import layout
from autoparallel.spec import DistSpec
from autoparallel.strides import contiguous_strides


def open_dims(a: Any) -> tuple[int, ...]:
    """The dims of argument leaf ``a`` a capture may leave open (see the module doc): none for a
    plain tensor, a value, a strided layout, a non-contiguous tensor or a rank outside the mesh."""
    if not layout.is_dist(a):
        return ()
    spec = layout.spec_of(a)
    if spec.symbolic or spec.has_strided:
        return ()
    if layout.stride_of(a) != contiguous_strides(spec.shape):
        return ()
    return spec_open_dims(spec, layout.local_of(a))


def spec_open_dims(spec: DistSpec, local: torch.Tensor) -> tuple[int, ...]:
    """``open_dims`` of a shard ``local`` of layout ``spec`` (also a program input made for one: a
    pipeline chunk's output gradient). A rank outside the mesh holds an empty 1-d shard: none."""
    if spec.has_strided or local.dim() != spec.ndim or not local.is_contiguous():
        return ()
    pieces = [spec.pieces(d) for d in range(spec.ndim)]
    return tuple(d for d, (n, k) in enumerate(zip(spec.shape, pieces)) if n % k == 0 and n // k >= 2 and local.shape[d] == n // k)


def masked(a: Any) -> Any:
    """Argument leaf ``a``'s part of a signature of open sizes: its layout with the open dims'
    sizes left out (None), its other metadata as ``static.signature`` keeps it."""
    dims = open_dims(a)
    spec = layout.spec_of(a)
    shape = tuple(None if d in dims else n for d, n in enumerate(spec.shape))
    return ("dist", spec.mesh, spec.placements, spec.shard_order, spec.dtype, shape)


def open_spec(spec: DistSpec, local: torch.Tensor, dims: tuple[int, ...]) -> tuple[DistSpec, tuple[int, ...]]:
    """The layout (and contiguous strides) of a DistTensor around the fake shard ``local`` whose
    ``dims`` are open: each such global size is the local one times the pieces of the dim."""
    shape = tuple(local.shape[d] * spec.pieces(d) if d in dims else n for d, n in enumerate(spec.shape))
    out = DistSpec(spec.mesh, spec.placements, shape, spec.dtype, spec.shard_order)
    return out, contiguous_strides(out.shape)


class OpenSizes:
    """Which program input dim each symbol of a capture is, and the guards the program holds
    under (sympy expressions over those symbols)."""

    def __init__(self, symbols: dict[Any, tuple[int, int]], fixed: dict[tuple[int, int], Any], guards: list[Any]) -> None:
        self.symbols = symbols
        self.fixed = fixed
        self.guards = guards
        self._check = _guard_function(guards, list(symbols))  # the guards as Python (None: by sympy)

    @staticmethod
    def of(symbols: Sequence[tuple[Any, ...]], dims: Sequence[tuple[int, ...]], fakes: Any) -> OpenSizes | None:
        """The open sizes of a capture (``symbols``: per input, each open dim's size as the fake
        was made; ``dims``: which dims those are; ``fakes``: the capture's ``compat.OpenSizeFakes``),
        or None where a guard speaks of a size that is no input's (the program then serves its own
        sizes only)."""
        found: dict[Any, tuple[int, int]] = {}
        fixed: dict[tuple[int, int], Any] = {}
        for i, (syms, ds) in enumerate(zip(symbols, dims)):
            for s, d in zip(syms, ds):
                if isinstance(s, sympy.Symbol) and s not in found:
                    found[s] = (i, d)
                else:  # fixed by torch when the fake was made, or a symbol met before (one tensor
                    fixed[(i, d)] = s  # passed twice): that size, or the first one's, there too
        guards = fakes.guards()
        if any(not g.free_symbols <= found.keys() for g in guards):
            return None
        return OpenSizes(found, fixed, [g for g in guards if g.free_symbols] + fakes.ranges(found))

    @staticmethod
    def hints(symbols: Sequence[tuple[Any, ...]], dims: Sequence[tuple[int, ...]],
              shapes: Sequence[tuple[int, ...]]) -> dict[Any, Any]:
        """The binding of the sizes the fakes were made at (``shapes``: the inputs')."""
        return {s: sympy.Integer(shapes[i][d]) for i, (syms, ds) in enumerate(zip(symbols, dims))
                for s, d in zip(syms, ds) if isinstance(s, sympy.Symbol)}

    def bind(self, shapes: Sequence[tuple[int, ...]]) -> dict[Any, Any] | None:
        """Each symbol's value for inputs of ``shapes`` (None: a guard fails there)."""
        if any(d >= len(shapes[i]) for i, d in (*self.symbols.values(), *self.fixed)):
            return None
        for (i, d), n in self.fixed.items():
            first = self.symbols.get(n)
            if shapes[i][d] != (shapes[first[0]][first[1]] if first is not None else int(n)):
                return None
        binding = {s: sympy.Integer(shapes[i][d]) for s, (i, d) in self.symbols.items()}
        if self._check is not None:
            try:
                return binding if self._check(*(shapes[i][d] for i, d in self.symbols.values())) else None
            except Exception:  # noqa: BLE001  (a guard its Python cannot evaluate: by sympy, from now on)
                self._check = None
        for g in self.guards:
            try:
                if not bool(g.xreplace(binding)):
                    return None
            except TypeError:  # (not decided by the sizes alone)
                return None
        return binding

    @staticmethod
    def value(x: Any, binding: dict[Any, Any]) -> Any:
        """``x`` (an int, a ``SymInt``, or a tuple, ``DistSpec`` or record holding them) at ``binding``."""
        if isinstance(x, torch.SymInt):
            return int(x.node.expr.xreplace(binding))
        if isinstance(x, tuple):
            return tuple(OpenSizes.value(v, binding) for v in x)
        if isinstance(x, DistSpec):
            return x.with_shape(OpenSizes.value(x.shape, binding)) if x.symbolic else x
        return x

    @staticmethod
    def record(r: Any, binding: dict[Any, Any]) -> Any:
        """A collective's record with its byte counts at ``binding``."""
        if isinstance(r.sent_bytes, torch.SymInt) or isinstance(r.recv_bytes, torch.SymInt):
            return replace(r, sent_bytes=OpenSizes.value(r.sent_bytes, binding), recv_bytes=OpenSizes.value(r.recv_bytes, binding))
        return r


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def bind_free_sizes(gm: torch.fx.GraphModule, symbols: Sequence[tuple[Any, ...]], dims: Sequence[tuple[int, ...]]) -> str:
    """Make every size argument of ``gm``'s nodes that the trace did not compute from its inputs
    (a local size the engine derived from a layout, outside the recording: a ``SymInt`` the
    program would print as a bare symbol) a node that computes it from the placeholders' sizes
    when the program runs. Returns why that cannot be done ('' when done): a size that depends
    on no input's open dim."""
    where: dict[Any, tuple[int, int]] = {}
    for i, (syms, ds) in enumerate(zip(symbols, dims)):
        for s, d in zip(syms, ds):
            if isinstance(s, sympy.Symbol):
                where.setdefault(s, (i, d))
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sizes: dict[Any, torch.fx.Node] = {}
    functions: dict[Any, Any] = {}
    missing: list[str] = []

    def size_of(sym: Any) -> torch.fx.Node:
        if sym not in sizes:
            i, d = where[sym]
            with graph.inserting_after(placeholders[-1]):
                sizes[sym] = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[i], d))
        return sizes[sym]

    def bound(a: Any, node: torch.fx.Node) -> Any:
        if not isinstance(a, _SYMBOLIC):
            return a
        expr = a.node.expr
        if not expr.free_symbols:
            return bool(expr) if isinstance(a, torch.SymBool) else float(expr) if isinstance(a, torch.SymFloat) else int(expr)
        free = sorted(expr.free_symbols, key=str)
        if any(s not in where for s in free):
            missing.append(str(expr))
            return a
        fn = functions.get(expr)
        if fn is None:
            fn = functions[expr] = _size_function(expr, free, len(functions))
        with graph.inserting_before(node):
            return graph.call_function(fn, tuple(size_of(s) for s in free))

    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method", "output"):
            node.args = torch.fx.node.map_aggregate(node.args, functools.partial(_bound_at, bound, node))  # type: ignore[assignment]
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, functools.partial(_bound_at, bound, node))  # type: ignore[assignment]
    if missing:
        return f"a size of the program ({missing[0]}) depends on no input's open size"
    graph.lint()
    gm.recompile()
    return ""


def _guard_function(guards: list[Any], symbols: list[Any]) -> Any:
    """The conjunction of ``guards`` as a Python function of ``symbols``' values (torch's sympy
    printer), or None where one cannot be printed."""
    from torch.utils._sympy.printers import PythonPrinter

    try:
        printer = PythonPrinter()
        body = " and ".join(f"({printer.doprint(g)})" for g in guards) or "True"
        scope: dict[str, Any] = {"math": math, "torch": torch}
        exec(f"def holds({', '.join(str(s) for s in symbols)}):\n    return bool({body})\n", scope)  # noqa: S102
        return scope["holds"]
    except Exception:  # noqa: BLE001  (a guard the printer does not write: evaluated by sympy)
        return None


def _bound_at(bound: Any, node: torch.fx.Node, a: Any) -> Any:
    return bound(a, node)


def _size_function(expr: Any, free: list[Any], k: int) -> Any:
    """A Python function of ``free``'s values computing ``expr`` (torch's sympy printer)."""
    from torch.utils._sympy.printers import PythonPrinter

    names = [str(s) for s in free]
    body = PythonPrinter().doprint(expr)
    scope: dict[str, Any] = {"math": math, "torch": torch}
    exec(f"def size_{k}({', '.join(names)}):\n    return {body}\n", scope)  # noqa: S102  (printed by sympy)
    fn = scope[f"size_{k}"]
    fn.__module__ = __name__
    return fn


class OpenPrograms:
    """The policy of open sizes, for any caller keeping captured programs by signature: per
    *family* (a signature with its open sizes left out), the programs captured with open sizes,
    and which families were captured at fixed sizes before.

    The first capture of a family is at fixed sizes; a second size is captured with them open
    (``second_size``), and that program serves every later size its guards admit (``serve``);
    a family whose open programs served no size but their own (guards that fix the sizes) goes
    back to fixed captures. A program is any object with ``sizes`` (its ``OpenSizes``), a
    ``served`` count and ``at(binding)``; at most ``limit`` families are kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[Any, list[Any]] = {}  # family -> its programs of open sizes (least recently made first)
        self.sized: set[Any] = set()          # families captured before

    def serve(self, family: Any, shapes: Sequence[tuple[int, ...]]) -> Any:
        """A kept program of ``family`` whose guards hold at the inputs' ``shapes``, made for them
        (``at``), or None."""
        for prog in self.open.get(family, ()):
            binding = prog.sizes.bind(shapes)
            if binding is not None:
                prog.served += 1
                return prog.at(binding)
        return None

    def second_size(self, family: Any) -> bool:
        """Whether a capture of ``family`` now should leave its sizes open (see the class doc);
        notes the family as captured."""
        if family in self.sized:
            kept = self.open.get(family)
            return not kept or any(p.served for p in kept)
        if len(self.sized) > 4 * self.limit:  # (signatures that keep changing otherwise)
            self.sized.clear()
        self.sized.add(family)
        return False

    def pinned(self, family: Any) -> Any:
        """A program of open sizes kept for ``family`` that served no size but its own (its guards
        fix the sizes), where every kept one is such; else None."""
        kept = self.open.get(family)
        return kept[-1] if kept and not any(p.served for p in kept) else None

    def keep(self, family: Any, prog: Any) -> None:
        """Keep ``prog`` (captured with open sizes) for ``family``'s later sizes."""
        kept = self.open.setdefault(family, [])
        kept.append(prog)
        del kept[:-self.limit]
        while len(self.open) > self.limit:
            del self.open[next(iter(self.open))]
