"""Generation reads from the device only where it must: greedy decoding without stop conditions reads back a fixed
number of values whatever the number of tokens (the first step's finiteness check and the final tokens), and with an
EOS id at most one per step (which rows have ended). Counted on every way a tensor's value reaches Python."""

import pytest
import torch

from tformer.generation.sampling import generate

READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@pytest.fixture
def count_reads(monkeypatch):
    """``count_reads(fn)``: ``fn()``'s result and how many times it read a tensor's value back to Python."""
    counter = {"reads": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counter["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def run(fn):
        counter["reads"] = 0
        result = fn()
        return result, counter["reads"]

    return run


@pytest.mark.parametrize(
    ("position", "max_seq_len"), [("learned", 64), ("learned", 16), ("rotary", 64), ("sinusoidal", 64)]
)
def test_greedy_decoding_reads_a_constant_number_of_values(
    random_lm, random_prompts, count_reads, position, max_seq_len
):
    """(Learned positions with max_seq_len 16: 40 tokens slide the context window, restarting it 4 times.)"""
    model = random_lm(position=position, max_seq_len=max_seq_len)
    prompts = random_prompts([5, 3])  # left-padded: a masked batch
    counts = []
    for new in (5, 20, 40):
        tokens, reads = count_reads(lambda new=new: generate(model, prompts, max_new_tokens=new, greedy=True))
        assert [len(row) for row in tokens] == [new, new]
        counts.append(reads)
    # the first step's finiteness check, the final tokens, and with learned positions each row's prompt length
    assert counts[0] == counts[1] == counts[2] <= 3, counts


def test_sampling_reads_a_constant_number_of_values(random_lm, random_prompts, count_reads):
    model = random_lm()
    prompts = random_prompts([4])
    counts = [count_reads(lambda n=n: generate(model, prompts, max_new_tokens=n, seed=3))[1] for n in (5, 30)]
    assert counts[0] == counts[1] <= 2, counts


def test_with_an_eos_id_at_most_one_read_per_step(random_lm, random_prompts, count_reads):
    model = random_lm(position="rotary")
    new, prompts = 30, random_prompts([4, 6])
    free = generate(model, prompts, max_new_tokens=new, greedy=True)
    eos = next(t for t in range(32) if all(t not in row for row in free))  # never drawn: no row ends early
    tokens, reads = count_reads(lambda: generate(model, prompts, max_new_tokens=new, greedy=True, eos_id=eos))
    assert tokens == free
    assert reads <= new + 1, reads  # one per step, and the finiteness check of the first step's logits
