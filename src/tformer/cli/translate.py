"""``tformer translate``: a thin skin over :func:`tformer.generation.text.translate_lines` for a saved checkpoint.

``tformer translate --checkpoint PATH`` (a tformer run or checkpoint, or a Hugging Face Marian directory with a
``tokenizer.json``) reads source lines from stdin and prints one output line per input line
(beam search; ``--beam-size 1 --length-penalty 0`` is greedy); a line it cannot translate (not valid UTF-8, a
character the tokenizer does not know, too long) gives an empty output line, a message on stderr and, at the end,
exit code 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator

from tformer.cli.common import add_device_flags, load_model, report_errors, utf8_error


def add_cli(subparsers) -> None:
    t = subparsers.add_parser(
        "translate",
        help="translate stdin line by line with a seq2seq checkpoint (beam search)",
        description="Read source lines (UTF-8) from stdin; print one output line per input line. An empty line gives "
        "an empty line. A line that cannot be translated (not valid UTF-8, a character the tokenizer does not know, "
        "or longer than the model's learned positions) gives an empty line and a message 'line N: reason' on stderr; "
        "the other lines are still translated, and the exit code is then 1 (0 when every line was translated).",
    )
    t.add_argument(
        "--checkpoint",
        required=True,
        help="a training run or checkpoint directory, or a Hugging Face Marian directory with a tokenizer.json",
    )
    t.add_argument("--beam-size", type=int, default=4, help="beams per source (default 4; 1 = greedy)")
    alpha = "GNMT alpha: score log P / ((5 + |Y|)/6)^alpha (default 0.6; 0 = plain log-probability)"
    t.add_argument("--length-penalty", type=float, default=0.6, help=alpha)
    t.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest output in tokens, EOS included (default: the model's max_seq_len)",
    )
    t.add_argument(
        "--batch-size", type=int, default=32, help="lines decoded together when stdin is not a terminal (default 32)"
    )
    add_device_flags(t)
    t.set_defaults(func=_run_translate)


def _decode_line(line: bytes | str) -> str | ValueError:
    """An input line without its line end: decoded as strict UTF-8 (a ``str`` line is already text), or the
    ``ValueError`` that makes it a failed line."""
    if isinstance(line, str):
        return line.rstrip("\r\n")
    try:
        return line.rstrip(b"\r\n").decode("utf-8")
    except UnicodeDecodeError as err:
        return ValueError(utf8_error(err))


def _chunks(lines: Iterable[bytes | str], size: int) -> Iterator[list[str | ValueError]]:
    """Groups of ``size`` decoded lines (the last may be shorter), each read only when needed."""
    chunk: list[str | ValueError] = []
    for number, line in enumerate(lines):
        if number == 0:  # a byte-order mark (text saved by Windows editors) is not part of the first line
            line = line.removeprefix(b"\xef\xbb\xbf" if isinstance(line, bytes) else "\ufeff")
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
        raise ValueError(
            "there is no standard input (stdin is closed); pipe the source lines in, e.g. "
            "`echo 31415 | tformer translate --checkpoint DIR`"
        )
    return getattr(sys.stdin, "buffer", sys.stdin)


def _check_translate_args(args: argparse.Namespace) -> None:
    """The flags' errors, before the checkpoint is loaded or stdin read."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
    if args.beam_size < 1:
        raise ValueError(f"--beam-size must be >= 1 (1 = greedy); got {args.beam_size}")
    if not (math.isfinite(args.length_penalty) and args.length_penalty >= 0):
        raise ValueError(
            f"--length-penalty must be a finite number >= 0 (0 = plain log-probability); got {args.length_penalty}"
        )
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(
            f"--max-new-tokens must be >= 1 (leave it out for the model's max_seq_len); got {args.max_new_tokens}"
        )


def _run_translate(args: argparse.Namespace) -> int:
    def run() -> int:
        from tformer.generation.text import translate_lines

        _check_translate_args(args)
        lines = _stdin_lines()
        loaded = load_model(args.checkpoint, "seq2seq", args.device, "translate", args.dtype)
        if loaded.start is None or not loaded.eos:
            raise ValueError(
                f"{loaded.path}: no start (<bos> or decoder_start_token_id) or end (<eos>) token; it is not a "
                "seq2seq model's tokenizer"
            )
        size = 1 if sys.stdin.isatty() else args.batch_size  # at a terminal answer each line at once
        done, failed = 0, 0  # input lines read before this chunk; lines that could not be translated
        for chunk in _chunks(lines, size):
            errors = {i: item for i, item in enumerate(chunk) if isinstance(item, ValueError)}  # undecodable
            texts = ["" if isinstance(item, ValueError) else item for item in chunk]
            outputs = translate_lines(
                loaded.model,
                loaded.tokenizer,
                texts,
                beam_size=args.beam_size,
                length_penalty=args.length_penalty,
                max_new_tokens=args.max_new_tokens,
                start_id=loaded.start,
                eos_id=loaded.eos[0],
                on_error=errors.__setitem__,
            )
            for i in sorted(errors):
                print(f"tformer translate: line {done + i + 1}: {errors[i]}", file=sys.stderr)
            for line in outputs:
                sys.stdout.write(line.replace("\n", " ") + "\n")
            sys.stdout.flush()
            done, failed = done + len(chunk), failed + len(errors)
        return 1 if failed else 0

    return report_errors("translate", run)
