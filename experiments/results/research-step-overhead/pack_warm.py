"""Warm, one thread: the 3-bit code's pack and unpack of charlm-small's 43,776 words (64 words a tile, as the kernels
call them), the scalar loops they were before 439b9d8 against ``gradcomp.backends.numba.threebit``'s (eight words at a
time as LLVM vector code), interleaved; medians of ``REPEATS`` passes each, and that both give the same bits.
Informal. From the repository root::

    PYTHONPATH=. python experiments/results/research-step-overhead/pack_warm.py [REPEATS]
"""
import statistics
import sys
import time

import numba
import numpy as np
from numba import njit

from gradcomp.backends.numba import threebit

_TEN = np.uint64(10)


@njit(cache=False)
def scalar_pack(code, count, code_words, first):
    for w in range(np.uint64(count)):
        k = w * _TEN
        packed = np.uint32(0)
        for b in range(10):
            packed |= np.uint32(code[k + np.uint64(b)]) << np.uint32(3 * b)
        code_words[np.uint64(first) + w] = packed


@njit(cache=False)
def scalar_unpack(code_words, first, count, code):
    for w in range(np.uint64(count)):
        x = code_words[np.uint64(first) + w]
        k = w * _TEN
        for b in range(10):
            code[k + np.uint64(b)] = np.uint8((x >> np.uint32(3 * b)) & np.uint32(7))


@njit(cache=False)
def passes(vector, unpack, words, code):
    """One pass over ``words``, a tile's 64 words at a time, into or out of the 640-code scratch ``code``."""
    for tile in range(words.size // threebit.TILE_WORDS):
        first = tile * threebit.TILE_WORDS
        if unpack:
            if vector:
                threebit.unpack_words(words, first, threebit.TILE_WORDS, code)
            else:
                scalar_unpack(words, first, threebit.TILE_WORDS, code)
        elif vector:
            threebit.pack_words(code, threebit.TILE_WORDS, words, first)
        else:
            scalar_pack(code, threebit.TILE_WORDS, words, first)


def round_trip(vector: bool, words: np.ndarray):
    """Every tile of ``words`` unpacked, then packed again from those codes: ``(codes, words)``."""
    unpack, pack = (threebit.unpack_words, threebit.pack_words) if vector else (scalar_unpack, scalar_pack)
    codes, packed = np.zeros(words.size * 10, np.uint8), np.zeros_like(words)
    for first in range(0, words.size, threebit.TILE_WORDS):
        unpack(words, first, threebit.TILE_WORDS, codes[first * 10:])
        pack(codes[first * 10:], threebit.TILE_WORDS, packed, first)
    return codes, packed


def main(repeats: int) -> None:
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**30, 43776, dtype=np.uint32)
    code = rng.integers(0, 8, threebit.TILE, dtype=np.uint8)
    same = all(np.array_equal(a, b) for a, b in zip(round_trip(False, words), round_trip(True, words)))
    timed = {(unpack, vector): [] for unpack in (True, False) for vector in (False, True)}
    scratch, target = np.zeros(threebit.TILE, np.uint8), words.copy()
    for _ in range(repeats):
        for (unpack, vector), seconds in timed.items():
            begin = time.perf_counter()
            passes(vector, unpack, words if unpack else target, scratch if unpack else code)
            seconds.append(time.perf_counter() - begin)
    print(f"{words.size} words, medians of {repeats}; the same bits: {same}")
    for (unpack, vector), seconds in timed.items():
        print(f"{statistics.median(seconds[repeats // 10:]) * 1e3:7.3f} ms  {'unpack' if unpack else 'pack'}, "
              f"{'vector' if vector else 'scalar'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
