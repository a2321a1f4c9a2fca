"""Text in, text out: a streamed continuation of a prompt (``tformer sample``) and line-by-line translation with an
encoder-decoder (``tformer translate``), on any tokenizer with ``encode``/``decode`` (and the special ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TextIO

from tformer.generation.sampling import generate
from tformer.generation.seq2seq import beam_search
from tformer.generation.static import auto_compile, auto_static_cache, check_fits_static_cache
from tformer.models import DecoderLM, EncoderDecoder, pad_right

DEFAULT_NEW_TOKENS = 200
EMPTY_PROMPT = "the prompt is empty; give a non-empty --prompt"


class TextTokenizer(Protocol):
    """What text generation needs of a tokenizer (every :class:`tformer.tokenizers.Tokenizer` has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Seq2SeqTokenizer(TextTokenizer, Protocol):
    pad_id: int | None
    bos_id: int | None
    eos_id: int | None


class TextStream:
    """Writes the text of a growing token list as it grows: only the new characters each time, and never a
    trailing U+FFFD that may be half of a multi-byte character still being generated. ``prefix`` (the prompt)
    is written with the first text, so nothing is written if generation fails before it starts."""

    def __init__(self, tokenizer, out: TextIO, prefix: str = "") -> None:
        self.tokenizer, self.out, self.prefix = tokenizer, out, prefix
        self.tokens: list[int] = []
        self.written = 0

    def push(self, token: int) -> None:
        self.tokens.append(token)
        self._write(final=False)

    def _write(self, final: bool) -> None:
        text = self.tokenizer.decode(self.tokens)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        if end > self.written or (final and self.prefix):
            self.out.write(self.prefix + text[self.written : end])
            self.out.flush()
            self.prefix, self.written = "", end

    def close(self) -> None:
        self._write(final=True)


def sample_to(
    out: TextIO,
    model: DecoderLM,
    tokenizer: TextTokenizer,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    note: Callable[[str], None] | None = None,
    echo: bool = True,
    add_special_tokens: bool = True,
    static_cache: bool | None = False,
    compile: bool | None = False,
    **sampling,
) -> list[int]:
    """Write ``prompt`` and its sampled continuation to ``out`` (streamed, flushed per token); return the new ids.
    ``echo=False`` writes the continuation alone; ``add_special_tokens=False`` encodes the prompt without the
    tokenizer's own special tokens (a chat prompt holds its template's already: :mod:`tformer.generation.chat`).
    ``compile=None``: compile where :func:`tformer.generation.static.auto_compile` says so for this prompt's length
    plus ``max_new_tokens``; ``static_cache=None``: when not compiling, decode over a static cache where
    :func:`tformer.generation.static.auto_static_cache` says so. Asked to compile or to use a static cache, a
    sequence that cannot fit one (learned positions) is refused before anything is written or noted.
    Bad settings raise ``ValueError`` before anything is written. ``max_new_tokens=None``: ``DEFAULT_NEW_TOKENS``.
    The text ends at ``eos_id`` (one id or several; ``None``: the tokenizer's ``eos_id``, if it has one);
    ``note``: called to say that the prompt is longer than the model's trained context (learned positions: the
    model sees the prompt's last ``max_seq_len`` tokens; rotary or sinusoidal positions work at any length, but the
    model never saw those positions: quality may drop; generating past it, as the default length does for small
    models, is not noted); ``sampling``: the other arguments of ``generate``."""
    ids = tokenizer.encode(prompt) if add_special_tokens else tokenizer.encode(prompt, add_special_tokens=False)
    if not ids and prompt:  # only a char tokenizer built with unknown='skip' drops characters
        raise ValueError(
            f"every character of the --prompt {prompt!r} is unknown to the tokenizer (it skips unknown characters), "
            "so nothing is left to condition on; use characters of the training text"
        )
    if not ids:
        raise ValueError(EMPTY_PROMPT)
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_NEW_TOKENS
    length = len(ids) + max_new_tokens
    if compile is None:
        compile = auto_compile(model, length)
    if static_cache is None:
        static_cache = not compile and auto_static_cache(model, length)
    if compile or static_cache:
        check_fits_static_cache(model, len(ids), max_new_tokens)
    trained = model.cfg.max_seq_len
    if note is not None and len(ids) > trained:
        if model.cfg.position == "learned":  # generate crops the prompt: a window
            note(
                f"the prompt's {len(ids)} tokens are more than the model's {trained} learned positions; it sees the "
                f"last {trained}"
            )
        else:
            note(
                f"the prompt's {len(ids)} tokens are more than the model's trained context (max_seq_len {trained}); "
                f"its {model.cfg.position} positions go on, but what it generates may degrade"
            )
    stream = TextStream(tokenizer, out, prefix=prompt if echo else "")
    new = generate(
        model,
        [ids],
        max_new_tokens=max_new_tokens,
        tokenizer=tokenizer,
        eos_id=getattr(tokenizer, "eos_id", None) if eos_id is None else eos_id,
        on_token=lambda _row, tok: stream.push(tok),
        static_cache=static_cache,
        compile=compile,
        **sampling,
    )[0]
    stream.close()
    out.write("\n")
    out.flush()
    return new


def translate_lines(
    model: EncoderDecoder,
    tokenizer: Seq2SeqTokenizer,
    lines: list[str],
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_new_tokens: int | None = None,
    start_id: int | None = None,
    eos_id: int | None = None,
    on_error: Callable[[int, ValueError], None] | None = None,
) -> list[str]:
    """Beam-search outputs of ``lines`` (one string each; an empty line gives ``""``); ``max_new_tokens=None``
    allows the model's ``max_seq_len`` tokens. The decoder starts from ``start_id`` and ends at ``eos_id``
    (``None``: the tokenizer's ``bos_id`` and ``eos_id``; Marian models start from their pad id).

    A line that cannot be translated (the tokenizer rejects a character, or it has more tokens than the
    encoder's learned positions) raises ``ValueError``; with ``on_error`` it gives ``""`` instead and
    ``on_error(i, error)`` is called with its index in ``lines``, so the other lines are still translated.
    """
    device, cfg = next(model.parameters()).device, model.cfg
    encoded: list[list[int]] = []
    for i, line in enumerate(lines):
        try:
            ids = tokenizer.encode(line)
            if cfg.position == "learned" and len(ids) > cfg.max_seq_len:
                raise ValueError(
                    f"the line is {len(ids)} tokens long, more than the model's max_seq_len="
                    f"{cfg.max_seq_len} learned positions"
                )
        except ValueError as err:
            if on_error is None:
                raise
            on_error(i, err)
            ids = []
        encoded.append(ids)
    present = [i for i, ids in enumerate(encoded) if ids]
    outputs = [""] * len(lines)
    if not present:
        return outputs
    src, src_mask = pad_right([encoded[i] for i in present], tokenizer.pad_id or 0)  # right-padded: True = real token
    limit = cfg.max_seq_len if max_new_tokens is None else max_new_tokens
    decoded = beam_search(
        model,
        src.to(device),
        src_mask.to(device),
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_new_tokens=limit,
        bos_id=tokenizer.bos_id if start_id is None else start_id,
        eos_id=tokenizer.eos_id if eos_id is None else eos_id,
    )
    for row, i in enumerate(present):
        outputs[i] = tokenizer.decode(decoded[row])
    return outputs
