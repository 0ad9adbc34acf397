"""A plain tensor a model fills in place with values that require grad becomes a DistTensor.

Mixtral's MoE block (transformers) does ``final = torch.zeros(...)`` and then, per expert,
``final.index_add_(0, token_idx, expert_out)``. With the experts' outputs DistTensors, the
first write went into the plain tensor below autograd and the second was refused ("cannot mix a
DistTensor with a plain tensor ... that requires grad"; found by the model zoo). Now the plain
tensor is made a Replicate DistTensor in place before the write (``keys.adopt_written_plain``),
and training equals one process. ``__setitem__`` is the same case.
"""

from __future__ import annotations


def _fill(rank: int, how: str) -> tuple[float, float, bool]:
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    w_full = torch.randn(3, 3)
    x = torch.randn(4, 3)
    idx = torch.tensor([2, 0])

    def run(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(4, 3)
        for k in range(2):  # two writes: the second once raised
            src = x[idx] @ w * (k + 1)
            if how == "index_add_":
                out.index_add_(0, idx, src)
            else:
                out[idx + k] = src
        return out, (out * out).sum()

    w = ap.shard_tensor(w_full.clone().requires_grad_(), mesh, [ap.Replicate()])
    w.retain_grad() if not w.is_leaf else None
    out, loss = run(w)
    loss.backward()
    ref_w = w_full.clone().requires_grad_()
    ref_out, ref_loss = run(ref_w)
    ref_loss.backward()
    return ((out.full_tensor() - ref_out).abs().max().item(),
            (w.grad.full_tensor() - ref_w.grad).abs().max().item(), isinstance(out, ap.DistTensor))


def test_a_plain_buffer_filled_in_place_trains(world2) -> None:  # type: ignore[no-untyped-def]
    for how in ("index_add_", "__setitem__"):
        for out_err, grad_err, dist in world2.run(_fill, how):
            assert dist, how
            assert out_err < 1e-6 and grad_err < 1e-5, (how, out_err, grad_err)


def _computed_with_grad(rank: int) -> tuple[float, float, float, str]:
    """T5's position bias under gradient checkpointing: a plain leaf that requires grad, plus a
    plain mask (a plain non-leaf that requires grad), added in place to DistTensor scores
    (``scores += bias``, a Python operator that turned the refusal into "unsupported operand")."""
    import torch

    import autoparallel as ap

    torch.manual_seed(0)
    mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
    x_full = torch.randn(4, 2, 3, 3)
    mask = torch.randn(1, 1, 3, 3)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias = torch.zeros(1, 2, 3, 3)
        bias.requires_grad = True
        scores = x * 2
        scores += bias + mask  # a plain non-leaf that requires grad
        return scores.softmax(-1).square().sum(), bias, scores

    x = ap.shard_tensor(x_full.clone(), mesh, [ap.Shard(0)]).requires_grad_()
    loss, bias, scores = run(x)
    loss.backward()
    ref_x = x_full.clone().requires_grad_()
    ref_loss, ref_bias, _ = run(ref_x)
    ref_loss.backward()
    assert bias.grad is not None and type(bias.grad) is torch.Tensor  # the plain leaf's own, full gradient
    return ((loss.full_tensor() - ref_loss).abs().item(), (bias.grad - ref_bias.grad).abs().max().item(),
            (x.grad.full_tensor() - ref_x.grad).abs().max().item(), str(scores.placements))


def test_a_plain_value_that_requires_grad_joins_as_replicate(world2) -> None:  # type: ignore[no-untyped-def]
    for loss_err, bias_err, x_err, placements in world2.run(_computed_with_grad):
        assert loss_err < 1e-6 and bias_err < 1e-6 and x_err < 1e-6, (loss_err, bias_err, x_err)
        assert placements == "(Shard(0),)", placements
