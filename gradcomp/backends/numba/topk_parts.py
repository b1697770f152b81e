"""Exact top-k of every small part of one flat group in one call (the per-parameter groups of the recipe's Adam).

A per-parameter top-k payload selects each parameter's own ``k`` largest. Part by part, each selection pays the
op's fixed cost (argument checks, NumPy views of five tensors, the kernel lock, a dispatch into three parallel
regions): about 47 us for a 4,096-element part of which the selection is 14 us (one thread, medians of 500
calls, an informal timing), so that charlm-small's 28 parts took 2.9 ms where one selection over its 437,760
elements takes 0.8 ms. :func:`compress_parts_kernel` runs every part's selection in one serial call.

Each part is selected exactly as :func:`gradcomp.backends.numba.topk.compress_kernel` selects it with one chunk
(its own helpers, in the same order, over the part's elements of the group's arrays), so values, indices and
residuals are bitwise the per-part op's; the indices are made the part's own afterwards. Only parts of one chunk
(:func:`~gradcomp.backends.numba.topk.chunk_count` of 1) come here: larger ones keep the parallel kernel, whose
chunks give its threads work.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from gradcomp.backends.numba.common import BLOCK
from gradcomp.backends.numba.topk import (
    LEVEL1_BINS,
    SUB_HISTOGRAMS,
    collect_chunk,
    histogram_chunk,
    plan_candidates,
    plan_selection,
    take,
    write_chunk,
)

__all__ = ["compress_parts_kernel"]


@njit(cache=True)
def compress_parts_kernel(grad, residual_in, residual_out, values, indices, lo, hi, out_lo, out_hi,
                          work_hist, work_index, work_bits, work_bound):
    """Top-k of ``acc = grad + residual_in`` over each part ``p``, elements ``[lo[p], hi[p])`` of the group, into
    ``values[out_lo[p]:out_hi[p]]`` and ``indices[out_lo[p]:out_hi[p]]`` (``k = out_hi[p] - out_lo[p]``, ``1 <= k <=
    hi[p] - lo[p]``; indices the part's own positions, ascending); the part's residual into ``residual_out`` (an
    array, ``None``, or ``True``: in place). ``lo``..``out_hi``: int64 ``[parts]``, checked by the caller.

    ``work_*`` are :class:`~gradcomp.backends.numba.topk.Workspace`'s scratch (``work_hist`` at least one row).
    Returns the most candidates and boundary keys one part needed, to size the workspace for the next call.
    """
    scratch = np.empty(BLOCK, np.uint16)
    sub_hist = np.empty((SUB_HISTOGRAMS, LEVEL1_BINS), np.int32)
    flags = np.empty(BLOCK, np.uint8)
    hist = work_hist[:1]
    most_candidates, most_boundary = 0, 0
    for p in range(lo.size):
        k = out_hi[p] - out_lo[p]
        part_values, part_indices = values[out_lo[p]:out_hi[p]], indices[out_lo[p]:out_hi[p]]
        histogram_chunk(grad, residual_in, residual_out, lo[p], hi[p], scratch, sub_hist, hist[0])
        boundary_bin, above_boundary, cand_start, bound_start, definite = plan_candidates(hist, k)
        cand_index = take(work_index, cand_start[1])
        cand_bits = take(work_bits, cand_start[1])
        boundary = take(work_bound, bound_start[1])
        collect_chunk(grad, residual_in, residual_out, part_values, boundary_bin, lo[p], hi[p], flags,
                      cand_index, cand_bits, 0, boundary, 0)
        threshold, ties, out_start = plan_selection(boundary, bound_start, definite, boundary_bin, k - above_boundary)
        write_chunk(cand_index, cand_bits, 0, cand_start[1] - 1, boundary_bin, threshold, ties[0], part_values,
                    part_indices, 0, out_start[1], residual_in, residual_out)
        for j in range(k):  # group positions -> the part's own
            part_indices[j] -= lo[p]
        most_candidates = max(most_candidates, cand_start[1])
        most_boundary = max(most_boundary, bound_start[1])
    return most_candidates, most_boundary
