"""What ``tformer explore`` shows, as plain functions of a loaded model: tokens, the next-token distribution under
the sampling filters, every layer's attention, and the source document's mechanisms as switches.

Each attention map is recomputed from the layer's own inputs (captured by a forward hook during one forward pass)
with :func:`tformer.functional.attention_weights`, so it is exactly what the layer computed. The mechanism switches
(the ``1/sqrt(d_k)`` factor, the causal mask before or after the softmax) recompute the chosen layer's attention from
those same inputs; the rest of the model is left as it is, so what changes is the one thing switched.

Shapes: B, H, Hkv, T, S, D, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import codecs
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.engine import accelerate
from tformer.functional import attention_scores, rotate_pairs, sinusoidal_positional_encoding, softmax_jacobian_norm
from tformer.generation.sampling import apply_temperature, filter_logits, sample
from tformer.layers import MultiHeadAttention
from tformer.models import DecoderLM, EncoderDecoder

MAX_TOKENS = 512  # the longest prompt the page analyses (attention maps are T x T per head)
TOP = 20  # tokens listed in the next-token distribution
KINDS = {"lm": ("self",), "seq2seq": ("encoder", "decoder", "cross")}
MASK_MODES = ("before", "after", "none")
OFFSETS = 64  # the RoPE / position score curves cover offsets 0 .. OFFSETS
PYTHON_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"  # for models trained on code
PYTHON_PROMPTS = (PYTHON_PROMPT, "def f(x):\n    return")  # the second for a model of a short context
ENGLISH_PROMPT = "The capital of France is"  # for pretrained English models
PROMPTS = (ENGLISH_PROMPT, "The Transformer", "the quick brown fox")  # the first the tokenizer encodes is the default


class ExploreError(ValueError):
    """A request the model cannot answer (too long, empty, a layer out of range): a 400 with this message."""


@dataclass
class Explorer:
    """A loaded model with its tokenizer, and a lock: one forward at a time (the server's threads share it)."""

    model: DecoderLM | EncoderDecoder
    tokenizer: Any
    name: str
    kind: str  # "lm" or "seq2seq"
    start_id: int | None = None  # a seq2seq decoder's first input
    prompt: str = "The Transformer"  # the page's first prompt, one that suits the model (:func:`default_prompt`)
    lock: threading.Lock = field(default_factory=threading.Lock)
    recent: OrderedDict = field(default_factory=OrderedDict)  # (prompt, target) -> Forward, the last few

    @property
    def max_tokens(self) -> int:
        cfg = self.model.cfg
        return min(MAX_TOKENS, cfg.max_seq_len) if cfg.position == "learned" else MAX_TOKENS

    @property
    def num_layers(self) -> dict[str, int]:
        return {kind: len(self.layers(kind)) for kind in KINDS[self.kind]}

    def layers(self, kind: str) -> list[MultiHeadAttention]:
        """The attention modules of ``kind`` in layer order."""
        if kind not in KINDS[self.kind]:
            raise ExploreError(f"kind must be one of {', '.join(KINDS[self.kind])} for this model; got {kind!r}")
        if self.kind == "lm":
            return [b.self_attn for b in self.model.decoder.stack.blocks]
        if kind == "encoder":
            return [b.self_attn for b in self.model.encoder.stack.blocks]
        return [b.self_attn if kind == "decoder" else b.cross_attn for b in self.model.decoder.stack.blocks]

    def info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {
            "name": self.name,
            "kind": self.kind,
            "kinds": list(KINDS[self.kind]),
            "layers": self.num_layers,
            "heads": cfg.num_heads,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "d_model": cfg.d_model,
            "vocab_size": cfg.vocab_size,
            "position": cfg.position,
            "norm_first": cfg.norm_first,
            "max_tokens": self.max_tokens,
            "dtype": str(self.model.decoder.embed.tokens.weight.dtype).removeprefix("torch."),  # what it computes in
            "prompt": self.prompt,
        }


def _encodes(tokenizer: Any, text: str, limit: int) -> bool:
    """Whether ``tokenizer`` reads ``text`` whole (no error, no character dropped or made unknown) in at most
    ``limit`` tokens."""
    try:
        ids = list(tokenizer.encode(text))
    except ValueError:
        return False
    unknown = getattr(tokenizer, "unknown_chars", None)
    return 0 < len(ids) <= limit and not (unknown and unknown(text))


def default_prompt(tokenizer: Any, train_config: dict[str, Any] | None, limit: int = MAX_TOKENS) -> str:
    """A first prompt that suits the model: Python for a tformer run trained on the default corpus (the Python
    standard library: ``train_config`` says ``"data": null`` with no task or pairs); English for the rest
    (pretrained models: ``train_config`` ``None``); and in every case one the tokenizer reads whole in at most
    ``limit`` tokens, else the first characters of a character tokenizer's alphabet (a task's)."""
    config = train_config or {}
    on_code = "data" in config and not any(config.get(key) for key in ("data", "task", "pairs"))
    for text in PYTHON_PROMPTS * on_code + PROMPTS:
        if _encodes(tokenizer, text, limit):
            return text
    chars = getattr(tokenizer, "chars", None)
    return "".join(chars[:12]) if chars else "a"


def open_model(path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None) -> Explorer:
    """An :class:`Explorer` of a tformer run or checkpoint, a Hugging Face directory or a GGUF file."""
    from tformer.interop import is_pretrained, load_pretrained

    p = Path(path)
    if is_pretrained(p):
        pretrained = load_pretrained(p, dtype=dtype, device=device)
        model, tokenizer, gen = pretrained.model, pretrained.tokenizer, pretrained.generation
        if tokenizer is None:
            raise ExploreError(f"{path}: no tokenizer.json beside the weights; the page needs one to read text")
        start = gen.decoder_start if gen.decoder_start is not None else gen.pad
        name = p.stem if p.suffix == ".gguf" else p.name
        config = None
    else:
        from tformer.training.resume import load_newest

        ckpt = load_newest(p, map_location=device)  # a damaged newest checkpoint: names an older one, as sample does
        model, tokenizer = ckpt.model, ckpt.tokenizer
        if dtype is not None:
            model.to(dtype)
        start, name = ckpt.special_ids()[1], p.resolve().name
        config = ckpt.train_config
    if not isinstance(model, DecoderLM | EncoderDecoder):
        raise ExploreError(
            f"{path} holds an encoder ({type(model).__name__}); the page shows language models and encoder-decoders"
        )
    kind = "lm" if isinstance(model, DecoderLM) else "seq2seq"
    explorer = Explorer(accelerate(model.eval()), tokenizer, name, kind, start)
    explorer.prompt = default_prompt(tokenizer, config, explorer.max_tokens)
    return explorer


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start : err.end]), err.end


codecs.register_error("tformer.hex", _hex_bytes)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable symbol that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


_GPT2_BYTES = _gpt2_bytes()


def token_bytes(tokenizer: Any, i: int) -> bytes | None:
    """The raw bytes of token ``i`` where the tokenizer is byte-level (one byte per token; GPT-2's byte-level BPE;
    SentencePiece's ``<0xE2>`` pieces), else ``None``."""
    if getattr(tokenizer, "kind", "") == "byte":
        b = i - len(tokenizer.specials)
        return bytes([b]) if 0 <= b < 256 else None
    inner = getattr(tokenizer, "hf", None) or getattr(tokenizer, "_hf", None)
    spelled = inner.id_to_token(i) if inner is not None else None
    if not spelled:
        return None
    if match := _BYTE_PIECE.fullmatch(spelled):
        return bytes([int(match.group(1), 16)])
    if all(c in _GPT2_BYTES for c in spelled):
        return bytes(_GPT2_BYTES[c] for c in spelled)
    return None


def piece(tokenizer: Any, i: int) -> str:
    """The text of token ``i`` alone: a special token by its name; a token holding part of a UTF-8 character (a
    byte-level tokenizer's) with those bytes as ``<0xE2>`` instead of ``\\ufffd``, so distinct bytes stay distinct."""
    text = tokenizer.decode([i])
    specials = getattr(tokenizer, "specials", ())
    if "\ufffd" in text:
        raw = token_bytes(tokenizer, i)
        if raw is not None:
            return raw.decode("utf-8", errors="tformer.hex")
        if i < len(specials) and text == "\ufffd":
            return specials[i]  # a character tokenizer's <unk>
    if text == "":
        if i < len(specials):
            return specials[i]
        token = getattr(tokenizer, "token", None)
        return (token(i) if token else None) or f"<{i}>"
    return text


def encode(ex: Explorer, text: str, what: str = "prompt") -> list[int]:
    try:
        ids = list(ex.tokenizer.encode(text))
    except ValueError as err:
        raise ExploreError(f"the {what} cannot be encoded: {err}") from None
    if not ids and what == "prompt" and ex.kind == "lm" and getattr(ex.tokenizer, "bos_id", None) is not None:
        ids = [ex.tokenizer.bos_id]
    if not ids and what == "prompt":
        raise ExploreError("the prompt encodes to no tokens; type some text")
    if len(ids) > ex.max_tokens:
        raise ExploreError(f"the {what} is {len(ids)} tokens long; this page analyses at most {ex.max_tokens}")
    return ids


@dataclass
class Forward:
    """One forward pass: the token ids, the logits of the next token ``(V,)`` and each attention layer's inputs."""

    ids: list[int]
    target_ids: list[int]
    logits: Tensor
    inputs: dict[MultiHeadAttention, tuple[Tensor, Tensor | None, Tensor | None, bool]]


RECENT = 8  # forward passes kept: the page asks for every layer's map of one prompt, one request each


def forward(ex: Explorer, prompt: str, target: str = "") -> Forward:
    """The model run once on ``prompt`` (and, for a seq2seq model, the decoder on its start id + ``target``); the
    last :data:`RECENT` are kept, so the requests for each layer of one prompt share one forward pass."""
    key = (prompt, target)
    with ex.lock:
        if key in ex.recent:
            ex.recent.move_to_end(key)
            return ex.recent[key]
    result = _forward(ex, prompt, target)
    with ex.lock:
        ex.recent[key] = result
        while len(ex.recent) > RECENT:
            ex.recent.popitem(last=False)
    return result


def _forward(ex: Explorer, prompt: str, target: str) -> Forward:
    ids = encode(ex, prompt)
    target_ids = []
    if ex.kind == "seq2seq":
        target_ids = [ex.start_id if ex.start_id is not None else 0, *encode(ex, target, "target")]
        if len(target_ids) > ex.max_tokens:
            raise ExploreError(f"the target is {len(target_ids)} tokens long; at most {ex.max_tokens}")
    elif target:
        raise ExploreError("'target' is for encoder-decoder models; this is a language model")
    from tformer.experiments._common import attention_inputs

    device = next(ex.model.parameters()).device
    src = torch.tensor([ids], device=device)
    tgt = torch.tensor([target_ids], device=device)
    out: list[Tensor] = []

    def run() -> None:
        out.append(ex.model(src)[0, -1] if ex.kind == "lm" else ex.model(src, tgt)[0, -1])

    with ex.lock, torch.inference_mode():
        inputs = attention_inputs(ex.model, run)
    return Forward(ids, target_ids, out[0].float().cpu(), inputs)


def next_tokens(
    ex: Explorer,
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    top: int = TOP,
) -> list[dict[str, Any]]:
    """The ``top`` most likely next tokens at ``temperature``: ``prob`` after top-k/top-p and renormalization
    (what sampling draws from; 0 where filtered out), ``raw`` before the filters, ``kept`` whether it survives."""
    raw = apply_temperature(logits[None], temperature).softmax(-1)[0]  # (V,)
    kept = filter_logits(logits[None], temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)[0]  # (V,)
    order = raw.argsort(descending=True)[:top].tolist()
    return [
        {
            "id": i,
            "token": piece(ex.tokenizer, i),
            "prob": float(kept[i]),
            "raw": float(raw[i]),
            "kept": bool(kept[i] > 0),
        }
        for i in order
    ]


def draw(ex: Explorer, logits: Tensor, seed: int, temperature: float, top_k: int | None, top_p: float | None) -> int:
    """One token drawn as ``tformer.generate(..., seed=seed)`` draws its first: from the filtered distribution with
    a generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    filtered = filter_logits(logits[None], temperature=temperature, top_k=top_k, top_p=top_p)
    return int(sample(filtered, [generator])[0])


def queries_keys(mha: MultiHeadAttention, inputs, *, rotate: bool = True) -> tuple[Tensor, Tensor]:
    """The layer's per-head queries ``(1, H, T, D)`` and keys, expanded to ``(1, H, S, D)``, from its inputs."""
    from tformer.experiments._common import per_head_queries_keys

    x, context, _, _ = inputs
    return per_head_queries_keys(mha, x, context, rotate=rotate)


def attention_map(
    mha: MultiHeadAttention, inputs, *, scale_factor: float = 1.0, mask: str = "before"
) -> tuple[Tensor, Tensor]:
    """The layer's attention ``(H, T, S)`` (float64) with its scale ``scale_factor / sqrt(d_k)`` and the causal
    mask (for causal layers) applied ``"before"`` the softmax (the model's way), ``"after"`` it (the rows of the
    future renormalised away: they no longer sum to 1), or not at all (``"none"``); and the scores it came from."""
    q, k = queries_keys(mha, inputs)
    q, k = q[0].double(), k[0].double()
    _, _, pad_mask, causal = inputs
    scores = attention_scores(q, k, scale=scale_factor / math.sqrt(q.shape[-1]))  # (H, T, S)
    if pad_mask is not None and pad_mask.dtype == torch.bool:
        scores = scores.masked_fill(~pad_mask.reshape(-1, *pad_mask.shape[-2:])[0], float("-inf"))
    T, S = scores.shape[-2:]
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)  # (T, S): True = a later position
    if causal and mask == "before":
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(-1)
    if causal and mask == "after":
        probs = probs.masked_fill(future, 0.0)
    return probs, scores


def head_summaries(probs: Tensor) -> dict[str, list[float]]:
    """Per head: mean row entropy (nats), mean Frobenius norm of the softmax Jacobian, min and max row sum."""
    from tformer.experiments._common import entropy

    sums = probs.sum(-1)  # (H, T)
    return {
        "entropy": entropy(probs).mean(-1).tolist(),
        "jacobian_norm": softmax_jacobian_norm(probs).mean(-1).tolist(),
        "row_sum_min": sums.min(-1).values.tolist(),
        "row_sum_max": sums.max(-1).values.tolist(),
    }


def position_scores(ex: Explorer, fwd: Forward, layer: int, kind: str) -> dict[str, Any]:
    """Scores as a function of the offset ``n - m``: for RoPE, each head's mean ``q_t . R(delta) k_t`` over the
    prompt's tokens (the layer's real, unrotated projections) and the largest change when both are moved by the
    same amount; for sinusoidal positions ``PE[m] . PE[m + delta] / C`` from ``m = 0`` and from ``m = 100``."""
    cfg = ex.model.cfg
    offsets = list(range(OFFSETS + 1))
    if cfg.position == "rotary" and kind != "cross":
        mha = ex.layers(kind)[layer]
        q, k = (t[0].float() for t in queries_keys(mha, fwd.inputs[mha], rotate=False))  # (H, T, D)
        mha.rotary.reserve(2 * OFFSETS + 200)
        cos, sin = mha.rotary.cos.float(), mha.rotary.sin.float()

        def score(m: int, n: int) -> Tensor:  # (H,)
            qm = rotate_pairs(q, cos[m], sin[m], mha.rotary.interleaved)
            kn = rotate_pairs(k, cos[n], sin[n], mha.rotary.interleaved)
            return (qm * kn).sum(-1).mean(-1) / math.sqrt(q.shape[-1])

        curve = torch.stack([score(0, d) for d in offsets], -1)  # (H, offsets)
        moved = torch.stack([score(100, 100 + d) for d in offsets], -1)
        return {
            "scheme": "rotary",
            "offsets": offsets,
            "scores": curve.tolist(),
            "shift_deviation": float((moved - curve).abs().max()),
        }
    if cfg.position == "sinusoidal":
        pe = sinusoidal_positional_encoding(100 + OFFSETS + 1, cfg.d_model, dtype=torch.float64, layout=cfg.pair_layout)
        from_0 = pe[offsets] @ pe[0] / cfg.d_model
        from_100 = pe[[100 + d for d in offsets]] @ pe[100] / cfg.d_model
        return {
            "scheme": "sinusoidal",
            "offsets": offsets,
            "scores": [from_0.tolist()],
            "shift_deviation": float((from_100 - from_0).abs().max()),
        }
    if cfg.position == "learned":  # no rule to check: the mean cosine of learned rows m and m + delta, as trained
        table = (
            next(m for m in ex.model.modules() if type(m).__name__ == "LearnedPositions").table.weight.detach().float()
        )
        unit = torch.nn.functional.normalize(table, dim=-1)
        top = min(OFFSETS, table.shape[0] - 1)
        curve = [float((unit[: table.shape[0] - d] * unit[d:]).sum(-1).mean()) for d in range(top + 1)]
        return {"scheme": "learned", "offsets": offsets[: top + 1], "scores": [curve], "shift_deviation": None}
    return {"scheme": cfg.position, "offsets": [], "scores": [], "shift_deviation": None}
