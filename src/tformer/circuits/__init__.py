"""Circuit tools on the hook points (:mod:`tformer.hooks`): the residual stream decomposed, the logit lens, direct
logit attribution, head ablation, activation patching and induction scores. Each is checked on what it means, not
only on shapes (``tests/circuits``); the walk-through: ``docs/circuits.md``.
"""

from tformer.circuits.decompose import (
    Decomposition,
    Lens,
    decompose,
    logit_attribution,
    logit_lens,
    unembedding,
)
from tformer.circuits.interventions import (
    ablate_heads,
    head_means,
    induction_scores,
    logit_diff,
    patch_heads,
    patch_residual,
    repeated_loss,
    repeated_tokens,
    restored,
)

__all__ = [
    "Decomposition",
    "Lens",
    "ablate_heads",
    "decompose",
    "head_means",
    "induction_scores",
    "logit_attribution",
    "logit_diff",
    "logit_lens",
    "patch_heads",
    "patch_residual",
    "repeated_loss",
    "repeated_tokens",
    "restored",
    "unembedding",
]
