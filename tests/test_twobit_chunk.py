"""The chunk-scaled 2-bit code (``TwoBit("chunk")``): the same bits on every backend.

The torch reference defines the arithmetic (halving-tree float32 sums per 64-element chunk); the
Numba kernels and the CUDA kernels (executed through the CPU emulation, launched by the plans the
GPU runs, with 64-thread blocks and a capped grid so that small inputs wrap the grid-stride loop)
must reproduce its codes, scales, residuals and decoded values bit for bit, for every gradient
dtype, residual arrangement and kind of data, NaN and infinities included. The compressor keeps
the error-feedback identity, and rejects scales that no compressor writes.
"""
from __future__ import annotations

import pytest
import torch

import gradcomp
import multiprocess
from gradcomp.backends import torch_ops
from test_cuda_kernels import (
    DTYPE_IDS,
    DTYPES,
    RESIDUAL_MODES,
    Guarded,
    assert_same,
    build_emulator,
    cuda_ops,
    make_case,
    make_values,
)

SIZES = [1, 15, 16, 63, 64, 65, 129, 1000, 3109]
KINDS = ("normal", "ties", "zeros", "special")
# 64-thread blocks (one chunk each), at most 3 blocks: the grid-stride loop wraps from 193 elements.
CHUNK_TINY = cuda_ops.LaunchConfig(threads=64, max_blocks=3, histogram_blocks=3)


@pytest.fixture(scope="module")
def emulator():
    return build_emulator()


def reference(grad, residual_in, with_residual: bool):
    n = grad.numel()
    codes = torch.empty((n + 15) // 16, dtype=torch.int32)
    scales = torch.empty((n + 63) // 64)
    residual = torch.empty(n) if with_residual else None
    torch_ops.twobit_chunk_compress(grad, residual_in.clone() if residual_in is not None else None, residual,
                                    codes, scales)
    return codes, scales, residual


def run_numba(grad, residual_in, residual_out):
    from gradcomp.backends.numba import ops

    n = grad.numel()
    codes = Guarded((n + 15) // 16, torch.int32)
    scales = Guarded((n + 63) // 64, torch.float32)
    ops.twobit_chunk_compress(grad, residual_in, residual_out, codes.tensor, scales.tensor)
    codes.check("codes")
    scales.check("scales")
    return codes.tensor, scales.tensor


def run_emulated(emulator, grad, residual_in, residual_out):
    n = grad.numel()
    codes = Guarded((n + 15) // 16, torch.int32)
    scales = Guarded((n + 63) // 64, torch.float32)
    cuda_ops.plan_twobit_chunk_compress(emulator, CHUNK_TINY, grad, residual_in, residual_out, codes.tensor,
                                        scales.tensor)
    codes.check("codes")
    scales.check("scales")
    return codes.tensor, scales.tensor


# Every backend x size x residual arrangement x dtype; the quick run keeps one case of each backend
# that crosses chunks, a partial last chunk and the grid-stride wrap.
CASES = [(b, d, m, n) for b in ("numba", "cuda-emulated") for d in DTYPES for m in RESIDUAL_MODES for n in SIZES]
QUICK = [("numba", torch.float32, "aliased", 1000), ("cuda-emulated", torch.bfloat16, "separate", 1000),
         ("cuda-emulated", torch.float32, "none", 65)]


@pytest.mark.parametrize("backend,dtype,mode,n", multiprocess.slow_except(CASES, QUICK))
def test_chunk_compress_matches_the_reference_bit_for_bit(emulator, backend, dtype, mode, n):
    pytest.importorskip("numba")
    for kind in KINDS:
        grad, residual_in, residual_out = make_case(dtype, mode, n, kind, seed=n)
        expected_codes, expected_scales, expected_residual = reference(grad, residual_in, residual_out is not None)
        out = residual_out.tensor if residual_out is not None else None
        if backend == "numba":
            codes, scales = run_numba(grad, residual_in, out)
        else:
            codes, scales = run_emulated(emulator, grad, residual_in, out)
        assert_same(codes, expected_codes, f"codes ({kind})")
        assert_same(scales, expected_scales, f"scales ({kind})")
        if residual_out is not None:
            residual_out.check("residual_out")
            assert_same(residual_out.tensor, expected_residual, f"residual ({kind})")


@pytest.mark.parametrize("backend", ["numba", "cuda-emulated"])
@pytest.mark.parametrize("n", [1, 16, 65, 3109])
def test_chunk_decompress_add_matches_the_reference(emulator, backend, n):
    pytest.importorskip("numba")
    generator = torch.Generator().manual_seed(n)
    codes = torch.randint(-(2**31), 2**31, ((n + 15) // 16,), generator=generator, dtype=torch.int64).to(torch.int32)
    if n % 16:  # unused bits of the last word are zero by contract
        codes[-1] &= (1 << (2 * (n % 16))) - 1
    scales = torch.rand((n + 63) // 64, generator=generator) * 3
    start = make_values("special", n, seed=n)
    start[: min(n, 8)] = -0.0  # -0.0 + 0.0 is +0.0: the kernels must add, not skip
    expected = start.clone()
    torch_ops.twobit_chunk_decompress_add(codes, scales, expected)
    out = Guarded(n, torch.float32, fill=start)
    if backend == "numba":
        from gradcomp.backends.numba import ops

        ops.twobit_chunk_decompress_add(codes, scales, out.tensor)
    else:
        cuda_ops.plan_twobit_chunk_decompress_add(emulator, CHUNK_TINY, codes, scales, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["aliased", "separate", "none"])
def test_numba_matches_the_reference_across_parallel_parts(dtype, mode):
    """Three parallel parts of the Numba kernels, the last one ending in a chunk of 17 elements (not
    a whole word): every chunk's codes, scales, residuals and decoded values."""
    pytest.importorskip("numba")
    from gradcomp.backends.numba import ops, twobit_chunk

    n = 2 * twobit_chunk.PART_CHUNKS * twobit_chunk.CHUNK + 17
    grad, residual_in, residual_out = make_case(dtype, mode, n, "special", seed=11)
    expected_codes, expected_scales, expected_residual = reference(grad, residual_in, residual_out is not None)
    codes, scales = run_numba(grad, residual_in, residual_out.tensor if residual_out is not None else None)
    assert_same(codes, expected_codes, "codes")
    assert_same(scales, expected_scales, "scales")
    if residual_out is not None:
        residual_out.check("residual_out")
        assert_same(residual_out.tensor, expected_residual, "residual")
    start = make_values("special", n, seed=12)
    expected = start.clone()
    torch_ops.twobit_chunk_decompress_add(codes, scales, expected)
    out = Guarded(n, torch.float32, fill=start)
    ops.twobit_chunk_decompress_add(codes, scales, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_chunk_code_keeps_the_error_feedback_identity(backend, dtype):
    """``acc == decoded + residual'`` for every element, and every chunk sends +-alpha or 0."""
    if backend == "numba":
        pytest.importorskip("numba")
    compressor = gradcomp.TwoBit("chunk")
    n = 1000
    grad, residual_in, _ = make_case(dtype, "in-only", n, "normal", seed=3)
    residual_out = torch.empty(n)
    payload = compressor.compress(grad, residual_in, residual_out, backend=backend)
    compressor.check_payload(payload, n)
    decoded = torch.zeros(n)
    compressor.decompress_add(payload, decoded, backend=backend)
    torch.testing.assert_close(decoded + residual_out, grad.float() + residual_in, rtol=0, atol=1e-6)
    scales = payload["scales"]
    for c in range((n + 63) // 64):
        values = set(decoded[64 * c: 64 * c + 64].abs().unique().tolist())
        assert values <= {0.0, float(scales[c])}


def test_chunk_level_follows_each_chunk_not_the_tensor():
    """A chunk of small values still sends its own largest entries (a tensor-wide threshold would
    send nothing there), and a large entry is sent at its chunk's magnitude."""
    acc = torch.cat([torch.full((64,), 1e-4), torch.full((64,), 10.0)])
    acc[0], acc[64] = 5e-4, 50.0
    compressor = gradcomp.TwoBit("chunk")
    payload = compressor.compress(acc, backend="torch")
    decoded = compressor.decompress(payload, torch.zeros(128), backend="torch")
    assert decoded[:64].abs().max() > 0 and float(payload["scales"][0]) < 1e-3
    assert float(payload["scales"][1]) >= 10.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_scale_no_compressor_writes_is_rejected(bad):
    compressor = gradcomp.TwoBit("chunk")
    payload = compressor.compress(torch.randn(200), backend="torch")
    payload["scales"][2] = bad
    with pytest.raises(ValueError, match="chunk 2"):
        compressor.check_payload(payload, 200)


def test_chunk_mode_has_a_spec_and_the_payload_size_of_its_layout():
    compressor = gradcomp.from_spec("twobit:chunk")
    assert compressor.spec == "twobit:chunk" and compressor.chunked
    layout = compressor.layout(1000, torch.float32)
    assert [s.numel for s in layout.segments] == [63, 16]
    with pytest.raises(ValueError, match="'rms' or 'chunk'"):
        gradcomp.TwoBit("chunks")
