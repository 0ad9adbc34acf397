"""Factories (``ap.ones/zeros/full/empty/rand/randn``) and random ops on DistTensors (4 gloo ranks).

Random results must equal the single-device result for the same seed — sharded (even, uneven,
2-d mesh, Partial) or replicated — and leave the generator where the single-device run leaves it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard
from tests.layouts import make_dist

R = Replicate()
S0, S1 = Shard(0), Shard(1)
P = Partial()


def _mesh1() -> ap.ProcessMesh:
    return ap.ProcessMesh([0, 1, 2, 3], ["x"])


def _mesh2() -> ap.ProcessMesh:
    return ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def _layouts() -> list[tuple[ap.ProcessMesh, tuple]]:
    m1, m2 = _mesh1(), _mesh2()
    return [(m1, (S0,)), (m1, (S1,)), (m1, (R,)), (m1, (P,)), (m2, (S0, S1)), (m2, (S1, S0)), (m2, (S0, S0)),
            (m2, (R, S1)), (m2, (P, S0)), (m2, (Partial("max"), R))]


SHAPE = (7, 5)  # uneven over 2 and 4 ranks


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.numels.append(out.numel())
        return out


def _seeded(seed: int, fn: Callable[[], Any]) -> tuple[Any, torch.Tensor]:
    """``fn()`` right after ``torch.manual_seed(seed)``, and the next draw (the generator's state)."""
    torch.manual_seed(seed)
    out = fn()
    return out, torch.rand(3)


def _full(x: Any) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, ap.DistTensor) else x


def _no_fallback(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "autoparallel" in str(w.message)]


# ---- factories -----------------------------------------------------------------------------------
def _factories(rank: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mesh, pl in _layouts():
            for name, make, want in [
                ("ones", lambda: ap.ones(SHAPE, mesh=mesh, placements=pl), torch.ones(SHAPE)),
                ("zeros", lambda: ap.zeros(*SHAPE, mesh=mesh, placements=pl, dtype=torch.float64),
                 torch.zeros(SHAPE, dtype=torch.float64)),
                ("full", lambda: ap.full(SHAPE, 3, mesh=mesh, placements=pl), torch.full(SHAPE, 3)),
                ("full_f", lambda: ap.full(SHAPE, 2.5, mesh=mesh, placements=pl, requires_grad=True),
                 torch.full(SHAPE, 2.5)),
            ]:
                with _Sizes() as sizes:
                    d = make()
                assert isinstance(d, ap.DistTensor) and tuple(d.placements) == pl, (name, d)
                assert d.dtype == want.dtype and d.shape == want.shape, (name, d.dtype, want.dtype)
                assert d._local.shape == d.dist_spec.local_shape(mesh.coordinate_of(rank)), name
                assert d.requires_grad == (name == "full_f") and d.is_leaf
                if any(isinstance(p, Shard) for p in pl):  # only the local shard was ever allocated
                    assert max(sizes.numels, default=0) < math.prod(SHAPE), (name, pl, sizes.numels)
                assert torch.equal(d.full_tensor().detach(), want), (name, pl)
            e = ap.empty(SHAPE, mesh=mesh, placements=pl)
            assert e.shape == SHAPE and e._local.shape == e.dist_spec.local_shape(mesh.coordinate_of(rank))
            for name, draw, ref in [("rand", ap.rand, torch.rand), ("randn", ap.randn, torch.randn)]:
                got, after = _seeded(5, lambda: draw(SHAPE, mesh=mesh, placements=pl))
                want, want_after = _seeded(5, lambda: ref(SHAPE))
                assert tuple(got.placements) == pl
                assert torch.equal(got.full_tensor(), want), (name, pl)
                assert torch.equal(after, want_after), (name, pl)  # generator left as on one device
            g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
            got = ap.randn(SHAPE, mesh=mesh, placements=pl, dtype=torch.float64, generator=g1)
            assert torch.equal(got.full_tensor(), torch.randn(SHAPE, dtype=torch.float64, generator=g2))
    return _no_fallback(caught)


def test_factories(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_factories):
        assert warned == []


# ---- new tensors made from a sharded one, then written ------------------------------------------
WRITES: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], Any]]] = [
    ("row", lambda t, x: t.__setitem__(0, 5.0)),
    ("rows", lambda t, x: t.__setitem__(slice(1, 3), 7.0)),
    ("column", lambda t, x: t.__setitem__((slice(None), 0), 5.0)),
    ("fill_diagonal_", lambda t, x: t.fill_diagonal_(2.0)),
    ("shift", lambda t, x: t[..., 1:].copy_(x[..., :-1])),
    ("index_put_", lambda t, x: t.index_put_((torch.tensor([0, 3]),), torch.tensor(9.0))),
    ("masked_fill_", lambda t, x: t.masked_fill_(x > 5, 1.0)),
]


def _new_then_written(rank: int) -> list[str]:
    """``x.new_zeros(x.shape)`` of a batch-sharded x, written through views (of the sharded dim
    too): every write lands as on one device."""
    bad = []
    x = torch.arange(12.0).reshape(4, 3)
    xd = ap.shard_tensor(x, _mesh1(), [S0])
    for name, write in WRITES:
        for make in ("new_zeros", "new_empty_strided"):
            t = xd.new_zeros(x.shape) if make == "new_zeros" else xd.new_empty_strided(x.shape, (3, 1)).zero_()
            want = torch.zeros(4, 3)
            write(t, xd)
            write(want, x)
            if not torch.equal(t.full_tensor(), want):
                bad.append(f"{make} {name}")
    return bad


def test_new_tensors_take_writes_through_any_view(world4):  # type: ignore[no-untyped-def]
    for bad in world4.run(_new_then_written):
        assert bad == []


# ---- random ops on DistTensors -------------------------------------------------------------------
FILLS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("uniform_", lambda x: x.uniform_(-2, 3)),
    ("normal_", lambda x: x.normal_(1.0, 2.0)),
    ("bernoulli_", lambda x: x.bernoulli_(0.3)),
    ("exponential_", lambda x: x.exponential_(2.0)),
    ("random_", lambda x: x.random_(0, 10)),
    ("cauchy_", lambda x: x.cauchy_()),
    ("log_normal_", lambda x: x.log_normal_()),
    ("geometric_", lambda x: x.geometric_(0.4)),
    ("init.normal_", lambda x: torch.nn.init.normal_(x, 0.0, 0.02)),
    ("init.uniform_", lambda x: torch.nn.init.uniform_(x, -0.1, 0.1)),
    ("init.kaiming_uniform_", lambda x: torch.nn.init.kaiming_uniform_(x, a=math.sqrt(5))),
    ("init.xavier_normal_", lambda x: torch.nn.init.xavier_normal_(x)),
    ("init.trunc_normal_", lambda x: torch.nn.init.trunc_normal_(x, std=0.5)),
]


def _fills(rank: int) -> list[str]:
    base = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mesh, pl in _layouts():
            for name, fill in FILLS:
                d = make_dist(base, mesh, pl)
                with torch.no_grad():
                    _, after = _seeded(7, lambda: fill(d))
                    want, want_after = _seeded(7, lambda: fill(base.clone()))
                assert tuple(d.placements) == pl, (name, d.placements)
                assert torch.equal(d.full_tensor(), want), (name, pl, d.full_tensor(), want)
                assert torch.equal(after, want_after), (name, pl)
            # a parameter: nn.init under no_grad on a DistTensor Parameter
            w = ap.shard_tensor(torch.nn.Parameter(base.clone()), mesh, list(pl) if P not in pl else [R] * mesh.ndim)
            _seeded(8, lambda: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
            ref = torch.nn.Parameter(base.clone())
            _seeded(8, lambda: torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5)))
            assert torch.equal(w.full_tensor(), ref.detach())
        # a transposed view is filled in memory order, as on one device
        t = make_dist(base, _mesh1(), (S0,)).t()
        _seeded(3, lambda: t.uniform_())
        want = base.clone().t()
        _seeded(3, lambda: want.uniform_())
        assert torch.equal(t.full_tensor(), want)
    return _no_fallback(caught)


def test_random_fills_match_single_device(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_fills):
        assert warned == []


def _draws(rank: int) -> list[str]:
    probs = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1))
    mean = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    std = torch.rand(SHAPE, generator=torch.Generator().manual_seed(3)) + 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mesh, pl in _layouts():
            dp, dm, ds = make_dist(probs, mesh, pl), make_dist(mean, mesh, pl), make_dist(std, mesh, pl)
            for name, fn in [
                ("rand_like", lambda p, m, s: torch.rand_like(m)),
                ("randn_like", lambda p, m, s: torch.randn_like(m)),
                ("randint_like", lambda p, m, s: torch.randint_like(m, 3, 9)),
                ("bernoulli", lambda p, m, s: torch.bernoulli(p)),
                ("bernoulli_p", lambda p, m, s: torch.bernoulli(m, 0.25)),
                ("bernoulli_tensor_", lambda p, m, s: torch.zeros_like(m).bernoulli_(p)),
                ("normal_tt", lambda p, m, s: torch.normal(m, s)),
                ("normal_tf", lambda p, m, s: torch.normal(m, 2.0)),
                ("normal_ft", lambda p, m, s: torch.normal(1.0, s)),
                ("multinomial", lambda p, m, s: torch.multinomial(p.reshape(p.shape[0], -1) + 0.1, 3, replacement=True)),
                ("poisson", lambda p, m, s: torch.poisson(s * 3)),
                ("standard_gamma", lambda p, m, s: torch._standard_gamma(s)),
            ]:
                if name in ("multinomial", "poisson") and any(isinstance(q, Partial) for q in pl):
                    continue  # (discrete draws from summands that add up to ~x: not comparable)
                got, after = _seeded(11, lambda: fn(dp, dm, ds))
                want, want_after = _seeded(11, lambda: fn(probs, mean, std))
                assert isinstance(got, ap.DistTensor), name
                if any(isinstance(q, Partial) for q in pl):  # the inputs' summands add up to ~x
                    torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(got.full_tensor(), want), (name, pl)
                assert torch.equal(after, want_after), (name, pl)
    return _no_fallback(caught)


def test_random_draws_match_single_device(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_draws):
        assert warned == []


def _dropout(rank: int) -> list[str]:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4))
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mesh, pl in _layouts():
            for p in (0.0, 0.4, 1.0):
                xd = make_dist(x, mesh, pl).detach().requires_grad_()
                wd = make_dist(weight, mesh, tuple(R for _ in pl))
                got, after = _seeded(13, lambda: F.dropout(xd, p, training=True))
                (got * wd).sum().backward()
                xr = x.clone().requires_grad_()
                want, want_after = _seeded(13, lambda: F.dropout(xr, p, training=True))
                (want * weight).sum().backward()
                torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)
                assert torch.equal(after, want_after)
                assert xd.grad is not None
                torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, rtol=1e-5, atol=1e-6)
            # eval mode is the identity; the module form draws the same mask
            ident = F.dropout(make_dist(x, mesh, pl), 0.5, training=False)
            torch.testing.assert_close(ident.full_tensor(), x, rtol=1e-5, atol=1e-6)
            got, _ = _seeded(14, lambda: torch.nn.Dropout(0.3)(make_dist(x, mesh, pl)))
            want, _ = _seeded(14, lambda: torch.nn.Dropout(0.3)(x))
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)
            # the aten op itself (what compiled graphs call): output and mask
            xd = make_dist(x, mesh, pl).detach().requires_grad_()
            xr = x.clone().requires_grad_()
            (o, m), after = _seeded(15, lambda: torch.native_dropout(xd, 0.3, True))
            (wo, wm), want_after = _seeded(15, lambda: torch.native_dropout(xr, 0.3, True))
            torch.testing.assert_close(o.full_tensor(), wo, rtol=1e-5, atol=1e-6)
            assert torch.equal(m.full_tensor(), wm) and torch.equal(after, want_after)
            (o * wd).sum().backward()
            (wo * weight).sum().backward()
            assert xd.grad is not None
            torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, rtol=1e-5, atol=1e-6)
    return _no_fallback(caught)


def test_dropout_forward_backward_match_single_device(world4):  # type: ignore[no-untyped-def]
    for warned in world4.run(_dropout):
        assert warned == []


def _sub_mesh_draws(rank: int) -> list[bool]:
    """Random ops on a sub-mesh ([2, 3]) advance every rank's generator alike (ranks 0 and 1,
    outside it, draw and drop the same whole tensor): a later Replicate draw on the whole mesh is
    the same on every rank, and the single-device one."""
    import torch.nn.functional as F

    part, whole = ap.ProcessMesh([2, 3], dim_names=["x"]), ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    torch.manual_seed(0)
    F.dropout(torch.ones(8, 4), 0.5)
    torch.rand(6, 4)
    torch.ones(5).normal_()
    want = F.dropout(torch.ones(8, 4), 0.5)
    torch.manual_seed(0)
    F.dropout(ap.shard_tensor(torch.ones(8, 4), part, [Shard(0)]), 0.5)
    torch.rand_like(ap.shard_tensor(torch.ones(6, 4), part, [Shard(0)]))
    ap.shard_tensor(torch.ones(5), part, [Replicate()]).normal_()
    got = F.dropout(ap.shard_tensor(torch.ones(8, 4), whole, [Replicate()]), 0.5)
    return [torch.equal(got.to_local(), want)]


def test_random_ops_on_a_sub_mesh_keep_every_generator_in_step(world4):  # type: ignore[no-untyped-def]
    assert world4.run(_sub_mesh_draws) == [[True]] * 4
