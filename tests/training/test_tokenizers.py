"""Tokenizers: round trips of any text (byte, BPE), the char tokenizer's unknown-character policies, the
vectorized encoder against the plain one, save/load, and clear errors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer.tokenizers import (
    SEQ2SEQ_SPECIALS,
    UNK_TOKEN,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    build_tokenizer,
    load_tokenizer,
)

CORPUS = [
    "def f(x):\n    return x * 2\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé → λ, 漢字.\n",
] * 20


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS, vocab_size=300, specials=SEQ2SEQ_SPECIALS)


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_byte_round_trips_any_text(text):
    for tok in (ByteTokenizer(), ByteTokenizer(SEQ2SEQ_SPECIALS)):
        ids = tok.encode(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert all(len(tok.specials) <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode_array(text).tolist() == ids


def test_byte_ids_are_the_bytes_without_specials():
    assert ByteTokenizer().encode("A\n") == [65, 10]
    assert ByteTokenizer(SEQ2SEQ_SPECIALS).encode("A") == [68]
    assert ByteTokenizer().vocab_size == 256


@given(st.text())
@settings(max_examples=150, deadline=None)
def test_bpe_round_trips_any_text(bpe, text):
    ids = bpe.encode(text)
    assert all(3 <= i < bpe.vocab_size for i in ids)  # specials never come out of text
    assert bpe.decode(ids) == text


def test_bpe_vocabulary_merges_and_specials(bpe):
    assert bpe.vocab_size == 300  # 3 specials + 256 bytes + 41 merges
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    text = "def f(x):\n    return x"
    assert len(bpe.encode(text)) < len(text.encode())  # merges compress seen text
    assert 2 not in bpe.encode("<eos>")  # text spelling a special token is text
    assert bpe.decode([1, *bpe.encode("hi"), 2, 0]) == "hi"  # decode drops bos/eos/pad


def test_bpe_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="at least 259"):
        BPETokenizer.train(CORPUS, vocab_size=100, specials=SEQ2SEQ_SPECIALS)


def test_char_tokenizer_is_built_from_the_corpus():
    tok = CharTokenizer.train(["abca", "cab"], specials=SEQ2SEQ_SPECIALS, unknown="error")
    assert tok.chars == ["a", "b", "c"]
    assert tok.vocab_size == 6
    assert tok.encode("cab") == [5, 3, 4]
    assert tok.decode([1, 5, 3, 4, 2, 0]) == "cab"


def test_char_unknown_policies():
    unk = CharTokenizer.train(["ab"], unknown="unk")
    assert unk.specials == (UNK_TOKEN,)
    assert unk.encode("axb") == [1, 0, 2]
    assert unk.decode(unk.encode("axb")) == "a\ufffdb"
    skip = CharTokenizer.train(["ab"], unknown="skip")
    assert skip.encode("axb") == [0, 1]
    strict = CharTokenizer.train(["ab"], unknown="error")
    known = r"'x' at index 1 is not in the tokenizer's 2 characters \('ab'\); use only characters the model was"
    with pytest.raises(ValueError, match=known + r" .* unknown='unk' or 'skip' \(tformer train --unknown unk"):
        strict.encode("axb")
    with pytest.raises(ValueError, match="policy 'drop'"):
        CharTokenizer(["a"], unknown="drop")


@given(st.text(alphabet=st.sampled_from("abcλ漢x\n ")))
@settings(max_examples=100, deadline=None)
def test_char_vectorized_encoder_matches_plain(text):
    for policy in ("unk", "skip"):
        tok = CharTokenizer.train(["abcλ漢\n"], specials=SEQ2SEQ_SPECIALS, unknown=policy)
        assert tok.encode_array(text).tolist() == tok.encode(text)


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_save_load_round_trip(tmp_path, kind):
    tok = build_tokenizer(kind, CORPUS, vocab_size=290, specials=SEQ2SEQ_SPECIALS)
    path = tok.save(tmp_path / "tok")
    assert path.name == "tokenizer.json"
    loaded = load_tokenizer(tmp_path / "tok")
    assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
    text = "class Point:\n    ü 漢 unseen-ish ~"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.fingerprint() == tok.fingerprint()
    assert list(tmp_path.joinpath("tok").iterdir()) == [path]  # no temporary file left behind


def test_fingerprint_tells_tokenizers_apart():
    assert ByteTokenizer().fingerprint() != ByteTokenizer(SEQ2SEQ_SPECIALS).fingerprint()
    assert CharTokenizer(["a"]).fingerprint() != CharTokenizer(["b"]).fingerprint()


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a tformer tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"format": "tformer-tokenizer", "kind": "wordpiece"}')
    with pytest.raises(ValueError, match="unknown tokenizer kind 'wordpiece'"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{trunc")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)


def test_lone_surrogate_is_rejected_clearly(bpe):
    for tok in (ByteTokenizer(), bpe, CharTokenizer(["a"])):
        with pytest.raises(ValueError, match="lone surrogate"):
            tok.encode("a\ud800")
        with pytest.raises(ValueError, match="lone surrogate"):
            tok.encode_array("a\ud800")


def test_char_tokenizer_names_the_characters_it_does_not_know():
    tok = CharTokenizer("abc", unknown="unk")
    assert tok.unknown_chars("abcab") == []
    assert tok.unknown_chars("xaybxz") == ["x", "y", "z"]  # each once, in order of first appearance
    assert tok.encode("xa") == [tok.specials.index(UNK_TOKEN), tok.encode("a")[0]]
