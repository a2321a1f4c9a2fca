"""tformer: the Transformer from first principles on PyTorch, every claim checked on running code.

Layers of the package (dependencies point one way; modules of one layer may use each other):
    the core: config, functional <- attention <- positions, layers <- models;
    then tokenizers, runtime (shared above the core) <- engine (the CPU decode engine, applied from outside: the core
    imports nothing of it) <- generation <- interop (Hugging Face and GGUF checkpoints), hooks (named activations) <-
    training, circuits (lens, attribution, patching) <- experiments, claims <- explore (the page), evaluation
    (benchmark scores) <- cli (tests/test_layout.py holds it).

Shapes: one legend for the whole package. Each module's docstring names the letters it uses, and comments give a
tensor's shape in them, e.g. ``(B, H, T, D)``; ``...`` stands for any leading dims.

    B        batch
    T        tokens of a model or layer input (inside a layer, also its query length)
    L        query length of an attention call
    S        key length of an attention call; the source length of an encoder-decoder
    P        prompt length (padded)
    N        tokens generated so far
    W        context window (the positions of a learned table)
    K        beams per source
    C        model width, d_model
    F        feed-forward hidden width, d_ff
    NL       blocks (layers) of a model
    Nc       components of a residual-stream decomposition
    V        vocabulary size
    M        rows of a linear layer's input (its leading dims flattened)
    I        input features of a linear layer
    O        output features of a linear layer
    H        query heads
    Hkv      key/value heads
    G        query heads per key/value head, H / Hkv
    D        query/key head dimension, C / H
    Dv       value head dimension
    BH       independent attention problems of the tiled kernels, B * Hkv
    Lt       query positions of one tile
    St       keys of one tile
    R        rows of a query tile, Lt * G
    BLOCK_M  query rows of a Triton program tile (Triton's name for Lt * G)
    BLOCK_N  keys of a Triton program tile (Triton's name for St)
    BLOCK_D  D rounded up to a power of two; BLOCK_DV: Dv rounded up

The names below are imported on first use (PEP 562 ``__getattr__``): ``import tformer`` does not import torch,
so the ``tformer`` command is already handling Ctrl-C while torch loads (about 1.5 s), and exits with 130
and one line instead of a traceback. ``from tformer import DecoderLM`` and ``tformer.train(...)`` work as with
eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it (a module's own name: the module itself)
_EXPORTS = {
    "Checkpoint": "tformer.training.checkpoint",
    "CheckpointError": "tformer.training.checkpoint",
    "load_checkpoint": "tformer.training.checkpoint",
    "TransformerConfig": "tformer.config",
    "ConfigError": "tformer.config",
    "functional": "tformer.functional",
    "FeedForward": "tformer.layers",
    "KVCache": "tformer.layers",
    "LayerCache": "tformer.layers",
    "MultiHeadAttention": "tformer.layers",
    "TransformerBlock": "tformer.layers",
    "Decoder": "tformer.models",
    "DecoderLM": "tformer.models",
    "Encoder": "tformer.models",
    "EncoderDecoder": "tformer.models",
    "num_parameters": "tformer.models",
    "generate": "tformer.generation.sampling",
    "beam_search": "tformer.generation.seq2seq",
    "greedy_seq2seq": "tformer.generation.seq2seq",
    "ChatTemplateError": "tformer.generation.chat",
    "chat_prompt": "tformer.generation.chat",
    "TrainConfig": "tformer.training.config",
    "TrainResult": "tformer.training.config",
    "TrainingError": "tformer.training.runtime",
    "train": "tformer.training.trainer",
    "Pretrained": "tformer.interop",
    "InteropError": "tformer.interop",
    "embed": "tformer.interop",
    "load_pretrained": "tformer.interop",
    "save_pretrained": "tformer.interop",
    "quantize": "tformer.engine.quantization",
    "pack_weights": "tformer.engine.memory",
    "evaluate": "tformer.evaluation.runner",
    "EvalError": "tformer.evaluation.data",
}

__all__ = sorted(_EXPORTS)
# Subpackages reachable as attributes after ``import tformer`` (``tformer.engine.accelerate``), imported on first use
SUBPACKAGES = (
    "attention",
    "circuits",
    "claims",
    "engine",
    "evaluation",
    "experiments",
    "explore",
    "generation",
    "hooks",
    "interop",
    "training",
)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name) or (f"tformer.{name}" if name in SUBPACKAGES else None)
    if module_name is None:
        raise AttributeError(f"module 'tformer' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"tformer.{name}" else getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(SUBPACKAGES))


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from tformer import functional
    from tformer.config import ConfigError, TransformerConfig
    from tformer.engine.memory import pack_weights
    from tformer.engine.quantization import quantize
    from tformer.evaluation.data import EvalError
    from tformer.evaluation.runner import evaluate
    from tformer.generation.chat import ChatTemplateError, chat_prompt
    from tformer.generation.sampling import generate
    from tformer.generation.seq2seq import beam_search, greedy_seq2seq
    from tformer.interop import InteropError, Pretrained, embed, load_pretrained, save_pretrained
    from tformer.layers import FeedForward, KVCache, LayerCache, MultiHeadAttention, TransformerBlock
    from tformer.models import Decoder, DecoderLM, Encoder, EncoderDecoder, num_parameters
    from tformer.training.checkpoint import Checkpoint, CheckpointError, load_checkpoint
    from tformer.training.config import TrainConfig, TrainResult
    from tformer.training.runtime import TrainingError
    from tformer.training.trainer import train
