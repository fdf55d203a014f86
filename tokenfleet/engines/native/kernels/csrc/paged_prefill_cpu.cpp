// Causal prefill attention for the CPU, over prompts laid end to end: each prompt's tokens attend
// to its own earlier tokens, with no padding to the batch's longest prompt, no [L, L] mask, and no
// scores computed above the diagonal, where SDPA on the same work pads and masks; this runs register-blocked dot products (AVX512-BF16 pairs on bf16 where the CPU has them,
// float32 FMAs otherwise), or on AMX CPUs in bf16 tile multiplies, and skips the upper triangle.
//
// Registered as tokenfleet::paged_prefill, which also writes the prompts' K/V into the pool.
// A prompt may begin with tokens whose K/V the pool already holds (a cached prefix): its packed
// tokens are then the rest, at positions cached[b] + i, and attend to the cached ones too, read
// through its block table.
//
// Layouts:
//   query        [1, H, N, D]        the packed prompts' queries (any strides)
//   key, value   [1, KVH, N, D]      their keys and values (any strides)
//   k_cache      [NB, BS, KVH, D]    one layer of the pool (v_cache the same), contiguous
//   write_blocks [N], write_offsets [N] int64: where each token's key/value go
//   starts       [B + 1] int64       prompt b is packed tokens starts[b] .. starts[b + 1]
//   block_tables [B, max_blocks]     int64, optional: each prompt's blocks (with cached)
//   cached       [B] int64           optional: tokens each prompt has in the pool before its own
//   returns      [1, N, H, D]        the layout Hugging Face attention functions return
// Work is split over (prompt, kv head, block of query rows); D must be a multiple of 16.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// Whether bf16 prefill may take the AMX tile path (where the CPU has it): prefill_tiles() sets it.
static std::atomic<bool> tiles_allowed{true};

bool prefill_tiles(bool enabled) { return tiles_allowed.exchange(enabled); }

namespace {

using tokenfleet::load;
using tokenfleet::store;
using tokenfleet::vec;
using tokenfleet::W;
constexpr int64_t ROWS = 4;         // query rows per register block
constexpr int64_t TASK_ROWS = 256;  // query rows per parallel task (each loads the keys up to its last row)

// --- float32 path: any CPU, any dtype (bf16 and fp16 inputs widened) ---------------------------

// s[r][t0 .. t0 + J*W) = scale * q[r] . kt[:, t], for ROWS query rows; kt is [D][ld] (keys transposed).
template <int J>
inline void score_block(const float* q, int64_t d_len, const float* kt, int64_t ld, int64_t t0, float* s,
                        float scale) {
  vec acc[ROWS][J] = {};
  for (int64_t d = 0; d < d_len; ++d) {
    vec k[J];
    for (int j = 0; j < J; ++j) k[j] = load(kt + d * ld + t0 + j * W);
    for (int r = 0; r < ROWS; ++r) {
      const float qv = q[r * d_len + d];
      for (int j = 0; j < J; ++j) acc[r][j] += qv * k[j];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) store(s + r * ld + t0 + j * W, acc[r][j] * scale);
}

// o[r][d0 .. d0 + J*W) = sum_t p[r][t] * v[t][d], for ROWS rows over t < n; v is [n][D].
template <int J>
inline void value_block(const float* p, int64_t p_ld, int64_t n, const float* v, int64_t d_len, int64_t d0,
                        float* o) {
  vec acc[ROWS][J] = {};
  for (int64_t t = 0; t < n; ++t) {
    vec x[J];
    for (int j = 0; j < J; ++j) x[j] = load(v + t * d_len + d0 + j * W);
    for (int r = 0; r < ROWS; ++r) {
      const float pv = p[r * p_ld + t];
      for (int j = 0; j < J; ++j) acc[r][j] += pv * x[j];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) store(o + r * d_len + d0 + j * W, acc[r][j]);
}

// Vectors per register block: the ROWS x J accumulators, J keys and a broadcast query must fit
// the registers: 32 with AVX-512 (J = 4), 16 with AVX2 (J = 2; the AVX-512 blocking spills there).
#ifdef __AVX512F__
constexpr int MAX_J = 4;
#else
constexpr int MAX_J = 2;
#endif

// Calls block<J>(offset) over [0, width) in steps of MAX_J vectors, then the rest (widths are
// multiples of W).
template <typename Block>
inline void over_vectors(int64_t width, Block&& block) {
  int64_t x = 0;
  for (; x + MAX_J * W <= width; x += MAX_J * W) block.template operator()<MAX_J>(x);
  switch ((width - x) / W) {
    case 3: if constexpr (MAX_J > 3) block.template operator()<3>(x); break;
    case 2: if constexpr (MAX_J > 2) block.template operator()<2>(x); break;
    case 1: if constexpr (MAX_J > 1) block.template operator()<1>(x); break;
    default: break;
  }
}

// Rows of a head are a stride apart (the model's [N, heads * D] projections, viewed per head): the
// hardware prefetcher does not run ahead of such reads on its own.
constexpr int64_t PREFETCH_AHEAD = 4;  // rows

template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < elements * static_cast<int64_t>(sizeof(T)); byte += 64) __builtin_prefetch(p + byte);
}

template <typename T>
struct Float32Path {
  int64_t d_len, ld = 0;
  std::vector<float> kt, v, q;

  explicit Float32Path(int64_t d) : d_len(d), q(ROWS * d) {}

  // keys transposed ([D][ld]) and values ([ld][D]) of the first n tokens, zeros past them
  void load_keys_values(const T* k, int64_t k_tok, int64_t k_dim, const T* x, int64_t v_tok, int64_t v_dim,
                        int64_t n, int64_t width) {
    ld = width;
    kt.assign(d_len * ld, 0.0f);
    v.assign(ld * d_len, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      prefetch_row(k + (t + PREFETCH_AHEAD) * k_tok, d_len * k_dim);
      prefetch_row(x + (t + PREFETCH_AHEAD) * v_tok, d_len * v_dim);
      for (int64_t d = 0; d < d_len; ++d) {
        kt[d * ld + t] = tokenfleet::to_float(k[t * k_tok + d * k_dim]);
        v[t * d_len + d] = tokenfleet::to_float(x[t * v_tok + d * v_dim]);
      }
    }
  }

  void load_query(int64_t r, const T* src, int64_t q_dim) {
    for (int64_t d = 0; d < d_len; ++d) q[r * d_len + d] = tokenfleet::to_float(src[d * q_dim]);
  }

  void scores(int64_t width, float* s, float scale) {
    over_vectors(width, [&]<int J>(int64_t t0) { score_block<J>(q.data(), d_len, kt.data(), ld, t0, s, scale); });
  }

  void values(const float* p, int64_t n, float* o) {
    over_vectors(d_len, [&]<int J>(int64_t d0) { value_block<J>(p, ld, n, v.data(), d_len, d0, o); });
  }
};

#ifdef __AVX512BF16__
// --- bf16 path: AVX512-BF16 dot products (two multiply-adds per lane), float32 sums ---------------
// The matmuls take bf16 inputs with float32 accumulation, as SDPA's do on bf16 tensors: keys are
// stored as pairs of head dims per lane ([D/2][ld] words), values as pairs of tokens per lane
// ([ld/2][D] words), probabilities rounded to bf16 before multiplying the values.

inline __m512 dot_pairs(__m512 acc, uint32_t a, const uint32_t* b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)),
                          (__m512bh)_mm512_loadu_si512(b));
}

template <int J>
inline void score_block_bf16(const uint32_t* q, int64_t pairs, const uint32_t* kp, int64_t ld, int64_t t0, float* s,
                             float scale) {
  __m512 acc[ROWS][J];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i)
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = dot_pairs(acc[r][j], q[r * pairs + i], kp + i * ld + t0 + j * W);
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(s + r * ld + t0 + j * W, _mm512_mul_ps(acc[r][j], _mm512_set1_ps(scale)));
}

template <int J>
inline void value_block_bf16(const uint32_t* p, int64_t p_ld, int64_t pairs, const uint32_t* vp, int64_t d_len,
                             int64_t d0, float* o) {
  __m512 acc[ROWS][J];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i)
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = dot_pairs(acc[r][j], p[r * p_ld + i], vp + i * d_len + d0 + j * W);
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(o + r * d_len + d0 + j * W, acc[r][j]);
}

struct BFloat16Path {
  int64_t d_len, ld = 0;
  std::vector<uint32_t> kp, vp, q, p;  // bf16 pairs

  explicit BFloat16Path(int64_t d) : d_len(d), q(ROWS * d / 2) {}

  static uint32_t pair(const c10::BFloat16* x, int64_t stride) {
    return static_cast<uint32_t>(x[0].x) | static_cast<uint32_t>(x[stride].x) << 16;
  }

  void load_keys_values(const c10::BFloat16* k, int64_t k_tok, int64_t k_dim, const c10::BFloat16* x,
                        int64_t v_tok, int64_t v_dim, int64_t n, int64_t width) {
    ld = width;
    const int64_t pairs = d_len / 2;
    kp.assign(pairs * ld, 0);
    vp.assign(ld / 2 * d_len, 0);
    p.resize(ROWS * ld / 2);
    for (int64_t t = 0; t < n; ++t) {
      prefetch_row(k + (t + PREFETCH_AHEAD) * k_tok, d_len * k_dim);
      for (int64_t i = 0; i < pairs; ++i) kp[i * ld + t] = pair(k + t * k_tok + 2 * i * k_dim, k_dim);
    }
    for (int64_t t = 0; t < n; ++t) {  // token t is half of the word at (t / 2, d)
      prefetch_row(x + (t + PREFETCH_AHEAD) * v_tok, d_len * v_dim);
      uint16_t* half = reinterpret_cast<uint16_t*>(vp.data() + t / 2 * d_len) + t % 2;
      for (int64_t d = 0; d < d_len; ++d) half[2 * d] = x[t * v_tok + d * v_dim].x;
    }
  }

  void load_query(int64_t r, const c10::BFloat16* src, int64_t q_dim) {
    for (int64_t i = 0; i < d_len / 2; ++i) q[r * d_len / 2 + i] = pair(src + 2 * i * q_dim, q_dim);
  }

  void scores(int64_t width, float* s, float scale) {
    over_vectors(width, [&]<int J>(int64_t t0) {
      score_block_bf16<J>(q.data(), d_len / 2, kp.data(), ld, t0, s, scale);
    });
  }

  void values(const float* probs, int64_t n, float* o) {
    const int64_t words = (n + 1) / 2;
    for (int64_t r = 0; r < ROWS; ++r)  // each row's probabilities, rounded to bf16, as pairs of tokens
      for (int64_t t = 0; t < 2 * words; t += 2 * W) {
        const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(probs + r * ld + t + W), _mm512_loadu_ps(probs + r * ld + t));
        _mm512_storeu_si512(p.data() + r * (ld / 2) + t / 2, (__m512i)two);
      }
    over_vectors(d_len, [&]<int J>(int64_t d0) {
      value_block_bf16<J>(p.data(), ld / 2, words, vp.data(), d_len, d0, o);
    });
  }
};
#endif

struct Task {
  int64_t start;       // the prompt's first packed token
  int64_t kv_head;
  int64_t row0, row1;  // the prompt's query rows this task computes
  int64_t context;     // tokens before the prompt's packed ones, in the pool (0: none)
  const int64_t* table;  // the prompt's blocks, where context > 0
};

// Where a task's keys and values come from: the packed tensors (no context), or, with a cached
// context, a copy of the context's rows from the pool followed by the packed rows, contiguous.
template <typename T>
struct KeySource {
  const T *k, *v;
  int64_t k_tok, k_dim, v_tok, v_dim;
  std::vector<T> ks, vs;  // the gathered rows, where there is a context

  void select(const Task& task, const T* key, const at::Tensor& key_t, const T* value, const at::Tensor& value_t,
              const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t d_len) {
    const T* packed_k = key + task.kv_head * key_t.stride(1) + task.start * key_t.stride(2);
    const T* packed_v = value + task.kv_head * value_t.stride(1) + task.start * value_t.stride(2);
    if (task.context == 0) {
      k = packed_k, v = packed_v;
      k_tok = key_t.stride(2), k_dim = key_t.stride(3), v_tok = value_t.stride(2), v_dim = value_t.stride(3);
      return;
    }
    const int64_t ctx = task.context, n = ctx + task.row1, bs = k_cache.size(1), kvh = k_cache.size(2);
    ks.resize(n * d_len);
    vs.resize(n * d_len);
    const T* pool_k = k_cache.data_ptr<T>();
    const T* pool_v = v_cache.data_ptr<T>();
    for (int64_t t = 0; t < ctx; ++t) {  // pool rows are contiguous over the head dims
      const int64_t row = ((task.table[t / bs] * bs + t % bs) * kvh + task.kv_head) * d_len;
      std::memcpy(ks.data() + t * d_len, pool_k + row, d_len * sizeof(T));
      std::memcpy(vs.data() + t * d_len, pool_v + row, d_len * sizeof(T));
    }
    for (int64_t t = ctx; t < n; ++t)
      for (int64_t d = 0; d < d_len; ++d) {
        ks[t * d_len + d] = packed_k[(t - ctx) * key_t.stride(2) + d * key_t.stride(3)];
        vs[t * d_len + d] = packed_v[(t - ctx) * value_t.stride(2) + d * value_t.stride(3)];
      }
    k = ks.data(), v = vs.data();
    k_tok = v_tok = d_len;
    k_dim = v_dim = 1;
  }
};

// The operator's tensors as pointers, and the sizes both attention paths work with.
template <typename T>
struct Operands {
  int64_t heads, group, d_len;
  const T *q, *k, *v;
  T* out;
  float scale;
  Operands(const at::Tensor& output, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
           double softmax_scale)
      : heads(query.size(1)), group(query.size(1) / key.size(1)), d_len(query.size(3)),
        q(query.data_ptr<T>()), k(key.data_ptr<T>()), v(value.data_ptr<T>()), out(output.data_ptr<T>()),
        scale(static_cast<float>(softmax_scale)) {}
};

#ifdef __AVX512BF16__
// --- bf16 on AMX: tiles of queries and keys through oneDNN's brgemm ------------------------------
// Where the CPU has AMX (cpublas::could_pack), the two matmuls run as tile multiplies: a block of
// QR query rows against KT keys at a time, with the softmax carried across key tiles (running
// max and sum, as flash attention does). Every brgemm call has the same shapes and strides, so
// oneDNN generates two kernels per head size, not one per prompt length. The AMX matmuls are a
// fifth of the time, the softmax and the packing the rest.
constexpr int64_t QR = 32;  // query rows per block
constexpr int64_t KT = 64;  // keys per tile

// keys of tile j as [D/2][KT][2] (pairs of head dims: brgemm's VNNI layout for K^T) and values
// as [KT/2][D][2] (pairs of tokens), zeros past the task's n tokens. Head dims are contiguous
// (d_stride 1: the model's [N, heads * D] projections viewed per head).
inline void pack_tiles(std::vector<c10::BFloat16>& kt, std::vector<c10::BFloat16>& vt, const c10::BFloat16* k,
                       int64_t k_tok, const c10::BFloat16* v, int64_t v_tok, int64_t n, int64_t d_len) {
  const int64_t tiles = (n + KT - 1) / KT, pairs = d_len / 2;
  kt.resize(tiles * KT * d_len);
  vt.resize(tiles * KT * d_len);
  const int64_t tail = tiles * KT - n;  // the last tile's unused keys: zeros
  if (tail) {
    uint32_t* last = reinterpret_cast<uint32_t*>(kt.data()) + (tiles - 1) * KT * pairs;
    for (int64_t i = 0; i < pairs; ++i) std::memset(last + i * KT + (KT - tail), 0, tail * sizeof(uint32_t));
    std::memset(vt.data() + n / 2 * 2 * d_len, 0, (tiles * KT - n / 2 * 2) * d_len * sizeof(c10::BFloat16));
  }
  for (int64_t t = 0; t < n; ++t) {  // keys: token t's pairs to column t % KT of its tile
    prefetch_row(k + (t + PREFETCH_AHEAD) * k_tok, d_len);
    const uint32_t* src = reinterpret_cast<const uint32_t*>(k + t * k_tok);
    uint32_t* dst = reinterpret_cast<uint32_t*>(kt.data()) + (t / KT) * KT * pairs + t % KT;
    for (int64_t i = 0; i < pairs; ++i) dst[i * KT] = src[i];
  }
  // values: tokens t and t + 1 interleaved, 16 head dims (32 bf16) per register
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < n; t += 2) {
    prefetch_row(v + (t + 2 + PREFETCH_AHEAD) * v_tok, d_len);
    const c10::BFloat16* a = v + t * v_tok;
    c10::BFloat16* dst = vt.data() + t / 2 * 2 * d_len;
    for (int64_t d = 0; d < d_len; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(a + v_tok + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// One block of query rows (q: [QR][D], rows past `rows` repeat the last) against the task's key
// tiles: o[r] = softmax(scale * q[r] . keys 0 .. first_row + r) . values, written to out rows.
inline void attend_block(const c10::BFloat16* q, int64_t first_row, int64_t rows, int64_t d_len, float scale,
                         const c10::BFloat16* kt, const c10::BFloat16* vt, float* s, c10::BFloat16* p, float* o,
                         c10::BFloat16* out, int64_t out_row_stride) {
  float mx[QR], sum[QR];
  std::fill(mx, mx + QR, -3.0e38f);
  std::fill(sum, sum + QR, 0.0f);
  std::fill(o, o + QR * d_len, 0.0f);
  const int64_t last_key = first_row + rows - 1;
  for (int64_t j = 0; j * KT <= last_key; ++j) {
    at::native::cpublas::brgemm(QR, KT, d_len, d_len, KT, KT, false, q, kt + j * KT * d_len, s);
    for (int64_t r = 0; r < QR; ++r) {
      float* row = s + r * KT;
      c10::BFloat16* prow = p + r * KT;
      // causal: keys up to this row (a padding row repeats the block's last)
      const int64_t keys = std::clamp(first_row + std::min(r, rows - 1) + 1 - j * KT, int64_t{0}, KT);
      __m512 x[KT / 16];
      __mmask16 valid[KT / 16];
      __m512 top = _mm512_set1_ps(-3.0e38f);
      for (int64_t c = 0; c < KT / 16; ++c) {
        valid[c] = keys >= 16 * (c + 1) ? 0xFFFF : keys <= 16 * c ? 0 : (1u << (keys - 16 * c)) - 1;
        x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-3.0e38f), valid[c], _mm512_loadu_ps(row + 16 * c), _mm512_set1_ps(scale));
        top = _mm512_max_ps(top, x[c]);
      }
      const float m = std::max(mx[r], _mm512_reduce_max_ps(top));
      const float alpha = tokenfleet::exp_nonpositive(tokenfleet::splat(mx[r] - m))[0];  // rescales earlier tiles
      __m512 total = _mm512_setzero_ps();
      for (int64_t c = 0; c < KT / 16; c += 2) {
        // exp(x - m) rounded to bf16, zero past the causal limit; the sum is of the rounded
        // probabilities, as the values see them
        const vec e0 = tokenfleet::exp_nonpositive(reinterpret_cast<const vec&>(x[c]) - m);
        const vec e1 = tokenfleet::exp_nonpositive(reinterpret_cast<const vec&>(x[c + 1]) - m);
        const __m512i bits = _mm512_maskz_mov_epi16(
            static_cast<__mmask32>(valid[c]) | static_cast<__mmask32>(valid[c + 1]) << 16,
            (__m512i)_mm512_cvtne2ps_pbh(reinterpret_cast<const __m512&>(e1), reinterpret_cast<const __m512&>(e0)));
        _mm512_storeu_si512(prow + 16 * c, bits);
        // back to float: the low and high halves of each word
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF0000))));
      }
      sum[r] = sum[r] * alpha + _mm512_reduce_add_ps(total);
      mx[r] = m;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < d_len; d += 16)
          _mm512_storeu_ps(o + r * d_len + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * d_len + d), _mm512_set1_ps(alpha)));
    }
    at::native::cpublas::brgemm(QR, d_len, KT, KT, d_len, d_len, true, p, vt + j * KT * d_len, o);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
    c10::BFloat16* dst = out + r * out_row_stride;
    for (int64_t d = 0; d < d_len; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * d_len + d), inv)));
  }
}

// Causal attention of every task's rows in tiles (bf16, AMX).
void attend_tiles(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Task>& tasks, double scale) {
  using T = c10::BFloat16;
  const Operands<T> x(out, query, key, value, scale);
  const int64_t heads = x.heads, group = x.group, d_len = x.d_len;
  const int64_t q_tok = query.stride(2);

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> kt, vt, q(QR * d_len), p(QR * KT);
    std::vector<float> s(QR * KT), o(QR * d_len);
    KeySource<T> src;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      src.select(task, x.k, key, x.v, value, k_cache, v_cache, d_len);
      pack_tiles(kt, vt, src.k, src.k_tok, src.v, src.v_tok, task.context + task.row1, d_len);
      for (int64_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
        const T* qh = x.q + h * query.stride(1) + task.start * q_tok;
        for (int64_t r0 = task.row0; r0 < task.row1; r0 += QR) {
          const int64_t rows = std::min(QR, task.row1 - r0);
          for (int64_t r = 0; r < QR; ++r)
            std::memcpy(q.data() + r * d_len, qh + (r0 + std::min(r, rows - 1)) * q_tok, d_len * sizeof(T));
          attend_block(q.data(), task.context + r0, rows, d_len, x.scale, kt.data(), vt.data(), s.data(), p.data(),
                       o.data(), x.out + ((task.start + r0) * heads + h) * d_len, heads * d_len);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

// The tile path: bf16 on a CPU with AMX, head sizes a multiple of 32 (the value packing's
// register), unless prefill_tiles(False) turned it off (tests compare the paths).
bool use_tiles(int64_t head_dim) {
  static const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
  return amx && head_dim % 32 == 0 && tiles_allowed.load();
}
#endif  // __AVX512BF16__

// Causal attention of every task's rows, with the arithmetic of Path.
template <typename T, typename Path>
void attend(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
            const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Task>& tasks, double scale) {
  const Operands<T> x(out, query, key, value, scale);
  const int64_t heads = x.heads, group = x.group, d_len = x.d_len;

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Path path(d_len);
    std::vector<float> s, o(ROWS * d_len);
    KeySource<T> src;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t ctx = task.context;
      const int64_t n = ctx + task.row1;  // keys this task needs: the context and the first row1 tokens
      const int64_t ld = (n + ROWS + 2 * W - 1) / (2 * W) * (2 * W);  // room for the last block's overhang
      src.select(task, x.k, key, x.v, value, k_cache, v_cache, d_len);
      path.load_keys_values(src.k, src.k_tok, src.k_dim, src.v, src.v_tok, src.v_dim, n, ld);
      s.assign(ROWS * ld, 0.0f);
      for (int64_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
        for (int64_t r0 = task.row0; r0 < task.row1; r0 += ROWS) {
          const int64_t rows = std::min(ROWS, task.row1 - r0);
          const T* next =
              x.q + h * query.stride(1) + (task.start + std::min(r0 + ROWS, task.row1 - 1)) * query.stride(2);
          for (int64_t r = 0; r < ROWS; ++r) prefetch_row(next + r * query.stride(2), d_len * query.stride(3));
          for (int64_t r = 0; r < ROWS; ++r)  // rows past the task's end repeat its last row, unused
            path.load_query(r, x.q + h * query.stride(1) + (task.start + r0 + std::min(r, rows - 1)) * query.stride(2),
                            query.stride(3));
          const int64_t width = (ctx + r0 + ROWS + W - 1) / W * W;  // keys up to the block's last row
          path.scores(width, s.data(), x.scale);
          float inv[ROWS];
          for (int64_t r = 0; r < ROWS; ++r) {  // causal softmax of row r0 + r: keys 0 .. ctx + r0 + r
            float* row = s.data() + r * ld;
            const int64_t keys = ctx + r0 + r + 1;
            inv[r] = 1.0f / tokenfleet::exp_shifted(row, keys);
            std::fill(row + keys, row + width, 0.0f);
          }
          path.values(s.data(), std::min(ctx + r0 + ROWS, ld), o.data());
          for (int64_t r = 0; r < rows; ++r) {
            T* dst = x.out + ((task.start + r0 + r) * heads + h) * d_len;
            for (int64_t d = 0; d < d_len; ++d) dst[d] = static_cast<T>(o[r * d_len + d] * inv[r]);
          }
        }
      }
    }
  });
}

}  // namespace

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& write_blocks, const at::Tensor& write_offsets,
                         const at::Tensor& starts, double scale, const std::optional<at::Tensor>& block_tables,
                         const std::optional<at::Tensor>& cached) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1, "query must be [1, H, N, D]");
  TORCH_CHECK(key.dim() == 4 && key.size(0) == 1 && key.sizes() == value.sizes(), "key/value must be [1, KVH, N, D]");
  TORCH_CHECK(key.size(2) == query.size(2) && key.size(3) == query.size(3), "query and key tokens/dims differ");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(3) % W == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key dtypes differ");
  // the packed tokens as rows [N, KVH, 1, D] for the pool
  tokenfleet::write_step(k_cache, v_cache, key[0].transpose(0, 1).unsqueeze(2), value[0].transpose(0, 1).unsqueeze(2),
                         write_blocks, write_offsets);
  auto bounds = starts.to(at::kLong).contiguous();
  const int64_t* b = bounds.data_ptr<int64_t>();
  const int64_t prompts = bounds.numel() - 1, tokens = query.size(2);
  TORCH_CHECK(prompts >= 0 && b[0] == 0 && b[prompts] == tokens, "starts must run from 0 to the token count");
  TORCH_CHECK(block_tables.has_value() == cached.has_value(), "block_tables and cached go together");
  at::Tensor tables, context;
  if (cached.has_value()) {
    tables = block_tables->to(at::kLong).contiguous();
    context = cached->to(at::kLong).contiguous();
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == prompts && context.numel() == prompts,
                "block_tables must be [B, max_blocks] and cached [B]");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  }
  std::vector<Task> tasks;
  for (int64_t p = 0; p < prompts; ++p) {
    const int64_t len = b[p + 1] - b[p];
    TORCH_CHECK(len >= 0, "starts must not decrease");
    const int64_t ctx = cached.has_value() ? context.data_ptr<int64_t>()[p] : 0;
    const int64_t* table = cached.has_value() ? tables.data_ptr<int64_t>() + p * tables.size(1) : nullptr;
    TORCH_CHECK(ctx >= 0 && (ctx == 0 || (ctx + k_cache.size(1) - 1) / k_cache.size(1) <= tables.size(1)),
                "a prompt's cached tokens must lie in its block table");
    for (int64_t g = 0; g < key.size(1); ++g)
      for (int64_t r = 0; r < len; r += TASK_ROWS) tasks.push_back({b[p], g, r, std::min(len, r + TASK_ROWS), ctx, table});
  }
  auto out = at::empty({1, tokens, query.size(1), query.size(3)}, query.options());
  switch (query.scalar_type()) {
    case at::kFloat: attend<float, Float32Path<float>>(out, query, key, value, k_cache, v_cache, tasks, scale); break;
#ifdef __AVX512BF16__
    case at::kBFloat16:
      if (use_tiles(query.size(3)) && query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1)
        attend_tiles(out, query, key, value, k_cache, v_cache, tasks, scale);
      else
        attend<c10::BFloat16, BFloat16Path>(out, query, key, value, k_cache, v_cache, tasks, scale);
      break;
#else
    case at::kBFloat16:
      attend<c10::BFloat16, Float32Path<c10::BFloat16>>(out, query, key, value, k_cache, v_cache, tasks, scale);
      break;
#endif
    case at::kHalf:
      attend<c10::Half, Float32Path<c10::Half>>(out, query, key, value, k_cache, v_cache, tasks, scale);
      break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def(
      "paged_prefill(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor write_blocks, Tensor write_offsets, Tensor starts, float scale, Tensor? block_tables=None, "
      "Tensor? cached=None) -> Tensor");
  m.def("prefill_tiles(bool enabled) -> bool", &prefill_tiles);
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
