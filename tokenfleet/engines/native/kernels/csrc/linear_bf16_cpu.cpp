// bf16 linears for CPUs with AVX-512 or AVX2: with AVX512-BF16 (and no AMX, where oneDNN's tile
// kernels are faster) on VDPBF16PS; without it on float32 FMAs over the widened weight.
//
// The weight is packed once at load into 64-column panels, each a [K/2][64][2] array: for every
// pair of input features, the pairs of 64 output features side by side, which is the operand
// VDPBF16PS takes (16 lanes, each the dot product of two bf16 pairs, summed in float32). A tile of
// 6 input rows x 64 output columns keeps 24 accumulators in registers; per pair of input features
// it loads 4 vectors of the panel and broadcasts 6 pairs of the input (docs/PERFORMANCE.md has how
// it compares with oneDNN).
//
// Without AVX512-BF16 (Skylake to Ice Lake Xeons, or a VM that hides the bf16 instructions) oneDNN
// emulates bf16 GEMMs, and the float32 route doubles the weights' memory. Here the packed panel (48 columns wide in this build) is widened in registers: a pair's
// 32-bit word holds input feature 2p in its low half and 2p+1 in its high half, so a shift by 16
// and a mask give the two exact float32 vectors; the input rows are widened to float32 once per
// call. The products are exact in float32 and summed in float32, so the result is that of the
// VDPBF16PS path up to the order of the sums. Decode reads half the bytes of a float32 weight.
// With AVX2 and FMA only (e.g. a Zen 3 EPYC, whose library bf16 GEMMs are emulated) the same
// scheme runs on 8-float vectors: panels of 16 columns, tiles of 6 rows
// (12 accumulators, 2 widened weight vectors and a broadcast of AVX2's 16 registers).
//
// Ops (torch.ops.tokenfleet):
//   pack_linear_bf16(weight [N, K])  -> packed [ceil(N/P), ceil(K/2), P, 2], zero padded (P = PANEL)
//   linear_bf16(x [..., K], packed, N, bias [N]?) -> [..., N] bf16, float32 sums rounded once

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "linear_tasks.h"

// AVX-512 F, BW and VL: every Xeon since Skylake-SP, Zen 4 (not Knights Landing, which lacks BW).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TOKENFLEET_LINEAR_AVX512 1
#define TOKENFLEET_LINEAR_KERNEL 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENFLEET_LINEAR_AVX2 1
#define TOKENFLEET_LINEAR_KERNEL 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

// Whether decode-sized calls prefetch the next panel: linear_prefetch() sets it (benchmarks compare).
static std::atomic<bool> prefetch_allowed{true};

bool linear_prefetch(bool enabled) { return prefetch_allowed.exchange(enabled); }

namespace {

constexpr int64_t ROW_CHUNK = 192;  // rows a task takes: a panel stays in L2 over many tiles

#if defined(__AVX512BF16__)
constexpr int64_t PANEL = 64;  // output columns per panel: 4 vectors of 16 float32 sums
constexpr int64_t ROWS = 6;    // input rows per tile: 6 x 4 = 24 accumulators of 32 registers

// The first of the 4 lines a pair row of the next panel spans that full tile t of `full` (2 to 4)
// prefetches; it takes them up to tile t + 1's first.
inline int64_t first_line_ahead(int64_t t, int64_t full) { return 4 * t / full; }

// out_tile[i][0..64) = sum over pairs p of x[i] pair p . panel[p][0..64), for MR rows.
// AHEAD: the tile also prefetches AHEAD of the 4 cache lines a pair row of `ahead`'s panel
// spans (from `ahead` on), into L2 as it goes: a decode step's weights come from DRAM, and a
// panel's first tile otherwise waits on every line of it. The tiles of a panel share the next
// panel's lines between them (see first_line_ahead).
template <int MR, int AHEAD = 0>
inline void tile(const uint32_t* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, int64_t /*cols*/,
                 float* out_tile, const uint32_t* ahead = nullptr) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + p * PANEL + v * 16);
#pragma GCC unroll 4
    for (int v = 0; v < AHEAD; ++v) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * PANEL + v * 16), _MM_HINT_T1);
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

#elif defined(TOKENFLEET_LINEAR_AVX512)
// Tiles of 8 rows x 48 columns: 24 accumulators, 3 widened weight vectors and a broadcast. With
// 64-column panels (6 x 4) GCC spilled accumulators to the stack in the widening's shadow.
constexpr int64_t PANEL = 48;
constexpr int64_t ROWS = 8;

// As above, on float32 FMAs: x is the input widened to float32, x_pairs pairs (2 floats) a row;
// NV of the panel's 3 vectors (a last panel of N % 48 columns takes fewer).
template <int MR, int NV>
inline void tile_cols(const float* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, float* out_tile) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* w = panel + p * PANEL;
    __m512 wf[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wf[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + v * 16), 16));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[(i * x_pairs + p) * 2]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(wf[v], a, acc[i][v]);
    }
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wf[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + v * 16), high));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[(i * x_pairs + p) * 2 + 1]);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(wf[v], a, acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out_tile + i * PANEL + v * 16, acc[i][v]);
}

template <int MR>
inline void tile(const float* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, int64_t cols, float* out_tile) {
  if (cols > 32)
    tile_cols<MR, 3>(x, x_pairs, panel, pairs, out_tile);
  else if (cols > 16)
    tile_cols<MR, 2>(x, x_pairs, panel, pairs, out_tile);
  else
    tile_cols<MR, 1>(x, x_pairs, panel, pairs, out_tile);
}
#elif defined(TOKENFLEET_LINEAR_AVX2)
constexpr int64_t PANEL = 16;  // 2 vectors of 8 float32 sums
constexpr int64_t ROWS = 6;    // 6 x 2 = 12 accumulators of 16 registers

// As the AVX-512 tiles above, on 8-float vectors; NV of the panel's 2 vectors. Not inlined: in its
// caller's loop GCC kept 4 of the 12 accumulators on the stack, a third of the speed.
template <int MR, int NV>
__attribute__((noinline)) void tile_cols(const float* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, float* out_tile) {
  __m256 acc[MR][NV];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* w = panel + p * PANEL;
    __m256 wf[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      wf[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 8)), 16));
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + (i * x_pairs + p) * 2);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(wf[v], a, acc[i][v]);
    }
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      wf[v] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 8)), high));
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + (i * x_pairs + p) * 2 + 1);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(wf[v], a, acc[i][v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out_tile + i * PANEL + v * 8, acc[i][v]);
}

template <int MR>
inline void tile(const float* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, int64_t cols, float* out_tile) {
  if (cols > 8)
    tile_cols<MR, 2>(x, x_pairs, panel, pairs, out_tile);
  else
    tile_cols<MR, 1>(x, x_pairs, panel, pairs, out_tile);
}
#else
constexpr int64_t PANEL = 64;  // no kernel in this build; pack_linear_bf16 still packs
#endif

#if defined(TOKENFLEET_LINEAR_AVX2)
// s rounded to bf16 bits: to nearest, ties to even, a NaN kept quiet (as VCVTNEPS2BF16 rounds).
inline uint16_t round_to_bf16_bits(float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof bits);
  if (s != s) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// The same for 8 floats at once (a scalar epilogue took ~15% of a decode-sized call).
inline __m128i round_to_bf16(__m256 s) {
  const __m256i bits = _mm256_castps_si256(s);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
  const __m256i halves = _mm256_blendv_epi8(rounded, quiet, nan);  // each < 2^16: packs exactly
  return _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
}

// A tile's float32 sums (plus the bias) rounded into rows x cols of the bf16 output.
inline void store_tile(const float* sums, int64_t rows, int64_t cols, const float* bias, c10::BFloat16* out,
                       int64_t out_row) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < rows; ++i) {
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) {
      __m256 s = _mm256_loadu_ps(sums + i * PANEL + j);
      if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + j));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i * out_row + j), round_to_bf16(s));
    }
    for (; j < cols; ++j) o[i * out_row + j] = round_to_bf16_bits(sums[i * PANEL + j] + (bias ? bias[j] : 0.0f));
  }
}
#endif

#if defined(TOKENFLEET_LINEAR_AVX512)
// The 16 floats of s rounded to bf16 (to nearest, ties to even, as VCVTNEPS2BF16 rounds).
inline __m256i round_to_bf16(__m512 s) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(s);
#else
  const __m512i bits = _mm512_castps_si512(s);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);  // a quiet NaN, not a rounded-up infinity
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}
#endif

#if defined(TOKENFLEET_LINEAR_KERNEL)
template <typename X>
void run_tile(int64_t rows, const X* x, int64_t x_pairs, const uint32_t* panel, int64_t pairs, int64_t cols,
              float* out) {
  static_assert(ROWS <= 8, "tiles of up to 8 rows");  // rows <= ROWS: a 6-row build never sees 7 or 8
  switch (rows) {
    case 8: tile<8 <= ROWS ? 8 : 1>(x, x_pairs, panel, pairs, cols, out); break;
    case 7: tile<7 <= ROWS ? 7 : 1>(x, x_pairs, panel, pairs, cols, out); break;
    case 6: tile<6>(x, x_pairs, panel, pairs, cols, out); break;
    case 5: tile<5>(x, x_pairs, panel, pairs, cols, out); break;
    case 4: tile<4>(x, x_pairs, panel, pairs, cols, out); break;
    case 3: tile<3>(x, x_pairs, panel, pairs, cols, out); break;
    case 2: tile<2>(x, x_pairs, panel, pairs, cols, out); break;
    default: tile<1>(x, x_pairs, panel, pairs, cols, out); break;
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
#if defined(TOKENFLEET_LINEAR_KERNEL)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 inputs only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PANEL && packed.size(3) == 2, "weight not packed by pack_linear_bf16");
  const int64_t k = x.size(-1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == pairs && out_features <= panels * PANEL, "input features differ from the weight's");
  auto in = x.reshape({-1, k});
  if (k % 2) in = at::constant_pad_nd(in, {0, 1});  // the pack padded the weight with a zero column
  in = in.contiguous();
  const int64_t m = in.size(0);
  auto out = tokenfleet::linear_output(x, out_features);
  if (m == 0) return out;
  const auto b = tokenfleet::linear_bias_f32(bias, out_features);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__)
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(in.data_ptr<c10::BFloat16>());
  const int64_t x_row = pairs;  // a row's pairs, one 32-bit word each
#else
  const auto widened = in.to(at::kFloat);  // once per call; the tiles broadcast single floats
  const float* xp = widened.data_ptr<float>();
  const int64_t x_row = 2 * pairs;
#endif
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t row_chunk = tokenfleet::task_rows(m, panels, ROW_CHUNK, 2 * ROWS);
  const int64_t chunks = (m + row_chunk - 1) / row_chunk;
  // Task = (panel, row chunk), panel-major: a thread's tasks share panels, which stay in L2.
  // Handed out in shrinking runs of consecutive tasks (OpenMP's guided schedule): a thread the OS
  // preempts (the client, Redis and the worker's I/O share these cores) holds up only the run it
  // has, where a static split left the other threads waiting for its whole share.
  const int64_t tasks = panels * chunks;
  [[maybe_unused]] const bool prefetch = prefetch_allowed.load(std::memory_order_relaxed);
#pragma omp parallel for schedule(guided) if (tasks > 1 && !omp_in_parallel())
  for (int64_t task = 0; task < tasks; ++task) {
    alignas(64) float sums[ROWS * PANEL];
    const int64_t panel = task / chunks, r0 = (task % chunks) * row_chunk;
    const int64_t r1 = std::min(m, r0 + row_chunk), c0 = panel * PANEL;
    const int64_t cols = std::min(PANEL, out_features - c0);
    const uint32_t* weights = wp + panel * pairs * PANEL;
#if defined(__AVX512BF16__)
    // one chunk of rows (decode): the panel's first full tiles (up to 4) bring the next panel into
    // L2; not with one full tile (its 4 prefetches a pair row held 8-row calls up, 0.93-0.94x)
    const int64_t full = std::min<int64_t>(4, (r1 - r0) / ROWS);
    const bool ahead = prefetch && chunks == 1 && panel + 1 < panels && full >= 2;
#endif
    for (int64_t r = r0, t = 0; r < r1; r += ROWS, ++t) {
      const int64_t rows = std::min(ROWS, r1 - r);
#if defined(__AVX512BF16__)
      const bool asks = ahead && t < full;  // full tiles come first: rows == ROWS here
      const int64_t line = asks ? first_line_ahead(t, full) : 0;
      const int lines = asks ? static_cast<int>(first_line_ahead(t + 1, full) - line) : 0;
      const uint32_t* next = weights + pairs * PANEL + line * 16;
      if (lines == 4)
        tile<ROWS, 4>(xp + r * x_row, pairs, weights, pairs, cols, sums, next);
      else if (lines == 2)
        tile<ROWS, 2>(xp + r * x_row, pairs, weights, pairs, cols, sums, next);
      else if (lines == 1)
        tile<ROWS, 1>(xp + r * x_row, pairs, weights, pairs, cols, sums, next);
      else
#endif
        run_tile(rows, xp + r * x_row, pairs, weights, pairs, cols, sums);
#if defined(TOKENFLEET_LINEAR_AVX2)
      store_tile(sums, rows, cols, bp ? bp + c0 : nullptr, op + r * out_features + c0, out_features);
#else
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t v = 0; v * 16 < cols; ++v) {
          __m512 s = _mm512_loadu_ps(sums + i * PANEL + v * 16);
          const int64_t left = cols - v * 16;  // columns of this panel from vector v on
          const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
          if (bp) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bp + c0 + v * 16));
          _mm256_mask_storeu_epi16(op + (r + i) * out_features + c0 + v * 16, mask, round_to_bf16(s));
        }
#endif
    }
  }
  return out;
#else
  TORCH_CHECK(false, "tokenfleet::linear_bf16 needs a CPU with AVX-512 or AVX2 and FMA (this build has neither)");
#endif
}

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def("pack_linear_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_prefetch(bool enabled) -> bool", &linear_prefetch);
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("pack_linear_bf16", &pack_linear_bf16);
  m.impl("linear_bf16", &linear_bf16);
}
