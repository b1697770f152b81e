// Exact top-k by magnitude, fused with error feedback: radix select + ordered compaction.
//
// The key of element i is the bit pattern of |acc_i| read as an unsigned integer (31
// bits), so NaN > inf > every finite value; every NaN has the same key, 0x7FFFFFFF. The k
// selected entries are those of largest key, ties going to the lower index; they are
// written in ascending index order with values[j] = acc[indices[j]] cast to the gradient
// dtype. See gradcomp/backends/__init__.py.
//
// Launch sequence (gradcomp/backends/cuda_ops.py plans it; all on one stream, no host sync):
//   1. scratch zeroed (histograms, select state)
//   2. for pass p in 0, 1, 2 (key bits [20,31), [10,20), [0,10)):
//        topk_histogram  -- histogram of the pass's digit over elements whose higher
//                           digits equal the prefix selected so far
//        topk_select     -- one block: the digit where the running count from the top
//                           reaches k; extends the prefix, updates how many are still needed
//      After pass 2 the prefix is the exact threshold key T, and `need` >= 1 is the number
//      of elements with key == T to take (the lowest-indexed ones).
//   3. topk_count       -- per block of a contiguous chunk: #(key > T) and #(key == T)
//   4. topk_write       -- per block: its offset from the counts of the blocks before it,
//                          then an in-order walk of its chunk with a block scan per tile;
//                          writes values, indices and every residual
// Every pass recomputes acc = grad + residual_in rather than staging the keys in an
// n-sized scratch buffer: for float32 that is 40 bytes read per element instead of 32
// (float16/bfloat16: 30 instead of 28), and it needs no bucket-sized scratch allocation.
#include "gradcomp_common.cuh"

namespace gradcomp {

#define GRADCOMP_TOPK_MAX_BINS 2048  // 11-bit digits at most

// Every NaN gets the same, largest key: NaN payloads are not portable (GPU arithmetic
// returns one canonical NaN, x86 propagates the operand's payload, and torch's own float16
// widening differs between its vector and scalar paths), so ranking NaNs by payload would
// make the selection depend on where the NaN was computed. NaNs tie, and ties go by index.
__device__ __forceinline__ u32 magnitude_key(float acc) {
  const u32 magnitude = float_bits(acc) & 0x7FFFFFFFu;
  return magnitude > 0x7F800000u ? 0x7FFFFFFFu : magnitude;
}

// select state, in the u64 scratch: [0] the key prefix found so far (the threshold T once
// the last pass is done), [1] how many elements with that prefix are still to be taken.
enum { STATE_PREFIX = 0, STATE_NEED = 1 };

template <class T>
__device__ void topk_histogram(const typename T::storage* grad, const float* residual_in, i64 n, u64* histogram,
                               const u64* state, int shift, int bits, int pass) {
  __shared__ u32 counts[GRADCOMP_TOPK_MAX_BINS];
  const int bins = 1 << bits;
  for (int b = threadIdx.x; b < bins; b += blockDim.x) counts[b] = 0;
  __syncthreads();
  const u32 prefix = pass == 0 ? 0u : (u32)state[STATE_PREFIX];
  const int fixed_shift = shift + bits;  // key bits at and above this are already decided
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const u32 key = magnitude_key(compensate<T>(grad, residual_in, i));
    if ((key >> fixed_shift) == (prefix >> fixed_shift)) atomicAdd(&counts[(key >> shift) & (u32)(bins - 1)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    if (counts[b] != 0) atomicAdd(&histogram[b], (u64)counts[b]);
  }
}

// Walks from the top digit down: the digit where the count of elements at or above it
// first reaches `need` is the next digit of the threshold. Each thread sums a contiguous
// run of bins; thread 0 finds the run, its owner finds the bin. Launched as one block.
__device__ void topk_select(const u64* histogram, int bins, int shift, u64* state, long long k, int pass) {
  __shared__ u64 run_sums[GRADCOMP_MAX_THREADS];
  __shared__ int owner;
  __shared__ u64 above_owner;
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  const int run = (bins + threads - 1) / threads;
  const int lo = tid * run < bins ? tid * run : bins;
  const int hi = lo + run < bins ? lo + run : bins;
  u64 sum = 0;
  for (int b = lo; b < hi; ++b) sum += histogram[b];
  run_sums[tid] = sum;
  const u64 need = pass == 0 ? (u64)k : state[STATE_NEED];
  const u32 prefix = pass == 0 ? 0u : (u32)state[STATE_PREFIX];
  __syncthreads();
  if (tid == 0) {
    u64 above = 0;
    int found = 0;  // the histogram always holds >= need elements; run 0 is the fallback
    for (int t = threads - 1; t >= 0; --t) {
      if (above + run_sums[t] >= need) {
        found = t;
        break;
      }
      above += run_sums[t];
    }
    owner = found;
    above_owner = above;
  }
  __syncthreads();
  if (tid == owner) {
    u64 above = above_owner;
    for (int b = hi - 1; b >= lo; --b) {
      if (above + histogram[b] >= need || b == lo) {
        state[STATE_PREFIX] = prefix | ((u64)b << shift);
        state[STATE_NEED] = need - above;
        break;
      }
      above += histogram[b];
    }
  }
}

// Block b of the grid owns elements [b * chunk, (b + 1) * chunk), chunk = ceil(n / grid);
// topk_count and topk_write must be launched with the same grid.
__device__ __forceinline__ void block_chunk(i64 n, i64& lo, i64& hi) {
  const i64 chunk = (n + gridDim.x - 1) / gridDim.x;
  lo = min_i64((i64)blockIdx.x * chunk, n);
  hi = min_i64(lo + chunk, n);
}

template <class T>
__device__ void topk_count(const typename T::storage* grad, const float* residual_in, i64 n, const u64* state,
                           u64* block_above, u64* block_ties) {
  __shared__ u64 scratch[2 * GRADCOMP_MAX_THREADS];
  const u32 threshold = (u32)state[STATE_PREFIX];
  i64 lo, hi;
  block_chunk(n, lo, hi);
  u64 above = 0, ties = 0;
  for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const u32 key = magnitude_key(compensate<T>(grad, residual_in, i));
    above += key > threshold;
    ties += key == threshold;
  }
  block_sum2(above, ties, scratch);
  if (threadIdx.x == 0) {
    block_above[blockIdx.x] = above;
    block_ties[blockIdx.x] = ties;
  }
}

// Element i is selected iff key > T, or key == T and fewer than `need` ties precede it.
// Its output slot is #(key > T before i) + min(#(key == T before i), need). The block walks
// its chunk in order, in tiles of TOPK_ITEMS * blockDim.x elements, and counts both with
// one block scan per tile (above in the low 16 bits, ties in the high 16: a tile holds at
// most 8 * 1024 elements). Global memory is read and written striped (element j * threads
// + tid of the tile), so every access coalesces; the flags are transposed through shared
// memory so that each thread scans TOPK_ITEMS consecutive elements serially and the block
// scan runs once per TOPK_ITEMS * threads elements rather than once per `threads`.
#define TOPK_ITEMS 8
#define TOPK_PADDED(x) ((x) + ((x) >> 5))  // one pad word per 32: no bank conflicts either way

__device__ __forceinline__ u32 topk_flags(u32 key, u32 threshold) {
  return key > threshold ? 1u : key == threshold ? 0x10000u : 0u;
}

template <class T, class Index>
__device__ void topk_write(const typename T::storage* grad, const float* residual_in, float* residual_out, i64 n,
                           const u64* state, const u64* block_above, const u64* block_ties,
                           typename T::storage* values, Index* indices) {
  __shared__ u64 sums[2 * GRADCOMP_MAX_THREADS];
  __shared__ u32 scan[GRADCOMP_MAX_THREADS];
  __shared__ u32 tile_flags[TOPK_PADDED(TOPK_ITEMS * GRADCOMP_MAX_THREADS)];
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  const u32 threshold = (u32)state[STATE_PREFIX];
  const u64 need = state[STATE_NEED];
  i64 lo, hi;
  block_chunk(n, lo, hi);

  // Counts of the blocks before this one (O(grid) per block, fine for grids of ~1000).
  u64 above = 0, ties = 0;
  for (int b = tid; b < (int)blockIdx.x; b += threads) {
    above += block_above[b];
    ties += block_ties[b];
  }
  block_sum2(above, ties, sums);

  const i64 tile = (i64)TOPK_ITEMS * threads;
  for (i64 base = lo; base < hi; base += tile) {  // same trip count for every thread
    float acc[TOPK_ITEMS];
    for (int j = 0; j < TOPK_ITEMS; ++j) {  // striped: coalesced loads
      const int local = j * threads + tid;
      const i64 i = base + local;
      u32 flags = 0;
      acc[j] = 0.0f;
      if (i < hi) {
        acc[j] = compensate<T>(grad, residual_in, i);
        flags = topk_flags(magnitude_key(acc[j]), threshold);
      }
      tile_flags[TOPK_PADDED(local)] = flags;
    }
    __syncthreads();
    // Blocked: thread tid owns tile elements [tid * TOPK_ITEMS, (tid + 1) * TOPK_ITEMS).
    u32 owned = 0;
    for (int j = 0; j < TOPK_ITEMS; ++j) owned += tile_flags[TOPK_PADDED(tid * TOPK_ITEMS + j)];
    u32 total;
    u32 before = block_inclusive_scan(owned, total, scan) - owned;
    for (int j = 0; j < TOPK_ITEMS; ++j) {  // each flag becomes the count before its element
      const int at = TOPK_PADDED(tid * TOPK_ITEMS + j);
      const u32 flags = tile_flags[at];
      tile_flags[at] = before;
      before += flags;
    }
    __syncthreads();
    for (int j = 0; j < TOPK_ITEMS; ++j) {  // striped again: coalesced stores
      const int local = j * threads + tid;
      const i64 i = base + local;
      if (i < hi) {
        const u32 flags = topk_flags(magnitude_key(acc[j]), threshold);
        const u32 counted = tile_flags[TOPK_PADDED(local)];
        const u64 above_before = above + (counted & 0xFFFFu);
        const u64 ties_before = ties + (counted >> 16);
        float residual = acc[j];
        if (flags == 1u || (flags == 0x10000u && ties_before < need)) {
          const u64 slot = above_before + min_u64(ties_before, need);
          const typename T::storage value = T::store(acc[j]);
          values[slot] = value;
          indices[slot] = (Index)i;
          residual = acc[j] - T::load(value);
        }
        if (residual_out != 0) residual_out[i] = residual;
      }
    }
    above += total & 0xFFFFu;
    ties += total >> 16;
    __syncthreads();  // the next tile overwrites tile_flags
  }
}

// Decoding is two launches, so that a payload a peer got wrong (or forged) writes nothing:
//   topk_check_indices  -- counts into `bad` the positions whose index lies outside [0, n)
//                          or does not exceed the index before it;
//   topk_decompress_add -- returns at once unless `bad` is 0; then every index is in
//                          [0, n) and unique, so no two threads touch the same element.
// The decoder also skips any index outside [0, n) by itself, so it never writes outside
// `out` whatever it is given. The host reads `bad` afterwards and raises if it is not 0.
template <class Index>
__device__ void topk_check_indices(const Index* indices, i64 k, i64 n, u64* bad) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  u64 count = 0;
  for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k; j += stride) {
    const i64 i = (i64)indices[j];
    const bool in_range = i >= 0 && i < n;
    const bool increasing = j == 0 || i > (i64)indices[j - 1];
    count += (in_range && increasing) ? 0u : 1u;
  }
  if (count != 0) atomicAdd(bad, count);
}

template <class T, class Index>
__device__ void topk_decompress_add(const typename T::storage* values, const Index* indices, float* out, i64 k,
                                    i64 n, const u64* bad) {
  if (*bad != 0) return;  // a rejected payload writes nothing (every thread reads the same count)
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k; j += stride) {
    const i64 i = (i64)indices[j];
    if (i < 0 || i >= n) continue;  // unreachable after a clean check; a bound whatever happens
    out[i] = out[i] + T::load(values[j]);
  }
}

}  // namespace gradcomp

using namespace gradcomp;

// Entry points. Suffixes: gradient dtype (f32, f16, bf16; half types as raw 16-bit words),
// then index dtype (i32, i64). `scratch` pointers are u64 arrays from the host's plan.

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_topk_select(const unsigned long long* histogram, int bins, int shift, unsigned long long* state,
                     long long k, int pass) {
  topk_select(histogram, bins, shift, state, k, pass);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_topk_check_indices_i32(const int* indices, long long k, long long n, unsigned long long* bad) {
  topk_check_indices<int>(indices, k, n, bad);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_topk_check_indices_i64(const long long* indices, long long k, long long n, unsigned long long* bad) {
  topk_check_indices<long long>(indices, k, n, bad);
}

#define GRADCOMP_TOPK_DTYPE_KERNELS(SUFFIX, TYPE)                                                                    \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_histogram_##SUFFIX(              \
      const TYPE::storage* grad, const float* residual_in, long long n, unsigned long long* histogram,              \
      const unsigned long long* state, int shift, int bits, int pass) {                                            \
    topk_histogram<TYPE>(grad, residual_in, n, histogram, state, shift, bits, pass);                               \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_count_##SUFFIX(                  \
      const TYPE::storage* grad, const float* residual_in, long long n, const unsigned long long* state,            \
      unsigned long long* block_above, unsigned long long* block_ties) {                                           \
    topk_count<TYPE>(grad, residual_in, n, state, block_above, block_ties);                                        \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_write_##SUFFIX##_i32(            \
      const TYPE::storage* grad, const float* residual_in, float* residual_out, long long n,                       \
      const unsigned long long* state, const unsigned long long* block_above, const unsigned long long* block_ties, \
      TYPE::storage* values, int* indices) {                                                                       \
    topk_write<TYPE, int>(grad, residual_in, residual_out, n, state, block_above, block_ties, values, indices);    \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_write_##SUFFIX##_i64(            \
      const TYPE::storage* grad, const float* residual_in, float* residual_out, long long n,                       \
      const unsigned long long* state, const unsigned long long* block_above, const unsigned long long* block_ties, \
      TYPE::storage* values, long long* indices) {                                                                 \
    topk_write<TYPE, long long>(grad, residual_in, residual_out, n, state, block_above, block_ties, values,        \
                                indices);                                                                          \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_decompress_add_##SUFFIX##_i32(   \
      const TYPE::storage* values, const int* indices, float* out, long long k, long long n,                       \
      const unsigned long long* bad) {                                                                             \
    topk_decompress_add<TYPE, int>(values, indices, out, k, n, bad);                                               \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS) gradcomp_topk_decompress_add_##SUFFIX##_i64(   \
      const TYPE::storage* values, const long long* indices, float* out, long long k, long long n,                 \
      const unsigned long long* bad) {                                                                             \
    topk_decompress_add<TYPE, long long>(values, indices, out, k, n, bad);                                         \
  }

GRADCOMP_TOPK_DTYPE_KERNELS(f32, F32)
GRADCOMP_TOPK_DTYPE_KERNELS(f16, F16)
GRADCOMP_TOPK_DTYPE_KERNELS(bf16, BF16)
