"""The GPT example's data: the shipped corpus, a character tokenizer, windows and a resumable sampler.

    text = load_corpus()                      # examples/data/corpus.txt (no download)
    tok = CharTokenizer(text, multiple_of=8)  # vocabulary padded so TP degrees divide it
    ids = tok.encode(text)                    # int64 tensor, one id per character
    data = TokenWindows(ids, seq=64)          # sample i = (ids[i*64 : i*64+64], the next chars)
    sampler = ResumableSampler(len(data), seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)

The sampler draws a fresh permutation of the windows every epoch and never ends; where it is
(epoch, index within the epoch) is explicit state (``state_dict`` / ``load_state_dict``), so a
training run can save and restore its data position exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Sampler

DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


def load_corpus(path: str = DEFAULT_CORPUS) -> str:
    """The corpus as one string (UTF-8); ``FileNotFoundError`` names the path if it is missing."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text:
        raise ValueError(f"corpus {path!r} is empty")
    return text


class CharTokenizer:
    """Character-level tokenizer: one id per distinct character, ids in sorted character order.

    ``vocab_size`` is the number of characters rounded up to ``multiple_of`` (the padding ids
    never occur in the data; they let a vocabulary-parallel embedding split evenly).
    """

    def __init__(self, text: str, multiple_of: int = 1) -> None:
        if multiple_of < 1:
            raise ValueError(f"CharTokenizer: multiple_of must be >= 1, got {multiple_of}")
        self.chars = sorted(set(text))
        self.ids = {c: i for i, c in enumerate(self.chars)}
        n = len(self.chars)
        self.vocab_size = -(-n // multiple_of) * multiple_of

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as an int64 tensor; a character outside the vocabulary raises KeyError."""
        try:
            return torch.tensor([self.ids[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise KeyError(f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of ``ids`` (padding ids decode to the empty string)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in values if i < len(self.chars))


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows: sample ``i`` is ``(ids[i*seq : (i+1)*seq], ids[i*seq+1 : (i+1)*seq+1])``."""

    def __init__(self, ids: torch.Tensor, seq: int) -> None:
        if ids.dim() != 1:
            raise ValueError(f"TokenWindows: ids must be 1-d, got shape {tuple(ids.shape)}")
        if seq < 1 or ids.numel() < seq + 1:
            raise ValueError(f"TokenWindows: need seq >= 1 and more than seq tokens, got seq={seq}, {ids.numel()} tokens")
        self.ids, self.seq = ids, seq
        self.count = (ids.numel() - 1) // seq

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(f"TokenWindows: index {i} out of range for {self.count} windows")
        lo = i * self.seq
        return self.ids[lo:lo + self.seq], self.ids[lo + 1:lo + self.seq + 1]


class ResumableSampler(Sampler[int]):
    """Endless shuffled indices: epoch ``e`` is ``randperm(n)`` seeded with ``seed + e``.

    State is ``(epoch, index)``: the next index handed out is ``perm(epoch)[index]``. A
    ``DataLoader`` without workers pulls indices lazily, so after ``k`` batches of ``b`` samples
    the sampler has handed out exactly ``k * b`` indices.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"ResumableSampler: need at least one sample, got n={n}")
        self.n, self.seed = n, seed
        self.epoch, self.index = 0, 0

    def _perm(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[int]:
        while True:
            perm = self._perm(self.epoch)
            while self.index < self.n:
                i = int(perm[self.index])
                self.index += 1
                yield i
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: ``{"epoch", "index", "seed", "n"}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; a state from a different dataset size or seed raises ValueError."""
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ValueError(f"ResumableSampler: state for n={state['n']}, seed={state['seed']} "
                             f"does not fit n={self.n}, seed={self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
