"""The ``tformer`` command line: a thin skin over importable functions.

Each command module contributes ``add_cli(subparsers)``, which registers its parser and sets
``func(args) -> exit code``. Ctrl-C outside a training loop (which saves and stops by itself) ends the command
with exit status 130, as the shell reports a process stopped by SIGINT.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that register commands; each is imported only when the CLI starts.
COMMAND_MODULES = [
    "tformer.demo_cli",
    "tformer.train_cli",
    "tformer.claims",
    "tformer.experiments.cli",
    "tformer.sample_cli",
]
DESCRIPTION = "The tformer command line: train, sample and study Transformers. tformer COMMAND --help lists its flags."
EXIT_INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tformer", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # e.g. during imports or tokenization, before a loop's own Ctrl-C handling
        print("tformer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
