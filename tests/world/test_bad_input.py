"""Bad input raises the same clear error on every rank before any collective; the world survives."""

from __future__ import annotations

import pytest
import torch

import autoparallel as ap
from autoparallel import Partial, Replicate, Shard

R = Replicate()


def _healthy(rank: int) -> bool:
    mesh = ap.ProcessMesh([0, 1, 2, 3])
    x = ap.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    return bool(torch.equal(x.full_tensor(), torch.arange(8.0)))


def _shard_out_of_range(rank: int) -> None:
    ap.shard_tensor(torch.ones(4, 6), ap.ProcessMesh([0, 1, 2, 3]), [Shard(3)])


def _placements_count(rank: int) -> None:  # (a shorter list is padded with Replicate: Paddle's rule)
    ap.shard_tensor(torch.ones(4, 6), ap.ProcessMesh([[0, 1], [2, 3]]), [Shard(0), Shard(1), Shard(0)])


def _duplicate_ranks(rank: int) -> None:
    ap.ProcessMesh([[0, 1], [1, 3]])


def _negative_rank(rank: int) -> None:
    ap.ProcessMesh([0, -1])


def _rank_too_large(rank: int) -> None:
    ap.ProcessMesh([0, 1, 2, 7])


def _ragged(rank: int) -> None:
    ap.ProcessMesh([[0, 1], [2]])


def _unknown_dim_name(rank: int) -> None:
    ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]).get_dim_size("pp")


def _bad_reduce_type(rank: int) -> None:
    ap.Partial("prod")


def _from_local_inconsistent(rank: int) -> None:
    ap.dtensor_from_local(torch.ones(3, 4), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)], shape=(8, 4))


def _mixed_meshes(rank: int) -> None:
    a = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)])
    b = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([[0, 1], [2, 3]]), [R, R])
    a + b


# A plain tensor mixed with DistTensors is Replicate on their mesh (docs/plain_tensors.md),
# unless it requires grad or the op writes it while ranks lie outside the mesh, or the
# DistTensors live on several meshes.
def _mixed_plain_requires_grad(rank: int) -> None:
    # (on a whole-world mesh a plain leaf is laid out in place and a computed one joins as a
    # differentiable Replicate: tests/world/test_plain_written.py; ranks 2 and 3 lie outside this one)
    a = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1]), [Shard(0)])
    with pytest.raises(TypeError):  # Python operators replace the message with their own
        a + torch.ones(4, requires_grad=True) * 2
    torch.add(a, torch.ones(4, requires_grad=True) * 2)


def _mixed_plain_written(rank: int) -> None:
    a = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1]), [Shard(0)])
    torch.ones(4).add_(a)  # ranks 2 and 3 would not write it


def _mixed_plain_two_meshes(rank: int) -> None:
    a = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)])
    b = ap.shard_tensor(torch.ones(4), ap.ProcessMesh([[0, 1], [2, 3]]), [R, R])
    torch.where(a > 0, b, torch.zeros(4))


def _plain_is_replicate(rank: int) -> bool:
    mesh = ap.ProcessMesh([0, 1, 2, 3])
    a = ap.shard_tensor(torch.arange(8.0), mesh, [Shard(0)])
    idx = torch.tensor([7, 0, 3])
    picked = a[idx]  # index tensors are plain in user code
    summed = a + torch.arange(8.0)
    buf = torch.zeros(8)
    buf.add_(a)  # the mesh spans the world: every rank's plain tensor gets the full value
    return (picked.placements[0] == R and torch.equal(picked.full_tensor(), torch.tensor([7.0, 0.0, 3.0]))
            and torch.equal(summed.full_tensor(), 2 * torch.arange(8.0)) and torch.equal(buf, torch.arange(8.0)))


def _bad_placement_type(rank: int) -> None:
    ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1, 2, 3]), [0])


def _placement_as_text(rank: int) -> None:  # a str element makes a dims mapping: "S(0)" is no mesh axis
    ap.shard_tensor(torch.ones(4), ap.ProcessMesh([0, 1, 2, 3]), ["S(0)"])


def _bad_mesh_type(rank: int) -> None:
    ap.shard_tensor(torch.ones(4), [0, 1, 2, 3], [Shard(0)])  # type: ignore[arg-type]


def _mixed_partial_kinds(rank: int) -> None:
    ap.shard_tensor(torch.ones(4), ap.ProcessMesh([[0, 1], [2, 3]]), [Partial("max"), Partial("sum")])


def _to_local_bad_grad_placements(rank: int) -> None:
    x = ap.shard_tensor(torch.ones(4, 6), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)]).requires_grad_()
    x.to_local(grad_placements=[Shard(2)])  # differentiable: checked by the autograd node


def _to_local_bad_grad_placements_no_grad(rank: int) -> None:
    x = ap.shard_tensor(torch.ones(4, 6), ap.ProcessMesh([0, 1, 2, 3]), [Shard(0)])
    with torch.no_grad():
        x.to_local(grad_placements=[Shard(2)])  # nothing to differentiate: the same check


CASES = [
    (_shard_out_of_range, ValueError, "tensor dim 3 does not exist"),
    (_placements_count, ValueError, "give one placement per mesh axis"),
    (_duplicate_ranks, ValueError, "appear more than once"),
    (_negative_rank, ValueError, "negative rank"),
    (_rank_too_large, ValueError, "not in the world of size 4"),
    (_ragged, ValueError, "ragged"),
    (_unknown_dim_name, ValueError, "'pp' is unknown"),
    (_bad_reduce_type, ValueError, "reduce type 'prod' is unknown"),
    (_from_local_inconsistent, ValueError, "should hold (2, 4)"),
    (_mixed_meshes, ValueError, "different meshes"),
    (_mixed_plain_requires_grad, TypeError, "plain tensor of shape (4,) that requires grad"),
    (_mixed_plain_written, TypeError, "the ranks outside mesh"),
    (_mixed_plain_two_meshes, TypeError, "no mesh to be replicated on"),
    (_bad_placement_type, TypeError, "is not a Replicate"),
    (_placement_as_text, ValueError, "names mesh axis 'S(0)', which mesh ProcessMesh([0, 1, 2, 3], dim_names=['d0']) lacks"),
    (_bad_mesh_type, TypeError, "must be an ap.ProcessMesh"),
    (_mixed_partial_kinds, ValueError, "do not commute"),
    (_to_local_bad_grad_placements, ValueError, "tensor dim 2 does not exist"),
    (_to_local_bad_grad_placements_no_grad, ValueError, "tensor dim 2 does not exist"),
]


@pytest.mark.parametrize("fn,exc,text", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_bad_input_raises_on_every_rank(world4, fn, exc, text):  # type: ignore[no-untyped-def]
    with pytest.raises(exc) as info:
        world4.run(fn, timeout=60)
    # the harness re-raises the same type only when every rank raised it
    assert text in str(info.value)
    assert all(world4.run(_healthy))


def test_plain_tensor_without_grad_is_replicate(world4):  # type: ignore[no-untyped-def]
    assert all(world4.run(_plain_is_replicate))
