"""The peak-memory helper counts what the allocator hands out, byte for byte: the figures below are exact sums of
tensor sizes, and they hold on a busy machine (nothing here depends on timing or on the resident set)."""

import pytest
import torch

from tformer.experiments.memory import peak_allocated_bytes

N = 1 << 18  # float32 elements: 1 MiB


def test_one_tensor_is_its_bytes():
    assert peak_allocated_bytes(lambda: torch.empty(N)) == 4 * N
    assert peak_allocated_bytes(lambda: torch.empty(N, dtype=torch.float64)) == 8 * N


def test_tensors_alive_at_once_add_up_and_freed_ones_do_not():
    def together():
        a, b = torch.empty(N), torch.empty(N)
        return a, b

    def one_after_another():
        a = torch.empty(N)
        del a
        return torch.empty(N)

    assert peak_allocated_bytes(together) == 8 * N
    assert peak_allocated_bytes(one_after_another) == 4 * N


def test_tensors_from_before_the_call_are_not_counted():
    x = torch.ones(N)
    assert peak_allocated_bytes(lambda: x.zero_()) == 0  # in place: nothing new
    assert peak_allocated_bytes(lambda: x * x) == 4 * N  # the product only


def test_a_materialized_softmax_is_counted_whole():
    """softmax(Q K^T) V: the (n, n) scores and their softmax exist together (the peak); the scores are freed before
    the (n, d) output is allocated next to the softmax."""
    n, d = 512, 16
    q = torch.randn(n, d)
    assert peak_allocated_bytes(lambda: torch.softmax(q @ q.T, dim=-1) @ q) == 2 * n * n * 4


def test_the_same_call_measures_the_same_twice():
    q = torch.randn(1, 4, 300, 32)
    run = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
    assert peak_allocated_bytes(run) == peak_allocated_bytes(run) > 0


def test_other_devices_are_refused_by_name():
    with pytest.raises(ValueError, match="measured on the CPU and on CUDA devices; got meta"):
        peak_allocated_bytes(lambda: None, device="meta")
