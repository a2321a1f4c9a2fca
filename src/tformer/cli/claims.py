"""``tformer verify-claims`` (and ``python -m tformer.claims``): a thin skin over :mod:`tformer.claims`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tformer.claims.checker import (
    BUILTIN_CLAIMS,
    DEFAULT_MEMORY_MB,
    DEFAULT_TIMEOUT_S,
    MIN_MEMORY_MB,
    Claim,
    ClaimsInputError,
    builtin_claims,
    format_row,
    iter_check_claims,
    load_claims,
    make_limits,
    parse_claims_text,
    summarize,
    summary_line,
)

CLI_DESCRIPTION = (
    'Check a JSON list of {"claim": text, "code": python} objects. Each code may use sympy names '
    "(symbols, exp, diff, simplify, Matrix, limit, oo, ...) without importing them and must set `result` "
    "to a bool or sympy true/false. Each claim runs in its own sandboxed worker process."
)
CLI_EPILOG = "exit codes: 0 all pass, 1 any FAIL/ERROR/TIMEOUT, 2 unusable input (an empty claims list included)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify-claims`` options, shared by ``tformer verify-claims`` and ``python -m tformer.claims``."""
    parser.add_argument("file", nargs="?", help="claims JSON file ('-' reads standard input)")
    parser.add_argument("--builtin", choices=sorted(BUILTIN_CLAIMS), help="check a claims file shipped with tformer")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="wall-clock and CPU-time limit per claim, seconds (default %(default)g)",
    )
    parser.add_argument(
        "--memory-mb",
        type=int,
        default=DEFAULT_MEMORY_MB,
        help="address-space limit per claim, MiB (default %(default)d)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="claims checked in parallel (default: the CPU count)")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``verify-claims`` on the ``tformer`` CLI's argparse subparsers; ``func(args)`` -> exit code."""
    parser = subparsers.add_parser(
        "verify-claims",
        help="check a JSON file of sympy claims in sandboxed worker processes",
        description=CLI_DESCRIPTION,
        epilog=CLI_EPILOG,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_cli, prog_name="tformer verify-claims", needs_torch=False)  # sympy, in workers
    return parser


def _claims_from_args(args: argparse.Namespace) -> list[Claim]:
    if (args.file is None) == (args.builtin is None):
        raise ClaimsInputError("give exactly one of a claims FILE or --builtin {seed,derivations}")
    if args.builtin is not None:
        return builtin_claims(args.builtin)
    if args.file == "-":
        return parse_claims_text(_read_stdin(), "<stdin>")
    return load_claims(Path(args.file))


def _read_stdin() -> str:
    """Standard input as UTF-8, with or without a byte-order mark, whatever the locale's encoding."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream without bytes underneath (io.StringIO); parse_claims_text drops a BOM
        return sys.stdin.read()
    try:
        return stream.read().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ClaimsInputError(f"cannot read <stdin>: {exc}") from None


def run_cli(args: argparse.Namespace) -> int:
    """Run ``verify-claims`` for parsed arguments; return the process exit code (0, 1 or 2)."""
    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be a number of seconds > 0; got {args.timeout:g}")
        if args.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"--memory-mb must be at least {MIN_MEMORY_MB}; got {args.memory_mb}")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1; got {args.jobs}")
        claims = _claims_from_args(args)
        limits = make_limits(args.timeout, args.memory_mb, None)
    except (ClaimsInputError, ValueError) as exc:
        print(f"{args.prog_name}: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = []
    for result in iter_check_claims(claims, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb, jobs=args.jobs):
        results.append(result)
        if not args.json:
            print(format_row(result), flush=True)
    ok = all(result.ok for result in results)
    if args.json:
        report = {"results": [asdict(r) for r in results], "summary": summarize(results), "ok": ok}
        print(json.dumps(report, indent=2))
    else:
        claims_checked = f"{len(results)} claim{'s' if len(results) != 1 else ''}"
        print(f"{summary_line(results)} ({claims_checked}, {time.perf_counter() - start:.1f} s)")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tformer.claims [FILE] [--builtin NAME] [--json] ...``"""
    from tformer.cli import Parser

    parser = Parser(prog="python -m tformer.claims", description=CLI_DESCRIPTION, epilog=CLI_EPILOG)
    add_arguments(parser)
    parser.set_defaults(prog_name="python -m tformer.claims")
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
