// LoRA updates of a batch whose rows use different adapters, in one call per linear (Punica's
// SGMV, on the CPU): after the base product y = x W^T of the whole batch, each row t whose slot
// s = row_slot[t] holds an adapter for this linear gets
//     y[t, offset : offset + out] += scale[s] * E_s^T (S_s x_t)
// (S_s [r_s, in]: PEFT's lora_A, shrinks; E_s [r_s, out]: lora_B transposed, expands; both read
// along their rows; an empty S_s: the adapter in slot s leaves this linear alone). Rows are
// grouped by slot, in pieces of PIECE_ROWS that each read their adapter once, summing in float32
// (bf16 on a CPU with AVX512-BF16: the shrink's products in pairs by dpbf16), the pieces shared
// among the threads. The library's GEMMs, tried on a prompt's long runs of one slot, lost to
// these loops on every CPU measured: their skinny shapes (rank columns) run far below peak.
//
// A fused linear (q/k/v, gate/up) passes its parts in one call, each part's slots in turn and
// each part's first output column in ``offsets``: one parallel region shares all their pieces.
//
// Op (torch.ops.tokenfleet):
//   lora_delta_(y [T, O], x [T, in], shrink Tensor[P * S], expand Tensor[P * S], scale float[P * S],
//               row_slot [T] int64, offsets int[P]) -> (): y updated in place (part p's update in
//               its columns offsets[p] onwards)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "common.h"

namespace tokenfleet {
namespace {

constexpr int64_t PIECE_ROWS = 16;
constexpr int ROW_BLOCK = 4;   // rows sharing each widened load of S and of E
constexpr int RANK_BLOCK = 4;  // ranks sharing each load of x in the shrink
constexpr int COL_BLOCK = 4;   // vectors of output columns summed in registers in the expand
// bytes ahead that the loops ask for: an adapter's rows are short streams (a few KB each, read
// side by side), too short for the hardware prefetcher to find before they end
constexpr int64_t PREFETCH_BYTES = 256;

// v[r0 .. r0 + ROW_BLOCK, k0 .. k0 + K) = scale * S[k0 .. k0 + K) x: each load of x serves K
// ranks and each widened load of S serves ROW_BLOCK rows, the K x ROW_BLOCK sums in registers.
template <int K, typename T>
void shrink_block(const T* sp, const float* xr, int64_t in, int64_t k0, int64_t rank, float scale, float* v) {
  vec acc[K][ROW_BLOCK] = {};
  int64_t d = 0;
  for (; d + W <= in; d += W) {
    vec xv[ROW_BLOCK];
    for (int i = 0; i < ROW_BLOCK; ++i) xv[i] = load(xr + i * in + d);
    for (int k = 0; k < K; ++k) {
      __builtin_prefetch(reinterpret_cast<const char*>(sp + (k0 + k) * in + d) + PREFETCH_BYTES);
      const vec a = load_vec(sp + (k0 + k) * in + d);
      for (int i = 0; i < ROW_BLOCK; ++i) acc[k][i] += a * xv[i];
    }
  }
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < ROW_BLOCK; ++i) {
      float sum = hsum(acc[k][i]);
      for (int64_t t = d; t < in; ++t) sum += to_float(sp[(k0 + k) * in + t]) * xr[i * in + t];
      v[i * rank + k0 + k] = sum * scale;
    }
}

#ifdef __AVX512BF16__
// shrink_block for bf16 on a CPU with AVX512-BF16: S and the rows of x read as they are, 32 values
// a load, each pair of products summed into float32 by one dpbf16 (no widening, half the steps).
// ``xr``: the ROW_BLOCK rows' starts (a short block repeats a row; its sums go unused).
template <int K>
void shrink_block_bf16(const c10::BFloat16* sp, const c10::BFloat16* const* xr, int64_t in, int64_t k0,
                       int64_t rank, float scale, float* v) {
  __m512 acc[K][ROW_BLOCK];
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < ROW_BLOCK; ++i) acc[k][i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= in; d += 32) {
    __m512bh xv[ROW_BLOCK];
    for (int i = 0; i < ROW_BLOCK; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(xr[i] + d);
    for (int k = 0; k < K; ++k) {
      const c10::BFloat16* row = sp + (k0 + k) * in + d;
      __builtin_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_BYTES);
      const __m512bh a = (__m512bh)_mm512_loadu_si512(row);
      for (int i = 0; i < ROW_BLOCK; ++i) acc[k][i] = _mm512_dpbf16_ps(acc[k][i], a, xv[i]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < ROW_BLOCK; ++i) {
      float sum = _mm512_reduce_add_ps(acc[k][i]);
      for (int64_t t = d; t < in; ++t) sum += to_float(sp[(k0 + k) * in + t]) * to_float(xr[i][t]);
      v[i * rank + k0 + k] = sum * scale;
    }
}
#endif

// The rows of one slot: v = scale * S x (x widened to float32 once, in ``xf``), then
// y += E^T v, ROW_BLOCK rows and COL_BLOCK vectors of columns at a time, rounded once to T.
template <typename T>
void delta_group(T* ys, int64_t y_row, const T* xs, int64_t x_row, int64_t in, const at::Tensor& shrink,
                 const at::Tensor& expand, float scale, const int64_t* rows, int64_t n, int64_t offset,
                 std::vector<float>& xf, std::vector<float>& v) {
  const int64_t rank = shrink.size(0), out = expand.size(1);
  const T* sp = shrink.data_ptr<T>();
  const T* ep = expand.data_ptr<T>();
  const int64_t padded = (n + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;  // whole blocks: sums in registers
  v.resize(padded * rank);
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
      const T* xr[ROW_BLOCK];
      for (int i = 0; i < ROW_BLOCK; ++i) xr[i] = xs + rows[std::min<int64_t>(r0 + i, n - 1)] * x_row;
      int64_t k = 0;
      for (; k + RANK_BLOCK <= rank; k += RANK_BLOCK)
        shrink_block_bf16<RANK_BLOCK>(sp, xr, in, k, rank, scale, v.data() + r0 * rank);
      for (; k < rank; ++k) shrink_block_bf16<1>(sp, xr, in, k, rank, scale, v.data() + r0 * rank);
    }
  } else
#endif
  {
    xf.assign(padded * in, 0.0f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < in; ++d) xf[r * in + d] = to_float(xs[rows[r] * x_row + d]);
    for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
      int64_t k = 0;
      for (; k + RANK_BLOCK <= rank; k += RANK_BLOCK)
        shrink_block<RANK_BLOCK>(sp, xf.data() + r0 * in, in, k, rank, scale, v.data() + r0 * rank);
      for (; k < rank; ++k) shrink_block<1>(sp, xf.data() + r0 * in, in, k, rank, scale, v.data() + r0 * rank);
    }
  }
  for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
    const int64_t m = std::min<int64_t>(ROW_BLOCK, n - r0);
    const float* vr = v.data() + r0 * rank;
    int64_t j = 0;
    for (; j + COL_BLOCK * W <= out; j += COL_BLOCK * W) {
      vec acc[ROW_BLOCK][COL_BLOCK] = {};
      for (int64_t k = 0; k < rank; ++k) {
        __builtin_prefetch(reinterpret_cast<const char*>(ep + k * out + j) + PREFETCH_BYTES);
        __builtin_prefetch(reinterpret_cast<const char*>(ep + k * out + j) + PREFETCH_BYTES + 64);
        vec e[COL_BLOCK];
        for (int c = 0; c < COL_BLOCK; ++c) e[c] = load_vec(ep + k * out + j + c * W);
        for (int i = 0; i < ROW_BLOCK; ++i) {
          const vec vk = splat(vr[i * rank + k]);
          for (int c = 0; c < COL_BLOCK; ++c) acc[i][c] += e[c] * vk;
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        T* yt = ys + rows[r0 + i] * y_row + offset + j;
        for (int c = 0; c < COL_BLOCK; ++c) store_vec(yt + c * W, round_vec<T>(load_vec(yt + c * W) + acc[i][c]));
      }
    }
    for (int64_t i = 0; i < m; ++i) {  // the columns left over (out is not a multiple of the block)
      T* yt = ys + rows[r0 + i] * y_row + offset;
      for (int64_t c = j; c < out; ++c) {
        float sum = to_float(yt[c]);
        for (int64_t k = 0; k < rank; ++k) sum += to_float(ep[k * out + c]) * vr[i * rank + k];
        yt[c] = store_as<T>(round_as<T>(sum));
      }
    }
  }
}

// The groups' rows in pieces of at most PIECE_ROWS (a piece reads its adapter once), for every
// part, the pieces shared among the threads: a decode step's slots, or one slot's many rows.
template <typename T>
void delta_groups(at::Tensor& y, const at::Tensor& x, at::TensorList shrink, at::TensorList expand,
                  const std::vector<double>& scale, const std::vector<std::vector<int64_t>>& groups,
                  at::IntArrayRef offsets) {
  struct Piece {
    int64_t part, slot, begin, count;
  };
  const int64_t num_slots = static_cast<int64_t>(groups.size());
  std::vector<Piece> pieces;
  for (int64_t p = 0; p < static_cast<int64_t>(offsets.size()); ++p)
    for (int64_t s = 0; s < num_slots; ++s) {
      if (!shrink[p * num_slots + s].numel()) continue;  // this adapter leaves this part alone
      for (size_t b = 0; b < groups[s].size(); b += PIECE_ROWS)
        pieces.push_back({p, s, static_cast<int64_t>(b),
                          std::min<int64_t>(PIECE_ROWS, static_cast<int64_t>(groups[s].size() - b))});
    }
  T* ys = y.data_ptr<T>();
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf, v;
    for (int64_t i = begin; i < end; ++i) {
      const Piece& p = pieces[i];
      const int64_t w = p.part * num_slots + p.slot;
      delta_group<T>(ys, y.stride(0), xs, x.stride(0), x.size(1), shrink[w], expand[w], static_cast<float>(scale[w]),
                     groups[p.slot].data() + p.begin, p.count, offsets[p.part], xf, v);
    }
  });
}

void lora_delta_(at::Tensor& y, const at::Tensor& x, at::TensorList shrink, at::TensorList expand,
                 at::ArrayRef<double> scale, const at::Tensor& row_slot, at::IntArrayRef offsets) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, in] and y [T, out] expected");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must be contiguous");
  const int64_t parts = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(parts > 0 && shrink.size() % parts == 0, "one S, E and scale per part and slot");
  TORCH_CHECK(shrink.size() == expand.size() && shrink.size() == scale.size(), "one S, E and scale per slot");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.numel() == x.size(0), "a slot per row");
  const auto slots = row_slot.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rows = x.size(0), num_slots = static_cast<int64_t>(shrink.size()) / parts;
  for (int64_t w = 0; w < parts * num_slots; ++w) {
    const at::Tensor &sh = shrink[w], &ex = expand[w];
    if (!sh.numel()) continue;
    TORCH_CHECK(sh.scalar_type() == x.scalar_type() && ex.scalar_type() == x.scalar_type(), "dtypes differ");
    TORCH_CHECK(sh.is_contiguous() && ex.is_contiguous() && sh.size(1) == x.size(1), "S must be [r, in]");
    TORCH_CHECK(ex.size(0) == sh.size(0) && offsets[w / num_slots] + ex.size(1) <= y.size(1), "E must be [r, out]");
  }
  std::vector<double> scales(scale.begin(), scale.end());
  std::vector<std::vector<int64_t>> groups(num_slots);  // each slot's rows
  bool grouped = false;
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] >= 0 && slot[t] < num_slots) {
      groups[slot[t]].push_back(t);
      grouped = true;
    }
  if (!grouped) return;
  if (x.scalar_type() == at::kFloat) {
    delta_groups<float>(y, x, shrink, expand, scales, groups, offsets);
  } else if (x.scalar_type() == at::kBFloat16) {
    delta_groups<c10::BFloat16>(y, x, shrink, expand, scales, groups, offsets);
  } else {
    TORCH_CHECK(false, "lora_delta_: float32 or bfloat16 only, got ", x.scalar_type());
  }
}

}  // namespace
}  // namespace tokenfleet

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def(
      "lora_delta_(Tensor(a!) y, Tensor x, Tensor[] shrink, Tensor[] expand, float[] scale, "
      "Tensor row_slot, int[] offsets) -> ()");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) { m.impl("lora_delta_", &tokenfleet::lora_delta_); }
