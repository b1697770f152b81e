"""The received payload's check over every part of a group in one pass (the ``numba`` form of
:data:`gradcomp.backends.FORMS`' ``"check"``).

:func:`gradcomp.backends.parts.parts_valid`'s torch form gathers every code word with ``index_select`` and then
reduces the copy: on charlm-small's 3-bit payloads (437,760 elements in two groups, 43,776 code words) about
0.65 ms a step for one rank's payloads, and every received payload takes it. This pass reads each part's words
where they lie, ORs them together and tests the spare bits once; it accepts exactly what the torch form accepts
(the tests compare them on valid and corrupted payloads). It is serial: the work is a few ten thousand words,
less than one fork-join of a parallel kernel.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gradcomp.backends import implements_form

_LARGEST_FINITE = np.uint32(0x7F7FFFFF)  # float32 max: every bit pattern up to it is a finite value >= +0.0
_NEGATIVE_ZERO = np.uint32(0x80000000)  # -0.0 >= 0, as the torch form's comparison has it


@njit(cache=True)
def valid_kernel(words, code_runs, last, shifts, scale_runs, spare_mask):
    """``False`` if a code word (``words[start:stop]`` for each row of int64 ``code_runs [r, 2]``) sets a bit of
    ``spare_mask``, a last word ``words[last[j]]`` a bit at or past ``shifts[j]``, or a scale (the rows of
    ``scale_runs``; float32 bits in uint32 ``words``) is not in ``[0, float32 max]`` (NaN is not); read only.
    A run or position past ``words`` fails (the caller checked the layout; this only keeps every read inside)."""
    n = np.uint64(words.size)
    seen = np.uint32(0)
    for r in range(code_runs.shape[0]):
        start, stop = np.uint64(code_runs[r, 0]), np.uint64(code_runs[r, 1])
        if stop > n:
            return False
        for k in range(start, stop):  # an OR over a run of words: a loop LLVM vectorises
            seen |= words[k]
    if seen & spare_mask:
        return False
    for j in range(last.size):
        if np.uint64(last[j]) >= n or words[last[j]] >> np.uint32(shifts[j]):
            return False
    bad = False
    for r in range(scale_runs.shape[0]):
        start, stop = np.uint64(scale_runs[r, 0]), np.uint64(scale_runs[r, 1])
        if stop > n:
            return False
        for k in range(start, stop):
            bits = words[k]
            bad |= (bits > _LARGEST_FINITE) & (bits != _NEGATIVE_ZERO)
    return not bad


@implements_form("check", "parts_valid", "numba")
def parts_valid(words: torch.Tensor, index) -> bool:
    """:func:`gradcomp.backends.parts.parts_valid` for int32 ``words`` and a :class:`~gradcomp.backends.parts.PartIndex`
    on the CPU."""
    spare_mask = np.uint32(0) if not index.spare else np.uint32(((1 << index.spare) - 1) << (32 - index.spare))
    return bool(valid_kernel(words.numpy().view(np.uint32), index.code_runs.numpy(), index.last.numpy(),
                             index.shifts.numpy(), index.scale_runs.numpy(), spare_mask))
