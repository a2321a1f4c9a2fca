"""``tformer sample``: a thin skin over :func:`tformer.generation.text.sample_to` for a saved checkpoint.

``tformer sample --checkpoint PATH --prompt TEXT`` prints the prompt, then streams the continuation of a language
model to stdout as tokens are made. ``PATH``: a tformer run or checkpoint, a Hugging Face model directory (GPT-2,
Llama, Qwen2, Mistral) or a ``.gguf`` file.
"""

from __future__ import annotations

import argparse
import sys

from tformer.cli.common import add_device_flags, apply_quantize, load_model, report_errors, utf8_error

# tformer.generation.text.DEFAULT_NEW_TOKENS, for the help (which is built without importing torch; a test holds
# the two equal)
DEFAULT_NEW_TOKENS = 200


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "sample",
        help="continue a prompt with a trained language model, streaming to stdout",
        description="Sample from a language-model checkpoint. Tokens are printed as they are made; text that could "
        "begin a --stop string is held back until it cannot.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a training run or checkpoint directory, a Hugging Face model directory, a .gguf file, or smollm2 (the "
        "shipped SmolLM2-135M-Instruct, installed by make)",
    )
    p.add_argument("--prompt", required=True, help="the text to continue (must encode to at least one token)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="a chat model: send --prompt as the user's message in the layout of the model's chat template "
        "(tokenizer_config.json's chat_template; GGUF files carry theirs) and print the model's reply alone; it "
        "ends at the end of the model's turn (the model's eos token)",
    )
    p.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="with --chat: a system message before the user's (default: the template's own, if it has one)",
    )
    more = (
        f"tokens to generate (default {DEFAULT_NEW_TOKENS}); a model with learned positions sees a sliding "
        "window of at most its max_seq_len latest tokens"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help=more)
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature > 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: the most likely tokens holding mass >= p")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (ignores the three above)")
    p.add_argument("--seed", type=int, default=None, help="random seed in [0, 2**63) (default: unseeded)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="end when the generated text contains STR (not printed); repeatable",
    )
    add_device_flags(p, quantize=True)
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the decode step over a static cache: the same function (float32: the same tokens; in "
        "bfloat16 and float16 the compiled kernels round differently, so a near tie can pick another token). auto: "
        "on CUDA yes when the prompt and --max-new-tokens fit a static cache (learned positions: the model's "
        "max_seq_len), on the CPU no (there the compile costs minutes; tformer.generation.static.auto_compile gives "
        "the measured rule). Not compiled, a Llama-style model on the CPU decodes over a static cache, each block one "
        "kernel call, when the prompt and --max-new-tokens fit its trained context (else the growing cache, whose "
        "memory follows the tokens made; tformer.generation.static.auto_static_cache)",
    )
    p.set_defaults(func=_run_sample)


def _check_utf8(text: str, flag: str = "--prompt") -> None:
    """``ValueError`` for a ``flag`` whose bytes are not UTF-8 (Python's argv holds them as lone surrogates)."""
    try:
        text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} is {utf8_error(err)}; pass it as UTF-8 text") from None


def _note_unknown_chars(tokenizer, prompt: str) -> None:
    """A note on stderr when a character-level tokenizer does not know some characters of the prompt: the model
    then reads ``<unk>`` for them (or nothing, with the ``skip`` policy; ``error`` stops with its own message)."""
    unknown = getattr(tokenizer, "unknown_chars", None)
    chars = unknown(prompt) if unknown is not None and tokenizer.unknown in ("unk", "skip") else []
    if chars:
        shown = " ".join(repr(c) for c in chars[:10]) + (f" and {len(chars) - 10} more" if len(chars) > 10 else "")
        became = "<unk>" if tokenizer.unknown == "unk" else "nothing (dropped)"
        print(
            f"tformer sample: note: the model's character tokenizer does not know {shown} of the prompt; it reads "
            f"{became} there",
            file=sys.stderr,
        )


def _run_sample(args: argparse.Namespace) -> int:
    def run() -> int:
        from tformer.generation.sampling import check_max_new_tokens, check_sampling_args, row_seeds
        from tformer.generation.text import EMPTY_PROMPT, sample_to

        check_sampling_args(args.temperature, args.top_k, args.top_p, args.greedy)  # before loading anything
        row_seeds(args.seed, 1)
        if args.max_new_tokens is not None:
            check_max_new_tokens(args.max_new_tokens)
        if not args.prompt:
            raise ValueError(EMPTY_PROMPT)
        _check_utf8(args.prompt)
        if args.system is not None and not args.chat:
            raise ValueError("--system is a chat model's system message: it needs --chat")
        if args.system is not None:
            _check_utf8(args.system, "--system")
        loaded = load_model(args.checkpoint, "lm", args.device, "sample", args.dtype)
        apply_quantize(loaded.model, args.quantize)
        from tformer.generation.static import LAST_TIMINGS

        prompt = args.prompt
        if args.chat:
            from tformer.generation.chat import chat_prompt

            system = [] if args.system is None else [{"role": "system", "content": args.system}]
            prompt = chat_prompt(loaded.tokenizer, [*system, {"role": "user", "content": args.prompt}])
        _note_unknown_chars(loaded.tokenizer, prompt)
        LAST_TIMINGS.clear()  # the timings of this call's decoding, if it compiles one
        sample_to(
            sys.stdout,
            loaded.model,
            loaded.tokenizer,
            prompt,
            echo=not args.chat,
            add_special_tokens=not args.chat,
            max_new_tokens=args.max_new_tokens,
            eos_id=loaded.eos,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy,
            seed=args.seed,
            stop=args.stop or None,
            compile=None if args.compile == "auto" else args.compile == "on",  # None: the rules of auto_compile
            static_cache=None,  # and, not compiled, of auto_static_cache
            note=lambda message: print(f"tformer sample: note: {message}", file=sys.stderr),
        )
        if LAST_TIMINGS:  # empty when nothing was compiled, or nothing ran (--max-new-tokens 0)
            times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in LAST_TIMINGS.items())
            print(f"tformer sample: compiled decoding ({times}, compilation included)", file=sys.stderr)
        return 0

    return report_errors("sample", run)
