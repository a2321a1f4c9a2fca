"""What training minimizes and what it reports: token cross-entropies, the validation loss, and for seq2seq runs
the exact match of greedy decodes on the held-out set.

    loss = sum of token cross-entropies / (target tokens in the global batch)   (seq2seq: label smoothing, padding
                                                                                 ignored)

Shapes: B, T, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.generation.seq2seq import greedy_seq2seq
from tformer.tokenizers import Tokenizer
from tformer.training.batches import evaluation_batches
from tformer.training.checkpoint import unwrap
from tformer.training.runtime import World


def lm_loss_sum(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Sum over tokens of ``-log p(y_t | x_<=t)``: ``x, y (B, T)``."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")


def seq2seq_loss_sum(model: nn.Module, rows, pad_id: int, label_smoothing: float = 0.0) -> Tensor:
    """Sum over target tokens (padding ignored) of the (label-smoothed) cross-entropy."""
    src, src_mask, tgt_in, tgt_out, tgt_mask = rows
    logits = model(src, tgt_in, src_mask, tgt_mask)  # (B, T, V)
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        tgt_out.flatten(),
        ignore_index=pad_id,
        reduction="sum",
        label_smoothing=label_smoothing,
    )


def loss_sum(model: nn.Module, kind: str, rows, pad_id: int | None, label_smoothing: float = 0.0) -> Tensor:
    """The summed loss of one micro-batch of either kind of run."""
    if kind == "lm":
        return lm_loss_sum(model, *rows)
    return seq2seq_loss_sum(model, rows, pad_id, label_smoothing)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    batches: list,
    kind: str,
    pad_id: int | None,
    world: World,
    amp: torch.dtype | None,
    device: torch.device,
    chunk: int,
) -> float:
    """Mean per-token cross-entropy over ``batches`` (no label smoothing), ``chunk`` rows at a time.

    Each rank takes its share of every batch's rows; the sums are all-reduced, so the result does not depend on
    the number of processes.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    for batch in batches:
        lo, hi = len(batch) * world.rank // world.size, len(batch) * (world.rank + 1) // world.size
        for first in range(lo, hi, chunk):
            rows = tuple(t.to(device) for t in batch.rows(first, min(first + chunk, hi)))
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                s = loss_sum(model, kind, rows, pad_id)
            count = rows[1].numel() if kind == "lm" else (rows[3] != pad_id).sum()
            total += torch.stack([s.double(), torch.as_tensor(count, dtype=torch.float64, device=device)])
    if world.size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


@torch.no_grad()
def exact_match(
    model: nn.Module,
    held_out: list[tuple[list[int], list[int]]],
    tokenizer: Tokenizer,
    device: torch.device,
    batch_size: int = 250,
) -> float:
    """Fraction of held-out sources whose greedy decode equals the target exactly."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(held_out), batch_size):
        chunk = held_out[i : i + batch_size]
        batch = evaluation_batches(chunk, len(chunk), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)[0]
        src, src_mask, *_ = (t.to(device) for t in batch.rows(0, len(chunk)))
        longest = max(len(t) for _, t in chunk) + 1
        predictions = greedy_seq2seq(
            model, src, src_mask, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, max_new_tokens=longest
        )
        correct += sum(p == list(t) for p, (_, t) in zip(predictions, chunk, strict=True))
    model.train(was_training)
    return correct / len(held_out)
