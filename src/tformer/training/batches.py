"""Batches of a training run: random windows of a token stream (language models) and source/target pairs
(sequence-to-sequence), each batch a pure function of ``(seed, index)``.

Every batch is a pure function of ``(seed, index)``: ``LMBatches`` draws window offsets from
``np.random.default_rng([seed, index])``, ``Seq2SeqBatches`` draws examples likewise. The sampler's state is
therefore just the next index -- saved in checkpoints, so ``--resume`` sees exactly the batches an
uninterrupted run would. A global batch is drawn whole on every process and each rank takes its own rows,
so data-parallel training sees the same examples as one process with the same global batch.

Shapes: B, T (a window of block_size tokens), S (a source) (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tformer.models import pad_right
from tformer.training.tasks import SequenceTask


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------
@dataclass
class LMBatch:
    """A global batch of windows: ``x = tokens[o : o+T]`` and ``y = tokens[o+1 : o+T+1]`` for each offset."""

    tokens: np.ndarray
    offsets: np.ndarray  # (B,)
    block_size: int

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def num_tokens(self) -> int:
        """Target tokens in the whole global batch (the loss denominator)."""
        return len(self.offsets) * self.block_size

    def rows(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """``x, y (stop-start, T)`` int64 for rows ``start:stop``."""
        index = self.offsets[start:stop, None] + np.arange(self.block_size + 1)  # (b, T+1)
        window = torch.from_numpy(self.tokens[index].astype(np.int64))  # (b, T+1)
        return window[:, :-1], window[:, 1:]


class LMBatches:
    """Random windows of ``block_size + 1`` tokens; batch ``index`` depends only on ``(seed, index)``."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int) -> None:
        if len(tokens) < block_size + 2:
            raise ValueError(
                f"a split of {len(tokens)} tokens is too short for windows of block_size={block_size} "
                "(+1 for the shifted targets); use a smaller --block-size, more data, or (for a small validation "
                "split) a larger --val-fraction"
            )
        self.tokens, self.block_size, self.batch_size, self.seed = tokens, block_size, batch_size, seed

    def get(self, index: int) -> LMBatch:
        rng = np.random.default_rng([self.seed, index])
        offsets = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)  # (B,)
        return LMBatch(self.tokens, offsets, self.block_size)

    def evaluation(self, num_batches: int) -> list[LMBatch]:
        """Fixed windows spread evenly over the split: the same validation set at every evaluation."""
        count = num_batches * self.batch_size
        offsets = np.linspace(0, len(self.tokens) - self.block_size - 1, count).astype(np.int64)
        return [
            LMBatch(self.tokens, offsets[i : i + self.batch_size], self.block_size)
            for i in range(0, count, self.batch_size)
        ]


@dataclass
class Seq2SeqBatch:
    """A global batch of (source ids, target ids) pairs; targets without BOS/EOS."""

    pairs: list[tuple[Sequence[int], Sequence[int]]]
    bos_id: int
    eos_id: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def num_tokens(self) -> int:
        """Predicted target tokens (each target plus its EOS) in the global batch."""
        return sum(len(t) + 1 for _, t in self.pairs)

    def rows(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``src, src_mask (b, S)``; ``tgt_in = BOS y``, ``tgt_out = y EOS``, ``tgt_mask (b, T)``; right-padded."""
        chunk = self.pairs[start:stop]
        src, src_mask = pad_right([list(s) for s, _ in chunk], self.pad_id)
        tgt_in, tgt_mask = pad_right([[self.bos_id, *t] for _, t in chunk], self.pad_id)  # teacher forcing input
        tgt_out, _ = pad_right([[*t, self.eos_id] for _, t in chunk], self.pad_id)  # the next token at each position
        return src, src_mask, tgt_in, tgt_out, tgt_mask


class Seq2SeqBatches:
    """Batches of a built-in task (generated) or of encoded pairs (sampled with replacement)."""

    def __init__(
        self,
        batch_size: int,
        seed: int,
        *,
        task: SequenceTask | None = None,
        exclude: set[tuple[int, ...]] | None = None,
        pairs: list[tuple[list[int], list[int]]] | None = None,
        bos_id: int = 1,
        eos_id: int = 2,
        pad_id: int = 0,
    ) -> None:
        if (task is None) == (pairs is None):
            raise ValueError("give exactly one of task and pairs")
        if pairs is not None and not pairs:
            raise ValueError("no training pairs")
        self.batch_size, self.seed, self.task, self.exclude, self.pairs = batch_size, seed, task, exclude, pairs
        self.ids = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)

    def get(self, index: int) -> Seq2SeqBatch:
        if self.task is not None:
            gen = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, index]).integers(2**62)))
            sources = []
            while len(sources) < self.batch_size:
                src = self.task.sample_source(gen)
                if self.exclude is None or src not in self.exclude:
                    sources.append(src)
            return Seq2SeqBatch([(s, self.task.target(s)) for s in sources], **self.ids)
        rng = np.random.default_rng([self.seed, index])
        picks = rng.integers(0, len(self.pairs), size=self.batch_size)
        return Seq2SeqBatch([self.pairs[i] for i in picks], **self.ids)


def evaluation_batches(
    pairs: list[tuple[Sequence[int], Sequence[int]]], batch_size: int, bos_id: int, eos_id: int, pad_id: int
) -> list[Seq2SeqBatch]:
    """A held-out set cut into batches, in order."""
    return [Seq2SeqBatch(pairs[i : i + batch_size], bos_id, eos_id, pad_id) for i in range(0, len(pairs), batch_size)]
