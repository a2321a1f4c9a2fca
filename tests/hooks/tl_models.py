"""Tiny random Hugging Face models wrapped in TransformerLens bridges, built fully offline.

TransformerLens 4.x has no ``HookedTransformer``: ``transformer_lens.model_bridge.TransformerBridge`` wraps a
``transformers`` model and exposes HookedTransformer's hook names (``hook_embed``, ``blocks.0.attn.hook_pattern``,
``blocks.0.hook_resid_post``, ...) as aliases of its own (``embed.hook_out``, ...). Nothing here touches the hub:

* the model is built from a config object (``transformers.GPT2Config`` etc.) with random weights, seeded;
* it is booted with ``TransformerBridge.boot_transformers(name, hf_model=..., tokenizer=...)``: given a model object
  the bridge takes its config from it instead of downloading one, and given a tokenizer it loads none;
* the tokenizer is a ``tokenizers`` WordLevel vocabulary (``t0 t1 ...`` plus the family's special tokens) saved
  with ``save_pretrained`` into a temporary folder and read back with ``AutoTokenizer``. Reading it back matters:
  the bridge's ``setup_tokenizer`` re-loads any tokenizer that does not already add a BOS token, by
  ``AutoTokenizer.from_pretrained(tokenizer.name_or_path, add_bos_token=True)``; an in-memory tokenizer has no
  ``name_or_path`` (KeyError), a hub name would be a download; a local folder is neither.

The bridge replaces submodules of the model it wraps, and weight processing (``fold_ln`` and the centerings)
rewrites its parameters in place, so :func:`tl_bridge` hands the bridge a deep copy and returns the untouched
original as the reference.

By default the bridge runs in compatibility mode *without* weight processing
(``enable_compatibility_mode(no_processing=True)``): HookedTransformer's names and shapes (``hook_z`` as
``(batch, pos, head, d_head)``, ...), but the Hugging Face model's own numbers, so every activation and the logits
equal the reference model's. ``process_weights=True`` gives HookedTransformer's load-time processing instead
(``fold_ln``, ``center_writing_weights``, ``center_unembed``, ``fold_value_biases``); its logits then differ from
the reference by a per-position constant (``center_unembed``), its log-probabilities do not.

Behaviour of TransformerLens 4.3.0 worth knowing (checked on these models):

* compatibility mode changes one activation when weights are not processed: masked attention scores are
  ``-inf`` in it (HookedTransformer's convention), ``torch.finfo(dtype).min`` without it.
* ``hook_normalized`` of LayerNorm and RMSNorm excludes the norm's weight and bias (``hook_out`` includes them);
  ``hook_scale`` is ``sqrt(mean(x^2 or centered x^2) + eps)``, shape ``(batch, pos, 1)``.
* BERT (post-LN) does not follow HookedEncoder's meanings: ``hook_attn_scores`` is the softmaxed pattern,
  ``hook_embed`` is the embedding LayerNorm's output (word + position + token type, normalized),
  ``hook_attn_out`` is ``LayerNorm(resid_pre + attention)`` (the raw attention output is ``attn.o.hook_out``),
  ``hook_resid_mid`` is ``ln2``'s input (``hook_attn_out + hook_mlp_out``, after the MLP), ``hook_resid_post`` the
  block's LayerNormed output. ``mlp.hook_in`` is the MLP's input (``hook_attn_out``), but with
  ``use_hook_mlp_in`` it and ``hook_mlp_in`` fire twice, the second time with ``hook_resid_mid``, which is what a
  cache then keeps.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import transformers
from torch import nn

transformers.logging.set_verbosity_error()

FAMILIES = ("gpt2", "llama", "bert", "gpt2-small")
VOCAB = 100  # the tiny families' vocabulary (gpt2-small: GPT-2's 50257)
N_CTX = 64

# Special tokens of the WordLevel vocabulary: the first ids, before t<i>.
_SPECIALS = {
    "bert": {
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    },
    "causal": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
}


def hf_config(family: str) -> transformers.PretrainedConfig:
    """The ``transformers`` config of ``family`` (eager attention, so attention hooks can fire):

    * ``gpt2``: ``GPT2Config`` with 2 layers, d_model 64, 4 heads (d_head 16), MLP 256 (4 x 64, GELU-new),
      vocabulary 100, 64 positions; LayerNorm eps 1e-5, tied embedding/unembedding.
    * ``llama``: ``LlamaConfig`` with 2 layers, d_model 64, 4 query heads and 2 key/value heads (grouped-query
      attention, d_head 16), gated SiLU MLP of 128, vocabulary 100, 64 positions, RoPE base 10000, RMSNorm eps
      1e-6, untied unembedding, no biases.
    * ``bert``: ``BertConfig`` with 2 layers, d_model 64, 4 heads, MLP 128 (GELU), vocabulary 100, 64 positions,
      2 token types, pad id 0; post-LayerNorm encoder (eps 1e-12), for ``BertForMaskedLM``.
    * ``gpt2-small``: ``GPT2Config()``, GPT-2 small's shape: 12 layers, d_model 768, 12 heads, vocabulary 50257,
      1024 positions (for timing; about 124M parameters).
    """
    t = transformers
    if family == "gpt2":
        config = t.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=N_CTX,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        )
    elif family == "gpt2-small":
        config = t.GPT2Config()
    elif family == "llama":
        config = t.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=128,
            max_position_embeddings=N_CTX,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        )
    elif family == "bert":
        config = t.BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=128,
            max_position_embeddings=N_CTX,
            pad_token_id=0,
        )
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    config._attn_implementation = "eager"
    return config


def hf_model(family: str, seed: int = 0, unit: bool = True) -> nn.Module:
    """A fresh ``transformers`` model of ``family`` (:func:`hf_config`) in eval mode with eager attention:
    ``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``BertForMaskedLM``, built under ``torch.manual_seed(seed)``
    (the global random state is left as it was).

    ``unit`` (default) redraws every weight with ``tests.interop.hf_models.unit_scale(model, seed)``: matrices
    std ``1/sqrt(fan_in)``, embeddings std 1, norm weights ``1 + 0.5 N(0, 1)``, biases std 0.2. The class's own
    initialization (std 0.02, norm weights 1, biases 0) makes every activation tiny and every norm an identity
    affine map, which hides exactly the differences the hooks are compared for (whether a normalized value
    includes the norm's weight, whether a bias is in a per-head result). ``unit=False`` keeps it. (GPT-2's tied
    token embedding is redrawn as the unembedding, std ``1/sqrt(d_model)``; its position embedding std 1.)"""
    classes = {
        "gpt2": transformers.GPT2LMHeadModel,
        "gpt2-small": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "bert": transformers.BertForMaskedLM,
    }
    config = hf_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = classes[family](config)
    model.set_attn_implementation("eager")
    if unit:
        from tests.interop.hf_models import unit_scale

        unit_scale(model, seed)
    return model.eval()


def tiny_tokenizer(family: str, vocab_size: int = VOCAB) -> transformers.PreTrainedTokenizerBase:
    """A WordLevel tokenizer of ``vocab_size`` ids split on whitespace: the family's special tokens first
    (BERT: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` = 0..4, and a ``[CLS] ... [SEP]`` template; the causal families:
    ``<unk> <s> </s> <pad>`` = 0..3), then ``t<i>`` for the other ids. Saved in a temporary folder and read back
    with ``AutoTokenizer`` (module docstring: the bridge may re-load it from ``name_or_path``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = _SPECIALS["bert" if family == "bert" else "causal"]
    words = list(specials.values())
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if family == "bert":
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    with tempfile.TemporaryDirectory(prefix="tl-tokenizer-") as folder:
        tok.save_pretrained(folder)
        return transformers.AutoTokenizer.from_pretrained(folder)


def boot(model: nn.Module, family: str, tokenizer=None):
    """``TransformerBridge.boot_transformers`` around ``model`` itself (which the bridge then modifies) on the
    CPU, with :func:`tiny_tokenizer` unless ``tokenizer`` is given. No compatibility mode: the bridge's own
    (HF-numerics) defaults, under which the HookedTransformer aliases already resolve."""
    from transformer_lens.model_bridge import TransformerBridge

    if tokenizer is None:
        tokenizer = tiny_tokenizer(family, model.config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="tl-tokenizer-") as folder:
        # the bridge may re-load the tokenizer from its name_or_path (module docstring): keep that a local folder
        tokenizer.save_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        return TransformerBridge.boot_transformers(
            f"tiny-{family}", hf_model=model, tokenizer=tokenizer, device="cpu", dtype=next(model.parameters()).dtype
        )


def tl_bridge(
    family: str,
    seed: int = 0,
    *,
    unit: bool = True,
    compat: bool = True,
    process_weights: bool = False,
    use_attn_result: bool = False,
    use_hook_mlp_in: bool = False,
    use_split_qkv_input: bool = False,
):
    """``(reference, bridge)``: :func:`hf_model` ``(family, seed, unit)``, and a ``TransformerBridge`` around a
    deep copy of it.

    ``reference`` is a plain ``transformers`` model the bridge never touches (the bridge rewires the copy's
    submodules, and weight processing rewrites its parameters). ``compat`` calls ``enable_compatibility_mode``:
    with ``process_weights=False`` (the default) as ``no_processing=True``, so the bridge's activations and logits
    are the reference's; with ``process_weights=True`` with HookedTransformer's defaults (fold_ln,
    center_writing_weights, center_unembed, fold_value_biases; fold_ln is skipped for post-LN BERT).
    ``compat=False`` leaves the bridge as booted (the hook aliases work there too, and no weights are changed).

    The ``use_*`` flags turn on hooks that HookedTransformer also gates behind config flags:
    ``blocks.L.attn.hook_result`` (per-head attention outputs, without the output bias), ``blocks.L.hook_mlp_in``
    (the residual entering the MLP branch, before ``ln2``) and ``blocks.L.hook_{q,k,v}_input`` (the residual
    repeated per head, ``(batch, pos, heads, d_model)``; key/value heads for ``k``/``v``). BERT's bridge supports
    only ``use_hook_mlp_in``: the other two raise ``NotImplementedError``.
    """
    reference = hf_model(family, seed, unit)
    bridge = boot(copy.deepcopy(reference), family)
    if compat:
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=not process_weights)
    if use_attn_result:
        bridge.set_use_attn_result(True)
    if use_hook_mlp_in:
        bridge.set_use_hook_mlp_in(True)
    if use_split_qkv_input:
        bridge.set_use_split_qkv_input(True)
    bridge.eval()
    return reference, bridge


def random_tokens(batch: int = 2, pos: int = 12, seed: int = 0, vocab: int = VOCAB, low: int = 5) -> torch.Tensor:
    """``(batch, pos)`` token ids drawn uniformly from ``[low, vocab)`` (above the special tokens), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, pos), generator=g)
