// float32 linears for CPUs with AVX-512.
//
// oneDNN's float32 GEMM on a prepacked weight runs a batch-32 decode step's linears at ~150 GF/s
// on a 2-core Zen 4 (its prefill at ~205, near the FMA peak): at 32 rows its kernel re-reads
// each weight block from memory in a pattern the prefetcher follows poorly. Here the weight is
// packed once into 48-column panels, each a [K][48] array, and a task takes one panel for all
// rows: a tile of 8 input rows x 48 output columns keeps 24 accumulators in registers and, per
// input feature, loads 3 vectors of the panel and broadcasts 8 inputs. The panel streams in once
// from memory (the first tile) and then from L2 (docs/PERFORMANCE.md has the figures).
//
// Each output is one float32 sum over the input features in order, plus the bias: oneDNN's and
// MKL's blocked sums round differently in the last bits, as they do between each other.
//
// Ops (torch.ops.tokenfleet):
//   pack_linear_f32(weight [N, K])  -> packed [ceil(N/48), K, 48], zero padded
//   linear_f32(x [..., K], packed, N, bias [N]?) -> [..., N]

#include <torch/extension.h>
#include <torch/library.h>
#include <omp.h>

#include "linear_tasks.h"

#if defined(__AVX512F__)
#define TOKENFLEET_LINEAR_F32_KERNEL 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t PANEL = 48;       // output columns per panel: 3 vectors of 16 floats
constexpr int64_t ROWS = 8;         // input rows per tile: 8 x 3 = 24 accumulators of 32 registers
constexpr int64_t ROW_CHUNK = 192;  // rows a task takes: its panel stays in L2 over the tiles

#if defined(TOKENFLEET_LINEAR_F32_KERNEL)
// out[i][c] = sum over k of x[i][k] * panel[k][c] (+ bias[c]), for MR rows and NV of the panel's
// 3 vectors (a last panel of N % 48 columns takes fewer); cols of its columns are stored.
template <int MR, int NV>
inline void tile(const float* x, int64_t k_len, const float* panel, int64_t cols, const float* bias, float* out,
                 int64_t out_row) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 w[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_ps(panel + k * PANEL + v * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * k_len + k]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(w[v], a, acc[i][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = cols - v * 16;  // columns of this panel from vector v on
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + v * 16) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + i * out_row + v * 16, mask, _mm512_add_ps(acc[i][v], b));
  }
}

template <int MR>
inline void tile_any_cols(const float* x, int64_t k_len, const float* panel, int64_t cols, const float* bias,
                          float* out, int64_t out_row) {
  if (cols > 32)
    tile<MR, 3>(x, k_len, panel, cols, bias, out, out_row);
  else if (cols > 16)
    tile<MR, 2>(x, k_len, panel, cols, bias, out, out_row);
  else
    tile<MR, 1>(x, k_len, panel, cols, bias, out, out_row);
}

void run_tile(int64_t rows, const float* x, int64_t k_len, const float* panel, int64_t cols, const float* bias,
              float* out, int64_t out_row) {
  switch (rows) {
    case 8: tile_any_cols<8>(x, k_len, panel, cols, bias, out, out_row); break;
    case 7: tile_any_cols<7>(x, k_len, panel, cols, bias, out, out_row); break;
    case 6: tile_any_cols<6>(x, k_len, panel, cols, bias, out, out_row); break;
    case 5: tile_any_cols<5>(x, k_len, panel, cols, bias, out, out_row); break;
    case 4: tile_any_cols<4>(x, k_len, panel, cols, bias, out, out_row); break;
    case 3: tile_any_cols<3>(x, k_len, panel, cols, bias, out, out_row); break;
    case 2: tile_any_cols<2>(x, k_len, panel, cols, bias, out, out_row); break;
    default: tile_any_cols<1>(x, k_len, panel, cols, bias, out, out_row); break;
  }
}
#endif

}  // namespace

at::Tensor pack_linear_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + PANEL - 1) / PANEL;
  auto padded = at::zeros({panels * PANEL, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, PANEL, k}).permute({0, 2, 1}).contiguous();  // [panels, K, 48]
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
#if defined(TOKENFLEET_LINEAR_F32_KERNEL)
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "float32 inputs only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL, "weight not packed by pack_linear_f32");
  const int64_t k = x.size(-1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && out_features <= panels * PANEL, "input features differ from the weight's");
  const auto in = x.reshape({-1, k}).contiguous();
  const int64_t m = in.size(0);
  auto out = tokenfleet::linear_output(x, out_features);
  if (m == 0) return out;
  const auto b = tokenfleet::linear_bias_f32(bias, out_features);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = in.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_chunk = tokenfleet::task_rows(m, panels, ROW_CHUNK, 2 * ROWS);
  const int64_t chunks = (m + row_chunk - 1) / row_chunk, tasks = panels * chunks;
  // Task = (panel, row chunk), panel-major, in shrinking runs (guided): as linear_bf16's tasks.
#pragma omp parallel for schedule(guided) if (tasks > 1 && !omp_in_parallel())
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t panel = task / chunks, r0 = (task % chunks) * row_chunk;
    const int64_t r1 = std::min(m, r0 + row_chunk), c0 = panel * PANEL;
    const int64_t cols = std::min(PANEL, out_features - c0);
    for (int64_t r = r0; r < r1; r += ROWS)
      run_tile(std::min(ROWS, r1 - r), xp + r * k, k, wp + panel * k * PANEL, cols, bp ? bp + c0 : nullptr,
               op + r * out_features + c0, out_features);
  }
  return out;
#else
  TORCH_CHECK(false, "tokenfleet::linear_f32 needs a CPU with AVX-512 (this build has none)");
#endif
}

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def("pack_linear_f32(Tensor weight) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &linear_f32);
}
