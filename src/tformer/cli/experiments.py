"""``tformer experiment NAME`` and ``tformer report``: thin skins over :mod:`tformer.experiments`.

tformer experiment scaling --out out/experiments     # one experiment: prints its table, writes its PNG
tformer experiment --list                            # the experiments and the questions they answer
tformer report --out runs/report [--quick]           # all of them, and report.md (default --out out/report)
tformer report --out runs/report --checkpoint smollm2 --checkpoint minilm  # and the claims on trained weights
tformer report --only trained --checkpoint MODEL     # those alone (a run, a Hugging Face folder, a GGUF file)
tformer report --only scaling,trained --checkpoint MODEL  # with some experiments

Each stage says on stderr when it starts and how long it took, so a long run is never silent (stdout holds the
tables, and may be a file).

Everything is checked before any experiment runs (the names, each --checkpoint's kind, that --out can be made and
written); bad input is one line on stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tformer.experiments import EXPERIMENTS, load

TRAINED = "trained"  # in --only: the --checkpoint sections


def add_cli(subparsers) -> None:
    names = ", ".join(EXPERIMENTS)
    p = subparsers.add_parser(
        "experiment",
        help="run one experiment that checks a claim of the source document (table + PNG)",
        description=f"Run one experiment: print its table and measured figures, write its PNG. Known: {names}.",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help=f"one of: {names}")
    p.add_argument("--list", action="store_true", help="list the experiments and the questions they answer")
    p.add_argument(
        "--out", type=Path, default=Path("out/experiments"), help="folder for the PNG(s) (default out/experiments)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds) instead of the report's")
    p.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**63) (default: each experiment's own)")
    p.set_defaults(func=_run_experiment)

    r = subparsers.add_parser(
        "report",
        help="run every experiment and write report.md with all tables and pictures",
        description="Run every experiment and write OUT/report.md (one section per question of the source).",
    )
    r.add_argument(
        "--out", type=Path, default=Path("out/report"), help="folder for report.md and the PNGs (default out/report)"
    )
    r.add_argument("--quick", action="store_true", help="tiny sizes: seconds instead of minutes")
    r.add_argument(
        "--only",
        default=None,
        help=f"comma-separated subset of: {names}, {TRAINED} ('{TRAINED}': the --checkpoint sections, e.g. --only "
        f"scaling,{TRAINED}; --only {TRAINED}: those alone; --checkpoint adds its sections to any --only)",
    )
    r.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="PATH",
        help="also measure the claims on this trained model (a tformer run, a Hugging Face directory, a GGUF file, or "
        "smollm2 / minilm: the shipped models; the committed report has both); repeatable",
    )
    r.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**63) (default: each experiment's own)")
    r.set_defaults(func=_run_report)


def _check_seed(args: argparse.Namespace) -> None:
    """``ValueError`` for a ``--seed`` torch cannot take, before any run. (``--out`` is checked, and made, by
    :class:`tformer.experiments.report.Staging` before any run too.)"""
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be an integer in [0, 2**63); got {args.seed}")


def _only(args: argparse.Namespace) -> list[str] | None:
    """The experiments ``--only`` names (``None``: all), without ``trained``, which needs a ``--checkpoint``."""
    if args.only is None:
        return None
    asked = list(dict.fromkeys(n.strip() for n in args.only.split(",") if n.strip()))
    if not asked:
        raise ValueError(f"--only names no experiment; give some of: {', '.join(EXPERIMENTS)}, {TRAINED}")
    for name in asked:
        if name != TRAINED and name not in EXPERIMENTS:
            raise ValueError(
                f"--only: unknown experiment {name!r}; give some of: {', '.join(EXPERIMENTS)}, {TRAINED} (the "
                "--checkpoint sections)"
            )
    if TRAINED in asked and not args.checkpoint:
        raise ValueError(f"--only {TRAINED} needs at least one --checkpoint PATH")
    return [n for n in asked if n != TRAINED]


def _run_experiment(args: argparse.Namespace) -> int:
    from tformer.experiments.report import OutputFolderError, format_console, write_experiment

    if args.list:
        for name in EXPERIMENTS:
            module = load(name)
            print(f"{name:<15} {module.QUESTION:<13} {module.TITLE}")
        return 0
    try:
        if args.name is None:
            raise ValueError(f"give an experiment NAME (one of: {', '.join(EXPERIMENTS)}) or --list")
        load(args.name)
        _check_seed(args)
    except ValueError as exc:
        print(f"tformer experiment: error: {exc}", file=sys.stderr)
        return 2
    size = "quick" if args.quick else "report"
    try:
        run = write_experiment(args.name, args.out, size, args.seed, progress=_progress("experiment"))
    except OutputFolderError as exc:
        print(f"tformer experiment: error: --out {exc}", file=sys.stderr)
        return 2
    print(format_console(run))
    return 0


def _progress(command: str):
    """A line on stderr as each stage starts and ends, flushed: seen whether or not stdout is a terminal."""
    return lambda message: print(f"tformer {command}: {message}", file=sys.stderr, flush=True)


def _run_report(args: argparse.Namespace) -> int:
    from tformer.cli.common import checkpoint_path

    try:
        names = _only(args)
        checkpoints = []
        for path in args.checkpoint:  # smollm2, minilm: the installed files
            try:
                checkpoints.append(checkpoint_path(path))
            except ValueError as err:
                raise ValueError(f"--checkpoint {err}") from None
        _check_seed(args)
    except ValueError as exc:
        print(f"tformer report: error: {exc}", file=sys.stderr)
        return 2
    from tformer.experiments.report import OutputFolderError, write_report
    from tformer.training.checkpoint import CheckpointError

    size = "quick" if args.quick else "report"
    try:  # checks each checkpoint's kind and --out before running anything; writes nothing if it fails later
        write_report(
            args.out,
            size,
            names,
            args.seed,
            echo=lambda text: print(text, flush=True),
            checkpoints=checkpoints,
            progress=_progress("report"),
        )
    except OutputFolderError as exc:
        print(f"tformer report: error: --out {exc}", file=sys.stderr)
        return 2
    except (ValueError, CheckpointError) as exc:  # a checkpoint that is not one, does not load, or has no tokenizer
        print(f"tformer report: error: {exc}", file=sys.stderr)
        return 2
    return 0
