"""``tformer eval --protocol lm-eval`` asks the requests of lm-evaluation-harness's own task definitions.

tformer writes its lm-eval prompts itself (``tformer.evaluation.tasks``). Here lm-eval's real task configs (the
YAMLs and ``utils.py`` files shipped with lm-eval) are loaded, offline, on the rows tformer reads, and must ask, for
25 documents of each set, the same ``(context, continuation)`` strings, with the same gold index and the same
choice texts for acc_norm's length normalization (``process_results`` divides by ``len`` of ``doc_to_choice``). lm-eval
must also evaluate the split tformer reads (its test split when the config names one, else its validation split).

The ARC and OpenBookQA test sets and LAMBADA come from OLMES request files, whose documents are not the Hugging
Face rows; lm-eval's documents are rebuilt from them (ARC, OpenBookQA: the question inside OLMES's
``Question: ...\\nAnswer:``, the choices and the answer key; LAMBADA: the passage and its last word joined again),
so for those the contexts are checked only as far as that rebuilding allows (the continuations, the gold index and
the choices fully). On the validation sets of ARC and OpenBookQA, which the data package holds in both forms, OLMES's
documents are exactly the Hugging Face rows in that form.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tformer.evaluation import data, tasks
from tformer.evaluation.data import EvalError

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra (also in `dev`)")
datasets = pytest.importorskip("datasets", reason="lm-eval's tasks read `datasets` datasets")

pytestmark = pytest.mark.slow  # lm-eval's import and its task loading take seconds

N = 25  # documents compared per task (from Pair.start)
TASK_DIR = Path(lm_eval.__file__).parent / "tasks"
MMLU_SUBJECTS = ["abstract_algebra", "high_school_us_history", "moral_scenarios"]


def arrow_docs(relative: str) -> Callable[[slice], list[dict]]:
    """Rows of a saved Hugging Face split, as tformer reads them: lm-eval's documents as they are."""
    return lambda rows: data.read_arrow(relative)[rows]


def arc_docs(task: str) -> Callable[[slice], list[dict]]:
    """ARC's Hugging Face rows (``question``, ``choices.text``/``label``, ``answerKey``) rebuilt from OLMES's
    documents, whose ``query`` is ``Question: {question}\\nAnswer:``."""

    def docs(rows: slice) -> list[dict]:
        out = []
        for d in data.read_requests(f"{task}/test_rc_5shot")[rows]:
            labels = list(tasks.LETTERS[: len(d["choices"])])
            question = d["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
            choices = {"text": d["choices"], "label": labels}
            out.append({"id": d["id"], "question": question, "choices": choices, "answerKey": labels[d["gold"]]})
        return out

    return docs


def openbookqa_docs(rows: slice) -> list[dict]:
    """OpenBookQA's Hugging Face rows (``question_stem``, ``choices``, ``answerKey``) rebuilt from OLMES's test
    documents, whose ``query`` is ``Question: {question_stem}\\nAnswer:``."""
    out = []
    for d in data.read_requests("openbookqa/test_rc_5shot")[rows]:
        labels = list(tasks.LETTERS[: len(d["choices"])])
        stem = d["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        choices = {"text": d["choices"], "label": labels}
        out.append({"id": d["id"], "question_stem": stem, "choices": choices, "answerKey": labels[d["gold"]]})
    return out


def lambada_docs(rows: slice) -> list[dict]:
    """LAMBADA's Hugging Face rows (``text``) rebuilt from OLMES's documents: the passage, a space, its last word."""
    return [{"text": d["query"] + " " + d["answers_text"][0]} for d in data.read_requests("lambada/bpb_0shot")[rows]]


@dataclass(frozen=True)
class Pair:
    ours: str  # tformer's task
    theirs: str  # lm-eval's task
    split: str  # the split tformer reads
    docs: Callable[[slice], list[dict]]  # lm-eval's documents, from the rows tformer reads
    folder: str = ""  # its folder under lm_eval/tasks, when not named as the task
    subject: str | None = None  # MMLU: the one subject tformer is made to read
    start: int = 0  # the first row compared

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + N)


def mmlu(subject: str) -> Pair:
    docs = arrow_docs(f"hails/mmlu_no_train/{subject}/test")
    return Pair("mmlu", f"mmlu_{subject}_continuation", "test", docs, "mmlu/continuation", subject=subject)


PAIRS = [
    # ActivityNet rows, then (from row 3243) WikiHow rows, whose bracket artifacts lm-eval's preprocess removes
    Pair("hellaswag", "hellaswag", "validation", arrow_docs("hellaswag/none/validation"), start=3230),
    Pair("piqa", "piqa", "validation", arrow_docs("piqa/plain_text/validation")),
    Pair("winogrande", "winogrande", "validation", arrow_docs("winogrande/winogrande_xl/validation")),
    Pair("openbookqa", "openbookqa", "test", openbookqa_docs),
    Pair("commonsense_qa", "commonsense_qa", "validation", arrow_docs("tau/commonsense_qa/none/validation")),
    Pair("arc_easy", "arc_easy", "test", arc_docs("arc_easy"), "arc"),
    Pair("arc_challenge", "arc_challenge", "test", arc_docs("arc_challenge"), "arc"),
    *(mmlu(subject) for subject in MMLU_SUBJECTS),
    Pair("lambada", "lambada_openai", "test", lambada_docs, "lambada"),
]


def load_lm_eval_task(pair: Pair, monkeypatch):
    """lm-eval's task, from its own config, its dataset replaced by ``pair``'s documents (under every split the
    config names) and any download made to fail."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    rows = datasets.Dataset.from_list(pair.docs(pair.rows))

    def download(self, dataset_kwargs=None, **kwargs):
        c = self.config
        splits = {c.training_split, c.validation_split, c.test_split, c.fewshot_split} - {None}
        self.dataset = datasets.DatasetDict({split: rows for split in splits})

    monkeypatch.setattr(ConfigurableTask, "download", download)
    manager = TaskManager(include_path=str(TASK_DIR / (pair.folder or pair.theirs)), include_defaults=False)
    return manager.load([pair.theirs])["tasks"][pair.theirs]


def lm_eval_instances(task) -> list[list]:
    """lm-eval's zero-shot requests for its ``N`` documents, one list a document, in choice order."""
    task.build_all_requests(limit=N, rank=0, world_size=1)
    per_doc = defaultdict(list)
    for instance in task.instances:
        per_doc[instance.doc_id].append(instance)
    return [sorted(per_doc[k], key=lambda i: i.idx) for k in sorted(per_doc)]


def lm_eval_gold(task, doc) -> int:
    """The gold index as lm-eval's ``process_results`` finds it: ``doc_to_text`` for partial evaluation (multiple
    inputs), else ``doc_to_target``; a string is looked up among ``doc_to_choice``."""
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    return task.doc_to_choice(doc).index(gold) if isinstance(gold, str) else gold


def tformer_examples(pair: Pair, monkeypatch) -> list[tasks.Example]:
    if pair.subject:  # MMLU: read only the subject under test
        monkeypatch.setattr(data, "arrow_splits", lambda relative: [pair.subject])
    return tasks.TASKS[pair.ours].build("lm-eval")[pair.rows]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.theirs)
def test_tformer_asks_lm_evals_own_requests(pair, monkeypatch):
    pytest.importorskip("pyarrow", reason="the sets are Arrow files")
    try:
        data.data_root()
    except EvalError as err:
        pytest.skip(str(err))
    examples = tformer_examples(pair, monkeypatch)
    task = load_lm_eval_task(pair, monkeypatch)
    theirs = lm_eval_instances(task)

    assert len(theirs) == len(examples) == N
    for example, instances in zip(examples, theirs, strict=True):
        doc = instances[0].doc
        assert example.requests == [i.arguments for i in instances], example.id
        if task.OUTPUT_TYPE == "multiple_choice":
            assert example.gold == lm_eval_gold(task, doc), example.id
            assert example.choices == task.doc_to_choice(doc), example.id
    # the same set: lm-eval evaluates its test split when the config names one, else its validation split
    evaluated = task.config.test_split or task.config.validation_split
    assert evaluated == pair.split, f"lm-eval's {pair.theirs} evaluates its {evaluated} split"
