// Vectorized global-memory access shared by the ringctx kernels (device code only).
//
// A vector of B bytes is moved as one native CUDA type (uint4 = 16 B, uint2 = 8 B, ...) so
// nvcc emits a single ld/st.global.vN; element conversion happens in registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace ringctx {
namespace detail {

template <int B> struct VecType;
template <> struct VecType<16> { using type = uint4; };
template <> struct VecType<8> { using type = uint2; };
template <> struct VecType<4> { using type = unsigned int; };
template <> struct VecType<2> { using type = unsigned short; };
template <> struct VecType<1> { using type = unsigned char; };

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Load B bytes at p (B-aligned) as E = B / sizeof(T) floats.
template <typename T, int B>
__device__ __forceinline__ void load_f32(const T* p, float (&f)[B / sizeof(T)]) {
  using V = typename VecType<B>::type;
  // Read-only for the kernel's lifetime: the non-coherent path (__ldg) is safe and cheaper.
  const V v = __ldg(reinterpret_cast<const V*>(p));
  T e[B / sizeof(T)];
  memcpy(e, &v, B);  // register reinterpretation; no memory traffic
#pragma unroll
  for (int k = 0; k < static_cast<int>(B / sizeof(T)); ++k) f[k] = to_f32<T>(e[k]);
}

// Store E floats at p (B-aligned) as B bytes of T (round to nearest even).
template <typename T, int B>
__device__ __forceinline__ void store_f32(T* p, const float (&f)[B / sizeof(T)]) {
  using V = typename VecType<B>::type;
  T e[B / sizeof(T)];
#pragma unroll
  for (int k = 0; k < static_cast<int>(B / sizeof(T)); ++k) e[k] = from_f32<T>(f[k]);
  V v;
  memcpy(&v, e, B);
  *reinterpret_cast<V*>(p) = v;
}

}  // namespace detail
}  // namespace ringctx
