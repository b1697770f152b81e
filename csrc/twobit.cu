// 2-bit threshold quantization (MXNet semantics), fused with error feedback.
//
// Element i lives in codes[i / 16] at bits 2*(i % 16) and 2*(i % 16)+1:
//   01: acc >= t   -> +t, residual acc - t
//   10: acc <= -t  -> -t, residual acc + t
//   00: otherwise  ->  0, residual acc
//   11: acc non-finite -> NaN, residual acc
// Unused bits of the last word are zero. See gradcomp/backends/__init__.py.
#include "gradcomp_common.cuh"

namespace gradcomp {

// One tile is 16 * blockDim.x elements, i.e. blockDim.x code words. Each thread handles
// elements j * blockDim.x + tid (j < 16), so every global load and store is coalesced;
// the 2-bit codes meet in shared memory and thread tid packs word tid of the tile.
// No atomics are needed: exactly one thread writes each word.
template <class T>
__device__ void twobit_compress(const typename T::storage* grad, const float* residual_in, float* residual_out,
                                float threshold, int* codes, i64 n) {
  __shared__ unsigned char tile_codes[16 * GRADCOMP_MAX_THREADS];
  const int tid = threadIdx.x;
  const i64 threads = blockDim.x;
  const i64 tile_elements = 16 * threads;
  const i64 tiles = (n + tile_elements - 1) / tile_elements;
  const i64 words = (n + 15) / 16;
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const i64 base = tile * tile_elements;
    for (int j = 0; j < 16; ++j) {
      const int local = j * (int)threads + tid;
      const i64 i = base + local;
      u32 code = 0;
      if (i < n) {
        const float acc = compensate<T>(grad, residual_in, i);
        float residual = acc;
        if (!is_finite(acc)) {
          code = 3;
        } else if (acc >= threshold) {
          code = 1;
          residual = acc - threshold;
        } else if (acc <= -threshold) {
          code = 2;
          residual = acc + threshold;
        }
        if (residual_out != 0) residual_out[i] = residual;
      }
      tile_codes[local] = (unsigned char)code;
    }
    __syncthreads();
    const i64 word = tile * threads + tid;
    if (word < words) {
      u32 packed = 0;
      for (int j = 0; j < 16; ++j) packed |= (u32)tile_codes[16 * tid + j] << (2 * j);
      codes[word] = (int)packed;
    }
    __syncthreads();  // the next tile overwrites tile_codes
  }
}

}  // namespace gradcomp

using namespace gradcomp;

// Entry points, one per gradient dtype. float16 and bfloat16 arrive as raw 16-bit words.
// residual_in and residual_out may be null, and may be the same pointer (in-place update).

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_compress_f32(const float* grad, const float* residual_in, float* residual_out, float threshold,
                             int* codes, long long n) {
  twobit_compress<F32>(grad, residual_in, residual_out, threshold, codes, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_compress_f16(const unsigned short* grad, const float* residual_in, float* residual_out,
                             float threshold, int* codes, long long n) {
  twobit_compress<F16>(grad, residual_in, residual_out, threshold, codes, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_compress_bf16(const unsigned short* grad, const float* residual_in, float* residual_out,
                              float threshold, int* codes, long long n) {
  twobit_compress<BF16>(grad, residual_in, residual_out, threshold, codes, n);
}

// out[i] = out[i] + decoded[i], one thread per element (consecutive threads share a code
// word, so the word loads coalesce). Code 00 still adds +0.0f, exactly as the reference
// does, so -0.0 in `out` becomes +0.0 on every backend alike.
extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_twobit_decompress_add(const int* codes, float threshold, float* out, long long n) {
  const float nan = bits_float(0x7FC00000u);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const u32 code = ((u32)codes[i >> 4] >> (2 * (u32)(i & 15))) & 3u;
    const float decoded = code == 0 ? 0.0f : code == 1 ? threshold : code == 2 ? -threshold : nan;
    out[i] = out[i] + decoded;
  }
}
