"""``attention-maps``: the three attentions of an encoder-decoder, seen in a model trained to reverse sequences.

Claim (source, Q3(c)): "1. Encoder self-attention: Q, K, V all from the encoder input sequence. 2. Decoder masked
self-attention: Q, K, V all from the (partial) decoder sequence, causally masked. 3. Encoder-decoder
cross-attention: Q from the decoder, K and V from the encoder output."

Measured on a :class:`tformer.EncoderDecoder` trained on the built-in ``reverse`` task by :func:`tformer.train` (the
settings of ``tformer demo``, :func:`tformer.training.demos.reverse_config`, at smaller sizes): forward pre-hooks record
what each attention layer receives (checking that the cross-attention's keys/values come from the encoder output), and
the weights are recomputed from the layer's own projections with :func:`tformer.functional.attention_weights`. On
held-out sources of length S, decoder position i (reading ``BOS y_1 .. y_i``) predicts ``y_{i+1} = x_{S-1-i}``, so a
cross-attention that has learned the task puts its mass on the anti-diagonal ``(i, S-1-i)``: the fraction of mass there
is the figure, averaged over the held-out sources of length S (never trained on). The decoder self-attention's mass on
future positions must be exactly 0.

Shapes: B, T, S, C, H (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tformer.experiments._common import Table, fmt, layer_attention_probs, new_figure, save_figure, single_thread
from tformer.layers import MultiHeadAttention
from tformer.models import EncoderDecoder
from tformer.training.datasets import task_held_out
from tformer.training.demos import reverse_config
from tformer.training.tasks import SequenceTask
from tformer.training.trainer import train

QUESTION = "Q3(c)"
TITLE = "The three attentions of an encoder-decoder"
CLAIM = (
    "Encoder self-attention: Q, K, V all from the encoder input. Decoder masked self-attention: Q, K, V from the "
    "partial decoder sequence, causally masked. Cross-attention: Q from the decoder, K and V from the encoder "
    "output. (Trained to reverse a sequence, target position i should attend source position S-1-i.)"
)
SIZES: dict[str, dict] = {
    "quick": dict(steps=300, max_len=6, d_model=32, num_heads=2, num_layers=1, d_ff=64, held_out=400),
    "report": dict(steps=1200, max_len=8, d_model=64, num_heads=4, num_layers=2, d_ff=256, held_out=600),
}


@dataclass
class AttentionMapsResult:
    """Mean attention maps over held-out sources of length ``seq_len`` (decoder length ``seq_len + 1``)."""

    steps: int
    seconds: float
    final_loss: float
    accuracy: float  # held-out exact match of greedy decodes
    seq_len: int
    encoder_self: Tensor  # (layers, H, S, S)
    decoder_self: Tensor  # (layers, H, S+1, S+1)
    cross: Tensor  # (layers, H, S+1, S)
    anti_diagonal: list[list[float]]  # [layer][head]: mean weight on (i, S-1-i), i < S
    anti_diagonal_head_mean: list[float]  # [layer]: the same for the head-averaged map
    decoder_future_mass: float  # largest decoder self-attention weight on a key after its query
    cross_context_error: float  # max |cross-attention context - encoder output|

    @property
    def best_anti_diagonal(self) -> float:
        """The anti-diagonal mass of the layer whose head-averaged cross-attention is most anti-diagonal."""
        return max(self.anti_diagonal_head_mean)

    def tables(self) -> list[Table]:
        rows = tuple(
            (str(layer), fmt(mean), ", ".join(fmt(v) for v in heads))
            for layer, (mean, heads) in enumerate(zip(self.anti_diagonal_head_mean, self.anti_diagonal, strict=True))
        )
        return [
            Table(
                ("decoder layer", "heads averaged", "each head"),
                rows,
                f"Cross-attention mass on the anti-diagonal (i, S-1-i), S = {self.seq_len} "
                f"(uniform attention would give {fmt(1 / self.seq_len)})",
            )
        ]

    def findings(self) -> list[str]:
        best = max(range(len(self.anti_diagonal_head_mean)), key=lambda i: self.anti_diagonal_head_mean[i])
        return [
            f"cross-attention mass on the anti-diagonal (i, S-1-i): {fmt(self.best_anti_diagonal)} in decoder layer "
            f"{best} (heads averaged; best single head {fmt(max(self.anti_diagonal[best]))}; uniform would be "
            f"{fmt(1 / self.seq_len)})",
            f"trained {self.steps} steps in {self.seconds:.0f} s (final loss {fmt(self.final_loss)}); held-out "
            f"exact-match accuracy {100 * self.accuracy:.1f}%",
            f"cross-attention keys/values come from the encoder output (max |context - encoder output| = "
            f"{fmt(self.cross_context_error)}); decoder self-attention weight on future positions: "
            f"{fmt(self.decoder_future_mass)}",
        ]

    def plot(self, out_dir: Path) -> list[Path]:
        best = max(range(len(self.anti_diagonal_head_mean)), key=lambda i: self.anti_diagonal_head_mean[i])
        head = max(range(len(self.anti_diagonal[best])), key=lambda h: self.anti_diagonal[best][h])
        fig, axes = new_figure(ncols=4, size=(3.1, 3.0))
        S = self.seq_len
        panels = (
            (axes[0, 0], self.encoder_self[0].mean(0), "encoder self-attn, layer 0", "source j", "source i"),
            (axes[0, 1], self.decoder_self[0].mean(0), "decoder masked self-attn, layer 0", "target j", "target i"),
            (axes[0, 2], self.cross[best].mean(0), f"cross-attn, layer {best}, heads averaged", "source j", "target i"),
            (axes[0, 3], self.cross[best, head], f"cross-attn, layer {best}, head {head}", "source j", "target i"),
        )
        for ax, weights, title, xlabel, ylabel in panels:
            im = ax.imshow(weights.numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(title, fontsize=7)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.yaxis.get_major_locator().set_params(integer=True)
            fig.colorbar(im, ax=ax, fraction=0.046)
        for ax in axes[0, 2:]:
            ax.plot([S - 1, 0], [0, S - 1], "r:", lw=1)  # the anti-diagonal j = S-1-i
        return [save_figure(fig, out_dir, "attention-maps")]


def _record_inputs(modules: list[MultiHeadAttention]) -> tuple[list[dict[str, Any]], list]:
    """Forward pre-hooks storing each call's arguments by name (as ``MultiHeadAttention.forward`` binds them)."""
    signature = inspect.signature(MultiHeadAttention.forward)
    calls: list[dict[str, Any]] = [{} for _ in modules]

    def hook(index: int):
        def record(module, args, kwargs):
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            calls[index] = dict(bound.arguments)

        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    return calls, handles


@torch.no_grad()
def attention_maps(model: EncoderDecoder, src: Tensor, tgt_in: Tensor) -> dict[str, Any]:
    """Per-layer attention weights ``(B, H, T, S)`` of the encoder self-, decoder self- and cross-attention
    for one teacher-forced batch ``src (B, S)``, ``tgt_in (B, T)`` without padding; plus the encoder output."""
    enc_blocks, dec_blocks = model.encoder.stack.blocks, model.decoder.stack.blocks
    groups = {
        "encoder_self": [b.self_attn for b in enc_blocks],
        "decoder_self": [b.self_attn for b in dec_blocks],
        "cross": [b.cross_attn for b in dec_blocks],
    }
    recorded, handles = {}, []
    for name, modules in groups.items():
        recorded[name], hs = _record_inputs(modules)
        handles += hs
    try:
        memory = model.encode(src)  # (B, S, C)
        model.decode(tgt_in, memory)
    finally:
        for h in handles:
            h.remove()
    maps: dict[str, Any] = {"memory": memory}
    for name, modules in groups.items():
        maps[name] = [
            layer_attention_probs(
                m, call["x"], call["context"], call["attn_mask"], call["is_causal"], positions=call["positions"]
            )
            for m, call in zip(modules, recorded[name], strict=True)
        ]
        maps[f"{name}_context"] = [call["context"] for call in recorded[name]]
    return maps


def anti_diagonal_mass(cross: Tensor) -> Tensor:
    """Mean weight on ``(i, S-1-i)`` for ``i < S`` of ``cross (..., S+1, S)``; shape ``cross.shape[:-2]``."""
    S = cross.shape[-1]
    rows = torch.arange(S)
    return cross[..., rows, S - 1 - rows].mean(-1)  # (..., S) -> (...)


def run(
    steps: int = 1000,
    max_len: int = 6,
    d_model: int = 32,
    num_heads: int = 2,
    num_layers: int = 1,
    d_ff: int = 64,
    batch_size: int = 64,
    lr: float = 3e-3,
    held_out: int = 400,
    seed: int = 0,
) -> AttentionMapsResult:
    """Train on ``reverse`` (source lengths ``1..max_len``, ``held_out`` sources held out); measure the maps on the
    held-out sources of length max_len."""
    model = dict(d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff)
    cfg = reverse_config(
        "reverse",
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        held_out=held_out,
        max_len=max_len,
        model=model,
        progress=False,
    )
    with single_thread():
        result = train(cfg)
    fixed = SequenceTask("reverse", min_len=max_len, max_len=max_len)
    map_sources = [s for s in task_held_out(cfg) if len(s) == max_len]  # all of length S: no padding
    if not map_sources:
        raise ValueError(f"no held-out source has {max_len} symbols; raise held_out (now {held_out})")
    src, _, tgt, _ = fixed.collate(map_sources)
    maps = attention_maps(result.model, src, tgt[:, :-1])  # decoder reads BOS y_1 .. y_S
    cross = torch.stack([m.mean(0) for m in maps["cross"]])  # (layers, H, S+1, S)
    decoder_self = torch.stack([m.mean(0) for m in maps["decoder_self"]])  # (layers, H, S+1, S+1)
    future = torch.triu(torch.ones(max_len + 1, max_len + 1, dtype=torch.bool), 1)
    context_error = max(float((c - maps["memory"]).abs().max()) for c in maps["cross_context"])
    return AttentionMapsResult(
        steps=steps,
        seconds=result.seconds,
        final_loss=result.final_loss,
        accuracy=result.val_accuracy,
        seq_len=max_len,
        encoder_self=torch.stack([m.mean(0) for m in maps["encoder_self"]]),
        decoder_self=decoder_self,
        cross=cross,
        anti_diagonal=anti_diagonal_mass(cross).tolist(),
        anti_diagonal_head_mean=anti_diagonal_mass(cross.mean(1)).tolist(),
        decoder_future_mass=float(torch.stack([m[..., future] for m in maps["decoder_self"]]).abs().max()),
        cross_context_error=context_error,
    )
