"""Each family computes what ``transformers`` computes: logits (BERT: last hidden states) of a padded batch agree in
float32 within 1e-4 on the real positions, against both its eager and its sdpa attention; and flipping one detail
of tformer's model (GELU variant, epsilon, RoPE pair layout, grouped-query mapping, sinusoid layout, embedding
scale) makes the comparison fail, so that the agreement is evidence about that detail."""

from __future__ import annotations

import pytest
import torch

from tests.interop.hf_models import CASES, KIND, TOL, batch, ours, real_error, theirs, tiny_hf
from tformer import DecoderLM, Encoder, EncoderDecoder
from tformer.interop import load_pretrained

CLASSES = {"lm": DecoderLM, "encoder": Encoder, "seq2seq": EncoderDecoder}
CONTROL_MIN = 2 * TOL  # a flipped detail must miss by twice the tolerance (the subtlest, the GELU variant, by ~5e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES)
def test_outputs_equal_transformers_on_a_padded_batch(saved, case, attn):
    s = saved(case)
    s.hf.set_attn_implementation(attn)
    pretrained = load_pretrained(s.path)
    b = batch(s.kind)
    assert type(pretrained.model) is CLASSES[s.kind]
    assert real_error(s.kind, b, ours(pretrained.model, s.kind, b), theirs(s.hf, s.kind, b)) < TOL


def rebuilt(model, **changes):
    """``model`` with its config changed (same weights): the negative control's model."""
    other = type(model)(model.cfg.replace(**changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


def control_error(s, model) -> float:
    b = batch(s.kind)
    return real_error(s.kind, b, ours(model, s.kind, b), theirs(s.hf, s.kind, b))


@pytest.mark.parametrize(
    ("case", "changes"),
    [
        ("gpt2", {"activation": "gelu"}),  # GPT-2's GELU is the tanh approximation
        ("llama", {"pair_layout": "interleaved"}),  # Llama's RoPE rotates halves, not neighbours
        ("llama", {"rope_base": 10000.0}),  # the file's rope_theta (500) is read
        ("marian", {"pair_layout": "interleaved"}),  # Marian's sinusoid is [sin | cos], not interleaved
        ("marian", {"embed_scale": False}),  # Marian scales its embeddings by sqrt(d_model)
        ("marian", {"activation": "gelu"}),  # the configured activation (swish here)
    ],
)
def test_flipping_one_detail_breaks_the_agreement(saved, case, changes):
    s = saved(case)
    s.hf.set_attn_implementation("eager")
    model = load_pretrained(s.path).model
    assert control_error(s, model) < TOL
    assert control_error(s, rebuilt(model, **changes)) > CONTROL_MIN


def test_qwen2s_qkv_biases_are_used(saved):
    s = saved("qwen2")
    s.hf.set_attn_implementation("eager")
    model = load_pretrained(s.path).model
    with torch.no_grad():  # as if the key table had dropped them
        for block in model.decoder.stack.blocks:
            block.self_attn.in_proj.bias.zero_()
    assert control_error(s, model) > CONTROL_MIN


@pytest.mark.parametrize(("case", "eps"), [("bert", 1e-5), ("llama", 1e-6)])
def test_a_wrong_norm_epsilon_is_seen_with_tiny_activations(tmp_path, case, eps):
    """With embeddings of std 1e-3 the first norm's input variance (~1e-6) is comparable to epsilon: BERT's 1e-12
    (or this Llama's 1e-5) must be the one used."""
    hf = tiny_hf(case, embedding_std=1e-3)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path).model
    s = type("S", (), {"hf": hf, "kind": KIND.get(case, "lm")})
    assert control_error(s, model) < TOL
    assert control_error(s, rebuilt(model, layer_norm_eps=eps)) > CONTROL_MIN


def test_the_grouped_query_mapping_is_hugging_faces(saved):
    """Query head h reads key/value head h // (H / KV) (``repeat_interleave``); with the tiled mapping h % KV,
    simulated by permuting the query heads and the output projection's columns alike, the logits differ."""
    s = saved("llama")
    s.hf.set_attn_implementation("eager")
    model = load_pretrained(s.path).model
    cfg = model.cfg
    H, KV, D = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    # head j of the permuted model is head perm[j] of the original one and reads kv head j // (H // KV);
    # choosing perm so that perm[j] % KV == j // (H // KV) makes original head h read kv head h % KV
    perm = sorted(range(H), key=lambda h: (h % KV, h))
    rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in perm])
    with torch.no_grad():
        for block in model.decoder.stack.blocks:
            attn = block.self_attn
            attn.in_proj.weight[: H * D] = attn.in_proj.weight[: H * D][rows].clone()
            attn.out_proj.weight[:] = attn.out_proj.weight[:, rows].clone()
    assert perm != list(range(H))
    assert control_error(s, model) > CONTROL_MIN


@pytest.mark.parametrize("head", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_files_with_a_task_head_or_without_a_pooler_load_as_their_encoder(tmp_path, head):
    """BertForMaskedLM has no pooler (it was "pooler.dense.weight is missing"); a classifier head was "has no place"."""
    import transformers

    encoder = tiny_hf("bert")
    model = getattr(transformers, head)(encoder.config).eval()
    model.bert.load_state_dict(encoder.state_dict(), strict=False)  # the same encoder weights (and pooler, if any)
    model.save_pretrained(tmp_path)
    pretrained = load_pretrained(tmp_path)
    assert pretrained.model.cfg.pooler == (head != "BertForMaskedLM")
    b = batch("encoder")
    assert real_error("encoder", b, ours(pretrained.model, "encoder", b), theirs(model.bert, "encoder", b)) < TOL
