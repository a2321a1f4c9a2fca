"""Stop conditions of generation: an end-of-sequence id, stop sequences of token ids, and stop strings.

:class:`Stopper` decides when a row's generated tokens end it, and which of them may already be shown while
a stop might still be forming (streaming holds those back). Used by :func:`tformer.generation.sampling.generate`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor


class TextDecoder(Protocol):
    """What stop strings need of a tokenizer (any :class:`tformer.tokenizers.Tokenizer` has it)."""

    def decode(self, ids: list[int]) -> str: ...


def token_id(value: object, what: str) -> int:
    """``value`` as a token id: an integer (Python's, NumPy's, or a one-value integer tensor), never a float, a bool
    or a string, which ``int()`` would turn into some other id without a word; ``what`` names it in the error."""
    if isinstance(value, Tensor):
        if value.numel() == 1 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            return int(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"{what} holds {value!r}, which is not a token id: ids are integers (not floats or bools)")


def eos_ids(eos_id: int | Sequence[int] | None) -> frozenset[int]:
    """The end-of-sequence ids of ``eos_id``: none, one, or several (models such as Llama 3 end at any of a list)."""
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, Tensor):
        eos_id = eos_id.reshape(-1).tolist()  # one id or several (floats and bools stay refused below)
    if isinstance(eos_id, numbers.Integral):
        return frozenset([token_id(eos_id, "eos_id")])
    if isinstance(eos_id, (str, bytes)) or not isinstance(eos_id, Iterable):
        raise ValueError(f"eos_id must be a token id or a list of them; got {eos_id!r}")
    return frozenset(token_id(e, "eos_id") for e in eos_id)


class Stopper:
    """When a row's generated tokens end generation, and which of them may already be shown.

    A row ends at ``eos_id`` (one id, or several: any of them ends it), at a stop sequence of token ids, or when
    its generated text contains a stop string (text stops need a tokenizer; only the generated text is searched,
    not the prompt). The EOS and the stop sequence/string are not part of the output. A stop string is cut on
    token boundaries: the kept tokens are the longest prefix whose text ends before the stop string, so with
    multi-character tokens the text of a token that straddles the stop string's start is lost with it.
    """

    def __init__(
        self,
        stop: str | Sequence[str | Sequence[int]] | None,
        eos_id: int | Sequence[int] | None,
        tokenizer: TextDecoder | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """``stop``: stop strings and stop sequences of token ids (a lone string is one stop string);
        ``vocab_size``: if given, every EOS and stop id must lie in ``[0, vocab_size)`` (one that cannot occur would
        never stop anything)."""
        self.eos_ids = eos_ids(eos_id)
        self.id_stops: list[list[int]] = []
        self.text_stops: list[str] = []
        for item in [stop] if isinstance(stop, str) else stop or ():
            if isinstance(item, str):
                if not callable(getattr(tokenizer, "decode", None)):
                    raise ValueError(f"the stop string {item!r} needs a tokenizer: pass the model's (tokenizer=...)")
                if not item:
                    raise ValueError("a stop string (--stop) must not be empty")
                self.text_stops.append(item)
            elif isinstance(item, (Sequence, Tensor)):
                ids = [token_id(t, "a stop sequence") for t in item]
                if not ids:
                    raise ValueError("a stop sequence of token ids must not be empty")
                self.id_stops.append(ids)
            else:
                raise ValueError(
                    f"stop holds {item!r}; each stop is a string or a list of token ids (one id: stop=[[{item!r}]])"
                )
        for e in sorted(self.eos_ids.union(*self.id_stops)) if vocab_size is not None else ():
            if not 0 <= e < vocab_size:
                what = "eos_id" if e in self.eos_ids else "a stop sequence's id"
                raise ValueError(f"{what} {e} is outside the vocabulary [0, {vocab_size})")
        self.tokenizer = tokenizer

    @property
    def active(self) -> bool:
        return bool(self.eos_ids) or bool(self.id_stops or self.text_stops)

    def _within(self, tokens: list[int], chars: int) -> int:
        """The longest prefix of ``tokens`` whose text is at most ``chars`` characters long."""
        n = len(tokens)
        while n and len(self.tokenizer.decode(tokens[:n])) > chars:
            n -= 1
        return n

    def end(self, tokens: list[int]) -> int | None:
        """``None`` while generation goes on; else how many of ``tokens`` the output keeps."""
        if tokens[-1] in self.eos_ids:
            return len(tokens) - 1
        for seq in self.id_stops:
            if tokens[-len(seq) :] == seq:
                return len(tokens) - len(seq)
        if self.text_stops:
            text = self.tokenizer.decode(tokens)
            hits = [text.find(s) for s in self.text_stops if s in text]
            if hits:
                return self._within(tokens, min(hits))
        return None

    def settled(self, tokens: list[int]) -> int:
        """How many leading tokens no stop sequence or string can still claim (the rest are held back)."""
        n = len(tokens)
        for seq in self.id_stops:  # hold back a suffix that is a proper prefix of a stop sequence
            for k in range(min(len(seq) - 1, n), 0, -1):
                if tokens[n - k :] == seq[:k]:
                    n = min(n, len(tokens) - k)
                    break
        if self.text_stops and n:
            text = self.tokenizer.decode(tokens[:n])
            hold = max((k for s in self.text_stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            if hold:
                n = self._within(tokens[:n], len(text) - hold)
        return n
