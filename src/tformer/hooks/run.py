"""Attach hooks to a model's points; run it with a cache of activations or with interventions.

A hook is ``fn(activation, hook)``: it reads the activation (``hook.name``, ``hook.layer()`` say where) and returns
``None`` to leave it, or a tensor of the same shape to replace it, which the rest of the forward then uses.

Shapes: B, T, H, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from tformer.hooks.points import HEAD_POINTS, NameFilter, Point, model_of, num_blocks, points, select
from tformer.layers import Tapped

HookFn = Callable[[Tensor, "Hook"], "Tensor | None"]


class HookError(ValueError):
    """A hook returned something its point cannot take."""


class Hook:
    """What a hook function is told about its point: ``name`` and :meth:`layer` (TransformerLens's ``HookPoint``)."""

    __slots__ = ("name", "_layer")

    def __init__(self, point: Point) -> None:
        self.name, self._layer = point.name, point.layer

    def layer(self) -> int:
        """The block this point belongs to; ``ValueError`` outside the blocks."""
        if self._layer is None:
            raise ValueError(f"{self.name} is not inside a block")
        return self._layer

    def __repr__(self) -> str:
        return f"Hook({self.name!r})"


class Taps:
    """The hooks attached to one module's points (the ``taps`` of :class:`tformer.layers.Tapped`)."""

    __slots__ = ("hooks", "count")

    def __init__(self) -> None:
        self.hooks: dict[str, list[tuple[Hook, HookFn]]] = {}
        self.count = 0  # the root model's: how many hooks the whole model holds

    def wants(self, *names: str) -> bool:
        return any(name in self.hooks for name in names)

    def __call__(self, name: str, x: Tensor) -> Tensor:
        entries = self.hooks.get(name)
        if not entries:
            return x
        heads = name in HEAD_POINTS
        value = x.transpose(1, 2) if heads else x  # (B, H, T, D) -> TransformerLens's (B, T, H, D)
        for hook, fn in entries:
            out = fn(value, hook)
            if out is None:
                continue
            if not isinstance(out, Tensor) or out.shape != value.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise HookError(
                    f"the hook at {hook.name} returned {got}; the point holds {tuple(value.shape)}: return a tensor "
                    "of that shape, or None to leave the activation as it is"
                )
            value = out.to(value.dtype)
        return value.transpose(1, 2) if heads else value


class Handle:
    """Hooks attached by :func:`attach`; :meth:`remove` takes them off (also on leaving a ``with`` block)."""

    def __init__(self, root: Tapped | None, entries: list[tuple[Tapped, str, tuple[Hook, HookFn]]]) -> None:
        self.root, self.entries = root, entries

    def remove(self) -> None:
        for module, local, entry in self.entries:
            taps = module.taps
            if taps is None:
                continue
            kept = [e for e in taps.hooks.get(local, []) if e is not entry]
            if kept:
                taps.hooks[local] = kept
            else:
                taps.hooks.pop(local, None)
            if not taps.hooks and module is not self.root:
                module.taps = None
        if self.root is not None and self.root.taps is not None:
            self.root.taps.count -= len(self.entries)
            if self.root.taps.count <= 0 and not self.root.taps.hooks:
                self.root.taps = None
        self.entries = []

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _root(model: nn.Module) -> Tapped | None:
    inner = model_of(model)
    return inner if isinstance(inner, Tapped) else None


def attach(model: nn.Module, hooks: Sequence[tuple[NameFilter, HookFn]]) -> Handle:
    """Attach ``hooks``, a list of ``(name_or_filter, fn)``, to ``model``'s points until :meth:`Handle.remove`.

    ``name_or_filter``: a point's name, a list of names, or a predicate on names. The root model's ``taps`` is set
    while any hook is attached, so decoding knows at no cost that its fused and compiled paths must step aside."""
    entries = []
    for names, fn in hooks:
        if not callable(fn):
            raise TypeError(f"a hook is (name_or_filter, fn) with fn(activation, hook); got {fn!r} for {names!r}")
        for point in select(model, names, default_all=False):
            entry = (Hook(point), fn)
            if point.module.taps is None:
                point.module.taps = Taps()
            point.module.taps.hooks.setdefault(point.local, []).append(entry)
            entries.append((point.module, point.local, entry))
    root = _root(model)
    if root is not None and entries:  # no point picked: the model stays unhooked (decoding keeps its fast paths)
        if root.taps is None:
            root.taps = Taps()
        root.taps.count += len(entries)
    return Handle(root, entries)


@contextlib.contextmanager
def hooks(model: nn.Module, fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()) -> Iterator[Handle]:
    """``with hooks(model, [(name, fn), ...]):`` the hooks fire in every forward inside the block (a decoding loop,
    :func:`tformer.generate` too), and are removed on leaving it, also on an error."""
    handle = attach(model, fwd_hooks)
    try:
        yield handle
    finally:
        handle.remove()


def remove_all(model: nn.Module) -> None:
    """Take every hook off ``model`` (what an interrupted notebook cell may leave)."""
    for point in points(model).values():
        point.module.taps = None
    root = _root(model)
    if root is not None:
        root.taps = None


class ActivationCache(dict):
    """Activations by hook-point name, each detached and holding only its own bytes.

    ``cache["blocks.0.attn.hook_pattern"]``, or TransformerLens's short form ``cache["pattern", 0]`` (and
    ``cache["scale", 0, "ln1"]``)."""

    def __getitem__(self, key: str | tuple) -> Tensor:
        if isinstance(key, tuple):
            from tformer.hooks.points import act_name

            key = act_name(*key)
        try:
            return super().__getitem__(key)
        except KeyError:
            raise KeyError(f"{key!r} is not in this cache; it holds {len(self)} points: {', '.join(self)}") from None

    def nbytes(self) -> int:
        """The bytes the cached tensors hold, each storage counted once: two points that hold one tensor share it
        (``blocks.{i}.hook_resid_post`` is ``blocks.{i+1}.hook_resid_pre``; in a Pre-LN block ``hook_mlp_in`` is
        ``hook_resid_mid``)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.values()}
        return sum(storages.values())


def _own(t: Tensor, device: torch.device | str | None) -> Tensor:
    """``t`` detached, moved to ``device``, and copied when it is a view into a larger tensor (so the cache keeps
    only what it shows: a view of the fused q|k|v product would keep all three alive)."""
    t = t.detach()
    if device is not None:
        t = t.to(device)
    whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.itemsize
    return t if whole else t.clone(memory_format=torch.contiguous_format)


class _Stop(Exception):
    def __init__(self, value: Tensor) -> None:
        self.value = value


def _stop_hook(model: nn.Module, layer: int) -> tuple[str, HookFn]:
    """The hook that ends a forward at the residual stream entering block ``layer`` (``layer == depth``: leaving
    the last block), as TransformerLens's ``stop_at_layer``."""
    table, depth = points(model), num_blocks(model)
    if "blocks.0.hook_resid_pre" not in table:
        raise ValueError("stop_at_layer works on a single stack of blocks (a language model or an encoder)")
    if not isinstance(layer, int) or not 0 <= layer <= depth:
        raise ValueError(f"stop_at_layer={layer!r} is out of range: the model has {depth} blocks; give 0..{depth}")
    if layer < depth:
        name = f"blocks.{layer}.hook_resid_pre"
    else:
        last = f"blocks.{depth - 1}."
        post_ln = last + "hook_normalized_resid_post" in table  # Post-LN: the block's output is after its last norm
        name = last + ("hook_normalized_resid_post" if post_ln else "hook_resid_post")

    def stop(x: Tensor, hook: Hook) -> None:
        raise _Stop(x)

    return name, stop


def run_with_hooks(
    model: nn.Module,
    *args,
    fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
    hooks: Sequence[tuple[NameFilter, HookFn]] = (),
    stop_at_layer: int | None = None,
    **kwargs,
):
    """``model(*args, **kwargs)`` with ``hooks`` (or TransformerLens's ``fwd_hooks``) attached for this call only.

    ``stop_at_layer=n``: return the residual stream entering block ``n`` instead of the output."""
    all_hooks = [*fwd_hooks, *hooks]
    if stop_at_layer is not None:
        all_hooks.append(_stop_hook(model, stop_at_layer))
    with attach(model, all_hooks):
        try:
            return model(*args, **kwargs)
        except _Stop as stop:
            return stop.value


def run_with_cache(
    model: nn.Module,
    *args,
    names: NameFilter = None,
    names_filter: NameFilter = None,
    stop_at_layer: int | None = None,
    device: torch.device | str | None = None,
    grad: bool = False,
    fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = (),
    **kwargs,
) -> tuple[object, ActivationCache]:
    """``(output, cache)``: ``model(*args, **kwargs)`` and the activations at the points ``names`` picks
    (TransformerLens's ``names_filter`` is the same argument; ``None``: every point but ``hook_result``), and
    nothing else. ``stop_at_layer``: as :func:`run_with_hooks`. ``device``: where the cache goes (default: where
    the model runs). Without ``grad`` the forward runs under ``torch.no_grad()`` (no saved tensors).

    ``fwd_hooks`` run first, so the cache holds what they left."""
    picked = select(model, names if names is not None else names_filter)
    cache = ActivationCache()

    def keep(x: Tensor, hook: Hook) -> None:
        cache[hook.name] = _own(x, device)

    keepers = [([p.name for p in picked], keep)] if picked else []
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        out = run_with_hooks(model, *args, fwd_hooks=[*fwd_hooks, *keepers], stop_at_layer=stop_at_layer, **kwargs)
    return out, cache  # in firing order, the order of hook_names
