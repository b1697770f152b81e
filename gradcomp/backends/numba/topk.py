"""Exact top-k by radix select (the counterpart of ``csrc/topk.cu``).

The key of an element is ``bits(|acc|)``, 31 bits, with every NaN counted as
``0x7FFFFFFF`` (so NaN > inf > finite, as the contract wants). The selection is the ``k``
largest keys, ties to the lower index, found in four steps:

1. **Histogram** (pass 1 over the data, :func:`histogram_chunk`): compute ``acc``, write
   ``residual_out = acc`` and count, per chunk, the top 11 key bits (8 exponent + 3
   mantissa bits: :data:`LEVEL1_BINS` bins above :data:`LEVEL1_SHIFT`).
2. **Collect** (pass 2, :func:`collect_chunk`): the merged histogram names the
   *boundary bin* holding the k-th largest key. Chunk by chunk and in index order, every
   element whose key is in the boundary bin or above is appended to the candidates (``k``
   plus part of one bin), and the keys of the boundary bin to the boundary list. The
   elements above the boundary bin are selected whatever happens, so their residual is
   settled now, while their cache lines are hot.
3. **Plan** (:func:`plan_selection`): two small histograms over the boundary keys (the
   next 11 bits above :data:`LEVEL2_SHIFT`, then the last 9) give the exact k-th key, the
   *threshold*, and how many of the ties at the threshold each chunk takes; ties go to
   the lower index because chunks hand them out in index order.
4. **Write** (:func:`write_chunk`): a last pass over the candidates writes values and
   indices (ascending) and the residual of the selected keys of the boundary bin.

Everything that decides the selection is an integer count, so the result does not depend
on the thread count. The chunk count depends on ``n`` only (:func:`chunk_count`, never on
the number of threads); any partition into index-ordered chunks gives the same output,
the count only sets the parallel grain.

Only the loops over chunks run in parallel; the glue between them lives in serial
helpers, because every array expression in a parallel function would be its own
fork-join, and those are costly on a busy machine.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

from gradcomp.backends.numba.common import (
    BLOCK,
    bits_of_f32,
    f32_from_bits,
    key_of_bits,
    key_of_f32,
    load_acc,
    residual_target,
    roundtrip,
    store,
)

LEVEL1_SHIFT = 20  # level 1: key bits 30..20 (2048 bins), counted in pass 1 over all elements
LEVEL2_SHIFT = 9  # level 2: key bits 19..9 (2048 bins), over the boundary bin's keys only
LEVEL1_BINS = 2048
LEVEL2_BINS = 2048
LEVEL3_BINS = 512  # level 3: key bits 8..0
SUB_HISTOGRAMS = 4  # interleaved, so that equal neighbours do not serialise on one counter
MAX_CHUNKS = 64
MIN_CHUNK = 65536  # elements; a Python-level constant (tests lower it to get many chunks)


def chunk_count(n: int) -> int:
    """Top-k chunk count: a function of ``n`` only, so never of the thread count."""
    return max(1, min(MAX_CHUNKS, n // MIN_CHUNK))


@njit(cache=True)
def residual_of_sent(a, sent):
    """``acc - float32(value sent)``, with NaN bits as torch's CPU subtraction gives them:
    it computes ``acc + (-1) * sent`` by FMA, which returns the NaN of ``sent`` (quiet)
    when both are NaN, and a NaN is only ever sent for a NaN ``acc``."""
    return a - sent if sent == sent else sent - a


@njit(cache=True)
def histogram_chunk(grad, residual_in, residual_out, lo, hi, scratch, sub_hist, hist):
    """Pass 1 on ``[lo, hi)``: ``residual_out = acc``; ``hist`` = counts of the top 11 key bits.

    Per block, a vectorised loop writes ``acc`` and the bin numbers to ``scratch``; a
    scalar loop then counts them into four interleaved histograms.
    """
    target = residual_target(residual_in, residual_out)
    sub_hist[:] = 0
    h0, h1, h2, h3 = sub_hist[0], sub_hist[1], sub_hist[2], sub_hist[3]
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        base = np.uint64(start)
        for i in range(base, np.uint64(stop)):
            a = load_acc(grad, residual_in, i)
            if residual_out is not None:
                target[i] = a
            scratch[i - base] = np.uint16(key_of_f32(a) >> LEVEL1_SHIFT)
        m = stop - start
        quads = m - m % 4
        for j in range(0, quads, 4):
            h0[scratch[j]] += 1
            h1[scratch[j + 1]] += 1
            h2[scratch[j + 2]] += 1
            h3[scratch[j + 3]] += 1
        for j in range(quads, m):
            h0[scratch[j]] += 1
    for b in range(LEVEL1_BINS):
        hist[b] = h0[b] + h1[b] + h2[b] + h3[b]


@njit(cache=True)
def pick_bin(counts, rank):
    """The bin holding the ``rank``-th largest (1-based), and how many lie in higher bins."""
    above = 0
    for b in range(counts.size - 1, -1, -1):
        if above + counts[b] >= rank:
            return b, above
        above += counts[b]
    return -1, above  # unreachable while rank <= counts.sum()


@njit(cache=True)
def plan_candidates(hist, k):
    """From the per-chunk level-1 histograms: the boundary bin, how many keys lie above
    it, and each chunk's start in the candidate and boundary arrays (each segment ends
    with one slot of slack), and per chunk the count of keys above the boundary bin."""
    nchunks = hist.shape[0]
    total = np.zeros(LEVEL1_BINS, np.int64)
    for c in range(nchunks):
        for b in range(LEVEL1_BINS):
            total[b] += hist[c, b]
    boundary_bin, above_boundary = pick_bin(total, k)
    cand_start = np.zeros(nchunks + 1, np.int64)
    bound_start = np.zeros(nchunks + 1, np.int64)
    definite = np.zeros(nchunks, np.int64)  # keys in bins above the boundary bin, per chunk
    for c in range(nchunks):
        for b in range(boundary_bin + 1, LEVEL1_BINS):
            definite[c] += hist[c, b]
        # One slot of slack per chunk for the branchless appends of pass 2.
        cand_start[c + 1] = cand_start[c] + definite[c] + hist[c, boundary_bin] + 1
        bound_start[c + 1] = bound_start[c] + hist[c, boundary_bin] + 1
    return boundary_bin, above_boundary, cand_start, bound_start, definite


@njit(cache=True)
def append_candidate(
    i, a, flag, values, boundary_bin, cand_index, cand_bits, cand_cursor, boundary, bound_cursor, target, residual_out
):
    """Append element ``i`` (``acc = a``) at ``cand_cursor`` and its key at ``bound_cursor``
    when it is in the boundary bin; both cursors only advance when ``flag`` (it is a
    candidate) holds, so the call has no branch on the data. Returns the new cursors.
    ``residual_out`` only says whether to settle the residual (in ``target``)."""
    bits = bits_of_f32(a)
    key = key_of_bits(bits)
    taken = np.int64(flag)
    in_boundary_bin = taken & np.int64((key >> LEVEL1_SHIFT) == boundary_bin)
    cand_index[cand_cursor] = i
    cand_bits[cand_cursor] = bits
    boundary[bound_cursor] = key
    if residual_out is not None:
        # A key above the boundary bin is sent whatever the boundary holds; any other
        # keeps acc, which is what pass 1 wrote.
        target[i] = residual_of_sent(a, roundtrip(values, a)) if taken > in_boundary_bin else a
    return cand_cursor + taken, bound_cursor + in_boundary_bin


@njit(cache=True)
def collect_chunk(
    grad, residual_in, residual_out, values, boundary_bin, lo, hi, flags,
    cand_index, cand_bits, cand_cursor, boundary, bound_cursor,
):
    """Pass 2 on ``[lo, hi)``: append every key in the boundary bin or above (index and
    bits), in index order, starting at ``cand_cursor``, and the keys of the boundary bin to
    ``boundary`` starting at ``bound_cursor``; settle the residual of the keys above the
    boundary bin, which are selected whatever the boundary holds (their lines are in cache
    now, which spares the last pass most of its scattered writes).

    Per block, a vectorised loop flags the candidates in ``flags`` (uint8, a multiple of
    8 long), one byte each. Where candidates are sparse, a scalar loop visits only the set
    bytes, eight flags at a time; where they are dense (more than one in eight), every
    element goes through the branchless append. Appends write at the cursor whether or
    not they advance it, so each chunk's segments end with one slot of slack.
    """
    target = residual_target(residual_in, residual_out)
    floor = np.int32(boundary_bin << LEVEL1_SHIFT)
    flags_u64 = flags.view(np.uint64)
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        base = np.uint64(start)
        flagged = 0
        for i in range(base, np.uint64(stop)):
            if residual_out is not None:
                a = target[i]
            else:
                a = load_acc(grad, residual_in, i)
            flag = key_of_f32(a) >= floor
            flags[i - base] = flag
            flagged += flag
        count = stop - start
        if 8 * flagged > count:
            for i in range(base, np.uint64(stop)):
                a = target[i] if residual_out is not None else load_acc(grad, residual_in, i)
                cand_cursor, bound_cursor = append_candidate(
                    i, a, flags[i - base], values, boundary_bin, cand_index, cand_bits, cand_cursor,
                    boundary, bound_cursor, target, residual_out,
                )
            continue
        flags[count : (count + 7) // 8 * 8] = 0  # a partial last word
        for w in range(np.uint64((count + 7) // 8)):
            mask = flags_u64[w]
            while mask != 0:
                i = base + w * np.uint64(8) + (trailing_zeros(mask) >> np.uint64(3))
                mask &= mask - np.uint64(1)
                a = target[i] if residual_out is not None else load_acc(grad, residual_in, i)
                cand_cursor, bound_cursor = append_candidate(
                    i, a, True, values, boundary_bin, cand_index, cand_bits, cand_cursor,
                    boundary, bound_cursor, target, residual_out,
                )


@njit(cache=True)
def plan_selection(boundary, bound_start, definite, boundary_bin, rank):
    """The exact k-th key, the *threshold* (the ``rank``-th largest key of the boundary
    bin) and, per chunk, how many ties at the threshold it takes and where its output starts.

    Chunk ``c``'s boundary keys are ``boundary[bound_start[c] : bound_start[c + 1] - 1]``.
    """
    nchunks = definite.size
    hist2 = np.zeros(LEVEL2_BINS, np.int64)
    for c in range(nchunks):
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            hist2[(boundary[j] >> LEVEL2_SHIFT) & (LEVEL2_BINS - 1)] += 1
    b2, above2 = pick_bin(hist2, rank)
    prefix = (boundary_bin << (LEVEL1_SHIFT - LEVEL2_SHIFT)) | b2
    hist3 = np.zeros(LEVEL3_BINS, np.int64)
    for c in range(nchunks):
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            if (boundary[j] >> LEVEL2_SHIFT) == prefix:
                hist3[boundary[j] & (LEVEL3_BINS - 1)] += 1
    b3, above3 = pick_bin(hist3, rank - above2)
    threshold = (prefix << LEVEL2_SHIFT) | b3
    ties_left = rank - above2 - above3  # keys equal to the threshold still to take
    ties = np.zeros(nchunks, np.int64)
    out_start = np.zeros(nchunks + 1, np.int64)
    for c in range(nchunks):
        above = definite[c]
        equal = 0
        for j in range(bound_start[c], bound_start[c + 1] - 1):
            above += boundary[j] > threshold
            equal += boundary[j] == threshold
        # Chunks are in index order, so handing ties out chunk by chunk sends the lowest
        # indices first.
        ties[c] = min(equal, ties_left)
        ties_left -= ties[c]
        out_start[c + 1] = out_start[c] + above + ties[c]
    return threshold, ties, out_start


@njit(cache=True)
def write_chunk(
    cand_index, cand_bits, start, stop, boundary_bin, threshold, ties, values, indices, out_cursor, out_end,
    residual_in, residual_out,
):
    """Write the selected candidates ``[start, stop)`` of one chunk to
    ``values[out_cursor:out_end]`` / ``indices[out_cursor:out_end]``, and the residual of the
    selected boundary keys (pass 2 settled the others).

    Each candidate is written at the cursor, which only advances when it is selected, so
    the loop has no branch on the selection; it ends when the chunk's quota is written.
    """
    target = residual_target(residual_in, residual_out)
    taken = 0
    for j in range(start, stop):
        if out_cursor == out_end:
            break
        bits = cand_bits[j]
        key = key_of_bits(bits)
        tie = key == threshold
        selected = (key > threshold) | (tie & (taken < ties))
        taken += tie & selected
        a = f32_from_bits(bits)
        sent = store(values, out_cursor, a)
        index = cand_index[j]
        indices[out_cursor] = index
        if residual_out is not None:
            if selected & ((key >> LEVEL1_SHIFT) == boundary_bin):
                target[index] = residual_of_sent(a, sent)
        out_cursor += selected


@njit(cache=True)
def chunk_bounds(n, nchunks):
    step = (n + nchunks - 1) // nchunks
    bounds = np.empty(nchunks + 1, np.int64)
    for c in range(nchunks + 1):
        bounds[c] = min(c * step, n)
    return bounds


@njit(cache=True)
def take(workspace, size):
    """``workspace[:size]`` when it is large enough, else a fresh array."""
    if size <= workspace.size:
        return workspace[:size]
    return np.empty(size, workspace.dtype)


@njit(parallel=True, cache=True)
def compress_kernel(
    grad, residual_in, residual_out, values, indices, nchunks, work_hist, work_index, work_bits, work_bound
):
    """Top-k of ``acc = grad + residual_in`` into ``values``/``indices`` (``k = values.size``,
    ``1 <= k <= n``), residual into ``residual_out`` (an array, ``None``, or ``True``: in place).

    ``work_*`` are reusable scratch (see :class:`Workspace`). Returns the candidate and
    boundary counts, so the caller can size the workspace for the next call.
    """
    k = values.size
    bounds = chunk_bounds(grad.size, nchunks)
    hist = work_hist[:nchunks]
    for c in prange(nchunks):
        scratch = np.empty(BLOCK, np.uint16)
        sub_hist = np.empty((SUB_HISTOGRAMS, LEVEL1_BINS), np.int32)
        histogram_chunk(grad, residual_in, residual_out, bounds[c], bounds[c + 1], scratch, sub_hist, hist[c])

    boundary_bin, above_boundary, cand_start, bound_start, definite = plan_candidates(hist, k)
    cand_index = take(work_index, cand_start[nchunks])
    cand_bits = take(work_bits, cand_start[nchunks])
    boundary = take(work_bound, bound_start[nchunks])
    for c in prange(nchunks):
        flags = np.empty(BLOCK, np.uint8)
        collect_chunk(
            grad, residual_in, residual_out, values, boundary_bin, bounds[c], bounds[c + 1], flags,
            cand_index, cand_bits, cand_start[c], boundary, bound_start[c],
        )

    threshold, ties, out_start = plan_selection(boundary, bound_start, definite, boundary_bin, k - above_boundary)
    for c in prange(nchunks):
        write_chunk(
            cand_index, cand_bits, cand_start[c], cand_start[c + 1] - 1, boundary_bin, threshold, ties[c],
            values, indices, out_start[c], out_start[c + 1], residual_in, residual_out,
        )
    return cand_start[nchunks], bound_start[nchunks]


# Grow-only scratch, reused across calls: fresh buffers of a few MiB would be page-faulted
# in on every call, which costs several percent of a call. Not thread-safe by itself: every
# op runs under the lock of :mod:`gradcomp.backends.numba.concurrency`.
class Workspace:
    """Scratch for :func:`compress_kernel`: per-chunk histograms, and per index dtype the
    candidate indices, candidate bits and boundary keys, grown to what the last call needed
    (up to :data:`MAX_ENTRIES` entries; rarer, larger needs allocate per call)."""

    MAX_ENTRIES = 1 << 22

    def __init__(self):
        self.hist = np.empty((MAX_CHUNKS, LEVEL1_BINS), np.int64)
        self._candidates = {}

    def candidates(self, index_dtype):
        """``(work_index, work_bits, work_bound)`` for ``index_dtype``."""
        work = self._candidates.get(index_dtype)
        if work is None:
            work = (np.empty(0, index_dtype), np.empty(0, np.int32), np.empty(0, np.int32))
            self._candidates[index_dtype] = work
        return work

    def grow(self, index_dtype, candidates: int, boundary: int) -> None:
        """Make room for ``candidates`` candidates and ``boundary`` boundary keys."""
        work_index, work_bits, work_bound = self.candidates(index_dtype)
        candidates, boundary = min(candidates, self.MAX_ENTRIES), min(boundary, self.MAX_ENTRIES)
        if candidates > work_index.size:
            work_index = np.empty(candidates + candidates // 4, index_dtype)
            work_bits = np.empty(work_index.size, np.int32)
        if boundary > work_bound.size:
            work_bound = np.empty(boundary + boundary // 4, np.int32)
        self._candidates[index_dtype] = (work_index, work_bits, work_bound)
