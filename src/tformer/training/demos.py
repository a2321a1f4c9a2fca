"""The two demos, both trained by :func:`tformer.training.train`.

* The main job (``make demo``, ``tformer train-demo``): a 4-layer GPT (d_model 128, byte-level, context 128) on the
  Python standard library for 1800 steps, then its validation loss, a sample and the loss plot. It replaces only
  runs of its own in its ``--out``.
* ``tformer demo``: a small encoder-decoder (2+2 layers, d_model 64) learns to reverse (sort, copy) sequences of
  digits by teacher forcing: the decoder reads ``BOS y_1 .. y_n`` and predicts ``y_1 .. y_n EOS``, the loss ignores
  padding, and accuracy is the exact match of greedy decodes on held-out sources (those of length >= 3 are never
  seen in training; shorter ones cannot all be withheld). Trained in memory (``out=None``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tformer.generation.sampling import generate
from tformer.generation.seq2seq import greedy_seq2seq
from tformer.models import pad_right
from tformer.tokenizers import BOS_ID, EOS_ID, SEQ2SEQ_SPECIALS
from tformer.training.checkpoint import CHECKPOINTS_DIR, MANIFEST, list_checkpoints
from tformer.training.config import TrainConfig, TrainResult
from tformer.training.corpus import DOC_SEPARATOR
from tformer.training.datasets import task_held_out
from tformer.training.presets import DEMO, DEMO_MODEL
from tformer.training.resume import RUN_OUTPUTS
from tformer.training.rundir import LOCK_FILE, run_lock
from tformer.training.tasks import SPECIALS, SequenceTask
from tformer.training.trainer import train

# --------------------------------------------------------------------------------------------------
# The main job
# --------------------------------------------------------------------------------------------------
# The settings that make a run a train-demo run (its length, --steps, may differ).
DEMO_IDENTITY = (
    "data",
    "task",
    "pairs",
    "tokenizer",
    "model",
    "block_size",
    "val_fraction",
    "seed",
    "batch_size",
    "grad_accum",
    "lr",
    "min_lr",
    "eval_every",
    "eval_batches",
    "save_every",
    "log_every",
)
RUN_FILES = (LOCK_FILE, *RUN_OUTPUTS, CHECKPOINTS_DIR)  # what a run writes into OUT


def demo_config(out: str, steps: int = DEMO["steps"], progress: bool = True) -> TrainConfig:
    """The main job's run (a shorter one warms up over at most a tenth of its steps)."""
    settings = {**DEMO, "steps": steps, "warmup": min(DEMO["warmup"], max(1, steps // 10))}
    return TrainConfig(out=str(out), model=dict(DEMO_MODEL), progress=progress, **settings)


def check_demo_may_replace(out: Path, cfg: TrainConfig) -> None:
    """``ValueError`` unless the existing folder ``out`` is empty or holds an earlier train-demo run: every
    checkpoint's manifest says ``kind`` "lm" and the demo's settings (``DEMO_IDENTITY``); without checkpoints, only
    the leftovers of a run that never saved one (``RUN_FILES``). The demo deletes nothing of any other run."""
    found = list_checkpoints(out / CHECKPOINTS_DIR)
    if not found:
        others = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ValueError(
                f"--out {out} is not empty and holds no train-demo run ({len(others)} other "
                f"{'entry' if len(others) == 1 else 'entries'}: {shown}); choose another --out or delete "
                "it"
            )
        return
    mine = cfg.to_dict()
    for checkpoint in found:
        try:
            manifest = json.loads((checkpoint / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            manifest = None
        manifest = manifest if isinstance(manifest, dict) else {}
        saved = manifest.get("train_config")
        if not (
            manifest.get("kind") == "lm"
            and isinstance(saved, dict)
            and all(saved.get(k) == mine[k] for k in DEMO_IDENTITY)
        ):
            kind = manifest.get("kind", "unknown")
            raise ValueError(
                f"--out {out} holds another run (kind {kind!r}, {len(found)} checkpoint"
                f"{'s' if len(found) != 1 else ''}); train-demo only replaces its own runs: choose "
                "another --out or delete it"
            )


def clear_demo_run(out: Path, cfg: TrainConfig) -> None:
    """Remove an earlier train-demo run from ``out`` (checked twice: before the lock, whose ``.lock`` would stay in
    a folder that is not ours, and again under it). A missing ``out`` is left to ``train``."""
    if not out.exists():
        return
    check_demo_may_replace(out, cfg)
    with run_lock(out):  # fails at once if another run is writing there; train() takes the lock again
        check_demo_may_replace(out, cfg)  # the folder is ours only now
        for stale in (out / CHECKPOINTS_DIR, *(out / name for name in RUN_OUTPUTS)):  # the demo starts afresh
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
    """Prompt + ``max_new_tokens`` sampled tokens, decoded: one call of :func:`tformer.generate` (key/value cache; a
    model with learned positions sees a sliding window of its last ``max_seq_len`` tokens). An empty prompt samples
    the start of a new document: the model is conditioned on the document separator of the training corpus
    (:data:`tformer.training.corpus.DOC_SEPARATOR`), which is not part of the returned text. Deterministic for a
    given ``seed``."""
    if prompt:
        ids = tokenizer.encode(prompt)
        new = generate(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)[0]
        return tokenizer.decode(ids + new)
    try:  # an empty prompt: the start of a document, after the separator that precedes one in the corpus
        start = tokenizer.encode(DOC_SEPARATOR)
    except ValueError:
        start = []
    if not start:  # a char tokenizer built from a corpus without line breaks
        raise ValueError(
            "the prompt is empty, and this tokenizer has no line break to start a document from; "
            "give a non-empty --prompt"
        )
    return tokenizer.decode(
        generate(model, [start], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)[0]
    )


# --------------------------------------------------------------------------------------------------
# The sequence-reversal demo
# --------------------------------------------------------------------------------------------------
REVERSE_MODEL = dict(d_model=64, num_heads=4, num_layers=2, d_ff=256, position="sinusoidal", norm_first=True)


@dataclass
class DemoResult:
    accuracy: float
    final_loss: float
    steps: int
    seconds: float
    examples: list[tuple[list[int], list[int], list[int]]]  # (source, expected, predicted)


def reverse_config(
    task: str = "reverse",
    *,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    held_out: int = 500,
    max_len: int = 16,
    model: dict | None = None,
    progress: bool = True,
) -> TrainConfig:
    """The demo's run: AdamW (0.9, 0.98), a short warmup and a cosine to lr/20, no label smoothing, in memory;
    sources of 1 to ``max_len`` symbols, the model ``REVERSE_MODEL`` (updated by ``model``)."""
    return TrainConfig(
        out=None,
        task=task,
        task_max_len=max_len,
        task_held_out=held_out,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        min_lr=lr / 20,
        warmup=max(1, steps // 20),
        betas=(0.9, 0.98),
        weight_decay=0.01,
        label_smoothing=0.0,
        eval_every=0,
        log_every=10,
        seed=seed,
        model={**REVERSE_MODEL, **(model or {})},
        progress=progress,
    )


def held_out_examples(result: TrainResult, cfg: TrainConfig, count: int = 5) -> list[tuple[list[int], ...]]:
    """The first ``count`` held-out sources of a task run with their targets and greedy decodes."""
    task = SequenceTask(cfg.task, min_len=cfg.task_min_len, max_len=cfg.task_max_len)
    sources = task_held_out(cfg)[:count]
    src, src_mask = pad_right([list(s) for s in sources])
    device = next(result.model.parameters()).device
    predicted = greedy_seq2seq(
        result.model,
        src.to(device),
        src_mask.to(device),
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        max_new_tokens=task.max_target_len,
    )
    return [(list(s), task.target(s), p) for s, p in zip(sources, predicted, strict=True)]


def run_demo(
    *,
    task: str = "reverse",
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    held_out: int = 500,
    progress: bool = True,
) -> DemoResult:
    """Train on ``steps`` batches of the task and report held-out exact-match accuracy."""
    cfg = reverse_config(
        task, steps=steps, batch_size=batch_size, lr=lr, seed=seed, held_out=held_out, progress=progress
    )
    result = train(cfg)
    examples = held_out_examples(result, cfg)
    return DemoResult(result.val_accuracy, result.final_loss, result.step, result.seconds, examples)


def format_result(result: DemoResult) -> str:
    def show(seq: list[int]) -> str:  # symbols print as digits 0..9, the special ids by name
        return " ".join(SEQ2SEQ_SPECIALS[t] if t < SPECIALS else str(t - SPECIALS) for t in seq)

    lines = [
        f"trained {result.steps} steps in {result.seconds:.0f} s, training loss {result.final_loss:.4f} (mean of the "
        f"last {min(20, result.steps)} steps)",
        f"held-out exact-match accuracy: {100 * result.accuracy:.1f}%",
        "examples (source -> predicted):",
    ]
    for src, expected, predicted in result.examples:
        mark = "ok" if expected == predicted else f"WRONG, expected {show(expected)}"
        lines.append(f"  {show(src):>32}  ->  {show(predicted):<32} {mark}")
    return "\n".join(lines)
