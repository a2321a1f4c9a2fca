"""Hugging Face model directories: ``config.json``, ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), ``generation_config.json`` and ``tokenizer.json``, read with clear errors and
written atomically (into a temporary folder, then renamed: a failed export leaves nothing behind).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.interop.family import GenerationIds
from tformer.interop.keys import InteropError

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TMP_PREFIX = ".tmp-"  # then the name, the pid and a random part: .tmp-NAME-PID-HEX8
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # stated in config.json, even when null


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InteropError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InteropError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a JSON object")
    return data


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: one file, or the shards its index lists."""
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    if (directory / INDEX).is_file():
        index = read_json(directory / INDEX).get("weight_map")
        if not isinstance(index, dict) or not index:
            raise InteropError(f'{directory / INDEX}: no "weight_map" of tensor names to shard files')
        shards = sorted(set(index.values()))
        if any("/" in s or "\\" in s or s in ("", ".", "..") for s in shards):
            raise InteropError(f"{directory / INDEX}: shard names must be plain file names in the directory")
        return [directory / s for s in shards]
    raise InteropError(f"{directory}: no {WEIGHTS} or {INDEX} (a Hugging Face model directory holds its weights)")


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the directory's weight files, as stored (dtype included)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, Tensor] = {}
    for path in weight_files(directory):
        if not path.is_file():
            raise InteropError(f"{path}: no such file (listed in {INDEX})")
        try:
            tensors.update(load_file(str(path), device="cpu"))
        except (SafetensorError, OSError, ValueError) as err:
            raise InteropError(f"{path}: cannot read the weights (truncated or not safetensors?): {err}") from None
    return tensors


def file_dtype(tensors: dict[str, Tensor]) -> torch.dtype:
    """The floating dtype most of the tensors are stored in."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def generation_ids(config: dict[str, Any], generation: dict[str, Any] | None, source: str = "") -> GenerationIds:
    """The special ids: ``generation_config.json`` first, then ``config.json``; ``InteropError`` naming the field for
    one that is not an integer (``2.7`` or ``"2"`` would be read as some id without a word). Their range is not
    checked here: transformers' own tiny configs keep GPT-2's 50256 beside a small vocabulary; ``generate`` refuses
    an end id outside the vocabulary when it is used."""
    merged = {**config, **(generation or {})}
    for name in (*SPECIAL_IDS, "decoder_start_token_id"):
        for value in _ids(merged.get(name)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InteropError(
                    f"{source}: {name}={merged[name]!r} must be a token id (an integer) or a list of them"
                )

    def one(name: str) -> int | None:
        value = merged.get(name)
        return value[0] if isinstance(value, list) and value else value

    return GenerationIds(
        one("bos_token_id"), _ids(merged.get("eos_token_id")), one("pad_token_id"), one("decoder_start_token_id")
    )


def special_tokens(token: Callable[[int], str | None], ids: dict[str, int | None]) -> dict[str, str]:
    """``tokenizer_config.json``'s special tokens by name, e.g. ``{"eos_token": "<|im_end|>"}``, from config-style
    ``ids`` (``{"eos_token_id": 2, ...}``) and ``token(id)``, the vocabulary's piece: ``transformers.AutoTokenizer``
    knows a tokenizer's eos, bos and pad from these, not from ``config.json``'s ids. ``None`` ids are left out."""
    named = {name.removesuffix("_id"): token(i) for name, i in ids.items() if i is not None}
    return {name: piece for name, piece in named.items() if piece is not None}


class UnwritableFolder(InteropError):
    """The folder a model directory was to be written in cannot be written (read-only, forbidden, not a folder)."""


def check_new_directory(path: Path) -> None:
    """``InteropError`` unless a model directory can be made at ``path``: it does not exist or is an empty folder,
    and no file lies where a folder above it must be. Cheap: callers check before long work."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InteropError(f"{path}: already exists and is not an empty folder; choose another path or delete it")
    above = next((folder for folder in path.absolute().parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise UnwritableFolder(f"{path}: {above} is a file, so no folder can be made under it; choose another path")


def write_directory(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    generation: dict[str, Any],
    tokenizer: Any | None,
    tokenizer_config: dict[str, Any] | None = None,
) -> Path:
    """Write a model directory at ``path`` (which must not exist, or be empty) in one rename; ``tokenizer_config``:
    the ``tokenizer_config.json`` to write beside ``tokenizer.json`` (special tokens, chat template)."""
    from safetensors.torch import save_file

    check_new_directory(path)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:  # a read-only or forbidden place: nothing was written
        message = f"{path}: cannot write there ({err.strerror}); choose a folder you can write to"
        raise UnwritableFolder(message) from err
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        shutil.copymode(tmp / CONFIG, tmp / WEIGHTS)  # safetensors writes 0600; the umask's mode, as every file
        if generation:
            (tmp / GENERATION).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if tokenizer_config:
            (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        if path.exists():
            path.rmdir()
        tmp.rename(path)
    except BaseException:  # e.g. the disk filled up mid-write: nothing is left, and the error goes on as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_abandoned(path)
    return path


def remove_abandoned(path: Path) -> list[Path]:
    """Delete the temporary folders that writes of ``path`` by processes no longer running left beside it (a
    ``kill -9`` mid-write: an interrupted write removes its own); returns them. A folder whose process still runs,
    or may (another user's), is kept."""
    pattern = re.compile(rf"{re.escape(TMP_PREFIX + path.name)}-(\d+)-[0-9a-f]{{8}}")
    removed = []
    for leftover in path.parent.glob(f"{TMP_PREFIX}*"):
        match = pattern.fullmatch(leftover.name)
        if match and leftover.is_dir() and not _running(int(match.group(1))):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the call only checks that the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no pid can be
        return True
    return True
