// Scatter a KV shard into the decode cache in sequence order: K and V, all layers, one launch.
//
// After a context-parallel prefill each rank holds its tokens' K/V rows in load-balanced (not
// sequence) order. PyTorch restores the order with one index_copy_ per layer and tensor
// (2 * L launches, 60 for SmolLM2, 252 for Llama-3-405B); this kernel moves the whole shard in
// one pass over its bytes. See ringctx_kernels.h for the exact semantics.
#include <algorithm>

#include "ringctx_kernels.h"
#include "vec_io.cuh"

namespace ringctx {
namespace {

constexpr int kThreads = 256;

// Grid-stride loop over the vectors of (plane, shard row, column). Consecutive threads walk
// along one token row, so both the read of the shard row and the write of the cache row are
// contiguous whatever the positions are.
template <int B>
__global__ void __launch_bounds__(kThreads) scatter_kv_kernel(const __grid_constant__ ScatterParams p) {
  using V = typename detail::VecType<B>::type;
  const int64_t vecs_per_row = p.row_bytes / B;
  const int64_t vecs_per_plane = p.n_rows * vecs_per_row;
  const int64_t total = p.n_planes * vecs_per_plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < total; v += stride) {
    const int64_t plane = v / vecs_per_plane;
    const int64_t rem = v - plane * vecs_per_plane;
    const int64_t i = rem / vecs_per_row;
    const int64_t c = rem - i * vecs_per_row;
    const int64_t pos = __ldg(p.positions + i);
    if (pos < 0 || pos >= p.dst_rows) {  // never write out of bounds; report instead
      if (c == 0) *p.error_flag = 1;     // benign race: every writer stores the same 1
      continue;
    }
    const char* src = reinterpret_cast<const char*>(__ldg(p.src_planes + plane));
    char* dst = reinterpret_cast<char*>(__ldg(p.dst_planes + plane));
    const V x = __ldg(reinterpret_cast<const V*>(src + i * p.src_row_stride + c * B));
    *reinterpret_cast<V*>(dst + pos * p.dst_row_stride + c * B) = x;
  }
}

template <int B>
cudaError_t launch(const ScatterParams& p, cudaStream_t stream) {
  const int64_t total = p.n_planes * p.n_rows * (p.row_bytes / B);
  // Enough blocks to fill any current GPU many times over; the grid-stride loop does the rest.
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 16);
  scatter_kv_kernel<B><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t scatter_kv(const ScatterParams& p, int vec_bytes, cudaStream_t stream) {
  if (p.n_planes < 0 || p.n_rows < 0 || p.row_bytes <= 0 || vec_bytes <= 0 || p.row_bytes % vec_bytes) {
    return cudaErrorInvalidValue;
  }
  if (p.n_rows == 0 || p.n_planes == 0) return cudaSuccess;
  switch (vec_bytes) {
    case 16: return launch<16>(p, stream);
    case 8: return launch<8>(p, stream);
    case 4: return launch<4>(p, stream);
    case 2: return launch<2>(p, stream);
    case 1: return launch<1>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace ringctx
