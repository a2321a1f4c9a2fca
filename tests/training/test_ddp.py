"""Data-parallel training: ``torchrun --nproc_per_node=2 -m tformer train`` (gloo, loopback) gives the losses of one
process with the same global batch.

Tolerance: relative 1e-5. The two runs see the same examples, but the data-parallel gradient is the all-reduced mean
of two half-batch gradients (and with accumulation, of micro-batch sums) while the one-process gradient sums all
rows at once: the same numbers added in another order, which in float32 differs by a few ulps (~1e-7 relative) per
step and compounds slowly through AdamW over a few steps.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tformer.training import TrainConfig, train
from tformer.training.checkpoint import list_checkpoints, load_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the value is {i * 37 % 101}\n" for i in range(400)))
    settings = dict(
        data=str(corpus),
        cache_dir=str(tmp_path / "cache"),
        steps=8,
        batch_size=8,
        grad_accum=2,
        block_size=16,
        model=dict(d_model=32, num_heads=4, num_layers=2, d_ff=64),
        warmup=2,
        eval_every=4,
        eval_batches=2,
        save_every=4,
        log_every=1,
        progress=False,
    )
    flags = [
        "--data",
        str(corpus),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--steps",
        "8",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--layers",
        "2",
        "--d-ff",
        "64",
        "--warmup",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--save-every",
        "4",
        "--log-every",
        "1",
        "--no-progress",
    ]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
    ]
    command = [*launcher, "-m", "tformer", "train", "--out", str(tmp_path / "ddp"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained to step 8") == 1  # rank 0 alone reports

    single = train(TrainConfig(out=str(tmp_path / "one"), **settings))
    records = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    ddp_losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))  # written once, by rank 0
    for step, loss in single.losses.items():
        assert abs(ddp_losses[step] - loss) <= 1e-5 * abs(loss), (step, ddp_losses[step], loss)
    ddp_val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    for step, loss in single.val_losses.items():
        assert abs(ddp_val[step] - loss) <= 1e-5 * abs(loss)
    assert [p.name for p in list_checkpoints(tmp_path / "ddp" / "checkpoints")] == ["step-000004", "step-000008"]
    a, b = load_checkpoint(tmp_path / "ddp").model.state_dict(), load_checkpoint(tmp_path / "one").model.state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
