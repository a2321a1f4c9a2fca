"""``tformer convert SRC --out DIR``: between tformer runs, Hugging Face model directories and GGUF files.

* a ``.gguf`` file -> a Hugging Face directory (weights dequantized, stored in ``--dtype``, default float32;
  Hugging Face's names and Q/K order; the tokenizer with its special tokens and chat template);
* a tformer run or checkpoint -> a Hugging Face directory (:func:`tformer.save_pretrained`: its config must map onto
  a family);
* a Hugging Face directory -> a tformer run (``DIR/checkpoints/step-000000``, weights only), which ``tformer sample``
  and ``tformer translate`` read like any run. Its ``train_config`` records the source and its special ids.

``DIR`` must not exist or be empty; a failed conversion leaves nothing there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tformer.cli.common import DTYPES, checkpoint_path, dtype_flag, load_run, report_errors, torch_dtype


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a GGUF file or a tformer run to a Hugging Face directory, or a Hugging Face directory to a run",
        description="GGUF file -> Hugging Face directory; tformer run -> Hugging Face directory; Hugging Face "
        "directory -> tformer run. --out must not exist or be an empty folder; nothing is written on error.",
    )
    p.add_argument(
        "src",
        help="a .gguf file, a tformer run or checkpoint directory, a Hugging Face directory, or a shipped model's name "
        "(smollm2, minilm)",
    )
    p.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        type=dtype_flag("not stored; tformer sample and explore --quantize int8 make them at load"),
        choices=DTYPES,
        default=None,
        help="store the weights in this dtype (default: as read)",
    )
    p.set_defaults(func=_run_convert)


def _check_out(out: str) -> Path:
    """``--out`` as a path a model directory or run can be made at, checked before any conversion work."""
    from tformer.interop.hf import check_new_directory
    from tformer.interop.keys import InteropError

    if not out:
        raise ValueError("--out must name a directory")
    try:
        check_new_directory(Path(out))
    except InteropError as err:
        raise ValueError(f"--out {err}") from None
    return Path(out)


def convert(
    src: str, out: str, dtype: str | None = None, note: Callable[[str], None] | None = None
) -> tuple[Path, str]:
    """Convert ``src`` into ``out``; returns the path written and what it now holds, in words. ``note`` gets a
    line as the conversion of a GGUF file starts (tens of seconds for a 100M-parameter model)."""
    from tformer.interop import InteropError, is_pretrained, load_pretrained, save_pretrained
    from tformer.models import DecoderLM

    path = _check_out(out)
    src = checkpoint_path(src)  # a shipped model's name (smollm2, minilm): its installed file
    if Path(src).suffix == ".gguf" and Path(src).is_file():
        from tformer.interop.gguf import convert_gguf, has_gguf_magic

        if note and has_gguf_magic(Path(src)):  # the long case: every tensor dequantized and written
            note(f"converting {Path(src).name} into {path} ...")

        stored = torch_dtype(dtype or "float32")
        return convert_gguf(Path(src), path, stored), f"a Hugging Face model directory ({dtype or 'float32'})"
    if is_pretrained(src):
        pretrained = load_pretrained(src, dtype=torch_dtype(dtype))
        stored = str(next(pretrained.model.parameters()).dtype).removeprefix("torch.")
        kind = "language-model" if isinstance(pretrained.model, DecoderLM) else "seq2seq"
        return _to_run(pretrained, path), f"a tformer {kind} run ({stored})"
    ckpt = load_run(src, None, "cpu", "convert")
    ckpt.model.to(torch_dtype(dtype) if dtype is not None else _stored_dtype(ckpt.path))
    try:
        save_pretrained(ckpt.model, path, tokenizer=ckpt.tokenizer, generation=_generation(ckpt))
    except InteropError as err:
        if ckpt.kind == "seq2seq" and "converted_from" not in ckpt.train_config:
            raise InteropError(
                f"{err}. A seq2seq run of tformer train exports to none: no train flag sets pair_layout or "
                "logits_bias, which Marian's layout needs; tformer translate and explore read the run itself"
            ) from None
        raise
    if not (path / "tokenizer.json").is_file():
        print(
            f"tformer convert: note: the run's {ckpt.tokenizer.kind} tokenizer has no tokenizer.json form "
            "(only BPE tokenizers do); the directory holds the model alone (transformers' AutoTokenizer finds none)",
            file=sys.stderr,
        )
    stored = str(next(ckpt.model.parameters()).dtype).removeprefix("torch.")
    return path, f"a Hugging Face model directory ({stored})"


def _stored_dtype(checkpoint: Path):
    """The dtype a checkpoint's weights are stored in (a run is read into float32): what "as read" keeps."""
    from safetensors import safe_open

    from tformer.training.checkpoint import WEIGHTS

    with safe_open(checkpoint / WEIGHTS, "pt") as f:
        names = list(f.keys())
        return f.get_tensor(names[0]).dtype if names else torch_dtype("float32")


def _generation(ckpt):
    """The special ids a converted run recorded (several end-of-sequence ids, a decoder start), else ``None``: the
    tokenizer's then."""
    from tformer.interop.family import GenerationIds

    gen = ckpt.train_config.get("generation")
    if not gen:
        return None
    return GenerationIds(gen.get("bos"), tuple(gen.get("eos") or ()), gen.get("pad"), gen.get("decoder_start"))


def _to_run(pretrained, path: Path) -> Path:
    from tformer.interop import MODEL_CLASSES
    from tformer.training.checkpoint import save_checkpoint

    kind = next(k for k, cls in MODEL_CLASSES.items() if type(pretrained.model) is cls)
    if kind == "encoder":
        raise ValueError(
            f"{pretrained.path} holds an encoder ({pretrained.family}); tformer runs hold language models and "
            "seq2seq models (use the directory itself with `tformer embed`)"
        )
    if pretrained.tokenizer is None:
        raise ValueError(f"{pretrained.path}: no tokenizer.json; a tformer run needs its tokenizer")
    gen = pretrained.generation
    source = {
        "converted_from": str(pretrained.path),
        "family": pretrained.family,
        "generation": {"bos": gen.bos, "eos": list(gen.eos), "pad": gen.pad, "decoder_start": gen.decoder_start},
    }
    try:
        save_checkpoint(
            path, model=pretrained.model, tokenizer=pretrained.tokenizer, kind=kind, step=0, train_config=source
        )
    except BaseException:
        import shutil

        shutil.rmtree(path, ignore_errors=True)  # it was absent or empty before
        raise
    return path


def _run_convert(args: argparse.Namespace) -> int:
    def run() -> int:
        written, what = convert(
            args.src,
            args.out,
            args.dtype,
            note=lambda line: print(f"tformer convert: {line}", file=sys.stderr, flush=True),
        )
        print(f"wrote {what} to {written}")
        if what.startswith("a tformer language-model run"):  # weights alone: --resume has nothing to continue
            print(f"to train it further: tformer train --out NEW_RUN --init-from {written} --data YOUR_TEXT")
        return 0

    return report_errors("convert", run)
