"""The tasks: each benchmark's documents turned into requests, in the prompt format of each protocol.

A multiple-choice example is a list of ``(context, continuation)`` requests, one per choice, the gold index, and the
choice texts its length normalization divides by. The formats are the protocols' own (``protocols`` names the
sources): lm-evaluation-harness's task YAMLs (``lm_eval/tasks/<task>/``) and the SmolLM2 cards' lighteval tasks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tformer.evaluation import data
from tformer.evaluation.data import EvalError

LETTERS = "ABCDEFGHIJ"


@dataclass
class Example:
    """One multiple-choice question: ``requests[i] = (context, continuation)`` scores choice ``i``; ``choices`` are
    the texts its length normalization counts."""

    id: str
    requests: list[tuple[str, str]]
    choices: list[str]
    gold: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """A named task: its kind (``choice``, ``lambada``, ``perplexity``, ``sts``), what it reads and its reference."""

    name: str
    kind: str
    about: str
    build: Callable[[str], list[Example]] | None = None  # protocol -> examples (choice and lambada tasks)


def _mc(context: str, choices: list[str], gold: int, protocol: str, id: str, **extra) -> Example:
    """The usual layout: the same context for every choice, joined by a space (lm-eval's ``target_delimiter``,
    the ``" " + choice`` of the lighteval prompts); lm-eval normalizes by the bare choice, lighteval by the joined."""
    joined = [" " + c for c in choices]
    norm = choices if protocol == "lm-eval" else joined
    return Example(id, [(context, c) for c in joined], norm, gold, extra)


def _hellaswag_text(text: str) -> str:
    """lm-eval's ``hellaswag/utils.py`` ``preprocess`` (WikiHow's bracket artifacts out); lighteval's omits the
    ``strip``."""
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(protocol: str) -> list[Example]:
    out = []
    for i, row in enumerate(data.read_arrow("hellaswag/none/validation")):
        gold = int(row["label"])
        if protocol == "lm-eval":
            ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
            query = _hellaswag_text((row["activity_label"] + ": " + ctx).strip())
            out.append(_mc(query, [_hellaswag_text(e.strip()) for e in row["endings"]], gold, protocol, str(i)))
        else:
            query = _hellaswag_text(row["activity_label"] + ": " + f"{row['ctx_a']} {row['ctx_b'].capitalize()} ")
            out.append(_mc(query, [_hellaswag_text(e) for e in row["endings"]], gold, protocol, str(i)))
    return out


def piqa(protocol: str) -> list[Example]:
    rows = data.read_arrow("piqa/plain_text/validation")
    return [
        _mc(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], int(r["label"]), protocol, str(i))
        for i, r in enumerate(rows)
    ]


def _arc(task: str, protocol: str) -> list[Example]:
    """The ARC test sets, from OLMES's request file: its ``query`` is lm-eval's and lighteval's
    ``Question: {question}\\nAnswer:``."""
    docs = data.read_requests(f"{task}/test_rc_5shot")
    return [_mc(d["query"], d["choices"], int(d["gold"]), protocol, str(d["id"])) for d in docs]


def arc_easy(protocol: str) -> list[Example]:
    return _arc("arc_easy", protocol)


def arc_challenge(protocol: str) -> list[Example]:
    return _arc("arc_challenge", protocol)


def openbookqa(protocol: str) -> list[Example]:
    """The test set (lm-eval's ``test_split``, the SmolLM2 card's ``evaluation_splits``), from OLMES's request file:
    its ``query`` is ``Question: {question_stem}\nAnswer:``, and both protocols read the bare stem."""
    docs = data.read_requests("openbookqa/test_rc_5shot")
    stems = [d["query"].removeprefix("Question: ").removesuffix("\nAnswer:") for d in docs]
    return [_mc(q, d["choices"], int(d["gold"]), protocol, str(d["id"])) for q, d in zip(stems, docs, strict=True)]


def commonsense_qa(protocol: str) -> list[Example]:
    """lm-eval: the question with lettered options, the letter scored; lighteval (SmolLM2): the bare question, the
    answer text scored."""
    out = []
    for r in data.read_arrow("tau/commonsense_qa/none/validation"):
        texts, labels = r["choices"]["text"], r["choices"]["label"]
        gold = labels.index(r["answerKey"].strip())
        if protocol == "lm-eval":
            options = "".join(f"\n{label}. {text}" for label, text in zip(labels, texts, strict=True))
            out.append(
                _mc(f"Question: {r['question'].strip()}{options}\nAnswer:", list(labels), gold, protocol, r["id"])
            )
        else:
            out.append(_mc(r["question"], texts, gold, protocol, r["id"]))
    return out


def winogrande(protocol: str) -> list[Example]:
    """lm-eval: partial evaluation, the sentence up to the blank filled with each option is the context and the rest
    the continuation; lighteval: the sentence up to the blank is the context, ``option + " " + rest`` the choices."""
    out = []
    for i, r in enumerate(data.read_arrow("winogrande/winogrande_xl/validation")):
        sentence, options, gold = r["sentence"], [r["option1"], r["option2"]], int(r["answer"]) - 1
        blank = sentence.index("_")
        if protocol == "lm-eval":
            rest = " " + sentence[blank + 1 :].strip()
            contexts = [sentence[:blank] + o for o in options]
            out.append(Example(str(i), [(c, rest) for c in contexts], contexts, gold))
        else:
            query, end = sentence.split("_", 1)
            choices = [f"{o} {end.strip()}" for o in options]
            out.append(Example(str(i), [(query, c) for c in choices], choices, gold))
    return out


def mmlu(protocol: str) -> list[Example]:
    """MMLU's test set in cloze form (the answer text scored, no lettered options), subjects in alphabetical order
    (the ``all`` configuration's order). lm-eval: its ``mmlu_continuation`` prompt (the subject's description, a
    blank line, ``Question: ...\nAnswer:``); lighteval: the SmolLM2 card's."""
    out = []
    for subject in data.arrow_splits("hails/mmlu_no_train"):
        topic = subject.replace("_", " ")
        for i, r in enumerate(data.read_arrow(f"hails/mmlu_no_train/{subject}/test")):
            if protocol == "lm-eval":
                query = f"The following are questions (with answers) about {topic}.\n\n"
                query += f"Question: {r['question'].strip()}\nAnswer:"
            else:
                query = f"The following are questions about {topic}.\nQuestion: {r['question']}\nAnswer:"
            out.append(_mc(query, r["choices"], int(r["answer"]), protocol, f"{subject}/{i}", subject=subject))
    return out


def lambada(protocol: str) -> list[Example]:
    """LAMBADA (OpenAI's test set, 5,153 passages): the passage without its last word, then ``" " + word``."""
    docs = data.read_requests("lambada/bpb_0shot")
    return [Example(str(d["id"]), [(d["query"], " " + d["answers_text"][0])], [d["answers_text"][0]], 0) for d in docs]


def user_choices(path: str, protocol: str) -> list[Example]:
    """A user's JSONL file (``data.read_choices_jsonl``), in the usual layout."""
    rows = data.read_choices_jsonl(path)
    return [_mc(r["context"], r["choices"], r["gold"], protocol, str(r.get("id", i))) for i, r in enumerate(rows)]


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("hellaswag", "choice", "HellaSwag validation (10,042)", hellaswag),
        TaskSpec("piqa", "choice", "PIQA validation (1,838)", piqa),
        TaskSpec("winogrande", "choice", "WinoGrande XL validation (1,267)", winogrande),
        TaskSpec("openbookqa", "choice", "OpenBookQA test (500)", openbookqa),
        TaskSpec("commonsense_qa", "choice", "CommonsenseQA validation (1,221)", commonsense_qa),
        TaskSpec("arc_easy", "choice", "ARC-Easy test (2,376)", arc_easy),
        TaskSpec("arc_challenge", "choice", "ARC-Challenge test (1,172)", arc_challenge),
        TaskSpec("mmlu", "choice", "MMLU test, cloze (14,042)", mmlu),
        TaskSpec("lambada", "lambada", "LAMBADA OpenAI test (5,153): accuracy and perplexity", lambada),
    )
}
FILE_TASKS = {
    "choices": "choices:FILE.jsonl, your multiple-choice file (context, choices, gold a line)",
    "perplexity": "perplexity:FILE, word/byte perplexity and bits per byte of a text file (rolling windows)",
    "sts": "sts:FILE, Spearman of cosine similarity on an STS Benchmark csv (embedding models)",
}


def known() -> str:
    """The task names and file tasks, for messages."""
    return ", ".join(list(TASKS) + [f"{k}:FILE" for k in FILE_TASKS])


def parse_task(text: str) -> tuple[str, str | None]:
    """``"piqa"`` -> ``("piqa", None)``; ``"perplexity:notes.txt"`` -> ``("perplexity", "notes.txt")``;
    :class:`EvalError` listing the known tasks for anything else."""
    name, sep, path = text.strip().partition(":")
    if not sep and name in TASKS:
        return name, None
    if sep and name in FILE_TASKS and path:
        return name, path
    raise EvalError(f"unknown task {text!r}; known tasks: {known()}")
