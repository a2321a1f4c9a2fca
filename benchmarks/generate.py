"""Generation speed: tformer with the KV cache, without it, and Hugging Face ``GPT2LMHeadModel.generate``.

Same sizes on both sides (random weights; nothing is copied): 4 layers, 4 heads, d_model 128, d_ff 512,
a 65-token character vocabulary, 256 learned positions, tied embeddings, Pre-LN, GPT-2's tanh-approximated
GELU (``activation="gelu_tanh"``; HF's default ``gelu_new``). Batch 1, a 16-token prompt, 200 new tokens, greedy.

Two comparisons: without any stop condition (HF with no EOS token: its fastest path, no per-step check), and
with an EOS id checked every step on both sides (an id the greedy output never holds, so all 200 tokens are
made). At this size a decode step is a few hundred microseconds of small kernels, so what is measured is
mostly per-step Python and dispatch overhead. The runs are interleaved, each ``--repeats`` times, and the best
(shortest) time of each is reported: the one least disturbed by other load on the machine.

Run:  OMP_NUM_THREADS=1 python benchmarks/generate.py   (needs the ``bench`` extra: ``pip install transformers``)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _common import cpu_model
from torch import Tensor

from tformer import DecoderLM, TransformerConfig
from tformer.generation.sampling import generate


def tformer_model(args: argparse.Namespace) -> DecoderLM:
    cfg = TransformerConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_ff=4 * args.d_model,
        max_seq_len=args.positions,
        position="learned",
        activation="gelu_tanh",
        norm_first=True,
        tie_embeddings=True,
    )
    return DecoderLM(cfg).eval()


def hf_model(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.positions,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return GPT2LMHeadModel(cfg).eval()


def step_breakdown(model: DecoderLM, past: int = 100, rounds: int = 20, calls: int = 100) -> dict[str, float]:
    """Microseconds of one cached decode step (batch 1, ``past`` cached tokens) computed three ways on the same
    weights: bare ``torch.nn.functional`` calls, the same ops through the ``nn.Module``s, and ``model(...)``.
    The differences are per-call overhead (module calls, parameter look-ups, checks), not arithmetic."""
    cfg, F = model.cfg, torch.nn.functional
    B, C, H, D = 1, cfg.d_model, cfg.num_heads, cfg.head_dim
    with torch.inference_mode():
        cache = model.new_cache()
        model(torch.randint(0, cfg.vocab_size, (B, past)), cache=cache)
        token, position = torch.tensor([[3]]), torch.tensor([past])
        blocks, embed = list(model.decoder.stack.blocks), model.decoder.embed
        final = model.decoder.stack.final_norm

        E, P = embed.tokens.weight, embed.positions.table.weight
        weights = [
            (
                b.self_attn_norm.weight,
                b.self_attn_norm.bias,
                b.self_attn.in_proj.weight,
                b.self_attn.in_proj.bias,
                b.self_attn.out_proj.weight,
                b.self_attn.out_proj.bias,
                b.ff_norm.weight,
                b.ff_norm.bias,
                b.ff.up.weight,
                b.ff.up.bias,
                b.ff.down.weight,
                b.ff.down.bias,
            )
            for b in blocks
        ]

        def attend(qkv: Tensor, K: Tensor, V: Tensor) -> Tensor:  # (B, 1, 3C) -> (B, 1, C); K/V written at past
            q, k, v = qkv.split_with_sizes([C, C, C], dim=-1)
            q, k, v = (
                q.view(B, 1, H, D).transpose(1, 2),
                k.view(B, 1, H, D).transpose(1, 2),
                v.view(B, 1, H, D).transpose(1, 2),
            )
            K[:, :, past : past + 1], V[:, :, past : past + 1] = k, v
            o = F.scaled_dot_product_attention(q, K[:, :, : past + 1], V[:, :, : past + 1])  # (B, H, 1, D)
            return o.transpose(1, 2).reshape(B, 1, C)

        def functional() -> Tensor:
            x = F.embedding(token, E) + F.embedding(position, P)
            for (n1w, n1b, wi, bi, wo, bo, n2w, n2b, wu, bu, wd, bd), (K, V) in zip(weights, stores, strict=True):
                x = x + F.linear(attend(F.linear(F.layer_norm(x, (C,), n1w, n1b), wi, bi), K, V), wo, bo)
                x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (C,), n2w, n2b), wu, bu), approximate="tanh"), wd, bd)
            return F.linear(F.layer_norm(x, (C,), final.weight, final.bias), E)

        def modules() -> Tensor:
            x = embed.tokens(token) + embed.positions.table(position)
            for block, (K, V) in zip(blocks, stores, strict=True):
                attn = block.self_attn
                x = x + attn.out_proj(attend(attn.in_proj(block.self_attn_norm(x)), K, V))
                x = x + block.ff(block.ff_norm(x))
            return F.linear(final(x), embed.tokens.weight)

        def full_model() -> Tensor:
            logits = model(token, cache=cache)
            for c in cache:  # forget the token again, so every call sees `past` cached tokens
                c.self_kv.length -= 1
            return logits

        reference = full_model()  # the first step also grows the cache storage to its final size
        stores = [(c.self_kv.k, c.self_kv.v) for c in cache]
        for run in (functional, modules):  # the same step three ways: the same logits
            torch.testing.assert_close(run(), reference, rtol=1e-5, atol=1e-5)
        ways = {"bare functional ops": functional, "the same through nn.Modules": modules, "tformer model": full_model}
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(rounds):
            for name, run in ways.items():
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def unused_token(tokens: list[int], vocab: int) -> int:
    """A token id absent from ``tokens``: as EOS it is checked every step but never ends the run early."""
    return next(t for t in range(vocab) if t not in set(tokens))


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="blocks of both models")
    p.add_argument("--heads", type=int, default=4, help="attention heads a block")
    p.add_argument("--d-model", type=int, default=128, help="model width (d_ff is 4x)")
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size")
    p.add_argument("--positions", type=int, default=256, help="learned positions")
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens")
    p.add_argument("--new", type=int, default=200, help="new tokens a run, greedy")
    p.add_argument("--repeats", type=int, default=9, help="interleaved runs; the best of them is reported")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face (transformers not installed)")
    p.add_argument("--breakdown", action="store_true", help="only time one decode step three ways (see step_breakdown)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    ours = tformer_model(args)
    if args.breakdown:
        print("| one cached decode step (100 cached tokens) | us |\n|---|---:|")
        for name, us in step_breakdown(ours).items():
            print(f"| {name} | {us:.0f} |")
        return
    n = args.new
    ours_eos = unused_token(generate(ours, prompt, max_new_tokens=n, greedy=True)[0], args.vocab)

    def ours_run(**kwargs) -> Callable[[], object]:
        def run():
            out = generate(ours, prompt, max_new_tokens=n, greedy=True, **kwargs)
            assert len(out[0]) == n

        return run

    # (name, run, name of the Hugging Face run it is compared with)
    runs: list[tuple[str, Callable[[], object], str]] = [
        ("tformer, KV cache", ours_run(), "HF generate"),
        ("tformer, KV cache, EOS checked each step", ours_run(eos_id=ours_eos), "HF generate, EOS checked each step"),
        ("tformer, no cache (full recompute)", ours_run(use_cache=False), "HF generate"),
    ]
    if not args.no_hf:
        hf = hf_model(args)
        attention = torch.ones_like(prompt)

        def hf_run(**kwargs) -> Callable[[], object]:
            def run():
                with torch.inference_mode():
                    out = hf.generate(prompt, attention_mask=attention, max_new_tokens=n, do_sample=False, **kwargs)
                assert out.shape[1] == args.prompt + n
                return out

            return run

        hf_eos = unused_token(hf_run()()[0, args.prompt :].tolist(), args.vocab)
        runs += [
            ("HF generate", hf_run(), ""),
            ("HF generate, EOS checked each step", hf_run(eos_token_id=hf_eos, pad_token_id=hf_eos), ""),
        ]
    for _, run, _ in runs:  # warm-up: first-call allocations, lazy initialisation
        run()
    best = {name: float("inf") for name, _, _ in runs}
    for _ in range(args.repeats):  # interleaved, so slow phases of the machine hit every run alike
        for name, run, _ in runs:
            best[name] = min(best[name], _timed(run))
    versions = f"torch {torch.__version__}"
    if not args.no_hf:
        import transformers

        versions += f", transformers {transformers.__version__}"
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} thread(s), {versions}")
    print(f"batch 1, prompt {args.prompt}, {n} new tokens, greedy; best of {args.repeats} interleaved runs\n")
    print("| run | tokens/s | ms/token | vs its HF run |")
    print("|---|---:|---:|---:|")
    for name, _, reference in runs:
        ratio = f"{best[reference] / best[name]:.2f}x" if reference in best else "-"
        print(f"| {name} | {n / best[name]:,.0f} | {1000 * best[name] / n:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
