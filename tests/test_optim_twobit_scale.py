"""2-bit with a per-tensor scale: TwoBit("rms") recomputes t = RMS(acc) and ships it."""
import math

import pytest
import torch

from gradcomp import TwoBit

BACKENDS = ("torch", "numba")


def reference(acc: torch.Tensor):
    """Independent reference: threshold, decoded values, residual."""
    t = float(torch.tensor(math.sqrt(float((acc.double() ** 2).sum()) / acc.numel()), dtype=torch.float32))
    sent = torch.where(acc >= t, t, torch.where(acc <= -t, -t, 0.0)).float()
    return t, sent, acc - sent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [1, 17, 4096 + 3, 3 * (1 << 16) + 5])  # the last: four pieces of the CPU sum
def test_rms_threshold_matches_reference_bitwise(backend, numel):
    gen = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel, generator=gen) * 0.01
    residual = torch.randn(numel, generator=gen) * 0.004
    compressor = TwoBit("rms")
    residual_out = torch.empty(numel)
    payload = compressor.compress(grad, residual, residual_out, backend=backend)
    t, sent, expected_residual = reference(grad + residual)
    assert float(payload["scale"][0]) == t
    out = torch.zeros(numel)
    compressor.decompress_add(payload, out, backend=backend)
    assert torch.equal(out, sent)
    assert torch.equal(residual_out, expected_residual)


def test_scale_differs_per_tensor_and_decoding_reads_it_from_the_payload():
    compressor = TwoBit("rms")
    small, large = torch.randn(64) * 1e-4, torch.randn(64) * 10.0
    p_small, p_large = compressor.compress(small), compressor.compress(large)
    assert float(p_large["scale"][0]) > 1e4 * float(p_small["scale"][0])
    out = torch.zeros(64)
    compressor.decompress_add(p_large, out)
    assert set(out.abs().unique().tolist()) <= {0.0, float(p_large["scale"][0])}
    # A rms threshold keeps a useful share of non-zero codes whatever the magnitude
    # (a fixed 0.5 would send nothing for the small tensor).
    for payload, tensor in ((p_small, small), (p_large, large)):
        out = torch.zeros(64)
        compressor.decompress_add(payload, out)
        assert 0.05 < float((out != 0).float().mean()) < 0.6
    fixed = torch.zeros(64)
    TwoBit(0.5).decompress_add(TwoBit(0.5).compress(small), fixed)
    assert not fixed.any()


def test_layout_has_one_float32_scale_and_the_fixed_mode_is_unchanged():
    rms, fixed = TwoBit("rms").layout(100, torch.float32), TwoBit(0.5).layout(100, torch.float32)
    assert [s.name for s in rms.segments] == ["codes", "scale"]
    assert rms.segments[1].dtype == torch.float32 and rms.segments[1].numel == 1
    assert [s.name for s in fixed.segments] == ["codes"]
    assert repr(TwoBit("rms")) != repr(TwoBit(0.5))


def test_zero_tensor_sends_nothing_and_nonfinite_entries_poison_the_average():
    compressor = TwoBit("rms")
    payload = compressor.compress(torch.zeros(40))
    out = torch.zeros(40)
    compressor.decompress_add(payload, out)
    assert float(payload["scale"][0]) == 1.0 and not out.any()
    grad = torch.randn(40)
    grad[7] = float("inf")
    payload = compressor.compress(grad)
    assert math.isfinite(float(payload["scale"][0]))
    out = torch.zeros(40)
    compressor.decompress_add(payload, out)
    assert not torch.isfinite(out).all()


def test_bad_threshold_strings_are_rejected():
    with pytest.raises(ValueError, match="'rms' or 'chunk'"):
        TwoBit("mean")


def test_rms_threshold_of_a_half_gradient_and_a_non_finite_one():
    """The pieces of the sum read a float16 gradient in float32, as the reference; a NaN anywhere (here in the
    last piece) gives t = 1.0, as documented."""
    from gradcomp.compressors.twobit import SQUARES_CHUNK

    gen = torch.Generator().manual_seed(3)
    grad = (torch.randn(2 * SQUARES_CHUNK + 9, generator=gen) * 0.01).half()
    residual = torch.randn(grad.numel(), generator=gen) * 0.004
    payload = TwoBit("rms").compress(grad, residual, torch.empty(grad.numel()))
    assert float(payload["scale"][0]) == reference(grad.float() + residual)[0]
    grad[-1] = float("nan")
    assert float(TwoBit("rms").compress(grad, residual)["scale"][0]) == 1.0
