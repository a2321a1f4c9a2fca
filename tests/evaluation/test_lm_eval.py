"""The lm-evaluation-harness model ``tformer``: lm-eval's own evaluator, offline, on local task files, gives the
numbers of ``tformer eval --protocol lm-eval`` on the same data; and lm-eval's Hugging Face model, on the
``transformers`` reading of the same file, gives the same scores."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.conftest import QUESTIONS, TEXT

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra (also in `dev`)")

pytestmark = pytest.mark.slow  # lm-eval's import and its task loading take seconds

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_TASK = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, choices_file):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    (folder / "tiny_mc.yaml").write_text(MC_TASK.format(data=choices_file))
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT.split("\n\n")))
    (folder / "tiny_ppl.yaml").write_text(PPL_TASK.format(data=docs))
    return folder


def run_lm_eval(model, task_dir, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        bootstrap_iters=10,  # > 0: stderrs are reported (acc's is the analytic one)
    )


def test_the_registered_model_gives_tformer_evals_numbers(tiny, task_dir, choices_file, text_file, tmp_path):
    from lm_eval.api.registry import get_model

    import tformer
    import tformer.evaluation.lm_eval as adapter

    assert get_model("tformer") is adapter.TformerLM
    model = adapter.TformerLM(pretrained=tiny, max_length=16)
    results = run_lm_eval(model, task_dir, ["tiny_mc", "tiny_ppl"])
    records = tmp_path / "records.jsonl"
    ours = tformer.evaluate(
        tiny, [f"choices:{choices_file}", f"perplexity:{text_file}"], max_length=16, records=records
    )
    mc = ours["tasks"][f"choices:{choices_file}"]["figures"]
    for name in ("acc", "acc_norm"):
        assert results["results"]["tiny_mc"][f"{name},none"] == mc[name]["value"]
        assert results["results"]["tiny_mc"][f"{name}_stderr,none"] == pytest.approx(mc[name]["stderr"], abs=1e-12)
    # per example: lm-eval's log-likelihoods are the ones tformer eval records
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    lines = [json.loads(line) for line in records.read_text().splitlines()][: len(QUESTIONS)]
    for sample, line in zip(samples, lines):
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(line["loglikelihoods"], abs=1e-9)
    ppl = ours["tasks"][f"perplexity:{text_file}"]["figures"]
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert results["results"]["tiny_ppl"][f"{name},none"] == pytest.approx(ppl[name]["value"], rel=1e-9)
    assert len(samples) == len(QUESTIONS)


def test_lm_evals_hf_model_on_transformers_scores_the_same(tiny, hf_tiny, task_dir, choices_file):
    from lm_eval.models.huggingface import HFLM

    import tformer

    model, tok = hf_tiny
    results = run_lm_eval(HFLM(pretrained=model, tokenizer=tok, batch_size=4), task_dir, ["tiny_mc"])
    ours = tformer.evaluate(tiny, f"choices:{choices_file}")["tasks"][f"choices:{choices_file}"]["figures"]
    for name in ("acc", "acc_norm"):
        assert results["results"]["tiny_mc"][f"{name},none"] == ours[name]["value"]
    assert len(results["samples"]["tiny_mc"]) == len(QUESTIONS)


def test_generate_until_stops_at_the_stop_string(tiny):
    from lm_eval.api.instance import Instance

    import tformer.evaluation.lm_eval as adapter

    model = adapter.TformerLM(pretrained=tiny)
    req = Instance("generate_until", {}, ("the cat", {"until": ["t"], "max_gen_toks": 6}), 0)
    free = adapter.TformerLM(pretrained=tiny).generate_until(
        [Instance("generate_until", {}, ("the cat", {"until": [], "max_gen_toks": 6}), 0)]
    )[0]
    assert model.generate_until([req]) == [free.split("t", 1)[0]]


def test_the_entry_point_resolves_to_the_registered_model():
    """The ``lm_eval.models`` entry point, put in a registry the way lm-eval's plugin discovery puts it (a lazy
    placeholder), materializes to the class that ``register_model("tformer")`` registers."""
    from importlib.metadata import entry_points

    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry, get_model

    found = [ep for ep in entry_points(group="lm_eval.models") if ep.name == "tformer"]
    assert len(found) == 1, "reinstall the package (pip install -e .) to write its entry points"
    registry = Registry("model", base_cls=LM)
    registry.register("tformer", target=found[0])
    cls = registry.get("tformer")
    assert cls is get_model("tformer")
    assert cls.__module__ == "tformer.evaluation.lm_eval" and issubclass(cls, LM)
