"""Training benchmark: tformer's GPT against Hugging Face ``GPT2LMHeadModel`` at the same configuration.

Both models train side by side in one run on the same character-level data, the same batches in the same order,
with the same optimizer (tformer's AdamW groups, warm-up + cosine schedule, gradient clipping), and are timed in
interleaved chunks so background load on a shared machine hits both alike. Reported: training tokens/s (forward +
backward + optimizer step, evaluation excluded) and the validation loss over the *whole* held-out 10% (every
non-overlapping window), which is more precise than a few random batches.

Default configuration (nanoGPT's CPU recipe for Shakespeare): 4 layers, 4 heads, d_model 128, context 64,
batch 12, dropout 0, lr 1e-3 (100 warm-up steps) cosine to 1e-4 over 2000 steps, 90/10 split.

    python benchmarks/train_lm.py                    # both models, 2000 steps (about 4 minutes on 2 cores)
    python benchmarks/train_lm.py --steps 200        # a quick look
    python benchmarks/train_lm.py --compile tformer  # torch.compile tformer's model (or: tformer,hf)
    python benchmarks/train_lm.py --models tformer:bf16,hf,hf:bf16  # ":bf16": under bfloat16 autocast

Validation is in float32 whatever the training precision: it measures the trained (float32 master) weights.

Needs ``transformers`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tformer import DecoderLM, TransformerConfig, num_parameters
from tformer.tokenizers import CharTokenizer
from tformer.training import TrainConfig
from tformer.training.batches import LMBatches
from tformer.training.corpus import corpus_files, iter_texts, tokenize_corpus
from tformer.training.optim import lr_at, make_optimizer

ROOT = Path(__file__).resolve().parents[1]
# The same function on both sides: exact GELU, or GPT-2's tanh approximation (GPT2Config's default "gelu_new")
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


@dataclass
class Runner:
    """One model under training: its forward returning logits, optimizer and timings."""

    name: str
    model: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    bf16: bool = False  # train under torch.autocast(bfloat16), as tformer.train(dtype="bfloat16") does
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)  # seconds per step of each timed chunk


def tformer_model(vocab: int, args: argparse.Namespace) -> nn.Module:
    cfg = TransformerConfig(
        vocab_size=vocab,
        d_model=args.n_embd,
        num_heads=args.n_head,
        num_layers=args.n_layer,
        d_ff=4 * args.n_embd,
        max_seq_len=args.block_size,
        dropout=0.0,
        position="learned",
        activation=args.activation,
        norm_first=True,
        tie_embeddings=True,
        bias=True,
    )
    return DecoderLM(cfg)


def hf_model(vocab: int, args: argparse.Namespace) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_inner=4 * args.n_embd,
        activation_function=HF_ACTIVATION[args.activation],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(cfg)


@torch.no_grad()
def validation_loss(runner: Runner, val: np.ndarray, block: int, batch: int = 64) -> float:
    """Mean cross-entropy over every non-overlapping window of the validation split."""
    runner.model.eval()
    starts = np.arange(0, len(val) - block - 1, block)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch):
        index = starts[i : i + batch, None] + np.arange(block + 1)  # (b, T+1)
        window = torch.from_numpy(val[index].astype(np.int64))
        logits = runner.logits(window[:, :-1])  # (b, T, V)
        total += float(F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten(), reduction="sum"))
        count += window[:, 1:].numel()
    runner.model.train()
    return total / count


def train_chunk(runner: Runner, batches: LMBatches, steps: range, cfg: TrainConfig) -> None:
    """The training step of tformer.training (one micro-batch, mean loss), timed."""
    model, opt = runner.model, runner.optimizer
    pending = []
    start = time.perf_counter()
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batches.get(step).rows(0, batches.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=runner.bf16):
            logits = runner.logits(x)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # as tformer.training
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach())
    runner.seconds += time.perf_counter() - start
    runner.chunks.append((time.perf_counter() - start) / len(steps))
    runner.losses.extend(torch.stack(pending).tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    parser.add_argument(
        "--data", default=str(default_data), help="text file (default ../shared/data/tinyshakespeare.txt)"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--chunk", type=int, default=50, help="steps per model before switching (interleaving)")
    parser.add_argument(
        "--models",
        default="tformer,hf",
        help="comma-separated: tformer, hf; 'NAME:bf16' trains NAME under bfloat16 autocast; ratios are to the first",
    )
    parser.add_argument("--compile", default="", help="models to torch.compile, e.g. 'tformer' or 'tformer,hf'")
    activation = "gelu: exact on both sides (default); gelu_tanh: GPT-2's tanh form (HF's default gelu_new)"
    parser.add_argument("--activation", choices=sorted(HF_ACTIVATION), default="gelu", help=activation)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--report", type=int, default=500, help="print training progress every N steps")
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero (both models)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)

    if not Path(args.data).exists():
        parser.error(
            f"--data {args.data} does not exist: the default is the workplace's ../shared/data/tinyshakespeare.txt "
            "(the figures in BENCHMARKS.md); pass any text file with --data"
        )
    files = corpus_files(args.data)
    tokenizer = CharTokenizer.train(iter_texts(files), unknown="error")
    corpus = tokenize_corpus(files, tokenizer, val_fraction=0.1)
    train_cfg = TrainConfig(
        out="-",
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=args.warmup,
        weight_decay=0.1,
        betas=(0.9, 0.99),
        grad_clip=1.0,
    )
    batches = LMBatches(corpus.train, args.block_size, args.batch_size, args.seed)

    runners = []
    for spec in args.models.split(","):
        name, _, precision = spec.partition(":")
        if name not in ("tformer", "hf") or precision not in ("", "bf16"):
            parser.error(f"--models: unknown entry {spec!r}; use tformer or hf, optionally with ':bf16'")
        torch.manual_seed(args.seed)
        model = (tformer_model if name == "tformer" else hf_model)(tokenizer.vocab_size, args)
        compiled, bf16 = name in args.compile.split(","), precision == "bf16"
        net = torch.compile(model) if compiled else model
        if name == "tformer":
            logits = net
        else:

            def logits(x, net=net):
                return net(input_ids=x, use_cache=False).logits

        label = name + (" (compiled)" if compiled else "") + (" bf16" if bf16 else "")
        runners.append(Runner(label, model, logits, make_optimizer(model, train_cfg), bf16=bf16))
    print(
        f"data {args.data}: {len(corpus.train):,} train / {len(corpus.val):,} validation characters, "
        f"vocab {tokenizer.vocab_size}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    for r in runners:
        print(f"  {r.name}: {num_parameters(r.model):,} parameters")

    for start in range(0, args.steps, args.chunk):
        for r in runners:
            train_chunk(r, batches, range(start, min(start + args.chunk, args.steps)), train_cfg)
        done = min(start + args.chunk, args.steps)
        if done % args.report == 0 or done == args.steps:
            summary = ", ".join(
                f"{r.name} {np.mean(r.losses[-50:]):.4f} ({1e3 * r.chunks[-1]:.1f} ms/step)" for r in runners
            )
            print(f"step {done}: train loss (last 50 steps) {summary}", flush=True)

    tokens = args.steps * args.batch_size * args.block_size
    rows = []
    for r in runners:
        rows.append((r.name, tokens / r.seconds, validation_loss(r, corpus.val, args.block_size), r.seconds))
    print("\n| model | tokens/s | val loss | train time (s) |\n|---|---:|---:|---:|")
    for name, rate, val, secs in rows:
        print(f"| {name} | {rate:,.0f} | {val:.4f} | {secs:.1f} |")
    # ru_maxrss is in KiB on Linux: the whole process (Python, torch, data, every model of the run)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak resident memory of the process: {peak_mib:,.0f} MiB (one model per run to compare)")
    first, (_, r0, v0, _) = runners[0], rows[0]
    for other, (_, r1, v1, _) in zip(runners[1:], rows[1:], strict=True):
        # The median over chunks of the per-chunk speed ratio: a load spike on the shared host hits one chunk
        chunk_ratio = float(np.median(np.array(other.chunks) / np.array(first.chunks)))
        print(
            f"\n{first.name} / {other.name}: throughput {r0 / r1:.2f}x over the run (median per chunk "
            f"{chunk_ratio:.2f}x); val loss difference {v0 - v1:+.4f} (nats/char; {math.exp(v0):.3f} vs "
            f"{math.exp(v1):.3f} perplexity)"
        )


if __name__ == "__main__":
    main()
