"""Text corpora for language models: the files of a corpus, read as a stream of text, tokenized once into a cache.

Language-model corpora
    The default corpus is the Python standard library of the running interpreter (``*.py`` under
    ``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), about 30 MB of real code that every Python
    install has. ``--data PATH`` names a text file or a folder of text files instead. Files are read in sorted
    order of their relative paths, as UTF-8 (undecodable bytes become U+FFFD), joined by a blank line.

    A folder is walked without its hidden entries (any name starting with ``.``: ``.git/`` is never entered) and
    without the files that are not text. Text means: the first 8 KiB hold no NUL byte and decode as strict
    UTF-8 (a character cut by the 8 KiB boundary is fine); so ``.pyc``, images, archives, UTF-16 and
    Latin-1 files are skipped, and counted (:class:`CorpusScan`). Only that prefix is read, once. A file named
    explicitly must be text too. The standard library's ``*.py`` files are taken as they are (source text by
    construction; a few are Latin-1/KOI8-R test fixtures, read with U+FFFD as before).

    The token stream is cached on disk as a flat binary array (``tokens.bin``, uint16 or uint32) read through
    ``np.memmap``, keyed by a hash of the files (path, size, mtime) and of the tokenizer: a corpus larger than
    memory is tokenized in chunks and trained on without being loaded. Train/validation split: the first
    ``1 - val_fraction`` of the tokens train, the rest validate (nanoGPT's convention). An entry is written
    into a ``.tmp-*`` folder and renamed into place; ``.tmp-*`` folders left by killed processes are removed
    by the next run (see :func:`remove_stale_temps` for the rule that spares running writers).

"""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import json
import os
import shutil
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tformer.runtime import default_cache_dir
from tformer.tokenizers import Tokenizer

DOC_SEPARATOR = "\n\n"
CHUNK_CHARS = 1 << 22  # read and tokenize ~4M characters at a time
TEXT_PROBE_BYTES = 8192  # a file is text if this prefix has no NUL byte and is valid UTF-8 (git's probe size)
STALE_TMP_QUIET_S = 60.0  # a cache .tmp-* folder unchanged this long, with no writer holding its lock, is stale
_CACHE_VERSION = 2  # 2: meta.json holds the SHA-256 of tokens.bin


# --------------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def not_text_reason(path: Path) -> str | None:
    """Why ``path`` is not text (``None`` when it is): a NUL byte, or invalid UTF-8, in its first
    ``TEXT_PROBE_BYTES`` bytes. Reads only that prefix."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(TEXT_PROBE_BYTES)
    except OSError as err:
        raise ValueError(f"cannot read the corpus file {path}: {err.strerror}") from err
    nul = prefix.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at offset {nul}: binary"
    try:  # final=False lets the prefix end in the middle of a multi-byte character
        codecs.getincrementaldecoder("utf-8")().decode(prefix, final=len(prefix) < TEXT_PROBE_BYTES)
    except UnicodeDecodeError as err:
        return f"byte 0x{prefix[err.start]:02x} at offset {err.start} is not UTF-8"
    return None


@dataclass
class CorpusScan:
    """The files of a corpus, and what a folder scan skipped (a hidden folder is one entry, never walked)."""

    files: list[Path]
    hidden: list[Path]
    not_text: list[Path]

    def skipped(self) -> str:
        """E.g. ``"1 hidden entry (.git) and 2 files that are not UTF-8 text (a.pyc, b.png)"``; ``""`` if none."""

        def part(paths: list[Path], one: str, many: str) -> str:
            names = ", ".join(p.as_posix() for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
            return f"{len(paths)} {one if len(paths) == 1 else many} ({names})"

        parts = [part(self.hidden, "hidden entry", "hidden entries")] if self.hidden else []
        if self.not_text:
            parts.append(part(self.not_text, "file that is not UTF-8 text", "files that are not UTF-8 text"))
        return " and ".join(parts)


def scan_corpus(data: str | os.PathLike | None = None) -> CorpusScan:
    """The files of a corpus: ``data`` (a text file, or the text files under a folder), or with ``None`` the
    standard library's ``*.py`` files. Sorted by relative path, so the order is the same on every machine.

    A folder's hidden entries and its files that are not text (:func:`not_text_reason`) are skipped and listed
    (relative to the folder) in the result. ``FileNotFoundError`` for a missing path or an empty folder,
    ``ValueError`` for a file that is not text, a folder with no text file, or a path that is neither.
    """
    if data is None:
        root = stdlib_root()
        skip = {"site-packages", "dist-packages", "__pycache__"}
        files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.is_file()]
        if not files:
            raise FileNotFoundError(f"found no *.py files under the standard library folder {root}")
        return CorpusScan(sorted(files, key=lambda p: p.relative_to(root).as_posix()), [], [])
    path = Path(data)
    if path.is_file():
        reason = not_text_reason(path)
        if reason is not None:
            raise ValueError(f"data file {path} is not text ({reason}); pass a UTF-8 text file or a folder (--data)")
        return CorpusScan([path], [], [])
    if path.is_dir():
        scan = CorpusScan([], [], [])
        for folder, dirs, names in os.walk(path):
            here = Path(folder)
            scan.hidden += [(here / d).relative_to(path) for d in dirs if d.startswith(".")]
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # pruned: .git/ and the like are never walked
            for name in names:
                file = here / name
                if name.startswith("."):
                    scan.hidden.append(file.relative_to(path))
                elif file.is_file():  # follows links; skips pipes, sockets and broken links
                    if not_text_reason(file) is None:
                        scan.files.append(file)
                    else:
                        scan.not_text.append(file.relative_to(path))
        if not scan.files:
            if not scan.hidden and not scan.not_text:
                raise FileNotFoundError(f"the data folder {path} holds no files; pass a folder of text files (--data)")
            raise ValueError(
                f"the data folder {path} holds no text files (skipped {scan.skipped()}); "
                "pass a folder of UTF-8 text files (--data)"
            )
        scan.files.sort(key=lambda p: p.relative_to(path).as_posix())
        scan.hidden.sort(key=Path.as_posix)
        scan.not_text.sort(key=Path.as_posix)
        return scan
    if path.exists():
        raise ValueError(
            f"data path {path} is not a regular file or folder (a device, pipe or socket); "
            "pass a text file or a folder of text files (--data)"
        )
    raise FileNotFoundError(f"data path {path} does not exist; pass a text file or a folder of text files (--data)")


def corpus_files(data: str | os.PathLike | None = None) -> list[Path]:
    """The text files of a corpus, in order: :func:`scan_corpus` without the list of what was skipped."""
    return scan_corpus(data).files


def iter_texts(files: Sequence[Path], chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The corpus as a stream of pieces of at most about ``chunk_chars`` characters.

    Documents are joined by ``DOC_SEPARATOR``; a UTF-8 byte-order mark that opens a file is not text (Windows
    editors write one) and is dropped; a long file is cut just after a newline, so no piece ends in
    the middle of a line (which keeps BPE's word splitting nearly the same as on the whole text); a line longer
    than ``4 * chunk_chars`` is cut where it stands, so memory stays bounded.
    """
    for i, path in enumerate(files):
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
            carry = DOC_SEPARATOR if i else ""
            while True:
                block = f.read(chunk_chars)
                if not block:
                    break
                text = carry + block
                cut = text.rfind("\n") + 1
                if len(text) < chunk_chars or (cut <= 0 and len(text) < 4 * chunk_chars):
                    carry = text  # keep reading: too short, or no line end yet (bounded: a huge line is cut)
                    continue
                cut = cut if cut > 0 else len(text)
                carry = text[cut:]
                yield text[:cut]
            if carry:
                yield carry


def files_fingerprint(files: Sequence[Path]) -> str:
    """Hash of the files' resolved paths, sizes and modification times (cheap for any corpus size)."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@dataclass
class TokenizedCorpus:
    """A tokenized corpus: ``tokens`` memory-mapped from ``path``, split at ``split``; ``digest``: the SHA-256 of the
    token stream (a resumed run checks that it trains on the same tokens)."""

    tokens: np.ndarray  # (N,) uint16 or uint32, a read-only memmap
    split: int
    path: Path
    digest: str

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.split]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.split :]


def _write_tokens(files: Sequence[Path], tokenizer: Tokenizer, directory: Path) -> None:
    """Tokenize chunk by chunk, appending to ``directory/tokens.bin``; then write ``meta.json``."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    count, digest = 0, hashlib.sha256()
    with open(directory / "tokens.bin", "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # held while writing: tells remove_stale_temps this entry is live
        for text in iter_texts(files, CHUNK_CHARS):
            ids = tokenizer.encode_array(text).astype(dtype)
            ids.tofile(f)
            digest.update(ids.tobytes())
            count += len(ids)
        f.flush()
        os.fsync(f.fileno())
    meta = {
        "version": _CACHE_VERSION,
        "dtype": np.dtype(dtype).name,
        "count": count,
        "sha256": digest.hexdigest(),
        "files": len(files),
        "tokenizer": tokenizer.to_dict()["kind"],
        "vocab_size": tokenizer.vocab_size,
    }
    (directory / "meta.json").write_text(json.dumps(meta))


def remove_stale_temps(cache: Path) -> list[Path]:
    """Remove the ``.tmp-*`` folders of ``cache`` that earlier processes left behind (killed mid-tokenization,
    even by ``kill -9``); returns them.

    A folder is stale when both hold: (1) no process holds the lock on its ``tokens.bin`` -- the writer holds an
    exclusive ``flock`` while it writes and the kernel drops it when the writer dies, whatever killed it -- and
    (2) nothing in it changed for ``STALE_TMP_QUIET_S`` seconds, which covers the instants before the lock is
    taken and after it is released, and file systems that do not share locks between machines (a live writer
    appends to ``tokens.bin`` every chunk). So the folder of a running writer is never removed.
    """
    removed = []
    now = time.time()
    for tmp in cache.glob(".tmp-*"):
        try:
            changed = max([tmp.lstat().st_mtime, *(p.lstat().st_mtime for p in tmp.iterdir())])
        except OSError:  # removed meanwhile, or not a folder
            continue
        if now - changed < STALE_TMP_QUIET_S:
            continue
        try:
            fd = os.open(tmp / "tokens.bin", os.O_WRONLY)  # opened for writing: NFS locks need it
        except FileNotFoundError:
            fd = None  # killed before it began to write
        except OSError:  # not ours to remove (permissions)
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def tokenize_corpus(
    files: Sequence[Path],
    tokenizer: Tokenizer,
    *,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    note: Callable[[str], None] | None = None,
) -> TokenizedCorpus:
    """The token stream of ``files`` under ``tokenizer``, from the cache or tokenized now (then cached; ``note`` is
    told so first: the first run on a large corpus tokenizes for a while).

    The cache entry is written into a temporary folder and renamed into place, so an interrupted run never
    leaves a half-written entry, and concurrent processes (data-parallel ranks) agree on one. Temporary folders
    left by killed runs are removed on every call, cached or not (:func:`remove_stale_temps`).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(
        f"{_CACHE_VERSION}:{files_fingerprint(files)}:{tokenizer.fingerprint()}:{DOC_SEPARATOR!r}".encode()
    ).hexdigest()[:20]
    entry = cache / f"corpus-{key}"
    if cache.is_dir():
        remove_stale_temps(cache)
    if not (entry / "meta.json").is_file():
        if note:
            size = sum(f.stat().st_size for f in files) / 2**20
            note(f"data: tokenizing {len(files)} file(s), {size:.1f} MiB (first use; cached in {cache})")
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _write_tokens(files, tokenizer, tmp)
            try:
                tmp.rename(entry)
            except OSError:  # another process finished the same entry first
                if not (entry / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((entry / "meta.json").read_text())
    count = meta["count"]
    if count == 0:
        what = f"{len(files)} file{'s' if len(files) != 1 else ''}, first {files[0]}"
        raise ValueError(f"the corpus ({what}) is empty after tokenization")
    tokens = np.memmap(entry / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(count,))
    split = int(round(count * (1.0 - val_fraction)))
    return TokenizedCorpus(tokens, split, entry, meta["sha256"])
