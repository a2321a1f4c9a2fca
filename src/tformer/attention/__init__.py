"""Attention backends: the materialized reference, PyTorch's SDPA, tiled FlashAttention in PyTorch, Triton."""
