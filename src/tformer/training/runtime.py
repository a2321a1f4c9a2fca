"""The process around a training run: ranks under ``torchrun``, Ctrl-C, the error that stops a run.

The run directory's lock lives in :mod:`tformer.training.rundir`; which device a name means, in
:mod:`tformer.runtime` (``resolve_device``, shared with the other commands).

Nothing here knows about models or data; :mod:`tformer.training` uses these pieces.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tformer.runtime import resolve_device, unavailable  # noqa: F401  (moved; importable from here too)


class TrainingError(RuntimeError):
    """Training cannot go on: the loss diverged, or another run is writing to the run directory. ``losses``: the
    training loss of each step run before it stopped (a diverged run's curve up to its end)."""

    def __init__(self, message: str, *, losses: dict[int, float] | None = None) -> None:
        super().__init__(message)
        self.losses = losses or {}


@dataclass
class World:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one); ``main`` is the rank that writes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world(device_name: str) -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    owns = False
    if not dist.is_initialized():
        use_cuda = device_name != "cpu" and torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
        owns = True
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)


def triton_interpreter() -> bool:
    """Whether Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``): Triton kernels then run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def all_ranks_agree(world: World, device: torch.device, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (a collective: every rank must call it)."""
    if world.size == 1:
        return ok
    flag = torch.tensor([float(not ok)], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0


class StopFlag:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one interrupts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        for sig, handler in self._previous.items():  # a second signal acts at once
            signal.signal(sig, handler)

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
