// One-pass merge of N partial attention results (out_i, lse_i) over disjoint key sets.
//
// PyTorch needs several passes for this (stack, max, exp, weighted sum, log); here every
// output vector is produced by one thread that reads the N lse values of its row and the N
// input vectors once, so the kernel moves the minimum bytes: N reads + 1 write of out, plus
// the lse rows. See ringctx_kernels.h for the exact semantics.
#include <cmath>

#include "ringctx_kernels.h"
#include "vec_io.cuh"

namespace ringctx {
namespace {

constexpr int kThreads = 256;

// Grid: x covers the T * D / E vectors of one head, y is the head. Threads that are
// neighbours in x walk along D and then along T for a fixed head h, so the lse reads
// (lse_i[h, t], contiguous in t) coalesce as well as the out rows do.
//
// __grid_constant__ lets the kernel index the pointer tables in the parameters with a
// runtime i straight from parameter memory; without it nvcc copies the whole 1 KiB struct
// into every thread's local memory.
//
// __launch_bounds__(256, 4): at least 4 blocks (1024 threads) per SM, i.e. up to 64 registers.
// Left to itself ptxas aimed at 32 registers for the float/16-byte case and spilled; the
// unrolled loop wants the registers to keep four 16-byte loads in flight per thread.
template <typename T, int B>
__global__ void __launch_bounds__(kThreads, 4) merge_partials_kernel(const __grid_constant__ MergeParams p) {
  constexpr int E = B / sizeof(T);
  const int64_t vecs_per_row = p.D / E;
  const int64_t h = blockIdx.y;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (v >= p.T * vecs_per_row) return;
  const int64_t t = v / vecs_per_row;
  const int64_t c = v - t * vecs_per_row;
  const int64_t lse_idx = h * p.T + t;
  const int64_t elem = (t * p.H + h) * p.D + c * E;

  // Pass 1 over the N lse values: the running max over the partials that saw a key.
  float m = -INFINITY;
  for (int i = 0; i < p.n; ++i) {
    const float l = __ldg(p.lses[i] + lse_idx);
    if (isfinite(l)) m = fmaxf(m, l);
  }

  float acc[E];
#pragma unroll
  for (int k = 0; k < E; ++k) acc[k] = 0.f;

  if (m == -INFINITY) {  // the row saw no key in any partial: out = 0, lse = -inf
    detail::store_f32<T, B>(static_cast<T*>(p.out) + elem, acc);
    if (c == 0) p.lse[lse_idx] = -INFINITY;
    return;
  }

  // Pass 2: weighted sum. The loads do not depend on the weights, so the unrolled loop
  // issues several 16-byte loads before the first FMA (memory-level parallelism). An
  // empty partial's values are loaded but selected away, never multiplied: 0 * NaN = NaN.
  float s = 0.f;
#pragma unroll 4
  for (int i = 0; i < p.n; ++i) {
    const float l = __ldg(p.lses[i] + lse_idx);
    const float w = isfinite(l) ? expf(l - m) : 0.f;
    float x[E];
    detail::load_f32<T, B>(static_cast<const T*>(p.outs[i]) + elem, x);
    s += w;
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = (w != 0.f) ? fmaf(w, x[k], acc[k]) : acc[k];
  }
  // s >= 1 here: the partial that attains the finite max m has weight exp(0) = 1.
  const float inv = 1.f / s;
#pragma unroll
  for (int k = 0; k < E; ++k) acc[k] *= inv;
  detail::store_f32<T, B>(static_cast<T*>(p.out) + elem, acc);
  if (c == 0) p.lse[lse_idx] = m + logf(s);
}

template <typename T, int B>
cudaError_t launch(const MergeParams& p, cudaStream_t stream) {
  constexpr int E = B / sizeof(T);
  const int64_t vecs = p.T * (p.D / E);
  const int64_t blocks_x = (vecs + kThreads - 1) / kThreads;
  if (blocks_x > 0x7fffffff || p.H > 65535) return cudaErrorInvalidConfiguration;
  merge_partials_kernel<T, B><<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(p.H)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_vec(const MergeParams& p, int vec_bytes, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16: return launch<T, 16>(p, stream);
    case 8: return launch<T, 8>(p, stream);
    case 4: if constexpr (sizeof(T) <= 4) return launch<T, 4>(p, stream); break;
    case 2: if constexpr (sizeof(T) <= 2) return launch<T, 2>(p, stream); break;
    default: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t merge_partials(const MergeParams& p, DType dtype, int vec_bytes, cudaStream_t stream) {
  if (p.n < 1 || p.n > kMaxPartials || p.T < 0 || p.H < 0 || p.D <= 0) return cudaErrorInvalidValue;
  if (p.T == 0 || p.H == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return dispatch_vec<float>(p, vec_bytes, stream);
    case DType::kFloat16: return dispatch_vec<__half>(p, vec_bytes, stream);
    case DType::kBFloat16: return dispatch_vec<__nv_bfloat16>(p, vec_bytes, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ringctx
