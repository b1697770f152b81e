"""The one-reduction checks every step runs: whether a group's average is finite (the engine's
accept), and whether a received 3-bit or 2-bit payload's codes and scales are in range."""
import pytest
import torch

import gradcomp
from gradcomp.validation import all_finite, within

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 4099])
def test_a_single_non_finite_element_anywhere_is_found(dtype, n):
    clean = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert bool(all_finite(clean))
    positions = range(n) if n <= 64 else sorted({0, 1, 15, 16, 31, 63, n // 2, n - 17, n - 2, n - 1})
    for position in positions:
        for bad in (float("nan"), float("inf"), -float("inf")):
            tensor = clean.clone()
            tensor[position] = bad
            verdict = all_finite(tensor)
            assert verdict.dim() == 0 and verdict.dtype == torch.bool
            assert not bool(verdict), (position, bad)


def test_the_largest_finite_values_and_an_empty_tensor_are_finite():
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    assert bool(all_finite(big)) and bool(all_finite(torch.empty(0)))
    assert bool(all_finite(torch.ones(3, 4)))  # any shape


def test_within_bounds_both_ends_and_rejects_nan():
    assert within(torch.tensor([0, 5, 2**30 - 1], dtype=torch.int32), 0, 2**30 - 1)
    assert not within(torch.tensor([0, 2**30], dtype=torch.int32), 0, 2**30 - 1)
    assert not within(torch.tensor([-1, 3], dtype=torch.int32), 0, 2**30 - 1)
    assert not within(torch.tensor([1.0, float("nan")]), 0, 10.0) and within(torch.empty(0), 0, 1)


def test_the_exchanges_accept_is_the_finite_check():
    from gradcomp.exchanges import Handle
    from gradcomp.exchanges.allgather import Allgather

    exchange = Allgather()
    grad = torch.ones(100)
    handle = Handle("g", ("w",), (100,), grad, exchange)
    assert bool(exchange.accept(None, handle, grad))
    grad[57] = float("nan")
    assert not bool(exchange.accept(None, handle, grad))
    handle.finite = True  # what the finish learnt as it wrote is taken as it is
    assert exchange.accept(None, handle, grad) is True
    grad[57], handle.finite = 1.0, False
    assert exchange.accept(None, handle, grad) is False


def threebit_payload(n=1000):
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0))
    return gradcomp.ThreeBit().compress(grad, backend="torch")


@pytest.mark.parametrize("word,value", [(0, 1 << 30), (57, -1), (99, 1 << 31)])
def test_threebit_codes_with_a_spare_bit_set_name_the_word(word, value):
    payload = threebit_payload()
    gradcomp.ThreeBit().check_payload(payload, 1000)  # what the encoder writes passes
    payload["codes"][word] = torch.tensor(value).to(torch.int32)
    with pytest.raises(ValueError, match=f"word {word} "):
        gradcomp.ThreeBit().check_payload(payload, 1000)


@pytest.mark.parametrize("compressor", [gradcomp.ThreeBit(), gradcomp.TwoBit("chunk")], ids=repr)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_a_bad_chunk_scale_names_the_chunk(compressor, bad):
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    payload = compressor.compress(grad, backend="torch")
    compressor.check_payload(payload, 1000)
    payload["scales"][3] = bad
    with pytest.raises(ValueError, match="chunk 3 has"):
        compressor.check_payload(payload, 1000)
