"""The built-in sequence-to-sequence tasks, generated on the fly.

Every built-in task maps a source sequence of symbols to a target sequence over one shared vocabulary: ``<pad>=0,
<bos>=1, <eos>=2`` (:data:`tformer.tokenizers.SEQ2SEQ_SPECIALS`), then the task's symbols (``alphabet``: symbol
``i`` is character ``alphabet[i]`` and id ``3 + i``). Sequences are drawn from a seeded generator, and a held-out set is
kept out of training so accuracy is measured on sequences the model never saw.

Tasks: ``reverse``, ``sort``, ``copy`` (sources of ``min_len..max_len`` symbols) and ``add`` (multi-digit
addition: ``"123+45" -> "168"``; operands of ``min_len..max_len`` digits, alphabet ``0123456789+``).

Shapes: B, T, S (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tformer.tokenizers import BOS_ID, EOS_ID, SEQ2SEQ_SPECIALS

if TYPE_CHECKING:  # torch is imported where examples are drawn: TrainConfig names the tasks without it
    import torch
    from torch import Tensor

SPECIALS = len(SEQ2SEQ_SPECIALS)  # the task's symbols start after <pad>, <bos>, <eos>


def _reverse(seq: list[int]) -> list[int]:
    return seq[::-1]


def _sort(seq: list[int]) -> list[int]:
    return sorted(seq)


def _copy(seq: list[int]) -> list[int]:
    return list(seq)


PLUS = SPECIALS + 10  # the id of "+" in the add task (after the digits 0..9)


def _add(seq: list[int]) -> list[int]:
    """Digits of ``a + b`` for the source ``digits(a) + [PLUS] + digits(b)``."""
    split = seq.index(PLUS)

    def number(digits: list[int]) -> int:
        return int("".join(str(d - SPECIALS) for d in digits))

    return [SPECIALS + int(c) for c in str(number(seq[:split]) + number(seq[split + 1 :]))]


TASKS: dict[str, Callable[[list[int]], list[int]]] = {
    "reverse": _reverse,
    "sort": _sort,
    "copy": _copy,
    "add": _add,
}
_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class SequenceTask:
    """A task over ``num_symbols`` symbols with source lengths in ``[min_len, max_len]``.

    For ``add``, ``min_len..max_len`` is the number of digits of each operand and ``num_symbols`` is ignored
    (the symbols are the ten digits and ``+``).
    """

    name: str = "reverse"
    num_symbols: int = 10
    min_len: int = 1
    max_len: int = 16

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; choose one of {sorted(TASKS)}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"the {self.name} task's lengths need 1 <= min_len <= max_len (--task-min-len <= --task-max-len); "
                f"got min_len={self.min_len}, max_len={self.max_len}"
            )
        if not 1 <= self.num_symbols <= len(_SYMBOLS):
            raise ValueError(f"num_symbols must be in [1, {len(_SYMBOLS)}]; got {self.num_symbols}")

    @property
    def vocab_size(self) -> int:
        return SPECIALS + len(self.alphabet)

    @property
    def alphabet(self) -> str:
        """The characters of the symbols: symbol id ``SPECIALS + i`` is ``alphabet[i]``."""
        return "0123456789+" if self.name == "add" else _SYMBOLS[: self.num_symbols]

    @property
    def max_source_len(self) -> int:
        return 2 * self.max_len + 1 if self.name == "add" else self.max_len

    @property
    def max_target_len(self) -> int:
        return self.max_len + 3 if self.name == "add" else self.max_len + 2  # BOS ... EOS (a sum may carry)

    def sample_source(self, gen: torch.Generator) -> tuple[int, ...]:
        import torch

        if self.name == "add":
            a, b = (self._sample_number(gen) for _ in range(2))
            return (*a, PLUS, *b)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=gen))
        return tuple((torch.randint(0, self.num_symbols, (length,), generator=gen) + SPECIALS).tolist())

    def _sample_number(self, gen: torch.Generator) -> list[int]:
        """Digit ids of a number with ``min_len..max_len`` digits (no leading zero unless it is 0)."""
        import torch

        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=gen))
        low = 0 if length == 1 else 10 ** (length - 1)
        value = low + int(torch.randint(0, 10**length - low, (1,), generator=gen))
        return [SPECIALS + int(c) for c in str(value)]

    def sources_of_length(self, length: int) -> int:
        """How many distinct sources have ``length`` symbols (``add``: operands without leading zeros)."""
        if self.name != "add":
            return self.num_symbols**length if self.min_len <= length <= self.max_len else 0

        def numbers(digits: int) -> int:
            return 0 if not self.min_len <= digits <= self.max_len else 10 if digits == 1 else 9 * 10 ** (digits - 1)

        return sum(numbers(a) * numbers(length - 1 - a) for a in range(1, length - 1))

    def can_withhold(self, source: tuple[int, ...], min_sources: int = 1000) -> bool:
        """Whether a held-out ``source`` may be kept out of training: only if its length has at least
        ``min_sources`` sources. (All 10 sources of length 1 would otherwise be withheld, and the model would
        never see that length.)"""
        return self.sources_of_length(len(source)) >= min_sources

    def to_text(self, ids: list[int] | tuple[int, ...]) -> str:
        """Symbol ids -> their characters (special ids are dropped)."""
        return "".join(self.alphabet[i - SPECIALS] for i in ids if SPECIALS <= i < self.vocab_size)

    def from_text(self, text: str) -> tuple[int, ...]:
        """Characters -> symbol ids; ``ValueError`` naming a character outside the alphabet."""
        ids = []
        for c in text:
            if c not in self.alphabet:
                raise ValueError(f"{c!r} is not a symbol of the {self.name} task; its alphabet is {self.alphabet!r}")
            ids.append(SPECIALS + self.alphabet.index(c))
        return tuple(ids)

    def target(self, source: tuple[int, ...]) -> list[int]:
        return TASKS[self.name](list(source))

    def held_out(self, count: int, seed: int = 1234) -> list[tuple[int, ...]]:
        import torch

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
        from tformer.models import pad_right

        targets = [[BOS_ID, *self.target(s), EOS_ID] for s in sources]
        src, src_mask = pad_right(sources)
        tgt, tgt_mask = pad_right(targets)
        return src, src_mask, tgt, tgt_mask
