"""Built-in sequence-to-sequence tasks, generated on the fly (no data files).

Every task maps a source sequence of symbols to a target sequence over one shared vocabulary:
``PAD=0, BOS=1, EOS=2`` then the task's symbols. Sequences are drawn from a seeded generator, and a
held-out set is kept out of training so accuracy is measured on sequences the model never saw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, EOS = 0, 1, 2
SPECIALS = 3


def _reverse(seq: list[int]) -> list[int]:
    return seq[::-1]


def _sort(seq: list[int]) -> list[int]:
    return sorted(seq)


def _copy(seq: list[int]) -> list[int]:
    return list(seq)


TASKS: dict[str, Callable[[list[int]], list[int]]] = {"reverse": _reverse, "sort": _sort, "copy": _copy}


@dataclass(frozen=True)
class SequenceTask:
    """A task over ``num_symbols`` symbols with source lengths in ``[min_len, max_len]``."""

    name: str = "reverse"
    num_symbols: int = 10
    min_len: int = 1
    max_len: int = 16

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; choose one of {sorted(TASKS)}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len; got min_len={self.min_len}, max_len={self.max_len}"
            )
        if self.num_symbols < 1:
            raise ValueError(f"num_symbols must be >= 1; got {self.num_symbols}")

    @property
    def vocab_size(self) -> int:
        return SPECIALS + self.num_symbols

    @property
    def max_target_len(self) -> int:
        return self.max_len + 2  # BOS ... EOS

    def sample_source(self, gen: torch.Generator) -> tuple[int, ...]:
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=gen))
        return tuple((torch.randint(0, self.num_symbols, (length,), generator=gen) + SPECIALS).tolist())

    def target(self, source: tuple[int, ...]) -> list[int]:
        return TASKS[self.name](list(source))

    def held_out(self, count: int, seed: int = 1234) -> list[tuple[int, ...]]:
        gen = torch.Generator().manual_seed(seed)
        return [self.sample_source(gen) for _ in range(count)]

    def batch(
        self, batch_size: int, gen: torch.Generator, exclude: set[tuple[int, ...]] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``src (B, S)``, ``src_mask``, ``tgt (B, T)`` = BOS + target + EOS, ``tgt_mask``; right-padded."""
        sources = []
        while len(sources) < batch_size:
            src = self.sample_source(gen)
            if exclude is None or src not in exclude:
                sources.append(src)
        return self.collate(sources)

    def collate(self, sources: list[tuple[int, ...]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        targets = [[BOS, *self.target(s), EOS] for s in sources]
        src, src_mask = pad(sources)
        tgt, tgt_mask = pad(targets)
        return src, src_mask, tgt, tgt_mask


def pad(seqs: list) -> tuple[Tensor, Tensor]:
    """Right-pad integer sequences with PAD: ids ``(B, T)`` and mask ``(B, T)`` (True = real token)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    return ids, torch.arange(length)[None, :] < lengths[:, None]
