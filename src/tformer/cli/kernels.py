"""``tformer kernels``: build the CPU decode kernels now (once per machine; they are otherwise built at their first
use) and print the loops they take on this CPU, one ``kind: path`` line each. A thin skin over
:func:`tformer.engine.kernels.build_kernels`; exits 1 saying why where they cannot be built.
"""

from __future__ import annotations

import argparse
import sys


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels",
        help="build the CPU decode kernels now and print the loops they take on this CPU",
        description="Build tformer's C++ decode kernels for this CPU (once per machine, about 20-30 s; otherwise "
        "they are built at their first use) and print the loop each kind of weights takes (bf16, int8, f32: "
        "avx512_bf16, avx512_vnni, avx512, avx2, avx2_bits or portable). Needs a C++ compiler (CXX, else c++); "
        "TFORMER_KERNELS=0 turns the kernels off.",
    )
    p.set_defaults(func=run_kernels)


def run_kernels(args: argparse.Namespace) -> int:
    from tformer.engine import kernels

    try:
        paths = kernels.build_kernels()
    except RuntimeError as error:
        print(f"tformer kernels: {error}", file=sys.stderr)
        return 1
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
