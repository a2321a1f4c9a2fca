"""``tformer experiment NAME`` and ``tformer report``: thin skins over :mod:`tformer.experiments`.

tformer experiment scaling --out out/experiments     # one experiment: prints its table, writes its PNG
tformer experiment --list                            # the experiments and the questions they answer
tformer report --out docs/report [--quick]           # all of them, and report.md
tformer report --only trained --checkpoint MODEL     # the claims on a trained checkpoint's weights
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tformer.experiments import EXPERIMENTS, load
from tformer.experiments.report import format_console, run_and_plot, write_report


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
        "--only", default=None, help=f"comma-separated subset of: {names}; 'trained': only the --checkpoint sections"
    )
    r.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="PATH",
        help="also measure the claims on this trained model (a tformer run, a Hugging Face directory or a GGUF file); "
        "repeatable",
    )
    r.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**63) (default: each experiment's own)")
    r.set_defaults(func=_run_report)


def _check_out_and_seed(args: argparse.Namespace) -> None:
    """``ValueError`` for an ``--out`` that cannot be a folder or a ``--seed`` torch cannot take, before any run."""
    blocking = next((p for p in (args.out, *args.out.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        where = "" if blocking == args.out else f" lies under {blocking}, which"
        raise ValueError(f"--out {args.out}{where} is a file; give a folder")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be an integer in [0, 2**63); got {args.seed}")


def _run_experiment(args: argparse.Namespace) -> int:
    if args.list:
        for name in EXPERIMENTS:
            module = load(name)
            print(f"{name:<15} {module.QUESTION:<13} {module.TITLE}")
        return 0
    try:
        if args.name is None:
            raise ValueError(f"give an experiment NAME (one of: {', '.join(EXPERIMENTS)}) or --list")
        load(args.name)
        _check_out_and_seed(args)
    except ValueError as exc:
        print(f"tformer experiment: error: {exc}", file=sys.stderr)
        return 2
    run = run_and_plot(args.name, args.out, "quick" if args.quick else "report", args.seed)
    print(format_console(run))
    return 0


def _run_report(args: argparse.Namespace) -> int:
    names = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    try:
        if names == ["trained"]:
            if not args.checkpoint:
                raise ValueError("--only trained needs at least one --checkpoint PATH")
            names = []
        elif names == []:
            raise ValueError(f"--only names no experiment; give some of: {', '.join(EXPERIMENTS)}, or trained")
        for name in names or []:
            load(name)
        for path in args.checkpoint:
            if not Path(path).exists():
                raise ValueError(f"--checkpoint {path}: no such file or directory")
        _check_out_and_seed(args)
    except ValueError as exc:
        print(f"tformer report: error: {exc}", file=sys.stderr)
        return 2
    from tformer.training.checkpoint import CheckpointError

    try:
        write_report(args.out, "quick" if args.quick else "report", names, args.seed, checkpoints=args.checkpoint)
    except (ValueError, CheckpointError) as exc:  # a checkpoint that does not load, or has no tokenizer
        print(f"tformer report: error: {exc}", file=sys.stderr)
        return 2
    return 0
