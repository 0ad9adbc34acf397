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
