"""A model's forward reads nothing back from the device and has no data-dependent Python branch, so that
``torch._dynamo`` captures it whole: zero graph breaks for every position scheme, with padding and grouped-query
heads, for one cached decode step and for the encoder-decoder. (Each ``Tensor.item`` or ``int(tensor)`` in a
forward would be a graph break here and a device-to-host sync per call on a GPU.)"""

import pytest
import torch
import torch._dynamo as dynamo

from tformer import DecoderLM, EncoderDecoder, TransformerConfig


def graph_breaks(fn, *args, **kwargs) -> list[str]:
    """Why dynamo split ``fn(*args, **kwargs)`` (empty: one graph)."""
    dynamo.reset()
    explained = dynamo.explain(fn)(*args, **kwargs)
    assert explained.graph_count >= 1
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("position", ["learned", "rotary", "sinusoidal", "none"])
@pytest.mark.parametrize("padded", [False, True])
def test_decoder_lm_forward_is_one_graph(random_ids, position, padded):
    model = DecoderLM(TransformerConfig.tiny(position=position)).eval()
    ids = random_ids(2, 9)
    mask = None
    if padded:
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[0, :4] = False  # row 0 left-padded
    assert graph_breaks(model, ids, mask) == []


def test_grouped_query_lm_in_training_mode_is_one_graph(random_ids):
    model = DecoderLM(TransformerConfig.tiny(position="rotary", num_kv_heads=2, dropout=0.1)).train()
    assert graph_breaks(model, random_ids(2, 9)) == []


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_one_cached_decode_step_is_one_graph(random_ids, position):
    model = DecoderLM(TransformerConfig.tiny(position=position)).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(random_ids(2, 7), cache=cache)  # prefill
        assert graph_breaks(model, random_ids(2, 1, seed=1), cache=cache) == []


def test_encoder_decoder_forward_and_cached_decode_are_one_graph(random_ids):
    model = EncoderDecoder(TransformerConfig.tiny(position="sinusoidal")).eval()
    src, tgt = random_ids(2, 7), random_ids(2, 5, seed=1)
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[1, 5:] = False  # right-padded source
    assert graph_breaks(model, src, tgt, src_mask) == []
    with torch.no_grad():
        memory, cache = model.encode(src, src_mask), model.new_cache()
        model.decode(tgt[:, :1], memory, src_mask, cache=cache)
        assert graph_breaks(model.decode, tgt[:, 1:2], memory, src_mask, cache=cache) == []


def test_inputs_longer_than_the_tables_grow_them_from_their_shape(random_ids):
    """Sinusoidal and rotary tables hold max_seq_len rows from construction; a longer input grows them by its static
    length (still one graph), and the grown model computes what a model built large enough computes."""
    torch.manual_seed(0)
    for position in ("sinusoidal", "rotary"):
        small = DecoderLM(TransformerConfig.tiny(position=position, max_seq_len=8)).double().eval()
        large = DecoderLM(TransformerConfig.tiny(position=position, max_seq_len=64)).double().eval()
        large.load_state_dict(small.state_dict())
        ids = random_ids(1, 20)
        assert graph_breaks(small, ids) == []
        torch.testing.assert_close(small(ids), large(ids), rtol=0, atol=0)
