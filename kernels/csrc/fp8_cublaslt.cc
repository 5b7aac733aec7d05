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
// and, per (M, N, K, output's leading dimension, output type, alignment, swap, config), the
// operation/layout descriptors and the algorithm, so a shape's algorithm is chosen once.
//
// The algorithm: the attribute `config` (kConfigLen int32: algo id, tile, stages, cluster
// shape, CTA swizzling, split-K, reduction scheme, custom option; cuBLASLt's enum values) where
// its algo id is >= 0 and cublasLtMatmulAlgoCheck accepts it; else the heuristic's first.
// With the attribute n_split > 0 the output's columns [n_split, N) come from a second
// cublasLtMatmul on the same buffers (w's rows and block scales from n_split, the output's
// columns in place, D's leading dimension the whole output's), with the configuration
// `tail_config`: the first call's tiles can then fill whole waves of SMs.
// `lacache_cublaslt_search` (ctypes, outside XLA) times every configuration cuBLASLt accepts
// for a shape, so a benchmark can find the ones worth passing, and cuBLASLt's per-tensor FP8
// GEMM (the speed reference) in the same harness.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 128;
// NVIDIA's recommended cuBLASLt workspace on Hopper.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kConfigLen = 8;

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

// (M, N, K, output's leading dimension, output type, alignment of all operands in bytes,
// swap, config)
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int, uint32_t, int32_t,
                           std::vector<int32_t>>;

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

// How the operands are scaled: our per-group product, or (for timing only) cuBLASLt's
// per-tensor FP8 GEMM with unit scales, with its default precise accumulation or fast.
enum Scaling : int32_t { kBlock = 0, kTensor = 1, kTensorFast = 2 };

// The descriptors of one problem, D's leading dimension `ldd` (0: D's own rows, a_cols; more
// where the problem is a column block of a wider output). The scale pointers are set before
// the heuristic runs (cuBLASLt checks them there too); each call sets its own again.
ffi::Error MakeDescriptors(int64_t M, int64_t N, int64_t K, cudaDataType_t out_type,
                           int32_t swap, const void* a_scale, const void* b_scale, Plan* plan,
                           Scaling scaling = kBlock, int64_t ldd = 0) {
  const int64_t a_cols = swap ? M : N, b_cols = swap ? N : M;
  const int32_t a_mode = swap ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                              : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = swap ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                              : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  if (scaling == kBlock) {
    LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode));
    LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode));
    LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale));
    LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale));
  }
  // Fast accumulation (which skips the fp32 promotion of each group) stays at its default,
  // off, but for the per-tensor reference that asks for it: block-scaled modes promote
  // every 128 of K.
  if (scaling == kTensorFast) {
    LT_CHECK(SetDesc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{1}));
  }
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, K, a_cols, K));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, K, b_cols, K));
  LT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, out_type, a_cols, b_cols,
                                      ldd > 0 ? ldd : a_cols));
  return ffi::Error::Success();
}

// The heuristic's first algorithm for plan's problem, operands aligned to `alignment` bytes.
ffi::Error Heuristic(const DeviceState& state, uint32_t alignment, Plan* plan,
                     const char* shape) {
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
                      std::string("lacache fp8 cuBLASLt GEMM: no block-scaled algorithm for ") +
                          shape + " (needs Hopper and cuBLAS >= 12.9)");
  }
  plan->algo = result.algo;
  return ffi::Error::Success();
}

// The configuration's attributes, in `config`'s order (after the algo id).
constexpr cublasLtMatmulAlgoConfigAttributes_t kConfigAttrs[kConfigLen - 1] = {
    CUBLASLT_ALGO_CONFIG_TILE_ID,         CUBLASLT_ALGO_CONFIG_STAGES_ID,
    CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
    CUBLASLT_ALGO_CONFIG_SPLITK_NUM,      CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
    CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION};

// Each attribute's own width (cuBLASLt checks sizeInBytes).
cublasStatus_t SetConfig(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr,
                         int32_t value) {
  switch (attr) {
    case CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID: {
      uint16_t v = static_cast<uint16_t>(value);
      return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &v, sizeof(v));
    }
    case CUBLASLT_ALGO_CONFIG_SPLITK_NUM:
      return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &value, sizeof(value));
    default: {
      uint32_t v = static_cast<uint32_t>(value);
      return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &v, sizeof(v));
    }
  }
}

int32_t GetConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  size_t written = 0;
  if (attr == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) {
    uint16_t v = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
    return v;
  }
  int32_t v = 0;  // int32_t and uint32_t attributes alike (all values are small)
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}

// `config` as an algorithm for plan's problem, if cuBLASLt accepts it within the workspace.
bool Configured(const DeviceState& state, const int32_t* config, cudaDataType_t out_type,
                Plan* plan) {
  cublasLtMatmulAlgo_t algo = {};
  if (cublasLtMatmulAlgoInit(state.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                             CUDA_R_8F_E4M3, out_type, out_type, config[0],
                             &algo) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  for (int i = 0; i < kConfigLen - 1; ++i) {
    if (SetConfig(&algo, kConfigAttrs[i], config[i + 1]) != CUBLAS_STATUS_SUCCESS) return false;
  }
  cublasLtMatmulHeuristicResult_t result = {};
  if (cublasLtMatmulAlgoCheck(state.handle, plan->desc, plan->a, plan->b, plan->d, plan->d,
                              &algo, &result) != CUBLAS_STATUS_SUCCESS ||
      result.workspaceSize > kWorkspaceBytes) {
    return false;
  }
  plan->algo = algo;
  return true;
}

ffi::Error MakePlan(const DeviceState& state, int64_t M, int64_t N, int64_t K, int64_t ldd,
                    cudaDataType_t out_type, uint32_t alignment, int32_t swap,
                    const std::vector<int32_t>& config, const void* a_scale,
                    const void* b_scale, Plan* plan) {
  if (ffi::Error err =
          MakeDescriptors(M, N, K, out_type, swap, a_scale, b_scale, plan, kBlock, ldd);
      !err.success()) {
    return err;
  }
  // A configuration cuBLASLt refuses (another version, other alignment) costs speed, not
  // correctness: the heuristic's algorithm then.
  if (config[0] >= 0 && Configured(state, config.data(), out_type, plan)) {
    return ffi::Error::Success();
  }
  const std::string shape = "M=" + std::to_string(M) + " N=" + std::to_string(N) +
                            " K=" + std::to_string(K);
  return Heuristic(state, alignment, plan, shape.c_str());
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

// One cuBLASLt call: out = x . w^T for an M x N problem (x [M, K], w [N, K]; with swap the
// roles trade places, see the top), the output's leading dimension `ldd` (0: its own). The
// caller holds state->mu.
ffi::Error Matmul(DeviceState* state, cudaStream_t stream, int64_t M, int64_t N, int64_t K,
                  int64_t ldd, cudaDataType_t out_type, int32_t swap,
                  const std::vector<int32_t>& config, const void* x, const float* x_scale,
                  const void* w, const float* w_scale, void* out) {
  const void* a_ptr = swap ? x : w;
  const void* b_ptr = swap ? w : x;
  const void* a_scale = swap ? static_cast<const void*>(x_scale) : w_scale;
  const void* b_scale = swap ? static_cast<const void*>(w_scale) : x_scale;
  const uint32_t alignment = Alignment({a_ptr, b_ptr, out});
  const PlanKey key{M, N, K, ldd, static_cast<int>(out_type), alignment, swap, config};
  auto& plan = state->plans[key];
  if (!plan) {
    auto made = std::make_unique<Plan>();
    if (ffi::Error err = MakePlan(*state, M, N, K, ldd, out_type, alignment, swap, config,
                                  a_scale, b_scale, made.get());
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
                          &beta, out, plan->d, out, plan->d, &plan->algo, state->workspace,
                          kWorkspaceBytes, stream));
  return ffi::Error::Success();
}

ffi::Error Fp8Gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::F32> x_scale, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                   ffi::Result<ffi::AnyBuffer> out, int32_t swap,
                   ffi::Span<const int32_t> config_attr, int32_t n_split,
                   ffi::Span<const int32_t> tail_config_attr) {
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
  if (config_attr.size() != kConfigLen || tail_config_attr.size() != kConfigLen) {
    return ffi::Error::InvalidArgument("lacache fp8 cuBLASLt GEMM: config and tail_config "
                                       "must be " + std::to_string(kConfigLen) + " int32");
  }
  if (n_split < 0 || n_split % kGroup || n_split >= N) {
    return ffi::Error::InvalidArgument(
        "lacache fp8 cuBLASLt GEMM: n_split must be 0 or a multiple of 128 below N");
  }
  DeviceState* state = nullptr;
  if (ffi::Error err = GetState(device, &state); !err.success()) return err;
  std::lock_guard<std::mutex> lock(state->mu);
  const std::vector<int32_t> config(config_attr.begin(), config_attr.end());
  if (n_split == 0) {
    return Matmul(state, stream, M, N, K, 0, out_type, swap, config, x.untyped_data(),
                  x_scale.typed_data(), w.untyped_data(), w_scale.typed_data(),
                  out->untyped_data());
  }
  // Two calls over column blocks of the output: N columns [0, n_split) with `config`, then
  // [n_split, N) with `tail_config`, each reading its rows of w and of w's block scales and
  // writing its columns in place (D's leading dimension stays the whole output's). Each
  // output element is one call's sum over all of K, as without the split.
  const std::vector<int32_t> tail(tail_config_attr.begin(), tail_config_attr.end());
  const int64_t ldd = swap ? M : N;
  const size_t out_bytes = out_type == CUDA_R_32F ? 4 : 2;
  auto* w_tail = static_cast<const uint8_t*>(w.untyped_data()) + n_split * K;
  const float* ws_tail = w_scale.typed_data() + n_split / kGroup * G4;
  auto* out_tail = static_cast<uint8_t*>(out->untyped_data()) +
                   (swap ? n_split * M : n_split) * out_bytes;
  if (ffi::Error err = Matmul(state, stream, M, n_split, K, ldd, out_type, swap, config,
                              x.untyped_data(), x_scale.typed_data(), w.untyped_data(),
                              w_scale.typed_data(), out->untyped_data());
      !err.success()) {
    return err;
  }
  return Matmul(state, stream, M, N - n_split, K, ldd, out_type, swap, tail, x.untyped_data(),
                x_scale.typed_data(), w_tail, ws_tail, out_tail);
}

// Buffers, handle, stream and events of one search, freed on every exit.
struct Search {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<void*> buffers;

  ~Search() {
    for (void* b : buffers) cudaFree(b);
    if (stop) cudaEventDestroy(stop);
    if (start) cudaEventDestroy(start);
    if (stream) cudaStreamDestroy(stream);
    if (handle) cublasLtDestroy(handle);
  }

  ffi::Error Alloc(size_t bytes, void** out) {
    CUDA_CHECK(cudaMalloc(out, bytes));
    buffers.push_back(*out);
    return ffi::Error::Success();
  }

  // Random FP8 values (exponent field <= 7: |v| < 2, never NaN) or fp32 scales in [0.5, 1).
  ffi::Error Fill(void* device, size_t bytes, bool scales, uint32_t seed) {
    std::vector<uint8_t> host(bytes);
    uint32_t r = seed;
    for (size_t i = 0; i < bytes; i += scales ? 4 : 1) {
      r = r * 1664525u + 1013904223u;
      if (scales) {
        float v = 0.5f + 0.5f * static_cast<float>(r >> 8) / 16777216.0f;
        std::memcpy(&host[i], &v, 4);
      } else {
        host[i] = static_cast<uint8_t>(((r >> 24) & 0x3F) | ((r >> 16) & 0x80));
      }
    }
    CUDA_CHECK(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice));
    return ffi::Error::Success();
  }
};

// ms per call of `algo` over `reps` calls after one warm-up; < 0 where it does not run.
float TimeAlgo(Search& s, const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* a,
               const void* b, void* d, void* workspace, int32_t reps) {
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&] {
    return cublasLtMatmul(s.handle, plan.desc, &alpha, a, plan.a, b, plan.b, &beta, d, plan.d,
                          d, plan.d, &algo, workspace, kWorkspaceBytes, s.stream);
  };
  if (run() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  cudaEventRecord(s.start, s.stream);
  for (int32_t i = 0; i < reps; ++i) run();
  cudaEventRecord(s.stop, s.stream);
  float ms = -1.0f;
  if (cudaEventSynchronize(s.stop) != cudaSuccess ||
      cudaEventElapsedTime(&ms, s.start, s.stop) != cudaSuccess) {
    return -1.0f;
  }
  return ms / reps;
}

// Capability `cap` of `algo` as a list of uint32 ids ({0}, "undefined", where it lists none).
std::vector<uint32_t> CapIds(const cublasLtMatmulAlgo_t& algo,
                             cublasLtMatmulAlgoCapAttributes_t cap) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, cap, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS ||
      bytes == 0) {
    return {0};
  }
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  cublasLtMatmulAlgoCapGetAttribute(&algo, cap, ids.data(), bytes, &bytes);
  return ids;
}

ffi::Error RunSearch(int64_t M, int64_t N, int64_t K, int32_t f32_out, int32_t swap,
                     Scaling scaling, int32_t max_split_k, int32_t reps, int32_t max_configs,
                     int32_t* configs, float* ms, int32_t* count) {
  *count = 0;
  const int64_t G = K / kGroup, G4 = (G + 3) / 4 * 4;
  const cudaDataType_t out_type = f32_out ? CUDA_R_32F : CUDA_R_16BF;
  Search s;
  LT_CHECK(cublasLtCreate(&s.handle));
  CUDA_CHECK(cudaStreamCreate(&s.stream));
  CUDA_CHECK(cudaEventCreate(&s.start));
  CUDA_CHECK(cudaEventCreate(&s.stop));
  void *x, *xs, *w, *ws, *d, *workspace;
  for (auto [ptr, bytes] : {std::pair{&x, size_t(M * K)}, {&xs, size_t(G * M * 4)},
                            {&w, size_t(N * K)}, {&ws, size_t(N / kGroup * G4 * 4)},
                            {&d, size_t(M * N * (f32_out ? 4 : 2))},
                            {&workspace, kWorkspaceBytes}}) {
    if (ffi::Error err = s.Alloc(bytes, ptr); !err.success()) return err;
  }
  uint32_t seed = 1;
  for (auto [ptr, bytes, scales] : {std::tuple{x, size_t(M * K), false},
                                    {xs, size_t(G * M * 4), true}, {w, size_t(N * K), false},
                                    {ws, size_t(N / kGroup * G4 * 4), true}}) {
    if (ffi::Error err = s.Fill(ptr, bytes, scales, seed++); !err.success()) return err;
  }
  const void* a = swap ? x : w;
  const void* b = swap ? w : x;
  Plan plan;
  if (ffi::Error err = MakeDescriptors(M, N, K, out_type, swap, swap ? xs : ws, swap ? ws : xs,
                                       &plan, scaling);
      !err.success()) {
    return err;
  }
  DeviceState state;  // only its handle is read by Heuristic and Configured; s frees it
  state.handle = s.handle;
  auto record = [&](const cublasLtMatmulAlgo_t& algo) {
    if (*count >= max_configs) return;
    const float t = TimeAlgo(s, plan, algo, a, b, d, workspace, reps);
    if (t < 0) return;
    int32_t* row = configs + *count * kConfigLen;
    row[0] = GetConfig(algo, CUBLASLT_ALGO_CONFIG_ID);
    for (int i = 0; i < kConfigLen - 1; ++i) row[i + 1] = GetConfig(algo, kConfigAttrs[i]);
    ms[(*count)++] = t;
  };
  if (ffi::Error err = Heuristic(state, 256, &plan, "the search"); !err.success()) return err;
  record(plan.algo);

  int ids[128];
  if (*count >= max_configs) return ffi::Error::Success();
  int n_ids = 0;
  LT_CHECK(cublasLtMatmulAlgoGetIds(s.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                                    CUDA_R_8F_E4M3, out_type, out_type, 128, ids, &n_ids));
  for (int i = 0; i < n_ids; ++i) {
    cublasLtMatmulAlgo_t algo = {};
    if (cublasLtMatmulAlgoInit(s.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                               CUDA_R_8F_E4M3, out_type, out_type, ids[i],
                               &algo) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    uint32_t swizzle = 0, split_support = 0, reductions = 0;
    int32_t custom_max = 0;
    size_t written = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swizzle,
                                      sizeof(swizzle), &written);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                      sizeof(custom_max), &written);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &split_support,
                                      sizeof(split_support), &written);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
                                      &reductions, sizeof(reductions), &written);
    // Splits of K only with fp32 partials summed in a separate, fixed-order pass (COMPUTE_TYPE):
    // the in-place scheme adds with atomics, in no fixed order.
    const bool can_split = split_support && (reductions & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    for (int32_t split = 1; split <= (can_split ? max_split_k : 1); ++split) {
      for (uint32_t tile : CapIds(algo, CUBLASLT_ALGO_CAP_TILE_IDS)) {
        for (uint32_t stages : CapIds(algo, CUBLASLT_ALGO_CAP_STAGES_IDS)) {
          for (int32_t cluster = 0; cluster < CUBLASLT_CLUSTER_SHAPE_END; ++cluster) {
            if (cluster == 1) continue;  // not a shape
            for (int32_t sw = 0; sw <= (swizzle ? 1 : 0); ++sw) {
              for (int32_t custom = 0; custom <= custom_max; ++custom) {
                const int32_t config[kConfigLen] = {
                    ids[i], static_cast<int32_t>(tile), static_cast<int32_t>(stages), cluster,
                    sw, split,
                    split > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                              : CUBLASLT_REDUCTION_SCHEME_NONE,
                    custom};
                if (Configured(state, config, out_type, &plan)) {
                  record(plan.algo);
                  if (*count >= max_configs) return ffi::Error::Success();
                }
              }
            }
          }
        }
      }
    }
  }
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
                                  .Attr<int32_t>("swap")
                                  .Attr<ffi::Span<const int32_t>>("config")
                                  .Attr<int32_t>("n_split")
                                  .Attr<ffi::Span<const int32_t>>("tail_config"));

// cuBLASLt's run-time version (e.g. 130100 for 13.1.0): block scaling needs >= 120900.
extern "C" size_t lacache_cublaslt_version() { return cublasLtGetVersion(); }

// Times every configuration cuBLASLt accepts for one problem (`RunSearch`: K split into at
// most `max_split_k` parts, with fp32 partials) on operands of its own, `reps` calls each
// after a warm-up, on the current device outside any XLA stream; writes up to `max_configs`
// rows of kConfigLen int32 to `configs` and their ms per call to `ms`, the heuristic's first
// choice as row 0. `scaling` (a `Scaling`) 1 or 2 times cuBLASLt's per-tensor FP8 GEMM
// instead (precise or fast accumulation). Returns the row count, or -1 with the reason in
// `error` (NUL-terminated, at most `error_len` bytes).
extern "C" int32_t lacache_cublaslt_search(int64_t M, int64_t N, int64_t K, int32_t f32_out,
                                           int32_t swap, int32_t scaling, int32_t max_split_k,
                                           int32_t reps, int32_t max_configs, int32_t* configs,
                                           float* ms, char* error, int32_t error_len) {
  int32_t count = 0;
  if (scaling < kBlock || scaling > kTensorFast) {
    std::snprintf(error, error_len, "scaling must be 0, 1 or 2, got %d", scaling);
    return -1;
  }
  ffi::Error err = RunSearch(M, N, K, f32_out, swap, static_cast<Scaling>(scaling),
                             max_split_k, reps, max_configs, configs, ms, &count);
  if (err.success()) return count;
  std::snprintf(error, error_len, "%s", err.message().c_str());
  return -1;
}

extern "C" int32_t lacache_cublaslt_config_len() { return kConfigLen; }
