"""Context parallelism: attention on a sequence-sharded layout, as a ring.

The SDPA rule (``spmd_rules.conv_attention``) offers a strategy with query, key and value
sharded alike on the sequence dim (``Shard(2)`` of ``[B, H, S, D]``, self-attention, equal
pieces) along one mesh axis. Its local step is not the op on the shards, since every query
reads every key (or every earlier one): this kernel computes it blockwise. Each member keeps
its queries; the key/value pieces travel around the axis line (``n - 1`` rotations, each one
all-to-all with one neighbour each way, so a captured program holds them), and the partial
results merge by their log-sum-exp. The backward does the same with the key/value gradients
travelling with their keys and coming home after one more rotation; it uses the saved output
and log-sum-exp, so no step of the forward is redone.

Load balance. Under a causal mask member ``r`` of contiguous pieces reads only pieces ``<= r``:
member 0 would compute one block, the last member ``n``. When the sequence divides into ``2n``
equal halves the kernel first moves to the balanced order (member ``r`` computes half-pieces
``r`` and ``2n - 1 - r``: one early, one late, the same work for every member at every step, as
Megatron and torch lay the sequence out) and moves the results back; those moves are ``O(S)``
bytes, the work they balance ``O(S^2)``. The layout the model sees stays plain ``Shard``, so
positions, masks and the loss need nothing.

Arithmetic: blocks in float32 (or the inputs' dtype when wider), the same formulas as the flash
kernel (``softmax(q k^T * scale) v``, grouped-query heads read their key/value head), so a result
agrees with the one-device op to rounding (fp32: ~1e-6 relative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoparallel.placement import Shard
from spmd_rules.base import LocalContext, bound_args
from spmd_rules.conv_attention import SDPA, SDPA_BACKWARD, sdpa_local
from spmd_rules.nn import compute_dtype

SEQ = 2  # the sequence dim of SDPA's [B, H, S, D] (and of its [B, H, S] log-sum-exp)


def sequence_axes(spec: Any) -> list[int]:
    """The mesh axes sharding the sequence dim of an SDPA operand's ``spec``."""
    return [a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim % len(spec.shape) == SEQ]


@dataclass(frozen=True)
class Ring:
    """One axis line of ``n`` members, this one at ``me``, holding contiguous pieces of a
    sequence of ``length``; ``balanced``: compute in the load-balanced order."""

    comm: Any  # the kernel's Collectives
    axis: int
    n: int
    me: int
    length: int
    balanced: bool

    def spans(self, member: int) -> list[tuple[int, int]]:
        """The global position ranges ``[start, end)`` of the rows ``member`` computes, in order."""
        if not self.balanced:
            piece = self.length // self.n
            return [(member * piece, (member + 1) * piece)]
        h = self.length // (2 * self.n)
        late = 2 * self.n - 1 - member
        return [(member * h, (member + 1) * h), (late * h, (late + 1) * h)]

    def positions(self, member: int, device: torch.device) -> torch.Tensor:
        """The global positions of the rows ``member`` computes."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans(member)])

    def reads(self, member: int, causal: bool) -> bool:
        """Whether this member's rows read any key of ``member``'s piece (from positions alone:
        every member decides alike, and a captured program holds no data-dependent branch)."""
        return not causal or min(a for a, _ in self.spans(member)) <= max(b - 1 for _, b in self.spans(self.me))

    def _balanced_holder(self, half: int) -> int:
        return half if half < self.n else 2 * self.n - 1 - half

    def to_balanced(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous pieces -> the balanced order (along the sequence dim)."""
        return self._move(xs, (2 * self.me, 2 * self.me + 1), self._balanced_holder,
                          (self.me, 2 * self.n - 1 - self.me), lambda half: half // 2)

    def to_contiguous(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The balanced order -> contiguous pieces."""
        return self._move(xs, (self.me, 2 * self.n - 1 - self.me), lambda half: half // 2,
                          (2 * self.me, 2 * self.me + 1), self._balanced_holder)

    def _move(self, xs: Sequence[torch.Tensor], held: tuple[int, int], goes_to: Any,
              wanted: tuple[int, int], comes_from: Any) -> list[torch.Tensor]:
        """Send each half-piece ``held`` here to ``goes_to(half)``; receive the ``wanted`` ones
        from ``comes_from(half)``. Both lists ascend, so pairs match in order."""
        def one_dtype(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            sends: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
            shapes: list[list[tuple[int, ...]]] = [[] for _ in range(self.n)]
            for x in ts:
                h = x.shape[SEQ] // 2
                for k, half in enumerate(held):
                    sends[goes_to(half)].append(x.narrow(SEQ, k * h, h))
                shape = list(x.shape)
                shape[SEQ] = h
                for half in wanted:
                    shapes[comes_from(half)].append(tuple(shape))
            got = [iter(g) for g in self.comm.exchange(self.axis, sends, shapes)]
            return [torch.cat([next(got[comes_from(half)]) for half in wanted], dim=SEQ) for _ in ts]

        return _per_dtype(xs, one_dtype)

    def rotate(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``xs`` to the next member, receive the previous member's (same shapes)."""
        nxt, prev = (self.me + 1) % self.n, (self.me - 1) % self.n

        def one_dtype(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            sends: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
            shapes: list[list[tuple[int, ...]]] = [[] for _ in range(self.n)]
            sends[nxt], shapes[prev] = ts, [tuple(t.shape) for t in ts]
            return self.comm.exchange(self.axis, sends, shapes)[prev]

        return _per_dtype(xs, one_dtype)

    def mask(self, rows: torch.Tensor, member: int, causal: bool) -> torch.Tensor | None:
        """Which keys of ``member``'s piece the ``rows`` read by position (None: all)."""
        if not causal:
            return None
        return self.positions(member, rows.device).unsqueeze(0) <= rows.unsqueeze(1)


def _per_dtype(xs: Sequence[torch.Tensor], move: Any) -> list[torch.Tensor]:
    """``move`` (one exchange of tensors of one dtype -> their counterparts, in order) applied
    to each dtype's tensors of ``xs``; the results in ``xs``'s order."""
    out: list[torch.Tensor] = list(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):
        idx = [i for i, x in enumerate(xs) if x.dtype == dtype]
        for i, t in zip(idx, move([xs[i] for i in idx])):
            out[i] = t
    return out


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that read them (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _per_kv_head(g: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient over query heads summed onto the key/value heads."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(2)


def _masked_scores(ring: Ring, q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor, member: int,
                   causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """``q k^T * scale`` of this member's rows against ``member``'s keys, masked: by position
    under ``causal``; by the columns of ``mask`` (4-d, this member's rows) that ``member``'s keys
    have (bool: False drops the pair; float: added)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = ring.mask(rows, member, causal)
    if mask is not None:
        block = mask if mask.shape[-1] == 1 else mask.index_select(-1, ring.positions(member, mask.device))
        if block.dtype == torch.bool:
            allowed = block if allowed is None else allowed & block
        else:
            s = s + block.to(s.dtype)
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _weights(lse: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``exp(lse - new)`` per row, 0 where both are -inf (a row no key reached yet)."""
    return torch.where(torch.isneginf(new), 0.0, torch.exp(lse - new)).unsqueeze(-1)


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of this member's queries, in its contiguous piece. ``mask``: the
    attention mask's rows of those queries (4-d, every key column; see ``sdpa_kernel``)."""
    if ring.balanced:
        q, k, v = ring.to_balanced([q, k, v])
    ct = compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qf = q.to(ct)
    rows = ring.positions(ring.me, q.device)
    out = qf.new_zeros(q.shape[:-1] + v.shape[-1:])
    lse = qf.new_full(q.shape[:-1], float("-inf"))
    kv = [k, v]
    for t in range(ring.n):
        if t:
            kv = ring.rotate(kv)
        member = (ring.me - t) % ring.n
        if mask is None and not ring.reads(member, causal):
            continue  # (every key of that piece comes later: nothing to compute)
        s = _masked_scores(ring, qf, _heads(kv[0], groups).to(ct), scale, rows, member, causal, mask)
        block_lse = torch.logsumexp(s, dim=-1)
        p = torch.nan_to_num(torch.exp(s - block_lse.unsqueeze(-1)), nan=0.0)  # (a row reading none of these keys: 0)
        block = torch.matmul(p, _heads(kv[1], groups).to(ct))
        new = torch.logaddexp(lse, block_lse)
        out = out * _weights(lse, new) + block * _weights(block_lse, new)
        lse = new
    out = out.to(q.dtype)
    if ring.balanced:
        out, lse = ring.to_contiguous([out, lse])
    return out, lse


def ring_backward(ring: Ring, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad query, grad key, grad value) of this member's contiguous piece."""
    dtype = q.dtype
    if ring.balanced:
        dout, q, k, v, out, lse = ring.to_balanced([dout, q, k, v, out, lse])
    ct = compute_dtype(dtype)
    groups = q.shape[1] // k.shape[1]
    qf, df, lf = q.to(ct), dout.to(ct), lse.to(ct)
    delta = (df * out.to(ct)).sum(-1, keepdim=True)  # rowsum(dO * O)
    rows = ring.positions(ring.me, q.device)
    dq = torch.zeros_like(qf)
    kv = [k, v, torch.zeros(k.shape, dtype=ct, device=k.device), torch.zeros(v.shape, dtype=ct, device=v.device)]
    for t in range(ring.n):
        if t:
            kv = ring.rotate(kv)
        member = (ring.me - t) % ring.n
        if mask is None and not ring.reads(member, causal):
            continue
        kf, vf = _heads(kv[0], groups).to(ct), _heads(kv[1], groups).to(ct)
        s = _masked_scores(ring, qf, kf, scale, rows, member, causal, mask)
        p = torch.nan_to_num(torch.exp(s - lf.unsqueeze(-1)), nan=0.0)
        kv[3] = kv[3] + _per_kv_head(torch.matmul(p.transpose(-1, -2), df), groups)
        ds = p * (torch.matmul(df, vf.transpose(-1, -2)) - delta)
        dq = dq + torch.matmul(ds, kf) * scale
        kv[2] = kv[2] + _per_kv_head(torch.matmul(ds.transpose(-1, -2), qf), groups) * scale
    dk, dv = ring.rotate(kv[2:])  # the key/value gradients go home
    grads = [dq.to(dtype), dk.to(dtype), dv.to(dtype)]
    if ring.balanced:
        grads = ring.to_contiguous(grads)
    return grads[0], grads[1], grads[2]


def sdpa_kernel(ctx: LocalContext, *args: Any, **kwargs: Any) -> Any:
    """SDPA's local step: the ring where the sequence is sharded, else the op on the shards."""
    op = ctx.call.op
    backward = op is SDPA_BACKWARD
    spec = ctx.in_specs[1 if backward else 0] if ctx.in_specs else None
    axes = sequence_axes(spec) if spec is not None else []
    if spec is None or not axes:
        return sdpa_local(ctx, *args, **kwargs)
    if len(axes) > 1:
        raise NotImplementedError(
            f"attention with its sequence sharded on {len(axes)} mesh axes at once: context "
            "parallelism runs on one axis (reshard the others)")
    axis = axes[0]
    assert ctx.coord is not None
    b = bound_args(op, args, kwargs)
    q = b["query"]
    n, length = spec.mesh.shape[axis], spec.shape[SEQ]
    causal = bool(b["is_causal"])
    mask = b.get("attn_mask")
    if mask is not None:  # its rows of this member's queries (the rule shards them alike), as 4-d
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    # balanced only where the skipped blocks are known from positions alone (a mask's are not)
    ring = Ring(ctx.comm, axis, n, ctx.coord[axis], length, causal and mask is None and length % (2 * n) == 0)
    scale = b.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if backward:
        return ring_backward(ring, b["grad_out"], q, b["key"], b["value"], b["out"], b["logsumexp"], causal, scale,
                             mask)
    out, lse = ring_forward(ring, q, b["key"], b["value"], causal, scale, mask)
    lse_meta = ctx.call.out[1]
    return out, lse if lse_meta is None else lse.to(lse_meta.dtype)


KERNELS = {SDPA: sdpa_kernel, SDPA_BACKWARD: sdpa_kernel}

__all__ = ["KERNELS", "Ring", "ring_backward", "ring_forward", "sdpa_kernel", "sequence_axes"]
