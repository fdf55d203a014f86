// bf16 linears on AMX tiles (Sapphire Rapids and later Xeons), for decode-sized calls.
//
// oneDNN's AMX GEMM is fast on prefill's thousands of rows, but a decode step's few rows leave it
// waiting on the weight, well below the memory's speed. Here the weight is packed once at load
// into the exact tiles TDPBF16PS takes, in the order they are used, so each thread reads one
// contiguous stream and asks for it a few KB ahead (figures in docs/PERFORMANCE.md).
//
// Packing: for each pair of 16-column blocks, for each 32-wide step along K, two 1 KB tiles, each
// [16 pairs of input features][16 output features][2] (the VNNI layout). Zero padded to multiples
// of 32 on both sides. A call takes the input 32 rows at a time (two A tiles) against two B tiles
// per K step, into four 16x16 float32 accumulator tiles; the sums are float32, the output is
// rounded once to bf16 (nearest even) after the bias is added.
//
// Ops (torch.ops.tokenfleet):
//   pack_linear_amx(weight [N, K]) -> packed [ceil(N/32), ceil(K/32), 2, 16, 32] bf16
//   linear_amx(x [..., K], packed, N, bias [N] float32?) -> [..., N] bf16

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENFLEET_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenfleet {
namespace {

constexpr int64_t TILE_K = 32;              // bf16 input features per A tile row / B tile
constexpr int64_t PAIR_N = 32;              // output features per pair of B tiles
constexpr int64_t TILE_ELEMS = 16 * 32;     // bf16 values in one tile (1 KB)
constexpr int64_t ROW_BLOCK = 256;          // input rows whose A tiles stay in L2 across a panel
constexpr int64_t PREFETCH_AHEAD = 4096;    // bytes of the weight stream asked for ahead (2 K steps)

at::Tensor pack_linear_amx(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be a bf16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t pairs = (n + PAIR_N - 1) / PAIR_N, steps = (k + TILE_K - 1) / TILE_K;
  auto packed = at::zeros({pairs, steps, 2, 16, 32}, weight.options());
  const auto w = weight.contiguous();
  const auto* src = w.data_ptr<at::BFloat16>();
  auto* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t half = 0; half < 2; ++half) {
          auto* tile = dst + ((p * steps + s) * 2 + half) * TILE_ELEMS;
          for (int64_t col = 0; col < 16; ++col) {
            const int64_t row = p * PAIR_N + half * 16 + col;
            if (row >= n) continue;
            for (int64_t i = 0; i < TILE_K && s * TILE_K + i < k; ++i)
              tile[(i / 2) * 32 + col * 2 + (i % 2)] = src[row * k + s * TILE_K + i];
          }
        }
  });
  return packed;
}

#ifdef TOKENFLEET_AMX

// Linux hands out AMX's tile state only to processes that ask (once; oneDNN asks the same way).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {  // all eight tiles 16 rows x 64 bytes; per thread, per call
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}

// One 32-row chunk of A against one pair of column blocks: 4 accumulators (tmm0-3), the A tiles
// in tmm4-5, the B tiles in tmm6-7; the float32 sums land in ``sums`` [32][32].
inline void pair_tiles(const at::BFloat16* a, int64_t a_stride_bytes, const at::BFloat16* b, int64_t steps,
                       float (*sums)[32]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const auto* tiles = b + s * 2 * TILE_ELEMS;
    const char* ahead = reinterpret_cast<const char*>(tiles) + PREFETCH_AHEAD;
    for (int line = 0; line < 2 * TILE_ELEMS * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(4, a + s * TILE_K, a_stride_bytes);
    _tile_loadd(5, reinterpret_cast<const char*>(a + s * TILE_K) + 16 * a_stride_bytes, a_stride_bytes);
    _tile_loadd(6, tiles, 64);
    _tile_loadd(7, tiles + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, &sums[0][0], 128);
  _tile_stored(1, &sums[0][16], 128);
  _tile_stored(2, &sums[16][0], 128);
  _tile_stored(3, &sums[16][16], 128);
}

// Adds the bias and rounds 16 sums to bf16 (VCVTNEPS2BF16: nearest even), storing ``count`` of them.
inline void store_row16(at::BFloat16* out, const float* sums, const float* bias, int64_t count) {
  __m512 v = _mm512_load_ps(sums);
  const __mmask16 mask = count >= 16 ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  const __m256bh rounded = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(out, mask, reinterpret_cast<const __m256i&>(rounded));
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), "the kernel refused this process AMX's tile state (arch_prctl)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 inputs only");
  TORCH_CHECK(packed.dim() == 5 && packed.size(0) * PAIR_N >= out_features, "packed is not pack_linear_amx's");
  const int64_t k = x.size(-1), steps = packed.size(1), padded_k = steps * TILE_K;
  TORCH_CHECK(padded_k >= k && padded_k - k < TILE_K, "x's width does not match the packed weight");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features && bias->is_contiguous(),
                "bias must be a float32 [N]");
    bias_data = bias->data_ptr<float>();
  }
  auto rows_in = x.reshape({-1, k});
  const int64_t rows = rows_in.size(0), padded_rows = (rows + 31) / 32 * 32;
  auto a = rows_in;  // the A tiles read 32 rows of padded_k: pad a copy where x is short of either
  if (padded_rows != rows || padded_k != k || !rows_in.is_contiguous()) {
    a = at::zeros({padded_rows, padded_k}, x.options());
    a.narrow(0, 0, rows).narrow(1, 0, k).copy_(rows_in);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = at::empty(sizes, x.options());
  const auto* a_data = a.data_ptr<at::BFloat16>();
  const auto* b_data = packed.data_ptr<at::BFloat16>();
  auto* o_data = out.data_ptr<at::BFloat16>();
  const int64_t pairs = (out_features + PAIR_N - 1) / PAIR_N, a_stride = padded_k * 2;
#pragma omp parallel if (pairs > 1)
  {
    configure_tiles();
    alignas(64) float sums[32][32];
    for (int64_t block = 0; block < padded_rows; block += ROW_BLOCK) {
      const int64_t block_end = std::min(padded_rows, block + ROW_BLOCK);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pairs; ++p) {
        const auto* panel = b_data + p * steps * 2 * TILE_ELEMS;
        const int64_t col = p * PAIR_N, width = std::min(PAIR_N, out_features - col);
        for (int64_t r = block; r < block_end; r += 32) {
          pair_tiles(a_data + r * padded_k, a_stride, panel, steps, sums);
          for (int64_t m = 0; m < std::min<int64_t>(32, rows - r); ++m) {
            auto* o = o_data + (r + m) * out_features + col;
            const float* bias_at = bias_data ? bias_data + col : nullptr;
            store_row16(o, sums[m], bias_at, width);
            if (width > 16) store_row16(o + 16, sums[m] + 16, bias_at ? bias_at + 16 : nullptr, width - 16);
          }
        }
      }
    }
    _tile_release();
  }
  return out;
}

#else

at::Tensor linear_amx(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "tokenfleet's kernels were built without AMX (this CPU has no AMX-BF16)");
}

#endif

}  // namespace
}  // namespace tokenfleet

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def("pack_linear_amx(Tensor weight) -> Tensor");
  m.def("linear_amx(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("pack_linear_amx", &tokenfleet::pack_linear_amx);
  m.impl("linear_amx", &tokenfleet::linear_amx);
}
