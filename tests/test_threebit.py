"""The chunk-scaled 3-bit code (``ThreeBit()``): the same bits on every backend.

The torch reference defines the arithmetic (a float32 maximum per 128-element chunk, ``rint(acc / s)``
clamped to ``[-3, 3]``); the Numba kernels and the CUDA kernels (executed through the CPU emulation,
launched by the plans the GPU runs, with a capped grid so that inputs past 1920 elements wrap the
grid-stride loop) must reproduce its codes, scales, residuals and decoded values bit for bit, for
every gradient dtype, residual arrangement and kind of data, NaN and infinities included. The
compressor keeps the error-feedback identity and rejects payloads no encoder writes.
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

# Word and chunk boundaries (10, 128), the 640-element tile, and the emulated grid's wrap at 1920.
SIZES = [1, 9, 10, 11, 127, 128, 129, 639, 640, 641, 1000, 1921, 3109]
KINDS = ("normal", "ties", "zeros", "special")
TINY = cuda_ops.LaunchConfig(threads=64, max_blocks=3, histogram_blocks=3)


def words(n: int) -> int:
    return -(-n // 10)


def chunks(n: int) -> int:
    return -(-n // 128)


@pytest.fixture(scope="module")
def emulator():
    return build_emulator()


def reference(grad, residual_in, with_residual: bool):
    n = grad.numel()
    codes, scales = torch.empty(words(n), dtype=torch.int32), torch.empty(chunks(n))
    residual = torch.empty(n) if with_residual else None
    torch_ops.threebit_compress(grad, residual_in.clone() if residual_in is not None else None, residual, codes,
                                scales)
    return codes, scales, residual


def run(backend, emulator, grad, residual_in, residual_out):
    n = grad.numel()
    codes, scales = Guarded(words(n), torch.int32), Guarded(chunks(n), torch.float32)
    if backend == "numba":
        from gradcomp.backends.numba import ops

        ops.threebit_compress(grad, residual_in, residual_out, codes.tensor, scales.tensor)
    else:
        cuda_ops.plan_threebit_compress(emulator, TINY, grad, residual_in, residual_out, codes.tensor, scales.tensor)
    codes.check("codes")
    scales.check("scales")
    return codes.tensor, scales.tensor


CASES = [(b, d, m, n) for b in ("numba", "cuda-emulated") for d in DTYPES for m in RESIDUAL_MODES for n in SIZES]
QUICK = [("numba", torch.float32, "aliased", 1000), ("cuda-emulated", torch.bfloat16, "separate", 1921),
         ("cuda-emulated", torch.float32, "aliased", 129)]


@pytest.mark.parametrize("backend,dtype,mode,n", multiprocess.slow_except(CASES, QUICK))
def test_compress_matches_the_reference_bit_for_bit(emulator, backend, dtype, mode, n):
    pytest.importorskip("numba")
    for kind in KINDS:
        grad, residual_in, residual_out = make_case(dtype, mode, n, kind, seed=n)
        expected_codes, expected_scales, expected_residual = reference(grad, residual_in, residual_out is not None)
        out = residual_out.tensor if residual_out is not None else None
        codes, scales = run(backend, emulator, grad, residual_in, out)
        assert_same(codes, expected_codes, f"codes ({kind})")
        assert_same(scales, expected_scales, f"scales ({kind})")
        if residual_out is not None:
            residual_out.check("residual_out")
            assert_same(residual_out.tensor, expected_residual, f"residual ({kind})")


@pytest.mark.parametrize("backend", ["numba", "cuda-emulated"])
@pytest.mark.parametrize("n", [1, 10, 129, 3109])
def test_decompress_add_matches_the_reference(emulator, backend, n):
    """Every code 0-7 at every position, any scale (negative ones too: the decoder must not care)."""
    pytest.importorskip("numba")
    generator = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 2**30, (words(n),), generator=generator, dtype=torch.int64).to(torch.int32)
    if n % 10:  # the bits past the last element are zero by contract
        codes[-1] &= (1 << (3 * (n % 10))) - 1
    scales = torch.randn(chunks(n), generator=generator) * 3
    start = make_values("special", n, seed=n)
    start[: min(n, 8)] = -0.0  # -0.0 + 0.0 is +0.0: the kernels must add, not skip
    expected = start.clone()
    torch_ops.threebit_decompress_add(codes, scales, expected)
    out = Guarded(n, torch.float32, fill=start)
    if backend == "numba":
        from gradcomp.backends.numba import ops

        ops.threebit_decompress_add(codes, scales, out.tensor)
    else:
        cuda_ops.plan_threebit_decompress_add(emulator, TINY, codes, scales, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["aliased", "separate", "none"])
def test_numba_matches_the_reference_across_parallel_parts(dtype, mode):
    """Three parallel parts of the Numba kernels, the last one ending in a tile of 641 % 640 = 1
    element (not a whole word or chunk): every tile's codes, scales, residuals and decoded values."""
    pytest.importorskip("numba")
    from gradcomp.backends.numba import ops, threebit

    n = 2 * threebit.PART_TILES * threebit.TILE + 641
    grad, residual_in, residual_out = make_case(dtype, mode, n, "special", seed=11)
    expected_codes, expected_scales, expected_residual = reference(grad, residual_in, residual_out is not None)
    codes, scales = run("numba", None, grad, residual_in, residual_out.tensor if residual_out is not None else None)
    assert_same(codes, expected_codes, "codes")
    assert_same(scales, expected_scales, "scales")
    if residual_out is not None:
        residual_out.check("residual_out")
        assert_same(residual_out.tensor, expected_residual, "residual")
    start = make_values("special", n, seed=12)
    expected = start.clone()
    torch_ops.threebit_decompress_add(codes, scales, expected)
    out = Guarded(n, torch.float32, fill=start)
    ops.threebit_decompress_add(codes, scales, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_code_keeps_the_error_feedback_identity_and_seven_levels(backend, dtype):
    """``acc == decoded + residual'`` for every element; every chunk sends ``q * s``, ``|q| <= 3``,
    its largest entry at exactly ``3 s``; the rounding error is at most ``s / 2``."""
    if backend == "numba":
        pytest.importorskip("numba")
    compressor = gradcomp.ThreeBit()
    n = 1000
    grad, residual_in, _ = make_case(dtype, "in-only", n, "normal", seed=3)
    residual_out = torch.empty(n)
    payload = compressor.compress(grad, residual_in, residual_out, backend=backend)
    compressor.check_payload(payload, n)
    decoded = compressor.decompress(payload, torch.zeros(n), backend=backend)
    acc = grad.float() + residual_in
    torch.testing.assert_close(decoded + residual_out, acc, rtol=0, atol=1e-6)
    for c in range(chunks(n)):
        s = float(payload["scales"][c])
        part, sent = acc[128 * c: 128 * c + 128], decoded[128 * c: 128 * c + 128]
        assert s == pytest.approx(float(part.abs().max()) / 3, rel=1e-6)
        assert set((sent / s).round().tolist()) <= {-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0}
        assert float((part - sent).abs().max()) <= s / 2 * (1 + 1e-5)


def test_non_finite_entries_decode_as_nan_and_keep_their_residual():
    grad = torch.randn(300)
    grad[[3, 150]] = torch.tensor([float("nan"), float("inf")])
    residual = torch.empty(300)
    compressor = gradcomp.ThreeBit()
    payload = compressor.compress(grad, None, residual, backend="torch")
    decoded = compressor.decompress(payload, torch.zeros(300), backend="torch")
    assert decoded.isnan().nonzero().flatten().tolist() == [3, 150]
    assert residual[3].isnan() and residual[150] == float("inf")
    assert torch.isfinite(payload["scales"]).all()  # the chunk's scale ignores them


def test_each_chunk_gets_its_own_scale():
    """A chunk of small values is sent at its own resolution next to a chunk of large ones."""
    acc = torch.cat([torch.linspace(-1e-4, 1e-4, 128), torch.linspace(-10.0, 10.0, 128)])
    compressor = gradcomp.ThreeBit()
    decoded = compressor.decompress(compressor.compress(acc, backend="torch"), torch.zeros(256), backend="torch")
    assert len(set(decoded[:128].tolist())) == 7 and len(set(decoded[128:].tolist())) == 7


def payload_of(n=200):
    compressor = gradcomp.ThreeBit()
    return compressor, compressor.compress(torch.randn(n), backend="torch")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_scale_no_encoder_writes_is_rejected(bad):
    compressor, payload = payload_of()
    payload["scales"][1] = bad
    with pytest.raises(ValueError, match="chunk 1"):
        compressor.check_payload(payload, 200)


@pytest.mark.parametrize("word", [1 << 30, -(2**31), -1])
def test_a_word_with_its_spare_bits_set_is_rejected(word):
    compressor, payload = payload_of()
    payload["codes"][4] = word
    with pytest.raises(ValueError, match="word 4"):
        compressor.check_payload(payload, 200)


def test_bits_past_the_last_element_are_rejected():
    compressor, payload = payload_of(205)
    payload["codes"][-1] |= 1 << 15  # element 205 of a 205-element tensor
    with pytest.raises(ValueError, match="past element 204"):
        compressor.check_payload(payload, 205)


def test_spec_and_payload_size():
    compressor = gradcomp.from_spec("threebit")
    assert compressor.spec == "threebit" and gradcomp.from_spec(compressor.spec).spec == "threebit"
    layout = compressor.layout(1000, torch.float32)
    assert [s.numel for s in layout.segments] == [100, 8]
    assert layout.nbytes == 4 * (100 + 8)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 16, 63, 64])
@pytest.mark.parametrize("first", [0, 3])
def test_numba_packs_and_unpacks_ten_codes_a_word(count, first):
    """The vector pack and unpack (eight words at a time) and their scalar tails against the word layout
    (code ``b`` of word ``w`` in bits ``3b``), at a word offset that is not a whole group; nothing outside the
    ``count`` words and ``10 * count`` codes is written."""
    import numpy as np

    from gradcomp.backends.numba import threebit

    rng = np.random.default_rng(count * 10 + first)
    code = rng.integers(0, 8, 640, dtype=np.uint8)
    shifts = np.arange(10, dtype=np.uint32) * 3
    expected = (code[:10 * count].reshape(count, 10).astype(np.uint32) << shifts).sum(axis=1, dtype=np.uint32)
    packed = np.full(first + count + 2, 0xFFFFFFFF, np.uint32)
    threebit.pack_words(code, count, packed, first)
    assert (packed[first:first + count] == expected).all()
    assert (packed[:first] == 0xFFFFFFFF).all() and (packed[first + count:] == 0xFFFFFFFF).all()
    unpacked = np.full(640, 255, np.uint8)
    threebit.unpack_words(packed, first, count, unpacked)
    assert (unpacked[:10 * count] == code[:10 * count]).all() and (unpacked[10 * count:] == 255).all()
