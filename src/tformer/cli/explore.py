"""``tformer explore --checkpoint PATH``: serve the explorer page (:mod:`tformer.explore`) for one model.

The server binds to loopback (127.0.0.1) unless ``--host`` names another address, which prints a warning: the page
has no login, and anyone who can reach the port can run the model.
"""

from __future__ import annotations

import argparse
import sys

from tformer.cli.common import (
    add_device_flags,
    apply_quantize,
    checkpoint_path,
    note_first_conversion,
    report_errors,
    torch_dtype,
)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "explore",
        help="serve a page that shows a model's tokens, next-token choices and attention, live",
        description="Load a model and serve the explorer page on 127.0.0.1: type a prompt, see its tokens, the "
        "next-token distribution under temperature/top-k/top-p, every layer's and head's attention, the "
        "1/sqrt(d_k) scale and the causal mask as switches, and RoPE's offset curve. Ctrl-C stops it.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a tformer run or checkpoint, a Hugging Face directory, a GGUF file (a language or seq2seq model), or "
        "smollm2 (the shipped SmolLM2-135M-Instruct)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; another one is reachable by others)"
    )
    add_device_flags(p, quantize=True)
    p.set_defaults(func=_run_explore)


def _run_explore(args: argparse.Namespace) -> int:
    def run() -> int:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65535]; got {args.port}")
        from tformer.explore.analysis import open_model
        from tformer.explore.server import ExploreServer, is_loopback
        from tformer.runtime import resolve_device

        checkpoint = checkpoint_path(args.checkpoint)  # a shipped model's name: its installed file
        note_first_conversion(checkpoint, "explore")
        explorer = open_model(checkpoint, device=resolve_device(args.device), dtype=torch_dtype(args.dtype))
        apply_quantize(explorer.model, args.quantize)
        if args.quantize:
            explorer.name += f" ({args.quantize})"
        try:
            server = ExploreServer(explorer, args.host, args.port)
        except OSError as err:
            raise ValueError(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}") from None
        if not is_loopback(args.host):
            print(
                f"tformer explore: warning: serving on {args.host}, not loopback: anyone who can reach this port can "
                "use the page and run the model",
                file=sys.stderr,
            )
        print(f"tformer explore: {explorer.name} at {server.url} (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0

    return report_errors("explore", run)
