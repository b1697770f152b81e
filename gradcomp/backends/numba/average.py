"""The average of every rank's quantized payloads over a group's parts in one pass (the ``numba`` forms of
``threebit_average`` and ``twobit_chunk_average``, :data:`gradcomp.backends.PART_OPS`).

The rank-by-rank average zeroes the group, adds each rank's decode (a read and a write of the group per rank),
divides by the ranks' count, multiplies back by Adam's frozen denominators and reads the result again for the
commit's finite check. These forms sum a chunk's decodes in a scratch row (from +0.0, in rank order: the same
float32 additions), write each element once, divided and multiplied, and return whether all they wrote is finite,
in one call for every part of the group. Warm on one thread, charlm-small's 3-bit group of two ranks took 0.696 ms
against 0.948 ms rank by rank (``experiments/results/research-step-overhead/average_warm.py``, informal); decoding
the codes is most of what is left.

Work units are runs of a part's tiles (3-bit: 640 elements, whole code words and scales) or chunks (2-bit: 64),
``(lo, numel, codes, scales, first, stop)`` rows of an int64 table built once per layout; ``words`` is uint32
``[P, W]``, one rank's payload a row.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from gradcomp.backends import checks, implements_parts
from gradcomp.backends.numba import threebit, twobit_chunk
from gradcomp.backends.numba.common import load
from gradcomp.backends.numba.concurrency import serialized
from gradcomp.backends.numba.group_parts import units
from gradcomp.backends.numba.ops import as_array
from gradcomp.backends.parts import check_parts

_ABS_BITS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


@njit(cache=True, error_model="numpy")  # Python's model tests every divisor for zero: a branch LLVM cannot vectorise
def finish_row(acc, length, count, multiplier, out, at):
    """``out[at + j] = acc[j] / count`` (times ``multiplier[at + j]`` unless ``None``), ``j < length``; returns the
    largest ``|out[at + j]|``'s bits (``>= 0x7F800000``: one is not finite)."""
    for j in range(np.uint64(length)):
        i = np.uint64(at) + j
        if multiplier is None:
            out[i] = acc[j] / count
        else:
            out[i] = acc[j] / count * multiplier[i]
    bits = out.view(np.uint32)
    largest = np.uint32(0)
    for j in range(np.uint64(length)):
        largest = max(largest, bits[np.uint64(at) + j] & _ABS_BITS)
    return largest


@njit(cache=True)
def threebit_unit(words, lo, numel, codes, scales, first, stop, count, multiplier, out):
    """Tiles ``[first, stop)`` of the 3-bit part of ``numel`` elements at ``lo`` (codes from word ``codes``, scales
    from word ``scales`` of every row); returns the largest bits written."""
    acc = np.empty(threebit.TILE, np.float32)
    code = np.empty(threebit.TILE, np.uint8)
    largest = np.uint32(0)
    for t in range(first, stop):
        length = min(threebit.TILE, numel - t * threebit.TILE)
        acc[:length] = np.float32(0.0)  # as the zeroed group: -0.0 decodes to +0.0
        for rank in range(words.shape[0]):
            row = words[rank]
            threebit.unpack_words(row, codes + t * threebit.TILE_WORDS,
                                  (length + threebit.PER_WORD - 1) // threebit.PER_WORD, code)
            scale_row = row.view(np.float32)
            for c in range((length + threebit.CHUNK - 1) // threebit.CHUNK):
                threebit.decode_chunk(code, c * threebit.CHUNK, min(length, (c + 1) * threebit.CHUNK),
                                      scale_row[scales + t * threebit.TILE_CHUNKS + c], acc, 0)
        largest = max(largest, finish_row(acc, length, count, multiplier, out, lo + t * threebit.TILE))
    return largest


@njit(cache=True)
def twobit_chunk_unit(words, lo, numel, codes, scales, first, stop, count, multiplier, out):
    """Chunks ``[first, stop)`` of the chunked 2-bit part, as :func:`threebit_unit`."""
    size = twobit_chunk.CHUNK
    acc = np.empty(size, np.float32)
    code = np.empty(size, np.uint8)
    code_u32 = code.view(np.uint32)
    largest = np.uint32(0)
    for c in range(first, stop):
        length = min(size, numel - c * size)
        acc[:length] = np.float32(0.0)
        for rank in range(words.shape[0]):
            row = words[rank]
            twobit_chunk.decode_chunk(row.view(np.uint8), 4 * codes + c * (size // 4), length,
                                      row.view(np.float32)[scales + c], code, code_u32, acc, 0)
        largest = max(largest, finish_row(acc, length, count, multiplier, out, lo + c * size))
    return largest


@njit(cache=True, error_model="numpy")
def dense_elements(values, elements, slots, count, multiplier, out):
    """``out[elements[j]] = (0 + v_0 + ... + v_{P-1}) / count`` (times the multiplier there), ``v_r`` rank ``r``'s
    value ``values[r, slots[j]]`` (float32, or half-precision bits) in float32; returns the largest bits written."""
    bits = out.view(np.uint32)
    largest = np.uint32(0)
    for j in range(elements.size):
        acc = np.float32(0.0)
        for rank in range(values.shape[0]):
            acc = acc + load(values[rank], slots[j])
        at = elements[j]
        if multiplier is None:
            out[at] = acc / count
        else:
            out[at] = acc / count * multiplier[at]
        largest = max(largest, bits[at] & _ABS_BITS)
    return largest


@njit(parallel=True, cache=True)
def average_kernel(words, units, count, multiplier, out, threebits, values, elements, slots):
    """``out[i] = (0 + D_0[i] + ... + D_{P-1}[i]) / count`` (times ``multiplier[i]`` unless ``None``) over every
    unit of the table, the 3-bit code's (``threebits``) or the chunked 2-bit code's, and over the dense elements
    (:func:`dense_elements`); ``count`` float32. Returns whether every element written is finite."""
    largest = np.zeros(units.shape[0] + 1, np.uint32)
    for u in prange(units.shape[0]):
        r = units[u]
        if threebits:
            largest[u] = threebit_unit(words, r[0], r[1], r[2], r[3], r[4], r[5], count, multiplier, out)
        else:
            largest[u] = twobit_chunk_unit(words, r[0], r[1], r[2], r[3], r[4], r[5], count, multiplier, out)
    largest[units.shape[0]] = dense_elements(values, elements, slots, count, multiplier, out)
    return largest.max() < _INF_BITS


_EMPTY = (torch.zeros(1, 0), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def check_words(op: str, words) -> None:
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 2 or not (
            words.is_contiguous() and words.shape[0] >= 1):
        raise TypeError(f"{op}: words must be a contiguous int32 [P >= 1, W] tensor, got "
                        f"{getattr(words, 'dtype', type(words).__name__)} {tuple(getattr(words, 'shape', ()))}")


def check_dense(op: str, dense, ranks: int, n: int):
    """``dense`` (``(values [P, X], elements int64 [k], slots int64 [k])``) if every index is inside its array."""
    values, elements, slots = dense
    if values.dim() != 2 or values.shape[0] != ranks or not values.is_contiguous() or values.dtype not in (
            torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: dense values must be a contiguous float [{ranks}, X] tensor, got "
                        f"{values.dtype} {tuple(values.shape)}")
    for name, index, size in (("elements", elements, n), ("slots", slots, values.shape[1])):
        if index.dtype != torch.int64 or index.dim() != 1 or index.numel() != elements.numel() or (
                index.numel() and not (0 <= int(index.min()) and int(index.max()) < size)):
            raise ValueError(f"{op}: dense {name} must be int64 [{elements.numel()}] indices below {size}")
    return values, elements.contiguous(), slots.contiguous()


def _average(op: str, block: int, per_unit: int):
    threebits = op.startswith("threebit")

    @implements_parts(op, "numba")
    @serialized
    def average(words, parts, out, multiplier=None, dense=None) -> bool:
        """See :mod:`gradcomp.backends.parts` (``average``); returns whether every element written is finite."""
        checks.check_vector(op, "out", out, (torch.float32,))
        checks.check_vector(op, "multiplier", multiplier, (torch.float32,), out.numel())
        check_words(op, words)
        check_parts(op, parts, out.numel(), words.shape[1])
        values, elements, slots = _EMPTY if dense is None else check_dense(op, dense, words.shape[0], out.numel())
        return bool(average_kernel(as_array(words).view(np.uint32), units(tuple(parts), block, per_unit),
                                   np.float32(words.shape[0]), as_array(multiplier), as_array(out), threebits,
                                   as_array(values), elements.numpy(), slots.numpy()))

    return average


threebit_average = _average("threebit_average", threebit.TILE, threebit.PART_TILES)
twobit_chunk_average = _average("twobit_chunk_average", twobit_chunk.CHUNK, twobit_chunk.PART_CHUNKS)
