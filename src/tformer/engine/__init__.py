"""The engine: what makes tformer's Transformer fast on a CPU, applied to a model from outside.

The core (:mod:`tformer.layers`, :mod:`tformer.models`, :mod:`tformer.attention`) is the math on ``nn.Linear`` and
PyTorch's kernels, and imports nothing from here.
"""
