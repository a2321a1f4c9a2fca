"""How much memory a computation needs, from the allocator's own accounting.

:func:`peak_allocated_bytes` runs a callable and returns the most bytes it had allocated at once beyond what was
allocated when it started: its outputs and every temporary, at the worst moment. The figure is the allocator's,
byte for byte, so it is the same on a busy machine as on an idle one (the resident set of a process is not: pages are
touched, reused and returned to the system at the kernel's and the allocator's discretion).

* CPU: the allocation and free events PyTorch's profiler records (``profile_memory=True``), summed in time order.
* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

Tensors the callable frees are counted while they live; tensors allocated before it are not counted, even if it
frees them (the running total then drops below zero, and the peak is taken from the start).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def peak_allocated_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """The peak of the bytes ``fn()`` allocated (and had not yet freed) on ``device``, its result included."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    if device.type != "cpu":
        raise ValueError(f"peak memory is measured on the CPU and on CUDA devices; got {device}")
    return _cpu_peak(fn)


def _cuda_peak(fn: Callable[[], Any], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return max(peak, 0)


def _cpu_peak(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler library's start/stop lines on stderr: off
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result  # freed inside the profile: its bytes count while it lives
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    total = peak = 0
    for event in events:  # positive: an allocation, negative: a free
        total += event.nbytes()
        peak = max(peak, total)
    return peak
