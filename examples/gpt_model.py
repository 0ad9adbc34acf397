"""A small GPT written for one device: the main job's model, also imported by tests and benchmarks.

    model = GPT(GPTConfig(vocab=80, seq=64, layers=2, width=64, heads=4))
    logits = model(idx)                       # idx (B, T) int64 -> logits (B, T, vocab)
    loss = lm_loss(logits, targets)

Nothing here knows about parallelism. Two choices keep it easy to shard by annotation:
* the fused ``qkv`` projection is laid out head-major — output feature ``h*3*D + j*D + d`` is
  (head ``h``, q/k/v ``j``, channel ``d``) — so splitting its output features evenly across
  ranks splits whole heads, and attention runs on local heads without communication;
* the number of heads is read from the activation (``view(B, T, -1, 3*D)``), so the same code
  runs on global DistTensors and on per-rank local tensors holding a subset of the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; ``width`` must be a multiple of ``heads``."""

    vocab: int
    seq: int = 64
    layers: int = 2
    width: int = 64
    heads: int = 4
    mlp_ratio: int = 4
    tied: bool = True
    dropout: float = 0.0        # Megatron's three dropouts: attention probabilities, after each projection
    attention: str = "sdpa"     # "sdpa": one fused op; "math": QK^T, softmax, dropout, AV as separate ops

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"GPTConfig: width {self.width} is not a multiple of heads {self.heads}")
        for name in ("vocab", "seq", "layers", "width", "heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"GPTConfig: attention must be 'sdpa' or 'math', got {self.attention!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused head-major qkv Linear, SDPA, output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.dropout, self.math = cfg.dropout, cfg.attention == "math"
        # No qkv bias: the key bias only adds q.b_k to every score of a row, which softmax
        # ignores, so its gradient is pure roundoff that Adam would turn into lr-sized steps.
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        d = self.head_dim
        qkv = self.qkv(x).view(b, t, -1, 3 * d)                       # (B, T, H, 3D), head-major
        q, k, v = (z.transpose(1, 2) for z in qkv.split(d, dim=-1))   # each (B, H, T, D)
        y = self.core(q, k, v)                                        # (B, H, T, D)
        return _dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)), self.dropout, self.training)  # (B, T, W)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: softmax(QK^T / sqrt(D) + causal mask), dropout, times V."""
        if not self.math:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[2]
        # heads first: matmul folds the two leading dims into one batch dim, and a fold whose
        # outer dim is the head dim (split under TP) stays split; (B, H) would be gathered
        q, k, v = (z.transpose(0, 1) for z in (q, k, v))                                  # (H, B, T, D)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))          # (H, B, T, T)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = _dropout(scores.masked_fill(causal, float("-inf")).softmax(-1), self.dropout, self.training)
        return (probs @ v).transpose(0, 1)                                               # (B, H, T, D)


class MLP(nn.Module):
    """Linear (W -> ratio*W), GELU, Linear (ratio*W -> W)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.proj(self.act(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final LayerNorm, LM head (tied or not)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.apply(_init_weights)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        _check_length(t, self.cfg.seq)
        x = self.tok(idx) + self.pos.weight[:t]                        # (B, T, W)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                 # (B, T, V)


@torch.fx.wrap
def _check_length(t: int, seq: int) -> None:
    """The sequence fits the position table (a call of its own: ``torch.fx`` records it, so the
    forward traces, as cutting the model into pipeline stages needs)."""
    if t > seq:
        raise ValueError(f"GPT: sequence length {t} exceeds the model's seq {seq}")


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that issues no op at all when ``p`` is 0 (the default model draws nothing)."""
    return F.dropout(x, p, training) if p > 0 else x


def _init_weights(m: nn.Module) -> None:
    """GPT-2 style: normal(0, 0.02) weights, zero biases, LayerNorm (1, 0)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
