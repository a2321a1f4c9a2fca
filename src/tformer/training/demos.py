"""The demo: train a small encoder-decoder Transformer to reverse sequences, then measure it.

Teacher forcing: the decoder reads ``BOS y_1 .. y_{n}`` and predicts ``y_1 .. y_n EOS``; the loss ignores
padding. Accuracy is exact match of greedy decodes on held-out source sequences (those of length >= 3 are never
seen in training; shorter ones cannot all be withheld).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tformer.config import TransformerConfig
from tformer.generation.seq2seq import greedy_seq2seq
from tformer.models import EncoderDecoder, num_parameters
from tformer.training.tasks import BOS, EOS, PAD, SPECIALS, SequenceTask


@dataclass
class DemoResult:
    accuracy: float
    final_loss: float
    steps: int
    seconds: float
    examples: list[tuple[list[int], list[int], list[int]]]  # (source, expected, predicted)


def warmup_cosine(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def evaluate(model: EncoderDecoder, task: SequenceTask, sources: list[tuple[int, ...]], batch_size: int = 256):
    """Exact-match accuracy of greedy decodes on ``sources``; also returns the decodes."""
    model.eval()
    predictions: list[list[int]] = []
    for i in range(0, len(sources), batch_size):
        chunk = sources[i : i + batch_size]
        src, src_mask, _, _ = task.collate(chunk)
        predictions += greedy_seq2seq(model, src, src_mask, bos_id=BOS, eos_id=EOS, max_new_tokens=task.max_target_len)
    correct = sum(pred == task.target(s) for s, pred in zip(sources, predictions, strict=True))
    return correct / len(sources), predictions


def train_seq2seq(
    task: SequenceTask,
    cfg: TransformerConfig,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    exclude: set[tuple[int, ...]] | None = None,
    progress: bool = False,
) -> tuple[EncoderDecoder, float]:
    """Train a fresh :class:`EncoderDecoder` on ``steps`` batches of ``task`` (never on a source in
    ``exclude``) with teacher forcing; return the model in eval mode and the last training loss."""
    torch.manual_seed(seed)
    model = EncoderDecoder(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc=f"training {task.name} ({num_parameters(model):,} params)", disable=not progress)
    loss_value = float("nan")
    model.train()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(step, steps, warmup=max(1, steps // 20), lr=lr, min_lr=lr / 20)
        src, src_mask, tgt, tgt_mask = task.batch(batch_size, gen, exclude)
        logits = model(src, tgt[:, :-1], src_mask, tgt_mask[:, :-1])  # (B, T-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1), ignore_index=PAD)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            loss_value = loss.item()
            bar.set_postfix(loss=f"{loss_value:.4f}")
    model.eval()
    return model, loss_value


def run_demo(
    *,
    task: SequenceTask | None = None,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    held_out: int = 500,
    seed: int = 0,
    config: TransformerConfig | None = None,
    progress: bool = True,
) -> DemoResult:
    """Train on ``steps`` batches of the task and report held-out exact-match accuracy."""
    task = task or SequenceTask("reverse")
    torch.manual_seed(seed)
    cfg = config or TransformerConfig(
        vocab_size=task.vocab_size, d_model=64, num_heads=4, num_layers=2, d_ff=256,
        max_seq_len=task.max_target_len, position="sinusoidal", norm_first=True, pad_id=PAD,
    )  # fmt: skip
    test_sources = task.held_out(held_out, seed=seed + 1)
    exclude = {s for s in test_sources if task.can_withhold(s)}  # held out = never trained on, where possible
    start = time.perf_counter()
    model, loss_value = train_seq2seq(
        task, cfg, steps=steps, batch_size=batch_size, lr=lr, seed=seed, exclude=exclude, progress=progress
    )
    accuracy, predictions = evaluate(model, task, test_sources)
    examples = [(list(s), task.target(s), p) for s, p in zip(test_sources[:5], predictions[:5], strict=True)]
    return DemoResult(accuracy, loss_value, steps, time.perf_counter() - start, examples)


SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}


def format_result(result: DemoResult) -> str:
    def show(seq: list[int]) -> str:  # symbols 3.. print as digits 0..9, the special ids by name
        return " ".join(SPECIAL_NAMES.get(t) or str(t - SPECIALS) for t in seq)

    lines = [
        f"trained {result.steps} steps in {result.seconds:.0f} s, final training loss {result.final_loss:.4f}",
        f"held-out exact-match accuracy: {100 * result.accuracy:.1f}%",
        "examples (source -> predicted):",
    ]
    for src, expected, predicted in result.examples:
        mark = "ok" if expected == predicted else f"WRONG, expected {show(expected)}"
        lines.append(f"  {show(src):>32}  ->  {show(predicted):<32} {mark}")
    return "\n".join(lines)
