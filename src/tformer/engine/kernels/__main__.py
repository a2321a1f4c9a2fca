"""``python -m tformer.engine.kernels``: build the kernels now and print their paths (as ``tformer kernels``)."""

import argparse

from tformer.cli.kernels import run_kernels

raise SystemExit(run_kernels(argparse.Namespace()))
