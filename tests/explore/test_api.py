"""The explorer's JSON API: its numbers equal tformer's own functions on the same model (a decoder-only LM with RoPE
and grouped-query heads, and an encoder-decoder): sampling, attention, and the circuit views (logit lens, head
ablation, patching) against :mod:`tformer.circuits`; bad requests get one-line 4xx errors."""

from __future__ import annotations

import math

import pytest
import torch

from tformer import generate
from tformer.circuits import ablate_heads, logit_diff, logit_lens, patch_residual
from tformer.explore import probes
from tformer.explore.analysis import ENGLISH_PROMPT, PYTHON_PROMPT, default_prompt, piece
from tformer.functional import attention_weights, softmax_jacobian, softmax_jacobian_norm
from tformer.generation.sampling import filter_logits
from tformer.hooks import run_with_hooks
from tformer.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer
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


def test_the_logit_lens_ends_in_the_models_own_distribution(lm_client, lm_checkpoint):
    ckpt = load_checkpoint(lm_checkpoint)
    ids = torch.tensor([ckpt.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        probs = ckpt.model(ids)[0].softmax(-1)  # (T, V)
        lens = logit_lens(ckpt.model, ids)
    for position in (-1, 4):
        status, out = lm_client.post("/api/lens", {"prompt": PROMPT, "position": position, "k": 5})
        assert status == 200 and out["position"] == position % len(PROMPT) and out["token"] == PROMPT[position]
        assert [row["label"] for row in out["rows"]] == ["embed", "L0", "L1"]
        last = out["rows"][-1]["top"]
        assert [t["id"] for t in last] == probs[position].topk(5).indices.tolist()
        assert [t["prob"] for t in last] == pytest.approx(probs[position].topk(5).values.tolist(), abs=FLOAT32)
        top_ids, top_probs = lens.top(position, 5)  # every row: tformer.circuits.logit_lens's
        for row, i, p in zip(out["rows"], top_ids.tolist(), top_probs.tolist(), strict=True):
            assert [t["id"] for t in row["top"]] == i and [t["prob"] for t in row["top"]] == pytest.approx(p, abs=1e-5)
        final = out["final"]["id"]
        assert final == last[0]["id"] and out["rows"][-1]["final_prob"] == pytest.approx(last[0]["prob"], abs=1e-7)
        for row, layer in zip(out["rows"], lens.logits[:, 0, position].softmax(-1), strict=True):
            assert row["final_prob"] == pytest.approx(float(layer[final]), abs=1e-5)


@pytest.mark.parametrize("heads", [[[1, 2]], [[0, 0], [1, 3], [0, 0]]])
def test_ablating_heads_is_run_with_hooks_with_ablate_heads(lm_client, lm_checkpoint, heads):
    ckpt = load_checkpoint(lm_checkpoint)
    ids = torch.tensor([ckpt.tokenizer.encode(PROMPT)])
    pairs = list(dict.fromkeys(tuple(h) for h in heads))
    with torch.no_grad():
        original = ckpt.model(ids)[0, -1].softmax(-1)
        ablated = run_with_hooks(ckpt.model, ids, hooks=ablate_heads(ckpt.model, pairs))[0, -1].softmax(-1)
    status, out = lm_client.post("/api/ablate", {"prompt": PROMPT, "heads": heads})
    assert status == 200 and out["heads"] == [list(p) for p in pairs]  # distinct, in order
    assert len(out["next"]) == 20
    for n in out["next"]:
        assert n["prob"] == pytest.approx(float(ablated[n["id"]]), abs=FLOAT32) and n["raw"] == n["prob"]
        assert n["original"] == pytest.approx(float(original[n["id"]]), abs=FLOAT32)
    assert out["total_variation"] == pytest.approx(0.5 * float((ablated - original).abs().sum()), abs=1e-5)
    assert out["total_variation"] > 1e-3  # a head of this peaked model matters
    _, filtered = lm_client.post("/api/ablate", {"prompt": PROMPT, "heads": heads, "top_k": 3})
    kept = [n for n in filtered["next"] if n["kept"]]
    assert len(kept) == 3 and sum(n["prob"] for n in kept) == pytest.approx(1.0, abs=1e-5)
    _, none = lm_client.post("/api/ablate", {"prompt": PROMPT, "heads": []})
    assert all(n["prob"] == n["original"] for n in none["next"]) and none["total_variation"] == 0


def test_patching_restores_the_clean_run_where_it_can(lm_client, lm_checkpoint):
    clean, corrupted = "the cat sat", "the bat sat"  # one token differs: position 4
    ckpt = load_checkpoint(lm_checkpoint)
    tok = ckpt.tokenizer
    status, out = lm_client.post("/api/patch", {"clean": clean, "corrupted": corrupted})
    assert status == 200 and out["layers"] == ["L0", "L1"]
    with torch.no_grad():
        clean_logits = ckpt.model(torch.tensor([tok.encode(clean)]))[0, -1]
        corrupted_logits = ckpt.model(torch.tensor([tok.encode(corrupted)]))[0, -1]
    assert out["correct"]["id"] == int(clean_logits.argmax())  # the default: the clean run's answer
    good, bad = out["correct"]["id"], out["wrong"]["id"]
    assert out["clean_diff"] == pytest.approx(float(clean_logits[good] - clean_logits[bad]), abs=1e-4)
    assert out["corrupted_diff"] == pytest.approx(float(corrupted_logits[good] - corrupted_logits[bad]), abs=1e-4)
    expected = patch_residual(
        ckpt.model, torch.tensor([tok.encode(clean)]), torch.tensor([tok.encode(corrupted)]), logit_diff(good, bad)
    )
    assert (torch.tensor(out["patched"]) - expected).abs().max() < 1e-4
    share = torch.tensor(out["restored"])  # (L, T)
    assert share.shape == (2, len(clean))
    assert share[0, 4] == pytest.approx(1.0, abs=1e-4)  # the embedding of the one changed token: the clean run
    assert share[0, torch.arange(len(clean)) != 4].abs().max() < 1e-4  # the same token in both runs: nothing
    assert share[:, :4].abs().max() < 1e-4  # causal: positions before the change are the same in both runs
    _, same = lm_client.post("/api/patch", {"clean": clean, "corrupted": clean, "correct": "a", "wrong": "e"})
    assert same["restored"] is None  # no gap to restore: the raw difference is the clean one everywhere
    assert (torch.tensor(same["patched"]) - same["clean_diff"]).abs().max() < 1e-4
    _, chosen = lm_client.post("/api/patch", {"clean": clean, "corrupted": corrupted, "correct": "a", "wrong": 5})
    assert chosen["correct"] == {"id": tok.encode("a")[0], "token": "a"} and chosen["wrong"]["id"] == 5


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/api/lens", {"prompt": "abc", "position": 3}, "position must be in [-3, 3) for this prompt of 3 tokens"),
        ("/api/lens", {"prompt": "abc", "k": 0}, "k must be in [1, 50]"),
        ("/api/lens", {"prompt": "abc", "position": "last"}, "position must be int"),
        ("/api/ablate", {"prompt": "abc", "heads": [[2, 0]]}, "the model has 2 layers of 4 heads"),
        ("/api/ablate", {"prompt": "abc", "heads": [[0]]}, "heads must be a list of [layer, head] pairs"),
        ("/api/ablate", {"prompt": "abc", "heads": [[0, True]]}, "heads must be a list of [layer, head] pairs"),
        ("/api/ablate", {"prompt": "abc", "heads": "L0H1"}, "heads must be list"),
        ("/api/ablate", {"prompt": "abc"}, "missing field 'heads'"),
        ("/api/patch", {"clean": "the cat", "corrupted": "a cat"}, "give prompts of the same token length"),
        ("/api/patch", {"clean": "abc", "corrupted": "abd", "correct": "ab"}, "correct 'ab' is 2 tokens"),
        ("/api/patch", {"clean": "abc", "corrupted": "abd", "wrong": 999}, "wrong id 999 is outside the vocabulary"),
        ("/api/patch", {"clean": "abc", "corrupted": "abd", "correct": "a", "wrong": "a"}, "the same token 'a'"),
        ("/api/patch", {"clean": "abc", "corrupted": "ABC"}, "the corrupted prompt cannot be encoded"),
        ("/api/patch", {"clean": "abc"}, "missing field 'corrupted'"),
    ],
)
def test_bad_circuit_requests_get_a_one_line_400(lm_client, path, body, message):
    status, out = lm_client.post(path, body)
    assert status == 400 and message in out["error"] and "\n" not in out["error"]


def test_patching_is_capped_by_its_forwards(lm_client, monkeypatch):
    monkeypatch.setattr(probes, "MAX_PATCH_FORWARDS", 10)
    status, out = lm_client.post("/api/patch", {"clean": "abcdef", "corrupted": "abcdeg"})
    assert status == 400 and "2 layers x 6 tokens = 12; at most 10: shorten the prompts to 5 tokens" in out["error"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/lens", {"prompt": "abc"}),
        ("/api/ablate", {"prompt": "abc", "heads": [[0, 0]]}),
        ("/api/patch", {"clean": "abc", "corrupted": "abd"}),
    ],
)
def test_the_circuit_views_are_for_language_models(seq2seq_client, path, body):
    status, out = seq2seq_client.post(path, body)
    assert status == 400 and "a language model); this is an encoder-decoder" in out["error"]


def test_tokens_that_hold_part_of_a_utf8_character_show_their_bytes():
    byte = ByteTokenizer()
    assert [piece(byte, i) for i in byte.encode("café →")] == [
        *"caf",
        "<0xC3>",
        "<0xA9>",
        " ",
        "<0xE2>",
        "<0x86>",
        "<0x92>",
    ]
    bpe = BPETokenizer.train(["a b c"], vocab_size=260)
    lone = bpe._hf.token_to_id("\u00e2")  # GPT-2's symbol for the byte 0xE2
    assert piece(bpe, lone) == "<0xE2>" and piece(bpe, bpe.encode(" é")[0]) != "\ufffd"
    char = CharTokenizer("ab", unknown="unk")
    assert piece(char, char.encode("x")[0]) == "<unk>" and piece(char, char.encode("a")[0]) == "a"


def test_the_default_prompt_suits_the_model(lm_client):
    code = {"data": None, "task": None, "pairs": None}  # a run on the default corpus: the Python standard library
    assert default_prompt(ByteTokenizer(), code) == PYTHON_PROMPT
    assert default_prompt(ByteTokenizer(), None) == ENGLISH_PROMPT  # a pretrained model
    assert default_prompt(ByteTokenizer(), {**code, "data": "novels.txt"}) == ENGLISH_PROMPT
    assert default_prompt(CharTokenizer("0123456789+", unknown="error"), {**code, "task": "add"}) == "0123456789+"
    assert default_prompt(ByteTokenizer(), code, limit=32) == "def f(x):\n    return"  # the longer one is 59 bytes
    _, info = lm_client.request("GET", "/api/info")
    assert info["prompt"] == "The Transformer"  # the test model's alphabet has no "C" or "F" for ENGLISH_PROMPT


def test_a_byte_level_model_trained_on_code(code_client):
    _, info = code_client.request("GET", "/api/info")
    assert info["prompt"] == PYTHON_PROMPT  # a run on the default corpus, the Python standard library
    status, out = code_client.post("/api/analyze", {"prompt": "é = 1"})
    assert status == 200 and out["tokens"] == ["<0xC3>", "<0xA9>", " ", "=", " ", "1"]
    assert all("\ufffd" not in n["token"] for n in out["next"])
    _, lens = code_client.post("/api/lens", {"prompt": "é", "position": 0})
    assert lens["token"] == "<0xC3>"
