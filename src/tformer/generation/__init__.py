"""Generation: sampling from a decoder-only LM and searching an encoder-decoder's outputs, with a KV cache.

Modules:
    sampling  pure logit filters (temperature, top-k, top-p) and ``generate`` for decoder-only LMs
    stopping  when a generated row ends: an EOS id, stop sequences, stop strings
    seq2seq   greedy and beam search for encoder-decoder models
    text      text in, text out: a streamed continuation of a prompt, translation of lines
    chat      a conversation as a chat model's prompt text (its tokenizer's chat template)
"""

from tformer.generation.chat import ChatTemplateError, chat_prompt
from tformer.generation.sampling import generate
from tformer.generation.seq2seq import beam_search, greedy_seq2seq

__all__ = ["ChatTemplateError", "beam_search", "chat_prompt", "generate", "greedy_seq2seq"]
