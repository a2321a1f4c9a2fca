"""Compiled decoding on CUDA (issue 13): exactness, one graph per bucket, freed models, and decode speed.

    python benchmarks/gpu_decode.py                  # on the GPU (CUDA graphs: ``mode="reduce-overhead"``)
    python benchmarks/gpu_decode.py --device cpu --new-tokens 16 --layers 2   # a dry run of the same steps

1. A tiny float32 model with peaked random weights, three left-padded prompts: greedy tokens of the default cache,
   the static cache and compiled decoding must be equal; dynamo's counters must show two graphs (prefill, step) for
   the first compiled call and none for a second in the same bucket; a deleted compiled model must be freed.
2. Speed: a model of SmolLM2-135M's shape (30 Llama blocks, d_model 576, 9 heads over 3 key/value heads, d_ff 1536,
   vocabulary 49152) with random bfloat16 weights, batch 1, a 32-token prompt, ``--new-tokens`` greedy tokens:
   eager (the default cache) against compiled, best of ``--repeats`` after a first call, beside the bound
   ``bandwidth / weight bytes`` with the bandwidth read by a large ``sum`` on the same device.
Exits 1 when a check of part 1 fails.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import weakref

import torch
from torch._dynamo.utils import counters

from tformer import DecoderLM, TransformerConfig, generate
from tformer.engine.quantization import weight_bytes

LLAMA = dict(position="rotary", norm="rms", ffn="gated", activation="silu", bias=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peaked(model: DecoderLM) -> DecoderLM:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def exactness(device: torch.device) -> list[str]:
    torch.manual_seed(0)
    model = peaked(DecoderLM(TransformerConfig.tiny(**LLAMA)).to(device))
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2, 6, 9], [3, 3, 1, 7, 2, 5]]
    default = generate(model, prompts, max_new_tokens=20, greedy=True)
    static = generate(model, prompts, max_new_tokens=20, greedy=True, static_cache=True)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompts, max_new_tokens=20, greedy=True, compile=True)
    first = counters["stats"]["unique_graphs"] - before
    again = generate(model, [p[:-1] for p in prompts], max_new_tokens=25, greedy=True, compile=True)
    second = counters["stats"]["unique_graphs"] - before - first
    eager_again = generate(model, [p[:-1] for p in prompts], max_new_tokens=25, greedy=True)
    alive = weakref.ref(model)
    del model
    gc.collect()
    checks = {
        "static cache == default cache (float32 greedy)": static == default,
        "compiled == default cache (float32 greedy)": compiled == default,
        "compiled == default, another prompt length in the bucket": again == eager_again,
        f"first compiled call: 2 graphs (got {first})": first == 2,
        f"second call in the bucket: no new graph (got {second})": second == 0,
        "a deleted compiled model is freed": alive() is None,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    return [name for name, ok in checks.items() if not ok]


def bandwidth(device: torch.device, gib: float) -> float:
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def rate(model: DecoderLM, prompt: list[int], new: int, repeats: int, device: torch.device, **kwargs) -> tuple:
    sync(device)
    start = time.perf_counter()
    generate(model, [prompt], max_new_tokens=new, greedy=True, **kwargs)
    sync(device)
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        generate(model, [prompt], max_new_tokens=new, greedy=True, **kwargs)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return new / best, first


def speed(device: torch.device, layers: int, new: int, repeats: int, gib: float) -> None:
    cfg = TransformerConfig(
        vocab_size=49152, d_model=576, num_heads=9, num_kv_heads=3, num_layers=layers, d_ff=1536, max_seq_len=2048,
        tie_embeddings=True, **LLAMA,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (32,)).tolist()
    read = bandwidth(device, gib)
    size = weight_bytes(model)
    bound = read / size
    print(f"\nread bandwidth (sum over {gib:g} GiB float32): {read / 1e9:.0f} GB/s; weights {size / 1e6:.0f} MB; "
          f"bound {bound:.0f} tok/s")  # fmt: skip
    print(f"batch 1, 32-token prompt, {new} new tokens, greedy, bfloat16, {layers} layers, best of {repeats}")
    print("| setting | tok/s | share of bound | first call s |\n|---|---:|---:|---:|")
    rates = {}
    for name, kwargs in (("eager, default cache", {}), ("eager, static cache", {"static_cache": True}),
                         ("compiled", {"compile": True})):  # fmt: skip
        tokens_s, first = rate(model, prompt, new, repeats, device, **kwargs)
        rates[name] = tokens_s
        print(f"| {name} | {tokens_s:.1f} | {tokens_s / bound:.0%} | {first:.1f} |", flush=True)
    print(f"compiled / eager default cache: {rates['compiled'] / rates['eager, default cache']:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--layers", type=int, default=30, help="blocks of the SmolLM2-shaped model (30: its own)")
    parser.add_argument("--new-tokens", type=int, default=256, help="greedy tokens a timed run makes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each setting after a first call")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB summed for the bandwidth reading")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False; pass --device cpu for a dry run")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    failed = exactness(device)
    speed(device, args.layers, args.new_tokens, args.repeats, args.gib)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
