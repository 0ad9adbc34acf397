"""World part of ``tests/pure/test_reduction_rules.py``: reductions and scans on a 4-rank world.

Values and gradients against plain torch on a 1-d mesh of 4 and on [[0, 1], [2, 3]].
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import autoparallel as ap
from tests.layouts import make_dist, reference
from tests.pure.test_reduction_rules import INF, PAVG, PMAX, PMIN, S0, S1, P, R


# ---- a 4-rank world: values and gradients against plain torch ---------------------------------
def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


# name, fn, differentiable
WORLD_OPS: list[tuple[str, Any, bool]] = [
    ("sum", lambda x: x.sum(), True),
    ("sum1_f64", lambda x: x.sum(1, dtype=torch.float64), True),
    ("mean0_keep", lambda x: x.mean(0, keepdim=True), True),
    ("mean_f64", lambda x: x.mean(dtype=torch.float64), True),
    # prod/cumprod backward builds plain ``ones``/``zeros`` for tensor subclasses: forward only
    ("prod1", lambda x: x.prod(1), False),
    ("amax0", lambda x: x.amax(0), True),
    ("amin", lambda x: x.amin(), True),
    ("max", lambda x: x.max(), True),
    ("min1", lambda x: x.min(1), True),
    ("max0_keep", lambda x: x.max(0, keepdim=True), True),
    ("aminmax1", lambda x: torch.aminmax(x, dim=1), False),
    ("argmax1", lambda x: x.argmax(1), False),
    ("argmin", lambda x: x.argmin(), False),
    ("norm", lambda x: x.norm(), True),
    ("norm1_0", lambda x: torch.linalg.vector_norm(x, 1, dim=0), True),
    ("norminf_1", lambda x: torch.linalg.vector_norm(x, INF, dim=1), True),
    ("normneginf", lambda x: torch.linalg.vector_norm(x, -INF), True),
    ("var1", lambda x: x.var(1), True),
    ("std", lambda x: x.std(correction=0), True),
    ("var_mean0", lambda x: torch.var_mean(x, 0), True),
    ("lse1", lambda x: x.logsumexp(1), True),
    ("cumsum0", lambda x: x.cumsum(0), True),
    ("cumprod1", lambda x: x.cumprod(1), False),
    ("all1", lambda x: (x > 0).all(1), False),
    ("any", lambda x: (x > 0).any(), False),
    ("count_nonzero0", lambda x: torch.count_nonzero(x > 0, 0), False),
]
SCALAR_OPS = [n for n in ("sum", "mean_f64", "amin", "max", "norm", "cumsum0", "any")]


def _layouts(small: bool) -> list[tuple[Any, tuple]]:
    """Layouts to check: uneven shards and Partial inputs; for a tensor smaller than the mesh,
    layouts that leave some ranks with empty pieces."""
    m1, m2 = _mesh1(), _mesh2()
    if small:
        return [(m1, (S1,)), (m2, (S0, S0)), (m2, (S1, P))]
    return [(m1, (S0,)), (m1, (S1,)), (m1, (P,)), (m1, (PMAX,)),
            (m2, (S0, S1)), (m2, (S1, S0)), (m2, (P, S0)), (m2, (PMIN, PMIN))]


def _loss(out: Any) -> Any:
    v = out[0] if isinstance(out, tuple) else out
    return v.sin().sum()  # a varying upstream gradient catches misplaced gradient pieces


def _check_op(name: str, fn: Any, grad: bool, full: torch.Tensor, mesh: Any, pl: tuple) -> str | None:
    """None when ``fn`` on the DistTensor matches torch (value and gradient), else what differs."""
    a = full.clone().requires_grad_(grad)
    ref = fn(a)
    d = make_dist(full, mesh, pl)
    if grad:
        d = d.detach().requires_grad_(True)
    out = fn(d)
    refs, outs = (ref, out) if isinstance(ref, tuple) else ((ref,), (out,))
    for r, o in zip(refs, outs):
        if not _close(o.full_tensor(), r.detach()):
            return f"{name} {list(pl)} {tuple(full.shape)}: value {o.full_tensor()} != {r}"
    if grad:
        _loss(ref).backward()
        _loss(out).backward()
        if d.grad is None or not _close(d.grad.full_tensor(), a.grad):
            return f"{name} {list(pl)} {tuple(full.shape)}: grad {None if d.grad is None else d.grad.full_tensor()} != {a.grad}"
    return None


def _world_values(rank: int, grads: bool = True) -> list[str]:
    warnings.simplefilter("ignore")  # backward ops without a rule fall back (their own warning)
    errors: list[str] = []
    for shape, seed in [((7, 5), 1), ((3, 2), 2)]:  # uneven; smaller than the mesh (empty shards)
        full = reference(shape, seed)
        for mesh, pl in _layouts(small=shape[0] < 4):
            for name, fn, grad in WORLD_OPS:
                try:
                    err = _check_op(name, fn, grad and grads, full, mesh, pl)
                except Exception as e:  # noqa: BLE001
                    err = f"{name} {list(pl)} {tuple(full.shape)}: {type(e).__name__} {str(e)[:200]}"
                if err:
                    errors.append(err)
    zero_d = reference((), 3)
    for mesh, pl in [(_mesh1(), (R,)), (_mesh2(), (P, PAVG)), (_mesh2(), (PMAX, R))]:
        for name, fn, grad in WORLD_OPS:
            if name in SCALAR_OPS:
                err = _check_op(name, fn, grad, zero_d, mesh, pl)
                if err:
                    errors.append(err)
    return errors


def _world_layouts(rank: int) -> bool:
    """The placements the rules pick, the collectives they cost, bool Partial reductions."""
    warnings.simplefilter("ignore")
    m1, m2 = _mesh1(), _mesh2()
    a = reference((7, 5), 4)
    d = make_dist(a, m1, (S0,))
    with ap.CommDebugMode() as comm:
        mx, s = d.amax(0), d.sum(0)
        cs = d.cumsum(1)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert list(mx.placements) == [PMAX] and list(s.placements) == [P] and list(cs.placements) == [S0]
    assert _close(mx.full_tensor(), a.amax(0)) and _close(cs.full_tensor(), a.cumsum(1))
    v, i = d.max(0)  # indices cannot be combined: the reduced dim is gathered (or moved) first
    assert list(v.placements) in ([R], [S0]) and list(i.placements) == list(v.placements)
    assert _close(v.full_tensor(), a.max(0).values) and _close(i.full_tensor(), a.max(0).indices)
    v, i = d.max(1)
    assert list(v.placements) == [S0] == list(i.placements)
    # a max of P(max) pieces stays P(max); a P(sum) is reduced first
    assert list(make_dist(a, m1, (PMAX,)).amax(1).placements) == [PMAX]
    ps = make_dist(a, m1, (P,)).amax(1)
    assert list(ps.placements) != [PMAX] and _close(ps.full_tensor(), a.amax(1))
    # bool Partials: any -> P(max) (all_reduce MAX), all -> P(min) then reduce_scatter MIN
    b = make_dist(a > 0.5, m2, (S0, S1))
    anyb, allb = b.any(0), b.all(1)
    assert list(anyb.placements) == [PMAX, S0] and list(allb.placements) == [S0, PMIN]
    assert _close(anyb.full_tensor(), (a > 0.5).any(0)) and _close(allb.full_tensor(), (a > 0.5).all(1))
    scattered = ap.reshard(allb, m2, [S0, S0])
    assert _close(scattered.full_tensor(), (a > 0.5).all(1))
    # P(max) bool from dtensor_from_local: any of P(max) pieces
    local = torch.tensor([rank == 1, False, rank == 3])
    pb = ap.dtensor_from_local(local, m1, [PMAX], shape=(3,))
    assert list(pb.any().placements) == [PMAX] and bool(pb.any().full_tensor()) is True
    assert _close(pb.full_tensor(), torch.tensor([True, False, True]))
    # an in-place scan keeps the layout
    c = make_dist(a, m1, (S0,))
    c.cumsum_(1)
    assert list(c.placements) == [S0] and _close(c.full_tensor(), a.cumsum(1))
    # empty global tensors raise like torch
    e = ap.shard_tensor(torch.empty(0), m1, [S0])
    try:
        e.max()
    except RuntimeError:
        pass
    else:
        raise AssertionError("max() of an empty DistTensor must raise")
    return True


def test_world_values_and_gradients_match_torch(world4):  # type: ignore[no-untyped-def]
    for errors in world4.run(_world_values, timeout=300):
        assert not errors, "\n".join(errors[:20])


def test_world_layouts_and_bool_partials(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_world_layouts))


def _nan_on_every_rank_in_turn(rank: int) -> list[str]:
    """A NaN in one rank's shard (each rank in turn) is the max and the min over the shards, as
    on one device: the reductions of Partial max/min carry it from any rank, not only the first;
    and ``ap.clip_grad_norm_`` of order inf raises for it with ``error_if_nonfinite``."""
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    wrong = []
    for pos in range(4):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            x = torch.arange(16.0).reshape(4, 4).to(dtype)
            x[pos, 1] = float("nan")
            d = ap.shard_tensor(x, mesh, [S0])
            for name, fn in (("max", lambda t: t.max()), ("amax0", lambda t: t.amax(0)), ("min", lambda t: t.min())):
                got, want = fn(d).full_tensor(), fn(x)
                if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())):
                    wrong.append(f"{name} {dtype} NaN on rank {pos}: {got.tolist()} != {want.tolist()}")
        p = ap.shard_tensor(torch.nn.Parameter(torch.ones(4, 3)), mesh, [S0])
        g = torch.ones(4, 3)
        g[pos, 0] = float("nan")
        (p * ap.shard_tensor(g, mesh, [S0])).sum().backward()
        try:
            ap.clip_grad_norm_([p], 1.0, norm_type=float("inf"), error_if_nonfinite=True)
            wrong.append(f"clip inf-norm with a NaN on rank {pos} did not raise")
        except RuntimeError:
            pass
    return wrong


def test_a_nan_on_any_rank_is_the_max_and_the_min(world4):  # type: ignore[no-untyped-def]
    assert world4.run(_nan_on_every_rank_in_turn) == [[]] * 4
