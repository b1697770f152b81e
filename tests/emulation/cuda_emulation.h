// A CPU emulation of the CUDA execution model, enough to run gradcomp's kernels with g++.
//
// Model: a launch of grid x block runs `block` OS threads (std::thread), one per CUDA
// thread; together they run block 0, then block 1, ... (blocks never overlap in time,
// which is why `__shared__` can simply mean `static`: one copy, reused block after block).
// `__syncthreads()` is a std::barrier over the block's threads; atomics are GCC __atomic
// builtins on the real memory, so they are truly concurrent. Every barrier phase also
// checks that all threads arrived at the same __syncthreads call site (or all at the end
// of the block): a divergent __syncthreads, undefined behaviour on a GPU, is reported as
// a launch error instead of passing by luck.
//
// Not emulated (the kernels must not use them): warp intrinsics (__shfl*, __ballot*,
// __any/__all, __activemask), cooperative groups, dynamic shared memory, inter-block
// waiting, textures, and device float arithmetic quirks (the kernels only add, subtract,
// multiply, divide, round to an integer and compare floats, which IEEE-754 makes bit-identical
// on both sides once the GPU build keeps denormals and exact division: cuda_source.NVRTC_OPTIONS).
#ifndef GRADCOMP_CUDA_EMULATION_H
#define GRADCOMP_CUDA_EMULATION_H

#define GRADCOMP_EMULATION 1

#include <cstring>
// CUDA's exact device math (rintf, fminf, fmaxf): the C library's are exact too (IEEE-754).
#include <math.h>

#ifndef __global__
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned int x, y, z;
};
struct uint3 {
  unsigned int x, y, z;
};

// Per CUDA thread (= per OS thread): its index and the block it is running.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
// Per launch: the same for every thread.
extern dim3 blockDim;
extern dim3 gridDim;

namespace gradcomp_emulation {
void syncthreads(const char* file, int line, int site);
}
// __COUNTER__ tells apart call sites that share a line.
#define __syncthreads() ::gradcomp_emulation::syncthreads(__FILE__, __LINE__, __COUNTER__)
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)

// Warp intrinsics are deliberately not defined: a kernel that uses one fails to build here.

inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned int)i); }

#define GRADCOMP_EMULATED_ATOMICS(T)                                                                            \
  inline T atomicAdd(T* address, T value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); } \
  inline T atomicSub(T* address, T value) { return __atomic_fetch_sub(address, value, __ATOMIC_SEQ_CST); } \
  inline T atomicOr(T* address, T value) { return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST); }   \
  inline T atomicAnd(T* address, T value) { return __atomic_fetch_and(address, value, __ATOMIC_SEQ_CST); } \
  inline T atomicXor(T* address, T value) { return __atomic_fetch_xor(address, value, __ATOMIC_SEQ_CST); } \
  inline T atomicExch(T* address, T value) { return __atomic_exchange_n(address, value, __ATOMIC_SEQ_CST); } \
  inline T atomicCAS(T* address, T expected, T desired) {                                                  \
    __atomic_compare_exchange_n(address, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);   \
    return expected;                                                                                       \
  }                                                                                                        \
  inline T atomicMax(T* address, T value) {                                                                \
    T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);                                                    \
    while (old < value &&                                                                                  \
           !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
    }                                                                                                      \
    return old;                                                                                            \
  }                                                                                                        \
  inline T atomicMin(T* address, T value) {                                                                \
    T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);                                                    \
    while (value < old &&                                                                                  \
           !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
    }                                                                                                      \
    return old;                                                                                            \
  }

GRADCOMP_EMULATED_ATOMICS(int)
GRADCOMP_EMULATED_ATOMICS(unsigned int)
GRADCOMP_EMULATED_ATOMICS(unsigned long long)
GRADCOMP_EMULATED_ATOMICS(long long)
#undef GRADCOMP_EMULATED_ATOMICS

#endif  // GRADCOMP_CUDA_EMULATION_H
