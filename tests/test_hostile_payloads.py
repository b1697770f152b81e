"""Payload validation: every malformed payload a peer could send is rejected with a
PayloadError naming the sender, and every payload a compressor produces is accepted."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import PayloadError, validate_gathered, validate_payload

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def topk_payload(n=100, ratio=0.1, dtype=torch.float32, seed=0):
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return gradcomp.TopK(ratio).compress(grad, backend="torch")


# -- honest payloads pass ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "compressor", [gradcomp.TopK(0.1), gradcomp.TopK(1.0), gradcomp.TwoBit(0.5), gradcomp.FP16(), gradcomp.Identity()]
)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_every_payload_a_compressor_produces_is_valid(compressor, dtype, n):
    grad = torch.randn(n).to(dtype) * 3
    payload = compressor.compress(grad, backend="torch")
    validate_payload(compressor, payload, n, rank=0)
    gathered = torch.cat([payload.buffer, payload.buffer])
    validate_gathered(compressor, payload.layout, gathered, n)


@given(st.integers(0, 600), st.floats(1e-3, 1.0), st.sampled_from(DTYPES))
@settings(max_examples=60, deadline=None)
def test_random_honest_topk_payloads_pass(n, ratio, dtype):
    compressor = gradcomp.TopK(ratio)
    payload = compressor.compress(torch.randn(n).to(dtype), backend="torch")
    validate_payload(compressor, payload, n)


# -- top-k indices -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "position,value,words",
    [
        (3, 100, "outside [0, 100)"),  # == n
        (-1, 10**6, "outside [0, 100)"),
        (0, -1, "outside [0, 100)"),
        (0, -(2**31), "outside [0, 100)"),
        (5, None, "duplicate"),  # copy of the previous index
        (5, 0, "unsorted"),
    ],
)
def test_bad_topk_indices_name_the_rank_and_the_problem(position, value, words):
    compressor = gradcomp.TopK(0.1)
    payload = topk_payload()
    indices = payload["indices"]
    indices[position] = indices[position - 1] if value is None else value
    with pytest.raises(PayloadError, match=r"rank 3: .*" + re.escape(words)) as caught:
        validate_payload(compressor, payload, 100, rank=3)
    assert caught.value.rank == 3 and words.split()[0] in caught.value.reason
    assert isinstance(caught.value, ValueError)


def test_validate_gathered_names_the_first_bad_rank_and_writes_nothing():
    compressor = gradcomp.TopK(0.1)
    payloads = [topk_payload(seed=r) for r in range(4)]
    payloads[2]["indices"][0] = -5
    payloads[3]["indices"][0] = 1000
    gathered = torch.cat([p.buffer for p in payloads])
    before = gathered.clone()
    with pytest.raises(PayloadError) as caught:
        validate_gathered(compressor, payloads[0].layout, gathered, 100)
    assert caught.value.rank == 2 and "-5" in caught.value.reason
    assert torch.equal(gathered, before)


def test_layout_mismatches_are_rejected():
    n = 100
    payload = topk_payload(n)
    # A payload built for another numel (k differs) or another ratio.
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.TopK(0.1), payload, 64, rank=1)
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.TopK(0.2), payload, n, rank=1)
    # A 2-bit payload where top-k is expected, and the reverse.
    twobit = gradcomp.TwoBit(0.5).compress(torch.randn(n), backend="torch")
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.TopK(0.1), twobit, n, rank=0)
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.TwoBit(0.5), payload, n, rank=0)
    # A cast payload of another numel or wire dtype.
    fp16 = gradcomp.FP16().compress(torch.randn(n), backend="torch")
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.FP16(), fp16, n + 1, rank=0)
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.BF16(), fp16, n, rank=0)
    # Integer "values" of the right size are not a gradient dtype.
    forged = PayloadLayout((("values", torch.int32, 10), ("indices", torch.int32, 10))).allocate("cpu")
    with pytest.raises(PayloadError, match="layout does not match"):
        validate_payload(gradcomp.TopK(0.1), forged, n, rank=0)


def test_gathered_buffers_of_the_wrong_size_or_type_are_rejected():
    compressor = gradcomp.TopK(0.1)
    payload = topk_payload()
    layout = payload.layout
    for bad in (payload.buffer[:-8], torch.cat([payload.buffer, payload.buffer[:8]]), payload.buffer[:0]):
        with pytest.raises(PayloadError, match="multiple"):
            validate_gathered(compressor, layout, bad, 100)
    with pytest.raises(PayloadError, match="uint8"):
        validate_gathered(compressor, layout, payload.buffer.view(torch.int32), 100)
    with pytest.raises(PayloadError, match="uint8"):
        validate_gathered(compressor, layout, payload.buffer.view(2, -1), 100)
    with pytest.raises(PayloadError, match="Payload"):
        validate_payload(compressor, payload.buffer, 100)


@pytest.mark.parametrize("n", [1, 15, 17, 31])
def test_twobit_bits_past_the_last_element_are_rejected(n):
    compressor = gradcomp.TwoBit(0.5)
    payload = compressor.compress(torch.randn(n) * 3, backend="torch")
    payload["codes"][-1] |= torch.tensor(1 << 30, dtype=torch.int32) if n % 16 else 0
    with pytest.raises(PayloadError, match="non-zero bits past element"):
        validate_payload(compressor, payload, n, rank=1)


def test_twobit_all_bits_used_when_numel_is_a_multiple_of_16():
    compressor = gradcomp.TwoBit(0.5)
    payload = compressor.compress(torch.full((32,), -9.0), backend="torch")
    assert int(payload["codes"][-1]) != 0  # the top bits are data, not padding
    validate_payload(compressor, payload, 32)


@given(st.binary(min_size=0, max_size=200), st.integers(0, 300))
@settings(max_examples=200, deadline=None)
def test_random_bytes_never_crash_the_validator(data, n):
    """Random bytes as a peer's payload: either accepted (then they are a well-formed
    payload) or rejected with a PayloadError; never any other exception."""
    for compressor in (gradcomp.TopK(0.05), gradcomp.TwoBit(0.5), gradcomp.FP16()):
        layout = compressor.layout(n, torch.float32)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        try:
            validate_gathered(compressor, layout, raw, n)
        except PayloadError as error:
            assert error.reason
            continue
        # Accepted: the indices of every rank's payload really are in range and increasing.
        if isinstance(compressor, gradcomp.TopK):
            for r in range(raw.numel() // layout.nbytes):
                indices = Payload(layout, raw[r * layout.nbytes : (r + 1) * layout.nbytes])["indices"].long()
                assert bool(((indices >= 0) & (indices < n)).all()) and bool((indices.diff() > 0).all())


def test_payload_error_keeps_rank_and_reason_through_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PayloadError("bad index", rank=1)))
    assert error.rank == 1 and error.reason == "bad index" and "rank 1" in str(error)
