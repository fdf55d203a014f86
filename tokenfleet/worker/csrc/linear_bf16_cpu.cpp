// bf16 linears for CPUs with AVX512-BF16 (and no AMX, where oneDNN's tile kernels are faster).
//
// The weight is packed once at load into 64-column panels, each a [K/2][64][2] array: for every
// pair of input features, the pairs of 64 output features side by side, which is the operand
// VDPBF16PS takes (16 lanes, each the dot product of two bf16 pairs, summed in float32). A tile of
// 6 input rows x 64 output columns keeps 24 accumulators in registers; per pair of input features
// it loads 4 vectors of the panel and broadcasts 6 pairs of the input. On a Zen 4 EPYC this ran at
// 358-363 GFLOP/s at 32 rows (oneDNN's bf16 GEMM on its own prepacked weight: 257-315) and at
// 438-449 at 2048 rows (oneDNN 427-438): the decode step's matmuls and the prefill's.
//
// Ops (torch.ops.tokenfleet):
//   pack_linear_bf16(weight [N, K])  -> packed [ceil(N/64), ceil(K/2), 64, 2], zero padded
//   linear_bf16(x [..., K], packed, N, bias [N]?) -> [..., N] bf16, float32 sums rounded once

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t PANEL = 64;  // output columns per panel: 4 vectors of 16 float32 sums

#if defined(__AVX512BF16__)
constexpr int64_t ROWS = 6;    // input rows per tile: 6 x 4 = 24 accumulators of 32 registers
constexpr int64_t ROW_CHUNK = 192;  // rows a task takes: a panel stays in L2 over 32 tiles

// out_tile[i][0..64) = sum over pairs p of x[i] pair p . panel[p][0..64), for MR rows.
template <int MR>
inline void tile(const uint32_t* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, float* out_tile) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + p * PANEL + v * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * x_pairs + p]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w[v], a);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out_tile + i * PANEL + v * 16, acc[i][v]);
}

void run_tile(int64_t rows, const uint32_t* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, float* out) {
  switch (rows) {
    case 6: tile<6>(x, x_pairs, panel, pairs, out); break;
    case 5: tile<5>(x, x_pairs, panel, pairs, out); break;
    case 4: tile<4>(x, x_pairs, panel, pairs, out); break;
    case 3: tile<3>(x, x_pairs, panel, pairs, out); break;
    case 2: tile<2>(x, x_pairs, panel, pairs, out); break;
    default: tile<1>(x, x_pairs, panel, pairs, out); break;
  }
}
#endif

}  // namespace

at::Tensor pack_linear_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be a 2-D bf16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + PANEL - 1) / PANEL, pairs = (k + 1) / 2;
  auto padded = at::zeros({panels * PANEL, pairs * 2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panels, 64, pairs, 2] -> [panels, pairs, 64, 2]
  return padded.view({panels, PANEL, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 inputs only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PANEL && packed.size(3) == 2, "weight not packed by pack_linear_bf16");
  const int64_t k = x.size(-1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == pairs && out_features <= panels * PANEL, "input features differ from the weight's");
  auto in = x.reshape({-1, k});
  if (k % 2) in = at::constant_pad_nd(in, {0, 1});  // the pack padded the weight with a zero column
  in = in.contiguous();
  const int64_t m = in.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  auto out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(in.data_ptr<c10::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
  // Task = (panel, row chunk), panel-major: a thread's tasks share panels, which stay in L2.
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[ROWS * PANEL];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task / chunks, r0 = (task % chunks) * ROW_CHUNK;
      const int64_t r1 = std::min(m, r0 + ROW_CHUNK), c0 = panel * PANEL;
      const int64_t cols = std::min(PANEL, out_features - c0);
      for (int64_t r = r0; r < r1; r += ROWS) {
        const int64_t rows = std::min(ROWS, r1 - r);
        run_tile(rows, xp + r * pairs, pairs, wp + panel * pairs * PANEL, pairs, sums);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t v = 0; v * 16 < cols; ++v) {
            __m512 s = _mm512_loadu_ps(sums + i * PANEL + v * 16);
            const int64_t left = cols - v * 16;  // columns of this panel from vector v on
            const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
            if (bp) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bp + c0 + v * 16));
            _mm256_mask_storeu_epi16(op + (r + i) * out_features + c0 + v * 16, mask, (__m256i)_mm512_cvtneps_pbh(s));
          }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "tokenfleet::linear_bf16 needs a CPU with AVX512-BF16 (this build has none)");
#endif
}

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def("pack_linear_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("pack_linear_bf16", &pack_linear_bf16);
  m.impl("linear_bf16", &linear_bf16);
}
