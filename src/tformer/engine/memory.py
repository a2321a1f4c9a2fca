"""Where a model's weights live: one block of memory, in the order the modules hold them, on huge pages where the OS
gives them (:func:`pack_weights`).

Why. A decode step at batch 1 reads every weight once, so it runs at the speed the CPU streams them from memory.
Loaded tensor by tensor, a model's matrices are separate allocations on 4 KB pages; streamed from one block on 2 MB
pages, the same kernels read them faster (BENCHMARKS.md, "Decode kernels"): a 2 MB page needs one TLB entry where
4 KB pages need 512, and the hardware prefetchers, which stop at page boundaries, restart less often.

What. :func:`pack_weights` copies every parameter and buffer of a CPU module into one anonymous memory mapping
(``mmap``, private), each tensor 64-byte aligned, the mapping's start 2 MB aligned, and asks Linux for transparent huge
pages on it (``madvise(MADV_HUGEPAGE)``: honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``). The tensors keep their identity (``tensor.data`` is swapped, as ``module.to`` does for
parameters), their values, dtypes, shapes and ``requires_grad``; each still has a storage of its own, over its part
of the block, so saving one (``torch.save``, safetensors) writes only its bytes. A tensor tied to another (one object
in two modules) is packed once; tensors that share storage any other way (views of one another) are left where they
are, so that they stay views. The block is freed with the last tensor that uses it.

Where. :func:`tformer.load_pretrained`, :func:`tformer.quantize` and the command line's model loading call it for CPU
models, so models people decode with are packed; a model built or trained in code can be packed by the caller
(after ``.to(dtype)``: a conversion allocates new tensors). Off Linux (no ``MADV_HUGEPAGE``) the block is still one
mapping on small pages; where ``mmap`` cannot make a private anonymous mapping (Windows), nothing is packed.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref

import torch
from torch import Tensor, nn

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
ALIGN = 64  # each tensor starts on a cache line
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its tensors' data_ptrs when packed


def pack_weights(module: nn.Module) -> nn.Module:
    """Move the CPU parameters and buffers of ``module`` into one memory block, in the order ``module.modules()``
    lists them (each module's parameters, then its buffers); returns ``module``. Idempotent: a module whose tensors
    are where the last call put them is left as it is. The module docstring says why and what is kept."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"pack_weights: need an nn.Module; got {type(module).__name__}")
    tensors = _packable(module)
    if not tensors or not hasattr(mmap, "MAP_PRIVATE"):
        return module
    if _PACKED.get(module) == [t.data_ptr() for t in tensors]:
        return module
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE  # the first tensor on a huge-page boundary; the pages are not touched yet
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # transparent huge pages off in this kernel: small pages, one block
            block.madvise(mmap.MADV_HUGEPAGE, start, total)
    with torch.inference_mode(False), torch.no_grad():  # normal tensors, even when called in inference mode
        for t, offset in zip(tensors, offsets, strict=True):
            packed = torch.frombuffer(block, dtype=t.dtype, count=t.numel(), offset=start + offset).view(t.shape)
            packed.copy_(t)  # first touch: the kernel backs the block with (huge) pages in this order
            t.data = packed
    _PACKED[module] = [t.data_ptr() for t in tensors]
    return module


def is_packed(module: nn.Module) -> bool:
    """Whether ``module``'s CPU tensors are where :func:`pack_weights` put them (none moved or replaced since)."""
    tensors = _packable(module)
    return bool(tensors) and _PACKED.get(module) == [t.data_ptr() for t in tensors]


def _packable(module: nn.Module) -> list[Tensor]:
    """The CPU parameters and buffers of ``module`` that :func:`pack_weights` moves, once each, in module order:
    not empty, not sharing storage with another distinct tensor of the module (views of one another stay views)."""
    seen: set[int] = set()
    tensors: list[Tensor] = []
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if t.device.type == "cpu" and t.numel() > 0 and t.layout == torch.strided and not t.is_quantized:
                tensors.append(t)
    owners: dict[int, int] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        owners[key] = owners.get(key, 0) + 1
    return [t for t in tensors if owners[t.untyped_storage().data_ptr()] == 1]


__all__ = ["ALIGN", "HUGE_PAGE", "is_packed", "pack_weights"]
