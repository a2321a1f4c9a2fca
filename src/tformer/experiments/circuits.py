"""``circuits``: a published finding reproduced on real weights, with the circuit tools of :mod:`tformer.circuits`.

Claim (Olsson et al., 2022, "In-context learning and induction heads"): language models hold induction heads,
heads that attend from a token to the token after its earlier occurrence and copy it. On random tokens repeated
twice the model predicts the second half almost perfectly, and this rests on a few heads: removing them destroys
the copying, removing as many other heads does not. With it, direct logit attribution (Elhage et al., 2021):
the logit of a token is a sum of what each head and feed-forward layer wrote into the residual stream.

Measured on each model of ``models``: ``smollm2`` (SmolLM2-135M-Instruct, the shipped GGUF dequantized to float32),
``demo`` (the byte-level model ``make demo`` trains on the Python standard library, read from ``demo_path``; skipped,
saying so, when it has not been trained) and ``toy`` (a 2-layer model whose induction circuit is set by hand,
:func:`tformer.experiments._planted.planted_model`: the quick size and the tests).

1. Induction score (:func:`tformer.circuits.induction_scores`): ``batch`` sequences of ``length`` random tokens
   (SmolLM2: ids in [1000, 20000), ordinary word pieces, after its BOS token; the demo model: printable ASCII bytes)
   repeated twice; a head's score is its mean attention from each token of the repeat to the token after that
   token's first occurrence (1: a perfect induction head).
2. Ablation (:func:`tformer.circuits.ablate_heads`): the next-token loss on the repeated half (clean, and with the
   top-``k`` heads by score set to zero or to their mean output over another draw of such sequences), against
   ``k`` heads drawn at random from all heads, ``draws`` times (the same draws for both kinds of ablation).
3. Direct logit attribution (:func:`tformer.circuits.logit_attribution`): each head's and each feed-forward layer's
   share of the logit of the expected next token (SmolLM2: " Paris" after "The capital of France is"; demo: "f"
   after "        return sel") and of its difference to a wrong one (" London"; "e"), through the final norm
   with its scale held; the shares must sum to the model's own logit (difference).

Shapes: NL, H, B, T, V, Nc (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tformer.circuits import (
    ablate_heads,
    head_means,
    induction_scores,
    logit_attribution,
    repeated_loss,
    repeated_tokens,
)
from tformer.experiments._common import Table, fmt, new_figure, save_figure
from tformer.experiments._planted import planted_model

QUESTION = "Q+ circuits"  # beyond the source's questions: a published finding
TITLE = "Induction heads and direct logit attribution on real weights"
CLAIM = (
    "Olsson et al. (2022): language models hold induction heads, which attend from a token to the token after its "
    "earlier occurrence and copy it; ablating the few heads with the highest induction score raises the loss on "
    "repeated random tokens by far more than ablating as many random heads. Direct logit attribution splits a "
    "logit into what each head and feed-forward layer wrote."
)
SIZES: dict[str, dict] = {
    "quick": dict(models=("toy",), batch=4, length=12, ks=(1, 2), draws=10),
    "report": dict(models=("smollm2", "demo"), batch=4, length=60, ks=(3, 6), draws=10),
}
MODELS = ("smollm2", "demo", "toy")
DEMO_PATH = "runs/demo"
TOP_HEADS = 8  # rows of the induction-score table per model
TOP_COMPONENTS = 10  # rows of the attribution table and bars of its chart per model
NO_INDUCTION = 0.1  # a top score below this: the model has no induction head to test


@dataclass
class Ablation:
    """The repeated-half loss with the top-``k`` heads ablated (``kind``) and with ``k`` random heads, per draw."""

    k: int
    kind: str
    top: float
    random: list[float]

    @property
    def random_mean(self) -> float:
        return sum(self.random) / len(self.random)


@dataclass
class Attribution:
    """Direct logit attribution at the prompt's last position: per component, the share of ``logit(token)`` and of
    ``logit(token) - logit(against)``; the model's own values (output bias removed) to check the sums against."""

    prompt: str
    token: str
    against: str
    labels: list[str]
    logit: list[float]
    diff: list[float]
    model_logit: float
    model_diff: float
    prob: float  # the model's probability of ``token``
    rank: int  # its rank among the next-token logits (1: the most likely)

    def top(self, n: int = TOP_COMPONENTS) -> list[int]:
        """The indices of the ``n`` components with the largest |share of the difference|."""
        return sorted(range(len(self.labels)), key=lambda i: -abs(self.diff[i]))[:n]


@dataclass
class ModelCircuits:
    """What :func:`run` measured on one model (``skipped``: why it was not measured, with nothing else set)."""

    name: str
    about: str = ""
    skipped: str = ""
    scores: list[list[float]] = field(default_factory=list)  # (NL, H) induction scores
    batch: int = 0
    length: int = 0
    first_loss: float = 0.0  # mean loss on the first (random, unpredictable) half
    clean_loss: float = 0.0  # on the repeated half
    ablations: list[Ablation] = field(default_factory=list)
    attribution: Attribution | None = None

    def ranked(self) -> list[tuple[int, int, float]]:
        """Every head as ``(layer, head, score)``, highest score first."""
        heads = [(layer, h, s) for layer, row in enumerate(self.scores) for h, s in enumerate(row)]
        return sorted(heads, key=lambda t: -t[2])


@dataclass
class CircuitsResult:
    models: list[ModelCircuits]
    seed: int

    def measured(self) -> list[ModelCircuits]:
        return [m for m in self.models if not m.skipped]

    def tables(self) -> list[Table]:
        heads, ablations, dla = [], [], []
        for m in self.measured():
            top = m.ranked()[:TOP_HEADS]
            heads += [(m.name, str(i + 1), f"L{layer}H{h}", f"{s:.3f}") for i, (layer, h, s) in enumerate(top)]
            for a in m.ablations:
                rise, rand = a.top - m.clean_loss, a.random_mean - m.clean_loss
                ratio = fmt(rise / rand) if rand > 0 else "-"
                cells = (fmt(m.clean_loss), fmt(a.top), fmt(a.random_mean), fmt(max(a.random)), ratio)
                ablations.append((m.name, a.kind, str(a.k), *cells))
            if m.attribution is not None:
                at = m.attribution
                for i in at.top():
                    dla.append((m.name, at.labels[i], f"{at.logit[i]:+.3f}", f"{at.diff[i]:+.3f}"))
                dla.append((m.name, "sum of all components", f"{sum(at.logit):+.3f}", f"{sum(at.diff):+.3f}"))
                dla.append((m.name, "the model's own", f"{at.model_logit:+.3f}", f"{at.model_diff:+.3f}"))
        n = self.measured()[0].batch if self.measured() else 0
        columns = ("model", "ablation", "k", "clean", "top-k ablated", "random-k: mean", "random-k: max")
        tables = [
            Table(("model", "rank", "head", "induction score"), tuple(heads), "The heads with the highest score"),
            Table(
                (*columns, "rise top / rise random"),
                tuple(ablations),
                f"Loss (nats) on the repeated half, {n} sequences; random: {self._draws()} draws of k heads",
            ),
        ]
        tables.append(
            Table(
                ("model", "component", "share of logit(token)", "share of the difference"),
                tuple(dla),
                f"Direct logit attribution: the {TOP_COMPONENTS} largest shares of the difference",
            )
        )
        return [t for t in tables if t.rows]  # none when no model was measured

    def _draws(self) -> int:
        return next((len(a.random) for m in self.measured() for a in m.ablations), 0)

    def findings(self) -> list[str]:
        out = []
        for m in self.models:
            if m.skipped:
                out.append(f"{m.name}: not measured: {m.skipped}")
                continue
            layer, h, s = m.ranked()[0]
            second = m.ranked()[1][2] if len(m.ranked()) > 1 else 0.0
            out.append(
                f"{m.name} ({m.about}): the top induction head is L{layer}H{h} (score {s:.2f}; the next "
                f"{second:.2f}); the loss on the repeated half is {fmt(m.clean_loss)} nats against "
                f"{fmt(m.first_loss)} on the first, random half"
            )
            if s < NO_INDUCTION:
                out.append(
                    f"{m.name}: no induction head (no score reaches {NO_INDUCTION}) and the repeat is predicted "
                    f"{'about as badly as' if m.first_loss - m.clean_loss < 1 else 'better than'} the first half: "
                    "the ablations below remove heads that do not copy, so they do not test the claim on this model"
                )
            for a in m.ablations:
                rise, rand = a.top - m.clean_loss, a.random_mean - m.clean_loss
                times = f": {rise / rand:.3g}x the random heads' rise" if rand > 0 else ""
                out.append(
                    f"{m.name}, {a.kind} ablation of k={a.k} heads: the loss on the repeated half rises by "
                    f"{fmt(rise)} nats with the top-k heads, by {fmt(rand)} on average with k random heads (at most "
                    f"{fmt(max(a.random) - m.clean_loss)}, {len(a.random)} draws){times}"
                )
            at = m.attribution
            if at is not None:
                best = at.top(3)
                shares = ", ".join(f"{at.labels[i]} {at.diff[i]:+.2f}" for i in best)
                error = max(abs(sum(at.logit) - at.model_logit), abs(sum(at.diff) - at.model_diff))
                out.append(
                    f"{m.name}, {at.token!r} after {at.prompt!r} (p = {at.prob:.3f}, rank {at.rank}): logit "
                    f"{at.model_logit:.3f}, difference to {at.against!r} {at.model_diff:.3f}; the largest shares of "
                    f"the difference: {shares}; the {len(at.labels)} shares sum to the model's own values within "
                    f"{error:.1e}"
                )
        return out

    def plot(self, out_dir: Path) -> list[Path]:
        shown = self.measured()
        fig, axes = new_figure(3, max(len(shown), 1), size=(4.6, 3.6))
        for row, m in enumerate(shown):
            _plot_scores(axes[row, 0], m)
            _plot_ablation(axes[row, 1], m)
            _plot_attribution(axes[row, 2], m)
        if not shown:
            axes[0, 0].text(0.5, 0.5, "no model measured", ha="center")
        return [save_figure(fig, out_dir, "circuits")]


def _plot_scores(ax, m: ModelCircuits) -> None:
    from matplotlib.ticker import MaxNLocator

    image = ax.imshow(m.scores, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set(xlabel="head", ylabel="layer", title=f"{m.name}: induction score")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.figure.colorbar(image, ax=ax)


def _plot_ablation(ax, m: ModelCircuits) -> None:
    x = range(len(m.ablations))
    top = [a.top for a in m.ablations]
    mean = [a.random_mean for a in m.ablations]
    up = [max(a.random) - a.random_mean for a in m.ablations]
    ax.bar([i - 0.2 for i in x], top, 0.4, label="top-k heads", color="tab:red")
    ax.bar([i + 0.2 for i in x], mean, 0.4, yerr=[[0] * len(up), up], label="random k (mean, max)", color="tab:gray")
    ax.axhline(m.clean_loss, color="k", lw=0.8, ls="--", label="clean")
    ax.axhline(m.first_loss, color="tab:blue", lw=0.8, ls=":", label="first half (random)")
    ax.set_xticks(list(x), [f"{a.kind}\nk={a.k}" for a in m.ablations])
    ax.set(ylabel="loss on the repeated half (nats)", title=f"{m.name}: ablation")
    ax.legend(fontsize=6)


def _plot_attribution(ax, m: ModelCircuits) -> None:
    at = m.attribution
    if at is None:
        ax.axis("off")
        return
    best = at.top()[::-1]
    colors = ["tab:green" if at.diff[i] > 0 else "tab:purple" for i in best]
    ax.barh([at.labels[i] for i in best], [at.diff[i] for i in best], color=colors)
    ax.axvline(0, color="k", lw=0.6)
    ax.set(xlabel=f"logit({at.token!r}) - logit({at.against!r})", title=f"{m.name}: direct logit attribution")
    ax.tick_params(axis="y", labelsize=7)


@dataclass
class Subject:
    """A model to measure, with how to draw its random tokens and the prompt of its logit attribution."""

    name: str
    model: nn.Module
    about: str
    low: int  # random tokens are drawn from [low, high)
    high: int
    prefix: tuple[int, ...]  # put before each sequence (a BOS token)
    prompt: list[int]
    prompt_text: str
    token: int
    token_text: str
    against: int
    against_text: str


def _subject(name: str, demo_path: str | Path) -> Subject | str:
    """The model ``name`` and its settings, or why it cannot be measured here."""
    if name == "toy":
        model = planted_model()
        vocab, length = model.cfg.vocab_size, 12
        ids = repeated_tokens(vocab, length, batch=1, seed=99, prefix=(0,), low=1)[0].tolist()
        cut = 1 + length + length // 2  # half-way into the repeat
        token = ids[cut]
        against = next(t for t in ids[1:] if t != token)  # another token of the sequence
        about = "2 layers x 8 heads, the induction circuit set by hand (planted_model); token 0 as BOS"
        text = f"token 0 then {length} random tokens, repeated up to its {length // 2}th"
        return Subject(
            name,
            model,
            about,
            low=1,
            high=vocab,
            prefix=(0,),
            prompt=ids[:cut],
            prompt_text=text,
            token=token,
            token_text=str(token),
            against=against,
            against_text=str(against),
        )
    if name == "smollm2":
        from tformer.interop import load_pretrained, shipped

        if not shipped.locate("smollm2").exists():
            return shipped.missing("smollm2")
        pretrained = load_pretrained("smollm2", dtype=torch.float32)
        tok, bos = pretrained.tokenizer, pretrained.generation.bos
        text, paris, london = "The capital of France is", " Paris", " London"
        ids = [bos, *tok.encode(text)]
        about = "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32, 30 layers x 9 heads"
        return Subject(
            name,
            pretrained.model,
            about,
            low=1000,
            high=20000,
            prefix=(bos,),
            prompt=ids,
            prompt_text=text,
            token=tok.encode(paris)[0],
            token_text=paris,
            against=tok.encode(london)[0],
            against_text=london,
        )
    if name == "demo":
        from tformer.training.checkpoint import CheckpointError, load_checkpoint

        try:
            ckpt = load_checkpoint(demo_path)
        except (CheckpointError, FileNotFoundError, ValueError) as err:
            first = str(err).splitlines()[0]
            return f"no demo checkpoint at {demo_path} ({first}); `make demo` trains it (a few minutes)"
        tok, cfg = ckpt.tokenizer, ckpt.model.cfg
        text = "        return sel"
        about = f"the make-demo byte-level model, step {ckpt.step}: {cfg.num_layers} layers x {cfg.num_heads} heads"
        return Subject(
            name,
            ckpt.model.float().eval(),
            about,
            low=32,
            high=127,
            prefix=(),
            prompt=tok.encode(text),
            prompt_text=text,
            token=tok.encode("f")[0],
            token_text="f",
            against=tok.encode("e")[0],
            against_text="e",
        )
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _first_half_loss(model: nn.Module, ids: torch.Tensor, length: int, prefix: int) -> float:
    """The mean next-token loss over the first half (tokens 2..length of it: the first follows only the prefix)."""
    with torch.no_grad():
        logits = model(ids)[:, prefix : prefix + length - 1].float()  # (B, length - 1, V)
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, prefix + 1 : prefix + length].flatten()))


def _attribution(s: Subject) -> Attribution:
    ids = torch.tensor([s.prompt])
    with torch.no_grad():
        labels, logit = logit_attribution(s.model, ids, s.token)  # (Nc, 1)
        _, diff = logit_attribution(s.model, ids, s.token, against=s.against)
        logits = s.model(ids)[0, -1].float()  # (V,)
    head = getattr(s.model, "head", None)
    bias = head.bias if head is not None and getattr(head, "bias", None) is not None else torch.zeros_like(logits)
    own = logits - bias
    rank = int((logits > logits[s.token]).sum()) + 1
    return Attribution(
        s.prompt_text,
        s.token_text,
        s.against_text,
        labels,
        logit[:, 0].tolist(),
        diff[:, 0].tolist(),
        float(own[s.token]),
        float(own[s.token] - own[s.against]),
        float(logits.softmax(-1)[s.token]),
        rank,
    )


def measure(
    s: Subject, batch: int, length: int, ks: tuple[int, ...], draws: int, seed: int, kinds: tuple[str, ...]
) -> ModelCircuits:
    """Induction scores, the ablations and the logit attribution of one model."""
    model, prefix = s.model, len(s.prefix)
    limit = getattr(model.cfg, "max_seq_len", None) if model.cfg.position == "learned" else None
    length = min(length, (limit - prefix) // 2) if limit else length
    ids = repeated_tokens(s.high, length, batch, seed, s.prefix, low=s.low)  # (B, prefix + 2 length)
    scores = induction_scores(model, ids, length, prefix)  # (NL, H)
    NL, H = scores.shape
    m = ModelCircuits(s.name, s.about, scores=scores.tolist(), batch=batch, length=length)
    m.first_loss = _first_half_loss(model, ids, length, prefix)
    m.clean_loss = repeated_loss(model, ids, length, prefix)
    ranked = [(layer, h) for layer, h, _ in m.ranked()]
    gen = torch.Generator().manual_seed(seed)
    drawn = {k: [torch.randperm(NL * H, generator=gen)[:k].tolist() for _ in range(draws)] for k in ks}
    reference = repeated_tokens(s.high, length, batch, seed + 1, s.prefix, low=s.low)
    means = head_means(model, reference) if "mean" in kinds else None
    for kind in kinds:
        for k in ks:
            top = repeated_loss(model, ids, length, prefix, ablate_heads(model, ranked[:k], kind, means))
            rand = [
                repeated_loss(model, ids, length, prefix, ablate_heads(model, [divmod(i, H) for i in d], kind, means))
                for d in drawn[k]
            ]
            m.ablations.append(Ablation(k, kind, top, rand))
    m.attribution = _attribution(s)
    return m


def run(
    models: tuple[str, ...] = ("smollm2", "demo"),
    batch: int = 4,
    length: int = 60,
    ks: tuple[int, ...] = (3, 6),
    draws: int = 10,
    seed: int = 0,
    kinds: tuple[str, ...] = ("zero", "mean"),
    demo_path: str | Path = DEMO_PATH,
) -> CircuitsResult:
    """Measure each of ``models`` (``"smollm2"``, ``"demo"``, ``"toy"``) on ``batch`` sequences of ``length``
    random tokens repeated twice (cut to the model's context for learned positions), ablating the top ``k`` and
    ``k`` random heads (``draws`` draws) for each ``k`` in ``ks`` and each ablation of ``kinds``."""
    if batch < 1 or length < 2 or draws < 1 or not ks or min(ks) < 1:
        raise ValueError(f"need batch >= 1, length >= 2, draws >= 1 and ks >= 1; got {batch}, {length}, {draws}, {ks}")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    out = []
    for name in models:
        subject = _subject(name, demo_path)
        if isinstance(subject, str):
            out.append(ModelCircuits(name, skipped=subject))
            continue
        out.append(measure(subject, batch, length, tuple(ks), draws, seed, tuple(kinds)))
    return CircuitsResult(out, seed)


__all__ = ["CircuitsResult", "ModelCircuits", "measure", "planted_model", "run"]
