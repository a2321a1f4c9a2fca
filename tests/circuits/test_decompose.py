"""The decomposition means what it says: on a tiny model of each single-stack family (Pre-LN and Post-LN language
models, learned, sinusoidal and rotary positions, grouped-query heads, a BERT-like encoder with token types and an
embedding norm, a Pre-LN encoder with a final norm) the components sum to the residual stream leaving the last block
and, through the final norm with its scale held, to the model's hidden state; through the unembedding their shares sum
to the logit difference; the logit lens at the last layer is the logits. Then the same on the real SmolLM2 and
MiniLM, and MiniLM's cached patterns against ``transformers``' ``output_attentions``."""

from __future__ import annotations

import pytest
import torch

from tests.hooks.families import LMS, STACKS, body, inputs, tiny
from tformer import DecoderLM, load_pretrained
from tformer.circuits import decompose, logit_attribution, logit_lens, unembedding
from tformer.engine import accelerate
from tformer.hooks import run_with_cache
from tformer.interop.shipped import locate

SUM = 1e-12  # float64 rounding of a sum of ~20 components of order 1 to 10, each through a few norms
# float32 (eps 6e-8) sums of ~60 components in another order, relative to the largest entry: <~4e-6 (SmolLM2: 2e-6)
REAL = 2e-5


def last_block_output(model, args: tuple) -> torch.Tensor:
    """The residual stream leaving the last block: ``hook_resid_post`` (Pre-LN) or, Post-LN, after its last norm."""
    blocks = body(model).stack.blocks
    last = f"blocks.{len(blocks) - 1}."
    name = last + ("hook_resid_post" if blocks[0].norm_first else "hook_normalized_resid_post")
    _, cache = run_with_cache(model, *args, names=[name])
    return cache[name]


def final_hidden(model, args: tuple) -> torch.Tensor:
    """What the output head reads (a language model) or the encoder's output."""
    with torch.no_grad():
        return model.hidden(*args) if isinstance(model, DecoderLM) else model(*args)


def cases() -> list[tuple[str, str]]:
    return [(family, "") for family in STACKS] + [("marian_pre", "encoder")]  # a Pre-LN encoder, final norm


def model_and_args(family: str, part: str):
    model, args = tiny(family), inputs(family)
    return (model.encoder, args[:1]) if part == "encoder" else (model, args)


@pytest.mark.parametrize("heads", [False, True])
@pytest.mark.parametrize(("family", "part"), cases())
def test_the_components_sum_to_the_residual_stream_and_through_the_final_norm_to_the_hidden_state(family, part, heads):
    model, args = model_and_args(family, part)
    parts = decompose(model, *args, heads=heads)
    assert len(parts.labels) == parts.values.shape[0]
    assert ("L1H3" in parts.labels) == heads and ("L1.attn" in parts.labels) != heads
    assert (parts.values.sum(0) - last_block_output(model, args)).abs().max() < SUM
    normalized = parts.normalized()
    assert (normalized.values.sum(0) - final_hidden(model, args)).abs().max() < SUM
    dropped = normalized.values[:-1].sum(0)  # without one component the sum misses: each one counts
    assert (dropped - final_hidden(model, args)).abs().max() > 1e-3


@pytest.mark.parametrize("family", LMS)
def test_logit_attribution_sums_to_the_logit_and_to_the_logit_difference(family):
    model, (ids,) = tiny(family), inputs(family)
    with torch.no_grad():
        logits = model(ids)
    labels, shares = logit_attribution(model, ids, token=3, against=7, position=-2)
    assert shares.shape == (len(labels), ids.shape[0]) and "L0H2" in labels
    assert (shares.sum(0) - (logits[:, -2, 3] - logits[:, -2, 7])).abs().max() < SUM
    _, alone = logit_attribution(model, ids, token=3, heads=False)
    assert (alone.sum(0) - logits[:, -1, 3]).abs().max() < SUM
    assert torch.equal(
        unembedding(model), model.head.weight if model.head is not None else model.decoder.embed.tokens.weight
    )


def test_attribution_reads_the_tied_embedding_of_an_accelerated_model():
    """``accelerate`` (which ``load_pretrained`` and ``generate`` apply) gives a tied model a ``TiedHead``, which
    holds no matrix: the unembedding is still the token embedding."""
    model, (ids,) = tiny("gpt2"), inputs("gpt2")
    accelerate(model)
    assert unembedding(model) is model.decoder.embed.tokens.weight
    _, shares = logit_attribution(model, ids, token=3)
    with torch.no_grad():
        logits = model(ids)
    assert (shares.sum(0) - logits[:, -1, 3]).abs().max() < SUM


@pytest.mark.parametrize("family", LMS)
def test_the_logit_lens_at_the_last_layer_is_the_logits(family):
    model, (ids,) = tiny(family), inputs(family)
    lens = logit_lens(model, ids)
    assert lens.labels == ["embed", "L0", "L1"] and lens.logits.shape == (3, *ids.shape, 41)
    with torch.no_grad():
        logits = model(ids)
    assert (lens.logits[-1] - logits).abs().max() < SUM
    assert (lens.logits[1] - logits).abs().max() > 1e-2  # an earlier layer reads something else
    top, probs = lens.top(position=-1, k=3)
    assert torch.equal(top[-1], logits[0, -1].topk(3).indices)
    assert probs.shape == (3, 3)


def test_decompose_names_what_it_reads():
    with pytest.raises(TypeError, match="DecoderLM or an Encoder"):
        decompose(tiny("marian_pre"), *inputs("marian_pre"))
    model = tiny("gpt2").train()
    with pytest.raises(ValueError, match="eval mode"):
        decompose(model, *inputs("gpt2"))


# --------------------------------------------------------------------------------------------------
# The real models
# --------------------------------------------------------------------------------------------------
def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_smollm2_decomposition_attribution_and_lens(smollm):
    model = smollm.model
    ids = torch.tensor([smollm.tokenizer.encode("The capital of France is")])
    parts = decompose(model, ids, heads=True)
    assert len(parts.labels) == 2 + 30 * (9 + 1) - 1  # embed, per layer 9 heads and the MLP (no attention bias)
    assert relative(parts.values.sum(0), last_block_output(model, (ids,))) < REAL
    assert relative(parts.normalized().values.sum(0), final_hidden(model, (ids,))) < REAL
    paris, london = smollm.tokenizer.encode(" Paris")[0], smollm.tokenizer.encode(" London")[0]
    with torch.no_grad():
        logits = model(ids)
    _, shares = logit_attribution(model, ids, paris, against=london)
    difference = logits[0, -1, paris] - logits[0, -1, london]
    assert abs(float(shares.detach().sum(0)[0] - difference)) < REAL * float(logits[0, -1].abs().max())
    lens = logit_lens(model, ids)
    assert relative(lens.logits[-1], logits) < REAL


@pytest.mark.slow
def test_minilm_decomposition_and_patterns_equal_transformers():
    """Patterns of a padded batch equal ``output_attentions`` of ``transformers`` reading the same files, on the real
    tokens' rows (padding queries differ by design: tformer gives them no positions of their own): float32 on both
    sides, bounded by 4x the reference's own float32 error against its float64 run."""
    import transformers

    minilm_dir = locate("minilm")
    model = load_pretrained(minilm_dir).model
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    enc = tokenizer(
        ["A man is eating food.", "The girl is carrying a baby in her arms."], padding=True, return_tensors="pt"
    )
    ids, mask, types = enc["input_ids"], enc["attention_mask"].bool(), enc["token_type_ids"]
    parts = decompose(model, ids, mask, types, heads=True)
    assert relative(parts.values.sum(0), final_hidden(model, (ids, mask, types))) < REAL
    reference = transformers.AutoModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = reference(**enc, output_attentions=True).attentions
        oracle = reference.double()(**enc, output_attentions=True).attentions
    _, cache = run_with_cache(model, ids, mask, types, names=lambda n: n.endswith("hook_pattern"))
    rows = mask[:, None, :, None]  # (B, 1, T, 1): real queries
    for i, (t, o) in enumerate(zip(theirs, oracle, strict=True)):
        own_error = ((t.double() - o) * rows).abs().max()
        assert ((cache["pattern", i].double() - o) * rows).abs().max() <= 4 * own_error, i
