"""tformer: the Transformer from first principles on PyTorch, every claim checked on running code.

Layers of the package (dependencies point one way):
    functional (tensor math) <- layers <- models <- training / generation <- CLI.
"""

from tformer import functional
from tformer.config import TransformerConfig
from tformer.layers import FeedForward, KVCache, LayerCache, MultiHeadAttention, TransformerBlock
from tformer.models import Decoder, DecoderLM, Encoder, EncoderDecoder, num_parameters

__version__ = "0.1.0"

__all__ = [
    "Decoder",
    "DecoderLM",
    "Encoder",
    "EncoderDecoder",
    "FeedForward",
    "KVCache",
    "LayerCache",
    "MultiHeadAttention",
    "TransformerBlock",
    "TransformerConfig",
    "functional",
    "num_parameters",
]
