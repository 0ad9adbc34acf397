"""Shape-generic region verdicts: a module proven local at two sequence lengths runs locally at
a third without proving it again. See ``autoparallel.regions`` and docs/local_regions.md.

A *family* is every signature of a module that differs only in the sizes (and strides) of its
tensor arguments. Its members' proofs (trace + replay) record the aten calls of the local run;
here each record is split into a **skeleton** (ops, argument structure, dtypes, every
non-integer value) and the **integers** (every size of every tensor, every integer argument).

Two proofs A and B of a family, at parameter values ``t_A != t_B`` (``t``: the first argument
size that differs between them), make the family *ready* when their skeletons are equal and
every integer of the records and of the arguments is an affine function of ``t`` through the
two points. A call at a new ``t_C`` then runs on local shards at once, recorded; it is taken
when:

* the arguments' sizes are the affine functions at ``t_C`` (one length varies, as in A and B);
* the run's skeleton is A's, op for op (checked before each op runs: a differing op, or any
  in-place op, stops the run before it executes, so a refused run has written nothing);
* every integer of the run is its affine function at ``t_C``;
* nothing a rule reads changes with ``t``: in every op, two sizes (tensor dims, ``SymInt``
  arguments; not dim indices) are equal exactly when their lines are (``t_C`` is no crossing:
  no coincidence such as ``t == 64`` making a view's dims group differently), and 0 and 1
  (empty dims, broadcasting) appear exactly where they did in A and B.

In an as-is strategy the only split dims are the sharded ones, split evenly by construction,
so what decided A and B — which dims are sharded, which sizes are equal, which are 1 — decides
C the same way. Everything read is metadata that every rank shares (regions need even shards),
so every rank takes the same path; uneven shards are never answered. A length the model alone
refuses (a crossing, a line not integral there or meeting 0/1: ``Model.refusal_at``) is proven
at once; a run refused by what it recorded costs one local forward first. Either way the new
signature then gets the full proof. A family whose two latest
proofs were refused for one reason predicts that refusal (``Family.refusal``).

A *certificate* (``regions.symbolic``: the shape guards of one run on fake tensors, built at a
model's first new length) may stand in for the recorder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from autoparallel.compat import TorchDispatchMode
from autoparallel.engine import layout
from autoparallel.engine.dtensor import DistTensor
from autoparallel.strides import nesting


class Stop(BaseException):
    """Raised inside a recorded run to stop it before an op that breaks the family's skeleton
    (a ``BaseException``: a module's own ``except Exception`` does not swallow it)."""


# ---- records -------------------------------------------------------------------------------------
_SYMINT = torch.SymInt


def _split(x: Any, ints: list[Any]) -> Any:
    """``x`` with every integer replaced by a marker (appended to ``ints``); tensors by rank and
    dtype (their sizes appended). A ``SymInt`` (a fake run over symbolic sizes,
    ``regions.symbolic``) is an integer too."""
    t = type(x)
    if t is int or t is _SYMINT:
        ints.append(x)
        return ()
    if t is tuple or t is list:
        return t is tuple, tuple([_split(v, ints) for v in x])
    if isinstance(x, torch.Tensor):
        ints.extend(x.shape)
        return x.dtype, x.dim()
    if t is dict:
        return "dict", tuple([(k, _split(v, ints)) for k, v in x.items()])
    return x


# ``alias`` is the tensor itself (same sizes, strides, storage), and whether one is issued is
# up to the caller's path through torch: indexing ``mask[:, :, :, :n]`` with ``n`` its whole
# length aliases the mask on real sizes but issues nothing on symbolic ones (where ``n`` is the
# mask's own size). Records leave it out.
_ALIAS = torch.ops.aten.alias.default


class Record:
    """A local run's aten calls as a skeleton (one entry per op) and its integers; ``bounds[k]``:
    where op k's integers end."""

    def __init__(self) -> None:
        self.skeleton: list[Any] = []
        self.ints: list[Any] = []       # ints; ``SymInt``s in a symbolic run
        self.bounds: list[int] = []
        self.mutates = False            # an op wrote a tensor the run did not make
        self.made = Made()

    def add(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is _ALIAS:
            return  # (see ``_ALIAS``)
        ints = self.ints
        self.skeleton.append((func, _split(args, ints), _split(kwargs, ints) if kwargs else None, _split(out, ints)))
        self.bounds.append(len(ints))
        self.mutates = self.mutates or self.made.writes_outside(func, args, kwargs)
        self.made.add(out)


class Made:
    """The storages of the tensors a run's aten calls made. An in-place op writing only those
    (a mask built by ``zeros_like`` and ``masked_fill_``, as SDPA converts a boolean mask)
    writes nothing the run did not make: running it again, or stopping it midway, changes
    nothing outside it."""

    def __init__(self) -> None:
        self.storages: set[int] = set()

    def add(self, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = _storage_of(t)
                if key:
                    self.storages.add(key)

    def writes_outside(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``func`` (about to run, or just run in place) writes a tensor the run did not make."""
        if not mutable(func):
            return False
        written = layout.written_args(func, args, kwargs)
        return not written or any(not isinstance(w, torch.Tensor) or _storage_of(w) not in self.storages
                                  for w in written)


def _storage_of(t: torch.Tensor) -> int:
    """A plain tensor's storage address (0 where it has none: an empty or meta tensor; or for a
    subclass, as the fake tensors of a symbolic run, whose sizes a test would guard on)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return 0
    if t.is_meta or not t.numel():
        return 0
    return int(t.untyped_storage().data_ptr())


_MUTABLE: dict[Any, bool] = {}


def mutable(func: Any) -> bool:
    """Whether the aten op writes one of its arguments (its schema says so)."""
    m = _MUTABLE.get(func)
    if m is None:
        schema = getattr(func, "_schema", None)
        m = _MUTABLE[func] = bool(schema is not None and schema.is_mutable)
    return m


def sized_flags(skeleton: Sequence[Any]) -> list[bool]:
    """Per integer of a record with this skeleton: is it a size (a tensor's, or a ``SymInt``
    argument's such as a view's) rather than an index or a flag (``transpose``'s dims)?
    Only sizes are compared with each other: a rule reads no equality between a dim index and
    a size."""
    flags: list[bool] = []
    for func, args, kwargs, out in skeleton:
        schema = getattr(func, "_schema", None)
        kinds = {a.name: "SymInt" in str(a.type) for a in schema.arguments} if schema is not None else {}
        order = list(kinds.values())
        for i, a in enumerate(args[1]):
            _flags(a, order[i] if i < len(order) else False, flags)
        if kwargs is not None:
            for k, a in kwargs[1]:
                _flags(a, kinds.get(k, False), flags)
        _flags(out, True, flags)
    return flags


def _flags(skel: Any, size: bool, flags: list[bool]) -> None:
    """Walk ``skel`` in ``_split``'s order: an int marker takes ``size``, a tensor its dims."""
    if skel == ():
        flags.append(size)
    elif type(skel) is tuple and len(skel) == 2 and isinstance(skel[0], torch.dtype):
        flags.extend([True] * skel[1])
    elif type(skel) is tuple and len(skel) == 2 and type(skel[0]) is bool:
        for v in skel[1]:
            _flags(v, size, flags)


class Recorder(TorchDispatchMode):
    """Records a local run into a ``Record``; with ``expect`` (a family's skeleton), stops the
    run (``Stop``) before an op that is not the expected one, an in-place op writing a tensor
    the run did not make (``Made``), or a DistTensor."""

    _ap_own_observer = True  # (``compat.OWN_OBSERVER``)

    def __init__(self, expect: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.record = Record()
        self.expect = expect

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        expect = self.expect
        if func is _ALIAS:
            return func(*args, **kwargs)  # (not recorded: ``_ALIAS``)
        if expect is not None:
            k = len(self.record.skeleton)
            if (k >= len(expect) or expect[k][0] is not func or self.record.made.writes_outside(func, args, kwargs)
                    or any(issubclass(t, DistTensor) for t in types)):
                raise Stop(f"aten call {k} ({func}) is not the proven one")
        out = func(*args, **kwargs)
        self.record.add(func, args, kwargs, out)
        return out


# ---- families -------------------------------------------------------------------------------------
def point_of(leaves: Sequence[Any]) -> tuple[int, ...]:
    """The sizes and strides of a call's tensor arguments, in order (the family's coordinates):
    a dense argument's strides as its layout (``_layout_coords``), any other's as they are."""
    out: list[int] = []
    for x in leaves:
        if isinstance(x, DistTensor):  # (its own ``shape``/``stride()`` go through ``__torch_function__``)
            shape, stride = layout.spec_of(x).shape, layout.stride_of(x)
        elif isinstance(x, torch.Tensor):
            shape, stride = tuple(x.shape), tuple(x.stride())
        else:
            continue
        out.extend(shape)
        out.extend(_layout_coords(shape, stride))
    return tuple(out)


def _layout_coords(shape: Sequence[int], stride: Sequence[int]) -> Sequence[int]:
    """A tensor argument's strides as family coordinates. A dense tensor (its elements packed,
    dims nested in some order: what a kernel, a copy or a factory makes) is given by that
    nesting, as negative numbers (``-1 - depth`` per dim, outermost first), the same at every
    length: a contiguous ``(B, 1, T, T)`` mask's ``T * T`` strides are no line in ``T``, its
    nesting is a constant. Any other tensor (expanded, sliced, overlapping, empty) keeps its
    strides, which must then follow the model's lines (``Model.admits_point``)."""
    order = nesting(stride)
    expected = 1
    for d in reversed(order):
        if shape[d] == 0 or (shape[d] != 1 and stride[d] != expected):
            return stride
        expected *= shape[d]
    depth = [0] * len(shape)
    for k, d in enumerate(order):
        depth[d] = -1 - k
    return depth


def sizes_at(leaves: Sequence[Any], point: Sequence[int]) -> list[tuple[int, ...] | None]:
    """Per argument, its sizes at a family member's ``point`` (``point_of`` of arguments of the
    same ranks); None for other values."""
    out: list[tuple[int, ...] | None] = []
    at = 0
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            out.append(None)
            continue
        n = x.dim()
        out.append(tuple(int(v) for v in point[at:at + n]))
        at += 2 * n  # its sizes, then its strides
    return out


@dataclass
class Proof:
    """A proven signature of a family: where (``point``), what its local run did (None: it was
    refused, or may not generalise), its verdict."""

    point: tuple[int, ...]
    record: Record | None
    verdict: Any          # checks._Verdict


class Model:
    """The affine model of two proofs A, B: every integer as a line through ``(t_A, x_A)`` and
    ``(t_B, x_B)``, and what a rule could read off them (which are 0 or 1, which are equal)."""

    def __init__(self, a: Proof, b: Proof) -> None:
        assert a.record is not None and b.record is not None
        self.a, self.b = a, b
        self.ra, self.rb = a.record, b.record
        self.skeleton = b.record.skeleton
        self.pa = np.asarray(a.point, dtype=np.int64)
        self.pb = np.asarray(b.point, dtype=np.int64)
        self.ia = np.asarray(a.record.ints, dtype=np.int64)
        self.ib = np.asarray(b.record.ints, dtype=np.int64)
        self.p0 = self.ta = self.tb = 0
        self.small = self.ia
        self.crossings: set[int] = set()
        self.certificate: Any = None      # ``regions.symbolic``: None not tried yet, else one or why not
        # what ``refusal_at`` and ``admits_point`` read, precomputed by ``build`` (O(1) per length):
        self.step = 1                     # t - t_A must be a multiple of it for every line to be integral
        self.lowest, self.highest = -math.inf, math.inf  # where every varying line stays >= 2
        self.point_lines: tuple[tuple[int, int], ...] = ()  # per coordinate: (value at A, B - A)

    def build(self) -> str | None:
        """Why A and B make no model (None: they do)."""
        ra, rb, pa, pb = self.ra, self.rb, self.pa, self.pb
        if ra.skeleton != rb.skeleton or self.ia.shape != self.ib.shape:
            return "the two proven lengths ran different aten calls"
        if pa.shape != pb.shape:
            return "the arguments differ in rank"
        if np.any(((pa < 0) | (pb < 0)) & (pa != pb)):
            return "an argument is laid out differently at the proven lengths"  # (``_layout_coords``)
        varying = np.flatnonzero(pa != pb)
        if not len(varying):
            return "no argument size differs"
        self.p0 = int(varying[0])
        self.ta, self.tb = int(pa[self.p0]), int(pb[self.p0])
        small = np.minimum(self.ia, 2)
        if not np.array_equal(small, np.minimum(self.ib, 2)):
            return "a size is 0 or 1 at one proven length only"
        self.small = small
        # per op, its integers' distinct functions (lines); where two of them cross, a call at
        # that length would see two sizes equal that are not equal in general
        self.crossings = set()
        sized = sized_flags(rb.skeleton)
        if len(sized) != len(self.ia):
            return "the record's integers do not match its skeleton"
        start = 0
        for end in rb.bounds:
            lines = {(int(x), int(y)) for x, y, f in zip(self.ia[start:end], self.ib[start:end], sized[start:end]) if f}
            start = end
            if len({x for x, _ in lines}) < len(lines) or len({y for _, y in lines}) < len(lines):
                return "sizes coincide at a proven length"
            self.crossings.update(_crossings(sorted(lines), self.ta, self.tb))
        self._bounds()
        self.point_lines = tuple(zip(pa.tolist(), (pb - pa).tolist()))
        return None

    def _bounds(self) -> None:
        """``step``, ``lowest`` and ``highest``: the lengths at which every line is an integer,
        and between which none meets 0 or 1 (lines 0 or 1 at both proven lengths are constant)."""
        den = self.tb - self.ta
        d = self.ib - self.ia
        g = int(np.gcd.reduce(np.abs(d))) if len(d) else 0
        self.step = abs(den) // math.gcd(abs(den), g)
        lowest, highest = -math.inf, math.inf
        for ia, di in zip(self.ia[d != 0].tolist(), d[d != 0].tolist()):
            # ia + di * s / den >= 2, s = t - t_A: a bound on s by the sign of the slope
            q_num, q_den = (2 - ia) * den, di
            if (di > 0) == (den > 0):
                lowest = max(lowest, self.ta - ((-q_num) // q_den))   # s >= ceil(q)
            else:
                highest = min(highest, self.ta + q_num // q_den)      # s <= floor(q)
        self.lowest, self.highest = lowest, highest

    def admits_point(self, point: tuple[int, ...]) -> int | None:
        """``t`` of a call at ``point`` when its argument sizes follow the model, else None."""
        lines = self.point_lines
        if len(point) != len(lines):
            return None
        tc = point[self.p0]
        if tc == self.ta or tc == self.tb:
            return None
        dt, dc = self.tb - self.ta, tc - self.ta
        for x, (xa, slope) in zip(point, lines):
            if (x - xa) * dt != slope * dc:
                return None
        return tc

    def refusal_at(self, tc: int) -> str | None:
        """Why a run at ``tc`` would be refused whatever it records (None: it may be taken): ``tc``
        is a crossing, or a line is not integral there or meets 0 or 1. Asked before the run, so
        a length bound to be proven costs no recorded run first."""
        if tc in self.crossings:
            return "sizes coincide at this length"
        if (tc - self.ta) % self.step:
            return "a size is not the proven lengths' function"
        if not self.lowest <= tc <= self.highest:
            return "a size becomes 0 or 1"
        return None

    def admits_record(self, record: Record, tc: int) -> str | None:
        """Why a run at ``tc`` is not the model's at that length (None: it is)."""
        if len(record.skeleton) != len(self.skeleton) or record.skeleton != self.skeleton:
            return "it ran other aten calls"
        ic = np.asarray(record.ints, dtype=np.int64)
        if ic.shape != self.ia.shape or not _affine(ic, self.ia, self.ib, self.ta, self.tb, tc):
            return "a size is not the proven lengths' function"
        if not np.array_equal(np.minimum(ic, 2), self.small):
            return "a size becomes 0 or 1"
        if tc in self.crossings:
            return "sizes coincide at this length"
        return None


class Family:
    """One family's latest proof and its model, built from the newest proof and the newest of
    the few before it (``WITNESSES``) that make one with it: a proof at a length where sizes
    coincide (``t == 8`` where ``4 * t`` meets a width of 32) is no witness, and the proofs on
    either side of it still make the model. A model, once made, stays until a newer proof makes
    another.

    ``refusal``: the reason both latest proofs were refused for, if the same (a new length then
    takes the DistTensor path without a trace: always correct, at worst slower)."""

    WITNESSES = 4  # recorded proofs kept to pair the newest one with

    def __init__(self) -> None:
        self.latest: Proof | None = None
        self.recorded: list[Proof] = []  # the latest proofs with a record, oldest first
        self.model: Model | None = None
        self.refusal = ""
        self.why = "fewer than two proven lengths"

    def add(self, proof: Proof) -> None:
        last, self.latest = self.latest, proof
        if last is not None:
            a, b = last.verdict, proof.verdict
            self.refusal = b.reason if not a.local and a.reason == b.reason else ""
        if proof.record is None:
            return
        for older in reversed(self.recorded):
            model = Model(older, proof)
            why = model.build()
            if why is None:
                self.model, self.why = model, ""
                break
            if self.model is None:
                self.why = why
        self.recorded = [*self.recorded[1 - self.WITNESSES:], proof]


def _affine(xc: np.ndarray, xa: np.ndarray, xb: np.ndarray, ta: int, tb: int, tc: int) -> bool:
    """Whether every ``xc`` lies on the line through ``(ta, xa)`` and ``(tb, xb)``: exact in integers."""
    return bool(np.array_equal((xc - xa) * (tb - ta), (xb - xa) * (tc - ta)))


def _crossings(lines: list[tuple[int, int]], ta: int, tb: int) -> list[int]:
    """The integer lengths ``t`` at which two of ``lines`` (values at ``ta``, ``tb``) meet."""
    out = []
    for i, (xa, xb) in enumerate(lines):
        for ya, yb in lines[i + 1:]:
            # xa + (xb - xa) u == ya + (yb - ya) u, u = (t - ta) / (tb - ta)
            slope = (xb - xa) - (yb - ya)
            if slope == 0:
                continue  # parallel lines: never equal (distinct at ta)
            num = (ya - xa) * (tb - ta)
            if num % slope == 0:
                out.append(ta + num // slope)
    return out


__all__ = ["Family", "Made", "Model", "Proof", "Record", "Recorder", "Stop", "mutable", "point_of", "sized_flags", "sizes_at"]
