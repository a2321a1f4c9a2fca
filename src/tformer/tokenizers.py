"""Tokenizers: text <-> integer ids, saved to and loaded from one JSON file.

Three kinds, one interface (``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``):

* ``ByteTokenizer``: the UTF-8 bytes of the text, 256 symbols. Round-trips any string; no training.
* ``CharTokenizer``: one id per character seen in a training corpus. A character outside that set follows
  the ``unknown`` policy: ``"unk"`` maps it to the ``<unk>`` token (decoded as U+FFFD), ``"skip"`` drops it,
  ``"error"`` raises ``ValueError`` naming it.
* ``BPETokenizer``: byte-level byte-pair encoding (GPT-2's scheme) trained with Hugging Face ``tokenizers`` to a
  chosen vocabulary size. Starts from the 256 byte symbols, so it also round-trips any string.

Special tokens (``<pad>``, ``<bos>``, ``<eos>`` for sequence-to-sequence, ``<unk>`` for the char policy) take the
first ids, ``0 .. len(specials)-1``; the text symbols follow. With no specials the byte tokenizer's id of a byte is
the byte itself. Special tokens are never produced by ``encode`` (text that spells ``<eos>`` is ordinary text);
``decode`` drops ``<pad>``/``<bos>``/``<eos>``.

"Any string" means any sequence of Unicode scalar values (what UTF-8 can encode); Python strings holding lone
surrogates (``"\\ud800"``) are not text and are rejected with ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # numpy is imported where arrays are made: the command line reads these names without it
    import numpy as np

TokenizerKind = Literal["byte", "char", "bpe"]
UnknownPolicy = Literal["unk", "skip", "error"]

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SEQ2SEQ_SPECIALS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # the first ids of every seq2seq vocabulary, in this order
PAD_ID, BOS_ID, EOS_ID = (SEQ2SEQ_SPECIALS.index(t) for t in SEQ2SEQ_SPECIALS)  # 0, 1, 2
TOKENIZER_FILE = "tokenizer.json"
_FORMAT = "tformer-tokenizer"


class Tokenizer:
    """Base class: special tokens first, then the symbols of the subclass."""

    kind: str = ""

    def __init__(self, specials: Sequence[str] = ()) -> None:
        specials = tuple(specials)
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be distinct; got {specials}")
        self.specials = specials
        self._special_ids = {s: i for i, s in enumerate(specials)}

    # -- the interface ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 NumPy array (subclasses vectorize it for large corpora)."""
        import numpy as np

        return np.asarray(self.encode(text), dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "version": 1, "kind": self.kind, "specials": list(self.specials)}

    # -- special tokens -------------------------------------------------------------------------------
    def special_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    @property
    def pad_id(self) -> int | None:
        return self.special_id(PAD_TOKEN)

    @property
    def bos_id(self) -> int | None:
        return self.special_id(BOS_TOKEN)

    @property
    def eos_id(self) -> int | None:
        return self.special_id(EOS_TOKEN)

    def _hidden(self, i: int) -> bool:
        """Special ids that ``decode`` leaves out."""
        return i < len(self.specials) and self.specials[i] in SEQ2SEQ_SPECIALS

    # -- persistence ----------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A short hash of the tokenizer's full definition (keys the token cache of a corpus)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/tokenizer.json`` (atomically: a temporary file, then rename). Returns its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), ensure_ascii=False))
        os.replace(tmp, path)
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, specials={list(self.specials)})"


def _utf8(text: str) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str; got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start : err.end]
        raise ValueError(f"text holds {bad!r} at index {err.start}, a lone surrogate that is not Unicode text") from err


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte: ``id = len(specials) + byte``. ``decode`` replaces invalid UTF-8 by U+FFFD."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + 256

    def encode(self, text: str) -> list[int]:
        offset = len(self.specials)
        data = _utf8(text)
        return list(data) if offset == 0 else [b + offset for b in data]

    def encode_array(self, text: str) -> np.ndarray:
        import numpy as np

        return np.frombuffer(_utf8(text), dtype=np.uint8).astype(np.int64) + len(self.specials)

    def decode(self, ids: Iterable[int]) -> str:
        offset = len(self.specials)
        data = bytes(i - offset for i in ids if i >= offset and i < offset + 256)
        return data.decode("utf-8", errors="replace")


class CharTokenizer(Tokenizer):
    """One token per character of ``chars`` (in that order, after the specials)."""

    kind = "char"

    def __init__(self, chars: Iterable[str], specials: Sequence[str] = (), unknown: UnknownPolicy = "unk") -> None:
        if unknown not in ("unk", "skip", "error"):
            raise ValueError(f"unknown-character policy {unknown!r} is not one of 'unk', 'skip', 'error'")
        specials = tuple(specials)
        if unknown == "unk" and UNK_TOKEN not in specials:
            specials = (*specials, UNK_TOKEN)
        super().__init__(specials)
        self.chars = list(chars)
        if any(len(c) != 1 for c in self.chars) or len(set(self.chars)) != len(self.chars):
            raise ValueError("CharTokenizer needs distinct single characters")
        self.unknown = unknown
        offset = len(self.specials)
        self._ids = {c: offset + i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, texts: Iterable[str], specials: Sequence[str] = (), unknown: UnknownPolicy = "unk") -> CharTokenizer:
        """The sorted set of characters in ``texts`` (an iterable, so a large corpus streams)."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen), specials, unknown)

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        _utf8(text)  # the same clear error for lone surrogates as the other tokenizers
        ids = self._ids
        try:
            return [ids[c] for c in text]
        except KeyError:
            pass
        if self.unknown == "error":
            index = next(i for i, c in enumerate(text) if c not in ids)
            known = f" ({''.join(self.chars)!r})" if len(self.chars) <= 40 else ""
            raise ValueError(
                f"character {text[index]!r} at index {index} is not in the tokenizer's {len(self.chars)} "
                f"characters{known}; use only characters the model was trained on (a task's alphabet, or the training "
                "corpus's); a tokenizer for a corpus (--data, --pairs) can instead be built with unknown='unk' or "
                "'skip' (tformer train --unknown unk or --unknown skip)"
            )
        if self.unknown == "skip":
            return [ids[c] for c in text if c in ids]
        unk = self._special_ids[UNK_TOKEN]
        return [ids.get(c, unk) for c in text]

    def unknown_chars(self, text: str) -> list[str]:
        """The distinct characters of ``text`` outside the vocabulary, in order of first appearance: what ``encode``
        turns into ``<unk>`` (policy ``"unk"``) or drops (``"skip"``)."""
        return list(dict.fromkeys(c for c in text if c not in self._ids))

    def encode_array(self, text: str) -> np.ndarray:
        """Vectorized: code points looked up by binary search in the sorted known code points."""
        import numpy as np

        _utf8(text)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        known = np.array(sorted(ord(c) for c in self.chars), dtype=np.uint32)
        ids_of_known = np.array([self._ids[chr(p)] for p in known], dtype=np.int64)
        where = np.searchsorted(known, points).clip(max=max(len(known) - 1, 0))
        found = known[where] == points if len(known) else np.zeros(len(points), dtype=bool)
        if found.all():
            return ids_of_known[where]
        if self.unknown != "unk":
            return np.asarray(self.encode(text), dtype=np.int64)  # raises ("error") or drops ("skip")
        return np.where(found, ids_of_known[where] if len(known) else 0, self._special_ids[UNK_TOKEN])

    def decode(self, ids: Iterable[int]) -> str:
        offset, chars = len(self.specials), self.chars
        out = []
        for i in ids:
            if offset <= i < offset + len(chars):
                out.append(chars[i - offset])
            elif 0 <= i < offset and not self._hidden(i):
                out.append("\ufffd")  # <unk>
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "chars": "".join(self.chars), "unknown": self.unknown}


class BPETokenizer(Tokenizer):
    """Byte-level BPE (Hugging Face ``tokenizers``): bytes mapped to 256 printable symbols, then learned merges.

    The specials are registered as Hugging Face special tokens with ids ``0 .. len(specials)-1``, but ``encode``
    never produces them from text (``split_special_tokens``), so encode/decode round-trips any string.
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any, specials: Sequence[str] = ()) -> None:
        super().__init__(specials)
        for i, s in enumerate(self.specials):
            if hf_tokenizer.token_to_id(s) != i:
                raise ValueError(f"BPE tokenizer maps special token {s!r} to {hf_tokenizer.token_to_id(s)}, not {i}")
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = True  # text spelling "<eos>" is text

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, specials: Sequence[str] = ()) -> BPETokenizer:
        """Learn merges from ``texts`` (streamed) until ``vocab_size`` = specials + 256 bytes + merges."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        minimum = len(specials) + 256
        if vocab_size < minimum:
            raise ValueError(
                f"BPE vocab_size={vocab_size} is too small: byte-level BPE needs the 256 byte symbols plus "
                f"{len(specials)} special tokens, so at least {minimum} (--vocab-size)"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf, specials)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        _utf8(text)  # the same clear error for lone surrogates
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        for text in texts:
            _utf8(text)
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        n = self.vocab_size
        kept = [i for i in ids if 0 <= i < n and not self._hidden(i)]
        return self._hf.decode(kept, skip_special_tokens=False)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "hf": json.loads(self._hf.to_str())}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids generation needs (``bos_id``, ``eos_id``, ``pad_id``).

    ``settings``: what a Hugging Face ``tokenizer_config.json`` said about it besides ``tokenizer.json`` (its chat
    template, unknown token, ``add_bos_token``, ...), kept as read so that exporting the model
    (:func:`tformer.save_pretrained`) writes it back; tformer's own encoding does not read it."""

    kind = "hf"

    def __init__(
        self,
        hf: Any,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        settings: dict[str, Any] | None = None,
    ):
        hf.no_padding()
        hf.no_truncation()
        self._hf = hf
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.settings = dict(settings or {})

    @classmethod
    def from_file(cls, path: str | os.PathLike, **options: Any) -> HFTokenizer:
        from tokenizers import Tokenizer

        try:
            inner = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path}: not a tokenizers file (tokenizer.json): {err}") from None
        return cls(inner, **options)

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

    def encode_array(self, text: str) -> np.ndarray:
        """A corpus's stream of ids (fine-tuning on text, :mod:`tformer.training.finetune`): no special tokens, as
        a piece of running text, not a sequence of its own."""
        import numpy as np

        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str | None:
        """The piece of id ``i`` as the vocabulary spells it (byte-level pieces show spaces as ``Ġ``)."""
        return self._hf.id_to_token(i)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/tokenizer.json`` in Hugging Face's format (what ``transformers`` reads)."""
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self._hf.to_str(), encoding="utf-8")
        return path

    def fingerprint(self) -> str:
        return hashlib.sha256(self._hf.to_str().encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "tformer-tokenizer",
            "version": 1,
            "kind": "hf",
            "hf": json.loads(self._hf.to_str()),
            "ids": {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id},
            "settings": self.settings,
        }

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"


def build_tokenizer(
    kind: TokenizerKind,
    texts: Iterable[str] | None = None,
    *,
    vocab_size: int = 512,
    specials: Sequence[str] = (),
    unknown: UnknownPolicy = "unk",
) -> Tokenizer:
    """A tokenizer of ``kind``; ``char`` and ``bpe`` are trained on ``texts`` (an iterable of strings)."""
    if kind == "byte":
        return ByteTokenizer(specials)
    if texts is None:
        raise ValueError(f"a {kind!r} tokenizer is built from a corpus; pass texts")
    if kind == "char":
        return CharTokenizer.train(texts, specials, unknown)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size, specials)
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of 'byte', 'char', 'bpe'")


def tokenizer_from_dict(data: dict[str, Any], source: str = "<dict>") -> Tokenizer:
    """Rebuild a tokenizer from :meth:`Tokenizer.to_dict`; ``ValueError`` naming ``source`` if it is not one."""
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f'{source} is not a tformer tokenizer (no "format": "{_FORMAT}" field)')
    kind, specials = data.get("kind"), data.get("specials", [])
    try:
        if kind == "byte":
            return ByteTokenizer(specials)
        if kind == "char":
            return CharTokenizer(data["chars"], specials, data["unknown"])
        if kind in ("bpe", "hf"):
            from tokenizers import Tokenizer as Library

            inner = Library.from_str(json.dumps(data["hf"]))
            if kind == "hf":
                ids = data.get("ids", {})
                return HFTokenizer(
                    inner,
                    bos_id=ids.get("bos"),
                    eos_id=ids.get("eos"),
                    pad_id=ids.get("pad"),
                    settings=data.get("settings"),  # absent in runs saved before it was kept
                )
            return BPETokenizer(inner, specials)
    except (KeyError, TypeError, Exception) as err:
        raise ValueError(f"{source}: malformed {kind} tokenizer: {type(err).__name__}: {err}") from err
    raise ValueError(f"{source}: unknown tokenizer kind {kind!r}; expected 'byte', 'char', 'bpe' or 'hf'")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Read ``directory/tokenizer.json`` (or the JSON file itself when given a file)."""
    path = Path(directory)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}; save one with Tokenizer.save(directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    return tokenizer_from_dict(data, str(path))
