"""A group's quantized parts as one table of work units, and the quantizers' compress over it in one call (the
``numba`` forms of ``threebit_compress`` and ``twobit_chunk_compress`` in :data:`gradcomp.backends.PART_OPS`).

A per-parameter group under Adam has one part a parameter (charlm-small: 10 quantized parts a group). Called
part by part, the op spent more on its own Python (each part's spans and views) than on the kernels' launches; one
call over a table of the parts' work units does that once (warm, one thread, charlm-small's 3-bit group, the op as
a whole: 0.349 -> 0.308 ms, medians of three runs of ``experiments/results/research-step-overhead/compress_warm.py``
before and after, informal; the bare kernels part by part 0.328 ms against 0.324 in one call). Each unit is a
part's run of tiles (3-bit) or chunks (2-bit) encoded by the family's own per-part loop on views of the part's
elements, words and scales, so the bits are the part-by-part call's (``tests/test_per_parameter.py``,
``tests/test_divided_exchange.py``). :func:`units` also feeds
:mod:`~gradcomp.backends.numba.average`.
"""
from __future__ import annotations

import functools
from typing import Tuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from gradcomp.backends.numba import threebit, twobit_chunk
from gradcomp.backends.parts import Part

__all__ = ["units", "compress_kernel"]


@functools.lru_cache(maxsize=64)
def units(parts: Tuple[Part, ...], block: int, per_unit: int) -> np.ndarray:
    """int64 ``[U, 6]``: ``(lo, numel, codes, scales, first, stop)``, each part's blocks of ``block`` elements (tiles
    or chunks) cut into runs of at most ``per_unit`` (the parallel loop's work items; a plan's parts are one tuple
    for the group's life, so this is built once)."""
    rows = []
    for part in parts:
        blocks = -(-part.numel // block)
        rows.extend((part.lo, part.numel, part.codes, part.scales, first, min(blocks, first + per_unit))
                    for first in range(0, blocks, per_unit))
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    table.setflags(write=False)
    return table


def window(array, lo, numel):
    """``array[lo : lo + numel]``; ``None`` and the in-place marker ``True`` as they are (typed in Numba only)."""
    raise NotImplementedError("window is for compiled code")


@overload(window)
def _window(array, lo, numel):
    if isinstance(array, (types.NoneType, types.Boolean)):
        return lambda array, lo, numel: array
    return lambda array, lo, numel: array[lo:lo + numel]


@njit(parallel=True, cache=True)
def compress_kernel(grad, residual_in, residual_out, words, units, divisor, threebits):
    """Every unit of the table compressed into uint32 ``words`` (the group's payload), the 3-bit code
    (``threebits``; ``divisor`` float32 ``[n]`` or ``None``) or the chunked 2-bit code (``divisor`` ``None``):
    each unit's tiles or chunks as the family's ``compress_part`` on the part's views. ``residual_out``: array,
    ``None`` or ``True`` (in place), as the per-part kernels take it."""
    scale_words = words.view(np.float32)
    code_bytes = words.view(np.uint8)
    for u in prange(units.shape[0]):
        row = units[u]
        lo, numel, codes, scales, first, stop = row[0], row[1], row[2], row[3], row[4], row[5]
        grad_part = grad[lo:lo + numel]
        residual_in_part, residual_out_part = window(residual_in, lo, numel), window(residual_out, lo, numel)
        if threebits:
            threebit.compress_part(grad_part, residual_in_part, residual_out_part,
                                   words[codes:codes + (numel + threebit.PER_WORD - 1) // threebit.PER_WORD],
                                   scale_words[scales:scales + (numel + threebit.CHUNK - 1) // threebit.CHUNK],
                                   first, stop, window(divisor, lo, numel))
        else:
            chunks = (numel + twobit_chunk.CHUNK - 1) // twobit_chunk.CHUNK
            twobit_chunk.compress_part(grad_part, residual_in_part, residual_out_part,
                                       code_bytes[4 * codes:4 * codes + 4 * ((numel + 15) // 16)],
                                       scale_words[scales:scales + chunks], first, stop)
