"""Hostile payloads, one process: what a corrupt or malicious peer could send.

* Payload validation (:mod:`gradcomp.validation`): every malformed payload is rejected with
  a ``PayloadError`` naming the sender, and every payload a compressor produces is accepted.
* Kernel level, on the torch and numba backends and the CUDA kernels in the CPU emulation:
  out-of-range, negative, duplicate and unsorted indices, truncated and oversized buffers,
  2-bit data where top-k is expected, random bytes. No crash, no write outside the output
  (sentinels before and after it stay intact), a clear error, and nothing written at all
  when the error is raised.

The same with two real ranks under DDP is in ``test_hostile_peers.py``.
"""
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
import gradcomp.csrc
from emulation import cuda_emulator
from experiments.gpu_hostile_check import KINDS as HOSTILE_KINDS  # the same cases on a GPU
from experiments.gpu_hostile_check import N, hostile_indices
from gradcomp.backends import (
    KERNELS,
    is_available,
    torch_ops,  # noqa: F401  (registers the reference)
)
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import PayloadError, validate_gathered, validate_payload

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def topk_payload(n=100, ratio=0.1, dtype=torch.float32, seed=0):
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return gradcomp.TopK(ratio).compress(grad, backend="torch")


# -- honest payloads pass ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "compressor", [gradcomp.TopK(0.1), gradcomp.TopK(1.0), gradcomp.TopK(0.1, entries="compact"), gradcomp.TwoBit(0.5),
                   gradcomp.TwoBit("chunk"), gradcomp.ThreeBit(), gradcomp.FP16(), gradcomp.Identity()], ids=repr
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
    compressors = (gradcomp.TopK(0.05), gradcomp.TopK(0.05, entries="compact"), gradcomp.TwoBit(0.5), gradcomp.FP16())
    for compressor in compressors:
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
                payload = Payload(layout, raw[r * layout.nbytes : (r + 1) * layout.nbytes])
                indices = compressor.sent_indices(payload).long()
                assert bool(((indices >= 0) & (indices < n)).all()) and bool((indices.diff() > 0).all())


def test_payload_error_keeps_rank_and_reason_through_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PayloadError("bad index", rank=1)))
    assert error.rank == 1 and error.reason == "bad index" and "rank 1" in str(error)


# ==========================================================================================
# Kernel level: every backend's decoder and wrapper, given what a hostile peer could send.
# ==========================================================================================
_HAS_NUMBA = is_available("numba", "cpu")
if _HAS_NUMBA:
    from gradcomp.backends.numba import ops as numba_ops  # noqa: F401  (registers the numba ops)

_GUARD = 24  # elements of sentinel before and after every output


@pytest.fixture(scope="module")
def cuda_emulation():
    """``(plans, launch, config)``: the CUDA backend's launch plans on the CPU emulation,
    with tiny launches (32-thread blocks, at most 3 blocks) so every grid-stride loop wraps."""
    try:
        library = cuda_emulator.build(Path(gradcomp.csrc.__file__).resolve().parent)
    except FileNotFoundError as error:  # no g++
        pytest.skip(f"the CUDA emulation needs a C++20 compiler ({cuda_emulator.CXX}): {error}")
    plans = cuda_emulator.load_cuda_plans()
    config = plans.LaunchConfig(threads=32, max_blocks=3, histogram_blocks=3)
    return plans, cuda_emulator.EmulatedLauncher(library), config


BACKENDS = ["torch", "numba", "cuda-emulated"]


def ops_for(backend, request):
    """``{op: callable}`` with the registry's signatures for ``backend``."""
    if backend == "numba" and not _HAS_NUMBA:
        pytest.skip("numba is not installed")
    if backend == "cuda-emulated":
        plans, launch, config = request.getfixturevalue("cuda_emulation")
        return {
            "topk_decompress_add": lambda v, i, out: plans.plan_topk_decompress_add(launch, config, v, i, out),
            "twobit_decompress_add": lambda c, t, out: plans.plan_twobit_decompress_add(launch, config, c, t, out),
            "topk_compress": lambda g, ri, ro, v, i: plans.plan_topk_compress(launch, config, g, ri, ro, v, i),
            "twobit_compress": lambda g, ri, ro, t, c: plans.plan_twobit_compress(launch, config, g, ri, ro, t, c),
            "threebit_decompress_add": lambda c, s, out: plans.plan_threebit_decompress_add(launch, config, c, s, out),
        }
    return {op: KERNELS[(op, backend)] for op in ("topk_decompress_add", "twobit_decompress_add", "topk_compress",
                                                  "twobit_compress", "threebit_decompress_add")}


class GuardedOut:
    """A float32 ``[n]`` output inside a larger buffer with sentinels before and after it:
    any write outside ``[0, n)`` changes a sentinel."""

    def __init__(self, n, seed=0):
        self.buffer = torch.randn(n + 2 * _GUARD, generator=torch.Generator().manual_seed(seed))
        self.tensor = self.buffer[_GUARD : _GUARD + n]
        self.before = self.buffer.clone()

    def assert_untouched(self, what):
        assert torch.equal(self.buffer.view(torch.int32), self.before.view(torch.int32)), f"{what}: memory changed"

    def assert_guards_intact(self, what):
        b, a = self.buffer.view(torch.int32), self.before.view(torch.int32)
        assert torch.equal(b[:_GUARD], a[:_GUARD]), f"{what}: written before the output"
        assert torch.equal(b[-_GUARD:], a[-_GUARD:]), f"{what}: written past the output"


VALID = torch.tensor([0, 3, 9, 27, 40, 41, 63, 88, 98, 99])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("kind", HOSTILE_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_decoders_reject_bad_indices_and_write_nothing(backend, kind, index_dtype, request):
    decode = ops_for(backend, request)["topk_decompress_add"]
    values = torch.arange(1, 11, dtype=torch.float32)
    out = GuardedOut(N)
    with pytest.raises(ValueError, match=r"outside \[0, 100\)|strictly increase") as caught:
        decode(values, hostile_indices(kind, index_dtype), out.tensor)
    assert "nothing was written" in str(caught.value)
    out.assert_untouched(f"{backend} {kind}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_decoders_accept_valid_indices_within_bounds(backend, request):
    decode = ops_for(backend, request)["topk_decompress_add"]
    values = torch.arange(1, 11, dtype=torch.bfloat16)
    out = GuardedOut(N, seed=1)
    expected = out.tensor.clone()
    expected[VALID] += values.float()
    decode(values, VALID.to(torch.int32), out.tensor)
    out.assert_guards_intact(backend)
    assert torch.equal(out.tensor, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_decoders_reject_mismatched_sizes_before_writing(backend, request):
    decode = ops_for(backend, request)["topk_decompress_add"]
    out = GuardedOut(N)
    values = torch.ones(10)
    with pytest.raises(ValueError, match="indices must have 10 elements"):  # truncated indices
        decode(values, VALID[:9].to(torch.int32), out.tensor)
    with pytest.raises(ValueError, match="indices must have 10 elements"):  # oversized indices
        decode(values, torch.arange(11, dtype=torch.int32), out.tensor)
    with pytest.raises(ValueError, match="cannot be distinct positions"):  # k > n: a payload for a larger tensor
        decode(torch.ones(N + 1), torch.arange(N + 1, dtype=torch.int32), out.tensor)
    with pytest.raises(TypeError, match="out must be torch.float32"):
        decode(values, VALID.to(torch.int32), out.tensor.double())
    with pytest.raises(TypeError, match="values must be"):  # a 2-bit code word where values are expected
        decode(torch.ones(10, dtype=torch.int32), VALID.to(torch.int32), out.tensor)
    with pytest.raises(TypeError, match="indices must be"):
        decode(values, VALID.float(), out.tensor)
    with pytest.raises(ValueError, match="flat contiguous"):
        decode(values, VALID.to(torch.int32), out.tensor.view(10, 10))
    out.assert_untouched(backend)


def test_topk_payload_built_for_a_larger_tensor_is_rejected_on_every_backend(request):
    """Decoding a payload for n=64 into an output of n=16 used to write past the output."""
    payload = gradcomp.TopK(0.25).compress(torch.randn(64), backend="torch")
    for backend in BACKENDS:
        decode = ops_for(backend, request)["topk_decompress_add"]
        out = GuardedOut(16)
        with pytest.raises(ValueError):
            decode(payload["values"], payload["indices"], out.tensor)
        out.assert_untouched(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_twobit_decoders_reject_truncated_and_oversized_codes(backend, request):
    decode = ops_for(backend, request)["twobit_decompress_add"]
    out = GuardedOut(N)
    for words in (0, 6, 8, 100):  # ceil(100 / 16) = 7
        with pytest.raises(ValueError, match="codes must have 7 elements"):
            decode(torch.full((words,), -1, dtype=torch.int32), 0.5, out.tensor)
    with pytest.raises(TypeError, match="codes must be torch.int32"):  # a top-k index buffer as int64 codes
        decode(torch.zeros(7, dtype=torch.int64), 0.5, out.tensor)
    out.assert_untouched(backend)
    # Garbage in the padding bits of the last word is never decoded past n.
    decode(torch.full((7,), -1, dtype=torch.int32), 0.5, out.tensor)
    out.assert_guards_intact(backend)
    assert torch.isnan(out.tensor).all()  # every code 0b11 decodes to NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_threebit_decoder_rejects_wrong_sizes_and_never_reads_spare_bits(backend, request):
    decode = ops_for(backend, request)["threebit_decompress_add"]
    out = GuardedOut(N)
    for words in (0, 9, 11, 100):  # ceil(100 / 10) = 10
        with pytest.raises(ValueError, match="codes must have 10 elements"):
            decode(torch.full((words,), -1, dtype=torch.int32), torch.ones(1), out.tensor)
    for chunks in (0, 2):  # ceil(100 / 128) = 1
        with pytest.raises(ValueError, match="scales must have 1 elements"):
            decode(torch.zeros(10, dtype=torch.int32), torch.ones(chunks), out.tensor)
    out.assert_untouched(backend)
    # Every spare bit set: the decoder reads only each element's three bits.
    decode(torch.full((10,), -1, dtype=torch.int32), torch.ones(1), out.tensor)
    out.assert_guards_intact(backend)
    assert torch.isnan(out.tensor).all()  # every code 0b111 decodes to NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_compress_wrappers_reject_short_residuals_and_buffers_before_writing(backend, request):
    """A residual shorter than the gradient overflowed the heap in the numba compress."""
    ops = ops_for(backend, request)
    grad = torch.randn(N)
    short_in, short_out = GuardedOut(N - 1, seed=2), GuardedOut(N - 1, seed=3)
    full_out = GuardedOut(N, seed=4)
    codes = torch.zeros(7, dtype=torch.int32)
    values, indices = torch.zeros(10), torch.zeros(10, dtype=torch.int32)
    cases = [
        ("twobit_compress", (grad, short_in.tensor, None, 0.5, codes), "residual_in must have 100"),
        ("twobit_compress", (grad, None, short_out.tensor, 0.5, codes), "residual_out must have 100"),
        ("twobit_compress", (grad, None, full_out.tensor, 0.5, codes[:6]), "codes must have 7"),
        ("topk_compress", (grad, short_in.tensor, None, values, indices), "residual_in must have 100"),
        ("topk_compress", (grad, None, short_out.tensor, values, indices), "residual_out must have 100"),
        ("topk_compress", (grad, None, full_out.tensor, values, indices[:9]), "indices must have 10"),
        ("topk_compress", (grad[:5], None, None, values, indices), "k <= n"),
    ]
    for op, args, message in cases:
        with pytest.raises(ValueError, match=message):
            ops[op](*args)
    for guarded in (short_in, short_out, full_out):
        guarded.assert_untouched(backend)
    assert not codes.any() and not values.any() and not indices.any()


@pytest.mark.parametrize("backend", ["numba", "cuda-emulated"])
def test_fast_topk_decoders_equal_the_reference_on_random_payload_bytes(backend, request):
    """Random bytes as a top-k payload: the fast decoder raises exactly when the reference
    does, writes nothing when it raises, stays inside the output, and otherwise gives the
    reference's result bit for bit."""
    decode = ops_for(backend, request)["topk_decompress_add"]
    reference = KERNELS[("topk_decompress_add", "torch")]

    @given(st.binary(min_size=0, max_size=4096), st.integers(1, 40), st.sampled_from([torch.float32, torch.bfloat16]))
    @settings(max_examples=60 if backend == "numba" else 25, deadline=None)
    def check(data, n, dtype):
        layout = gradcomp.TopK(0.2).layout(n, dtype)
        raw = bytearray(data[: layout.nbytes].ljust(layout.nbytes, b"\0"))
        payload = Payload(layout, torch.frombuffer(raw, dtype=torch.uint8))
        values, indices = payload["values"], payload["indices"]
        # Small random indices sometimes, so that valid payloads occur too.
        if data and data[0] % 2:
            indices.copy_(indices.abs() % (2 * n) - n // 4)
        expected, out = GuardedOut(n, seed=5), GuardedOut(n, seed=5)
        try:
            reference(values, indices, expected.tensor)
        except ValueError:
            with pytest.raises(ValueError):
                decode(values, indices, out.tensor)
            out.assert_untouched(backend)
            return
        decode(values, indices, out.tensor)
        out.assert_guards_intact(backend)
        assert torch.equal(out.tensor.isnan(), expected.tensor.isnan())
        same = out.tensor.view(torch.int32) == expected.tensor.view(torch.int32)
        assert bool((same | out.tensor.isnan()).all())

    check()


def test_numba_parallel_decode_never_loses_updates_to_duplicates():
    """Duplicate indices raced in the parallel decode (non-atomic adds): rejected now,
    with the output untouched, whatever the thread count."""
    if not _HAS_NUMBA:
        pytest.skip("numba is not installed")
    n, k = 1 << 16, 1 << 14
    indices = torch.arange(k, dtype=torch.int32) * 4
    indices[k // 2 :] = indices[k // 2]  # half the payload adds to one element
    out = GuardedOut(n)
    with pytest.raises(ValueError, match="duplicate"):
        KERNELS[("topk_decompress_add", "numba")](torch.ones(k), indices, out.tensor)
    out.assert_untouched("numba")
