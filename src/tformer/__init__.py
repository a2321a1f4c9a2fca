"""tformer: the Transformer from first principles on PyTorch, every claim checked on running code.

Layers of the package (dependencies point one way):
    functional (tensor math) <- layers <- models <- training / generation <- CLI.
"""

from tformer import functional
from tformer.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from tformer.config import TransformerConfig
from tformer.layers import FeedForward, KVCache, LayerCache, MultiHeadAttention, TransformerBlock
from tformer.models import Decoder, DecoderLM, Encoder, EncoderDecoder, num_parameters
from tformer.sampling import generate
from tformer.seq2seq import beam_search, greedy_seq2seq
from tformer.training import TrainConfig, TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Decoder",
    "DecoderLM",
    "Encoder",
    "EncoderDecoder",
    "FeedForward",
    "KVCache",
    "LayerCache",
    "MultiHeadAttention",
    "TrainConfig",
    "TrainResult",
    "TransformerBlock",
    "TransformerConfig",
    "beam_search",
    "functional",
    "generate",
    "greedy_seq2seq",
    "load_checkpoint",
    "num_parameters",
    "train",
]
