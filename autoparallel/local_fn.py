"""Escape hatches: run arbitrary per-shard code with declared input and output layouts.

``local_map(fn, out_placements, in_placements=None, mesh=None, out_shapes=None, *,
in_grad_placements=None)`` wraps ``fn`` so that positional DistTensor arguments arrive as local
shards (first resharded to ``in_placements`` when given) and the local results come back as
DistTensors with ``out_placements``, as ``torch.distributed.tensor.experimental.local_map``
does. ``LocalLayer`` does the same for an ``nn.Module``'s ``forward``. Both are differentiable:
gradients flow through ``to_local`` / ``dtensor_from_local``.

The caller promises that ``fn`` computes, on each shard, the shard of the declared output
(that is the whole point: the framework cannot check it), and that each input's local gradient
is laid out as declared by ``in_grad_placements`` (default: the input's own placements, as in
torch). A Replicate input used against sharded inputs gets a per-rank *contribution* as its
local gradient, which must be declared ``Partial()``; ``local_map`` warns when it sees that
pattern left at the default. Global output shapes are inferred for even shards; pass
``out_shapes`` for uneven ones.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoparallel.api import dtensor_from_local, reshard
from autoparallel.engine.dtensor import DistTensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Partial, Placement, Shard, StridedShard

PlacementsLike = Sequence[Placement]


def _is_placements(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(not isinstance(p, (list, tuple)) for p in x)


def local_map(
    fn: Callable[..., Any],
    out_placements: PlacementsLike | Sequence[PlacementsLike | None],
    in_placements: Sequence[PlacementsLike | None] | None = None,
    mesh: ProcessMesh | None = None,
    out_shapes: Sequence[Sequence[int] | None] | None = None,
    *,
    in_grad_placements: Sequence[PlacementsLike | None] | None = None,
) -> Callable[..., Any]:
    """Wrap ``fn`` to run on the local shards of its positional DistTensor arguments.

    ``out_placements``: one placement list for a single tensor output, or one per output of a
    tuple/list result (``None`` for a non-tensor output). ``in_placements``: one per positional
    argument (``None`` = take it as it is). ``mesh`` defaults to the mesh of the first
    DistTensor argument. DistTensors go positionally: as in torch's ``local_map``, placements
    are declared per position, so a DistTensor passed by keyword raises ``TypeError``.

    ``in_grad_placements``: one per positional argument, the placements that argument's *local*
    gradient (what autograd computes for the shard ``fn`` received) is declared with; ``None``,
    or the argument left out, means its placements in the call (after ``in_placements``), as in
    torch. **Gradient trap**: a Replicate input used against sharded data, e.g. the weight in
    ``local_map(lambda x, w: x @ w, [Shard(0)], [[Shard(0)], [Replicate()]])``, receives on
    each rank only that rank's contribution to its gradient; declared Replicate (the default)
    each rank keeps its own piece and the gradient is silently wrong. Declare it
    ``in_grad_placements=[None, [Partial()]]`` so the contributions are summed. A call whose
    differentiable Replicate input meets a Shard or Partial input (or a Shard output) on the
    same mesh axis warns when ``in_grad_placements`` is not given; pass it (even equal to the
    default, when ``fn`` reduces the gradient itself) to say the layout is meant.
    """
    single = _is_placements(out_placements)
    outs: list[Any] = [out_placements] if single else list(out_placements)
    name = getattr(fn, "__name__", repr(fn))
    warned: list[bool] = []  # the gradient-trap warning, said once per wrapped function

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_call(name, args, kwargs, in_placements, in_grad_placements)
        local_args, dist_args = _to_locals(args, lambda i, a: _at(in_placements, i), lambda i, a: _at(in_grad_placements, i))
        the_mesh = mesh or (dist_args[0][1].process_mesh if dist_args else None)
        if the_mesh is None:
            raise ValueError(f"local_map({name}): no DistTensor argument and no mesh given")
        if in_grad_placements is None and not warned and torch.is_grad_enabled():
            suspects = _replicate_grad_suspects(dist_args, outs, the_mesh)
            if suspects:
                warned.append(True)
                warnings.warn(_trap_message(name, suspects, len(args)), stacklevel=2)
        result = fn(*local_args, **kwargs)
        results = _check_outputs(name, result, out_placements, outs, single)
        wrapped = []
        for k, (r, pl) in enumerate(zip(results, outs)):
            if pl is None:
                wrapped.append(r)
                continue
            shape = out_shapes[k] if out_shapes is not None else None
            wrapped.append(dtensor_from_local(r, the_mesh, list(pl), shape=shape))
        return wrapped[0] if single or not isinstance(result, (tuple, list)) else type(result)(wrapped)

    return wrapper


def _to_locals(args: tuple[Any, ...], want: Callable[[int, DistTensor], Any], grad: Callable[[int, DistTensor], Any]
               ) -> tuple[list[Any], list[tuple[int, DistTensor]]]:
    """(the arguments with each DistTensor resharded to ``want(i, a)`` (None: as it is) and taken
    to its local shard, its local gradient declared ``grad(i, a)`` (None: its own placements); the
    DistTensor arguments by position)."""
    local_args: list[Any] = []
    dist_args: list[tuple[int, DistTensor]] = []
    for i, a in enumerate(args):
        if not isinstance(a, DistTensor):
            local_args.append(a)
            continue
        placements = want(i, a)
        if placements is not None:
            a = reshard(a, a.process_mesh, list(placements))
        dist_args.append((i, a))
        g = grad(i, a)
        local_args.append(a.to_local(grad_placements=None if g is None else list(g)))
    return local_args, dist_args


def _at(per_arg: Sequence[PlacementsLike | None] | None, i: int) -> PlacementsLike | None:
    """Entry ``i`` of a per-positional-argument list, ``None`` past its end or without one."""
    return per_arg[i] if per_arg is not None and i < len(per_arg) else None


def _check_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                in_placements: Sequence[Any] | None, in_grad_placements: Sequence[Any] | None) -> None:
    """Raise, before any reshard moves data, on a call that the placements cannot describe.

    Every check reads only the call's structure, which every rank shares (SPMD), so every rank
    raises the same error."""
    for key, v in kwargs.items():
        if isinstance(v, DistTensor):
            raise TypeError(
                f"local_map({name}): keyword argument {key}= is a DistTensor, but in_placements and "
                f"in_grad_placements describe positional arguments only (as in "
                f"torch.distributed.tensor.experimental.local_map); pass it positionally, with its "
                f"placements at that position of in_placements (a keyword-only parameter takes a "
                f"wrapper: local_map(lambda x, {key}: fn(x, {key}={key}), ...))")
    for what, per_arg in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if per_arg is not None and len(per_arg) > len(args):
            raise ValueError(
                f"local_map({name}): {what} has {len(per_arg)} entries but the call has {len(args)} "
                f"positional arguments (one entry per positional argument; keyword arguments take none)")


def _check_outputs(name: str, result: Any, out_placements: Any, outs: list[Any], single: bool) -> list[Any]:
    """``fn``'s outputs, one per entry of ``outs``; raise when ``result`` does not match them.

    Raised before any output is wrapped (wrapping checks agreement across ranks, a collective),
    from the result's structure alone, so every rank raises the same error."""
    if single:
        if isinstance(result, (tuple, list)):
            example = [list(out_placements)] * len(result)
            raise ValueError(
                f"local_map({name}): {name} returned a {type(result).__name__} of {len(result)} values, but "
                f"out_placements {_fmt(out_placements)} is one placement list (a single tensor output); "
                f"give one placement list per output, None for a non-tensor one: e.g. "
                f"out_placements={_fmt(example)}")
        results = [result]
    else:
        results = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(results) != len(outs):
        raise ValueError(f"local_map({name}): {len(results)} outputs but {len(outs)} out_placements")
    for k, (r, pl) in enumerate(zip(results, outs)):
        if pl is not None and (not isinstance(r, torch.Tensor) or isinstance(r, DistTensor)):
            where = "its output" if single else f"output {k}"
            raise ValueError(
                f"local_map({name}): {where} has type {type(r).__name__}, but out_placements gives it "
                f"{_fmt(pl)}: an output with placements must be a plain (local) torch.Tensor; use None for "
                f"a non-tensor output")
    return results


def _fmt(placements: Any) -> str:
    """``[S(0), R]`` for a placement list, nested for a list of them."""
    if isinstance(placements, (list, tuple)):
        return "[" + ", ".join(_fmt(p) for p in placements) + "]"
    return str(placements)


def _replicate_grad_suspects(dist_args: list[tuple[int, DistTensor]], outs: list[Any],
                             mesh: ProcessMesh) -> dict[int, list[Placement]]:
    """Position -> suggested gradient placements for each differentiable input that is
    Replicate on a mesh axis where another input is Shard or Partial, or an output is Shard:
    there its local gradient is a per-rank contribution (``Partial()`` on that axis), not the
    replicated gradient the default declares."""
    def splits_or_sums(p: object) -> bool:
        return isinstance(p, (Shard, StridedShard, Partial))

    found: dict[int, list[Placement]] = {}
    for i, a in dist_args:
        if not a.requires_grad:
            continue
        suggested = list(a.placements)
        for axis, p in enumerate(suggested):
            by_input = any(b.process_mesh == a.process_mesh and splits_or_sums(b.placements[axis])
                           for j, b in dist_args if j != i)
            by_output = a.process_mesh == mesh and any(
                _is_placements(pl) and axis < len(pl) and isinstance(pl[axis], (Shard, StridedShard)) for pl in outs)
            if p.is_replicate() and (by_input or by_output):
                suggested[axis] = Partial()
        if suggested != list(a.placements):
            found[i] = suggested
    return found


def _trap_message(name: str, suspects: dict[int, list[Placement]], nargs: int) -> str:
    example = "[" + ", ".join(repr(suspects[i]) if i in suspects else "None" for i in range(nargs)) + "]"
    return (
        f"autoparallel: local_map({name}): positional argument(s) {sorted(suspects)} are Replicate on a mesh "
        f"axis where another input or an output is sharded, so each rank's local gradient for them is only "
        f"that rank's contribution; without in_grad_placements it is declared Replicate and the gradient "
        f"is wrong. Declare the contributions Partial: in_grad_placements={example} (or pass "
        f"in_grad_placements explicitly, even equal to in_placements, if fn reduces the gradient itself)")


class LocalLayer(torch.nn.Module):
    """A module whose ``forward`` runs on local shards; outputs get ``out_dist_attrs``.

    ``out_dist_attrs`` lists ``(mesh, placements)`` per output. Subclass and write ``forward``
    as single-device code on the shards::

        class LocalSum(ap.LocalLayer):
            def __init__(self, mesh):
                super().__init__([(mesh, [ap.Partial()])])
            def forward(self, x):           # x: this rank's shard
                return x.sum()

    ``grad_dist_attrs`` (as Paddle's): one ``(mesh, placements)`` or ``None`` per positional
    argument, the layout its *local* gradient is declared with (``None``: its own layout). The
    gradient trap of ``local_map`` applies: a Replicate input used against sharded data gets each
    rank's contribution as its local gradient, so declare it ``Partial`` there; a call that looks
    like the trap warns once when ``grad_dist_attrs`` is not given.
    """

    def __init__(self, out_dist_attrs: Sequence[tuple[ProcessMesh, PlacementsLike]],
                 grad_dist_attrs: Sequence[tuple[ProcessMesh, PlacementsLike] | None] | None = None) -> None:
        super().__init__()
        self.out_dist_attrs = [(m, list(p)) for m, p in out_dist_attrs]
        self.grad_dist_attrs = None if grad_dist_attrs is None else [
            None if g is None else (g[0], list(g[1])) for g in grad_dist_attrs]
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = type(self).__name__
        grads = self.grad_dist_attrs
        if grads is not None and len(grads) > len(args):
            raise ValueError(f"{name}: grad_dist_attrs has {len(grads)} entries but the call has {len(args)} positional "
                             "arguments (one entry per positional argument)")
        def grad(i: int, a: DistTensor) -> Any:
            g = grads[i] if grads is not None and i < len(grads) else None
            if g is not None and g[0] != a.process_mesh:
                raise ValueError(f"{name}: grad_dist_attrs[{i}] names {g[0]!r}, but argument {i} lives on "
                                 f"{a.process_mesh!r}: a gradient takes its argument's mesh")
            return None if g is None else g[1]

        local_args, dist_args = _to_locals(args, lambda i, a: None, grad)
        local_kwargs = {k: v.to_local() if isinstance(v, DistTensor) else v for k, v in kwargs.items()}
        if grads is None and not self._warned and torch.is_grad_enabled() and dist_args:
            mesh = self.out_dist_attrs[0][0] if self.out_dist_attrs else dist_args[0][1].process_mesh
            suspects = _replicate_grad_suspects(dist_args, [p for _, p in self.out_dist_attrs], mesh)
            if suspects:
                self._warned = True
                example = "[" + ", ".join(f"(mesh, {suspects[i]!r})" if i in suspects else "None"
                                          for i in range(len(args))) + "]"
                warnings.warn(
                    f"autoparallel: {name}: positional argument(s) {sorted(suspects)} are Replicate on a mesh axis "
                    "where another input or an output is sharded, so each rank's local gradient for them is only "
                    "that rank's contribution; without grad_dist_attrs it is declared Replicate and the gradient "
                    f"is wrong. Declare the contributions Partial: grad_dist_attrs={example} (or pass "
                    "grad_dist_attrs explicitly if forward reduces the gradient itself)", stacklevel=2)
        result = super().__call__(*local_args, **local_kwargs)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(results) != len(self.out_dist_attrs):
            raise ValueError(f"{name}: {len(results)} outputs but {len(self.out_dist_attrs)} out_dist_attrs")
        wrapped = [
            dtensor_from_local(r, m, p) if isinstance(r, torch.Tensor) else r
            for r, (m, p) in zip(results, self.out_dist_attrs)
        ]
        return type(result)(wrapped) if isinstance(result, (tuple, list)) else wrapped[0]
