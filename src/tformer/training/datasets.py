"""The data of a run: its tokenizer, training batches, validation batches and held-out examples, for each source
(a text corpus, a built-in task, a file of pairs).

The char and BPE tokenizers of a corpus are built once and cached (``tokenizer-<files>-<kind>-<size>-<policy>.json``
next to the token cache); a seq2seq tokenizer holds ``<pad>, <bos>, <eos>`` as ids 0, 1, 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tformer.runtime import default_cache_dir
from tformer.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEQ2SEQ_SPECIALS,
    CharTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenizer_from_dict,
)
from tformer.training.batches import LMBatches, Seq2SeqBatches, evaluation_batches
from tformer.training.config import TrainConfig
from tformer.training.corpus import files_fingerprint, iter_texts, tokenize_corpus
from tformer.training.pairs import load_pairs, split_pairs
from tformer.training.tasks import SequenceTask

TASK_HELD_OUT_SEED = 1234  # the held-out sources of a task do not depend on the run's seed


@dataclass
class RunData:
    """What a run trains and validates on."""

    tokenizer: Tokenizer
    train: LMBatches | Seq2SeqBatches
    val: list
    held_out: list[tuple[list[int], list[int]]] | None = None  # seq2seq: (source ids, target ids)
    max_len: int = 0  # seq2seq: the longest source or target (+ BOS/EOS)
    digest: str | None = None  # SHA-256 of the token ids of a corpus or pairs file (a task is made by its settings)
    trained_held_out: int = 0  # held-out examples that training may draw too (a task's short lengths)


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cached_tokenizer(cfg: TrainConfig, files: list[Path]) -> Tokenizer:
    """Build (or read from the cache) the char/BPE tokenizer of a corpus."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    name = f"tokenizer-{files_fingerprint(files)}-{cfg.tokenizer}-{cfg.vocab_size}-{cfg.unknown}.json"
    path = cache / name
    if path.is_file():
        return tokenizer_from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
    if cfg.progress:
        _note(f"data: building the {cfg.tokenizer} tokenizer of {len(files)} file(s) (first use; cached in {cache})")
    tokenizer = build_tokenizer(cfg.tokenizer, iter_texts(files), vocab_size=cfg.vocab_size, unknown=cfg.unknown)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(tokenizer.to_dict(), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
    return tokenizer


def task_held_out(cfg: TrainConfig) -> list[tuple[int, ...]]:
    """The held-out sources of a task run (never trained on, where their length has enough sources)."""
    task = SequenceTask(cfg.task, min_len=cfg.task_min_len, max_len=cfg.task_max_len)
    return task.held_out(cfg.task_held_out, seed=TASK_HELD_OUT_SEED)


def prepare_data(cfg: TrainConfig, tokenizer: Tokenizer | None, files: list[Path]) -> RunData:
    """The tokenizer (``tokenizer``, or built from the data), batches and held-out set of a run; ``files``: the
    text files of an LM corpus (:func:`tformer.training.corpus.scan_corpus`)."""
    if cfg.kind == "lm":
        if tokenizer is None:
            tokenizer = build_tokenizer("byte") if cfg.tokenizer == "byte" else cached_tokenizer(cfg, files)
        note = _note if cfg.progress else None  # a long first tokenization says so, wherever stderr goes
        corpus = tokenize_corpus(files, tokenizer, val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir, note=note)
        train = LMBatches(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed)
        val = LMBatches(corpus.val, cfg.block_size, cfg.batch_size, cfg.seed).evaluation(cfg.eval_batches)
        return RunData(tokenizer, train, val, digest=corpus.digest)
    if cfg.task is not None:
        task = SequenceTask(cfg.task, min_len=cfg.task_min_len, max_len=cfg.task_max_len)
        if tokenizer is None:
            tokenizer = CharTokenizer(task.alphabet, SEQ2SEQ_SPECIALS, unknown="error")
        sources = task_held_out(cfg)
        held = [(list(s), task.target(s)) for s in sources]
        withheld = {s for s in sources if task.can_withhold(s)}  # short lengths cannot be withheld (all of them)
        train = Seq2SeqBatches(cfg.batch_size, cfg.seed, task=task, exclude=withheld)
        max_len = max(task.max_source_len, task.max_target_len)
        digest, trained_held_out = None, sum(s not in withheld for s in sources)
    else:
        pairs = load_pairs(cfg.pairs)
        train_idx, val_idx = split_pairs(len(pairs), cfg.val_fraction)
        if tokenizer is None:
            texts = (side for i in train_idx for side in pairs[i])
            tokenizer = build_tokenizer(
                cfg.tokenizer, texts, vocab_size=cfg.vocab_size, specials=SEQ2SEQ_SPECIALS, unknown=cfg.unknown
            )
        encoded = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]
        held = [encoded[i] for i in val_idx]
        train = Seq2SeqBatches(
            cfg.batch_size, cfg.seed, pairs=[encoded[i] for i in train_idx], bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID
        )
        max_len = max(max(len(s), len(t) + 2) for s, t in encoded)
        digest, trained_held_out = hashlib.sha256(json.dumps(encoded).encode()).hexdigest(), 0
    if (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) != (PAD_ID, BOS_ID, EOS_ID):
        raise ValueError(f"a seq2seq tokenizer needs {', '.join(SEQ2SEQ_SPECIALS)} as ids 0, 1, 2; got {tokenizer}")
    val = evaluation_batches(held, cfg.batch_size, BOS_ID, EOS_ID, PAD_ID)
    return RunData(tokenizer, train, val, held, max_len, digest, trained_held_out)
