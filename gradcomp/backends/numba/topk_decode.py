"""Top-k decode on the CPU: scatter-add a peer's ``(values, indices)`` into a dense tensor, after
checking the indices (the counterpart of the decode kernel in ``csrc/topk.cu``).

A peer's payload is untrusted input: the indices are checked in their own pass before any
write, which is also what makes the parallel scatter safe (valid indices are unique).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from gradcomp.backends.numba.common import load


@njit(cache=True)
def count_not_increasing(indices):
    """How many ``j >= 1`` have ``indices[j] <= indices[j - 1]`` (0: strictly increasing).

    A flat loop over unsigned positions that LLVM vectorises: it streams the indices once.
    """
    count = 0
    one = np.uint64(1)
    for j in range(one, np.uint64(indices.size)):
        count += indices[j] <= indices[j - one]
    return count


@njit(parallel=True, cache=True)
def decompress_add_kernel(values, indices, out):
    """``out[indices[j]] += values[j]`` for every ``j``, if the indices strictly increase
    and lie in ``[0, out.size)``; otherwise nothing is written.

    Returns 0 when it decoded, else a positive count of failures. Checking first, in its
    own pass, is what makes the parallel writes safe: valid indices are unique, so no two
    threads add to the same element (duplicates would race and lose updates), and none
    writes outside ``out`` (a peer's index is untrusted input). Strictly increasing with
    the first >= 0 and the last < n means every index is in range.
    """
    k = values.size
    if k == 0:
        return 0
    bad = count_not_increasing(indices) + np.int64(indices[0] < 0) + np.int64(indices[k - 1] >= out.size)
    if bad == 0:
        for j in prange(k):
            i = indices[j]
            out[i] = out[i] + load(values, j)
    return bad
