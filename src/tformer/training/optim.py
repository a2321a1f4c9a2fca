"""The optimization of a run: the learning-rate schedule, AdamW's parameter groups, the seed of each step, autocast.

    lr(s) = lr * (s+1)/warmup                                                     for s < warmup
          = min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup)/(steps - warmup))) / 2   after

AdamW weight decay applies to every parameter with ``dim >= 2`` (the weight matrices, including the token and
position embedding tables, as GPT-2/nanoGPT); biases and LayerNorm gains/shifts (``dim < 2``) are not decayed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from tformer.training.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: ``dim >= 2`` parameters decayed, the rest (biases, norms) not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = next(iter(params)).device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of one step on one rank (dropout): a pure function, so resume needs no RNG state."""
    return int(np.random.default_rng([seed, step, rank, 0xD50]).integers(2**62))


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """``None`` (float32) or the autocast dtype: ``auto`` is bfloat16 on CUDA GPUs that support it."""
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if cfg.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (oneDNN's check: AVX512-BF16 or AMX), where bfloat16
    autocast trains 1.25-1.5x faster than float32 (BENCHMARKS.md); elsewhere it is emulated and slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False
