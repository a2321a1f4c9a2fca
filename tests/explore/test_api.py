"""The explorer's JSON API: its numbers equal tformer's own functions on the same model (a decoder-only LM with RoPE
and grouped-query heads, and an encoder-decoder), and bad requests get one-line 4xx errors."""

from __future__ import annotations

import math

import pytest
import torch

from tformer import generate
from tformer.functional import attention_weights, softmax_jacobian, softmax_jacobian_norm
from tformer.generation.sampling import filter_logits
from tformer.training.checkpoint import load_checkpoint

PROMPT = "the quick brown fox jumps"
FLOAT32 = 1e-5  # the page's float32 forward against an independent float32 recomputation


def test_info_describes_the_model(lm_client):
    status, info = lm_client.request("GET", "/api/info")
    assert status == 200
    assert info["kind"] == "lm" and info["layers"] == {"self": 2} and (info["heads"], info["kv_heads"]) == (4, 2)
    assert info["dtype"] == "float32"  # the checkpoint's; --dtype bfloat16 shows as "bfloat16" (test_server)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.6}])
def test_next_token_probabilities_are_generates_filters(lm_client, lm_checkpoint, sampling):
    status, out = lm_client.post("/api/analyze", {"prompt": PROMPT, **sampling})
    assert status == 200
    ckpt = load_checkpoint(lm_checkpoint)
    ids = ckpt.tokenizer.encode(PROMPT)
    assert out["ids"] == ids and "".join(out["tokens"]) == PROMPT
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids]))[0, -1]
    args = {"temperature": 1.0, "top_k": None, "top_p": None, **sampling}
    expected = filter_logits(logits[None], **args).softmax(-1)[0]
    raw = (logits / args["temperature"]).softmax(-1)
    assert [n["id"] for n in out["next"]] == raw.argsort(descending=True)[:20].tolist()
    for n in out["next"]:
        assert n["prob"] == pytest.approx(float(expected[n["id"]]), abs=FLOAT32)
        assert n["raw"] == pytest.approx(float(raw[n["id"]]), abs=FLOAT32)
        assert n["kept"] == (float(expected[n["id"]]) > 0)
    if sampling.get("top_k"):
        assert sum(n["kept"] for n in out["next"]) == sampling["top_k"]
    if int((expected > 0).sum()) <= 20:  # every surviving token is listed: renormalised, they sum to 1
        assert sum(n["prob"] for n in out["next"] if n["kept"]) == pytest.approx(1.0, abs=1e-5)
    assert len(out["layers"]["self"]) == 2 and all(len(layer["entropy"]) == 4 for layer in out["layers"]["self"])


def test_sample_draws_what_generate_draws_with_the_same_seed(lm_client, lm_checkpoint):
    ckpt = load_checkpoint(lm_checkpoint)
    ids = ckpt.tokenizer.encode(PROMPT)
    for seed in (0, 1, 7):
        status, out = lm_client.post("/api/sample", {"prompt": PROMPT, "seed": seed, "temperature": 1.5, "top_k": 8})
        assert status == 200
        expected = generate(ckpt.model, [ids], max_new_tokens=1, seed=seed, temperature=1.5, top_k=8)[0][0]
        assert out["id"] == expected and out["prompt"] == PROMPT + ckpt.tokenizer.decode([expected])


def layer0_queries_keys(model, ids):
    """Layer 0's queries and keys recomputed by hand: embeddings, the Pre-LN norm, the q/k rows of in_proj, RoPE."""
    stack = model.decoder if hasattr(model, "decoder") and not hasattr(model, "encoder") else model.encoder
    block, T = stack.stack.blocks[0], ids.shape[1]
    x = stack.embed(ids, torch.arange(T))
    h = block.self_attn_norm(x) if block.norm_first else x
    mha = block.self_attn
    C, D = mha.d_model, mha.head_dim
    q = (h @ mha.in_proj.weight[:C].T + mha.in_proj.bias[:C]).view(1, T, -1, D).transpose(1, 2)
    kv = mha.num_kv_heads * D
    k = (h @ mha.in_proj.weight[C : C + kv].T + mha.in_proj.bias[C : C + kv]).view(1, T, -1, D).transpose(1, 2)
    if stack.rotary is not None:
        angles = stack.rotary(torch.arange(T))
        q, k = stack.rotary.rotate(q, angles), stack.rotary.rotate(k, angles)
    return q, k.repeat_interleave(mha.num_heads // mha.num_kv_heads, dim=1)


def test_attention_weights_equal_functional_attention_weights(lm_client, lm_checkpoint):
    ckpt = load_checkpoint(lm_checkpoint)
    ids = torch.tensor([ckpt.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        q, k = layer0_queries_keys(ckpt.model, ids)
        expected = attention_weights(q, k, is_causal=True)[0]  # (H, T, T)
    status, out = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 0})
    assert status == 200 and out["causal"] is True and out["kind"] == "self"
    weights = torch.tensor(out["weights"])
    assert weights.shape == (4, len(PROMPT), len(PROMPT))
    assert (weights - expected).abs().max() < FLOAT32
    for layer in (0, 1):
        w = torch.tensor(lm_client.post("/api/attention", {"prompt": PROMPT, "layer": layer})[1]["weights"])
        assert torch.allclose(w.sum(-1), torch.ones(4, len(PROMPT)), atol=1e-6)  # every row sums to 1
        assert torch.equal(w.triu(1), torch.zeros_like(w))  # and is 0 above the diagonal


def test_the_mechanism_switches(lm_client):
    T = len(PROMPT)
    _, after = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 1, "mask": "after"})
    sums = torch.tensor(after["weights"]).sum(-1)  # (H, T): the leak, rows of the future's mass removed
    assert (sums <= 1 + 1e-6).all() and sums[:, :-1].mean() < 0.9  # rows with a future lose its share
    assert torch.allclose(sums[:, -1], torch.ones(4), atol=1e-6)  # the last row has no future: still 1
    assert min(after["row_sum_min"]) < 0.999
    _, none = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 1, "mask": "none"})
    assert torch.tensor(none["weights"]).triu(1).max() > 0  # the future is visible
    _, flat = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 1, "scale_factor": 0})
    uniform = sum(math.log(i + 1) for i in range(T)) / T  # scale 0: every causal row uniform
    assert flat["entropy"] == pytest.approx([uniform] * 4, abs=1e-9)
    _, normal = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 1})
    _, sharp = lm_client.post("/api/attention", {"prompt": PROMPT, "layer": 1, "scale_factor": 8})
    assert all(s < n for s, n in zip(sharp["entropy"], normal["entropy"], strict=True))  # saturation
    assert normal["scale"] == pytest.approx(1 / math.sqrt(8))


def test_softmax_jacobian_norm_is_the_norm_of_the_jacobian():
    probs = torch.rand(3, 5, 7, dtype=torch.float64).softmax(-1)
    full = softmax_jacobian(probs).flatten(-2).norm(dim=-1)
    assert (softmax_jacobian_norm(probs) - full).abs().max() < 1e-12
    assert softmax_jacobian_norm(torch.eye(4, dtype=torch.float64)).abs().max() < 1e-12  # saturated: no gradient


def test_rope_scores_depend_on_the_offset_only(lm_client):
    status, out = lm_client.post("/api/positions", {"prompt": PROMPT, "layer": 1})
    assert status == 200 and out["scheme"] == "rotary"
    assert len(out["scores"]) == 4 and len(out["offsets"]) == len(out["scores"][0]) == 65
    assert out["shift_deviation"] < 1e-4


def test_the_three_attention_types_of_an_encoder_decoder(seq2seq_client, seq2seq_checkpoint):
    status, info = seq2seq_client.request("GET", "/api/info")
    assert info["kinds"] == ["encoder", "decoder", "cross"]
    body = {"prompt": "hello world", "target": "dlrow"}
    ckpt = load_checkpoint(seq2seq_checkpoint)
    src = torch.tensor([ckpt.tokenizer.encode("hello world")])
    with torch.no_grad():
        q, k = layer0_queries_keys(ckpt.model, src)
        expected = attention_weights(q, k)[0]
    _, enc = seq2seq_client.post("/api/attention", {**body, "layer": 0, "kind": "encoder"})
    assert enc["causal"] is False and (torch.tensor(enc["weights"]) - expected).abs().max() < FLOAT32
    _, dec = seq2seq_client.post("/api/attention", {**body, "layer": 0, "kind": "decoder"})
    _, cross = seq2seq_client.post("/api/attention", {**body, "layer": 0, "kind": "cross"})
    T, S = 1 + len("dlrow"), len("hello world")  # the decoder starts from its start token
    assert torch.tensor(dec["weights"]).shape == (2, T, T) and dec["causal"] is True
    assert torch.tensor(cross["weights"]).shape == (2, T, S) and cross["keys"] == list("hello world")
    for w in (dec, cross):
        assert torch.allclose(torch.tensor(w["weights"]).sum(-1), torch.ones(2, T), atol=1e-6)
    _, analysis = seq2seq_client.post("/api/analyze", body)
    with torch.no_grad():
        tgt = torch.tensor([[ckpt.tokenizer.bos_id, *ckpt.tokenizer.encode("dlrow")]])
        probs = ckpt.model(src, tgt)[0, -1].softmax(-1)
    assert analysis["next"][0]["id"] == int(probs.argmax())
    assert analysis["next"][0]["prob"] == pytest.approx(float(probs.max()), abs=FLOAT32)
    assert set(analysis["layers"]) == {"encoder", "decoder", "cross"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "abc", "layer": 5}, "layer must be in [0, 2)"),
        ({"prompt": "abc", "layer": 0, "kind": "cross"}, "kind must be one of self"),
        ({"prompt": "abc", "layer": 0, "mask": "later"}, "mask must be one of before, after, none"),
        ({"prompt": "abc", "layer": "0"}, "layer must be int"),
        ({"prompt": "abc", "layer": True}, "layer must be int"),
        ({"layer": 0}, "missing field 'prompt'"),
        ({"prompt": "abc", "layer": 0, "colour": 1}, "unknown field(s) colour"),
        ({"prompt": "ABC", "layer": 0}, "cannot be encoded"),
        ({"prompt": "", "layer": 0}, "encodes to no tokens"),
        ({"prompt": "a" * 513, "layer": 0}, "at most 512"),
    ],
)
def test_bad_attention_requests_get_a_one_line_400(lm_client, body, message):
    status, out = lm_client.post("/api/attention", body)
    assert status == 400 and message in out["error"] and "\n" not in out["error"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "abc", "temperature": 0}, "temperature must be a finite number > 0"),
        ({"prompt": "abc", "top_k": 0}, "top_k must be >= 1"),
        ({"prompt": "abc", "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt": "abc", "target": "x"}, "'target' is for encoder-decoder models"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_analyze_requests_get_a_one_line_400(lm_client, body, message):
    status, out = lm_client.post("/api/analyze", body)
    assert status == 400 and message in out["error"]
