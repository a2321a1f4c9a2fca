"""The batch samplers: every batch a pure function of (seed, index), fixed evaluation windows, held-out task sources
kept out of training."""

import numpy as np
import pytest
import torch

from tformer.tokenizers import BOS_ID as BOS
from tformer.tokenizers import EOS_ID as EOS
from tformer.tokenizers import PAD_ID as PAD
from tformer.training.batches import LMBatches, Seq2SeqBatches
from tformer.training.tasks import SequenceTask


def test_lm_batches_are_a_pure_function_of_seed_and_index():
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = LMBatches(tokens, block_size=16, batch_size=6, seed=3)
    a, b = sampler.get(5), sampler.get(5)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.offsets, sampler.get(6).offsets)
    assert not np.array_equal(a.offsets, LMBatches(tokens, 16, 6, seed=4).get(5).offsets)
    x, y = a.rows(0, 6)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert int(y.max()) <= 999 and a.num_tokens == 6 * 16
    shards = torch.cat([a.rows(0, 2)[0], a.rows(2, 4)[0], a.rows(4, 6)[0]])  # ranks' rows = the global batch
    assert torch.equal(shards, x)


def test_lm_evaluation_windows_are_fixed_and_spread():
    sampler = LMBatches(np.arange(500, dtype=np.uint16), block_size=10, batch_size=4, seed=0)
    batches = sampler.evaluation(3)
    offsets = np.concatenate([b.offsets for b in batches])
    assert len(batches) == 3 and offsets[0] == 0 and offsets[-1] == 500 - 11
    np.testing.assert_array_equal(offsets, np.concatenate([b.offsets for b in sampler.evaluation(3)]))


def test_lm_batches_reject_a_split_shorter_than_a_window():
    with pytest.raises(ValueError, match="too short for windows of block_size=64"):
        LMBatches(np.arange(50, dtype=np.uint16), block_size=64, batch_size=2, seed=0)


def test_task_batches_exclude_held_out_and_are_deterministic():
    task = SequenceTask("reverse", max_len=3, num_symbols=3)
    held = set(task.held_out(20, seed=1))
    sampler = Seq2SeqBatches(64, seed=0, task=task, exclude=held)
    batch = sampler.get(0)
    assert len(batch) == 64 and not {s for s, _ in batch.pairs} & held
    assert batch.pairs == sampler.get(0).pairs and batch.pairs != sampler.get(1).pairs
    src, src_mask, tgt_in, tgt_out, tgt_mask = batch.rows(0, 5)
    assert (tgt_in[:, 0] == BOS).all()
    for i, (s, t) in enumerate(batch.pairs[:5]):
        assert src[i, : len(s)].tolist() == list(s) and src_mask[i].sum() == len(s)
        assert tgt_out[i, : len(t) + 1].tolist() == [*t, EOS] and (tgt_out[i, len(t) + 1 :] == PAD).all()
        assert tgt_mask[i].sum() == len(t) + 1
    assert batch.num_tokens == sum(len(t) + 1 for _, t in batch.pairs)
