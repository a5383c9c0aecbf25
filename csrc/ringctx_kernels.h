// Plain-CUDA entry points of the ringctx kernels: raw pointers and sizes, no torch headers.
//
// Why a header this light: the .cu files include only this and the CUDA runtime, so nvcc
// compiles them in seconds (CI compiles them for sm_90 on CPU machines), and all torch glue
// (dtype checks, streams, allocation) lives in bindings.cpp.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace ringctx {

// Element types understood by the kernels (the binding maps torch dtypes onto these).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The largest N that merge_partials takes in one launch. The pointers travel by value in the
// kernel parameters (no device-side pointer table, so no host-to-device copy per call);
// 64 x 2 pointers = 1 KiB, well under the 4 KiB parameter limit. Callers with more partials
// merge in groups or use the torch path.
constexpr int kMaxPartials = 64;

// Merge N partial attention results over disjoint key sets in one pass:
//   out_i [T, H, D] (dtype, contiguous), lse_i [H, T] float32 contiguous (natural log).
//   m = max_i lse_i;  w_i = exp(lse_i - m);  out = sum_i w_i out_i / sum_i w_i;  lse = m + log(sum_i w_i)
// Math is float32. A partial whose lse is not finite for a row (-inf: saw no key; +inf or NaN:
// the empty-row markers of some kernels, as ringctx.attention.merge.sanitize_lse treats them)
// contributes nothing to that row, and its out values never enter the sum, so garbage (even
// NaN) there cannot leak. A row empty in every partial gets out = 0, lse = -inf.
struct MergeParams {
  const void* outs[kMaxPartials];
  const float* lses[kMaxPartials];
  void* out;       // [T, H, D], same dtype as the inputs
  float* lse;      // [H, T]
  int n;           // number of partials, 1..kMaxPartials
  int64_t T;       // tokens
  int64_t H;       // heads
  int64_t D;       // head dim
};

// vec_bytes: bytes per vector load, one of 16, 8, 4 or the element size; the caller picks
// the largest that divides D * element size and every out pointer's alignment.
cudaError_t merge_partials(const MergeParams& p, DType dtype, int vec_bytes, cudaStream_t stream);

// Scatter rows of a KV shard into a cache in sequence order: K and V of every layer in one launch.
//   for every plane j and shard row i: dst_j[positions[i], :] = src_j[i, :]
// A plane is one [rows, Hkv, D] tensor (one layer's K, or V); the caller passes K's layers
// then V's. A "row" is one token's Hkv * D contiguous elements (row_bytes bytes); row strides
// are in bytes and shared by all planes on each side, so slices of bigger buffers work.
// Plane base addresses come from device-side tables (per-layer tensors are separate
// allocations, and 2 x 126 layers of pointers would not fit in the kernel parameters).
// Rows whose position is outside [0, dst_rows) are skipped and set *error_flag to 1 instead of
// writing out of bounds. Positions must be distinct (with duplicates, which row lands is
// unspecified).
struct ScatterParams {
  const int64_t* src_planes;  // device [n_planes] base addresses of the shard planes
  const int64_t* dst_planes;  // device [n_planes] base addresses of the cache planes
  const int64_t* positions;   // device [n_rows] destination row of each shard row
  int* error_flag;            // device int, set to 1 on an out-of-range position
  int64_t n_planes;           // layers x (1 or 2)
  int64_t n_rows;             // shard rows (tokens)
  int64_t row_bytes;          // Hkv * D * element size
  int64_t dst_rows;           // P: rows available in each cache plane
  int64_t src_row_stride;     // bytes between shard rows
  int64_t dst_row_stride;     // bytes between cache rows
};

// vec_bytes: 16, 8, 4, 2 or 1; must divide row_bytes, both row strides and every plane address.
cudaError_t scatter_kv(const ScatterParams& p, int vec_bytes, cudaStream_t stream);

}  // namespace ringctx
