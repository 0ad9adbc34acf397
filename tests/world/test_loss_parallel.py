"""Cross-entropy over class-split logits ("loss parallel") on 4 ranks: the backward needs no
collective of its own.

The NLL loss's backward knows each row's gradient sum over all classes from the replicated
targets and notes it on its shard (``autoparallel.known_sums``); log-softmax's backward takes it
instead of all-reducing its pieces' sums. Checked, with class weights, an ignored target and 10
classes on 4 ranks (uneven): the forward's one collective (each piece's row max and row sum of
exponentials, gathered), none
in the backward, the input gradient bit for bit the all-reduce path's (a hook writing the
gradient in place with ``add_(0)`` between the two backwards makes the note stale and brings
the all-reduce back) and equal to one process; a hook that really changes the gradient in
place gives one process's result.
"""

from __future__ import annotations

from typing import Any

import pytest


def _ce(rank: int, reduction: str, hook: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import autoparallel as ap

    mesh = ap.ProcessMesh([0, 1, 2, 3], ["tp"])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g, dtype=torch.float64)
    target = torch.tensor([0, 9, 3, -100, 5, 7])
    weight = torch.rand(10, generator=g, dtype=torch.float64) + 0.5

    def loss_of(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(x, dim=1)
        if hook == "noop":
            logp.register_hook(lambda grad: grad.add_(0))
        elif hook == "triple":
            logp.register_hook(lambda grad: grad.mul_(3))
        return F.nll_loss(logp, t, weight=w, reduction=reduction)

    ref_x = logits.clone().requires_grad_()
    ref_loss = loss_of(ref_x, target, weight)
    ref_loss.backward()

    x = ap.shard_tensor(logits, mesh, [ap.Shard(1)]).requires_grad_()
    t, w = ap.shard_tensor(target, mesh, [ap.Replicate()]), ap.shard_tensor(weight, mesh, [ap.Replicate()])
    with ap.CommDebugMode() as fwd:
        loss = loss_of(x, t, w)
    with ap.CommDebugMode() as bwd:
        loss.backward()
    return {"forward": fwd.get_comm_counts(), "backward": bwd.get_comm_counts(), "grad": x.grad.full_tensor(),
            "ref_grad": ref_x.grad, "loss": loss.detach().full_tensor(), "ref_loss": ref_loss.detach()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_split_cross_entropy_backward_issues_no_collective(world4: Any, reduction: str) -> None:
    import torch

    for known, reduced in zip(world4.run(_ce, reduction, "none"), world4.run(_ce, reduction, "noop")):
        # each piece's (row max, row sum of exponentials), gathered in one collective
        assert known["forward"] == reduced["forward"] == {"all_gather": 1}
        assert known["backward"] == {} and reduced["backward"] == {"all_reduce": 1}
        assert torch.equal(known["grad"], reduced["grad"])
        torch.testing.assert_close(known["grad"], known["ref_grad"], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(known["loss"], known["ref_loss"], rtol=1e-12, atol=0)


def test_a_gradient_written_in_place_between_the_two_backwards_is_read_as_written(world4: Any) -> None:
    import torch

    for res in world4.run(_ce, "mean", "triple"):
        assert res["backward"] == {"all_reduce": 1}
        torch.testing.assert_close(res["grad"], res["ref_grad"], rtol=1e-12, atol=1e-15)
