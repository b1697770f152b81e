// Shared definitions of the gradcomp CUDA kernels: integer types, float <-> bits,
// float16/bfloat16 conversions, and the block-level building blocks (reduction, scan)
// that the kernels use instead of warp intrinsics.
//
// The kernels are compiled three ways from the same text:
//   * by NVRTC through cupy.RawModule (gradcomp/backends/cuda_ops.py), which sees no
//     headers at all: this file includes none and relies only on compiler builtins;
//   * by nvcc in the tests, for sm_75/80/90, to prove they build for real targets;
//   * by g++ under tests/emulation/cuda_emulation.h (GRADCOMP_EMULATION defined), which
//     runs every CUDA thread as an OS thread so the tests execute the kernels on a CPU.
// To stay executable by that emulation the kernels use only __syncthreads, shared memory
// and atomics: no warp shuffles, ballots or votes, no cooperative groups, and no block
// ever waits on another block (blocks run one after another there).
#ifndef GRADCOMP_COMMON_CUH
#define GRADCOMP_COMMON_CUH

#ifndef GRADCOMP_MAX_THREADS
// Upper bound of blockDim.x for every kernel; it sizes the shared-memory arrays. Hosts
// launch 1-D blocks of at most this many threads.
#define GRADCOMP_MAX_THREADS 256
#endif

namespace gradcomp {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u32 float_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float bits_float(u32 x) { return __uint_as_float(x); }

__device__ __forceinline__ bool is_finite(float x) {
  return (float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

__device__ __forceinline__ i64 min_i64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// --- float16 / bfloat16 -------------------------------------------------------------
// Half-precision tensors are passed as raw 16-bit words and converted in software. The
// conversions are exact (round-to-nearest-even, like torch's casts), need no header (NVRTC
// ships none), and are the very code the CPU emulation executes; they cost a few integer
// operations per element in kernels that are bound by memory bandwidth.
// NaN encodings follow torch's scalar CPU conversion: float16 0x7E00 with the sign,
// bfloat16 0x7FC0. Anything that compares results treats every NaN as equal.

__device__ __forceinline__ float half_to_float(unsigned short h) {
  u32 sign = (u32)(h & 0x8000u) << 16;
  u32 exponent = (h >> 10) & 0x1Fu;
  u32 mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);  // +-0
  // Subnormal: value = mantissa * 2^-24; shift the leading one up to the implicit bit.
  u32 float_exponent = 113;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --float_exponent;
  }
  return bits_float(sign | (float_exponent << 23) | ((mantissa & 0x3FFu) << 13));
}

__device__ __forceinline__ unsigned short float_to_half(float x) {
  u32 bits = float_bits(x);
  u32 sign = (bits >> 16) & 0x8000u;
  u32 magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return (unsigned short)(sign | 0x7E00u);  // NaN
  if (magnitude >= 0x477FF000u) return (unsigned short)(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (magnitude >= 0x38800000u) {  // >= 2^-14: a normal half
    u32 rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return (unsigned short)(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (magnitude < 0x33000000u) return (unsigned short)sign;  // < 2^-25 rounds to 0
  // A half subnormal: count units of 2^-24, rounding the dropped bits to nearest even.
  u32 shift = 126u - (magnitude >> 23);  // 14..24
  u32 mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  u32 units = mantissa >> shift;
  u32 dropped = mantissa & ((1u << shift) - 1u);
  u32 halfway = 1u << (shift - 1u);
  if (dropped > halfway || (dropped == halfway && (units & 1u))) ++units;
  return (unsigned short)(sign | units);
}

__device__ __forceinline__ float bfloat16_to_float(unsigned short b) {
  return bits_float((u32)b << 16);
}

__device__ __forceinline__ unsigned short float_to_bfloat16(float x) {
  u32 bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)0x7FC0u;  // NaN
  return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// Element types: `storage` is what a tensor holds, load/store convert to and from fp32.
struct F32 {
  typedef float storage;
  __device__ __forceinline__ static float load(float x) { return x; }
  __device__ __forceinline__ static float store(float x) { return x; }
};
struct F16 {
  typedef unsigned short storage;
  __device__ __forceinline__ static float load(unsigned short x) { return half_to_float(x); }
  __device__ __forceinline__ static unsigned short store(float x) { return float_to_half(x); }
};
struct BF16 {
  typedef unsigned short storage;
  __device__ __forceinline__ static float load(unsigned short x) { return bfloat16_to_float(x); }
  __device__ __forceinline__ static unsigned short store(float x) { return float_to_bfloat16(x); }
};

// The compensated value of element i: acc = float32(grad[i]) + residual_in[i].
template <class T>
__device__ __forceinline__ float compensate(const typename T::storage* grad, const float* residual_in, i64 i) {
  float acc = T::load(grad[i]);
  if (residual_in != 0) acc = acc + residual_in[i];
  return acc;
}

// --- block-level building blocks (every thread of the block must call them) ---------

// Sums of `a` and `b` over the block, returned to every thread. `scratch` holds
// 2 * blockDim.x values. Works for any block size.
__device__ __forceinline__ void block_sum2(u64& a, u64& b, u64* scratch) {
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  scratch[tid] = a;
  scratch[threads + tid] = b;
  __syncthreads();
  for (int active = threads; active > 1;) {
    int half = (active + 1) / 2;
    if (tid < active - half) {
      scratch[tid] += scratch[tid + half];
      scratch[threads + tid] += scratch[threads + tid + half];
    }
    __syncthreads();
    active = half;
  }
  a = scratch[0];
  b = scratch[threads];
  __syncthreads();  // scratch may be reused as soon as this returns
}

// Inclusive prefix sum of `value` over the threads of the block (Hillis-Steele);
// `total` receives the sum over the block. `scratch` holds blockDim.x values.
__device__ __forceinline__ u32 block_inclusive_scan(u32 value, u32& total, u32* scratch) {
  const int tid = threadIdx.x;
  scratch[tid] = value;
  __syncthreads();
  for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {
    u32 left = tid >= offset ? scratch[tid - offset] : 0u;
    __syncthreads();
    scratch[tid] += left;
    __syncthreads();
  }
  u32 inclusive = scratch[tid];
  total = scratch[blockDim.x - 1];
  __syncthreads();
  return inclusive;
}

}  // namespace gradcomp

#endif  // GRADCOMP_COMMON_CUH
