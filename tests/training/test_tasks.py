"""The built-in seq2seq tasks: addition, lengths, the task API, which held-out lengths can be withheld."""

import pytest
import torch

from tformer.training.tasks import SequenceTask


def test_addition_task():
    task = SequenceTask("add", min_len=1, max_len=4)
    assert task.alphabet == "0123456789+" and task.vocab_size == 14
    assert task.to_text(task.target(task.from_text("123+45"))) == "168"
    assert task.to_text(task.target(task.from_text("999+1"))) == "1000"
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        source = task.to_text(task.sample_source(gen))
        a, b = source.split("+")
        assert 1 <= len(a) <= 4 and 1 <= len(b) <= 4 and (a == "0" or a[0] != "0")
        assert task.to_text(task.target(task.from_text(source))) == str(int(a) + int(b))
    assert task.max_source_len == 9 and task.max_target_len == 7
    with pytest.raises(ValueError, match="'x' is not a symbol of the add task"):
        task.from_text("1x2")


def test_task_lengths_error_names_the_cli_flags():
    with pytest.raises(
        ValueError,
        match=r"reverse task's lengths need 1 <= min_len <= max_len "
        r"\(--task-min-len <= --task-max-len\); got min_len=1, max_len=0",
    ):
        SequenceTask("reverse", min_len=1, max_len=0)


def test_existing_task_api_still_works():
    task = SequenceTask("reverse")
    src, src_mask, tgt, tgt_mask = task.batch(8, torch.Generator().manual_seed(0))
    assert src.shape[0] == tgt.shape[0] == 8 and task.vocab_size == 13 and task.max_target_len == 18
    assert task.alphabet == "0123456789"


def test_only_lengths_with_many_sources_are_withheld():
    add = SequenceTask("add", min_len=1, max_len=2)
    counts = {}
    for a in range(100):
        for b in range(100):
            counts[len(f"{a}+{b}")] = counts.get(len(f"{a}+{b}"), 0) + 1
    assert [add.sources_of_length(n) for n in range(1, 7)] == [counts.get(n, 0) for n in range(1, 7)]
    reverse = SequenceTask("reverse")
    assert [reverse.sources_of_length(n) for n in (1, 2, 3)] == [10, 100, 1000]
    assert not reverse.can_withhold((3,)) and not reverse.can_withhold((3, 4)) and reverse.can_withhold((3, 4, 5))
