"""The demos' settings, as data: :mod:`tformer.training.demos` runs them, and the command line shows them in
``tformer train-demo --help`` and ``tformer demo --help`` without importing torch."""

from __future__ import annotations

# The main job (make demo, tformer train-demo): a 4-layer GPT on the Python stdlib
DEMO_MODEL = dict(d_model=128, num_heads=4, num_layers=4, d_ff=512, dropout=0.0)
DEMO = dict(
    steps=1800,
    batch_size=16,
    block_size=128,
    lr=2e-3,
    min_lr=2e-4,
    warmup=100,
    eval_every=250,
    eval_batches=16,
    save_every=400,
    log_every=10,
)
# tformer demo: a small encoder-decoder learns a built-in task (the defaults of demos.run_demo)
SEQ2SEQ_DEMO = dict(steps=1500, batch_size=64, lr=2e-3, seed=0)

__all__ = ["DEMO", "DEMO_MODEL", "SEQ2SEQ_DEMO"]
