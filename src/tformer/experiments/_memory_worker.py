"""Peak-memory measurement of one attention call, in a process of its own: ``python -m ...._memory_worker SPEC``.

``SPEC`` is JSON: ``{"points": [[backend, n], ...], "batch": B, "heads": H, "head_dim": D}``. This worker imports
torch once and then, for each point, forks a child that builds ``q, k, v (B, H, n, D)`` in float32, runs one
warm-up call at n = 8 (so code pages and thread state are already resident), reads its peak resident set size
``ru_maxrss``, runs ``scaled_dot_product_attention(q, k, v, backend=backend)`` under ``no_grad``, and reads
``ru_maxrss`` again. The difference is the extra memory the call needed at its peak (outputs and every
temporary, as the operating system saw it). A fresh child per point keeps each measurement's high-water mark its
own; the parent never runs a torch operation, so the children start clean (OpenMP is not fork-safe once used).
Prints one JSON line per point: ``{"backend", "n", "peak_bytes"}``. Linux/macOS only (``fork``).
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

from tformer.attention import scaled_dot_product_attention

# ru_maxrss is in KiB on Linux and in bytes on macOS
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT


def _measure_in_child(backend: str, n: int, batch: int, heads: int, head_dim: int, write_fd: int) -> None:
    torch.set_num_threads(1)  # per-thread buffers are not part of the claim; one thread keeps them constant
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))  # (B, H, n, D)
    with torch.no_grad():
        scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], backend=backend)  # warm-up
        before = _peak_rss_bytes()
        out = scaled_dot_product_attention(q, k, v, backend=backend)  # (B, H, n, D)
        after = _peak_rss_bytes()
    del out
    os.write(write_fd, json.dumps({"backend": backend, "n": n, "peak_bytes": after - before}).encode())


def measure(points: list[tuple[str, int]], batch: int, heads: int, head_dim: int) -> list[dict]:
    """Fork one child per ``(backend, n)`` point; return what each measured."""
    if not hasattr(os, "fork"):
        raise RuntimeError("the peak-memory measurement forks one child per point: it needs Linux or macOS")
    results = []
    for backend, n in points:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            status = 0
            try:
                os.close(read_fd)
                _measure_in_child(backend, n, batch, heads, head_dim, write_fd)
            except BaseException as exc:  # report, never fall back into the parent's loop
                os.write(write_fd, json.dumps({"backend": backend, "n": n, "error": repr(exc)}).encode())
                status = 1
            finally:
                os._exit(status)
        os.close(write_fd)
        chunks = []
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
        if not chunks:
            results.append({"backend": backend, "n": n, "error": f"child exited with status {status} (out of memory?)"})
        else:
            results.append(json.loads(b"".join(chunks)))
    return results


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get("import_tiled"):
        import tformer.attention.tiled  # noqa: F401  (imported before forking, like torch)
    points = [(str(b), int(n)) for b, n in spec["points"]]
    for row in measure(points, int(spec["batch"]), int(spec["heads"]), int(spec["head_dim"])):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
