"""Models: causality, cross-attention wiring, masks, caches, config validation."""

import pytest
import torch

from tformer import DecoderLM, Encoder, EncoderDecoder, TransformerConfig, num_parameters

POSITIONS = ["sinusoidal", "rotary", "learned", "none"]


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_lm_is_causal(random_ids, position, norm_first):
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig.tiny(position=position, norm_first=norm_first)).double().eval()
    ids = random_ids(2, 12)
    base = model(ids)
    assert base.shape == (2, 12, 32)
    for t in (0, 5, 11):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 32
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)  # the past never sees t
        assert (out[:, t] - base[:, t]).abs().max() > 1e-6  # but position t itself does


@pytest.mark.parametrize("position", POSITIONS)
def test_encoder_decoder_decoder_is_causal_and_reads_the_source(random_ids, position):
    torch.manual_seed(1)
    model = EncoderDecoder(TransformerConfig.tiny(position=position)).double().eval()
    src, tgt = random_ids(2, 9, seed=1), random_ids(2, 7, seed=2)
    base = model(src, tgt)
    assert base.shape == (2, 7, 32)
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] + 3) % 32
    torch.testing.assert_close(model(src, changed)[:, :4], base[:, :4], rtol=0, atol=1e-12)
    other_src = src.clone()
    other_src[:, -1] = (other_src[:, -1] + 5) % 32  # the last source token: visible to every target position
    assert (model(other_src, tgt) - base).abs().amax(dim=-1).min() > 1e-6  # cross-attention is wired


def test_source_padding_is_ignored(random_ids):
    torch.manual_seed(2)
    model = EncoderDecoder(TransformerConfig.tiny()).double().eval()
    src, tgt = random_ids(1, 6, seed=3), random_ids(1, 5, seed=4)
    padded = torch.cat([src, random_ids(1, 3, seed=5)], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    torch.testing.assert_close(model(padded, tgt, src_mask=mask), model(src, tgt), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("position", ["sinusoidal", "rotary", "learned"])
def test_left_padded_batch_equals_one_by_one(random_ids, position):
    torch.manual_seed(3)
    model = DecoderLM(TransformerConfig.tiny(position=position)).double().eval()
    short, long = random_ids(1, 4, seed=6), random_ids(1, 7, seed=7)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False
    out = model(batch, mask)
    torch.testing.assert_close(out[0, 3:], model(short)[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1], model(long)[0], rtol=1e-10, atol=1e-10)
    assert torch.isfinite(out).all()  # padded query rows see nothing: zeros, not NaN


@pytest.mark.parametrize("position", POSITIONS)
def test_cached_logits_equal_uncached(random_ids, position):
    torch.manual_seed(4)
    model = DecoderLM(TransformerConfig.tiny(position=position)).eval()
    ids = random_ids(2, 10, seed=8)
    full = model(ids)
    cache = model.new_cache()
    steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(4, 10)]
    # float32, same math in a different order: 1e-5 is ~100 ulps of the logits' scale
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_head_of_the_last_hidden_state_gives_the_last_positions_logits(random_ids, dtype):
    """What generation asks after a prompt: the head's product for one row, ``logits(hidden(ids)[:, -1:])``. In
    float64 the same numbers (to 1e-12: the product of one row and of ten are the same sums); in float32 1e-5, ~100
    ulps of the logits' scale (an accelerated model runs one row on the matrix-vector kernel and ten on a GEMM:
    tests/engine/test_apply.py)."""
    torch.manual_seed(6)
    model = DecoderLM(TransformerConfig.tiny(position="rotary")).to(dtype).eval()
    ids = random_ids(2, 10, seed=9)
    with torch.no_grad():
        full, last = model(ids), model.logits(model.hidden(ids)[:, -1:])
        assert last.shape == (2, 1, 32)
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(last, full[:, -1:], rtol=tolerance, atol=tolerance)
        cache = model.new_cache()
        prompt = model.logits(model.hidden(ids[:, :6], cache=cache)[:, -1:])  # a prefill: the cache still fills
        step = model(ids[:, 6:7], cache=cache)
    torch.testing.assert_close(prompt, full[:, 5:6], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(step, full[:, 6:7], rtol=tolerance, atol=tolerance)


def test_encoder_decoder_cached_decode_equals_full_decode(random_ids):
    torch.manual_seed(5)
    model = EncoderDecoder(TransformerConfig.tiny(position="rotary", num_kv_heads=2)).eval()
    src, tgt = random_ids(2, 8, seed=9), random_ids(2, 6, seed=10)
    src_mask = torch.ones(2, 8, dtype=torch.bool)
    src_mask[1, 5:] = False
    memory = model.encode(src, src_mask)
    full = model.decode(tgt, memory, src_mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_one_matrix():
    cfg = TransformerConfig.tiny()
    tied, untied = EncoderDecoder(cfg), EncoderDecoder(cfg.replace(tie_embeddings=False))
    assert tied.encoder.embed.tokens.weight is tied.decoder.embed.tokens.weight
    extra = 2 * cfg.vocab_size * cfg.d_model  # a second embedding and an output matrix
    assert num_parameters(untied) - num_parameters(tied) == extra


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(d_model=30, num_heads=4), "d_model"),
        (dict(d_model=12, num_heads=4, position="rotary"), "rotary"),
        (dict(num_layers=0), "num_layers"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(position="alibi"), "position"),
        (dict(attn_backend="fast"), "attn_backend"),
        (dict(dropout=1.5), "dropout"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(pad_id=1.5), "pad_id"),
        (dict(pad_id=True), "pad_id"),
        (dict(pad_id="0"), "pad_id"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig.tiny(**changes)


def test_config_round_trips_and_rejects_unknown_fields():
    cfg = TransformerConfig.tiny(position="rotary")
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="nheads"):
        TransformerConfig.from_dict({**cfg.to_dict(), "nheads": 3})


def test_bad_token_ids_and_lengths_raise(random_ids):
    model = DecoderLM(TransformerConfig.tiny(position="learned", max_seq_len=8))
    with pytest.raises(ValueError, match="token id 32"):
        model(torch.tensor([[1, 32]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(random_ids(1, 9))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="mask"):
        model(random_ids(1, 3), torch.ones(1, 4, dtype=torch.bool))
    rotary = DecoderLM(TransformerConfig.tiny(position="rotary", max_seq_len=8))
    assert rotary(random_ids(1, 20)).shape == (1, 20, 32)  # rotary and sinusoidal extrapolate past max_seq_len


def test_wrong_inputs_are_named_with_what_fits(random_ids):
    """Metadata checks (no value read back) where torch's own error would name neither the argument nor the fix;
    an encoder-decoder's errors say whether the source or the target is wrong."""
    lm = DecoderLM(TransformerConfig.tiny(position="learned")).eval()
    ids = random_ids(2, 8)
    with pytest.raises(TypeError, match=r"positions"):
        lm(ids, positions=torch.arange(3, 11))  # counted from the mask and the cache: no argument to ignore
    with pytest.raises(ValueError, match=r"int64 or int32: ids.long\(\)\); got torch.uint8"):
        lm(ids.to(torch.uint8))
    cache = lm.new_cache()
    lm(ids, cache=cache)
    with pytest.raises(ValueError, match="the cache holds 2 rows; ids has 1"):
        lm(ids[:1, :1], cache=cache)
    ed = EncoderDecoder(TransformerConfig.tiny())
    src, tgt = random_ids(2, 10), random_ids(3, 7)
    with pytest.raises(ValueError, match=r"batch of tgt_ids \(3, 7\); got \(2, 10, 32\)"):
        ed(src, tgt)
    mask = torch.ones(2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"src_mask must be \(batch, source length\) = \(2, 10\)"):
        ed.decode(tgt[:2], ed.encode(src, mask), mask[:, :5])
    with pytest.raises(ValueError, match="src_ids holds token id 99"):
        ed(torch.full((2, 3), 99), tgt[:2])
    with pytest.raises(ValueError, match="tgt_ids holds token id 99"):
        ed(src, torch.full((2, 3), 99))


def test_token_types_outside_the_table_or_of_another_shape_are_refused(random_ids):
    encoder = Encoder(TransformerConfig.tiny(type_vocab_size=2))
    ids = random_ids(2, 5)
    assert encoder(ids, None, torch.ones(2, 5, dtype=torch.long)).shape == (2, 5, 32)
    with pytest.raises(ValueError, match=r"token_types holds a type outside \[0, 2\)"):
        encoder(ids, None, torch.full((2, 5), 2))
    with pytest.raises(ValueError, match=r"shaped like the ids \(2, 5\); got torch.int64 \(2, 4\)"):
        encoder(ids, None, torch.ones(2, 4, dtype=torch.long))
