"""Building and loading the C++ kernels: :func:`ready` compiles them for this CPU the first time (``-march=native``,
with ``torch.utils.cpp_extension``), says so on stderr, and loads them; :func:`build` does it on demand and reports.

The library is cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder named by a
hash of the sources, the flags, torch's and Python's versions and the CPU's feature flags, so that a change of any of
them builds anew. A failed build (no compiler, an unsupported flag) is warned about once; the callers then use
PyTorch's own ops. ``TFORMER_KERNELS=0`` turns the kernels off (nothing is built); ``TFORMER_KERNEL_CFLAGS`` adds
compiler flags (the tests build the AVX2 and portable paths with ``-mno-avx512f`` and ``-mno-avx2``). README.md in
this folder has the paths, the rounding contract, and how to add an instruction set.

Shapes: M, I, O; B, H, L, Dv (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

FOLDER = Path(__file__).parent
SOURCES = tuple(FOLDER / name for name in ("gemv.cpp", "attention.cpp", "block.cpp"))
HEADERS = tuple(sorted(FOLDER.glob("*.h")))  # not compiled on their own, but part of the build's hash
WEIGHT_KINDS = ("bfloat16", "float32", "int8")  # the kinds with a prefetch distance each, in gemv.h's enum's order
BUILD_SECONDS = "about 20-30 s"  # what the notice promises (BENCHMARKS.md has the measured times)

_state: dict[str, object] = {"ready": None, "error": None}  # ready: None = not tried yet, then True or False


def turned_off() -> bool:
    """Whether the user turned the kernels off for this process (``TFORMER_KERNELS=0``)."""
    return os.environ.get("TFORMER_KERNELS", "1") == "0"


def compiler() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would call (``CXX``, else ``c++``), as a path; ``None`` when
    there is none, so that the kernels cannot be built here."""
    from torch.utils import cpp_extension

    return shutil.which(cpp_extension.get_cxx_compiler())


def _cpuinfo(*fields: str) -> str:
    """The first line of ``/proc/cpuinfo`` naming one of ``fields``; off Linux, ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(fields)), "")
    except OSError:
        return platform.processor()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (``avx512f``, ``amx_tile``, ...); empty off Linux."""
    line = _cpuinfo("flags", "Features")
    return set(line.partition(":")[2].split())


def cflags() -> list[str]:
    """The compiler flags: this CPU's instruction sets, and ``TFORMER_KERNEL_CFLAGS`` added."""
    return ["-O3", "-march=native", "-fopenmp", *os.environ.get("TFORMER_KERNEL_CFLAGS", "").split()]


def build_name(flags: list[str]) -> str:
    """The library's name for these compiler flags: a hash of everything the build depends on."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    python = f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}"
    for part in (*flags, torch.__version__, python, " ".join(sorted(cpu_flags()))):
        digest.update(b"\0" + part.encode())
    return f"tformer_kernels_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where the library ``name`` is built and cached: ``TORCH_EXTENSIONS_DIR`` (or torch's default root) / name."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name


def is_built(name: str) -> bool:
    """Whether the library ``name`` is built already (loading it compiles nothing)."""
    return (build_directory(name) / f"{name}.so").is_file()


def ready() -> bool:
    """Build (the first time on this machine) and load the kernels; ``True`` when they can run. Never raises: a
    failed build is warned about once and remembered for the process."""
    if _state["ready"] is not None or torch.compiler.is_compiling():
        return _state["ready"] is True
    if turned_off():
        return False
    try:
        _load(cflags())
    except Exception as error:  # no compiler, an unsupported flag, a failed link: fall back, say so once
        lines = str(error).strip().splitlines() or [type(error).__name__]
        message = next((line.strip() for line in lines if "error:" in line), lines[0])[:300]  # the compiler's own
        _state.update(ready=False, error=message)
        warnings.warn(
            f"tformer: the decode kernels did not build ({message}); layers use F.linear and attention PyTorch's "
            "kernels (correct, slower). TFORMER_KERNELS=0 skips the attempt.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    for index, weights in enumerate(WEIGHT_KINDS):
        torch.ops.tformer.gemv_prefetch(default_prefetch_rows(weights), index)
    _state["ready"] = True
    return True


def _load(flags: list[str]) -> None:
    """Compile (if not built yet, with a notice on stderr before and after) and load the library."""
    from torch.utils import cpp_extension

    name = build_name(flags)
    folder = build_directory(name)
    building = not is_built(name)
    if building:  # on stderr whatever it is (a terminal, a pipe, a log): a silent 20-30 s looks like a hang
        print(
            f"tformer: building the decode kernels for this CPU (once, {BUILD_SECONDS}) ...",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    if building:
        print(
            f"tformer: built the decode kernels in {time.perf_counter() - start:.1f} s ({folder})",
            file=sys.stderr,
            flush=True,
        )
    torch.library.register_fake("tformer::gemv_bf16")(_gemv_shape)
    torch.library.register_fake("tformer::gemv_int8")(_gemv_shape)
    torch.library.register_fake("tformer::gemv_f32")(_gemv_shape)
    torch.library.register_fake("tformer::decode_attention")(_attention_shape)
    torch.library.register_fake("tformer::decode_blocks")(_block_shape)


def _gemv_shape(x: Tensor, weight: Tensor, *rest) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # (M, O) from x (M, I), weight or int8 codes (O, I)


def _attention_shape(query: Tensor, key: Tensor, value: Tensor, mask, is_causal: bool, scale: float) -> Tensor:
    return query.new_empty(*query.shape[:-1], value.shape[-1])  # (B, H, L, Dv), contiguous


def _block_shape(x: Tensor, *args) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # x's shape; the caches change in place


def build_error() -> str | None:
    """Why the kernels did not build, or ``None``."""
    return _state["error"]  # type: ignore[return-value]


def paths() -> dict[str, str] | None:
    """The loops the build took on this CPU for each kind of weights, e.g. ``{"bf16": "avx512_bf16", "int8":
    "avx512_vnni", "f32": "avx512"}`` (README.md in this folder, "Paths"); ``None`` when not built."""
    if not ready():
        return None
    return dict(part.split("=") for part in torch.ops.tformer.gemv_paths().split())


def default_prefetch_rows(weights: str = "bfloat16") -> int:
    """The software prefetch distance (rows of W ahead) the kernels start with for ``weights`` (``"bfloat16"``,
    ``"float32"`` or ``"int8"`` codes). The rule: 8 rows for int8 codes on AVX-512 and for every kind on CPUs with
    AMX, else none (the hardware prefetchers keep up alone there; BENCHMARKS.md, "software prefetch")."""
    _check_weights(weights)
    flags = cpu_flags()
    return 8 if "amx_tile" in flags or (weights == "int8" and "avx512f" in flags) else 0


def prefetch_rows(rows: int | None = None, *, weights: str = "bfloat16") -> int:
    """How many rows of a weight matrix ahead each thread of a matrix-vector kernel asks the CPU for (a software
    prefetch into L2; 0: none), for one kind of ``weights``; set it to ``rows`` (0 to 1024) if given. Returns the
    distance in force before the call (0 when the kernels are not built). It changes no result, only the speed:
    ``benchmarks/decode_step.py`` compares settings in one process."""
    _check_weights(weights)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= 1024):
        raise ValueError(f"prefetch_rows: rows={rows!r}; need an int from 0 (no software prefetch) to 1024")
    if not ready():
        return 0
    return int(torch.ops.tformer.gemv_prefetch(-1 if rows is None else rows, WEIGHT_KINDS.index(weights)))


def _check_weights(weights: str) -> None:
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights={weights!r}: need one of {', '.join(map(repr, WEIGHT_KINDS))}")


def build_kernels() -> dict[str, str]:
    """Build (if not built yet) and load the kernels now; their :func:`paths`. ``RuntimeError`` saying why when they
    cannot be: turned off, no compiler, or the compiler's error."""
    if turned_off():
        raise RuntimeError("the kernels are turned off (TFORMER_KERNELS=0)")
    if compiler() is None:
        raise RuntimeError("no C++ compiler found (CXX, else c++ on PATH); install one, e.g. g++")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # said below, as the error
        built = ready()
    if not built:
        raise RuntimeError(f"the kernels did not build: {build_error()}")
    return paths()  # type: ignore[return-value]
