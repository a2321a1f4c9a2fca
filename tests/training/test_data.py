"""Data: corpora (stdlib default, files, folders without hidden or binary files), the memory-mapped token cache
(and the removal of temporary folders left by killed runs), the batch samplers, the built-in tasks (including
addition) and TSV pairs."""

import fcntl
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import tformer.training.data as data
from tformer.training.data import (
    DOC_SEPARATOR,
    LMBatches,
    Seq2SeqBatches,
    corpus_files,
    iter_texts,
    remove_stale_temps,
    scan_corpus,
    split_pairs,
    stdlib_root,
    tokenize_corpus,
)
from tformer.training.tasks import BOS, EOS, PAD, SequenceTask, load_pairs
from tformer.training.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second file\nwith two lines\n")
    (root / "a.txt").write_text("first file: héllo\n")
    (root / "sub" / "c.txt").write_text("third\r\nfile\n" * 50)
    (root / ".hidden").write_text("never read")
    return root


def test_stdlib_corpus_is_the_standard_library_in_a_fixed_order():
    files = corpus_files()
    root = stdlib_root()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names)
    assert "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in n for n in names)
    assert all(n.endswith(".py") for n in names)
    assert sum(f.stat().st_size for f in files) > 10_000_000  # tens of MB of text


def test_folder_corpus_and_missing_path(folder, tmp_path):
    assert [f.relative_to(folder).as_posix() for f in corpus_files(folder)] == ["a.txt", "b.txt", "sub/c.txt"]
    assert corpus_files(folder / "a.txt") == [folder / "a.txt"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no files"):
        corpus_files(tmp_path / "empty")


def test_folder_corpus_skips_hidden_folders_and_files_that_are_not_text(folder):
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "objects" / "pack.txt").write_text("text, but under a hidden folder")
    (folder / "sub" / ".cache").mkdir()
    (folder / "sub" / ".cache" / "d.txt").write_text("hidden two levels down")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0" + bytes(range(256)))
    (folder / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (folder / "late_nul.txt").write_bytes(b"a" * 9000 + b"\0")  # past the 8 KiB probe: text
    (folder / "cut.txt").write_bytes(b"a" * 8191 + "\u00e9".encode())  # a character cut by the probe: text
    scan = scan_corpus(folder)
    names = [f.relative_to(folder).as_posix() for f in scan.files]
    assert names == ["a.txt", "b.txt", "cut.txt", "late_nul.txt", "sub/c.txt"]
    assert [p.as_posix() for p in scan.hidden] == [".git", ".hidden", "sub/.cache"]
    assert [p.as_posix() for p in scan.not_text] == ["__pycache__/a.cpython-311.pyc", "latin1.txt"]
    assert scan.skipped() == (
        "3 hidden entries (.git, .hidden, sub/.cache) and 2 files that are not UTF-8 text "
        "(__pycache__/a.cpython-311.pyc, latin1.txt)"
    )
    assert corpus_files(folder) == scan.files


def test_folder_without_text_and_binary_or_special_paths_are_clear_errors(tmp_path):
    binaries = tmp_path / "binaries"
    (binaries / ".git").mkdir(parents=True)
    (binaries / ".git" / "pack.bin").write_bytes(b"PACK\0\0\0\2")
    (binaries / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(
        ValueError,
        match=r"holds no text files \(skipped 1 hidden entry \(\.git\) and 1 file that "
        r"is not UTF-8 text \(image\.png\)\); pass a folder of UTF-8 text files \(--data\)",
    ):
        corpus_files(binaries)
    with pytest.raises(ValueError, match=r"data file .*image\.png is not text \(a NUL byte at offset 8: binary\)"):
        corpus_files(binaries / "image.png")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"latin1\.txt is not text \(byte 0xe9 at offset 3 is not UTF-8\)"):
        corpus_files(tmp_path / "latin1.txt")
    with pytest.raises(ValueError, match=r"data path /dev/null is not a regular file or folder.*\(--data\)"):
        corpus_files("/dev/null")


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_iter_texts_is_the_joined_files_in_pieces(folder, chunk):
    files = corpus_files(folder)
    whole = DOC_SEPARATOR.join(f.read_bytes().decode() for f in files)
    pieces = list(iter_texts(files, chunk))
    assert "".join(pieces) == whole
    if chunk == 64:
        assert len(pieces) > 3 and all(p.endswith("\n") for p in pieces[:-1])  # cut at line ends


def test_token_cache_round_trip_split_and_reuse(folder, tmp_path, monkeypatch):
    files = corpus_files(folder)
    whole = DOC_SEPARATOR.join(f.read_bytes().decode() for f in files)
    monkeypatch.setattr(data, "CHUNK_CHARS", 16)  # tokenized in many small pieces
    corpus = tokenize_corpus(files, ByteTokenizer(), val_fraction=0.25, cache_dir=tmp_path / "cache")
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16
    assert bytes(corpus.tokens.tolist()).decode() == whole
    assert corpus.split == round(len(corpus.tokens) * 0.75)
    assert len(corpus.train) + len(corpus.val) == len(corpus.tokens)

    def fail(*args):
        raise AssertionError("tokenized again although cached")

    monkeypatch.setattr(data, "_write_tokens", fail)
    again = tokenize_corpus(files, ByteTokenizer(), val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert again.path == corpus.path and again.split == round(len(corpus.tokens) * 0.9)
    with pytest.raises(AssertionError, match="tokenized again"):  # another tokenizer is another entry
        tokenize_corpus(files, ByteTokenizer(SEQ2SEQ_SPECIALS), cache_dir=tmp_path / "cache")
    (folder / "a.txt").write_text("changed content, changed size\n")
    with pytest.raises(AssertionError, match="tokenized again"):  # so is a changed file
        tokenize_corpus(files, ByteTokenizer(), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # no half-written entries


def _stale_temp(cache, name, age_s=3600.0):
    """A temporary cache folder as a killed writer leaves it, last written ``age_s`` ago."""
    tmp = cache / name
    tmp.mkdir(parents=True)
    (tmp / "tokens.bin").write_bytes(b"\0" * 64)
    for p in (tmp / "tokens.bin", tmp):
        os.utime(p, (time.time() - age_s, time.time() - age_s))
    return tmp


def test_temporary_folders_of_dead_writers_are_removed_and_live_ones_kept(folder, tmp_path):
    cache = tmp_path / "cache"
    dead = _stale_temp(cache, ".tmp-abc-999999-deadbeef")
    empty = cache / ".tmp-abc-999998-00000000"  # killed before its first write
    empty.mkdir()
    os.utime(empty, (time.time() - 3600, time.time() - 3600))
    recent = _stale_temp(cache, ".tmp-abc-999997-11111111", age_s=1.0)  # written a second ago: may be running
    locked = _stale_temp(cache, ".tmp-abc-999996-22222222")
    fd = os.open(locked / "tokens.bin", os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer holds the lock, however long since its last write
    try:
        corpus = tokenize_corpus(corpus_files(folder), ByteTokenizer(), cache_dir=cache)
        assert corpus.tokens.size > 0
        assert sorted(p.name for p in cache.glob(".tmp-*")) == [locked.name, recent.name]
        assert not dead.exists() and not empty.exists()
    finally:
        os.close(fd)
    tokenize_corpus(corpus_files(folder), ByteTokenizer(), cache_dir=cache)  # cached now, still cleans up
    assert sorted(p.name for p in cache.glob(".tmp-*")) == [recent.name]  # the lock is free: its writer is gone


def test_a_writer_killed_by_sigkill_releases_its_lock(tmp_path):
    tmp = _stale_temp(tmp_path, ".tmp-abc-1-33333333")
    holder = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp / "tokens.bin")], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"locked\n"
        assert remove_stale_temps(tmp_path) == [] and tmp.exists()  # alive: kept
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert remove_stale_temps(tmp_path) == [tmp] and not tmp.exists()


def test_char_corpus_matches_plain_encoding(folder, tmp_path):
    files = corpus_files(folder)
    tok = CharTokenizer.train(iter_texts(files))
    corpus = tokenize_corpus(files, tok, cache_dir=tmp_path)
    whole = DOC_SEPARATOR.join(f.read_bytes().decode() for f in files)
    assert corpus.tokens.tolist() == tok.encode(whole)


def test_lm_batches_are_a_pure_function_of_seed_and_index():
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = LMBatches(tokens, block_size=16, batch_size=6, seed=3)
    a, b = sampler.get(5), sampler.get(5)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.offsets, sampler.get(6).offsets)
    assert not np.array_equal(a.offsets, LMBatches(tokens, 16, 6, seed=4).get(5).offsets)
    x, y = a.rows(0, 6)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert int(y.max()) <= 999 and a.num_tokens == 6 * 16
    shards = torch.cat([a.rows(0, 2)[0], a.rows(2, 4)[0], a.rows(4, 6)[0]])  # ranks' rows = the global batch
    assert torch.equal(shards, x)


def test_lm_evaluation_windows_are_fixed_and_spread():
    sampler = LMBatches(np.arange(500, dtype=np.uint16), block_size=10, batch_size=4, seed=0)
    batches = sampler.evaluation(3)
    offsets = np.concatenate([b.offsets for b in batches])
    assert len(batches) == 3 and offsets[0] == 0 and offsets[-1] == 500 - 11
    np.testing.assert_array_equal(offsets, np.concatenate([b.offsets for b in sampler.evaluation(3)]))


def test_lm_batches_reject_a_split_shorter_than_a_window():
    with pytest.raises(ValueError, match="too short for windows of block_size=64"):
        LMBatches(np.arange(50, dtype=np.uint16), block_size=64, batch_size=2, seed=0)


def test_task_batches_exclude_held_out_and_are_deterministic():
    task = SequenceTask("reverse", max_len=3, num_symbols=3)
    held = set(task.held_out(20, seed=1))
    sampler = Seq2SeqBatches(64, seed=0, task=task, exclude=held)
    batch = sampler.get(0)
    assert len(batch) == 64 and not {s for s, _ in batch.pairs} & held
    assert batch.pairs == sampler.get(0).pairs and batch.pairs != sampler.get(1).pairs
    src, src_mask, tgt_in, tgt_out, tgt_mask = batch.rows(0, 5)
    assert (tgt_in[:, 0] == BOS).all()
    for i, (s, t) in enumerate(batch.pairs[:5]):
        assert src[i, : len(s)].tolist() == list(s) and src_mask[i].sum() == len(s)
        assert tgt_out[i, : len(t) + 1].tolist() == [*t, EOS] and (tgt_out[i, len(t) + 1 :] == PAD).all()
        assert tgt_mask[i].sum() == len(t) + 1
    assert batch.num_tokens == sum(len(t) + 1 for _, t in batch.pairs)


def test_addition_task():
    task = SequenceTask("add", min_len=1, max_len=4)
    assert task.alphabet == "0123456789+" and task.vocab_size == 14
    assert task.to_text(task.target(task.from_text("123+45"))) == "168"
    assert task.to_text(task.target(task.from_text("999+1"))) == "1000"
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        source = task.to_text(task.sample_source(gen))
        a, b = source.split("+")
        assert 1 <= len(a) <= 4 and 1 <= len(b) <= 4 and (a == "0" or a[0] != "0")
        assert task.to_text(task.target(task.from_text(source))) == str(int(a) + int(b))
    assert task.max_source_len == 9 and task.max_target_len == 7
    with pytest.raises(ValueError, match="'x' is not a symbol of the add task"):
        task.from_text("1x2")


def test_task_lengths_error_names_the_cli_flags():
    with pytest.raises(
        ValueError,
        match=r"reverse task's lengths need 1 <= min_len <= max_len "
        r"\(--task-min-len <= --task-max-len\); got min_len=1, max_len=0",
    ):
        SequenceTask("reverse", min_len=1, max_len=0)


def test_existing_task_api_still_works():
    task = SequenceTask("reverse")
    src, src_mask, tgt, tgt_mask = task.batch(8, torch.Generator().manual_seed(0))
    assert src.shape[0] == tgt.shape[0] == 8 and task.vocab_size == 13 and task.max_target_len == 18
    assert task.alphabet == "0123456789"


def test_pairs_file(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("hello\tbonjour\n\ncat\tchat\r\n")
    assert load_pairs(path) == [("hello", "bonjour"), ("cat", "chat")]
    path.write_text("ok\tfine\nno tab here\n")
    with pytest.raises(ValueError, match=r"pairs\.tsv:2: expected 'source<TAB>target'"):
        load_pairs(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.tsv does not exist; pass a file .*\(--pairs\)"):
        load_pairs(tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match=r"pairs file .* is a directory; pass a file of source<TAB>target lines"):
        load_pairs(tmp_path)
    with pytest.raises(ValueError, match=r"pairs file /dev/null is not a regular file"):
        load_pairs("/dev/null")


def test_pairs_split_is_fixed_disjoint_and_complete():
    train, val = split_pairs(50, 0.2)
    assert len(val) == 10 and not set(train) & set(val) and sorted([*train, *val]) == list(range(50))
    np.testing.assert_array_equal(val, split_pairs(50, 0.2)[1])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        split_pairs(1, 0.1)


def test_only_lengths_with_many_sources_are_withheld():
    add = SequenceTask("add", min_len=1, max_len=2)
    counts = {}
    for a in range(100):
        for b in range(100):
            counts[len(f"{a}+{b}")] = counts.get(len(f"{a}+{b}"), 0) + 1
    assert [add.sources_of_length(n) for n in range(1, 7)] == [counts.get(n, 0) for n in range(1, 7)]
    reverse = SequenceTask("reverse")
    assert [reverse.sources_of_length(n) for n in (1, 2, 3)] == [10, 100, 1000]
    assert not reverse.can_withhold((3,)) and not reverse.can_withhold((3, 4)) and reverse.can_withhold((3, 4, 5))
