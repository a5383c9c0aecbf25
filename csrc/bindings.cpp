// Torch glue for the ringctx CUDA kernels: checks, allocation, streams, dtype dispatch.
//
// Built by ringctx/attention/cuda_ext.py with torch.utils.cpp_extension.load on the first use
// on a GPU machine. The kernels themselves (merge_partials.cu, scatter_kv.cu) see only raw
// pointers and sizes; every shape/dtype/device rule is enforced here (and again, with
// friendlier messages, in cuda_ext.py).
#include <torch/extension.h>

// c10's stream/guard headers only: ATen/cuda/CUDAContext.h drags in cuBLAS/cuSPARSE headers,
// which a compile-only CI toolkit (nvcc alone) does not have.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <vector>

#include "ringctx_kernels.h"

namespace {

ringctx::DType kernel_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return ringctx::DType::kFloat32;
    case at::kHalf: return ringctx::DType::kFloat16;
    case at::kBFloat16: return ringctx::DType::kBFloat16;
    default: TORCH_CHECK(false, "ringctx CUDA kernels take float32, float16 or bfloat16, got ", s);
  }
}

// The widest vector (bytes, <= 16, >= min_bytes) dividing every size and every address given.
int pick_vec_bytes(const std::vector<int64_t>& values, int min_bytes) {
  for (int b = 16; b > min_bytes; b /= 2) {
    bool ok = true;
    for (int64_t x : values) ok = ok && (x % b == 0);
    if (ok) return b;
  }
  return min_bytes;
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "ringctx ", what, " kernel failed: ", cudaGetErrorString(err));
}

}  // namespace

// outs: N tensors [T, H, D] of one dtype; lses: N float32 tensors [H, T]; all on one CUDA
// device; 1 <= N <= max_partials(). Returns {out [T, H, D] (input dtype), lse [H, T] float32}.
std::vector<at::Tensor> merge_partials(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& lses) {
  const int64_t n = static_cast<int64_t>(outs.size());
  TORCH_CHECK(n >= 1 && n == static_cast<int64_t>(lses.size()), "merge_partials: need N >= 1 outs and as many lses");
  TORCH_CHECK(n <= ringctx::kMaxPartials, "merge_partials: at most ", ringctx::kMaxPartials, " partials per call, got ", n);
  const at::Tensor& o0 = outs[0];
  TORCH_CHECK(o0.is_cuda() && o0.dim() == 3, "merge_partials: out must be a CUDA tensor [T, H, D]");
  const int64_t T = o0.size(0), H = o0.size(1), D = o0.size(2);
  const ringctx::DType dt = kernel_dtype(o0.scalar_type());
  c10::cuda::CUDAGuard guard(o0.device());

  // Keep the contiguous versions alive until the kernel is enqueued (the caching allocator
  // makes that safe on the current stream afterwards).
  std::vector<at::Tensor> keep;
  keep.reserve(2 * n);
  ringctx::MergeParams p{};
  std::vector<int64_t> align{D * static_cast<int64_t>(o0.element_size())};
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& o = outs[i];
    const at::Tensor& l = lses[i];
    TORCH_CHECK(o.device() == o0.device() && l.device() == o0.device(), "merge_partials: all tensors on one device");
    TORCH_CHECK(o.scalar_type() == o0.scalar_type(), "merge_partials: outs differ in dtype");
    TORCH_CHECK(o.sizes() == o0.sizes(), "merge_partials: out ", i, " has shape ", o.sizes(), ", expected ", o0.sizes());
    TORCH_CHECK(l.scalar_type() == at::kFloat, "merge_partials: lse must be float32");
    TORCH_CHECK(l.dim() == 2 && l.size(0) == H && l.size(1) == T, "merge_partials: lse ", i, " has shape ", l.sizes(),
                ", expected [", H, ", ", T, "]");
    keep.push_back(o.contiguous());
    keep.push_back(l.contiguous());
    p.outs[i] = keep[2 * i].data_ptr();
    p.lses[i] = keep[2 * i + 1].data_ptr<float>();
    align.push_back(reinterpret_cast<int64_t>(p.outs[i]));
  }
  at::Tensor out = at::empty({T, H, D}, o0.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({H, T}, o0.options().dtype(at::kFloat));
  align.push_back(reinterpret_cast<int64_t>(out.data_ptr()));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.n = static_cast<int>(n);
  p.T = T;
  p.H = H;
  p.D = D;
  const int vec = pick_vec_bytes(align, static_cast<int>(o0.element_size()));
  check_cuda(ringctx::merge_partials(p, dt, vec, c10::cuda::getCurrentCUDAStream().stream()), "merge_partials");
  return {out, lse};
}

// dst: n_planes cache planes [P, Hkv, D]; src: as many shard planes [n, Hkv, D] (K's layers then
// V's, as cuda_ext.py flattens them), one dtype, (Hkv, D) contiguous, one row stride per side.
// positions: int64 [n]; error_flag: int32 [>= 1], set to 1 on a position outside [0, P).
void scatter_kv(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, const at::Tensor& positions,
                at::Tensor error_flag) {
  const int64_t planes = static_cast<int64_t>(dst.size());
  TORCH_CHECK(planes >= 1 && planes == static_cast<int64_t>(src.size()), "scatter_kv: need as many shard as cache planes");
  const at::Tensor& d0 = dst[0];
  const at::Tensor& s0 = src[0];
  TORCH_CHECK(d0.is_cuda() && d0.dim() == 3 && s0.dim() == 3, "scatter_kv: planes must be CUDA tensors [rows, Hkv, D]");
  c10::cuda::CUDAGuard guard(d0.device());
  TORCH_CHECK(positions.device() == d0.device() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.numel() == s0.size(0),
              "scatter_kv: positions must be a contiguous int64 [", s0.size(0), "] tensor on the cache's device");
  TORCH_CHECK(error_flag.device() == d0.device() && error_flag.scalar_type() == at::kInt && error_flag.numel() >= 1,
              "scatter_kv: error_flag must be an int32 tensor on the cache's device");
  const int64_t esize = d0.element_size();
  const int64_t row_bytes = d0.size(1) * d0.size(2) * esize;
  std::vector<int64_t> align{row_bytes, d0.stride(0) * esize, s0.stride(0) * esize};
  at::Tensor table = at::empty({2, planes}, at::TensorOptions().dtype(at::kLong));  // host: src row 0, dst row 1
  int64_t* t = table.data_ptr<int64_t>();
  for (int64_t j = 0; j < planes; ++j) {
    const at::Tensor& d = dst[j];
    const at::Tensor& s = src[j];
    TORCH_CHECK(d.device() == d0.device() && s.device() == d0.device(), "scatter_kv: all tensors on one device");
    TORCH_CHECK(d.scalar_type() == d0.scalar_type() && s.scalar_type() == d0.scalar_type(),
                "scatter_kv: caches and shards must share one dtype");
    TORCH_CHECK(d.sizes() == d0.sizes() && s.sizes() == s0.sizes(), "scatter_kv: planes differ in shape");
    TORCH_CHECK(d.size(1) == s.size(1) && d.size(2) == s.size(2), "scatter_kv: cache ", d.sizes(), " and shard ",
                s.sizes(), " differ in (Hkv, D)");
    // A token row (Hkv, D) must be contiguous; the row stride is free but shared per side.
    TORCH_CHECK(d.stride(2) == 1 && d.stride(1) == d.size(2) && s.stride(2) == 1 && s.stride(1) == s.size(2),
                "scatter_kv: the (Hkv, D) part of every cache and shard plane must be contiguous");
    TORCH_CHECK(d.stride(0) == d0.stride(0) && s.stride(0) == s0.stride(0), "scatter_kv: planes differ in row stride");
    t[j] = reinterpret_cast<int64_t>(s.data_ptr());
    t[planes + j] = reinterpret_cast<int64_t>(d.data_ptr());
    align.push_back(t[j]);
    align.push_back(t[planes + j]);
  }
  // One small host-to-device copy of the plane tables (a hand-off happens once per prefill).
  at::Tensor dev_table = table.to(d0.device());

  ringctx::ScatterParams p{};
  p.src_planes = dev_table.data_ptr<int64_t>();
  p.dst_planes = dev_table.data_ptr<int64_t>() + planes;
  p.positions = positions.data_ptr<int64_t>();
  p.error_flag = error_flag.data_ptr<int>();
  p.n_planes = planes;
  p.n_rows = s0.size(0);
  p.row_bytes = row_bytes;
  p.dst_rows = d0.size(0);
  p.src_row_stride = s0.stride(0) * esize;
  p.dst_row_stride = d0.stride(0) * esize;
  check_cuda(ringctx::scatter_kv(p, pick_vec_bytes(align, 1), c10::cuda::getCurrentCUDAStream().stream()), "scatter_kv");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringctx CUDA kernels: one-pass merge of partial attention results, KV shard scatter";
  m.def("merge_partials", &merge_partials, "merge N (out [T,H,D], lse [H,T]) partials", py::arg("outs"), py::arg("lses"));
  m.def("scatter_kv", &scatter_kv, "scatter shard planes into cache planes by positions", py::arg("dst"),
        py::arg("src"), py::arg("positions"), py::arg("error_flag"));
  m.def("max_partials", []() { return ringctx::kMaxPartials; });
}
