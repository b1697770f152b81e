// Chunk-scaled 2-bit quantization (a level per 64 elements from the chunk's own statistics),
// fused with error feedback. The codes are those of twobit.cu (element i in codes[i / 16] at
// bits 2*(i % 16)); chunk c's level is scales[c]. For chunk c of L elements, with
// m_i = |acc_i| (0 where acc_i is not finite) and float32 sums by the halving tree
// s[j] += s[j + h], h = 32, 16, ..., 1:
//   tau   = (sum m_i / L) * 0.7f
//   keep  = m_i > tau
//   alpha = (sum of kept m_i) / count(keep), 0 when nothing is kept
//   01: keep, acc > 0 -> +alpha, residual acc - alpha
//   10: keep, acc < 0 -> -alpha, residual acc + alpha
//   00: otherwise     ->  0,     residual acc
//   11: acc non-finite -> NaN,   residual acc
// See gradcomp/backends/__init__.py.
#include "gradcomp_common.cuh"

namespace gradcomp {

#define GRADCOMP_CHUNK 64

// The halving-tree sum of the 64 values of this thread's chunk in `values` (every thread of
// the block calls it; the chunk's sum ends in values[first]).
__device__ __forceinline__ void chunk_tree_sum(float* values, int* counts, int tid, int lane) {
  for (int half = GRADCOMP_CHUNK / 2; half >= 1; half >>= 1) {
    if (lane < half) {
      values[tid] = values[tid] + values[tid + half];
      if (counts != 0) counts[tid] = counts[tid] + counts[tid + half];
    }
    __syncthreads();
  }
}

// A block of 64 * q threads handles q chunks at a time, one thread per element, so every
// global load and store is coalesced; the chunk's two sums meet in shared memory and thread
// w < 4q packs code word w of the q chunks. Exactly one thread writes each word and scale.
template <class T>
__device__ void twobit_chunk_compress(const typename T::storage* grad, const float* residual_in,
                                      float* residual_out, int* codes, float* scales, i64 n) {
  __shared__ float sums[GRADCOMP_MAX_THREADS];
  __shared__ int counts[GRADCOMP_MAX_THREADS];
  __shared__ unsigned char tile_codes[GRADCOMP_MAX_THREADS];
  const int tid = threadIdx.x;
  const int lane = tid % GRADCOMP_CHUNK;
  const int first = tid - lane;
  const i64 per_block = blockDim.x / GRADCOMP_CHUNK;
  const i64 chunks = (n + GRADCOMP_CHUNK - 1) / GRADCOMP_CHUNK;
  const i64 words = (n + 15) / 16;
  const i64 groups = (chunks + per_block - 1) / per_block;
  for (i64 group = blockIdx.x; group < groups; group += gridDim.x) {
    const i64 chunk = group * per_block + tid / GRADCOMP_CHUNK;
    const i64 i = chunk * GRADCOMP_CHUNK + lane;
    const bool valid = chunk < chunks && i < n;
    const float acc = valid ? compensate<T>(grad, residual_in, i) : 0.0f;
    const bool finite = is_finite(acc);
    const float magnitude = (valid && finite) ? bits_float(float_bits(acc) & 0x7FFFFFFFu) : 0.0f;
    sums[tid] = magnitude;
    __syncthreads();
    chunk_tree_sum(sums, 0, tid, lane);
    const i64 length = chunk < chunks ? min_i64(GRADCOMP_CHUNK, n - chunk * GRADCOMP_CHUNK) : 1;
    const float tau = (sums[first] / (float)length) * 0.7f;
    __syncthreads();  // every thread has read the sum before it is overwritten
    const bool keep = magnitude > tau;
    sums[tid] = keep ? magnitude : 0.0f;
    counts[tid] = keep ? 1 : 0;
    __syncthreads();
    chunk_tree_sum(sums, counts, tid, lane);
    const int count = counts[first];
    const float alpha = count > 0 ? sums[first] / (float)count : 0.0f;
    u32 code = 0;
    if (valid) {
      float residual = acc;
      if (!finite) {
        code = 3;
      } else if (keep) {
        code = acc > 0.0f ? 1u : 2u;
        residual = code == 1 ? acc - alpha : acc + alpha;
      }
      if (residual_out != 0) residual_out[i] = residual;
      if (lane == 0) scales[chunk] = alpha;
    }
    tile_codes[tid] = (unsigned char)code;
    __syncthreads();
    const i64 word = group * per_block * 4 + tid;
    if (tid < 4 * per_block && word < words) {
      u32 packed = 0;
      for (int j = 0; j < 16; ++j) packed |= (u32)tile_codes[16 * tid + j] << (2 * j);
      codes[word] = (int)packed;
    }
    __syncthreads();  // the next group overwrites the shared arrays
  }
}

}  // namespace gradcomp

using namespace gradcomp;

// Entry points, one per gradient dtype (float16 and bfloat16 arrive as raw 16-bit words).
// blockDim.x must be a multiple of 64; residual_in and residual_out may be null or alias.

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_chunk_compress_f32(const float* grad, const float* residual_in, float* residual_out, int* codes,
                                   float* scales, long long n) {
  twobit_chunk_compress<F32>(grad, residual_in, residual_out, codes, scales, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_chunk_compress_f16(const unsigned short* grad, const float* residual_in, float* residual_out,
                                   int* codes, float* scales, long long n) {
  twobit_chunk_compress<F16>(grad, residual_in, residual_out, codes, scales, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_chunk_compress_bf16(const unsigned short* grad, const float* residual_in, float* residual_out,
                                    int* codes, float* scales, long long n) {
  twobit_chunk_compress<BF16>(grad, residual_in, residual_out, codes, scales, n);
}

// out[i] = out[i] + decoded[i], one thread per element; code 00 adds +0.0f, as the reference.
extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_chunk_decompress_add(const int* codes, const float* scales, float* out, long long n) {
  const float nan = bits_float(0x7FC00000u);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const u32 code = ((u32)codes[i >> 4] >> (2 * (u32)(i & 15))) & 3u;
    const float alpha = scales[i >> 6];
    const float decoded = code == 0 ? 0.0f : code == 1 ? alpha : code == 2 ? -alpha : nan;
    out[i] = out[i] + decoded;
  }
}
