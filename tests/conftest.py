"""Shared fixtures: tiny configurations, random models with peaked next-token distributions, random inputs, a corpus.

Random models: GPT-2's initialization (std 0.02) gives nearly uniform next-token distributions, full of near-ties,
on which greedy and beam search would test nothing; the factories here draw the matrices with a larger standard
deviation instead.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tformer import DecoderLM, EncoderDecoder, TransformerConfig
from tformer.training import TrainConfig

# The fast tier (``make test-fast``) runs no subprocess and builds no kernel: it sets this variable and
# TFORMER_KERNELS=0, and deselects the tests marked ``slow``, ``subprocess`` and ``kernels``. A test that starts a
# process anyway (itself, or through torch.compile's C++ builds or the claims sandbox) fails there, naming its mark.
FAST_TIER = os.environ.get("TFORMER_TEST_TIER") == "fast"


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(monkeypatch):
    if FAST_TIER:

        def refuse(*args, **kwargs):
            raise RuntimeError("this test starts a process: mark it @pytest.mark.subprocess (the fast tier runs none)")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


VOCAB = TransformerConfig.tiny().vocab_size
# The model of the tiny training runs: TransformerConfig.tiny()'s sizes (vocab_size and max_seq_len come from the run)
TINY_MODEL = {k: getattr(TransformerConfig.tiny(), k) for k in ("d_model", "num_heads", "num_layers", "d_ff")}


def peaky(model, std: float = 0.5, seed: int = 0):
    """``model`` in eval mode with every matrix redrawn from N(0, std^2): next-token distributions far from
    uniform."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


def random_lm(position: str = "rotary", dtype=torch.float32, seed: int = 0, std: float = 0.3, **changes) -> DecoderLM:
    """A tiny decoder-only LM (``TransformerConfig.tiny``) with peaked next-token distributions."""
    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig.tiny(position=position, **changes)).to(dtype).eval()
    with torch.no_grad():  # drawn after the initialization, from the same seeded stream
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def random_seq2seq(vocab: int = VOCAB, seed: int = 0, dtype=torch.float64, eos: int = 2, **changes) -> EncoderDecoder:
    """A tiny encoder-decoder with an untied output matrix (with tied embeddings a random model mostly repeats its
    last input token) whose EOS row is zero: the EOS logit is 0, so outputs end sometimes early, sometimes late,
    never all at once."""
    torch.manual_seed(seed)
    cfg = TransformerConfig.tiny(vocab_size=vocab, d_model=16, num_heads=2, d_ff=32, tie_embeddings=False, **changes)
    model = peaky(EncoderDecoder(cfg).to(dtype), std=0.2, seed=seed)
    with torch.no_grad():
        model.head.weight[eos] = 0.0
    return model


def random_ids(batch: int, length: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Token ids ``(batch, length)`` drawn uniformly from the vocabulary."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def random_prompts(lengths, vocab: int = VOCAB, seed: int = 0) -> list[list[int]]:
    """One random prompt (a list of ids) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def random_sources(lengths, vocab: int, low: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``src (B, S)`` and ``src_mask`` of random sources with ids in ``[low, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(src, dtype=torch.bool)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(low, vocab, (n,), generator=g)
        mask[i, :n] = True
    return src, mask


# The factories as fixtures (session-scoped: module-scoped fixtures use them too)
@pytest.fixture(scope="session", name="peaky")
def _peaky_fixture():
    return peaky


@pytest.fixture(scope="session", name="random_lm")
def _random_lm_fixture():
    return random_lm


@pytest.fixture(scope="session", name="random_seq2seq")
def _random_seq2seq_fixture():
    return random_seq2seq


@pytest.fixture(scope="session", name="random_ids")
def _random_ids_fixture():
    return random_ids


@pytest.fixture(scope="session", name="random_prompts")
def _random_prompts_fixture():
    return random_prompts


@pytest.fixture(scope="session", name="random_sources")
def _random_sources_fixture():
    return random_sources


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """``tmp_path / "ro"``, a folder in which nothing can be made, as a user who is not root sees a read-only one
    (CI runs as root, who may write anywhere): ``os.mkdir`` of any path inside it raises ``PermissionError``."""
    import os

    folder, real_mkdir = tmp_path / "ro", os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    return folder


@pytest.fixture
def corpus(tmp_path):
    """A small Python-like text file (about 10k characters)."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)))
    return path


@pytest.fixture(scope="session")
def tiny_flags() -> list[str]:
    """``tformer train`` flags of the tiny runs: the TINY_MODEL sizes, 16-token windows, batches of 4."""
    from tformer.training.config import MODEL_FLAGS

    model = [word for name, value in TINY_MODEL.items() for word in (MODEL_FLAGS[name].flag, str(value))]
    return [*model, "--block-size", "16", "--batch-size", "4"]


@pytest.fixture
def tiny_run(tmp_path, corpus):
    """``tiny_run(name="run", **changes)``: the TrainConfig of a seconds-long LM run on ``corpus`` into
    ``tmp_path / name`` (12 steps of 4 windows of 16 bytes, the TINY_MODEL sizes). A ``model`` dict in ``changes``
    updates TINY_MODEL; any other ``model`` value is passed as it is (to test its validation)."""

    def make(name: str = "run", **changes) -> TrainConfig:
        model = changes.pop("model", {})
        base = dict(
            out=str(tmp_path / name),
            data=str(corpus),
            cache_dir=str(tmp_path / "cache"),
            steps=12,
            batch_size=4,
            block_size=16,
            warmup=3,
            eval_every=4,
            eval_batches=2,
            save_every=0,
            log_every=1,
            progress=False,
        )
        model = {**TINY_MODEL, **model} if isinstance(model, dict) else model
        return TrainConfig(**{**base, **changes, "model": model})

    return make
