"""``tformer embed``: a thin skin over :func:`tformer.interop.embed` for a sentence-embedding model.

``tformer embed --checkpoint DIR`` reads one text per line on stdin (UTF-8) and prints one JSON array (the
L2-normalized embedding) per line, in order; with ``--similarity``, the cosine similarity matrix of the lines
instead (row ``i``: line ``i`` against every line). Every line is read and checked before anything is printed.
"""

from __future__ import annotations

import argparse
import json
import sys

from tformer.cli.common import add_device_flags, report_errors, torch_dtype, utf8_error

DIGITS = 4  # decimals of a printed similarity


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "embed",
        help="sentence embeddings of stdin's lines (a BERT-family model), one JSON array per line; --similarity: "
        "how alike the lines are",
        description="Read one text per line on stdin (UTF-8); print each text's embedding as a JSON array on its own "
        "line: the encoder's last hidden states mean-pooled over the real tokens and L2-normalized, as "
        "sentence-transformers computes them. An empty line is embedded as the empty text. A text longer than the "
        "model's max_seq_length (sentence-transformers' setting, e.g. 256 tokens for all-MiniLM-L6-v2; else its "
        "position table) is cut to it, as sentence-transformers does. A line that is not UTF-8 stops the command "
        "before anything is printed. With --similarity, print the lines' cosine similarity matrix instead, e.g. "
        "printf 'A man is eating food.\\nA man is eating bread.\\n' | tformer embed --checkpoint minilm --similarity",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a Hugging Face BERT directory with a tokenizer.json, or minilm (the shipped all-MiniLM-L6-v2)",
    )
    p.add_argument(
        "--similarity",
        action="store_true",
        help="print the cosine similarity of every pair of lines instead of the embeddings: row i, a JSON array on "
        f"line i, holds line i's similarity to each line (rounded to {DIGITS} decimals; 1 = same direction)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="texts encoded together (default 32)")
    add_device_flags(p)
    p.set_defaults(func=_run_embed)


def read_lines(stream) -> list[str]:
    """The lines of ``stream`` without their line ends; ``ValueError`` naming the first line that is not UTF-8."""
    if stream is None:
        raise ValueError("there is no standard input (stdin is closed); pipe the texts in, one per line")
    texts = []
    for number, line in enumerate(getattr(stream, "buffer", stream), start=1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"line {number} is {utf8_error(err)}") from None
        texts.append(line.rstrip("\r\n"))
    return texts


def _run_embed(args: argparse.Namespace) -> int:
    def run() -> int:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
        from tformer.interop import check_embedder, embed, load_pretrained
        from tformer.runtime import resolve_device

        texts = read_lines(sys.stdin)
        pretrained = load_pretrained(args.checkpoint, dtype=torch_dtype(args.dtype), device=resolve_device(args.device))
        check_embedder(pretrained)  # also with no lines: the wrong model is an error, not an empty output
        if args.similarity:
            vectors = embed(pretrained, texts, batch_size=args.batch_size)  # a unit-length row per line
            for row in (vectors @ vectors.T).tolist():  # row i, column j: the cosine of lines i and j
                sys.stdout.write(json.dumps([round(x, DIGITS) for x in row]) + "\n")
            return 0
        for start in range(0, len(texts), args.batch_size):
            vectors = embed(pretrained, texts[start : start + args.batch_size], batch_size=args.batch_size)
            for row in vectors.tolist():
                sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()
        return 0

    return report_errors("embed", run)
