"""Hook points: what they cost, against a plain forward and against TransformerLens, and what a cache holds.

One GPT-2-small-shaped model (12 blocks, d_model 768, 12 heads, GPT-2's vocabulary) with random weights, built by
``transformers`` and read by tformer's interop, so tformer and TransformerLens (4.3, its ``TransformerBridge`` in
compatibility mode without weight processing) compute the same function of the same weights. The measurements
alternate in rounds (best of each), and every figure is a ratio to a baseline measured in the same run:

* a forward with hooks attached to no point that fires (every module's hook table present, none holding a hook),
  against the plain forward: the dispatch cost alone;
* ``run_with_cache`` of the residual stream after every block (``blocks.{i}.hook_resid_post``), against the plain
  forward (goal: at most 1.15x);
* ``run_with_cache`` of every point, tformer against TransformerLens's ``run_with_cache`` on the same tokens (goal:
  tformer 1.5x faster);
* the bytes the cache holds: ``ActivationCache.nbytes()``, the bytes the names imply (their shapes times 4), and
  what PyTorch's allocator kept allocated across the call (``torch.profiler``'s memory accounting, not the
  resident set): the three agree.

Run:  python benchmarks/hooks.py [--tokens 256] [--rounds 5]   (needs pip install -e ".[bench]")
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def build(seed: int = 0):
    """(tformer's model, TransformerLens's bridge) of one random GPT-2-small."""
    import transformers

    import tformer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    hf.set_attn_implementation("eager")
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = tformer.load_pretrained(folder, dtype=torch.float32).model.eval()
    sys.path.insert(0, str(ROOT))
    from tests.hooks.tl_models import boot  # offline: a local WordLevel tokenizer, the model object given

    bridge = boot(hf, "gpt2")
    bridge.enable_compatibility_mode(no_processing=True)
    return ours, bridge


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def allocated_across(run) -> int:
    """Bytes PyTorch's CPU allocator holds more after ``run()`` than before, while its result is alive (each op's
    own allocations minus its frees, ``self_cpu_memory_usage``: the total would count nested ops twice)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = run()
    total = sum(e.self_cpu_memory_usage for e in prof.events())  # allocations positive, frees negative
    del kept
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from tformer import hooks
    from tformer.hooks.run import Taps

    ours, bridge = build()
    ids = torch.randint(0, 50257, (1, args.tokens))
    depth = len(ours.decoder.stack.blocks)
    resid = [f"blocks.{i}.hook_resid_post" for i in range(depth)]
    modules = {p.module for p in hooks.points(ours).values()}

    def plain():
        with torch.no_grad():
            return ours(ids)

    def dispatch_only():
        for m in modules:
            m.taps = Taps()
        try:
            with torch.no_grad():
                return ours(ids)
        finally:
            for m in modules:
                m.taps = None

    runs = {
        "plain forward": plain,
        "hooks attached, none firing": dispatch_only,
        "cache: resid_post of every block": lambda: hooks.run_with_cache(ours, ids, names=resid),
        "cache: every point (tformer)": lambda: hooks.run_with_cache(ours, ids),
        "TransformerLens forward": lambda: bridge(ids),
        "cache: every point (TransformerLens)": lambda: bridge.run_with_cache(ids),
    }
    with torch.no_grad():
        for run in runs.values():
            run()  # warm
        best = {name: math.inf for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                best[name] = min(best[name], timed(run))

    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"GPT-2-small shape (12 x 768, 12 heads), random weights, float32, 1 x {args.tokens} tokens, best of "
        f"{args.rounds} alternated rounds\n"
    )
    print("| measurement | seconds | ratio | against |")
    print("|---|---|---|---|")
    rows = [
        ("plain forward", "", ""),
        ("hooks attached, none firing", "plain forward", ""),
        ("cache: resid_post of every block", "plain forward", "goal <= 1.15"),
        ("cache: every point (tformer)", "plain forward", ""),
        ("TransformerLens forward", "plain forward", ""),
        ("cache: every point (TransformerLens)", "cache: every point (tformer)", "goal >= 1.5 (TL / tformer)"),
    ]
    for name, base, note in rows:
        ratio = f"{best[name] / best[base]:.3f}x" if base else ""
        print(f"| {name} | {best[name]:.4f} | {ratio} | {base} {note} |")

    _, cache = hooks.run_with_cache(ours, ids)
    names_total = sum(t.numel() * t.itemsize for t in cache.values())
    out_bytes = plain().numel() * 4
    shared_out = out_bytes if "hook_unembed" in cache else 0  # the returned logits are the cached hook_unembed
    kept = allocated_across(lambda: hooks.run_with_cache(ours, ids))
    _, tl_cache = bridge.run_with_cache(ids)
    tl_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tl_cache.values()}.values())
    mib = 2**20
    print(
        f"\ncache of every point: {len(cache)} names, {names_total / mib:.1f} MiB by their shapes; nbytes() (each "
        f"storage once: resid_post(i) is resid_pre(i+1), mlp_in is resid_mid) {cache.nbytes() / mib:.1f} MiB; "
        f"PyTorch's allocator kept {kept / mib:.1f} MiB across run_with_cache = nbytes() + the logits "
        f"({(cache.nbytes() + out_bytes - shared_out) / mib:.1f} MiB); TransformerLens: {len(tl_cache)} names, "
        f"{tl_bytes / mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()
