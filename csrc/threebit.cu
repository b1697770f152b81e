// Chunk-scaled 3-bit quantization (seven levels, a scale per 128 elements from the chunk's own
// largest entry), fused with error feedback. Element i lives in codes[i / 10] at bits
// 3*(i % 10) .. 3*(i % 10) + 2 (bits 30-31 stay zero); chunk c's scale is scales[c]. For chunk
// c, with m_i = |acc_i| (0 where acc_i is not finite), in float32:
//   s      = (max m_i) / 3.0f
//   q_i    = min(max(rint(acc_i / s), -3), 3)     (0 when s == 0)
//   code_i = q_i + 3, or 7 when acc_i is not finite
//   decoded_i = (float)(code_i - 3) * s, NaN for code 7; residual acc_i - decoded_i (acc_i for 7)
// See gradcomp/backends/__init__.py.
#include "gradcomp_common.cuh"

namespace gradcomp {

#define GRADCOMP_THREEBIT_CHUNK 128
#define GRADCOMP_THREEBIT_TILE_CHUNKS 5  // 640 elements: whole chunks and whole 10-code words
#define GRADCOMP_THREEBIT_TILE (GRADCOMP_THREEBIT_CHUNK * GRADCOMP_THREEBIT_TILE_CHUNKS)

__device__ __forceinline__ u32 threebit_code(float acc, float s, float* residual) {
  if (!is_finite(acc)) {
    *residual = acc;
    return 7u;
  }
  const float q = s > 0.0f ? fminf(fmaxf(rintf(acc / s), -3.0f), 3.0f) : 0.0f;
  const int code = (int)q + 3;
  *residual = acc - (float)(code - 3) * s;
  return (u32)code;
}

// A block of 128 threads (one per element of a chunk) takes a tile of five chunks at a time:
// thread t handles element t of each chunk, so every global load and store is coalesced. The
// chunks' maxima meet in shared memory by a halving tree (a maximum is exact in any order), and
// thread w < 64 packs code word w of the tile. Exactly one thread writes each word and scale.
template <class T>
__device__ void threebit_compress(const typename T::storage* grad, const float* residual_in, float* residual_out,
                                  int* codes, float* scales, i64 n) {
  __shared__ float maxima[GRADCOMP_THREEBIT_TILE];
  __shared__ unsigned char tile_codes[GRADCOMP_THREEBIT_TILE];
  const int lane = threadIdx.x;
  const i64 tiles = (n + GRADCOMP_THREEBIT_TILE - 1) / GRADCOMP_THREEBIT_TILE;
  const i64 chunks = (n + GRADCOMP_THREEBIT_CHUNK - 1) / GRADCOMP_THREEBIT_CHUNK;
  const i64 words = (n + 9) / 10;
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float acc[GRADCOMP_THREEBIT_TILE_CHUNKS];
    for (int c = 0; c < GRADCOMP_THREEBIT_TILE_CHUNKS; ++c) {
      const i64 i = tile * GRADCOMP_THREEBIT_TILE + c * GRADCOMP_THREEBIT_CHUNK + lane;
      acc[c] = i < n ? compensate<T>(grad, residual_in, i) : 0.0f;
      const bool finite = is_finite(acc[c]);
      maxima[c * GRADCOMP_THREEBIT_CHUNK + lane] = finite ? bits_float(float_bits(acc[c]) & 0x7FFFFFFFu) : 0.0f;
    }
    __syncthreads();
    for (int half = GRADCOMP_THREEBIT_CHUNK / 2; half >= 1; half >>= 1) {
      if (lane < half) {
        for (int c = 0; c < GRADCOMP_THREEBIT_TILE_CHUNKS; ++c) {
          float* m = maxima + c * GRADCOMP_THREEBIT_CHUNK;
          m[lane] = fmaxf(m[lane], m[lane + half]);
        }
      }
      __syncthreads();
    }
    for (int c = 0; c < GRADCOMP_THREEBIT_TILE_CHUNKS; ++c) {
      const i64 chunk = tile * GRADCOMP_THREEBIT_TILE_CHUNKS + c;
      const i64 i = chunk * GRADCOMP_THREEBIT_CHUNK + lane;
      const float s = maxima[c * GRADCOMP_THREEBIT_CHUNK] / 3.0f;
      u32 code = 0;
      if (i < n) {
        float residual;
        code = threebit_code(acc[c], s, &residual);
        if (residual_out != 0) residual_out[i] = residual;
        if (lane == 0 && chunk < chunks) scales[chunk] = s;
      }
      tile_codes[c * GRADCOMP_THREEBIT_CHUNK + lane] = (unsigned char)code;
    }
    __syncthreads();
    const i64 word = tile * (GRADCOMP_THREEBIT_TILE / 10) + lane;
    if (lane < GRADCOMP_THREEBIT_TILE / 10 && word < words) {
      u32 packed = 0;
      for (int j = 0; j < 10; ++j) packed |= (u32)tile_codes[10 * lane + j] << (3 * j);
      codes[word] = (int)packed;
    }
    __syncthreads();  // the next tile overwrites the shared arrays
  }
}

}  // namespace gradcomp

using namespace gradcomp;

// Entry points, one per gradient dtype (float16 and bfloat16 arrive as raw 16-bit words).
// blockDim.x must be 128; residual_in and residual_out may be null or alias.

extern "C" __global__ void __launch_bounds__(GRADCOMP_THREEBIT_CHUNK)
gradcomp_threebit_compress_f32(const float* grad, const float* residual_in, float* residual_out, int* codes,
                               float* scales, long long n) {
  threebit_compress<F32>(grad, residual_in, residual_out, codes, scales, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_THREEBIT_CHUNK)
gradcomp_threebit_compress_f16(const unsigned short* grad, const float* residual_in, float* residual_out,
                               int* codes, float* scales, long long n) {
  threebit_compress<F16>(grad, residual_in, residual_out, codes, scales, n);
}

extern "C" __global__ void __launch_bounds__(GRADCOMP_THREEBIT_CHUNK)
gradcomp_threebit_compress_bf16(const unsigned short* grad, const float* residual_in, float* residual_out,
                                int* codes, float* scales, long long n) {
  threebit_compress<BF16>(grad, residual_in, residual_out, codes, scales, n);
}

// out[i] = out[i] + decoded[i], one thread per element; code 3 adds +0.0f * s, as the reference.
extern "C" __global__ void __launch_bounds__(GRADCOMP_MAX_THREADS)
gradcomp_threebit_decompress_add(const int* codes, const float* scales, float* out, long long n) {
  const float nan = bits_float(0x7FC00000u);
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const i64 word = i / 10;
    const u32 code = ((u32)codes[word] >> (3 * (u32)(i - 10 * word))) & 7u;
    const float s = scales[i / GRADCOMP_THREEBIT_CHUNK];
    const float decoded = code == 7u ? nan : (float)((int)code - 3) * s;
    out[i] = out[i] + decoded;
  }
}
