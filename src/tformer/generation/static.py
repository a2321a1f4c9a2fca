"""Decoding over a static KV cache, optionally compiled: every decode step has the same shapes, so one compiled graph
serves them all (``generate(..., static_cache=True)``, ``generate(..., compile=True)``).

The cache holds ``capacity`` positions per layer, allocated once (:class:`StaticKVCache`). A step writes its token's
keys and values at column ``slot`` (a one-element tensor updated in place), marks the column real in the key mask
``(B, capacity)`` and passes each row's position ``(B, 1)``; none of these is a Python number a graph could
specialise on. :func:`forward` runs the model's own modules over that cache, or, for a decode step of Llama-style
blocks on the CPU, the engine's fused step (:mod:`tformer.engine.fused`: the blocks as one kernel call).

With ``compile=True`` the prompt is also left-padded to a multiple of :data:`BUCKET` tokens and the capacity rounded
up to one, so prompts and lengths within a bucket share their graphs (prefill and step). What is compiled is one
function of the model (:func:`compiled_forward`), so dynamo's graphs take the weights as inputs and keep no model
alive. The batch size and the dtype are part of the shape too; dynamo keeps at most :data:`RECOMPILE_LIMIT` graphs of
that function per process, past which a ``RuntimeError`` names the fix, ``torch._dynamo.reset()``.

On CUDA the step runs with ``mode="reduce-overhead"`` (CUDA graphs: one launch per step). On the CPU it runs
inductor's C++ kernels without inductor's per-call checks of its inputs' sizes and strides, and without dynamo after
the first step: :class:`StaticLM` passes the same tensors at every step (written in place), dynamo's guards checked
them at the first, so later steps call the step's compiled graph directly (:attr:`StaticLM.replay`), the CPU's
counterpart of a CUDA graph replay. The model must not change during one generation except in place; the next
generation's first step runs every guard again.

Shapes: B, Hkv, P, S, D, T, C, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time

import torch
from torch import Tensor

from tformer.engine import fused, kernels
from tformer.generation.sampling import context_window
from tformer.layers import LayerCache
from tformer.models import DecoderLM

BUCKET = 64  # prompt lengths and capacities are rounded up to a multiple of this when compiling
# wall seconds of the last compiled generation's prefill and first step, the compilation in them
LAST_TIMINGS: dict[str, float] = {}


REPLAY = True  # False: every compiled CPU step goes through dynamo (benchmarks/decode.py measures the difference)
RECOMPILE_LIMIT = 64  # graphs of the compiled decode function dynamo keeps: 2 per structure x dtype x batch x bucket
AUTO_COMPILE_DEVICES = ("cuda",)  # where --compile auto compiles (auto_compile says why)


class StaticKVCache:
    """Keys and values in storage of ``capacity`` positions allocated once, ``(B, Hkv, capacity, D)``, written in
    place at the columns ``slots (T,)`` the caller sets before each call: every decoding step then has the same
    shapes, and a compiled step runs again without recompiling. Unwritten columns hold zeros; the key mask of
    :func:`forward` hides them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a static cache needs capacity >= 1; got {capacity}")
        self.capacity = capacity
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.slots: Tensor | None = None  # (T,) long: the columns the next update writes

    def allocate(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the storage now, zeros ``(batch, kv_heads, capacity, head_dim)`` for keys and values, rather than
        at the first :meth:`update`. A compiled caller must: storage made inside a CUDA graph belongs to the graph's
        memory pool, which the next graph reuses."""
        self.k = torch.zeros(batch, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v (B, Hkv, T, D)`` at columns ``slots``; return the whole storage ``(B, Hkv, S, D)``
        (allocated at the first call, unless :meth:`allocate` did it before)."""
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:-2], self.capacity, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], self.capacity, v.shape[-1])
        self.k.index_copy_(-2, self.slots, k)
        self.v.index_copy_(-2, self.slots, v)
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index``: new storage of the same capacity."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


def static_cache(model: DecoderLM, capacity: int) -> list[LayerCache]:
    """An empty static cache of ``capacity`` positions, one entry per block of ``model``, its position tables
    reserved for them (learned positions: at most ``max_seq_len``, the real tokens they count)."""
    decoder = model.decoder
    learned = model.cfg.position == "learned"
    decoder.reserve(min(capacity, model.cfg.max_seq_len) if learned else capacity)
    return [LayerCache(StaticKVCache(capacity)) for _ in decoder.stack.blocks]


def forward(
    model: DecoderLM,
    ids: Tensor,
    keys: Tensor,
    caches: list[LayerCache],
    positions: Tensor,
    last_only: bool = False,
) -> Tensor:
    """Logits ``(B, T, V)`` of the new tokens ``ids (B, T)`` over a static cache (:func:`static_cache`): the caller
    gives each token's position ``positions (B, T)``, the columns they go to (``cache.slots``, shared by the rows)
    and ``keys (B, S)``, the columns that hold real tokens once these are written. Query ``i`` sees column ``j`` when
    ``keys[b, j]`` and ``j <= slots[i]``. Only tensors vary between steps: one compiled graph serves every step.
    ``last_only``: the last position's logits alone ``(B, 1, V)`` (what a prefill needs; the head's product for one
    row)."""
    decoder, cache = model.decoder, caches[0].self_kv
    if cache.slots is None:
        raise ValueError("a static cache needs cache.slots: the columns the new tokens go to")
    if keys.shape != (ids.shape[0], cache.capacity) or positions.shape != ids.shape:
        raise ValueError(
            f"with a static cache of capacity {cache.capacity}: keys must be {(ids.shape[0], cache.capacity)} "
            f"and positions {tuple(ids.shape)}; got {tuple(keys.shape)} and {tuple(positions.shape)}"
        )
    rope = decoder.rotary(positions) if decoder.rotary is not None else None  # tables reserved by static_cache
    x = decoder.embed(ids, positions)  # (B, T, C)
    # a decode step: the blocks as one kernel call, unless hooks are attached (the modules run every hook point)
    stack = fused.plan(decoder.stack.blocks, x, caches) if model.taps is None else None
    if stack is not None:  # the op masks by keys and the slot itself
        h = decoder.stack.final_norm(fused.step(stack, x, [layer.self_kv for layer in caches], keys, rope))
    else:
        columns = torch.arange(cache.capacity, device=ids.device)
        self_mask = keys[:, None, None, :] & (columns[None, :] <= cache.slots[:, None])  # (B, 1, T, S)
        h = decoder.stack(x, caches=caches, self_mask=self_mask, is_causal=False, rope=rope)  # (B, T, C)
    return model.logits(h[:, -1:] if last_only else h)


def compiled_forward(model: DecoderLM) -> tuple[object, _Recorder | None]:
    """``model``'s forward through ``torch.compile``: a compiled function that calls the model it is given, made once
    per device kind; and the :class:`_Recorder` its CPU graphs report to (``None`` on CUDA, whose graphs are CUDA
    graphs). The model is the function's argument, not something the compiled object holds, so compiling a
    model does not keep it alive (``torch.compile(model)`` in a table would: the compiled module holds its model).
    Every model, dtype, batch size and shape bucket is a graph of this one function, so dynamo's recompile limit
    (8 by default, for the whole process) is raised to :data:`RECOMPILE_LIMIT`."""
    kernels.ready()  # build or load the bfloat16 kernel now: a graph being traced does not build it
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda not in _COMPILED:
        if cuda:
            _COMPILED[cuda] = torch.compile(forward, mode="reduce-overhead", dynamic=False, fullgraph=True)
        else:  # the step's Python wrapper runs per token: skip its input-stride asserts (dynamo's guards hold them)
            _COMPILED[cuda] = torch.compile(forward, backend=RECORDER, dynamic=False, fullgraph=True)
    return functools.partial(_COMPILED[cuda], model), None if cuda else RECORDER


def _recompile_limit_error() -> RuntimeError:
    limit = torch._dynamo.config.recompile_limit
    return RuntimeError(
        f"torch.compile keeps at most {limit} graphs of compiled decoding per process (torch._dynamo.config."
        "recompile_limit), and this generation needs another: each model structure, dtype, batch size and shape "
        f"bucket (prompt and capacity rounded up to {BUCKET} tokens) takes two. Free them with torch._dynamo.reset() "
        "(later calls compile again), raise the limit, or decode uncompiled (compile=False; static_cache=True keeps "
        "the same shapes)"
    )


class _Recorder:
    """``torch.compile``'s backend for CPU decoding: inductor (``torch._inductor.compile``, which is what
    ``backend="inductor"`` runs) with ``options``, each compiled graph wrapped to note its last call: ``last`` is
    ``(graph, arguments, outputs)``. :class:`StaticLM` takes its step's graph from there and calls it directly."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.last: tuple | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graph = torch._inductor.compile(gm, example_inputs, self.options)

        def run(*args):
            outputs = graph(*args)
            self.last = (graph, args, outputs)
            return outputs

        return run


# The CPU graphs' backend; StaticLM clears its note after each call. emulate_precision_casts: where eager rounds to
# bfloat16 and reads the value back as float32 (a norm's output going into a bfloat16 GEMM run as float32:
# kernels.uses_float32_gemm), the fused kernel rounds too, as eager does (by default inductor keeps the float32 value)
RECORDER = _Recorder({"size_asserts": False, "emulate_precision_casts": True})
_COMPILED: dict[bool, object] = {}  # on CUDA (CUDA graphs) or not -> torch.compile of forward


def auto_compile(model: DecoderLM, length: int | None = None) -> bool:
    """The rule of ``--compile auto`` (exact either way: a compiled step computes the same function): compile on
    CUDA (:data:`AUTO_COMPILE_DEVICES`; CUDA graphs make a step one launch) when the generation's ``length`` (prompt
    + new tokens; ``None``: not known) fits a static cache (:func:`fits_static_cache`), and not on the CPU, where the
    compile takes minutes and an eager step over a static cache is about as fast (BENCHMARKS.md, "Decoding
    SmolLM2-135M")."""
    parameters = next(model.parameters(), None)
    if parameters is None or parameters.device.type not in AUTO_COMPILE_DEVICES:
        return False
    return length is None or fits_static_cache(model, length)


def fits_static_cache(model: DecoderLM, length: int) -> bool:
    """Whether ``length`` tokens (prompt + new tokens) fit a static cache: always, except with learned positions,
    where a static cache holds the whole sequence in the model's ``max_seq_len`` positions (no sliding window)."""
    window = context_window(model.cfg)
    return window is None or length <= window


def check_fits_static_cache(model: DecoderLM, prompt: int, max_new_tokens: int) -> None:
    """``ValueError`` naming the fix when a ``prompt``-token prompt and ``max_new_tokens`` do not fit a static cache
    (:func:`fits_static_cache`)."""
    if fits_static_cache(model, prompt + max_new_tokens):
        return
    window = context_window(model.cfg)
    default = (
        "decode on the default cache, which slides a window (static_cache=False and compile=False; tformer sample "
        "--compile off)"
    )
    if prompt >= window:
        raise ValueError(
            f"a static cache holds the whole sequence, and the prompt's {prompt} tokens already fill the model's "
            f"{window} learned positions; shorten the prompt, or {default}"
        )
    raise ValueError(
        f"a static cache holds the whole sequence: prompt {prompt} + max_new_tokens {max_new_tokens} exceeds the "
        f"model's {window} learned positions; lower max_new_tokens to <= {window - prompt} (--max-new-tokens), or "
        f"{default}"
    )


def auto_static_cache(model: DecoderLM, length: int | None = None) -> bool:
    """The rule ``tformer sample`` follows when it does not compile: decode over a static cache when every block
    runs a decode step as one kernel call there (:func:`tformer.engine.fused.fits`: the CPU, Llama-style blocks, the
    kernels built, float32 or bfloat16) and the generation's ``length`` (prompt + new tokens; ``None``: not known)
    fits the trained context (``max_seq_len``); else over the growing cache, whose memory follows the tokens made.
    The reason: the fused step runs no Python between the products (BENCHMARKS.md, "Decoding SmolLM2-135M")."""
    parameters = next(model.parameters(), None)
    if parameters is None or parameters.device.type != "cpu" or not kernels.uses_block_kernel():
        return False
    if model.decoder.embed.tokens.weight.dtype not in (torch.float32, torch.bfloat16):  # the kernel's (float16: no)
        return False
    if length is not None and length > model.cfg.max_seq_len:
        return False
    return all(fused.fits(block) for block in model.decoder.stack.blocks)


def _available_memory(meminfo: str = "/proc/meminfo") -> tuple[int, str] | None:
    """Bytes of memory a new allocation can take without swapping, and what they are: Linux's ``MemAvailable``
    (free memory plus the caches the kernel can drop), else the machine's physical memory; ``None`` where the OS
    says neither."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "in all"
    except (AttributeError, ValueError, OSError):
        return None


def _check_fits(model: DecoderLM, batch: int, positions: int) -> None:
    """``ValueError`` when a static cache of ``positions`` for ``batch`` rows needs more bytes than the machine has
    available (:func:`_available_memory`): it is allocated before the first token, so a huge ``max_new_tokens`` would
    fail there with an allocator's error, or swap, even when an EOS would end the row at once."""
    memory = _available_memory()
    if memory is None:
        return
    available, what = memory
    cfg = model.cfg
    width = next(model.parameters()).element_size() * cfg.head_dim * cfg.kv_heads
    needed = 2 * cfg.num_layers * batch * positions * width  # keys and values, every block
    if needed > available:
        rows = f"{batch} row{'s' * (batch != 1)}"
        raise ValueError(
            f"a static cache of {positions} positions for {rows} needs {needed / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB of memory {what}; lower max_new_tokens (--max-new-tokens), or decode "
            "on the default cache, which grows with the tokens made (static_cache=False and compile=False; tformer "
            "sample --compile off)"
        )


def round_up(n: int, to: int = BUCKET) -> int:
    return max(to, math.ceil(n / to) * to)


class StaticLM:
    """:class:`tformer.generation.sampling.IncrementalLM`'s interface (``prefill``, ``step``, ``ids``, ``length``)
    over a static cache of ``P + max_new_tokens`` positions (rounded up to buckets when compiling).

    ``replay``: ``None``, or once a compiled CPU step has run, ``(graph, arguments)``: the step's compiled graph and
    the tensors it takes, which every later step of this generation calls directly (the module docstring)."""

    def __init__(self, model: DecoderLM, ids: Tensor, mask: Tensor | None, *, max_new_tokens: int, compile: bool):
        B, P = ids.shape
        check_fits_static_cache(model, P, max_new_tokens)
        _check_fits(model, B, P + max_new_tokens)
        device = ids.device
        if mask is None:
            mask = torch.ones(B, P, dtype=torch.bool, device=device)
        pad = (round_up(P) - P) if compile else 0  # left-pad to the bucket: padding is masked, positions unchanged
        if pad:
            ids = torch.cat([ids.new_full((B, pad), model.cfg.pad_id or 0), ids], dim=1)
            mask = torch.cat([mask.new_zeros(B, pad), mask], dim=1)
        self.capacity = round_up(P + pad + max_new_tokens) if compile else P + max_new_tokens
        self.ids = ids.new_empty(B, P + pad + max_new_tokens)  # the prompt, then the generated tokens
        self.ids[:, : P + pad] = ids
        self.length = P + pad
        self.keys = torch.zeros(B, self.capacity, dtype=torch.bool, device=device)  # (B, S): real, written columns
        self.keys[:, : P + pad] = mask
        self.prompt_positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P): left padding does not count
        self.position = self.prompt_positions[:, -1:] + 1  # (B, 1): the next token's position, advanced in place
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the next token's column, advanced in place
        self.token = ids.new_zeros(B, 1)  # the step's input: the same tensor at every step, its value copied in
        self.cache = static_cache(model, self.capacity)
        dtype = model.decoder.embed.tokens.weight.dtype  # what the blocks compute in, and their keys and values
        for layer in self.cache:  # before any graph runs: a CUDA graph must not own the storage (allocate says why)
            layer.self_kv.allocate(B, model.cfg.kv_heads, model.cfg.head_dim, dtype, device)
        self.forward, self.recorder = compiled_forward(model) if compile else (functools.partial(forward, model), None)
        self.replay: tuple | None = None  # (graph, arguments): the compiled step, called without dynamo
        self.compiled = compile
        self.steps = 0

    def keep(self, tokens: Tensor) -> None:
        """Append ``tokens (B,)`` without running the model (the last token of a generation)."""
        self.ids[:, self.length] = tokens
        self.length += 1

    def prefill(self) -> Tensor:
        """Logits of the token after the prompt ``(B, V)``; the prompt's keys and values go to columns ``0 .. P-1``."""
        start = time.perf_counter()
        slots = torch.arange(self.length, device=self.ids.device)
        for layer in self.cache:
            layer.self_kv.slots = slots
        prompt = self.ids[:, : self.length].contiguous()  # its own strides: the graph must not see the buffer width
        logits = self._forward(prompt, self.keys, self.cache, self.prompt_positions, last_only=True)[:, -1]
        if self.recorder is not None:
            self.recorder.last = None  # it would hold this generation's cache
        for layer in self.cache:
            layer.self_kv.slots = self.slot  # every step writes the column this tensor holds
        self.slot.fill_(self.length)
        if self.compiled:
            LAST_TIMINGS.clear()
            LAST_TIMINGS["prefill"] = time.perf_counter() - start
        return logits

    def step(self, tokens: Tensor) -> Tensor:
        """Append ``tokens (B,)``; logits of the token after them ``(B, V)``."""
        start = time.perf_counter()
        self.ids.select(1, self.length).copy_(tokens)
        self.keys.index_fill_(1, self.slot, True)
        self.token.copy_(tokens[:, None])
        if self.replay is not None:
            graph, args = self.replay
            logits = graph(*args)[0][:, -1]
        else:
            # The first step runs dynamo's guards and chooses the graph. Every later step passes the same objects with
            # the same shapes, so none of dynamo's work would change its outcome: where the graph can be called
            # directly (_take_replay), it is; otherwise only the guards that tell cached graphs apart run.
            later = self.compiled and self.steps
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True) if later else contextlib.nullcontext():
                out = self._forward(self.token, self.keys, self.cache, self.position)
            if self.recorder is not None:
                if not self.steps and REPLAY:
                    self.replay = self._take_replay(out)
                self.recorder.last = None  # it would hold this generation's cache (every step, if not replaying)
            logits = out[:, -1]
        self.length += 1
        self.slot.add_(1)
        self.position.add_(1)
        self.steps += 1
        if self.steps == 1 and self.compiled:
            LAST_TIMINGS["first step"] = time.perf_counter() - start
        return logits

    def _forward(self, *args, **kwargs) -> Tensor:
        try:
            return self.forward(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise _recompile_limit_error() from err

    def _take_replay(self, out: Tensor) -> tuple | None:
        """The first compiled step's graph and arguments, if calling the graph is all that the step did: the recorded
        call took this step's token tensor and returned exactly ``out`` (no output that dynamo's bytecode around the
        graph turned into something else, no side effect for it to replay). A later step then writes its token into
        the same tensor and calls the graph with the same arguments: the tensors dynamo's guards checked at the first
        step, mutated in place since (the cache, the key mask, the positions, the slot). ``None``: keep calling
        through dynamo."""
        if self.recorder.last is None:
            return None
        graph, args, outputs = self.recorder.last
        if len(outputs) == 1 and outputs[0] is out and any(a is self.token for a in args):
            return graph, args
        return None
