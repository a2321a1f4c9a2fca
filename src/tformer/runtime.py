"""What every part above the model shares about where it runs: the device a name means (:func:`resolve_device`),
the plain model inside a wrapper (:func:`unwrap`), and the folder where tformer caches what it computes once
(:func:`default_cache_dir`: tokenized corpora, converted GGUF files).

Training, interop, generation, the explorer and the CLI all use these; none of them owns them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside ``torch.compile`` (``_orig_mod``) and ``DistributedDataParallel`` (``module``)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def resolve_device(name: str) -> torch.device:
    """The device ``name`` names (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``), checked to exist on this machine.

    ``auto`` is CUDA when there is a GPU, else the CPU. Raises ``ValueError`` naming the device and the
    ``--device`` to use instead (``torch.device`` alone accepts ``cuda`` without a GPU and fails much later).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use --device auto, cpu, cuda or cuda:N") from None
    missing = unavailable(device)
    if missing is not None:
        why, instead = missing
        raise ValueError(f"device {name!r} is not available here{why}; use --device {instead}")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {name!r} is not supported; use --device auto, cpu, cuda or cuda:N")
    return device


def unavailable(device: torch.device) -> tuple[str, str] | None:
    """``None`` if this machine has ``device`` (or torch cannot tell: a type other than CUDA and MPS), else why not
    (to follow "is not available here") and the device to use instead."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return " (torch.cuda.is_available() is False)", "cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f": this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}", "cuda:0"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return " (torch.backends.mps.is_available() is False)", "cpu"
    return None


def default_cache_dir() -> Path:
    """``$TFORMER_CACHE``, else ``$XDG_CACHE_HOME/tformer``, else ``~/.cache/tformer``."""
    if os.environ.get("TFORMER_CACHE"):
        return Path(os.environ["TFORMER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tformer"


__all__ = ["default_cache_dir", "resolve_device", "unavailable", "unwrap"]
