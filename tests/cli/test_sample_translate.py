"""The ``sample`` and ``translate`` commands on tiny checkpoints, and the text helpers behind them."""

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.cli import main
from tformer.generation.sampling import generate
from tformer.generation.seq2seq import beam_search
from tformer.generation.text import DEFAULT_NEW_TOKENS, TextStream, sample_to, translate_lines
from tformer.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer
from tformer.training.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
from tformer.training.demos import sample_text

# --------------------------------------------------------------------------------------------------
# The CLI on tiny checkpoints
# --------------------------------------------------------------------------------------------------
CHARS = "abcdefghijklmnop qrstuvwxyz"


@pytest.fixture(scope="module")
def lm_run(peaky, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    tok = CharTokenizer(CHARS, unknown="error")
    torch.manual_seed(0)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size, position="learned", max_seq_len=40)))
    save_checkpoint(out, model=model, tokenizer=tok, kind="lm", step=0, train_config={})
    return out


@pytest.fixture(scope="module")
def seq2seq_run(random_seq2seq, tmp_path_factory):
    out = tmp_path_factory.mktemp("seq2seq")
    tok = CharTokenizer(CHARS, SEQ2SEQ_SPECIALS, unknown="error")
    model = random_seq2seq(vocab=tok.vocab_size, seed=3, dtype=torch.float32, max_seq_len=20)
    save_checkpoint(out, model=model, tokenizer=tok, kind="seq2seq", step=0, train_config={})
    return out


def test_cli_sample_streams_what_generate_returns(lm_run, capsys):
    ckpt = load_checkpoint(lm_run)
    tok = ckpt.tokenizer
    new = generate(ckpt.model, [tok.encode("abc")], max_new_tokens=25, seed=3, top_k=5)[0]
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(lm_run),
                "--prompt",
                "abc",
                "--max-new-tokens",
                "25",
                "--seed",
                "3",
                "--top-k",
                "5",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "abc" + tok.decode(new) + "\n"
    # default length: DEFAULT_NEW_TOKENS, far past the 40 learned positions (a sliding window)
    assert main(["sample", "--checkpoint", str(lm_run), "--prompt", "hello", "--greedy"]) == 0
    greedy = capsys.readouterr().out
    new = generate(ckpt.model, [tok.encode("hello")], max_new_tokens=DEFAULT_NEW_TOKENS, greedy=True)[0]
    assert len(new) == DEFAULT_NEW_TOKENS == 200 and greedy == "hello" + tok.decode(new) + "\n"


def test_cli_sample_prompt_longer_than_the_learned_positions(lm_run, capsys):
    ckpt = load_checkpoint(lm_run)
    prompt = ("the quick brown fox jumps over the lazy dog " * 2)[:60]  # 60 tokens, 40 learned positions
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(lm_run),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "50",
                "--seed",
                "1",
                "--temperature",
                "0.8",
                "--top-p",
                "0.95",
            ]
        )
        == 0
    )
    new = generate(
        ckpt.model, [ckpt.tokenizer.encode(prompt[-40:])], max_new_tokens=50, seed=1, temperature=0.8, top_p=0.95
    )[0]
    out = capsys.readouterr()
    assert out.out == prompt + ckpt.tokenizer.decode(new) + "\n"
    assert out.err == (
        "tformer sample: note: the prompt's 60 tokens are more than the model's 40 learned positions; it sees the "
        "last 40\n"
    )


def test_cli_commands_given_a_run_of_the_other_kind_name_the_command_to_use(lm_run, seq2seq_run, capsys):
    assert main(["translate", "--checkpoint", str(lm_run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tformer translate: error: ") and err.endswith(
        "holds a language model ('lm'); `tformer translate` needs a seq2seq model ('seq2seq'): use `tformer sample`\n"
    )
    assert main(["sample", "--checkpoint", str(seq2seq_run), "--prompt", "abc"]) == 2
    assert capsys.readouterr().err.endswith(
        "holds a seq2seq model ('seq2seq'); `tformer sample` needs a language model ('lm'): use `tformer translate`\n"
    )


@pytest.mark.parametrize("position", ["rotary", "sinusoidal"])
def test_cli_sample_notes_a_prompt_longer_than_the_trained_context_and_still_samples(peaky, tmp_path, capsys, position):
    tok = CharTokenizer(CHARS, unknown="error")
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size, position=position, max_seq_len=8)))
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=0, train_config={})
    args = ["sample", "--checkpoint", str(tmp_path), "--greedy", "--max-new-tokens", "12", "--prompt"]
    assert main([*args, "abcdefgh"]) == 0  # 8 tokens: the trained context; generating past it is not noted
    assert capsys.readouterr().err == ""
    assert main([*args, "abcdefghi"]) == 0
    out = capsys.readouterr()
    assert out.err == (
        "tformer sample: note: the prompt's 9 tokens are more than the model's trained context (max_seq_len 8); "
        f"its {position} positions go on, but what it generates may degrade\n"
    )
    new = generate(model, [tok.encode("abcdefghi")], max_new_tokens=12, greedy=True)[0]
    assert out.out == "abcdefghi" + tok.decode(new) + "\n"


def test_cli_sample_tiny_temperature_is_greedy(lm_run, capsys):
    assert main(["sample", "--checkpoint", str(lm_run), "--prompt", "ab", "--max-new-tokens", "30", "--greedy"]) == 0
    greedy = capsys.readouterr().out
    for t in ("1e-40", "1e-300"):
        assert (
            main(
                [
                    "sample",
                    "--checkpoint",
                    str(lm_run),
                    "--prompt",
                    "ab",
                    "--max-new-tokens",
                    "30",
                    "--temperature",
                    t,
                    "--seed",
                    "0",
                ]
            )
            == 0
        )
        assert capsys.readouterr().out == greedy


def test_cli_sample_nan_checkpoint_is_a_clear_error(peaky, tmp_path, capsys):
    tok = CharTokenizer(CHARS)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size)))
    with torch.no_grad():
        model.decoder.embed.tokens.weight.fill_(float("nan"))
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=0, train_config={})
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ab", "--seed", "0"]) == 2
    printed = capsys.readouterr()
    assert "NaN" in printed.err and "diverged" in printed.err and "Traceback" not in printed.err
    assert printed.out == ""


def test_sample_prompt_messages_say_why_it_has_no_tokens(lm_run):
    ckpt = load_checkpoint(lm_run)
    skipping = SimpleNamespace(model=ckpt.model, tokenizer=CharTokenizer(CHARS, unknown="skip"))
    with pytest.raises(ValueError, match="every character of the --prompt 'ZZZ' is unknown to the tokenizer"):
        sample_to(io.StringIO(), skipping.model, skipping.tokenizer, "ZZZ", max_new_tokens=3)
    with pytest.raises(ValueError, match="the prompt is empty; give a non-empty --prompt"):
        sample_to(io.StringIO(), skipping.model, skipping.tokenizer, "", max_new_tokens=3)
    out = io.StringIO()  # known characters survive the skipping
    assert len(sample_to(out, skipping.model, skipping.tokenizer, "aZb", max_new_tokens=3, greedy=True)) == 3
    assert out.getvalue().startswith("aZb")


def test_demo_sample_text_is_one_generate_call_past_the_context(lm_run):
    ckpt = load_checkpoint(lm_run)
    tok = ckpt.tokenizer
    text = sample_text(ckpt.model, tok, "def ", max_new_tokens=90, temperature=0.9, seed=4)
    new = generate(ckpt.model, [tok.encode("def ")], max_new_tokens=90, temperature=0.9, seed=4)[0]
    assert text == "def " + tok.decode(new) and len(text) == 94  # 94 tokens > 40 learned positions
    with pytest.raises(ValueError, match="the prompt is empty.*give a non-empty --prompt"):  # no line break in CHARS
        sample_text(ckpt.model, tok, "", max_new_tokens=5, seed=4)


def test_demo_sample_text_empty_prompt_starts_a_document_and_prints_only_new_text(peaky):
    torch.manual_seed(0)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=256)))
    tok = ByteTokenizer()
    text = sample_text(model, tok, "", max_new_tokens=30, temperature=1.0, seed=5)
    new = generate(model, [tok.encode("\n\n")], max_new_tokens=30, temperature=1.0, seed=5)[0]  # DOC_SEPARATOR
    assert text == tok.decode(new) and "\x00" not in text.replace(tok.decode(new), "", 1)


def test_cli_sample_greedy_nan_checkpoint_is_a_clear_error(peaky, tmp_path, capsys):
    tok = CharTokenizer(CHARS)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size)))
    with torch.no_grad():
        model.decoder.stack.blocks[0].ff.up.weight[0, 0] = float("nan")
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=0, train_config={})
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ab", "--greedy"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.splitlines()) == 1
    assert printed.err.startswith("tformer sample: error: the model produced NaN") and "diverged" in printed.err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temperature", "inf"], "temperature (--temperature) must be a finite number > 0"),
        (["--seed", "-1"], "seed (--seed) must be an integer in [0, 2**63 - 1"),
        (["--seed", "99999999999999999999"], "seed (--seed) must be an integer in [0, 2**63 - 1"),
        (["--max-new-tokens", "-1"], "max_new_tokens (--max-new-tokens) must be an integer >= 0; got -1"),
        (["--prompt", ""], "the prompt is empty; give a non-empty --prompt"),
        # the bytes ab\xff\xfe as Python's argv hands them over (surrogateescape)
        (["--prompt", b"ab\xff\xfe".decode("utf-8", "surrogateescape")], "--prompt is not valid UTF-8 (byte 0xff at"),
    ],
)
def test_cli_sample_bad_flags_are_errors_before_loading(flags, message, tmp_path, capsys):
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ab", *flags]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("tformer sample: error: ") and message in printed.err
    assert "checkpoint" not in printed.err and printed.out == ""  # tmp_path is no checkpoint: nothing was loaded


@pytest.mark.parametrize("unknown", ["unk", "skip"])
def test_cli_sample_notes_prompt_characters_a_char_tokenizer_does_not_know(unknown, peaky, tmp_path, capsys):
    tok = CharTokenizer(CHARS, unknown=unknown)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size)))
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=0, train_config={})
    args = ["sample", "--checkpoint", str(tmp_path), "--greedy", "--max-new-tokens", "2", "--prompt"]
    assert main([*args, "Hi, héllo!"]) == 0
    became = "<unk>" if unknown == "unk" else "nothing (dropped)"
    assert capsys.readouterr().err == (
        "tformer sample: note: the model's character tokenizer does not know 'H' ',' 'é' '!' of the prompt; it reads "
        f"{became} there\n"
    )
    assert main([*args, "hello"]) == 0  # every character known: no note
    assert capsys.readouterr().err == ""


def test_cli_sample_damaged_latest_checkpoint_names_a_good_older_one(peaky, tmp_path, capsys):
    tok = CharTokenizer(CHARS)
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size)))
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=step, train_config={}, keep=3)
    root = tmp_path / "checkpoints"
    for step in (20, 30):  # the newest two are damaged: a truncated weights file, a missing manifest
        weights = root / f"step-0000{step}" / WEIGHTS
        weights.write_bytes(weights.read_bytes()[:100])
    args = ["sample", "--prompt", "ab", "--greedy", "--max-new-tokens", "3"]
    assert main([*args, "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tformer sample: error: the newest checkpoint {root / 'step-000030'} is damaged (")
    assert "truncated" in err and err.rstrip().endswith(f"delete it, or pass --checkpoint {root / 'step-000010'}")
    assert main([*args, "--checkpoint", str(root)]) == 2  # the checkpoints folder itself: the same hint
    assert f"--checkpoint {root / 'step-000010'}" in capsys.readouterr().err
    assert main([*args, "--checkpoint", str(root / "step-000030")]) == 2  # a chosen step: no other is offered
    err = capsys.readouterr().err
    assert "truncated" in err and "--checkpoint" not in err
    assert main([*args, "--checkpoint", str(root / "step-000010")]) == 0  # the hint works
    assert capsys.readouterr().out.startswith("ab")
    (root / "step-000010" / WEIGHTS).write_bytes(b"")  # no good checkpoint left
    assert main([*args, "--checkpoint", str(tmp_path)]) == 2
    assert "no earlier checkpoint of" in capsys.readouterr().err


def test_cli_sample_stop_string_ends_the_output(lm_run, capsys):
    main(["sample", "--checkpoint", str(lm_run), "--prompt", "m", "--greedy", "--max-new-tokens", "30"])
    text = capsys.readouterr().out[1:-1]  # without the prompt and the newline
    stop = text[8:10]
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(lm_run),
                "--prompt",
                "m",
                "--greedy",
                "--max-new-tokens",
                "30",
                "--stop",
                stop,
                "--stop",
                "zzzz",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "m" + text[: text.index(stop)] + "\n"


def test_cli_translate_prints_one_line_per_input_line(seq2seq_run, capsys, monkeypatch):
    ckpt = load_checkpoint(seq2seq_run)
    tok = ckpt.tokenizer
    lines = ["hello world", "", "abc", "zyx wv"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["translate", "--checkpoint", str(seq2seq_run), "--beam-size", "3", "--length-penalty", "1.0"]) == 0
    printed = capsys.readouterr().out.split("\n")
    assert printed[-1] == "" and len(printed) == len(lines) + 1
    for line, output in zip(lines, printed):
        if not line:
            assert output == ""
            continue
        src = torch.tensor([tok.encode(line)])
        best = beam_search(
            ckpt.model, src, None, beam_size=3, length_penalty=1.0, bos_id=1, eos_id=2, max_new_tokens=20
        )[0]
        assert output == tok.decode(best)  # batched (right-padded) equals one by one
    assert translate_lines(ckpt.model, ckpt.tokenizer, lines, beam_size=3, length_penalty=1.0) == printed[:-1]


def test_cli_translate_bad_line_is_reported_and_the_others_translated(seq2seq_run, capsys, monkeypatch):
    ckpt = load_checkpoint(seq2seq_run)
    lines = ["abc", "hello", "ab C", "zyx", "", "9", "wv"]  # 'C' and '9' are not in the tokenizer
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    # batches of 2: line 3 is the first of the second batch, line 6 the second of the third
    assert main(["translate", "--checkpoint", str(seq2seq_run), "--batch-size", "2"]) == 1
    printed = capsys.readouterr()
    good = translate_lines(ckpt.model, ckpt.tokenizer, ["abc", "hello", "zyx", "wv"])
    assert all(good) and printed.out.split("\n") == [good[0], good[1], "", good[2], "", "", good[3], ""]
    errors = printed.err.splitlines()
    assert [e.split(":")[:2] for e in errors] == [["tformer translate", " line 3"], ["tformer translate", " line 6"]]
    assert "'C'" in errors[0] and "'9'" in errors[1]
    with pytest.raises(ValueError, match="'C'"):  # the function alone raises, unless given on_error
        translate_lines(ckpt.model, ckpt.tokenizer, ["abc", "ab C"])
    seen = []
    assert translate_lines(ckpt.model, ckpt.tokenizer, ["ab C", "abc"], on_error=lambda i, e: seen.append(i)) == [
        "",
        good[0],
    ]
    assert seen == [0]
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\nzyx\n"))
    assert main(["translate", "--checkpoint", str(seq2seq_run)]) == 0  # every line translated: exit code 0
    assert capsys.readouterr().out == f"{good[0]}\n{good[2]}\n"


class _Stdin:
    """A stand-in for ``sys.stdin``: ``buffer`` yields the byte lines, and records how many output lines had been
    written (to ``out``) when each line was read."""

    def __init__(self, data: bytes, tty: bool, out: io.StringIO | None = None) -> None:
        self.data, self.tty, self.out, self.seen = data, tty, out, []

    def isatty(self) -> bool:
        return self.tty

    @property
    def buffer(self):
        return self._lines()

    def _lines(self):
        for line in io.BytesIO(self.data):
            self.seen.append(None if self.out is None else self.out.getvalue().count("\n"))
            yield line


def test_cli_translate_invalid_utf8_fails_only_its_line(seq2seq_run, capsys, monkeypatch):
    good = translate_lines(*_model_and_tokenizer(seq2seq_run), ["abc", "zyx", "hello"])
    data = b"abc\n\xe9\xff12\nzyx\r\nab C\nab\xc3\n\nhello"  # no final line end
    for tty in (False, True):
        monkeypatch.setattr(sys, "stdin", _Stdin(data, tty))
        assert main(["translate", "--checkpoint", str(seq2seq_run), "--batch-size", "3"]) == 1
        printed = capsys.readouterr()
        assert printed.out.split("\n") == [good[0], "", good[1], "", "", "", good[2], ""]
        errors = printed.err.splitlines()  # in line order, within a batch too
        assert len(errors) == 3 and errors[1].startswith("tformer translate: line 4: ") and "'C'" in errors[1]
        assert errors[0] == "tformer translate: line 2: not valid UTF-8 (byte 0xe9 at offset 0)"
        assert errors[2] == "tformer translate: line 5: not valid UTF-8 (byte 0xc3 at offset 2)"


def test_cli_translate_skips_a_byte_order_mark_at_the_start_only(seq2seq_run, capsys, monkeypatch):
    """Text saved by Windows editors starts with U+FEFF: not a character of the first line. Later on it is one (and
    the tokenizer's error names it, with the characters it knows)."""
    good = translate_lines(*_model_and_tokenizer(seq2seq_run), ["abc", "zyx"])
    for stdin in (_Stdin(b"\xef\xbb\xbfabc\n\xef\xbb\xbfzyx\n", tty=False), io.StringIO("\ufeffabc\n\ufeffzyx\n")):
        monkeypatch.setattr(sys, "stdin", stdin)
        assert main(["translate", "--checkpoint", str(seq2seq_run)]) == 1
        printed = capsys.readouterr()
        assert printed.out == f"{good[0]}\n\n"
        assert printed.err.startswith("tformer translate: line 2: character '\\ufeff' at index 0 is not in the ")
    assert good[1]


def test_cli_translate_at_a_terminal_answers_each_line_before_reading_the_next(seq2seq_run, monkeypatch):
    for tty, expected in ((True, [0, 1, 2]), (False, [0, 0, 0])):
        out = io.StringIO()
        stdin = _Stdin(b"abc\nzyx\nhello\n", tty, out)
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["translate", "--checkpoint", str(seq2seq_run)]) == 0
        assert stdin.seen == expected and out.getvalue().count("\n") == 3


def test_cli_translate_without_stdin_is_a_clear_error(seq2seq_run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # `tformer translate <&-`
    assert main(["translate", "--checkpoint", str(seq2seq_run)]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines() == [
        "tformer translate: error: there is no standard input (stdin is closed); pipe the source lines in, e.g. "
        "`echo 31415 | tformer translate --checkpoint DIR`"
    ]


@pytest.mark.parametrize("beam_size", ["4", "1"])
def test_cli_translate_nan_checkpoint_is_a_clear_error(random_seq2seq, beam_size, tmp_path, capsys, monkeypatch):
    tok = CharTokenizer(CHARS, SEQ2SEQ_SPECIALS, unknown="error")
    model = random_seq2seq(vocab=tok.vocab_size, dtype=torch.float32, max_seq_len=20)
    with torch.no_grad():
        model.encoder.stack.blocks[0].ff.up.weight[0, 0] = float("nan")
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="seq2seq", step=0, train_config={})
    monkeypatch.setattr(sys, "stdin", _Stdin(b"abc\nzyx\n", tty=False))
    assert main(["translate", "--checkpoint", str(tmp_path), "--beam-size", beam_size]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.splitlines()) == 1
    assert printed.err.startswith("tformer translate: error: the model produced NaN") and "diverged" in printed.err


def test_translate_line_longer_than_learned_positions_is_one_failed_line(random_seq2seq):
    tok = CharTokenizer(CHARS, SEQ2SEQ_SPECIALS, unknown="error")
    model = random_seq2seq(vocab=tok.vocab_size, seed=3, dtype=torch.float32, position="learned", max_seq_len=8)
    ckpt = SimpleNamespace(model=model, tokenizer=tok)
    failed = []
    out = translate_lines(
        ckpt.model, ckpt.tokenizer, ["abc", "abcdefghij", "ab"], on_error=lambda i, e: failed.append((i, str(e)))
    )
    assert failed == [(1, "the line is 10 tokens long, more than the model's max_seq_len=8 learned positions")]
    assert out[1] == "" and out[::2] == translate_lines(ckpt.model, ckpt.tokenizer, ["abc", "ab"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
        (["--length-penalty", "nan"], "--length-penalty must be a finite number >= 0"),
        (["--length-penalty", "-1"], "--length-penalty must be a finite number >= 0"),
        (["--beam-size", "0"], "--beam-size must be >= 1"),
    ],
)
def test_cli_translate_bad_flags_are_errors_before_loading(flags, message, tmp_path, capsys):
    # tmp_path is not a checkpoint: the flag's error comes first, so nothing was loaded
    assert main(["translate", "--checkpoint", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "checkpoint" not in err


def test_translate_max_new_tokens_none_is_max_seq_len_and_0_is_an_error(seq2seq_run):
    ckpt = load_checkpoint(seq2seq_run)  # max_seq_len 20
    full = translate_lines(ckpt.model, ckpt.tokenizer, ["hello world"], max_new_tokens=None)
    assert full == translate_lines(ckpt.model, ckpt.tokenizer, ["hello world"], max_new_tokens=20)
    assert len(translate_lines(ckpt.model, ckpt.tokenizer, ["hello world"], max_new_tokens=2)[0]) <= 2
    with pytest.raises(ValueError, match="max_new_tokens"):
        translate_lines(ckpt.model, ckpt.tokenizer, ["hello world"], max_new_tokens=0)


def test_cli_errors_are_reported_not_raised(lm_run, seq2seq_run, capsys, tmp_path):
    assert main(["sample", "--checkpoint", str(seq2seq_run), "--prompt", "ab"]) == 2
    assert "tformer translate" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(lm_run), "--prompt", "ab", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(lm_run), "--prompt", "ab", "--max-new-tokens", "-1"]) == 2
    printed = capsys.readouterr()
    assert "--max-new-tokens" in printed.err and printed.out == ""  # nothing echoed before the error
    assert main(["sample", "--checkpoint", str(lm_run), "--prompt", "ab", "--temperature", "0"]) == 2
    assert "greedy decoding (greedy=True, --greedy)" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ab"]) == 2
    assert "not a tformer checkpoint" in capsys.readouterr().err


def test_text_stream_writes_as_it_goes_and_never_half_a_character():
    writes = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    stream = TextStream(ByteTokenizer(), Out(), prefix="> ")
    for b in "aé€".encode():
        stream.push(b)
    stream.close()
    assert writes == ["> a", "é", "€"]
    empty = TextStream(ByteTokenizer(), Out(), prefix="prompt")
    empty.close()  # no token at all: the prompt is still written
    assert writes[-1] == "prompt"


@pytest.mark.subprocess
def test_cli_end_to_end_in_a_subprocess(lm_run, seq2seq_run):
    ckpt = load_checkpoint(lm_run)
    new = generate(ckpt.model, [ckpt.tokenizer.encode("ab")], max_new_tokens=12, seed=7, temperature=0.8)[0]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tformer",
            "sample",
            "--checkpoint",
            str(lm_run),
            "--prompt",
            "ab",
            "--max-new-tokens",
            "12",
            "--seed",
            "7",
            "--temperature",
            "0.8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "ab" + ckpt.tokenizer.decode(new) + "\n"
    run = subprocess.run(
        [sys.executable, "-m", "tformer", "translate", "--checkpoint", str(seq2seq_run)],
        input="abc\nhello\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == translate_lines(*_model_and_tokenizer(seq2seq_run), ["abc", "hello"])


def _model_and_tokenizer(run):
    ckpt = load_checkpoint(run)
    return ckpt.model, ckpt.tokenizer


@pytest.mark.slow
def test_cli_sample_compile_on_gives_the_eager_text_and_reports_the_compile(lm_run, capsys):
    args = ["sample", "--checkpoint", str(lm_run), "--prompt", "abc", "--greedy", "--max-new-tokens", "10"]
    assert main([*args, "--compile", "off"]) == 0
    eager = capsys.readouterr()
    assert main([*args, "--compile", "on"]) == 0
    compiled = capsys.readouterr()
    assert compiled.out == eager.out
    assert "compiled decoding (prefill" in compiled.err and "compiled" not in eager.err
    assert main([*args, "--compile", "auto"]) == 0  # on the CPU: eager (tformer.generation.static.auto_compile)
    assert "compiled" not in capsys.readouterr().err
    assert main([*args[:-1], "0", "--compile", "on"]) == 0  # nothing decoded: nothing compiled to report
    assert capsys.readouterr() == ("abc\n", "")


def test_cli_sample_compile_on_names_the_longest_max_new_tokens_that_fits(lm_run, capsys):
    """A static cache (compiled decoding) holds the whole sequence in the 40 learned positions: the error names
    the longest --max-new-tokens that fits, or the default cache; nothing is printed before it, not even the note
    that a long prompt is cropped (compiled decoding does not crop it)."""
    args = ["sample", "--checkpoint", str(lm_run), "--greedy", "--compile", "on"]
    assert main([*args, "--prompt", "abc", "--max-new-tokens", "50"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        "tformer sample: error: a static cache holds the whole sequence: prompt 3 + max_new_tokens 50 exceeds the "
        "model's 40 learned positions; lower max_new_tokens to <= 37 (--max-new-tokens), or decode on the default "
        "cache, which slides a window (static_cache=False and compile=False; tformer sample --compile off)\n"
    )
    assert main([*args, "--prompt", "x" * 60, "--max-new-tokens", "5"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(
        "tformer sample: error: a static cache holds the whole sequence, and the prompt's 60 tokens already fill "
    )


@pytest.mark.slow
def test_cli_sample_compile_auto_falls_back_where_a_static_cache_cannot_hold_the_sequence(lm_run, capsys, monkeypatch):
    """Where ``auto`` compiles (CUDA; the CPU stands in for it here), a sequence longer than the 40 learned
    positions decodes uncompiled over the sliding window, as ``--compile off`` does; one that fits compiles."""
    from tformer.generation import static

    monkeypatch.setattr(static, "AUTO_COMPILE_DEVICES", ("cpu",))
    args = ["sample", "--checkpoint", str(lm_run), "--prompt", "abc", "--greedy"]
    for new, compiles in (("50", False), ("10", True)):
        assert main([*args, "--max-new-tokens", new, "--compile", "off"]) == 0
        eager = capsys.readouterr()
        assert main([*args, "--max-new-tokens", new, "--compile", "auto"]) == 0
        auto = capsys.readouterr()
        assert auto.out == eager.out and ("compiled decoding (prefill" in auto.err) == compiles


@pytest.mark.parametrize(
    "command, int8",
    [
        ("sample", "--quantize int8 (with --dtype for the activations)"),
        ("explore", "--quantize int8 (with --dtype for the activations)"),
        ("translate", "tformer sample and explore --quantize int8"),
        ("embed", "tformer sample and explore --quantize int8"),
        ("convert", "not stored; tformer sample and explore --quantize int8 make them at load"),
    ],
)
def test_a_dtype_that_is_not_a_compute_dtype_names_the_choices_and_where_int8_is(command, int8, capsys, tmp_path):
    """--dtype int8 was argparse's bare "invalid choice"; int8 weights come from --quantize."""
    checkpoint = [str(tmp_path)] if command == "convert" else ["--checkpoint", str(tmp_path)]
    choices = "(choose from float32, bfloat16, float16)"
    for value, hint in (("int8", f"; int8 weights: {int8}"), ("bf16", "")):
        with pytest.raises(SystemExit) as exit_:
            main([command, *checkpoint, "--dtype", value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err == (
            f"tformer {command}: error: argument --dtype: invalid dtype '{value}' {choices}{hint}; "
            f"see tformer {command} --help\n"
        )
