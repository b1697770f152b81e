"""Fuzzing the compressors and their kernels with hypothesis: shapes, dtypes, ratios,
thresholds and special values (+-0, subnormals, +-inf, NaN, ties), on every CPU backend
through the public API, and on the CUDA kernels through the CPU emulation."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp.backends import is_available

SPECIAL = [0.0, -0.0, 1e-45, -1e-40, 1e-38, float("inf"), -float("inf"), float("nan"), 65504.0, 7e4, 3e38, 0.5, -0.5]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_BACKENDS = [b for b in ("torch", "numba") if is_available(b, "cpu")]


@st.composite
def gradients(draw, max_size=2000):
    """A float32 vector mixing normal noise, a small set of repeated values (ties) and
    special values, then cast to a drawn dtype; plus an optional residual."""
    n = draw(st.integers(0, max_size))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=generator) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    if n and draw(st.booleans()):  # ties
        values = torch.round(values * 2) / 2
    if n and draw(st.booleans()):  # special values at random places
        count = draw(st.integers(1, min(n, 20)))
        positions = torch.randperm(n, generator=generator)[:count]
        picks = draw(st.lists(st.sampled_from(SPECIAL), min_size=count, max_size=count))
        values[positions] = torch.tensor(picks, dtype=torch.float32)
    dtype = draw(st.sampled_from(DTYPES))
    residual = torch.randn(n, generator=generator) * 0.1 if draw(st.booleans()) else None
    return values.to(dtype), residual


compressors = st.one_of(
    st.floats(1e-4, 1.0).map(gradcomp.TopK),
    st.sampled_from([1e-3, 0.25, 0.5, 2.0, 1e5]).map(gradcomp.TwoBit),
)


def run(compressor, grad, residual, backend):
    residual_out = torch.full((grad.numel(),), 123.0)
    payload = compressor.compress(grad, residual, residual_out, backend=backend)
    decoded = torch.zeros(grad.numel())
    compressor.decompress_add(payload, decoded, backend=backend)
    return payload, decoded, residual_out


def same_bits(a, b):
    """Equal bit for bit, any NaN equal to any NaN."""
    if a.dtype.is_floating_point:
        both_nan = torch.isnan(a) & torch.isnan(b)
        integer = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return bool(((a.view(integer) == b.view(integer)) | both_nan).all())
    return torch.equal(a, b)


# The quick run keeps the torch backend here and fuzzes numba against it in the test below.
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b == "numba" else b
                                     for b in CPU_BACKENDS])
@given(case=gradients(), compressor=compressors)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_compressors_keep_their_invariants(backend, case, compressor):
    grad, residual = case
    payload, decoded, residual_out = run(compressor, grad, residual, backend)
    acc = grad.float() if residual is None else grad.float() + residual
    assert payload.nbytes == compressor.layout(grad.numel(), grad.dtype).nbytes
    finite = torch.isfinite(acc)
    # The error-feedback identity, element by element, wherever acc is finite (as
    # values: decoding adds into +0.0, so a sent -0.0 comes back as +0.0).
    assert torch.equal(residual_out[finite], (acc - decoded)[finite])
    # A non-finite input reaches the decoded result (so the average is non-finite too).
    if grad.numel() and not finite.all():
        if isinstance(compressor, gradcomp.TwoBit):
            assert torch.equal(torch.isnan(decoded), ~finite)
        else:
            assert not torch.isfinite(decoded).all()
    if isinstance(compressor, gradcomp.TopK) and grad.numel():
        k = compressor.k(grad.numel())
        indices = payload["indices"].long()
        assert indices.numel() == k and bool((indices[1:] > indices[:-1]).all())
        magnitude = acc.abs().nan_to_num(nan=math.inf)
        unsent = torch.ones(grad.numel(), dtype=torch.bool)
        unsent[indices] = False
        if unsent.any():  # nothing left out is larger than anything sent
            assert magnitude[unsent].max() <= magnitude[indices].min()


@pytest.mark.skipif(len(CPU_BACKENDS) < 2, reason="numba is not installed: nothing to compare with the reference")
@given(case=gradients(), compressor=compressors)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_numba_backend_matches_the_torch_reference_bit_for_bit(case, compressor):
    grad, residual = case
    expected = run(compressor, grad, residual.clone() if residual is not None else None, "torch")
    actual = run(compressor, grad, residual, "numba")
    names = ("payload", "decoded", "residual")
    for name, got, want in zip(names, (actual[0].buffer, *actual[1:]), (expected[0].buffer, *expected[1:])):
        if name == "payload" and isinstance(compressor, gradcomp.TopK):
            got_values, want_values = actual[0]["values"], expected[0]["values"]
            assert torch.equal(actual[0]["indices"], expected[0]["indices"])
            assert same_bits(got_values, want_values)
        else:
            assert same_bits(got, want), name
