"""What the commands that load a model share: loading a tformer run (and naming a good older checkpoint when the
newest is damaged), a Hugging Face directory or a GGUF file alike, and turning bad input into one line on stderr
with exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
OTHER_COMMAND = {"lm": "sample", "seq2seq": "translate", "encoder": "embed"}
KIND_NAME = {"lm": "a language model", "seq2seq": "a seq2seq model", "encoder": "an encoder"}


def utf8_error(err: UnicodeDecodeError) -> str:
    """What a strict UTF-8 ``UnicodeDecodeError`` found, for a message: ``not valid UTF-8 (byte 0xff at offset 3)``."""
    return f"not valid UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start})"


def dtype_flag(int8: str) -> Callable[[str], str]:
    """The ``type`` of a ``--dtype`` flag: the name itself, or argparse's error naming the choices, and for an
    integer dtype where int8 weights are had instead (``int8``: e.g. ``--quantize int8``)."""

    def check(value: str) -> str:
        if value in DTYPES:
            return value
        hint = f"; int8 weights: {int8}" if value.lower().startswith(("int", "uint", "q")) else ""
        raise argparse.ArgumentTypeError(f"invalid dtype {value!r} (choose from {', '.join(DTYPES)}){hint}")

    return check


def add_device_flags(p, *, quantize: bool = False) -> None:
    """The flags of every command that runs a loaded model: ``--device``, ``--dtype`` and, where the command offers
    it, ``--quantize`` (apply with :func:`apply_quantize`)."""
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, or auto (CUDA if there is a GPU) (default cpu)")
    int8 = (
        "--quantize int8 (with --dtype for the activations)"
        if quantize
        else "tformer sample and explore --quantize int8"
    )
    p.add_argument(
        "--dtype", type=dtype_flag(int8), choices=DTYPES, default=None, help="compute in this dtype (default: as saved)"
    )
    if quantize:
        p.add_argument(
            "--quantize",
            choices=["int8"],
            default=None,
            help="int8: weight-only int8 with per-channel scales (tformer.quantize; lossy, so never the default)",
        )


def apply_quantize(model: Any, scheme: str | None) -> None:
    """``--quantize``: quantize ``model`` in place when a scheme was asked for."""
    if scheme:
        from tformer.engine.quantization import quantize

        quantize(model, scheme)


@dataclass
class Loaded:
    """A model ready for a command: its tokenizer, the ids that end (``eos``, any of them) and start (``start``: the
    decoder's first token of a seq2seq model) generation, and where it came from."""

    model: Any
    tokenizer: Any
    path: Path
    eos: tuple[int, ...]
    start: int | None


def torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def checkpoint_path(checkpoint: str) -> str:
    """``--checkpoint`` as a path: the name of a model tformer ships (``smollm2``, ``minilm``) becomes its installed
    file (a path that exists wins); ``ValueError`` for neither an existing path nor a known name (listing the names),
    or for a known name whose package is not installed (naming it)."""
    from tformer.interop import shipped

    if Path(checkpoint).exists():
        return checkpoint  # as given: messages name it as the user wrote it
    path = shipped.locate(checkpoint)
    if not path.exists():
        raise ValueError(shipped.missing(checkpoint))
    return str(path)


def load_model(path: str, kind: str, device: str, command: str, dtype: str | None = None) -> Loaded:
    """The model at ``path`` (a tformer run or checkpoint, a Hugging Face directory, a ``.gguf`` file, or a shipped
    model's name) on ``device``, in ``dtype`` (``None``: as saved); it must be a ``kind`` model and have a tokenizer."""
    from tformer.engine import accelerate, pack_weights
    from tformer.interop import is_pretrained
    from tformer.runtime import resolve_device

    path = checkpoint_path(path)
    if not is_pretrained(path):
        ckpt = load_run(path, kind, device, command)
        if dtype is not None:
            ckpt.model.to(torch_dtype(dtype))
        pack_weights(accelerate(ckpt.model))  # as load_pretrained does: the kernels, one block of memory
        eos, start = ckpt.special_ids()
        return Loaded(ckpt.model, ckpt.tokenizer, ckpt.path, eos, start)
    from tformer.interop import MODEL_CLASSES, load_pretrained

    note_first_conversion(path, command)
    pretrained = load_pretrained(path, dtype=torch_dtype(dtype), device=resolve_device(device))
    held = next(k for k, cls in MODEL_CLASSES.items() if type(pretrained.model) is cls)
    if held != kind:
        raise ValueError(
            f"{path} holds {KIND_NAME[held]} ({pretrained.family}); `tformer {command}` needs {KIND_NAME[kind]}: use "
            f"`tformer {OTHER_COMMAND[held]}`"
        )
    if pretrained.tokenizer is None:
        raise ValueError(f"{path}: no tokenizer.json beside the weights; `tformer {command}` needs one to read text")
    gen = pretrained.generation
    eos = gen.eos or (() if pretrained.tokenizer.eos_id is None else (pretrained.tokenizer.eos_id,))
    start = gen.decoder_start if kind == "seq2seq" else gen.bos
    return Loaded(pretrained.model, pretrained.tokenizer, Path(path), tuple(eos), start)


def note_first_conversion(path: str, command: str) -> None:
    """Say on stderr that a GGUF file is about to be converted (its first load: dequantized and written to the
    cache, tens of seconds for a 100M-parameter model; later loads read the cache)."""
    from tformer.interop.gguf import cache_folder, has_gguf_magic, is_cached

    file = Path(path)  # a file that is not GGUF is refused by the loader, with nothing to note
    if file.suffix == ".gguf" and file.is_file() and has_gguf_magic(file) and not is_cached(file):
        print(
            f"tformer {command}: converting {file.name} to safetensors (first use; cached in {cache_folder(file)})",
            file=sys.stderr,
        )


def load_run(path: str, kind: str | None, device: str, command: str):
    """The checkpoint at ``path`` (a checkpoint or a run directory) on ``device``, which must hold a ``kind`` model
    (``None``: any)."""
    from tformer.runtime import resolve_device
    from tformer.training.resume import load_newest

    ckpt = load_newest(path, map_location=resolve_device(device))  # a damaged newest checkpoint: names an older one
    if kind is not None and ckpt.kind != kind:
        other = OTHER_COMMAND[ckpt.kind]
        raise ValueError(
            f"{ckpt.path} holds {KIND_NAME[ckpt.kind]} ({ckpt.kind!r}); `tformer {command}` needs {KIND_NAME[kind]} "
            f"({kind!r}): use `tformer {other}`"
        )
    return ckpt


def report_errors(command: str, run: Callable[[], int]) -> int:
    """``run()``, or exit code 2 with one line on stderr for a bad setting or checkpoint, or exit code 1 with one
    line for what the system refused (a full disk, a file gone mid-run): writers leave nothing half-written."""
    from tformer.training.checkpoint import CheckpointError

    try:
        return run()
    except (ValueError, CheckpointError) as err:
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if isinstance(err, BrokenPipeError):  # the reader of stdout is gone: tformer.cli.main ends quietly
            raise
        print(f"tformer {command}: error: {err}", file=sys.stderr)
        return 1
