"""Every dtype x every collective on a 4-rank gloo world, against the single-device result.

The expectation of each (dtype, collective) is the cell of docs/dtypes.md (``tests.dtypes_table``,
checked against the file by tests/pure/test_dtype_table.py): an exact cell must equal the
single-device reference bit for bit (compared as bytes); a refused cell must raise the same
``ValueError`` on every rank, naming the dtype and the reduce type, before any collective.
The collectives started without waiting (``all_gather_start``, ``reduce_scatter_start``: ZeRO-3's
overlap) give the same bits as the waited ones, on meshes whose ranks are out of group order too.

Single-device references (``reduce_ref``), the semantics docs/dtypes.md states:
integers ``sum`` wraps modulo 2^bits (numpy's add in the dtype); bool ``sum``/``max`` is ``or``,
``min`` is ``and``; floats and float8 ``sum`` is the exact sum rounded once to the dtype (native
floats get small integers here, whose sums are exact in any order; float8 gets any finite
value: the widened sum is exact), ``avg`` that sum divided by n in the dtype (float8: in
float64, then rounded once); ``max``/``min`` the elementwise extreme.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoparallel as ap
from autoparallel.placement import Partial, Replicate, Shard, chunk_bounds
from autoparallel.runtime import comm
from reshard import plan_best
from tests.dtypes_table import DTYPES, MOVES, REDUCES, is_exact, name

WORLD = 4
ORDERS = [[0, 1, 2, 3], [3, 0, 2, 1]]
RESHARDS = [  # (src, dst) on a 1-d mesh; the reduce type of a Partial picks the table column
    ((Shard(0),), (Replicate(),)),
    ((Shard(0),), (Shard(1),)),
    ((Shard(1),), (Shard(0),)),
    ((Replicate(),), (Shard(0),)),
    ((Partial("sum"),), (Replicate(),)),
    ((Partial("sum"),), (Shard(0),)),
    ((Partial("max"),), (Shard(1),)),
    ((Partial("min"),), (Replicate(),)),
    ((Partial("avg"),), (Replicate(),)),
    ((Shard(0),), (Partial("sum"),)),
    ((Shard(1),), (Partial("max"),)),
]


# ---- values and references ---------------------------------------------------------------------
def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic values of ``dtype``: random bits for integers (sums wrap), small integers
    for native floats and complex (exact sums), any finite value for float8."""
    g = torch.Generator().manual_seed(seed)
    numel = int(np.prod(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.complex(torch.randint(-8, 9, shape, generator=g).float(),
                             torch.randint(-8, 9, shape, generator=g).float()).to(dtype)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * item,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)
    if dtype.is_floating_point:  # float8: finite values only (no NaN, no inf)
        wide = raw.float()
        raw = torch.where(wide.isfinite(), wide, torch.ones_like(wide)).to(dtype)
    return raw


def reduce_ref(pieces: list[torch.Tensor], reduce_type: str) -> torch.Tensor:
    """What one device computes from the ``n`` pieces (see the module docstring)."""
    dtype, n = pieces[0].dtype, len(pieces)
    if dtype == torch.bool:
        stack = torch.stack(pieces)
        return stack.all(0) if reduce_type == "min" else stack.any(0)
    if not (dtype.is_floating_point or dtype.is_complex):
        arr = np.stack([p.numpy() for p in pieces])
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[reduce_type]
        return torch.from_numpy(fn.reduce(arr, axis=0).astype(arr.dtype))
    wide = torch.stack([p.to(torch.complex128 if dtype.is_complex else torch.float64) for p in pieces])
    if reduce_type in ("max", "min"):
        return (wide.amax(0) if reduce_type == "max" else wide.amin(0)).to(dtype)
    total = wide.sum(0)
    if reduce_type == "sum":
        return total.to(dtype)
    if dtype in comm.NATIVE:  # the sum in the dtype (exact here), divided in the dtype
        return total.to(dtype) / n
    return (total / n).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# ---- one rank's checks ---------------------------------------------------------------------------
def _refused(fn, dtype: torch.dtype, what: str) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert str(dtype) in msg and repr(what) in msg, f"{msg!r} does not name {dtype} and {what!r}"
        return "refused"
    raise AssertionError(f"{dtype} {what}: expected a ValueError")


def _check(rank: int, dtype_name: str, shape: tuple[int, int], seed: int, order: list[int], src: int) -> dict[str, str]:
    """Run every collective on ``dtype``; returns {collective: "exact" | "refused"}."""
    dtype = getattr(torch, dtype_name)
    mesh = ap.ProcessMesh(order)
    n, me = WORLD, order.index(rank)
    full = values(dtype, shape, seed)
    pieces = [values(dtype, shape, seed + 1 + c) for c in range(n)]  # the summands, by coordinate
    got: dict[str, str] = {}

    def mine(t: torch.Tensor, dim: int, c: int = me) -> torch.Tensor:
        return t.narrow(dim, *chunk_bounds(t.shape[dim], n, c))

    # data movement
    out = comm.all_gather(mine(full, 0), mesh, 0, 0, [chunk_bounds(shape[0], n, c)[1] for c in range(n)])
    assert same_bits(out, full), "all_gather"
    out = comm.all_to_all(mine(full, 0), mesh, 0, 0, 1, [chunk_bounds(shape[0], n, c)[1] for c in range(n)])
    assert same_bits(out, mine(full, 1)), "all_to_all"
    out = comm.broadcast(pieces[me], mesh, 0, src)
    assert same_bits(out, pieces[src]), "broadcast"
    buf = torch.empty(shape, dtype=dtype)
    comm.send_recv([(pieces[me], order[(me + 1) % n])], [(buf, order[(me - 1) % n])])
    assert same_bits(buf, pieces[(me - 1) % n]), "send_recv"
    flat = comm.all_gather_start(pieces[me].reshape(-1), mesh, 0)  # started, waited for below
    flat[1].wait()  # type: ignore[attr-defined]
    assert same_bits(flat[0], torch.cat([p.reshape(-1) for p in pieces])), "all_gather_start"
    got.update({m: "exact" for m in MOVES})

    # reductions: all_reduce, reduce_scatter on both dims (uneven pieces), one table column each
    for t in REDUCES:
        if not is_exact(dtype, t):
            for call in (lambda t=t: comm.all_reduce(pieces[me], mesh, 0, t),
                         lambda t=t: comm.reduce_scatter(pieces[me], mesh, 0, 0, t),
                         lambda t=t: ap.dtensor_from_local(pieces[me], mesh, [Partial(t)])):
                got[t] = _refused(call, dtype, t)
            continue
        want = reduce_ref(pieces, t)
        assert same_bits(comm.all_reduce(pieces[me], mesh, 0, t), want), f"all_reduce {t}"
        for dim in (0, 1):
            assert same_bits(comm.reduce_scatter(pieces[me], mesh, 0, dim, t), mine(want, dim)), f"reduce_scatter {t} dim {dim}"
        out, work = comm.reduce_scatter_start(torch.cat([pieces[me].reshape(-1)] * n), mesh, 0, t)  # segment c for c
        work.wait()  # type: ignore[attr-defined]
        assert same_bits(out, want.reshape(-1)), f"reduce_scatter_start {t}"
        got[t] = "exact"

    # reshards through ap.reshard: the value, the local shard's dtype, the bytes the plan promised
    for src_pl, dst_pl in RESHARDS:
        t = next((p.reduce_type for p in src_pl + dst_pl if isinstance(p, Partial)), None)
        if t is not None and not is_exact(dtype, t):
            continue  # construction is refused (checked above)
        if isinstance(src_pl[0], Partial):
            value, local = reduce_ref(pieces, t), pieces[me]  # type: ignore[arg-type]
        else:
            value = full
            local = mine(full, src_pl[0].dim) if isinstance(src_pl[0], Shard) else full
        x = ap.dtensor_from_local(local, mesh, list(src_pl), shape=shape)
        with ap.CommDebugMode() as seen:
            y = ap.reshard(x, mesh, list(dst_pl))
        assert y.to_local().dtype == dtype and y.dtype == dtype, f"{src_pl}->{dst_pl}: local {y.to_local().dtype}"
        promised = plan_best(x.dist_spec, y.dist_spec).bytes_per_rank(rank)
        assert (seen.bytes_sent, seen.bytes_received) == promised, f"{src_pl}->{dst_pl}: {seen.summary()}"
        assert same_bits(y.full_tensor(), value), f"{src_pl}->{dst_pl}: wrong value"
    return got


def _expected(dtype: torch.dtype) -> dict[str, str]:
    return {c: "exact" if is_exact(dtype, c) else "refused" for c in MOVES + REDUCES}


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_every_collective_on_every_dtype(world4, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    results = world4.run(_check, name(dtype), (7, 5), 11, ORDERS[1], 2)
    assert results == [_expected(dtype)] * WORLD


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    seed=st.integers(0, 10_000),
    order=st.sampled_from(ORDERS),
    src=st.integers(0, WORLD - 1),
)
def test_collectives_match_single_device(world4, dtype, shape, seed, order, src) -> None:  # type: ignore[no-untyped-def]
    assert world4.run(_check, name(dtype), shape, seed, order, src) == [_expected(dtype)] * WORLD


def _bool_avg(rank: int) -> str:
    mesh = ap.ProcessMesh(list(range(WORLD)))
    try:
        ap.dtensor_from_local(torch.ones(3, dtype=torch.bool), mesh, [Partial("avg")])
    except ValueError as e:
        return str(e)
    return "accepted"


def test_partial_avg_on_bool_is_refused_with_a_clear_message(world4) -> None:  # type: ignore[no-untyped-def]
    msgs = world4.run(_bool_avg)
    assert len(set(msgs)) == 1
    assert "Partial('avg')" in msgs[0] and "torch.bool" in msgs[0] and "not an integer" in msgs[0]
