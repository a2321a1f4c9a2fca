"""The training loop: ``train(TrainConfig) -> TrainResult`` for decoder-only LMs and encoder-decoder models.

One optimizer step (``B`` sequences, the *global* batch, over all processes and micro-steps), with the schedule and
parameter groups of :mod:`tformer.training.optim` and the losses of :mod:`tformer.training.losses`::

    lr      = warmup then cosine (optim.lr_at)
    loss    = sum of token cross-entropies / (target tokens in the global batch)   (seq2seq: label smoothing)
    grads   = accumulated over ``grad_accum`` micro-batches (DDP all-reduces only on the last: ``no_sync``)
    clip    ||g||_2 <= grad_clip, then AdamW

:class:`Trainer` runs it in named steps: :meth:`~Trainer.restore` (on ``--resume``), then per step
:meth:`~Trainer.step`, :meth:`~Trainer.log`, :meth:`~Trainer.evaluate` and :meth:`~Trainer.save`.

Exact resume. Everything a step depends on is either restored or a pure function of ``(seed, step)``: weights
and AdamW moments (checkpoint), the learning rate (step), the batch (``batches.LMBatches.get(step)``), the dropout
masks (the torch RNG is re-seeded from ``(seed, step, rank)`` before each step). So ``k`` steps, stop, resume,
``N - k`` steps give bitwise the losses of ``N`` straight steps on the CPU in float32. The trainer state also keeps
the token count and the losses of the unfinished log window, so the metrics of a resumed run equal a straight run's.

Data parallel. Under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in ``DistributedDataParallel``
(gloo on CPU, NCCL on CUDA). Every rank draws the same global batch and trains on its own rows; rank 0 alone
writes checkpoints, metrics and plots. The loss is normalized by the global token count, and DDP averages
gradients over ranks, so the update equals the one-process update up to floating-point summation order.

Files under ``OUT``: ``checkpoints/step-N/`` (:mod:`tformer.training.checkpoint`), ``metrics.jsonl`` (one JSON
record per log or evaluation event), ``loss.png`` (written at the end and on interruption), ``.lock``
(:mod:`tformer.training.rundir`). Settings are all checked before ``OUT`` is created. ``out=None`` writes nothing.

Divergence. The losses are read back from the device once per log interval (and before each checkpoint); a loss
that is not finite stops the run with :class:`TrainingError` before a checkpoint of the broken weights is written.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tformer.config import ConfigError
from tformer.models import check_inputs
from tformer.runtime import resolve_device
from tformer.training.checkpoint import Checkpoint, CheckpointError, find_latest, model_class, save_checkpoint
from tformer.training.config import TrainConfig, TrainResult, model_config
from tformer.training.corpus import CorpusScan, scan_corpus
from tformer.training.datasets import RunData, prepare_data
from tformer.training.finetune import starting_config, starting_model
from tformer.training.losses import evaluate_loss, exact_match, loss_sum
from tformer.training.metrics import MetricsLog
from tformer.training.optim import autocast_dtype, cpu_has_native_bfloat16, lr_at, make_optimizer, step_seed
from tformer.training.pairs import check_pairs_file
from tformer.training.resume import check_out_outside_data, check_same_data, checkpoint_to_resume
from tformer.training.rundir import METRICS_FILE, claimed
from tformer.training.runtime import StopFlag, TrainingError, World, init_world

Init = Callable[[nn.Module], None]


def train(cfg: TrainConfig, *, init: Init | None = None) -> TrainResult:
    """Train (or resume) the model ``cfg`` describes; see the module docstring for the exact procedure.

    ``init(model)`` re-initializes a fresh model before training (e.g. the Xavier matrices of the 2017 paper).
    Raises ``ValueError`` (:class:`tformer.config.ConfigError` for a setting) / ``FileNotFoundError`` /
    ``FileExistsError`` / ``CheckpointError`` for settings, data or run directories that cannot work (before
    training), and :class:`TrainingError` when the loss diverges or another run is writing to ``cfg.out``.
    """
    cfg.validate()  # everything that can be checked before OUT is created for the lock
    if init is not None and cfg.resume:
        raise ConfigError(
            "init re-initializes a fresh model; a resumed run continues its checkpoint's weights", "resume"
        )
    if init is not None and cfg.init_from is not None:
        raise ConfigError("init re-initializes a fresh model; init_from starts from a model's weights", "init_from")
    scan = scan_corpus(cfg.data) if cfg.kind == "lm" else None  # the corpus's text files (a folder with none fails)
    check_out_outside_data(cfg)
    if cfg.pairs is not None:
        check_pairs_file(cfg.pairs)
    world = init_world(cfg.device)
    try:
        if cfg.batch_size % (world.size * cfg.grad_accum):
            raise ConfigError(
                f"batch_size={cfg.batch_size} must divide evenly into {world.size} processes x "
                f"grad_accum={cfg.grad_accum} micro-batches (--batch-size, --grad-accum)",
                "batch_size",
                "grad_accum",
            )
        device = _device(cfg, world)
        with claimed(cfg.out, world, device):
            return Trainer.prepare(cfg, world, device, scan, init).run()
    finally:
        if world.owns_group:
            dist.destroy_process_group()


def _device(cfg: TrainConfig, world: World) -> torch.device:
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:  # under torchrun each process takes its own GPU
        return torch.device("cuda", world.local_rank)
    return device


class Trainer:
    """One training run: the model, its optimizer and data, the step counter and what has been measured so far."""

    def __init__(
        self, cfg: TrainConfig, world: World, device: torch.device, data: RunData, model: nn.Module, start: int
    ) -> None:
        self.cfg, self.world, self.device, self.data = cfg, world, device, data
        self.model = model.to(device).train()
        self.optimizer = make_optimizer(self.model, cfg)
        self.amp = autocast_dtype(cfg, device)
        self.net = self._wrap(self.model)
        self.micro_rows = cfg.batch_size // (world.size * cfg.grad_accum)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.start = self.done = start  # completed optimizer steps at the start of this run, and now
        self.tokens_seen, self.tokens_at_start = 0, 0
        self.loss_window: list[float] = []  # losses of the steps since the last log boundary
        self.pending: list[Tensor] = []  # per-step losses not yet read back (one device sync per log interval)
        self.losses: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.accuracy: float | None = None
        self.lr = lr_at(start, cfg)
        self.metrics: MetricsLog | None = None
        self.bar = None
        self._window = (time.perf_counter(), 0)  # (start, tokens) of the current tokens/s measurement
        self.paused_s = 0.0  # seconds of evaluations and saves: not training time
        self.label_smoothing = cfg.label_smoothing if cfg.kind == "seq2seq" else 0.0  # of the training loss alone

    @classmethod
    def prepare(
        cls, cfg: TrainConfig, world: World, device: torch.device, scan: CorpusScan | None, init: Init | None
    ) -> Trainer:
        """Load the checkpoint to resume (if any), prepare the data, and build or restore the model."""
        ckpt = checkpoint_to_resume(cfg)
        start = starting_model(cfg) if cfg.init_from is not None and ckpt is None else None  # (model, tokenizer)
        if world.main and scan is not None and scan.skipped():
            print(f"data: skipped {scan.skipped()} under {cfg.data}", file=sys.stderr)
        tokenizer = ckpt.tokenizer if ckpt else start[1] if start else None
        for turn in (True, False):  # rank 0 builds the tokenizer and token caches first; the others then read them
            if world.main == turn:
                data = prepare_data(cfg, tokenizer, scan.files if scan else [])
            world.barrier()
        if start is not None:  # fine-tuning: the starting model as it is
            trainer = cls(cfg, world, device, data, start[0], 0)
        elif ckpt is not None:
            # the model the run was built as (a fine-tuning run: its starting model's, with the run's dropout)
            fine_tuned = cfg.init_from is not None
            config = (
                starting_config(cfg, ckpt.config) if fine_tuned else model_config(cfg, data.tokenizer, data.max_len)
            )
            if ckpt.config != config:
                raise CheckpointError(f"{ckpt.path}: saved model config {ckpt.config} differs from {config}")
            check_same_data(cfg, ckpt, data.digest)
            trainer = cls(cfg, world, device, data, ckpt.model, ckpt.step)
            trainer.restore(ckpt)
        else:
            torch.manual_seed(cfg.seed)
            model = model_class(cfg.kind)(model_config(cfg, data.tokenizer, data.max_len))
            if init is not None:
                init(model)
            trainer = cls(cfg, world, device, data, model, 0)
        if world.main:
            trainer._notes(fresh_tokenizer=tokenizer is None)
        trainer._open_outputs(resumed=ckpt is not None)
        return trainer

    def _notes(self, fresh_tokenizer: bool) -> None:
        """Settings that will not do what they seem to (on stderr, before training)."""
        cfg = self.cfg
        if cfg.warmup > cfg.steps:
            print(
                f"note: --warmup {cfg.warmup} is longer than the run (--steps {cfg.steps}): the learning rate rises to "
                f"{lr_at(cfg.steps - 1, cfg):.1e} of --lr {cfg.lr:g} and never decays; lower --warmup for a full "
                "schedule",
                file=sys.stderr,
            )
        if self.amp == torch.bfloat16 and self.device.type == "cpu" and not cpu_has_native_bfloat16():
            note = "dtype: this CPU has no native bfloat16 arithmetic (AVX512-BF16 or AMX): bfloat16 autocast is"
            print(f"{note} emulated and slower than float32 here; --dtype float32 is faster", file=sys.stderr)
        size = self.data.tokenizer.vocab_size
        if fresh_tokenizer and cfg.tokenizer == "bpe" and cfg.task is None and size < cfg.vocab_size:
            print(
                f"note: the BPE vocabulary has {size} tokens, fewer than --vocab-size {cfg.vocab_size}: the data "
                "has no more pairs to merge",
                file=sys.stderr,
            )

    def _wrap(self, model: nn.Module) -> nn.Module:
        net = model
        if self.world.size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if self.cfg.compile:
            net = torch.compile(net)
        return net

    def _open_outputs(self, resumed: bool) -> None:
        """metrics.jsonl (rewritten up to the resumed step) and the progress bar, on the rank that writes."""
        if not self.world.main:
            return
        if self.cfg.out is not None:
            mid_window = self.start % self.cfg.log_every != 0
            self.metrics = MetricsLog(
                Path(self.cfg.out) / METRICS_FILE, start=self.start if resumed else 0, mid_window=mid_window
            )
        if self.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.cfg.steps,
                initial=self.start,
                unit="step",
                dynamic_ncols=True,
                desc=f"{self.cfg.kind} {self.num_parameters / 1e6:.2f}M params",
            )

    # -- the named steps -------------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> None:
        """Continue ``ckpt``: AdamW's moments, the token count and the unfinished log window."""
        state = ckpt.trainer_state
        self.optimizer.load_state_dict(state["optimizer"])
        self.tokens_seen = self.tokens_at_start = int(state["tokens_seen"])
        saved = [float(v) for v in state.get("loss_window", [])]  # absent in checkpoints of older versions
        into_window = self.start % self.cfg.log_every
        self.loss_window = saved[max(0, len(saved) - into_window) :] if into_window else []

    def step(self) -> None:
        """One optimizer step: this step's learning rate and dropout seed, forward and backward of this rank's
        micro-batches of the global batch, clipping, the AdamW update."""
        cfg, step = self.cfg, self.done
        self.lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        torch.manual_seed(step_seed(cfg.seed, step, self.world.rank))
        batch = self.data.train.get(step)
        if step == self.start:
            self._check_first_batch(batch)
        self.pending.append(self._accumulate_gradients(batch))
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.done += 1
        self.tokens_seen += batch.num_tokens
        self._window = (self._window[0], self._window[1] + batch.num_tokens)

    def collect(self) -> None:
        """Read the losses of the steps since the last read back from the device (one sync) and check them."""
        if not self.pending:
            return
        values = torch.stack(self.pending)
        if self.world.size > 1:
            dist.all_reduce(values)  # each rank holds its share of the global mean
        first = self.done - len(self.pending) + 1
        self.pending.clear()
        for i, value in enumerate(values.tolist()):
            self._check_finite("the training loss", value, first + i)
            self.losses[first + i] = value
            self.loss_window.append(value)

    def log(self) -> None:
        """Write the mean loss of the window, the learning rate and tokens/s; a full window starts anew."""
        now = time.perf_counter()
        rate = self._window[1] / max(now - self._window[0], 1e-9)
        self._window = (now, 0)
        mean = sum(self.loss_window) / len(self.loss_window)
        self._record(
            {
                "step": self.done,
                "loss": mean,
                "lr": self.lr,
                "tokens_per_s": rate,
                "tokens": self.tokens_seen,
                "elapsed": now - self._t0,
            }
        )
        if self.done % self.cfg.log_every == 0:
            self.loss_window.clear()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{rate:,.0f}", lr=f"{self.lr:.2e}", refresh=False)
            self.bar.update(self.done - self.bar.n)

    def evaluate(self) -> None:
        """The validation loss (every rank takes its share of the rows)."""
        kind, pad_id = self.cfg.kind, self.data.tokenizer.pad_id
        value = evaluate_loss(self.net, self.data.val, kind, pad_id, self.world, self.amp, self.device, self.micro_rows)
        self._check_finite("the validation loss", value, self.done)
        self.val_losses[self.done] = value
        self._record({"step": self.done, "val_loss": value})
        if self.bar is not None:
            self.bar.write(f"step {self.done}: validation loss {value:.4f}")

    def save(self) -> None:
        """A checkpoint of this step, once its update is known to be finite (one sync)."""
        finite = torch.stack([p.isfinite().all() for p in self.model.parameters()]).all()
        self._check_finite("a weight", 0.0 if bool(finite) else math.nan, self.done)
        if not self.world.main or self.cfg.out is None:
            return
        state = {
            "optimizer": self.optimizer.state_dict(),
            "tokens_seen": self.tokens_seen,
            "loss_window": list(self.loss_window),
        }
        save_checkpoint(
            self.cfg.out,
            model=self.model,
            tokenizer=self.data.tokenizer,
            kind=self.cfg.kind,
            step=self.done,
            train_config={**self.cfg.to_dict(), "data_digest": self.data.digest},  # checked on --resume
            trainer_state=state,
            keep=self.cfg.keep,
        )

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Step until ``stop_after`` (or ``steps``), or Ctrl-C (which stops after the current step and saves)."""
        cfg = self.cfg
        end = cfg.stop_after if cfg.stop_after is not None else cfg.steps
        self._t0 = time.perf_counter()
        self._window = (self._t0, 0)
        interrupted = False
        try:
            if cfg.init_from is not None and self.done == 0:  # fine-tuning: the starting model's loss on this data
                with self._paused():
                    self.evaluate()
            with StopFlag() as stop:
                while self.done < end and not interrupted:
                    self.step()
                    interrupted = self._agree_to_stop(stop)
                    last = self.done == end or interrupted
                    boundary = self.done % cfg.log_every == 0
                    saving = (cfg.save_every and self.done % cfg.save_every == 0) or last
                    if boundary or last or saving:
                        self.collect()
                    if boundary or last:
                        self.log()
                    with self._paused():  # evaluation and saving do not count against tokens/s
                        if (cfg.eval_every and self.done % cfg.eval_every == 0) or self.done == cfg.steps:
                            self.evaluate()
                        if saving:
                            self.save()
            seconds = time.perf_counter() - self._t0
            if cfg.kind == "seq2seq" and self.world.main and self.done == cfg.steps and not interrupted:
                self.accuracy = exact_match(self.model, self.data.held_out, self.data.tokenizer, self.device)
                self._record({"step": cfg.steps, "val_accuracy": self.accuracy})
        finally:  # also on an exception or a second Ctrl-C: close the log and draw what there is
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close(title=f"{cfg.kind} training ({self.num_parameters:,} params)")
        self.world.barrier()
        return self._result(seconds, interrupted)

    # -- helpers ---------------------------------------------------------------------------------------
    def _accumulate_gradients(self, batch) -> Tensor:
        """Forward and backward this rank's micro-batches of one global batch; returns its share of the mean loss.

        Each micro-batch loss is a *sum* over its tokens scaled by ``world_size / global tokens``; DDP then averages
        the gradients over ranks, so the accumulated gradient is that of the mean loss over the global batch. DDP
        all-reduces only after the last micro-batch (``no_sync`` before).
        """
        cfg, world, device = self.cfg, self.world, self.device
        scale = world.size / batch.num_tokens
        smoothing = self.label_smoothing
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            first = (micro * world.size + world.rank) * self.micro_rows
            rows = tuple(t.to(device, non_blocking=True) for t in batch.rows(first, first + self.micro_rows))
            sync = world.size == 1 or micro == cfg.grad_accum - 1
            with (
                contextlib.nullcontext() if sync else self.net.no_sync(),
                torch.autocast(device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None),
            ):
                s = loss_sum(self.net, cfg.kind, rows, self.data.tokenizer.pad_id, smoothing)
                (s * scale).backward()
            total += s.detach()
        return total / batch.num_tokens

    def _check_first_batch(self, batch) -> None:
        """The ids of the first batch against the model's vocabulary, once (the forward itself reads no ids)."""
        rows = batch.rows(0, min(len(batch), self.micro_rows))
        named = {"ids": rows[0], "targets": rows[1]} if self.cfg.kind == "lm" else {"src": rows[0], "tgt_in": rows[2]}
        for name, ids in named.items():
            check_inputs(self.model.cfg, ids, name=name)

    def _agree_to_stop(self, stop: StopFlag) -> bool:
        if self.world.size > 1:  # every rank must agree to stop at the same step
            flag = torch.tensor([float(stop.requested)], device=self.device)
            dist.all_reduce(flag)
            stop.requested = bool(flag.item())
        return stop.requested

    @contextlib.contextmanager
    def _paused(self):
        paused = time.perf_counter()
        yield
        elapsed = time.perf_counter() - paused
        start, tokens = self._window
        self._window = (start + elapsed, tokens)
        self.paused_s += elapsed

    def _record(self, entry: dict) -> None:
        if self.metrics is not None:
            self.metrics.record(entry)

    def _check_finite(self, what: str, value: float, step: int) -> None:
        if math.isfinite(value):
            return
        cfg = self.cfg
        latest = find_latest(cfg.out) if cfg.out is not None else None
        kept = f"checkpoints up to {latest.name} are intact" if latest else "no checkpoint was written"
        clip = f"lower --grad-clip (now {cfg.grad_clip:g})" if cfg.grad_clip > 0 else "turn on --grad-clip"
        raise TrainingError(
            f"training diverged: {what} is {value} at step {step}; lower --lr (now {cfg.lr:g}), "
            f"raise --warmup (now {cfg.warmup}) or {clip}; {kept}",
            losses=dict(self.losses),
        )

    def _result(self, seconds: float, interrupted: bool) -> TrainResult:
        out = Path(self.cfg.out) if self.cfg.out is not None else None
        return TrainResult(
            out=out,
            kind=self.cfg.kind,
            step=max(self.losses) if self.losses else self.start,
            losses=self.losses,
            val_losses=self.val_losses,
            val_accuracy=self.accuracy,
            tokens_per_s=(self.tokens_seen - self.tokens_at_start) / max(seconds - self.paused_s, 1e-9),
            seconds=seconds,
            checkpoint=find_latest(out) if out is not None else None,
            interrupted=interrupted,
            num_parameters=self.num_parameters,
            label_smoothing=self.label_smoothing,
            trained_held_out=self.data.trained_held_out,
            model=self.model.eval(),
            tokenizer=self.data.tokenizer,
        )
