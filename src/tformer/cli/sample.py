"""``tformer sample`` and ``tformer translate``: thin skins over :func:`tformer.generation.sampling.generate` and
:func:`tformer.generation.seq2seq.beam_search` for a saved checkpoint.

``tformer sample --checkpoint DIR --prompt TEXT`` prints the prompt, then streams the continuation of a language
model to stdout as tokens are made. ``tformer translate --checkpoint DIR`` reads source lines from stdin and
prints one output line per input line (beam search; ``--beam-size 1 --length-penalty 0`` is greedy); a line it
cannot translate (not valid UTF-8, a character the tokenizer does not know, too long) gives an empty output
line, a message on stderr and, at the end, exit code 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO

from tformer.generation.sampling import check_sampling_args, generate, row_seeds
from tformer.generation.seq2seq import beam_search
from tformer.training.tasks import pad

DEFAULT_NEW_TOKENS = 200


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "sample", help="continue a prompt with a trained language model, streaming to stdout",
        description="Sample from a language-model checkpoint. Tokens are printed as they are made; text that could "
        "begin a --stop string is held back until it cannot.",
    )  # fmt: skip
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory or a training run directory")
    p.add_argument("--prompt", required=True, help="the text to continue (must encode to at least one token)")
    more = (f"tokens to generate (default {DEFAULT_NEW_TOKENS}); a model with learned positions sees a sliding "
            "window of at most its max_seq_len latest tokens")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=None, help=more)
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature > 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: the most likely tokens holding mass >= p")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (ignores the three above)")
    p.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**63) (default: unseeded)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end when the generated text contains STR (not printed); repeatable")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
    p.set_defaults(func=_run_sample)

    t = subparsers.add_parser(
        "translate", help="translate stdin line by line with a seq2seq checkpoint (beam search)",
        description="Read source lines (UTF-8) from stdin; print one output line per input line. An empty line gives "
        "an empty line. A line that cannot be translated (not valid UTF-8, a character the tokenizer does not know, "
        "or longer than the model's learned positions) gives an empty line and a message 'line N: reason' on stderr; "
        "the other lines are still translated, and the exit code is then 1 (0 when every line was translated).",
    )  # fmt: skip
    t.add_argument("--checkpoint", required=True, help="a checkpoint directory or a training run directory")
    t.add_argument("--beam-size", type=int, default=4, help="beams per source (default 4; 1 = greedy)")
    alpha = "GNMT alpha: score log P / ((5 + |Y|)/6)^alpha (default 0.6; 0 = plain log-probability)"
    t.add_argument("--length-penalty", type=float, default=0.6, help=alpha)
    t.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest output in tokens, EOS included (default: the model's max_seq_len)")  # fmt: skip
    t.add_argument("--batch-size", type=int, default=32, help="lines decoded together when stdin is not a terminal")
    t.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
    t.set_defaults(func=_run_translate)


def _load(path: str, kind: str, device: str, command: str):
    from tformer.training.checkpoint import CheckpointError, load_checkpoint
    from tformer.training.runtime import resolve_device

    try:
        ckpt = load_checkpoint(path, map_location=resolve_device(device))
    except CheckpointError as err:
        raise _damaged_latest_error(path, err) from err
    if ckpt.kind != kind:
        other = "translate" if kind == "lm" else "sample"
        raise ValueError(f"{ckpt.path} holds a {ckpt.kind!r} model; `tformer {command}` needs {kind!r} "
                         f"(use `tformer {other}`)")  # fmt: skip
    return ckpt


def _damaged_latest_error(path: str, err: Exception) -> Exception:
    """For ``path`` a run directory (or its ``checkpoints`` folder) whose newest checkpoint failed to load with
    ``err``: an error that also names the newest earlier checkpoint that verifies, to pass as --checkpoint.
    ``err`` itself for a specific checkpoint directory, or when there is no earlier one."""
    from tformer.training.checkpoint import (
        CHECKPOINTS_DIR,
        MANIFEST,
        CheckpointError,
        last_good_checkpoint,
        list_checkpoints,
    )

    root = Path(path)
    if (root / MANIFEST).exists():  # a specific checkpoint: the user chose it, there is nothing to fall back to
        return err
    found = list_checkpoints(root / CHECKPOINTS_DIR) or list_checkpoints(root)  # as load_checkpoint looks
    if not found:
        return err
    older = last_good_checkpoint(found[:-1])
    if older is not None:
        return CheckpointError(f"the newest checkpoint {found[-1]} is damaged ({err}); delete it, or pass "
                               f"--checkpoint {older}")  # fmt: skip
    return CheckpointError(f"the newest checkpoint {found[-1]} is damaged ({err}); no earlier checkpoint of {path} "
                           "verifies")  # fmt: skip


def _errors(command: str, run: Callable[[], int]) -> int:
    from tformer.training.checkpoint import CheckpointError

    try:
        return run()
    except (ValueError, CheckpointError) as err:
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------------
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


def sample_to(out: TextIO, ckpt, prompt: str, *, max_new_tokens: int | None = None, **sampling) -> list[int]:
    """Write ``prompt`` and its sampled continuation to ``out`` (streamed, flushed per token); return the new ids.
    Bad settings raise ``ValueError`` before anything is written. ``max_new_tokens=None``: ``DEFAULT_NEW_TOKENS``."""
    tokenizer = ckpt.tokenizer
    ids = tokenizer.encode(prompt)
    if not ids and prompt:  # only a char tokenizer built with unknown='skip' drops characters
        raise ValueError(
            f"every character of the --prompt {prompt!r} is unknown to the tokenizer (it skips unknown characters), "
            "so nothing is left to condition on; use characters of the training text"
        )
    if not ids:
        raise ValueError("the prompt is empty; give a non-empty --prompt")
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_NEW_TOKENS
    stream = TextStream(tokenizer, out, prefix=prompt)
    new = generate(ckpt.model, [ids], max_new_tokens=max_new_tokens, tokenizer=tokenizer,
                   eos_id=getattr(tokenizer, "eos_id", None), on_token=lambda _row, tok: stream.push(tok),
                   **sampling)[0]  # fmt: skip
    stream.close()
    out.write("\n")
    out.flush()
    return new


def _run_sample(args: argparse.Namespace) -> int:
    def run() -> int:
        check_sampling_args(args.temperature, args.top_k, args.top_p, args.greedy)  # before loading anything
        row_seeds(args.seed, 1)
        ckpt = _load(args.checkpoint, "lm", args.device, "sample")
        sample_to(sys.stdout, ckpt, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, greedy=args.greedy, seed=args.seed,
                  stop=args.stop or None)  # fmt: skip
        return 0

    return _errors("sample", run)


# --------------------------------------------------------------------------------------------------
# translate
# --------------------------------------------------------------------------------------------------
def _decode_line(line: bytes | str) -> str | ValueError:
    """An input line without its line end: decoded as strict UTF-8 (a ``str`` line is already text), or the
    ``ValueError`` that makes it a failed line."""
    if isinstance(line, str):
        return line.rstrip("\r\n")
    try:
        return line.rstrip(b"\r\n").decode("utf-8")
    except UnicodeDecodeError as err:
        return ValueError(f"not valid UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start})")


def _chunks(lines: Iterable[bytes | str], size: int) -> Iterator[list[str | ValueError]]:
    """Groups of ``size`` decoded lines (the last may be shorter), each read only when needed."""
    chunk: list[str | ValueError] = []
    for line in lines:
        chunk.append(_decode_line(line))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _stdin_lines() -> Iterable[bytes | str]:
    """The lines of stdin as bytes (each decoded by :func:`_decode_line`, so one bad byte fails one line), or as
    text when stdin was replaced by a text stream without a byte buffer."""
    if sys.stdin is None:
        raise ValueError("there is no standard input (stdin is closed); pipe the source lines in, e.g. "
                         "`echo 31415 | tformer translate --checkpoint DIR`")  # fmt: skip
    return getattr(sys.stdin, "buffer", sys.stdin)


def translate_lines(ckpt, lines: list[str], *, beam_size: int = 4, length_penalty: float = 0.6,
                    max_new_tokens: int | None = None,
                    on_error: Callable[[int, ValueError], None] | None = None) -> list[str]:  # fmt: skip
    """Beam-search outputs of ``lines`` (one string each; an empty line gives ``""``); ``max_new_tokens=None``
    allows the model's ``max_seq_len`` tokens.

    A line that cannot be translated (the tokenizer rejects a character, or it has more tokens than the
    encoder's learned positions) raises ``ValueError``; with ``on_error`` it gives ``""`` instead and
    ``on_error(i, error)`` is called with its index in ``lines``, so the other lines are still translated.
    """
    tokenizer, model = ckpt.tokenizer, ckpt.model
    device, cfg = next(model.parameters()).device, model.cfg
    encoded: list[list[int]] = []
    for i, line in enumerate(lines):
        try:
            ids = tokenizer.encode(line)
            if cfg.position == "learned" and len(ids) > cfg.max_seq_len:
                raise ValueError(f"the line is {len(ids)} tokens long, more than the model's max_seq_len="
                                 f"{cfg.max_seq_len} learned positions")  # fmt: skip
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
    src, src_mask = pad([encoded[i] for i in present], tokenizer.pad_id or 0)  # right-padded: True = real token
    limit = cfg.max_seq_len if max_new_tokens is None else max_new_tokens
    decoded = beam_search(model, src.to(device), src_mask.to(device), beam_size=beam_size,
                          length_penalty=length_penalty, max_new_tokens=limit, bos_id=tokenizer.bos_id,
                          eos_id=tokenizer.eos_id)  # fmt: skip
    for row, i in enumerate(present):
        outputs[i] = tokenizer.decode(decoded[row])
    return outputs


def _check_translate_args(args: argparse.Namespace) -> None:
    """The flags' errors, before the checkpoint is loaded or stdin read."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
    if args.beam_size < 1:
        raise ValueError(f"--beam-size must be >= 1 (1 = greedy); got {args.beam_size}")
    if not (math.isfinite(args.length_penalty) and args.length_penalty >= 0):
        raise ValueError(f"--length-penalty must be a finite number >= 0 (0 = plain log-probability); "
                         f"got {args.length_penalty}")  # fmt: skip
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1 (leave it out for the model's max_seq_len); "
                         f"got {args.max_new_tokens}")  # fmt: skip


def _run_translate(args: argparse.Namespace) -> int:
    def run() -> int:
        _check_translate_args(args)
        lines = _stdin_lines()
        ckpt = _load(args.checkpoint, "seq2seq", args.device, "translate")
        if ckpt.tokenizer.bos_id is None or ckpt.tokenizer.eos_id is None:
            raise ValueError(f"{ckpt.path}: the tokenizer has no <bos>/<eos> tokens; it is not a seq2seq tokenizer")
        size = 1 if sys.stdin.isatty() else args.batch_size  # at a terminal answer each line at once
        done, failed = 0, 0  # input lines read before this chunk; lines that could not be translated
        for chunk in _chunks(lines, size):
            errors = {i: item for i, item in enumerate(chunk) if isinstance(item, ValueError)}  # undecodable
            texts = ["" if isinstance(item, ValueError) else item for item in chunk]
            outputs = translate_lines(ckpt, texts, beam_size=args.beam_size, length_penalty=args.length_penalty,
                                      max_new_tokens=args.max_new_tokens, on_error=errors.__setitem__)  # fmt: skip
            for i in sorted(errors):
                print(f"tformer translate: line {done + i + 1}: {errors[i]}", file=sys.stderr)
            for line in outputs:
                sys.stdout.write(line.replace("\n", " ") + "\n")
            sys.stdout.flush()
            done, failed = done + len(chunk), failed + len(errors)
        return 1 if failed else 0

    return _errors("translate", run)
