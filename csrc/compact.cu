// Compact top-k entries over every part of a group: the encode and the check
// (gradcomp/backends/cuda_compact.py; the torch forms are CompactParts.encode/.entries in
// gradcomp/backends/sparse_parts.py, the Numba ones gradcomp/backends/numba/compact.py).
//
// A group's payload holds, per compressed part (a parameter), its entries' bfloat16 values, the
// low 16 bits of each index (its place inside a 65536-element chunk) and one int32 count per
// chunk. The plan's columns (int64) say where each part's slots lie in the payload; `ends` holds
// the inclusive prefix sums of the parts' entry counts `k`, so entry `e` belongs to the first part
// whose end passes it. Every kernel is a grid-stride loop with one thread per entry, chunk or part,
// and writes what the torch forms write, bit for bit.
//
// The check trusts the plan, never the payload: a count read from the payload only steers a search
// inside the part's own chunks, and every read and write lies in slots the plan gives, whatever the
// counts or indices say. What the check rejects it flags in `bad`; the host reads the flag once.
#include "gradcomp_common.cuh"

#define GRADCOMP_COMPACT_CHUNK 65536

namespace gradcomp {

// The part of entry `e` (0 <= e < ends[parts - 1]): the first p with ends[p] > e.
__device__ __forceinline__ i64 compact_part_of(const i64* ends, i64 parts, i64 e) {
  i64 lo = 0, hi = parts - 1;
  while (lo < hi) {
    i64 mid = lo + (hi - lo) / 2;
    if (ends[mid] > e) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// How many of the ascending `a[0..n)` are below `value`.
__device__ __forceinline__ i64 compact_below(const int* a, i64 n, i64 value) {
  i64 lo = 0, hi = n;
  while (lo < hi) {
    i64 mid = lo + (hi - lo) / 2;
    if ((i64)a[mid] < value) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The chunks of part p: [first_chunk[p], the next part's first chunk or `chunks`).
__device__ __forceinline__ i64 compact_chunks_end(const i64* first_chunk, i64 parts, i64 chunks, i64 p) {
  return p + 1 < parts ? first_chunk[p + 1] : chunks;
}

}  // namespace gradcomp

using namespace gradcomp;

// Entry e (float32 `values[e]`, its part's own position `indices[e]`): its bfloat16 value (round to
// nearest even) at value_slot[p] + j and its low 16 bits at local_slot[p] + j (16-bit words of the
// payload), j its place among the part's entries; `residual` (may be null) gains what bfloat16 rounds
// off, at the entry's group position (distinct positions: no two threads write one element).
extern "C" __global__ void gradcomp_compact_encode(const float* values, const int* indices, unsigned short* halves,
                                                   float* residual, const i64* ends, const i64* k,
                                                   const i64* value_slot, const i64* local_slot, const i64* offsets,
                                                   i64 parts, i64 total) {
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    const i64 p = compact_part_of(ends, parts, e);
    const i64 j = e - (ends[p] - k[p]);
    const i64 index = indices[e];
    const float value = values[e];
    const unsigned short bits = float_to_bfloat16(value);
    halves[value_slot[p] + j] = bits;
    halves[local_slot[p] + j] = (unsigned short)(index & (GRADCOMP_COMPACT_CHUNK - 1));
    if (residual != 0) {
      const i64 position = offsets[p] + index;
      residual[position] = residual[position] + (value - bfloat16_to_float(bits));
    }
  }
}

// Chunk c's count (int32 word count_words[c]): its part's entries whose own position falls in the chunk,
// found by two binary searches in the part's ascending indices.
extern "C" __global__ void gradcomp_compact_counts(const int* indices, int* words, const i64* ends, const i64* k,
                                                   const i64* first_chunk, const i64* count_words,
                                                   const i64* chunk_part, i64 chunks) {
  for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (i64)gridDim.x * blockDim.x) {
    const i64 p = chunk_part[c];
    const int* own = indices + (ends[p] - k[p]);
    const i64 first = (c - first_chunk[p]) * GRADCOMP_COMPACT_CHUNK;
    const i64 count = compact_below(own, k[p], first + GRADCOMP_COMPACT_CHUNK) - compact_below(own, k[p], first);
    words[count_words[c]] = (int)count;
  }
}

// Per part: its chunks' counts read from the payload, each >= 0 and together its k (else `bad`), and each
// chunk's first entry among the part's (`starts`, int64 [chunks]; a negative count counts as 0 there).
extern "C" __global__ void gradcomp_compact_chunk_starts(const int* words, const i64* k, const i64* first_chunk,
                                                         const i64* count_words, i64* starts, int* bad, i64 parts,
                                                         i64 chunks) {
  for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < parts; p += (i64)gridDim.x * blockDim.x) {
    const i64 end = compact_chunks_end(first_chunk, parts, chunks, p);
    i64 sum = 0;
    for (i64 c = first_chunk[p]; c < end; ++c) {
      const int count = words[count_words[c]];
      starts[c] = sum;
      if (count < 0) atomicOr(bad, 1);
      else sum += count;
    }
    if (sum != k[p]) atomicOr(bad, 1);
  }
}

// Entry e: its chunk (the part's last chunk starting at or before it), its group position (the chunk's
// first element plus the unsigned 16-bit index, `bad` unless inside the chunk) and its bfloat16 value.
extern "C" __global__ void gradcomp_compact_entries(const unsigned short* halves, const i64* ends, const i64* k,
                                                    const i64* value_slot, const i64* local_slot,
                                                    const i64* first_chunk, const i64* chunk_base,
                                                    const i64* chunk_limit, const i64* starts, i64* positions,
                                                    unsigned short* out_values, int* bad, i64 parts, i64 chunks,
                                                    i64 total) {
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    const i64 p = compact_part_of(ends, parts, e);
    const i64 j = e - (ends[p] - k[p]);
    i64 lo = first_chunk[p], hi = compact_chunks_end(first_chunk, parts, chunks, p) - 1;
    while (lo < hi) {  // the last c in [lo, hi] with starts[c] <= j (starts[first] is 0)
      const i64 mid = lo + (hi - lo + 1) / 2;
      if (starts[mid] <= j) lo = mid;
      else hi = mid - 1;
    }
    const i64 local = halves[local_slot[p] + j];
    if (local >= chunk_limit[lo]) atomicOr(bad, 1);
    positions[e] = chunk_base[lo] + local;
    out_values[e] = halves[value_slot[p] + j];
  }
}

// `bad` unless the group positions strictly increase.
extern "C" __global__ void gradcomp_compact_increasing(const i64* positions, int* bad, i64 total) {
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x + 1; e < total; e += (i64)gridDim.x * blockDim.x) {
    if (positions[e] <= positions[e - 1]) atomicOr(bad, 1);
  }
}
