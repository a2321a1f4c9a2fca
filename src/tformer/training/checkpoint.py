"""Checkpoints: a directory per saved step, written atomically, verified when read.

Layout of a training run ``OUT/``::

    OUT/checkpoints/step-000400/
        checkpoint.json      manifest: format, kind ("lm" | "seq2seq"), step, model and training configs,
                             and the size and SHA-256 of every other file (written last)
        model.safetensors    the weights; tied matrices stored once, keys without ``_orig_mod.``/``module.``
        tokenizer.json       the tokenizer (tformer.tokenizers)
        trainer_state.pt     optimizer, RNG and data-sampler state, for an exact ``--resume``

Atomicity: a checkpoint is written into ``OUT/checkpoints/.tmp-...`` (each file fsync'ed, then the directory),
then renamed to ``step-NNNNNN`` (one atomic ``rename``) and the parent fsync'ed. A ``step-*`` directory therefore
exists only complete, and a crash at any moment (even ``kill -9`` mid-write) leaves the last complete one intact;
older ones are pruned only after the new one is in place. Leftover ``.tmp-*`` directories are ignored.

Reading checks the manifest (the type of every field used; listed files must be plain names inside the
directory, so a hand-edited ``"../x"`` is refused) and verifies every file against it, so a truncated,
corrupted, foreign or hand-mangled directory raises :class:`CheckpointError` naming the file and what is wrong,
instead of loading garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tformer.config import TransformerConfig
from tformer.engine.quantization import is_quantized
from tformer.models import DecoderLM, EncoderDecoder
from tformer.runtime import unwrap
from tformer.tokenizers import TOKENIZER_FILE, Tokenizer, tokenizer_from_dict

Kind = Literal["lm", "seq2seq"]
FORMAT = "tformer-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
WEIGHTS = "model.safetensors"
STATE = "trainer_state.pt"
CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DistributedDataParallel


class CheckpointError(Exception):
    """A checkpoint that cannot be read: the message names the path and what is wrong."""


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``model`` is in eval mode on ``map_location``."""

    model: DecoderLM | EncoderDecoder
    tokenizer: Tokenizer
    kind: Kind
    config: TransformerConfig
    step: int
    train_config: dict[str, Any]
    path: Path
    trainer_state: dict[str, Any] | None = field(default=None, repr=False)

    def special_ids(self) -> tuple[tuple[int, ...], int | None]:
        """``(eos ids, start id)`` for generation: a converted model's (``train_config["generation"]``, written by
        ``tformer convert``), else the tokenizer's. The start id is a seq2seq decoder's first input, or an LM's bos."""
        gen = self.train_config.get("generation") or {}
        eos = gen.get("eos") or (() if self.tokenizer.eos_id is None else (self.tokenizer.eos_id,))
        start = gen.get("decoder_start" if self.kind == "seq2seq" else "bos")
        return tuple(eos), self.tokenizer.bos_id if start is None else start


def model_class(kind: str) -> type[nn.Module]:
    if kind == "lm":
        return DecoderLM
    if kind == "seq2seq":
        return EncoderDecoder
    raise ValueError(f"unknown model kind {kind!r}; expected 'lm' or 'seq2seq'")


def strip_wrapper_prefixes(key: str) -> str:
    """``"_orig_mod.module.decoder.x"`` -> ``"decoder.x"``."""
    while key.startswith(_WRAPPER_PREFIXES):  # each a first name and its dot
        key = key.split(".", 1)[1]
    return key


def _shared_groups(state: dict[str, Tensor]) -> list[list[str]]:
    """Names of the state-dict entries that are the same tensor (tied weights), each group sorted."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        groups.setdefault((t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), []).append(name)
    return [sorted(g) for g in groups.values()]


def model_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Plain keys; each tied matrix once (safetensors refuses aliased tensors), contiguous, on the CPU."""
    state = unwrap(model).state_dict()
    keep = {group[0] for group in _shared_groups(state)}
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k in keep}


def load_model_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load ``model.safetensors`` at ``path`` into ``model`` (plain, compiled or DDP-wrapped).

    Keys saved with ``_orig_mod.``/``module.`` prefixes are accepted; a missing key is fine only when it is tied
    to a loaded one. Anything else (missing, unexpected, wrong shape) is a :class:`CheckpointError`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the weights (truncated or not safetensors?): {err}") from err
    tensors = {strip_wrapper_prefixes(k): v for k, v in tensors.items()}
    target = unwrap(model)
    expected = target.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    tied_ok = set()
    for group in _shared_groups(expected):
        if any(name in tensors for name in group):
            tied_ok.update(group)
    missing = sorted(set(expected) - set(tensors) - tied_ok)
    if unexpected or missing:
        raise CheckpointError(
            f"{path}: weights do not fit a {type(target).__name__} with this config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(t.shape)} but the model expects {tuple(expected[name].shape)}"
            )
    target.load_state_dict(tensors, strict=False)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save_weights(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, leaving the file mode a plain ``open`` gives (0666 less the umask, like the
    other checkpoint files): safetensors 0.8 writes through a temporary file created 0600."""
    from safetensors.torch import save_file

    with open(path, "wb"):  # the mode a new file gets here (umask, default ACLs)
        pass
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _write_files(
    tmp: Path, model: nn.Module, tokenizer: Tokenizer, kind: Kind, trainer_state: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """The weights, the tokenizer and the trainer state, each fsync'ed; returns the manifest's ``files``."""
    _save_weights(model_state_dict(model), tmp / WEIGHTS, metadata={"format": "pt", "kind": kind})
    (tmp / TOKENIZER_FILE).write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")
    names = [WEIGHTS, TOKENIZER_FILE]
    if trainer_state is not None:
        torch.save(trainer_state, tmp / STATE)
        names.append(STATE)
    files = {}
    for name in names:
        _fsync_file(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    return files


def _swap_in(tmp: Path, final: Path) -> Path:
    """Rename the complete ``tmp`` to ``final`` (one atomic rename; the same step saved again is moved aside)."""
    if final.exists():
        old = final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)
    return final


def save_checkpoint(
    out: str | os.PathLike,
    *,
    model: nn.Module,
    tokenizer: Tokenizer,
    kind: Kind,
    step: int,
    train_config: dict[str, Any],
    trainer_state: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write ``OUT/checkpoints/step-NNNNNN`` atomically and prune all but the newest ``keep``. Returns its path."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    model_class(kind)  # validates kind
    if is_quantized(model):  # Int8Linear's codes and scales: not the weights load_checkpoint builds a model for
        raise ValueError("a quantized (int8) model cannot be saved as a checkpoint; save it before tformer.quantize")
    root = Path(out) / CHECKPOINTS_DIR
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)  # and OUT/checkpoints, if missing
    except OSError as err:  # a read-only or forbidden place: nothing was written
        raise CheckpointError(f"{out}: cannot write a checkpoint there ({err.strerror}); choose another") from err
    try:
        files = _write_files(tmp, model, tokenizer, kind, trainer_state)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "kind": kind,
            "step": step,
            "model_config": unwrap(model).cfg.to_dict(),
            "train_config": train_config,
            "files": files,
            "torch_version": torch.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        final = _swap_in(tmp, root / step_dir_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):  # from earlier crashes; never a complete checkpoint
        if leftover != tmp:
            shutil.rmtree(leftover, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------
def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``root`` (``OUT/checkpoints``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself, or the newest under ``path`` or ``path/checkpoints``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a checkpoint: a tformer run or checkpoint is a directory (holding {MANIFEST}); other models "
            "load from a Hugging Face directory (with config.json) or a .gguf file"
        )
    if (path / MANIFEST).exists():
        return path
    for root in (path / CHECKPOINTS_DIR, path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    hint = (
        "it is a Hugging Face model directory (config.json): load it with tformer.load_pretrained"
        if (path / "config.json").is_file()
        else f"it holds {weights[0]} but no config.json, which a Hugging Face model directory needs beside its weights"
        if weights
        else "train one with `tformer train --out DIR`; other models load from a Hugging Face directory (with "
        "config.json) or a .gguf file"
    )
    raise CheckpointError(
        f"{path}: not a tformer checkpoint: no {MANIFEST} here and no {CHECKPOINTS_DIR}/step-* checkpoint inside "
        f"({hint})"
    )


def find_latest(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of run directory ``out``, or ``None``."""
    found = list_checkpoints(Path(out) / CHECKPOINTS_DIR)
    return found[-1] if found else None


def last_good_checkpoint(checkpoints: list[Path]) -> Path | None:
    """The newest of ``checkpoints`` (oldest first, as :func:`list_checkpoints` gives them) whose files all verify
    (:func:`read_manifest` checks every size and SHA-256), or ``None``."""
    for candidate in reversed(checkpoints):
        try:
            read_manifest(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


_FILE_FIELDS = (("bytes", _is_count, "a non-negative integer"), ("sha256", _is_sha256, "64 lowercase hex digits"))


def _check_manifest_fields(manifest: dict[str, Any], path: Path) -> None:
    """The type of every field the loader uses; ``files`` names must be plain names inside the checkpoint."""

    def bad(field: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{path}: field {field} must be {expected}; got {json.dumps(value)[:80]}")

    for key in ("kind", "step", "model_config", "train_config", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path}: the manifest lacks the field {key!r}")
    if manifest["kind"] not in ("lm", "seq2seq"):
        raise CheckpointError(f"{path}: unknown model kind {manifest['kind']!r}; expected 'lm' or 'seq2seq'")
    if not _is_count(manifest["step"]):
        raise bad('"step"', "a non-negative integer", manifest["step"])
    for key in ("model_config", "train_config", "files"):
        if not isinstance(manifest[key], dict):
            raise bad(f'"{key}"', "an object", manifest[key])
    for name, info in manifest["files"].items():
        field = f'"files"[{json.dumps(name)}]'
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(
                f"{path}: field {field}: a file name must be a plain name inside the checkpoint "
                "directory (no '/', no '..')"
            )
        if not isinstance(info, dict):
            raise bad(field, 'an object {"bytes": ..., "sha256": ...}', info)
        for key, valid, expected in _FILE_FIELDS:
            if key not in info:
                raise CheckpointError(f'{path}: field {field}["{key}"] is missing')
            if not valid(info[key]):
                raise bad(f'{field}["{key}"]', expected, info[key])
    for name in (WEIGHTS, TOKENIZER_FILE):
        if name not in manifest["files"]:
            raise CheckpointError(f"{path}: the manifest does not list {name}")


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and check ``checkpoint.json`` (the type of every field used; file names plain names inside
    ``directory``) and verify every listed file's size and SHA-256."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: missing; {directory} is not a tformer checkpoint") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON (truncated or corrupted?): {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f'{path}: not a tformer checkpoint manifest (no "format": "{FORMAT}")')
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {manifest.get('version')!r}; this tformer reads {VERSION}")
    _check_manifest_fields(manifest, path)
    for name, info in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise CheckpointError(f"{file}: {what}: {size} bytes, the manifest says {info['bytes']}")
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file}: corrupted: its SHA-256 differs from the one in {MANIFEST}")
    return manifest


def load_checkpoint(
    path: str | os.PathLike,
    *,
    map_location: str | torch.device = "cpu",
    with_state: bool = False,
    attn_backend: str | None = None,
) -> Checkpoint:
    """Load a checkpoint directory, or the newest checkpoint of a run directory ``OUT``.

    Returns the model in eval mode on ``map_location`` with its tokenizer, kind, config, step and training config;
    ``with_state=True`` also reads the optimizer/RNG/data state (``trainer_state``) needed to resume.
    ``attn_backend`` runs the model's attention on another backend than the one it was trained with (all are
    exact); by default the saved one, except that a model trained with ``"triton"`` runs on ``"auto"`` when
    ``map_location`` is not a CUDA device (the Triton kernels need a GPU).
    Raises :class:`CheckpointError` for anything missing, truncated, corrupted or foreign.

    A run directory may be read while its training writes to it: if the newest checkpoint is pruned while it is
    being read (a live run keeps only the last few), the one that replaced it is read instead.
    """
    path = Path(path)
    for _ in range(_READ_ATTEMPTS - 1):
        directory = resolve_checkpoint(path)
        try:
            return _load_directory(directory, map_location, with_state, attn_backend)
        except CheckpointError:
            # Pruning follows a newer save, so a newer checkpoint in place means this one may have been deleted
            # under the reader; with none, the failure is the checkpoint's own.
            if directory == path or resolve_checkpoint(path) == directory:
                raise
    return _load_directory(resolve_checkpoint(path), map_location, with_state, attn_backend)


_READ_ATTEMPTS = 5  # a live run saving faster than one read takes five times over is not a run to read from


def _load_directory(
    directory: Path, map_location: str | torch.device, with_state: bool, attn_backend: str | None
) -> Checkpoint:
    manifest = read_manifest(directory)
    try:
        config = TransformerConfig.from_dict(manifest["model_config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{directory / MANIFEST}: invalid model_config: {err}") from err
    if attn_backend is None and config.attn_backend == "triton" and torch.device(map_location).type != "cuda":
        attn_backend = "auto"
    if attn_backend is not None:
        config = config.replace(attn_backend=attn_backend)  # a ValueError names an unknown backend
    try:
        tokenizer = tokenizer_from_dict(
            json.loads((directory / TOKENIZER_FILE).read_text(encoding="utf-8")), str(directory / TOKENIZER_FILE)
        )
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(str(err)) from err
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{directory / TOKENIZER_FILE}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size}"
        )
    model = model_class(manifest["kind"])(config)
    load_model_weights(model, directory / WEIGHTS)
    model.to(map_location).eval()
    state = None
    if with_state:
        if STATE not in manifest["files"]:
            raise CheckpointError(f"{directory}: holds no {STATE}; it is a weights-only checkpoint and cannot resume")
        try:
            state = torch.load(directory / STATE, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{directory / STATE}: cannot be read: {err}") from err
    return Checkpoint(
        model=model,
        tokenizer=tokenizer,
        kind=manifest["kind"],
        config=config,
        step=int(manifest["step"]),
        train_config=manifest["train_config"],
        path=directory,
        trainer_state=state,
    )


def remove_checkpoints(out: str | os.PathLike) -> None:
    """Delete the checkpoints of run ``out`` (used when a fresh run is asked to overwrite)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(Path(out) / CHECKPOINTS_DIR)
