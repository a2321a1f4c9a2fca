"""The ``tformer`` command line: a thin skin over importable functions.

Each command module contributes ``add_cli(subparsers)``, which registers its parser and sets
``func(args) -> exit code`` (and ``needs_torch=False`` for a command that runs without torch). The parsers are built
without importing torch (the command modules import it inside their functions), so ``--help`` and a mistyped
command answer at once. Ctrl-C outside a training loop (which saves and stops by itself) ends the command with exit
status 130, as the shell reports a process stopped by SIGINT; during the import of torch, after parsing, it is held
back until that is done (:func:`_ctrl_c_held_back`).

Output that cannot be written ends the command without a traceback: a reader that went away (``tformer sample
... | head``) quietly with exit status 141, as the shell reports a process stopped by SIGPIPE; anything else (a
full disk) with one line on stderr and exit status 1. This module imports nothing heavy (no torch): the command
modules are imported inside :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

# Modules that register commands; each is imported only when the CLI starts.
COMMAND_MODULES = [
    "tformer.cli.demo",
    "tformer.cli.train",
    "tformer.cli.claims",
    "tformer.cli.experiments",
    "tformer.cli.sample",
    "tformer.cli.translate",
    "tformer.cli.embed",
    "tformer.cli.eval",
    "tformer.cli.convert",
    "tformer.cli.explore",
    "tformer.cli.kernels",
]
DESCRIPTION = "The tformer command line: train, sample and study Transformers. tformer COMMAND --help lists its flags."
EXIT_INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"
EXIT_BROKEN_PIPE = 141  # the shell's code for "stopped by SIGPIPE" (128 + 13)


class OutputError(Exception):
    """Writing to stdout failed; ``__cause__`` is the ``OSError`` (a broken pipe, a full disk)."""


class _GuardedStdout:
    """``sys.stdout`` while a command runs: an ``OSError`` from writing or flushing it becomes :class:`OutputError`,
    so that it is told apart from other ``OSError`` s (a checkpoint that cannot be written is not "output")."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            raise OutputError(err) from err

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            raise OutputError(err) from err

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Point stdout's file descriptor at ``os.devnull``, so that the flush of what is still buffered when Python exits
    does not fail a second time (the Python docs' "Note on SIGPIPE", signal module)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's stand-in): nothing is flushed at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


@contextlib.contextmanager
def _ctrl_c_held_back() -> Iterator[None]:
    """Run the block with Ctrl-C held back, then raise it as ``KeyboardInterrupt`` if it came meanwhile.

    For the heavy imports (torch, ~1.5 s): a ``KeyboardInterrupt`` raised inside an extension module's
    initialization can be swallowed by its C code (torch's NumPy bridge clears any error, and the run goes on)
    or leave a module half-initialized (``module 'numpy' has no attribute 'intp'`` a few seconds later).
    Only Python's own Ctrl-C handler is replaced, and only in the main thread: an ignored SIGINT (a background
    job) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``tformer train: error: ...; see tformer train --help``), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tformer", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)  # of the same class
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The namespace of ``argv``; arguments the command does not know are reported by the command's parser."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser._subparsers._group_actions[0].choices[args.command]  # argparse keeps them only here
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    stdout = sys.stdout
    if stdout is not None:  # None: no console at all (pythonw)
        sys.stdout = _GuardedStdout(stdout)
    try:
        try:
            args = parse(build_parser(), argv)  # no torch yet: --help and a mistyped command answer at once
            if getattr(args, "needs_torch", True):
                with _ctrl_c_held_back():  # the command's imports; Ctrl-C meanwhile ends it once they are done
                    importlib.import_module("torch")
            return int(args.func(args) or 0)
        finally:  # what is still buffered (stdout is a pipe or a file) fails here, inside the handlers below
            if sys.stdout is not None:
                sys.stdout.flush()
    except KeyboardInterrupt:  # e.g. during imports or tokenization, before a loop's own Ctrl-C handling
        print("tformer: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OutputError, BrokenPipeError) as err:  # a BrokenPipeError directly: a write that went around sys.stdout
        sys.stdout = stdout
        _discard_stdout()
        cause = err.__cause__ if isinstance(err, OutputError) else err
        if isinstance(cause, BrokenPipeError):  # the reader is gone: nobody to tell
            return EXIT_BROKEN_PIPE
        print(f"tformer: error writing output: {cause}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
