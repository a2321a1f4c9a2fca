"""Corpora (the stdlib default, files, folders without hidden or binary files) and the memory-mapped token cache,
with the removal of temporary folders left by killed runs."""

import fcntl
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tformer.training.corpus as data
from tformer.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer
from tformer.training.corpus import (
    DOC_SEPARATOR,
    corpus_files,
    iter_texts,
    remove_stale_temps,
    scan_corpus,
    stdlib_root,
    tokenize_corpus,
)


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


def test_a_byte_order_mark_opening_a_file_is_not_text(tmp_path):
    """A file saved "UTF-8 with BOM" reads as the same text as one without: the mark would otherwise be a character
    of the corpus (and of a char tokenizer's vocabulary)."""
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("abc\n")
    marked.write_bytes(b"\xef\xbb\xbfabc\n")
    assert "".join(iter_texts([marked, plain])) == f"abc\n{DOC_SEPARATOR}abc\n"


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


@pytest.mark.subprocess
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


def test_a_first_tokenization_says_so_and_a_cached_one_is_silent(folder, tmp_path):
    """Tokenizing a large corpus takes a while the first time: ``note`` is told before it starts, naming the cache
    (the trainer prints it on stderr, wherever that goes); the next run reads the cache and says nothing."""
    notes: list[str] = []
    files = corpus_files(folder)
    tokenize_corpus(files, ByteTokenizer(), cache_dir=tmp_path / "cache", note=notes.append)
    assert notes == [f"data: tokenizing 3 file(s), 0.0 MiB (first use; cached in {tmp_path / 'cache'})"]
    tokenize_corpus(files, ByteTokenizer(), cache_dir=tmp_path / "cache", note=notes.append)
    assert len(notes) == 1
