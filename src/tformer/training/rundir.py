"""The run directory ``OUT`` of a training run: the lock that keeps a second run out, and the clean-up of a run that
fails before it logged a step.

``OUT/.lock`` is held (``flock``) by the process writing to ``OUT``, so that a second run fails at once instead of
clobbering it; the OS drops the lock when the process ends, even on ``kill -9``. A run that fails before it logs a
step (data too short for ``block_size``, Ctrl-C while tokenizing) removes the ``OUT`` it created, and nothing else.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from tformer.training.runtime import TrainingError, World, all_ranks_agree

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"


@contextlib.contextmanager
def run_lock(out: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``OUT/.lock`` (creating ``OUT``) while the body runs; a run already holding it
    makes this raise :class:`TrainingError` at once, and so does an ``OUT`` that cannot be made or written to.
    (Without ``fcntl``, i.e. on Windows, ``OUT`` is made but not locked.)"""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        import fcntl

        lock = open(out / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except ImportError:
        yield
        return
    except OSError as error:
        raise TrainingError(
            f"cannot write the run directory {out} ({error.strerror or error}); choose an --out you can write to"
        ) from None
    with lock as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            raise TrainingError(
                f"another tformer run is writing to {out} (pid {pid}); wait for it or choose another --out"
            ) from None
        f.truncate(0)  # "a+" writes at the end: the file now holds just our pid
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield  # closing the file releases the lock


def writer_of(out: str | os.PathLike) -> str | None:
    """The pid (as ``OUT/.lock`` holds it) of a run writing to ``out`` now, else ``None``; takes no lock."""
    try:
        import fcntl

        f = open(Path(out) / LOCK_FILE, encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except (ImportError, OSError):
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "unknown"
        return None  # closing the file releases the shared lock


@contextlib.contextmanager
def claimed(out: str | None, world: World, device: torch.device) -> Iterator[None]:
    """Run the body holding ``out``'s lock (rank 0 holds it; every rank learns whether it got it). If the body fails
    before the run logged a step, the folders the lock created are removed again. ``out=None``: nothing to claim."""
    if out is None:
        yield
        return
    created = _missing_folders(Path(out))
    with contextlib.ExitStack() as stack:
        locked: TrainingError | None = None
        if world.main:
            try:
                stack.enter_context(run_lock(out))
            except TrainingError as err:
                locked = err
                _remove_unused_run_folder(created)  # the parents of an OUT that could not be made
        if not all_ranks_agree(world, device, locked is None):
            raise locked or TrainingError(f"rank 0 could not lock {out}; another run is writing there")
        try:
            yield
        except BaseException:  # also Ctrl-C during tokenization: the lock is still held here
            if world.main and created:
                _remove_unused_run_folder(created)
            raise


def _missing_folders(out: Path) -> list[Path]:
    """``out`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for folder in (out.absolute(), *out.absolute().parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove_unused_run_folder(created: list[Path]) -> None:
    """After a run failed: remove the folders it created (``created``, deepest first: OUT and the parents it
    made), but only while OUT holds nothing but the run's own ``.lock`` and an empty ``metrics.jsonl`` (once
    training has logged a step, the metrics and the loss plot tell what happened, and they are kept)."""
    if not created:
        return
    out = created[0]
    entries = list(out.iterdir()) if out.is_dir() else []
    if any(p.name not in (LOCK_FILE, METRICS_FILE) or not p.is_file() for p in entries):
        return
    if any(p.name == METRICS_FILE and p.stat().st_size > 0 for p in entries):
        return
    for p in entries:
        p.unlink()
    for folder in created:
        if not folder.exists():  # OUT (and parents) that could not be made
            continue
        try:
            folder.rmdir()  # only an empty folder: anything another process put there meanwhile stays
        except OSError:
            return
