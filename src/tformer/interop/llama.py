"""The Llama family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``): pre-RMSNorm blocks, a SwiGLU
feed-forward, rotate-half RoPE of base ``rope_theta``, grouped-query attention, a tied or untied head; Qwen2 adds
biases to the q, k, v projections only.

q, k, v (and the gate and up projections) are separate HF tensors, concatenated into tformer's ``in_proj`` (and
``ff.up``). Refused by name: RoPE scaling of any type but the default, sliding-window attention, a ``head_dim`` other
than ``hidden_size / num_attention_heads``, biases tformer cannot place.
"""

from __future__ import annotations

from typing import Any

from tformer.config import TransformerConfig
from tformer.interop.family import (
    Family,
    GenerationIds,
    activation,
    differences,
    head_dim_must_split,
    refuse,
    reverse_activation,
    setting,
)
from tformer.interop.keys import InteropError, Key, KeyTable, per_layer

L = "model.layers.{i}."
B = "decoder.stack.blocks.{i}."


def rope_theta(hf: dict[str, Any], source: str) -> float:
    """The RoPE base: ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta`` (4); only the default
    (unscaled) RoPE is supported."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    # either block may ask for scaling (transformers 5 reads rope_scaling beside a default rope_parameters too)
    kinds = {block.get(key) for block in (params, scaling) for key in ("rope_type", "type")} - {None, "default"}
    kind = ", ".join(sorted(map(str, kinds))) or "default"
    refuse(kind != "default", source, "rope_type", kind, "tformer implements the unscaled RoPE only")
    factor = next((b["factor"] for b in (params, scaling) if b.get("factor") not in (None, 1, 1.0)), None)
    refuse(factor is not None, source, "rope_scaling.factor", factor, "tformer implements the unscaled RoPE only")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise InteropError(f"{source}: rope_theta={theta!r} must be a number > 1 (the RoPE base, e.g. 10000)")
    return float(theta)


def _flag(hf: dict[str, Any], name: str, source: str) -> bool:
    """A true/false setting (default false); a string such as ``"false"`` would read as true."""
    value = hf.get(name, False)
    if not isinstance(value, bool):
        raise InteropError(f"{source}: {name}={value!r} must be true or false")
    return value


class Llama(Family):
    name, architecture, model_types, kind = "llama", "LlamaForCausalLM", ("llama",), "lm"

    def config(self, hf: dict[str, Any], source: str) -> TransformerConfig:
        d_model, heads = setting(hf, "hidden_size", source), setting(hf, "num_attention_heads", source)
        head_dim_must_split(hf, d_model, heads, source)
        qkv_bias, bias = self._biases(hf, source)
        self._sliding_window(hf, source)
        return TransformerConfig(
            vocab_size=setting(hf, "vocab_size", source),
            d_model=d_model,
            num_heads=heads,
            num_kv_heads=setting(hf, "num_key_value_heads", source, heads),
            num_layers=setting(hf, "num_hidden_layers", source),
            d_ff=setting(hf, "intermediate_size", source),
            max_seq_len=setting(hf, "max_position_embeddings", source, 2048),
            position="rotary",
            pair_layout="half",
            rope_base=rope_theta(hf, source),
            norm="rms",
            ffn="gated",
            activation=activation(hf, "hidden_act", source, "silu"),
            layer_norm_eps=setting(hf, "rms_norm_eps", source, 1e-6),
            norm_first=True,
            bias=bias,
            qkv_bias=qkv_bias,
            tie_embeddings=_flag(hf, "tie_word_embeddings", source),
        )

    def _biases(self, hf: dict[str, Any], source: str) -> tuple[bool | None, bool]:
        """``(qkv_bias, bias)``: Llama's ``attention_bias`` covers q, k, v and o, ``mlp_bias`` the feed-forward."""
        attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        refuse(
            attention != mlp,
            source,
            "attention_bias",
            attention,
            f"with mlp_bias={mlp}: tformer's output projection and feed-forward share one bias setting",
        )
        return None, attention

    def _sliding_window(self, hf: dict[str, Any], source: str) -> None:
        # Even a window as long as max_position_embeddings is refused: tformer's rotary models run past that length
        # (a longer prompt is noted, not cut), where transformers' window would start to drop keys.
        window = hf.get("sliding_window")
        refuse(
            window is not None,
            source,
            "sliding_window",
            window,
            "tformer's attention sees every earlier position, at any length (a model trained with full attention "
            "may set it to null)",
        )

    def keys(self, cfg: TransformerConfig) -> KeyTable:
        kv = cfg.kv_heads * cfg.head_dim
        qkv = (L + "self_attn.q_proj", L + "self_attn.k_proj", L + "self_attn.v_proj")
        layer = [
            Key(B + "self_attn.in_proj.weight", tuple(n + ".weight" for n in qkv), (cfg.d_model, kv, kv)),
            Key(B + "self_attn.out_proj.weight", (L + "self_attn.o_proj.weight",)),
            Key(B + "self_attn_norm.weight", (L + "input_layernorm.weight",)),
            Key(B + "ff.up.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), (cfg.d_ff, cfg.d_ff)),
            Key(B + "ff.down.weight", (L + "mlp.down_proj.weight",)),
            Key(B + "ff_norm.weight", (L + "post_attention_layernorm.weight",)),
        ]
        if cfg.qkv_bias if cfg.qkv_bias is not None else cfg.bias:
            layer.append(Key(B + "self_attn.in_proj.bias", tuple(n + ".bias" for n in qkv), (cfg.d_model, kv, kv)))
        if cfg.bias:
            layer += [
                Key(B + "self_attn.out_proj.bias", (L + "self_attn.o_proj.bias",)),
                Key(B + "ff.up.bias", (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"), (cfg.d_ff, cfg.d_ff)),
                Key(B + "ff.down.bias", (L + "mlp.down_proj.bias",)),
            ]
        keys = [
            Key("decoder.embed.tokens.weight", ("model.embed_tokens.weight",)),
            *per_layer(cfg.num_layers, layer),
            Key("decoder.stack.final_norm.weight", ("model.norm.weight",)),
        ]
        aliases = {}
        if cfg.tie_embeddings:
            aliases["lm_head.weight"] = "model.embed_tokens.weight"
        else:
            keys.append(Key("head.weight", ("lm_head.weight",)))
        return KeyTable(keys, ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",), aliases=aliases)

    def mismatches(self, cfg: TransformerConfig) -> list[str]:
        shape = dict(
            position="rotary",
            pair_layout="half",
            norm="rms",
            ffn="gated",
            norm_first=True,
            type_vocab_size=0,
            embed_norm=False,
            embed_scale=(None, False),
            logits_bias=False,
            pooler=False,
        )
        return differences(cfg, {**shape, **self._bias_shape(cfg)}, self.architecture.removesuffix("ForCausalLM"))

    def _bias_shape(self, cfg: TransformerConfig) -> dict[str, Any]:
        """Llama: attention_bias (q, k, v, o) and mlp_bias together: all biases or none."""
        return {"qkv_bias": (None, cfg.bias), "bias": (False, True)}

    def hf_config(self, cfg: TransformerConfig, generation: GenerationIds) -> dict[str, Any]:
        return {
            "model_type": self.model_types[0],
            "architectures": [self.architecture],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "num_hidden_layers": cfg.num_layers,
            "intermediate_size": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},  # transformers 5
            "rope_theta": cfg.rope_base,  # transformers 4 reads this one (without it: its default, 10000)
            "hidden_act": reverse_activation(cfg.activation),
            "rms_norm_eps": cfg.layer_norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_dropout": cfg.dropout,
            "bos_token_id": generation.bos,
            "eos_token_id": list(generation.eos) if len(generation.eos) > 1 else generation.eos_id,
            "pad_token_id": generation.pad,
            **self._extra_hf_config(cfg),
        }

    def _extra_hf_config(self, cfg: TransformerConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}


class Qwen2(Llama):
    """Qwen2: biases on q, k, v only; sliding windows only with ``use_sliding_window``."""

    name, architecture, model_types = "qwen2", "Qwen2ForCausalLM", ("qwen2",)

    def _biases(self, hf: dict[str, Any], source: str) -> tuple[bool | None, bool]:
        return True, False

    def _sliding_window(self, hf: dict[str, Any], source: str) -> None:
        used = bool(hf.get("use_sliding_window", False))
        refuse(used, source, "use_sliding_window", used, "tformer's attention sees every earlier position")

    def _bias_shape(self, cfg: TransformerConfig) -> dict[str, Any]:
        return {"qkv_bias": True, "bias": False}

    def _extra_hf_config(self, cfg: TransformerConfig) -> dict[str, Any]:
        return {"use_sliding_window": False}


class Mistral(Llama):
    """Mistral: Llama's blocks; ``sliding_window`` must be off (``null``)."""

    name, architecture, model_types = "mistral", "MistralForCausalLM", ("mistral",)

    def _biases(self, hf: dict[str, Any], source: str) -> tuple[bool | None, bool]:
        return None, False

    def _bias_shape(self, cfg: TransformerConfig) -> dict[str, Any]:
        return {"qkv_bias": (None, False), "bias": False}

    def _extra_hf_config(self, cfg: TransformerConfig) -> dict[str, Any]:
        return {"sliding_window": None}
