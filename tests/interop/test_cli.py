"""The CLI on pretrained models: ``sample``/``translate`` on Hugging Face directories and GGUF files, ``embed`` and
``convert``. Outputs are compared with ``transformers`` (the reference) or with the library call the command wraps."""

from __future__ import annotations

import io
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import GenerationConfig

from tests.interop.gguf_files import write_llama_gguf
from tests.interop.hf_models import PAD, VOCAB, padded, tiny_hf
from tformer import chat_prompt, embed, generate, load_pretrained
from tformer.cli import main
from tformer.training.checkpoint import load_checkpoint

EOS = 2  # the tiny GGUF vocabulary's <|im_end|>


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_gguf(tmp_path, cache):
    """A tiny Llama GGUF file with a tokenizer, and ``transformers``' model of the same file."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied", seed=1))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    return path, reference


def cli(capsys, *args: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8"))
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def hf_continuation(reference, ids: list[int], new: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    with torch.no_grad():
        row = reference.generate(input_ids=torch.tensor([ids]), generation_config=config)[0, len(ids) :].tolist()
    return row[: row.index(EOS)] if EOS in row else row


def test_sample_on_a_gguf_file_continues_as_transformers_does(tiny_gguf, capsys):
    path, reference = tiny_gguf
    tokenizer = load_pretrained(path).tokenizer
    code, out, _ = cli(
        capsys, "sample", "--checkpoint", str(path), "--prompt", "the cat", "--greedy", "--max-new-tokens", "12"
    )
    assert code == 0
    new = hf_continuation(reference, tokenizer.encode("the cat"), 12)
    assert out == "the cat" + tokenizer.decode(new) + "\n"


def test_the_first_load_of_a_gguf_file_says_that_it_converts_and_later_loads_do_not(tiny_gguf, capsys):
    path, _ = tiny_gguf
    args = ("sample", "--checkpoint", str(path), "--prompt", "the", "--greedy", "--max-new-tokens", "2")
    code, first, err = cli(capsys, *args)
    assert code == 0 and err.startswith(f"tformer sample: converting {path.name} to safetensors (first use; cached in ")
    code, again, err = cli(capsys, *args)
    assert code == 0 and err == "" and again == first
    fake = path.with_name("fake.gguf")
    fake.write_text("not a model")  # nothing is converted: the one line is the loader's refusal, no note before it
    code, _, err = cli(capsys, "sample", "--checkpoint", str(fake), "--prompt", "the")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"tformer sample: error: {fake}: not a readable GGUF file")


def test_convert_gguf_to_hf_to_run_to_hf_keeps_the_model(tiny_gguf, tmp_path, capsys):
    path, reference = tiny_gguf
    ids, mask = padded([7, 4], left=True, vocab=VOCAB, pad=0)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits

    code, out, err = cli(capsys, "convert", str(path), "--out", str(tmp_path / "hf"))
    assert code == 0 and "Hugging Face model directory" in out
    assert err == f"tformer convert: converting {path.name} into {tmp_path / 'hf'} ...\n"  # the long step, said
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        assert torch.equal(hf_model.eval()(input_ids=ids, attention_mask=mask).logits, expected)

    code, out, _ = cli(capsys, "convert", str(tmp_path / "hf"), "--out", str(tmp_path / "run"))
    assert code == 0 and out.splitlines() == [
        f"wrote a tformer language-model run (float32) to {tmp_path / 'run'}",
        f"to train it further: tformer train --out NEW_RUN --init-from {tmp_path / 'run'} --data YOUR_TEXT",
    ]
    run = load_checkpoint(tmp_path / "run")
    assert run.train_config["family"] == "llama" and run.train_config["generation"]["eos"] == [EOS]
    with torch.no_grad():
        assert (run.model(ids, mask) - expected)[mask].abs().max() < 1e-4
    outputs = [
        cli(capsys, "sample", "--checkpoint", str(src), "--prompt", "an", "--greedy", "--max-new-tokens", "9")
        for src in (path, tmp_path / "hf", tmp_path / "run")
    ]
    assert outputs[0][1] == outputs[1][1] == outputs[2][1] and outputs[0][0] == 0

    code, out, _ = cli(capsys, "convert", str(tmp_path / "run"), "--out", str(tmp_path / "hf16"), "--dtype", "bfloat16")
    assert code == 0 and out == f"wrote a Hugging Face model directory (bfloat16) to {tmp_path / 'hf16'}\n"
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    hf16, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    for name, weight in hf_model.state_dict().items():
        assert torch.equal(hf16.state_dict()[name], weight.to(torch.bfloat16)), name
    # the special tokens by name survive GGUF -> HF -> run -> HF (save_pretrained writes them as convert_gguf does)
    specials = ("bos_token", "eos_token", "pad_token")
    first, last = (transformers.AutoTokenizer.from_pretrained(tmp_path / d) for d in ("hf", "hf16"))
    assert [getattr(last, k) for k in specials] == [getattr(first, k) for k in specials]
    assert first.eos_token is not None and first.convert_tokens_to_ids(first.eos_token) == EOS


def test_convert_run_to_hf_keeps_the_runs_dtype_and_every_end_of_sequence_id(tiny_gguf, tmp_path, capsys):
    """A run stored in bfloat16 went out as float32 ("default: as read"), and a second EOS id was dropped: the run
    records the generation ids its source had, and the export now writes them."""
    path, _ = tiny_gguf
    assert cli(capsys, "convert", str(path), "--out", str(tmp_path / "hf"))[0] == 0
    generation = tmp_path / "hf" / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [EOS, 5]}))
    code, out, _ = cli(capsys, "convert", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--dtype", "bfloat16")
    assert code == 0 and "run (bfloat16)" in out
    code, out, _ = cli(capsys, "convert", str(tmp_path / "run"), "--out", str(tmp_path / "back"))
    assert code == 0 and out == f"wrote a Hugging Face model directory (bfloat16) to {tmp_path / 'back'}\n"
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["eos_token_id"] == [EOS, 5]
    first, back = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "back"))
    assert sorted(back) == sorted(first) and all(torch.equal(back[k], first[k].to(torch.bfloat16)) for k in first)


def test_convert_gguf_in_bfloat16_is_the_float32_conversion_cast_with_the_same_tokenizer_files(
    tiny_gguf, tmp_path, capsys
):
    path, _ = tiny_gguf
    for dtype in ("float32", "bfloat16"):
        code, out, _ = cli(capsys, "convert", str(path), "--out", str(tmp_path / dtype), "--dtype", dtype)
        assert code == 0 and f"Hugging Face model directory ({dtype})" in out
    f32, bf16 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("float32", "bfloat16"))
    assert sorted(bf16) == sorted(f32) and all(torch.equal(bf16[k], f32[k].to(torch.bfloat16)) for k in f32)
    assert json.loads((tmp_path / "bfloat16" / "config.json").read_text())["dtype"] == "bfloat16"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "bfloat16" / name).read_text() == (tmp_path / "float32" / name).read_text(), name
    hf16, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {} and hf16.dtype == torch.bfloat16


def test_convert_refuses_an_encoder_as_a_run_and_writes_nothing(saved, tmp_path, capsys):
    code, _, err = cli(capsys, "convert", str(saved("bert").path), "--out", str(tmp_path / "run"))
    assert code == 2 and "holds an encoder" in err and "tformer embed" in err
    assert not (tmp_path / "run").exists()


def test_convert_of_a_trained_seq2seq_run_says_no_train_flag_makes_it_exportable(random_seq2seq, tmp_path, capsys):
    """tformer train's seq2seq runs have RoPE-style interleaved pairs and no logits bias, which no train flag
    changes: the refusal says so and where the run can be used, and writes nothing."""
    from tformer.tokenizers import SEQ2SEQ_SPECIALS, CharTokenizer
    from tformer.training.checkpoint import save_checkpoint

    tok = CharTokenizer("abc", SEQ2SEQ_SPECIALS)
    model = random_seq2seq(vocab=tok.vocab_size, dtype=torch.float32)
    save_checkpoint(tmp_path / "s2s", model=model, tokenizer=tok, kind="seq2seq", step=1, train_config={})
    code, _, err = cli(capsys, "convert", str(tmp_path / "s2s"), "--out", str(tmp_path / "hf"))
    assert code == 2 and "closest: marian" in err
    assert err.rstrip().endswith(
        "A seq2seq run of tformer train exports to none: no train flag sets pair_layout or logits_bias, which "
        "Marian's layout needs; tformer translate and explore read the run itself"
    )
    assert not (tmp_path / "hf").exists()


def test_convert_refuses_a_folder_that_is_not_empty(tiny_gguf, tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    code, _, err = cli(capsys, "convert", str(tiny_gguf[0]), "--out", str(tmp_path / "busy"))
    assert code == 2 and "already exists and is not an empty folder" in err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer of the tiny Marian's vocabulary: "</s>" (EOS, id 0), "w1".."w59", "<pad>" (60);
    sources get "</s>" appended, as Marian's tokenizer does."""
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, VOCAB - 1)}, "<pad>": PAD}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 0)])
    tok.add_special_tokens(["</s>", "<pad>"])
    return tok


def test_translate_on_a_marian_directory_gives_transformers_greedy_output(tmp_path, monkeypatch, capsys):
    reference = tiny_hf("marian", seed=1).eval()
    reference.save_pretrained(tmp_path / "marian")
    word_tokenizer().save(str(tmp_path / "marian" / "tokenizer.json"))
    lines = ["w3 w17 w5 w9", "w40 w2", "w11 w12 w13 w14 w15 w16"]
    code, out, _ = cli(
        capsys,
        "translate",
        "--checkpoint",
        str(tmp_path / "marian"),
        "--beam-size",
        "1",
        "--max-new-tokens",
        "12",
        stdin="\n".join(lines) + "\n",
        monkeypatch=monkeypatch,
    )
    assert code == 0
    tok = word_tokenizer()
    expected = []
    config = GenerationConfig(
        max_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=0, pad_token_id=PAD, decoder_start_token_id=PAD
    )
    for line in lines:
        with torch.no_grad():
            row = reference.generate(input_ids=torch.tensor([tok.encode(line).ids]), generation_config=config)
        new = row[0, 1:].tolist()  # after the decoder start
        expected.append(tok.decode(new[: new.index(0)] if 0 in new else new))
    assert out.splitlines() == expected, expected
    assert len({*expected}) == 3 and all(expected)  # different, non-empty outputs for different sources


@pytest.mark.slow
def test_embed_prints_minilms_embeddings_one_json_array_per_line(minilm, minilm_dir, monkeypatch, capsys):
    texts = ["A man is eating food.", "", "A man is eating a piece of bread."]
    code, out, _ = cli(
        capsys, "embed", "--checkpoint", str(minilm_dir), stdin="\n".join(texts) + "\n", monkeypatch=monkeypatch
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3 and all(len(r) == 384 for r in rows)
    assert torch.equal(torch.tensor(rows, dtype=torch.float32), embed(minilm, texts))


@pytest.mark.slow
def test_sample_on_smollm2_knows_the_capital_of_france(smollm, smollm_gguf, capsys):
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(smollm_gguf),
        "--prompt",
        "The capital of France is",
        "--greedy",
        "--max-new-tokens",
        "3",
    )
    assert code == 0 and out.startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_sample_chat_on_smollm2_prints_the_models_reply_alone(smollm, smollm_gguf, capsys):
    question = "What is the capital of France?"
    ids = smollm.tokenizer.encode(chat_prompt(smollm.tokenizer, [{"role": "user", "content": question}]), False)
    new = generate(smollm.model, [ids], max_new_tokens=24, greedy=True, eos_id=list(smollm.generation.eos))[0]
    args = ("--prompt", question, "--chat", "--greedy", "--max-new-tokens", "24", "--dtype", "float32")
    code, out, _ = cli(capsys, "sample", "--checkpoint", str(smollm_gguf), *args)
    assert code == 0 and out == smollm.tokenizer.decode(new) + "\n"
    assert out == "The capital of France is Paris.\n" and len(new) < 24  # it answered, and ended its turn


@pytest.mark.subprocess
def test_sample_decodes_over_a_static_cache_only_within_the_trained_context(tiny_gguf, capsys, monkeypatch):
    import tformer.generation.text as text

    chosen, real = [], text.generate

    def spy(*args, **kwargs):
        chosen.append(kwargs["static_cache"])
        return real(*args, **kwargs)

    monkeypatch.setattr(text, "generate", spy)
    path = tiny_gguf[0]  # a Llama of 64 positions: its blocks fuse
    room = 64 - len(load_pretrained(path).tokenizer.encode("the cat"))
    for new in (room, room + 1, 0):
        assert (
            cli(capsys, "sample", "--checkpoint", str(path), "--prompt", "the cat", "--max-new-tokens", str(new))[0]
            == 0
        )
    assert chosen == [True, False, True]


def test_sample_chat_needs_a_chat_template_and_system_needs_chat(tiny_gguf, capsys):
    path = str(tiny_gguf[0])  # its tokenizer has no chat template
    code, out, err = cli(capsys, "sample", "--checkpoint", path, "--prompt", "the cat", "--chat")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1].startswith("tformer sample: error: the model's tokenizer has no chat template")
    code, out, err = cli(capsys, "sample", "--checkpoint", path, "--prompt", "the cat", "--system", "Be brief.")
    assert (code, out) == (2, "")
    assert err == "tformer sample: error: --system is a chat model's system message: it needs --chat\n"


def test_sample_quantize_int8_continues_as_the_quantized_model_does(tiny_gguf, capsys):
    from tformer import generate, quantize

    path, _ = tiny_gguf
    pretrained = load_pretrained(path)
    model = quantize(pretrained.model)
    ids = pretrained.tokenizer.encode("the cat")
    new = generate(model, [ids], max_new_tokens=12, greedy=True, eos_id=list(pretrained.generation.eos))[0]
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(path),
        "--prompt",
        "the cat",
        "--greedy",
        "--max-new-tokens",
        "12",
        "--quantize",
        "int8",
    )
    assert code == 0 and out == "the cat" + pretrained.tokenizer.decode(new) + "\n"


def test_the_explorer_starts_a_converted_marian_runs_decoder_at_its_pad_id(tmp_path, capsys):
    """``tformer convert`` keeps a Hugging Face model's special ids in the run; the explorer reads them as ``sample``
    and ``translate`` do (Marian's decoder starts at pad, not at the tokenizer's bos)."""
    from tformer.explore.analysis import open_model

    tiny_hf("marian", seed=1).eval().save_pretrained(tmp_path / "marian")
    word_tokenizer().save(str(tmp_path / "marian" / "tokenizer.json"))
    assert cli(capsys, "convert", str(tmp_path / "marian"), "--out", str(tmp_path / "run"))[0] == 0
    assert open_model(tmp_path / "run").start_id == PAD
    assert open_model(tmp_path / "marian").start_id == PAD
