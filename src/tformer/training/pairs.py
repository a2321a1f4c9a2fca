"""Source/target pairs for sequence-to-sequence training: ``source<TAB>target`` lines of a UTF-8 text file, and their
fixed split into training and validation pairs."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np


def check_pairs_file(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` if it is a regular file: ``FileNotFoundError`` if it is missing, ``ValueError``
    saying what it is otherwise (a directory, a device...). Cheap: for checks before any work starts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pairs file {path} does not exist; pass a file of source<TAB>target lines (--pairs)")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file (a device, pipe or socket)"
        raise ValueError(f"pairs file {path} is {what}; pass a file of source<TAB>target lines (--pairs)")
    return path


def load_pairs(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Read ``source<TAB>target`` lines of a UTF-8 text file; blank lines are skipped.

    A line without exactly one tab, or with an empty side, or bytes that are not UTF-8, is a ``ValueError``
    naming the file and line; a path that is not a regular file is an error saying what it is
    (:func:`check_pairs_file`).
    """
    path = check_pairs_file(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"pairs file {path} is not UTF-8 text (line {line}: byte 0x{data[err.start]:02x} at offset {err.start}); "
            "pass a UTF-8 file of source<TAB>target lines (--pairs)"
        ) from None
    text = text.removeprefix("\ufeff")  # a byte-order mark (files saved by Windows editors) is not a character
    pairs = []
    with io.StringIO(text, newline="") as f:  # lines end as in the file: \n, \r\n or \r
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2 or not fields[0] or not fields[1]:
                raise ValueError(
                    f"{path}:{number}: expected 'source<TAB>target' with both sides non-empty; got {line[:80]!r}"
                )
            pairs.append((fields[0], fields[1]))
    if not pairs:
        raise ValueError(f"{path} holds no source<TAB>target pairs")
    return pairs


def split_pairs(count: int, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the training and validation pairs: a fixed-seed permutation, the last ``val_fraction``
    (at least one pair) validating. Independent of the training seed, so runs compare on one held-out set."""
    if count < 2:
        raise ValueError(f"need at least 2 pairs to split into training and validation; got {count}")
    order = np.random.default_rng(seed).permutation(count)
    n_val = min(count - 1, max(1, int(round(count * val_fraction))))
    return np.sort(order[: count - n_val]), np.sort(order[count - n_val :])
