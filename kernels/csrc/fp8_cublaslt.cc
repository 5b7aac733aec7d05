// XLA FFI handler: the per-group FP8 GEMM of kernels/fp8_matmul.py through cuBLASLt's block
// scaling on Hopper (cuBLAS >= 12.9), for kernels/fp8_cublaslt.py, which builds and registers it.
//
// out[M, N] = sum over 128-wide K groups g of (x[:, g] . w[:, g]^T) * xs[m, g] * ws[n/128, g],
// x [M, K] and w [N, K] float8_e4m3fn, each group's product promoted to fp32 by cuBLASLt.
//
// cuBLAS is column-major, so the row-major [M, N] output is computed as its transpose
// D (N x M, column-major) = op(A) . B with
//   A = w, read as a K x N column-major matrix (lda K) and transposed (op T): the weights,
//       one fp32 scale per 128 x 128 block (BLK128x128_32F): [N / 128][round_up(K / 128, 4)],
//       the K blocks contiguous;
//   B = x, read as a K x M column-major matrix (ldb K), not transposed: the activations, one
//       fp32 scale per 1 x 128 group along K (VEC128_32F): [K / 128][M], M contiguous.
// The caller passes the scales in exactly these layouts (x_scale transposed, w_scale padded).
// With the attribute swap = 1 the roles trade places (A = x with the 1 x 128 scales, B = w with
// the block scales, as NVIDIA's LtBlk128x128Fp8Matmul sample has them) and D = M x N
// column-major, i.e. the output buffer is [N, M] row-major and the caller transposes it.
//
// State per device (made on first use, kept for the process): a cuBLASLt handle, a workspace
// and, per (M, N, K, output type, alignment), the operation/layout descriptors and the
// heuristic's algorithm, so a shape's algorithm is chosen once.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 128;
// NVIDIA's recommended cuBLASLt workspace on Hopper.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

ffi::Error LtError(cublasStatus_t status, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("lacache fp8 cuBLASLt GEMM: ") + what + " failed: " +
                        cublasLtGetStatusString(status));
}

ffi::Error CudaError(cudaError_t status, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("lacache fp8 cuBLASLt GEMM: ") + what + " failed: " +
                        cudaGetErrorString(status));
}

#define LT_CHECK(expr)                                   \
  do {                                                   \
    cublasStatus_t status_ = (expr);                     \
    if (status_ != CUBLAS_STATUS_SUCCESS) {              \
      return LtError(status_, #expr);                    \
    }                                                    \
  } while (0)

#define CUDA_CHECK(expr)                                 \
  do {                                                   \
    cudaError_t status_ = (expr);                        \
    if (status_ != cudaSuccess) {                        \
      return CudaError(status_, #expr);                  \
    }                                                    \
  } while (0)

// Descriptors and the chosen algorithm of one problem.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};

  ~Plan() {
    // Teardown errors are ignored: nothing can report them.
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// (M, N, K, output type, alignment of all operands in bytes, swap)
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int, uint32_t, int32_t>;

struct DeviceState {
  std::mutex mu;  // guards plans and the scale pointers written into a plan's descriptor
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

std::mutex g_states_mu;

// Never destroyed: cuBLAS and CUDA may already be torn down when static destructors run.
std::map<int32_t, DeviceState*>& States() {
  static auto* states = new std::map<int32_t, DeviceState*>();
  return *states;
}

ffi::Error GetState(int32_t device, DeviceState** out) {
  std::lock_guard<std::mutex> lock(g_states_mu);
  auto it = States().find(device);
  if (it != States().end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  int previous = 0;
  CUDA_CHECK(cudaGetDevice(&previous));
  CUDA_CHECK(cudaSetDevice(device));
  auto state = std::make_unique<DeviceState>();
  cublasStatus_t created = cublasLtCreate(&state->handle);
  cudaError_t allocated = cudaMalloc(&state->workspace, kWorkspaceBytes);
  CUDA_CHECK(cudaSetDevice(previous));
  if (created != CUBLAS_STATUS_SUCCESS) return LtError(created, "cublasLtCreate");
  if (allocated != cudaSuccess) return CudaError(allocated, "cudaMalloc(workspace)");
  *out = state.release();
  States()[device] = *out;
  return ffi::Error::Success();
}

template <typename T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}

// The scale pointers are set before the heuristic runs (cuBLASLt checks them there too);
// each call sets its own again.
ffi::Error MakePlan(const DeviceState& state, int64_t M, int64_t N, int64_t K,
                    cudaDataType_t out_type, uint32_t alignment, int32_t swap,
                    const void* a_scale, const void* b_scale, Plan* plan) {
  const int64_t a_cols = swap ? M : N, b_cols = swap ? N : M;
  const int32_t a_mode = swap ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                              : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = swap ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                              : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale));
  // Fast accumulation (which skips the fp32 promotion of each group) stays at its default,
  // off: block-scaled modes promote every 128 of K.
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, K, a_cols, K));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, K, b_cols, K));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, out_type, a_cols, b_cols, a_cols));

  cublasLtMatmulPreference_t pref = nullptr;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t workspace = kWorkspaceBytes;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulPreferenceSetAttribute(pref, attr, &alignment, sizeof(alignment));
    }
  }
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(state.handle, plan->desc, plan->a, plan->b,
                                            plan->d, plan->d, pref, 1, &result, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) return LtError(status, "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "lacache fp8 cuBLASLt GEMM: no block-scaled algorithm for M=" +
                          std::to_string(M) + " N=" + std::to_string(N) + " K=" +
                          std::to_string(K) + " (needs Hopper and cuBLAS >= 12.9)");
  }
  plan->algo = result.algo;
  return ffi::Error::Success();
}

// Largest power of two (<= 256, cuBLASLt's default requirement) dividing every address.
uint32_t Alignment(std::initializer_list<const void*> pointers) {
  uint32_t alignment = 256;
  for (const void* p : pointers) {
    auto address = reinterpret_cast<uintptr_t>(p);
    while (alignment > 1 && address % alignment) alignment /= 2;
  }
  return alignment;
}

ffi::Error Fp8Gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::F32> x_scale, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                   ffi::Result<ffi::AnyBuffer> out, int32_t swap) {
  // (The FFI header has no typed buffers of FP8 in every jax version: checked here.)
  if (x.element_type() != ffi::DataType::F8E4M3FN ||
      w.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("lacache fp8 cuBLASLt GEMM: x, w must be float8_e4m3fn");
  }
  auto xd = x.dimensions(), wd = w.dimensions(), xsd = x_scale.dimensions();
  auto wsd = w_scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xsd.size() != 2 || wsd.size() != 2 ||
      od.size() != 2) {
    return ffi::Error::InvalidArgument("lacache fp8 cuBLASLt GEMM: operands must be 2-D");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0], G = K / kGroup;
  const int64_t G4 = (G + 3) / 4 * 4;
  if (wd[1] != K || K % kGroup || N % kGroup || M % 8 || M == 0 || xsd[0] != G ||
      xsd[1] != M || wsd[0] != N / kGroup || wsd[1] != G4 || od[0] != (swap ? N : M) ||
      od[1] != (swap ? M : N)) {
    return ffi::Error::InvalidArgument(
        "lacache fp8 cuBLASLt GEMM: need x [M, K], x_scale [K/128, M], w [N, K], "
        "w_scale [N/128, round_up(K/128, 4)], out [M, N] ([N, M] with swap) with K, N "
        "multiples of 128 and M of 8");
  }
  cudaDataType_t out_type;
  switch (out->element_type()) {
    case ffi::DataType::BF16: out_type = CUDA_R_16BF; break;
    case ffi::DataType::F32: out_type = CUDA_R_32F; break;
    default:
      return ffi::Error::InvalidArgument(
          "lacache fp8 cuBLASLt GEMM: out must be bfloat16 or float32");
  }
  DeviceState* state = nullptr;
  if (ffi::Error err = GetState(device, &state); !err.success()) return err;

  const void* a_ptr = swap ? x.untyped_data() : w.untyped_data();
  const void* b_ptr = swap ? w.untyped_data() : x.untyped_data();
  const void* a_scale = swap ? x_scale.typed_data() : w_scale.typed_data();
  const void* b_scale = swap ? w_scale.typed_data() : x_scale.typed_data();
  void* o_ptr = out->untyped_data();
  const uint32_t alignment = Alignment({a_ptr, b_ptr, o_ptr});
  const PlanKey key{M, N, K, static_cast<int>(out_type), alignment, swap};
  std::lock_guard<std::mutex> lock(state->mu);
  auto& plan = state->plans[key];
  if (!plan) {
    auto made = std::make_unique<Plan>();
    if (ffi::Error err = MakePlan(*state, M, N, K, out_type, alignment, swap, a_scale,
                                  b_scale, made.get());
        !err.success()) {
      state->plans.erase(key);
      return err;
    }
    plan = std::move(made);
  }
  // The scale addresses change per call; cublasLtMatmul reads them when it enqueues.
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale));
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(state->handle, plan->desc, &alpha, a_ptr, plan->a, b_ptr, plan->b,
                          &beta, o_ptr, plan->d, o_ptr, plan->d, &plan->algo, state->workspace,
                          kWorkspaceBytes, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LacacheFp8GemmCublasLt, Fp8Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K] fp8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x_scale [K/128, M]
                                  .Arg<ffi::AnyBuffer>()         // w [N, K] fp8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_scale [N/128, K4]
                                  .Ret<ffi::AnyBuffer>()         // out [M, N] / [N, M]
                                  .Attr<int32_t>("swap"));

// cuBLASLt's run-time version (e.g. 130100 for 13.1.0): block scaling needs >= 120900.
extern "C" size_t lacache_cublaslt_version() { return cublasLtGetVersion(); }
