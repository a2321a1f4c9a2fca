"""The ``tformer`` command line: a thin skin over importable functions.

Each command module contributes ``add_cli(subparsers)``, which registers its parser and sets
``func(args) -> exit code``.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tformer", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
