"""Small GGUF files written with the ``gguf`` package's own writer: a tiny Llama (from a tiny ``transformers``
model, its Q and K rows permuted as llama.cpp's converter does), optionally quantized, and files with a metadata
field changed (another architecture, RoPE scaling) for the error tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tests.interop.hf_models import VOCAB
from tformer.interop.gguf import NAMES, permute

HF_TO_GGUF = {hf: g for g, hf in NAMES.items()}
# byte-level BPE of a tiny alphabet: its 61 tokens are 26 letters, "Ġ" (a space), 3 specials and 31 merges
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a 61-token byte-level BPE vocabulary."""
    merges = [f"Ġ {c}" for c in LETTERS] + ["t h", "Ġ th", "e r", "i n", "a n"]
    tokens = [*SPECIALS, "Ġ", *LETTERS] + [m.replace(" ", "") for m in merges]
    assert len(tokens) == VOCAB
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3: control (special) tokens
    return tokens, merges, types


def write_llama_gguf(
    path: Path,
    hf_model,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    arch: str = "llama",
    rope_scaling: str | None = None,
    rope_factor: float | None = None,
    chat_template: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """``hf_model`` (a tiny ``LlamaForCausalLM``) as a GGUF file at ``path``; matrices stored as ``qtype``;
    ``tokenizer=False``: no tokenizer metadata and no vocabulary size (only the embedding's rows tell it)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer:
        w.add_vocab_size(cfg.vocab_size)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    if rope_factor is not None:
        w.add_rope_scaling_factor(rope_factor)
    if tokenizer:
        tokens, merges, types = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        base = name.split(".", 3)[3] if layer is not None else name
        g = HF_TO_GGUF[base]
        if base == "self_attn.q_proj.weight":
            tensor = permute(tensor, cfg.num_attention_heads)
        elif base == "self_attn.k_proj.weight":
            tensor = permute(tensor, cfg.num_key_value_heads)
        array = tensor.detach().to(torch.float32).numpy()
        target = f"blk.{layer}.{g}" if layer is not None else g
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(target, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
