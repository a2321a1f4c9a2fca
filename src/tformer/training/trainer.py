"""Training: ``train(TrainConfig) -> TrainResult`` for decoder-only LMs and encoder-decoder models.

One optimizer step (``B`` sequences, the *global* batch, over all processes and micro-steps)::

    lr      = warmup then cosine:  lr * (s+1)/warmup  for s < warmup,
              min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup)/(steps - warmup))) / 2  after
    loss    = sum of token cross-entropies / (target tokens in the global batch)   (seq2seq: label smoothing)
    grads   = accumulated over ``grad_accum`` micro-batches (DDP all-reduces only on the last: ``no_sync``)
    clip    ||g||_2 <= grad_clip, then AdamW

AdamW weight decay applies to every parameter with ``dim >= 2`` (the weight matrices, including the token and
position embedding tables, as GPT-2/nanoGPT); biases and LayerNorm gains/shifts (``dim < 2``) are not decayed.

Exact resume. Everything a step depends on is either restored or a pure function of ``(seed, step)``: weights
and AdamW moments (checkpoint), the learning rate (step), the batch (``data.LMBatches.get(step)``), the dropout
masks (the torch RNG is re-seeded from ``(seed, step, rank)`` before each step). So ``k`` steps, stop, resume,
``N - k`` steps give bitwise the losses of ``N`` straight steps on the CPU in float32.

Data parallel. Under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in ``DistributedDataParallel``
(gloo on CPU, NCCL on CUDA). Every rank draws the same global batch and trains on its own rows; rank 0 alone
writes checkpoints, metrics and plots. The loss is normalized by the global token count, and DDP averages
gradients over ranks, so the update equals the one-process update up to floating-point summation order.

Files under ``OUT``: ``checkpoints/step-N/`` (see :mod:`tformer.training.checkpoint`), ``metrics.jsonl`` (one JSON
record per log or evaluation event), ``loss.png`` (written at the end and on interruption), ``.lock`` (held by the
run writing to ``OUT``, so that a second one fails at once instead of clobbering it). Settings are all checked
before ``OUT`` is created; a run that still fails before it logs a step (data too short for ``block_size``,
Ctrl-C while tokenizing) removes the ``OUT`` it created, and nothing else.

Divergence. The losses are read back from the device once per log interval (and before each checkpoint); a loss
that is not finite stops the run with :class:`TrainingError` before a checkpoint of the broken weights is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.generation.seq2seq import greedy_seq2seq
from tformer.training.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    CheckpointError,
    find_latest,
    last_good_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_class,
    save_checkpoint,
    unwrap,
)
from tformer.training.config import (
    STRUCTURAL,
    TrainConfig,
    TrainResult,
    model_config,
)
from tformer.training.data import (
    CorpusScan,
    LMBatches,
    Seq2SeqBatches,
    default_cache_dir,
    evaluation_batches,
    files_fingerprint,
    iter_texts,
    scan_corpus,
    split_pairs,
    tokenize_corpus,
)
from tformer.training.metrics import plot_loss, read_metrics
from tformer.training.runtime import (
    LOCK_FILE,
    StopFlag,
    TrainingError,
    World,
    all_ranks_agree,
    init_world,
    resolve_device,
    rng_state,
    run_lock,
    set_rng_state,
)
from tformer.training.tasks import SequenceTask, check_pairs_file, load_pairs
from tformer.training.tokenizers import SEQ2SEQ_SPECIALS, CharTokenizer, Tokenizer, build_tokenizer, tokenizer_from_dict


# --------------------------------------------------------------------------------------------------
# Pieces (importable: the benchmarks use the same optimizer and schedule)
# --------------------------------------------------------------------------------------------------
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


def lm_loss_sum(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Sum over tokens of ``-log p(y_t | x_<=t)``: ``x, y (B, T)``."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")


def seq2seq_loss_sum(model: nn.Module, rows, pad_id: int, label_smoothing: float = 0.0) -> Tensor:
    """Sum over target tokens (padding ignored) of the (label-smoothed) cross-entropy."""
    src, src_mask, tgt_in, tgt_out, tgt_mask = rows
    logits = model(src, tgt_in, src_mask, tgt_mask)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=pad_id,
                           reduction="sum", label_smoothing=label_smoothing)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Data and model set-up
# --------------------------------------------------------------------------------------------------
@dataclass
class _Data:
    tokenizer: Tokenizer
    train: LMBatches | Seq2SeqBatches
    val: list
    held_out: list[tuple[list[int], list[int]]] | None = None  # seq2seq: (source ids, target ids)
    max_len: int = 0  # seq2seq: the longest source or target (+ BOS/EOS)


def _cached_tokenizer(cfg: TrainConfig, files: list[Path]) -> Tokenizer:
    """Build (or read from the cache) the char/BPE tokenizer of a corpus."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    name = f"tokenizer-{files_fingerprint(files)}-{cfg.tokenizer}-{cfg.vocab_size}-{cfg.unknown}.json"
    path = cache / name
    if path.is_file():
        return tokenizer_from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
    tokenizer = build_tokenizer(cfg.tokenizer, iter_texts(files), vocab_size=cfg.vocab_size, unknown=cfg.unknown)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return tokenizer


def _prepare_data(cfg: TrainConfig, tokenizer: Tokenizer | None, files: list[Path]) -> _Data:
    """The tokenizer (``tokenizer``, or built from the data), batches and held-out set of a run; ``files``: the
    text files of an LM corpus (:func:`tformer.training.data.scan_corpus`)."""
    if cfg.kind == "lm":
        if tokenizer is None:
            tokenizer = build_tokenizer("byte") if cfg.tokenizer == "byte" else _cached_tokenizer(cfg, files)
        corpus = tokenize_corpus(files, tokenizer, val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir)
        train = LMBatches(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed)
        val = LMBatches(corpus.val, cfg.block_size, cfg.batch_size, cfg.seed).evaluation(cfg.eval_batches)
        return _Data(tokenizer, train, val)
    if cfg.task is not None:
        task = SequenceTask(cfg.task, min_len=cfg.task_min_len, max_len=cfg.task_max_len)
        if tokenizer is None:
            tokenizer = CharTokenizer(task.alphabet, SEQ2SEQ_SPECIALS, unknown="error")
        sources = task.held_out(cfg.task_held_out, seed=1234)
        held = [(list(s), task.target(s)) for s in sources]
        withheld = {s for s in sources if task.can_withhold(s)}  # short lengths cannot be withheld (all of them)
        train = Seq2SeqBatches(cfg.batch_size, cfg.seed, task=task, exclude=withheld)
        max_len = max(task.max_source_len, task.max_target_len)
    else:
        pairs = load_pairs(cfg.pairs)
        train_idx, val_idx = split_pairs(len(pairs), cfg.val_fraction)
        if tokenizer is None:
            texts = (side for i in train_idx for side in pairs[i])
            tokenizer = build_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.vocab_size,
                                        specials=SEQ2SEQ_SPECIALS, unknown=cfg.unknown)  # fmt: skip
        encoded = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        held = [encoded[i] for i in val_idx]
        train = Seq2SeqBatches(cfg.batch_size, cfg.seed, pairs=[encoded[i] for i in train_idx],
                               bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)  # fmt: skip
        max_len = max(max(len(s), len(t) + 2) for s, t in encoded)
    if (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) != (1, 2, 0):
        raise ValueError(f"a seq2seq tokenizer needs <pad>, <bos>, <eos> as ids 0, 1, 2; got {tokenizer}")
    val = evaluation_batches(held, cfg.batch_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    return _Data(tokenizer, train, val, held, max_len)


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------
def _device(cfg: TrainConfig, world: World) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:  # under torchrun each process takes its own GPU
        return torch.device("cuda", world.local_rank)
    return device


def damaged_checkpoint_error(out: str | os.PathLike, err: CheckpointError) -> CheckpointError:
    """The error for a latest checkpoint of run ``out`` that fails to load with ``err``: it names that checkpoint
    and the newest earlier one that verifies (nothing is deleted)."""
    found = list_checkpoints(Path(out) / CHECKPOINTS_DIR)
    if not found:
        return err
    good = last_good_checkpoint(found[:-1])
    hint = (f"delete it to resume from {good.name}" if good is not None else
            "no earlier checkpoint verifies; train without --resume into another --out")  # fmt: skip
    return CheckpointError(f"checkpoint {found[-1].name} is damaged ({err}); {hint}")


def _check_resumable(cfg: TrainConfig, ckpt: Checkpoint) -> None:
    if ckpt.kind != cfg.kind:
        raise ValueError(f"the checkpoint in {cfg.out} is a {ckpt.kind!r} model but this run trains a {cfg.kind!r} "
                         "one; resume with the same --data/--task/--pairs or train into another --out")  # fmt: skip
    saved = dict(ckpt.train_config)
    for name in ("data", "pairs"):  # runs saved before paths were made absolute
        if isinstance(saved.get(name), str):
            saved[name] = os.path.abspath(saved[name])
    now = {k: getattr(cfg, k) for k in STRUCTURAL}
    for settings in (saved, now):  # the attention backend does not change the weights: every backend is exact
        if isinstance(settings.get("model"), dict):
            settings["model"] = {k: v for k, v in settings["model"].items() if k != "attn_backend"}
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in STRUCTURAL if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"cannot resume {ckpt.path}: these settings differ from the saved run: {'; '.join(diffs)}")
    if ckpt.step >= cfg.steps:
        raise ValueError(f"the checkpoint is already at step {ckpt.step} >= steps={cfg.steps}; raise --steps to "
                         "train further")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, kind: str, pad_id: int | None, world: World,
                  amp: torch.dtype | None, device: torch.device, chunk: int) -> float:  # fmt: skip
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
                s = lm_loss_sum(model, *rows) if kind == "lm" else seq2seq_loss_sum(model, rows, pad_id)
            count = rows[1].numel() if kind == "lm" else (rows[3] != pad_id).sum()
            total += torch.stack([s.double(), torch.as_tensor(count, dtype=torch.float64, device=device)])
    if world.size > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


@torch.no_grad()
def exact_match(model: nn.Module, held_out: list[tuple[list[int], list[int]]], tokenizer: Tokenizer,
                device: torch.device, batch_size: int = 250) -> float:  # fmt: skip
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
        predictions = greedy_seq2seq(model, src, src_mask, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                     max_new_tokens=longest)  # fmt: skip
        correct += sum(p == list(t) for p, (_, t) in zip(predictions, chunk, strict=True))
    model.train(was_training)
    return correct / len(held_out)


def train(cfg: TrainConfig) -> TrainResult:
    """Train (or resume) the model ``cfg`` describes; see the module docstring for the exact procedure.

    Raises ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError`` / ``CheckpointError`` for settings, data
    or run directories that cannot work (before training), and :class:`TrainingError` when the loss diverges or
    another run is writing to ``cfg.out``.
    """
    cfg.validate()  # everything that can be checked before OUT is created for the lock
    scan = scan_corpus(cfg.data) if cfg.kind == "lm" else None  # the corpus's text files (a folder with none fails)
    if cfg.pairs is not None:
        check_pairs_file(cfg.pairs)
    world = init_world(cfg.device)
    try:
        if cfg.batch_size % (world.size * cfg.grad_accum):
            raise ValueError(f"batch_size={cfg.batch_size} must divide evenly into {world.size} processes x "
                             f"grad_accum={cfg.grad_accum} micro-batches (--batch-size, --grad-accum)")  # fmt: skip
        device = _device(cfg, world)
        created = _missing_folders(Path(cfg.out))  # what the lock is about to create, removed if the run fails early
        with contextlib.ExitStack() as stack:
            locked: TrainingError | None = None
            if world.main:  # rank 0 writes OUT, so rank 0 holds the lock; every rank learns whether it got it
                try:
                    stack.enter_context(run_lock(cfg.out))
                except TrainingError as err:
                    locked = err
            if not all_ranks_agree(world, device, locked is None):
                raise locked or TrainingError(f"rank 0 could not lock {cfg.out}; another run is writing there")
            try:
                return _train(cfg, world, device, scan)
            except BaseException:  # also Ctrl-C during tokenization: the lock is still held here
                if world.main and created:
                    _remove_unused_run_folder(created)
                raise
    finally:
        if world.owns_group:
            dist.destroy_process_group()


def _missing_folders(out: Path) -> list[Path]:
    """``out`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for folder in (out.absolute(), *out.absolute().parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove_unused_run_folder(created: list[Path]) -> None:
    """After a run failed: remove the folders it created (``created``, deepest first: OUT and the parents it
    made), but only while OUT holds nothing but the run's own ``.lock`` and an empty ``metrics.jsonl`` (once
    training has logged a step, the metrics and the loss plot tell what happened, and they are kept)."""
    out = created[0]
    entries = list(out.iterdir()) if out.is_dir() else []
    if any(p.name not in (LOCK_FILE, "metrics.jsonl") or not p.is_file() for p in entries):
        return
    if any(p.name == "metrics.jsonl" and p.stat().st_size > 0 for p in entries):
        return
    for p in entries:
        p.unlink()
    for folder in created:
        try:
            folder.rmdir()  # only an empty folder: anything another process put there meanwhile stays
        except OSError:
            return


def _train(cfg: TrainConfig, world: World, device: torch.device, scan: CorpusScan | None) -> TrainResult:
    out = Path(cfg.out)
    micro_rows = cfg.batch_size // (world.size * cfg.grad_accum)

    ckpt = None
    if cfg.resume:
        if find_latest(out) is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}; train without --resume first")
        try:  # on this run's attention backend: all are exact, so a run may continue on another one
            ckpt = load_checkpoint(out, with_state=True, attn_backend=cfg.model.get("attn_backend", "auto"))
        except CheckpointError as err:
            raise damaged_checkpoint_error(out, err) from None
        _check_resumable(cfg, ckpt)
    elif find_latest(out) is not None:
        raise FileExistsError(f"{out} already holds checkpoints (latest {find_latest(out).name}); pass --resume to "
                              "continue that run, or choose another --out")  # fmt: skip

    end = cfg.stop_after if cfg.stop_after is not None else cfg.steps
    if ckpt is not None and end <= ckpt.step:
        raise ValueError(f"stop_after={end} is not after the checkpoint's step {ckpt.step}; nothing to train")
    if world.main and scan is not None and scan.skipped():
        print(f"data: skipped {scan.skipped()} under {cfg.data}", file=sys.stderr)
    for turn in (True, False):  # rank 0 builds the tokenizer and token caches first; the others then read them
        if world.main == turn:
            data = _prepare_data(cfg, ckpt.tokenizer if ckpt else None, scan.files if scan else [])
        world.barrier()
    tokenizer = data.tokenizer
    config = model_config(cfg, tokenizer, data.max_len)

    if ckpt is not None:
        if ckpt.config != config:
            raise CheckpointError(f"{ckpt.path}: saved model config {ckpt.config} differs from {config}")
        model, start = ckpt.model, ckpt.step
    else:
        torch.manual_seed(cfg.seed)
        model, start = model_class(cfg.kind)(config), 0
    model.to(device).train()
    optimizer = make_optimizer(model, cfg)
    tokens_seen = 0
    loss_window: list[float] = []  # losses of the steps since the last log boundary (a multiple of log_every)
    if ckpt is not None:
        state = ckpt.trainer_state
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        tokens_seen = int(state["tokens_seen"])
        saved = [float(v) for v in state.get("loss_window", [])]  # absent in checkpoints of older versions
        loss_window = saved[max(0, len(saved) - start % cfg.log_every) :] if start % cfg.log_every else []
        if state["data"]["next_index"] != start:
            raise CheckpointError(f"{ckpt.path}: data position {state['data']['next_index']} != step {start}")
    n_params = sum(p.numel() for p in model.parameters())
    net: nn.Module = model
    if world.size > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        net = torch.compile(net)
    amp = autocast_dtype(cfg, device)
    if world.main and amp == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bfloat16():
        note = "dtype: this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX): bfloat16 autocast is emulated"
        print(f"{note} and slower than float32 here; --dtype float32 is the faster choice", file=sys.stderr)

    metrics_path = out / "metrics.jsonl"
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        # Drop the records of steps after the checkpoint (they are redone), and the loss record of a stop between
        # log boundaries: the window it averaged goes on, so the next record covers the steps it would have.
        mid_window = start % cfg.log_every != 0
        kept = [r for r in read_metrics(metrics_path) if r.get("step", 0) < start
                or (r.get("step") == start and not (mid_window and "loss" in r))] if ckpt else []  # fmt: skip
        _rewrite_jsonl(metrics_path, kept)
    metrics = open(metrics_path, "a", encoding="utf-8") if world.main else None  # noqa: SIM115

    def save(step: int) -> Path | None:
        if not world.main:
            return None
        trainer_state = {"optimizer": optimizer.state_dict(), "rng": rng_state(), "tokens_seen": tokens_seen,
                         "data": {"next_index": step, "seed": cfg.seed}, "loss_window": list(loss_window)}  # fmt: skip
        return save_checkpoint(out, model=model, tokenizer=tokenizer, kind=cfg.kind, step=step,
                               train_config=cfg.to_dict(), trainer_state=trainer_state, keep=cfg.keep)  # fmt: skip

    def record(entry: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()

    def check_finite(what: str, value: float, step: int) -> None:
        if not math.isfinite(value):
            latest = find_latest(out)
            kept = f"checkpoints up to {latest.name} are intact" if latest else "no checkpoint was written"
            clip = f"lower --grad-clip (now {cfg.grad_clip:g})" if cfg.grad_clip > 0 else "turn on --grad-clip"
            raise TrainingError(f"training diverged: {what} is {value} at step {step}; lower --lr (now {cfg.lr:g}), "
                                f"raise --warmup (now {cfg.warmup}) or {clip}; {kept}")  # fmt: skip

    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    pending: list[Tensor] = []  # per-step loss sums not yet read back (avoids a device sync every step)
    pad_id = tokenizer.pad_id
    bar = _progress_bar(cfg, world, start, n_params)
    t0 = time.perf_counter()
    window_start, window_tokens = t0, 0
    interrupted, step = False, start

    accuracy = None
    try:
        with StopFlag() as stop:
            for step in range(start, end):
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                torch.manual_seed(step_seed(cfg.seed, step, world.rank))
                batch = data.train.get(step)
                pending.append(_accumulate_gradients(net, batch, cfg, world, micro_rows, device, amp, pad_id))
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                tokens_seen += batch.num_tokens
                window_tokens += batch.num_tokens

                if world.size > 1:  # every rank must agree to stop at the same step
                    flag = torch.tensor([float(stop.requested)], device=device)
                    dist.all_reduce(flag)
                    stop.requested = bool(flag.item())
                last = done == end or stop.requested
                boundary = done % cfg.log_every == 0
                saving = (cfg.save_every and done % cfg.save_every == 0) or last
                if boundary or last or saving:  # the one host sync per log interval (and before a checkpoint)
                    values = torch.stack(pending)
                    if world.size > 1:
                        dist.all_reduce(values)  # each rank holds its share of the global mean
                    first_step = done - len(pending) + 1
                    pending.clear()
                    for i, value in enumerate(values.tolist()):
                        check_finite("the training loss", value, first_step + i)
                        losses[first_step + i] = value
                        loss_window.append(value)
                if boundary or last:
                    now = time.perf_counter()
                    rate = window_tokens / max(now - window_start, 1e-9)
                    window_start, window_tokens = now, 0
                    mean = sum(loss_window) / len(loss_window)
                    record({"step": done, "loss": mean, "lr": lr, "tokens_per_s": rate, "tokens": tokens_seen,
                            "elapsed": now - t0})  # fmt: skip
                    if boundary:
                        loss_window.clear()
                    if bar is not None:
                        bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}", refresh=False)
                        bar.update(done - bar.n)
                paused = time.perf_counter()  # evaluation and saving do not count against tokens/s
                if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                    val_losses[done] = evaluate_loss(net, data.val, cfg.kind, pad_id, world, amp, device, micro_rows)
                    check_finite("the validation loss", val_losses[done], done)
                    record({"step": done, "val_loss": val_losses[done]})
                    if bar is not None:
                        bar.write(f"step {done}: validation loss {val_losses[done]:.4f}")
                if saving:  # the losses so far are finite; the update of this very step must be too (one sync)
                    finite = torch.stack([p.isfinite().all() for p in model.parameters()]).all()
                    check_finite("a weight", 0.0 if bool(finite) else math.nan, done)
                    save(done)
                window_start += time.perf_counter() - paused
                if stop.requested:
                    interrupted = True
                    break
        seconds = time.perf_counter() - t0
        if cfg.kind == "seq2seq" and world.main and step + 1 == cfg.steps and not interrupted:
            accuracy = exact_match(model, data.held_out, tokenizer, device)
            record({"step": cfg.steps, "val_accuracy": accuracy})
    finally:  # also on an exception or a second Ctrl-C: close the log and draw what there is
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
            plot_loss(read_metrics(metrics_path), out / "loss.png", title=f"{cfg.kind} training ({n_params:,} params)")
    world.barrier()
    run_tokens = tokens_seen - (int(ckpt.trainer_state["tokens_seen"]) if ckpt else 0)
    return TrainResult(
        out=out,
        kind=cfg.kind,
        step=max(losses) if losses else start,
        losses=losses,
        val_losses=val_losses,
        val_accuracy=accuracy,
        tokens_per_s=run_tokens / max(seconds, 1e-9),
        seconds=seconds,
        checkpoint=find_latest(out),
        interrupted=interrupted,
        num_parameters=n_params,
    )


def _accumulate_gradients(net: nn.Module, batch, cfg: TrainConfig, world: World, micro_rows: int,
                          device: torch.device, amp: torch.dtype | None, pad_id: int | None) -> Tensor:  # fmt: skip
    """Forward and backward this rank's micro-batches of one global batch; returns its share of the mean loss.

    Each micro-batch loss is a *sum* over its tokens scaled by ``world_size / global tokens``; DDP then averages
    the gradients over ranks, so the accumulated gradient is that of the mean loss over the global batch. DDP
    all-reduces only after the last micro-batch (``no_sync`` before).
    """
    scale = world.size / batch.num_tokens
    smoothing = cfg.label_smoothing if cfg.kind == "seq2seq" else 0.0
    total = torch.zeros((), device=device)
    for micro in range(cfg.grad_accum):
        first = (micro * world.size + world.rank) * micro_rows
        rows = tuple(t.to(device, non_blocking=True) for t in batch.rows(first, first + micro_rows))
        sync = world.size == 1 or micro == cfg.grad_accum - 1
        with (
            contextlib.nullcontext() if sync else net.no_sync(),
            torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None),
        ):
            s = lm_loss_sum(net, *rows) if cfg.kind == "lm" else seq2seq_loss_sum(net, rows, pad_id, smoothing)
            (s * scale).backward()
        total += s.detach()
    return total / batch.num_tokens


def _progress_bar(cfg: TrainConfig, world: World, start: int, n_params: int):
    if not (cfg.progress and world.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True,
                desc=f"{cfg.kind} {n_params / 1e6:.2f}M params")  # fmt: skip


def _rewrite_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)
