"""Hugging Face tokenizers (``tokenizer.json``) through the ``tokenizers`` library, which is what ``transformers``'
fast tokenizers run, so encode and decode give its ids and text.

The file is taken as it stands, except that padding and truncation baked into it are switched off (tformer pads its
own batches). Special tokens come from the file's post-processor: ``encode`` adds BERT's ``[CLS] ... [SEP]``, and
nothing for GPT-2 or SmolLM2, as ``transformers.AutoTokenizer`` does with ``add_special_tokens=True``. ``decode``
keeps special tokens unless asked (``transformers``' default too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tformer.interop.keys import InteropError

TOKENIZER_JSON = "tokenizer.json"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids generation needs (``bos_id``, ``eos_id``, ``pad_id``)."""

    kind = "hf"

    def __init__(self, hf: Any, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None):
        hf.no_padding()
        hf.no_truncation()
        self._hf = hf
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    @classmethod
    def from_file(cls, path: str | os.PathLike, **ids: int | None) -> HFTokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), **ids)
        except Exception as err:  # the library raises a bare Exception for malformed files
            raise InteropError(f"{path}: not a tokenizers file (tokenizer.json): {err}") from None

    @property
    def hf(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with the post-processor's special tokens (BERT's ``[CLS]``/``[SEP]``; none for GPT-2)
        unless ``add_special_tokens=False``: what ``transformers.AutoTokenizer.encode`` gives."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str | None:
        """The piece of id ``i`` as the vocabulary spells it (byte-level pieces show spaces as ``Ġ``)."""
        return self._hf.id_to_token(i)

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / TOKENIZER_JSON
        path.write_text(self._hf.to_str(), encoding="utf-8")
        return path

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "tformer-tokenizer",
            "version": 1,
            "kind": "hf",
            "hf": json.loads(self._hf.to_str()),
            "ids": {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id},
        }

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"
