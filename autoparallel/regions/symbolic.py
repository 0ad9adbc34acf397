"""Symbolic certificates: a family's model vouched for by shape guards, not by a recorded run.
See ``autoparallel.regions.generic`` and docs/local_regions.md "New lengths".

A family's model (two proven lengths A and B) answers a new length C by running the module on
shards under a recorder that checks every aten call against the model — Python's dispatch mode
on every op, about twice a plain local forward. A *certificate* replaces that check by a
condition on C alone:

1. Once per model, the module's forward runs on **fake tensors** (``FakeTensorMode``, no data)
   whose varying input dims are affine functions ``a*u + b`` of one symbolic size ``u`` (the
   first input dim that differs between A and B; every other varying dim must be an integer
   affine function of it), recorded like a proof. Every branch Python or a kernel takes on a
   symbolic size becomes a **guard** (``u <= 300``, ``u != 64``); data-dependent code fails.
2. The run is the model's: the same skeleton (ops, argument structure, dtypes, non-integer
   values; no symbolic float or bool anywhere), and every integer an affine function of ``u``
   with integer coefficients that takes the model's values at A and B.
3. At a new length C whose argument sizes follow the model (``Model.admits_point``) and which
   the model does not refuse (``Model.refusal_at``: no crossing, integral lines, no 0/1), the
   guards hold at ``u_C`` and the inputs are contiguous as traced: then the module, run on
   shards with no mode, issues the model's aten calls with the model's integers at C, which is
   what the recorder would have checked. It runs plainly.

What a certificate cannot see is what a warm call at a proven length cannot see either — state
outside the signature (a global flag, Python randomness) — so it trusts no more than the
verdict cache already does. Built only from a run whose forward has no module hooks (a hook
would see fake tensors), with no other dispatch mode active; module attributes and RNG states
are restored after the fake run. A module that fails any of this keeps the recorded check.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sympy
import torch

from autoparallel.compat import modes_active, symbolic_tools
from autoparallel.regions.generic import Model, Record, Recorder

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class Certificate:
    """Guards on the local size ``u`` of input ``leaf``'s dim ``dim`` under which a local run
    is its family's model (see the module doc)."""

    __slots__ = ("leaf", "dim", "lower", "upper", "check", "text")

    def __init__(self, leaf: int, dim: int, lower: float, upper: float, check: Callable[[int], bool], text: str) -> None:
        self.leaf, self.dim = leaf, dim
        self.lower, self.upper = lower, upper
        self.check, self.text = check, text

    def holds(self, local_leaves: Sequence[Any]) -> bool:
        """Whether a call with these local arguments (tensors where the certified call had
        tensors) runs as the model says: contiguous inputs, ``u`` in range, every guard true."""
        for x in local_leaves:
            if isinstance(x, torch.Tensor) and not x.is_contiguous():
                return False
        u = local_leaves[self.leaf].shape[self.dim]
        return self.lower <= u <= self.upper and bool(self.check(u))


def certify(model: Model, local_leaves: Sequence[Any], sizes_a: Sequence[tuple[int, ...] | None],
            sizes_b: Sequence[tuple[int, ...] | None], leaf_grads: Sequence[bool],
            slots: Sequence[tuple[torch.Tensor, bool]], run: Callable[[list[Any], list[torch.Tensor]], Any],
            ) -> Certificate | str:
    """A certificate for ``model``, or why there is none.

    ``local_leaves``: the call's arguments as the local run gets them (shards; other values as
    they are); ``sizes_a``/``sizes_b``: each tensor argument's local sizes at the model's two
    lengths (None for other values); ``leaf_grads``/``slots``: whether each fake argument needs a
    gradient, and each parameter/buffer slot's local tensor and that flag; ``run(args, slots)``
    runs the module's forward with these (fake) tensors in place and restores it after."""
    tools = symbolic_tools()
    if tools is None:
        return "this torch has no symbolic shapes"
    if modes_active():
        return "another dispatch mode is active"
    where = _parameter(sizes_a, sizes_b)
    if isinstance(where, str):
        return where
    leaf, dim = where
    ua, ub = sizes_a[leaf][dim], sizes_b[leaf][dim]  # type: ignore[index]
    uc = local_leaves[leaf].shape[dim]
    lines: list[list[tuple[int, int] | int]] = []
    for x, a, b in zip(local_leaves, sizes_a, sizes_b):
        if a is None or b is None:
            lines.append([])
            continue
        if not isinstance(x, torch.Tensor) or not x.is_contiguous() or x.dim() != len(a):
            return "an input is not a contiguous tensor of the model's rank"
        per: list[tuple[int, int] | int] = []
        for n, xa, xb in zip(x.shape, a, b):
            if xa == xb:
                per.append(xa)
                if n != xa:
                    return "a fixed size differs"
                continue
            slope, rem = divmod(xb - xa, ub - ua)
            if rem or n != xa + slope * (uc - ua):
                return "a size is not an integer function of the first varying one"
            per.append((slope, xa - slope * ua))
        lines.append(per)

    env = tools.shape_env()
    u = env.create_symbol(uc, tools.source(), dynamic_dim=tools.dynamic)
    if not isinstance(u, sympy.Symbol):
        return f"the length {uc} was specialized"
    us = env.create_symintnode(u, hint=uc)
    mode = tools.fake_mode(env)
    rng = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]), mode:
            fakes: list[Any] = []
            for x, per, g in zip(local_leaves, lines, leaf_grads):
                if not per:
                    fakes.append(x)
                    continue
                shape = [s if isinstance(s, int) else s[0] * us + s[1] for s in per]
                fakes.append(torch.empty(shape, dtype=x.dtype, device=x.device).requires_grad_(g))
            memo: dict[int, torch.Tensor] = {}
            fake_slots = []
            for t, g in slots:
                f = memo.get(id(t))
                if f is None:
                    f = memo[id(t)] = mode.from_tensor(t.detach(), static_shapes=True).requires_grad_(g)
                fake_slots.append(f)
            recorder = _FakeRecorder(tools.metadata_ops)
            with recorder:
                run(fakes, fake_slots)
    except Exception as e:  # noqa: BLE001  (data-dependent code, an op fake tensors lack, ...)
        return f"its fake run failed ({type(e).__name__}: {str(e)[:80]})"
    finally:
        random.setstate(rng)
    return _conclude(model, recorder.record, env, u, tools, leaf, dim, (ua, ub, uc))


def _parameter(sizes_a: Sequence[tuple[int, ...] | None], sizes_b: Sequence[tuple[int, ...] | None]) -> tuple[int, int] | str:
    """(argument, dim) of the first local size that differs between the two lengths."""
    for k, (a, b) in enumerate(zip(sizes_a, sizes_b)):
        if a is not None and b is not None:
            for d, (xa, xb) in enumerate(zip(a, b)):
                if xa != xb:
                    return k, d
    return "no local size differs between the proven lengths"


def _conclude(model: Model, record: Record, env: Any, u: sympy.Symbol, tools: Any, leaf: int, dim: int,
              at: tuple[int, int, int]) -> Certificate | str:
    """The certificate from a fake run's ``record``: same skeleton as the model, integers on its
    lines, guards compiled (see the module doc)."""
    ua, ub, uc = at
    skeleton, ints = record.skeleton, record.ints
    if _has_symbolic(skeleton):
        return "a non-integer value depends on the length"
    if len(skeleton) != len(model.skeleton) or skeleton != model.skeleton:
        return "its fake run issues other aten calls"
    if len(ints) != len(model.ia):
        return "its fake run has other integers"
    slope = np.zeros(len(ints), dtype=np.int64)
    const = np.zeros(len(ints), dtype=np.int64)
    for k, x in enumerate(ints):
        if isinstance(x, int):
            const[k] = x
            continue
        expr = x.node.expr
        if expr.free_symbols - {u}:  # an unbacked size (``nonzero``, a mask's count)
            return f"a size depends on the data ({expr})"
        try:
            poly = sympy.Poly(expr, u)
        except (sympy.PolynomialError, sympy.GeneratorsNeeded):
            return f"a size is not affine in the length ({expr})"
        if poly.degree() > 1 or poly.free_symbols - {u} or not all(c.is_Integer for c in poly.all_coeffs()):
            return f"a size is not affine in the length ({expr})"
        slope[k], const[k] = int(poly.coeff_monomial(u)), int(poly.coeff_monomial(1))
    if not (np.array_equal(slope * ua + const, model.ia) and np.array_equal(slope * ub + const, model.ib)):
        return "its integers are not the model's lines"

    if u in env.replacements:
        return "the length was specialized"
    guards = [g.expr for g in env.guards]
    for asserts in env.deferred_runtime_asserts.values():
        guards += [a.expr for a in asserts]
    if any(g.free_symbols - {u} for g in guards):
        return "a guard involves another symbol"
    vr = env.var_to_range.get(u)
    lower = _bound(None if vr is None else vr.lower, 2)
    upper = _bound(None if vr is None else vr.upper, math.inf)
    name = str(u)
    printer = tools.printer()
    text = " and ".join(f"({printer.doprint(g)})" for g in guards) or "True"
    try:
        check = eval(f"lambda {name}: {text}", {"math": math, "max": max, "min": min, "__builtins__": {}})  # noqa: S307
        # the printed guards must say what sympy says (at the lengths known so far, and a few more)
        for v in {ua, ub, uc, lower, lower + 1, 2 * uc + 1, 1000}:
            want = all(bool(g.xreplace({u: sympy.Integer(v)})) for g in guards)
            if bool(check(v)) != want:
                return "its guards print differently"
    except Exception as e:  # noqa: BLE001  (a guard the printer cannot write)
        return f"its guards cannot be compiled ({type(e).__name__})"
    if not check(uc):
        return "its guards do not hold where it ran"
    return Certificate(leaf, dim, lower, upper, check, text)


def _bound(x: Any, default: float) -> float:
    """A value range's end as a number (``default`` where it is unbounded)."""
    if isinstance(x, sympy.Integer):
        return int(x)
    return default


class _FakeRecorder(Recorder):
    """The fake run's recorder: leaves out the calls only fake tensors make — metadata queries
    (``prim.device``) and full slices (``x[:, None, :]`` slices a symbolic dim whole, which
    indexing skips where the size is a number: the real run never dispatches them)."""

    def __init__(self, metadata_ops: frozenset[Any]) -> None:
        super().__init__()
        self.metadata_ops = metadata_ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self.metadata_ops and not _whole_slice(func, args, kwargs, out):
            self.record.add(func, args, kwargs, out)
        return out


def _whole_slice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether this is ``slice`` from 0 by 1 whose output has its input's sizes (read off the
    size expressions: comparing ``SymInt``s would add guards)."""
    if func is not _SLICE or kwargs or not isinstance(out, torch.Tensor):
        return False
    start = args[2] if len(args) > 2 else 0
    step = args[4] if len(args) > 4 else 1
    return ((start is None or (type(start) is int and start == 0)) and type(step) is int and step == 1
            and _exprs(out.shape) == _exprs(args[0].shape))


def _exprs(shape: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in shape)


_SLICE = torch.ops.aten.slice.Tensor


def _has_symbolic(x: Any) -> bool:
    if isinstance(x, _SYM_TYPES):
        return True
    if isinstance(x, (tuple, list)):
        return any(_has_symbolic(v) for v in x)
    return False


__all__ = ["Certificate", "certify"]
