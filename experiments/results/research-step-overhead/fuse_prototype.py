"""Prototype (informal, not gradcomp): what a 3-bit compress that divides by Adam's frozen denominators as it
loads, and a decode that averages two payloads and multiplies back in one pass, take against the present passes
(warm, one thread, on charlm-small's 437,760 elements). Checks that both are bitwise the present sequence.

    NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 python experiments/results/research-step-overhead/fuse_prototype.py
"""
import statistics
import time

import numpy as np
import torch
from numba import njit

from gradcomp.backends.numba import threebit as tb
from gradcomp.backends.numba.common import NAN32

torch.set_num_threads(1)
N = 437760
TILES = (N + tb.TILE - 1) // tb.TILE
rng = np.random.default_rng(0)
grad = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
denom = torch.from_numpy((rng.random(N).astype(np.float32) + 0.1) * 1e-3)
residual = torch.from_numpy((rng.standard_normal(N) * 0.1).astype(np.float32))
residual_out = torch.empty_like(residual)
words = np.zeros((N + 9) // 10 + 10, np.uint32)
scales = np.zeros((N + 127) // 128 + 10, np.float32)


@njit(error_model="numpy")  # Python's model checks every divisor for zero, a branch that keeps LLVM from vectorising
def load_row_divided(g, div, residual_in, lo, length, acc):
    for j in range(np.uint64(length)):
        i = np.uint64(lo) + j
        acc[j] = g[i] / div[i] + residual_in[i]


@njit
def compress_divided(g, div, residual_in, residual_target, code_words, chunk_scales):
    n = g.size
    acc = np.empty(tb.TILE, np.float32)
    code = np.empty(tb.TILE, np.uint8)
    for t in range(TILES):
        lo = t * tb.TILE
        length = min(tb.TILE, n - lo)
        load_row_divided(g, div, residual_in, lo, length, acc)
        acc_bits = acc.view(np.uint32)
        for c in range((length + tb.CHUNK - 1) // tb.CHUNK):
            start, stop = c * tb.CHUNK, min(length, (c + 1) * tb.CHUNK)
            s = tb.chunk_scale(acc_bits, start, stop)
            chunk_scales[t * tb.TILE_CHUNKS + c] = s
            tb.quantize_chunk(acc, start, stop, s, code, residual_in, residual_target, lo)
        count = (length + tb.PER_WORD - 1) // tb.PER_WORD
        code[length: count * tb.PER_WORD] = 0
        tb.pack_words(code, count, code_words, t * tb.TILE_WORDS)


@njit
def average_chunk(c0, c1, start, stop, s0, s1, div, out, lo):
    """One chunk of two payloads' codes: ``out = ((0 + D_0) + D_1) / 2 * d``, a flat loop LLVM vectorises."""
    for j in range(np.uint64(start), np.uint64(stop)):
        k0, k1 = c0[j], c1[j]
        d0 = np.float32(np.int32(k0) - 3) * s0
        d1 = np.float32(np.int32(k1) - 3) * s1
        a = np.float32(0.0) + (NAN32 if k0 == 7 else d0)
        a = a + (NAN32 if k1 == 7 else d1)
        i = np.uint64(lo) + j
        out[i] = a / np.float32(2.0) * div[i]


@njit
def average_multiplied(w0, s0, w1, s1, div, out):
    n = out.size
    c0 = np.empty(tb.TILE, np.uint8)
    c1 = np.empty(tb.TILE, np.uint8)
    for t in range(TILES):
        lo = t * tb.TILE
        length = min(tb.TILE, n - lo)
        count = (length + tb.PER_WORD - 1) // tb.PER_WORD
        tb.unpack_words(w0, t * tb.TILE_WORDS, count, c0)
        tb.unpack_words(w1, t * tb.TILE_WORDS, count, c1)
        for c in range((length + tb.CHUNK - 1) // tb.CHUNK):
            chunk = t * tb.TILE_CHUNKS + c
            average_chunk(c0, c1, c * tb.CHUNK, min(length, (c + 1) * tb.CHUNK), s0[chunk], s1[chunk], div, out, lo)


def present_compress():
    source = grad.clone()
    source.div_(denom)
    tb.compress_kernel(source.numpy(), residual.numpy(), residual_out.numpy(), words, scales)


def fused_compress():
    compress_divided(grad.numpy(), denom.numpy(), residual.numpy(), residual_out.numpy(), words, scales)


other_words, other_scales, out = words.copy(), scales.copy(), torch.empty(N)


def present_average():
    out.zero_()
    tb.decompress_add_kernel(words, scales, out.numpy())
    tb.decompress_add_kernel(other_words, other_scales, out.numpy())
    out.div_(2)
    out.mul_(denom)


def fused_average():
    average_multiplied(words, scales, other_words, other_scales, denom.numpy(), out.numpy())


def median_ms(fn, repeats=80):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    for _ in range(3):
        print(" ".join(f"{fn.__name__} {median_ms(fn):.3f}"
                       for fn in (present_compress, fused_compress, present_average, fused_average)))
    present_compress()
    expected = residual_out.clone(), words.copy(), scales.copy()
    fused_compress()
    print("compress bitwise:", torch.equal(residual_out, expected[0]) and bool((words == expected[1]).all())
          and np.array_equal(scales.view(np.uint32), expected[2].view(np.uint32)))
    present_average()
    expected_out = out.clone()
    fused_average()
    print("average bitwise:", torch.equal(out.view(torch.int32), expected_out.view(torch.int32)))
