"""The engine: what makes tformer's Transformer fast on a CPU, applied to a model from outside.

The core (:mod:`tformer.layers`, :mod:`tformer.models`, :mod:`tformer.attention`) is the math on ``nn.Linear`` and
PyTorch's kernels, and imports nothing from here. The engine is:

* :mod:`tformer.engine.kernels`: C++ kernels for a CPU decode step (matrix-vector products in bfloat16, float32 and
  int8, attention for a few query rows, a stack of Llama-style blocks as one call), built for this CPU on first use;
* :mod:`tformer.engine.apply`: :func:`accelerate` swaps a model's modules for kernel-backed ones (and
  :func:`plain` back), the way :func:`quantize` swaps in int8 layers;
* :mod:`tformer.engine.fused`: a decode step of whole blocks as one kernel call, which the static-cache decoder
  (:mod:`tformer.generation.static`) runs;
* :mod:`tformer.engine.quantization`: weight-only int8 (:func:`quantize`);
* :mod:`tformer.engine.memory`: a model's weights in one block of memory on huge pages (:func:`pack_weights`).
"""

from tformer.engine.apply import accelerate, is_accelerated, plain
from tformer.engine.memory import pack_weights
from tformer.engine.quantization import quantize

__all__ = ["accelerate", "is_accelerated", "pack_weights", "plain", "quantize"]
