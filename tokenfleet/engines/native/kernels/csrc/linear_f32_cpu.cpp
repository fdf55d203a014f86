// float32 linears for CPUs with AVX-512 or AVX2 and FMA.
//
// oneDNN's float32 GEMM on a prepacked weight runs a batch-32 decode step's linears at ~150 GF/s
// on a 2-core Zen 4 (its prefill at ~205, near the FMA peak): at 32 rows its kernel re-reads
// each weight block from memory in a pattern the prefetcher follows poorly. Here the weight is
// packed once into column panels, each a [K][PANEL] array, and a task takes one panel for all
// rows. With AVX-512 a tile of 8 input rows x 48 output columns keeps 24 accumulators in
// registers and, per input feature, loads 3 vectors of the panel and broadcasts 8 inputs. With
// AVX2 (16 registers of 8 floats) a tile is 6 rows x 16 columns: 12 accumulators, 2 vectors of
// the panel and a broadcast, and a panel's row is one cache line, so the panel streams in order.
// The panel comes from memory once and then from L2; with AVX2 the tiles of one panel ask for the
// next one ahead of use, spread over their work (docs/PERFORMANCE.md).
//
// Each output is one float32 sum over the input features in order, plus the bias, in both builds:
// oneDNN's and MKL's blocked sums round differently in the last bits, as they do between each other.
//
// Ops (torch.ops.tokenfleet):
//   pack_linear_f32(weight [N, K])  -> packed [ceil(N/PANEL), K, PANEL], zero padded
//   linear_f32(x [..., K], packed, N, bias [N]?) -> [..., N]

#include <ATen/ATen.h>
#include <torch/library.h>
#include <omp.h>

#include "linear_tasks.h"

#if defined(__AVX512F__)
#define TOKENFLEET_LINEAR_F32_KERNEL 1
#define TOKENFLEET_LINEAR_F32_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENFLEET_LINEAR_F32_KERNEL 1
#define TOKENFLEET_LINEAR_F32_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t ROW_CHUNK = 192;  // rows a task takes: its panel stays in L2 over the tiles

// Rows of the next panel a tile asks for (into L2) while it computes: `lines` rows from `at`, one
// every `every` input features. At decode sizes each tile of a panel asks for its share, so the
// next panel is in L2 when its first tile starts: that tile used to wait on memory for every row
// (AVX2 Zen 2, 32 rows, 1024 x 1024 weights from memory: 480 against 656 us, oneDNN 750). The
// AVX-512 tiles take no requests: not measured there yet.
struct Ahead {
  const float* at = nullptr;
  int64_t lines = 0, every = 1;
};

#if defined(TOKENFLEET_LINEAR_F32_AVX512)
constexpr int64_t PANEL = 48;  // output columns per panel: 3 vectors of 16 floats
constexpr int64_t ROWS = 8;    // input rows per tile: 8 x 3 = 24 accumulators of 32 registers
constexpr bool ASKS_AHEAD = false;  // run_tile ignores its Ahead (see Ahead)

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
              float* out, int64_t out_row, Ahead) {
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
#elif defined(TOKENFLEET_LINEAR_F32_AVX2)
constexpr int64_t PANEL = 16;  // output columns per panel: 2 vectors of 8 floats, one cache line
constexpr int64_t ROWS = 6;    // input rows per tile: 6 x 2 = 12 accumulators of 16 registers
constexpr bool ASKS_AHEAD = true;

// As the AVX-512 tile above, on 8-float vectors; NV of the panel's 2 vectors. Not inlined, as
// linear_bf16's AVX2 tiles: inlined in its caller's loop GCC kept accumulators on the stack.
template <int MR, int NV>
__attribute__((noinline)) void tile(const float* x, int64_t k_len, const float* panel, int64_t cols,
                                    const float* bias, float* out, int64_t out_row, Ahead ahead) {
  __m256 acc[MR][NV];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  int64_t wait = ahead.every;
  for (int64_t k = 0; k < k_len; ++k) {
    if (ahead.lines > 0 && --wait == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead.at), _MM_HINT_T1);
      ahead.at += PANEL, --ahead.lines, wait = ahead.every;
    }
    __m256 w[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_ps(panel + k * PANEL + v * 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * k_len + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(w[v], a, acc[i][v]);
    }
  }
  // unrolled, as every loop over acc: a loop left rolled makes GCC keep acc in memory, and the
  // k loop then stored all 12 accumulators each step (half the speed)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
    const int left = static_cast<int>(cols - v * 8);  // columns of this panel from vector v on
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
    const __m256 b = bias ? _mm256_maskload_ps(bias + v * 8, mask) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) _mm256_maskstore_ps(out + i * out_row + v * 8, mask, _mm256_add_ps(acc[i][v], b));
  }
}

template <int MR>
inline void tile_any_cols(const float* x, int64_t k_len, const float* panel, int64_t cols, const float* bias,
                          float* out, int64_t out_row, Ahead ahead) {
  if (cols > 8)
    tile<MR, 2>(x, k_len, panel, cols, bias, out, out_row, ahead);
  else
    tile<MR, 1>(x, k_len, panel, cols, bias, out, out_row, ahead);
}

void run_tile(int64_t rows, const float* x, int64_t k_len, const float* panel, int64_t cols, const float* bias,
              float* out, int64_t out_row, Ahead ahead) {
  switch (rows) {
    case 6: tile_any_cols<6>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
    case 5: tile_any_cols<5>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
    case 4: tile_any_cols<4>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
    case 3: tile_any_cols<3>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
    case 2: tile_any_cols<2>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
    default: tile_any_cols<1>(x, k_len, panel, cols, bias, out, out_row, ahead); break;
  }
}
#else
constexpr int64_t PANEL = 48;  // no kernel in this build; pack_linear_f32 still packs
#endif

// Tile t of `tiles`' share of the next panel (k rows of PANEL floats from `next`).
inline Ahead share_of_next_panel(const float* next, int64_t k, int64_t tiles, int64_t t) {
  const int64_t share = std::max<int64_t>(1, (k + tiles - 1) / tiles);
  Ahead ahead;
  ahead.at = next + t * share * PANEL;
  ahead.lines = std::max<int64_t>(0, std::min(share, k - t * share));
  ahead.every = std::max<int64_t>(1, k / share);
  return ahead;
}

}  // namespace

at::Tensor pack_linear_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + PANEL - 1) / PANEL;
  auto padded = at::zeros({panels * PANEL, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, PANEL, k}).permute({0, 2, 1}).contiguous();  // [panels, K, PANEL]
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
    const int64_t tiles = (r1 - r0 + ROWS - 1) / ROWS;
    const bool ahead = ASKS_AHEAD && chunks == 1 && panel + 1 < panels;  // decode: the next task, the next panel
    for (int64_t r = r0, t = 0; r < r1; r += ROWS, ++t)
      run_tile(std::min(ROWS, r1 - r), xp + r * k, k, wp + panel * k * PANEL, cols, bp ? bp + c0 : nullptr,
               op + r * out_features + c0, out_features,
               ahead ? share_of_next_panel(wp + (panel + 1) * k * PANEL, k, tiles, t) : Ahead{});
  }
  return out;
#else
  TORCH_CHECK(false, "tokenfleet::linear_f32 needs a CPU with AVX-512 or AVX2 and FMA (this build has neither)");
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
