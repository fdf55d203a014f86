// Paged decode attention for the CPU: each new query attends to its sequence's keys and values
// read in place from the block pool, so a decode step reads the KV cache once instead of copying
// it into a contiguous batch first (the gather costs about as much as the attention itself).
//
// Registered as the operator tokenfleet::paged_decode, which also writes the step's new K/V into
// the pool: one C++ call per layer and step, with no Python in between, which is what a compiled
// decode graph calls (a Python custom op per layer cost a large share of a small model's step).
//
// Layouts (see tokenfleet/kvcache/store.py):
//   query        [B, H, 1, D]         this step's query, one token per sequence (any strides)
//   key, value   [B, KVH, 1, D]       this step's new key and value (any strides)
//   k_cache      [NB, BS, KVH, D]     one layer of the pool (v_cache the same), contiguous
//   write_blocks [B], write_offsets [B] int64: where the new key/value of each sequence go
//   block_tables [B, MB] int64        the blocks of each sequence, in order
//   lengths      [B] int64            tokens each sequence attends to (its new token included)
//   returns      [B, 1, H, D]         the layout Hugging Face attention functions return
// Work is split over sequences; query head h reads kv head h / (H / KVH) (GQA). Sums and the
// softmax are in float32, as SDPA does for bf16 inputs.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <omp.h>

// The vector paths: bf16 q . k on VDPBF16PS with AVX512-BF16; otherwise (AVX-512 or AVX2 and FMA)
// float32 FMAs on float32 keys or bf16 keys widened (a shift). All read the pool in memory order.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENFLEET_DECODE_AVX512 1
#define TOKENFLEET_DECODE_VECTORS 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENFLEET_DECODE_AVX2 1
#define TOKENFLEET_DECODE_VECTORS 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using tokenfleet::to_float;

// Plain loops over one head's row, for head sizes and dtypes the vector paths leave alone.
template <int64_t D, typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.0f;
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < n; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <int64_t D, typename T>
inline void axpy(float p, const T* v, float* acc, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  for (int64_t i = 0; i < n; ++i) acc[i] += p * to_float(v[i]);
}

// The vector paths (defined below when the compiler targets AVX-512 or AVX2; called for bf16 and
// float32 caches whose head size fills whole registers, kVectors). The plain loops sum q . k one
// float at a time (the compiler may not reorder a float sum to vectorize it): on a float32 cache
// they ran the keys at a quarter of the vector paths' speed.
#if defined(TOKENFLEET_DECODE_AVX512)
template <typename T, int64_t D>
constexpr bool kVectors = D > 0 && (std::is_same_v<T, c10::BFloat16> ? D % 32 == 0 : std::is_same_v<T, float> && D % 16 == 0);
#elif defined(TOKENFLEET_DECODE_AVX2)
template <typename T, int64_t D>
constexpr bool kVectors = D > 0 && D % 8 == 0 && (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>);
#else
template <typename T, int64_t D>
constexpr bool kVectors = false;
#endif
template <typename T, int64_t D>
void keys_vec(float* scores, const T* q, int64_t q_head, int64_t q_dim, int64_t heads, int64_t group, int64_t len,
              float scale, const T* kc, const int64_t* table, int64_t block_size, int64_t block_stride, int64_t row);
template <typename T, int64_t D>
void values_vec(float* acc, const float* p, int64_t heads, int64_t group, int64_t len, const T* vc,
                const int64_t* table, int64_t block_size, int64_t block_stride, int64_t row);

#if defined(TOKENFLEET_DECODE_AVX512)
// One register of float32 sums, and what the paths below do with it, for each instruction set.
using fvec = __m512;
constexpr int64_t LANES = 16;
inline fvec vzero() { return _mm512_setzero_ps(); }
inline fvec vset1(float x) { return _mm512_set1_ps(x); }
inline fvec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline void vstore_first(float* p, fvec v, int64_t n) {  // lanes 0 .. n - 1 only
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }

// 16 bf16 numbers widened to float32 (exact: a shift).
inline fvec widen(const void* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Lane i of the result: the sum of v[i]'s 16 lanes.
inline fvec reduce(const fvec* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3], x = v[2i], y = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per lane: partial sums of v[4j .. 4j + 3]
    b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(TOKENFLEET_DECODE_AVX2)
using fvec = __m256;
constexpr int64_t LANES = 8;
inline fvec vzero() { return _mm256_setzero_ps(); }
inline fvec vset1(float x) { return _mm256_set1_ps(x); }
inline fvec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline void vstore_first(float* p, fvec v, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane), v);
}
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }

// 8 bf16 numbers widened to float32 (exact: a shift).
inline fvec widen(const void* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Lane i of the result: the sum of v[i]'s 8 lanes.
inline fvec reduce(const fvec* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: [x01, x23, y01, y23], x = v[2i], y = v[2i+1]
    a[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int j = 0; j < 2; ++j)  // per half: the partial sums of v[4j .. 4j + 3], in order
    b[j] = _mm256_hadd_ps(a[2 * j], a[2 * j + 1]);
  // low halves hold lanes 0-3 of each v, high halves lanes 4-7: add them across
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

#if defined(TOKENFLEET_DECODE_VECTORS)
// LANES numbers of the cache as float32: loaded as they are, or bf16 widened.
template <typename T>
inline fvec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) return vload(p);
  else return widen(p);
}

constexpr int64_t CHUNK = LANES;  // tokens the vector paths take at a time (one register of float sums)

// rows[i] = token t0 + i's row of one layer's pool (all KV heads) for the chunk's n tokens, and
// ahead[i] the row of token t0 + CHUNK + i (the next chunk's; the last row again past the end).
// The tokens are consecutive: one division for the chunk, then the block and the offset in it
// step along (a division per token cost more than the dot products of a small model's 2-4 heads).
template <typename T>
void chunk_rows(const T** rows, const T** ahead, const T* cache, const int64_t* table, int64_t t0, int64_t n,
                int64_t len, int64_t block_size, int64_t block_stride, int64_t row) {
  int64_t block = t0 / block_size, offset = t0 - block * block_size;
  const T* last = nullptr;  // the row of min(t, len - 1)
  for (int64_t i = 0; i < 2 * CHUNK; ++i) {
    if (t0 + i < len) {
      last = cache + table[block] * block_stride + offset * row;
      if (++offset == block_size) offset = 0, ++block;
    }
    if (i >= CHUNK) ahead[i - CHUNK] = last;
    else if (i < n) rows[i] = last;
  }
}

// Asks for one row ahead of use, into L2. A sequence's blocks lie anywhere in the pool and the
// hardware prefetcher starts over at each; a row per token read keeps the requests spread out
// (a whole chunk asked at once filled the load queue and stalled the reads it was meant to feed).
template <typename T>
inline void prefetch_row(const T* p, int64_t row) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < row * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(bytes + byte, _MM_HINT_T1);
}

// scores[h * len + t] = scale * q_h . k_t,(h / group) for every head and token of one sequence,
// with dot_head(k, h) returning a register of partial sums of q_h . k (k: one head's key).
// Read token by token, all heads of a token in turn: the order the pool lies in memory (head by
// head, 16 strided streams, ran slower). Each (token, head) leaves a register of partial sums,
// reduced per head after, instead of one horizontal sum per token.
template <typename T, int64_t D, typename DotHead>
void score_chunks(float* scores, int64_t heads, int64_t group, int64_t len, float scale, const T* kc,
                  const int64_t* table, int64_t block_size, int64_t block_stride, int64_t row, DotHead dot_head) {
  std::vector<fvec> part(heads * CHUNK);
  const T* rows[CHUNK];
  const T* ahead[CHUNK];
  for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, len - t0);
    chunk_rows(rows, ahead, kc, table, t0, n, len, block_size, block_stride, row);
    for (int64_t i = 0; i < CHUNK; ++i) {
      prefetch_row(ahead[i], row);
      for (int64_t h = 0; h < heads; ++h) {
        part[h * CHUNK + i] = i < n ? dot_head(rows[i] + (h / group) * D, h) : vzero();
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      vstore_first(scores + h * len + t0, vmul(reduce(part.data() + h * CHUNK), vset1(scale)), n);
  }
}

// The keys' scores (see score_chunks). On bf16 with AVX512-BF16, VDPBF16PS multiplies bf16 pairs
// exactly and sums them in float32, so a head's q . k is D / 32 instructions on the cache's own
// bytes; otherwise D / LANES FMAs on float32 keys, or bf16 keys widened by a shift.
template <typename T, int64_t D>
void keys_vec(float* scores, const T* q, int64_t q_head, int64_t q_dim, int64_t heads,
              int64_t group, int64_t len, float scale, const T* kc, const int64_t* table, int64_t block_size,
              int64_t block_stride, int64_t row) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    constexpr int64_t C = D / 32;  // 32 bf16 per register
    std::vector<__m512bh> qb(heads * C);
    for (int64_t h = 0; h < heads; ++h) {
      alignas(64) T tmp[D];
      for (int64_t d = 0; d < D; ++d) tmp[d] = q[h * q_head + d * q_dim];
      for (int64_t c = 0; c < C; ++c) qb[h * C + c] = (__m512bh)_mm512_load_si512(tmp + 32 * c);
    }
    score_chunks<T, D>(scores, heads, group, len, scale, kc, table, block_size, block_stride, row,
                       [&](const T* k, int64_t h) {
                         __m512 acc = _mm512_setzero_ps();
                         for (int64_t c = 0; c < C; ++c)
                           acc = _mm512_dpbf16_ps(acc, qb[h * C + c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
                         return acc;
                       });
    return;
  }
#endif
  constexpr int64_t C = D / LANES;  // floats per register
  std::vector<fvec> qv(heads * C);
  for (int64_t h = 0; h < heads; ++h) {
    alignas(64) float tmp[D];
    for (int64_t d = 0; d < D; ++d) tmp[d] = to_float(q[h * q_head + d * q_dim]);
    for (int64_t c = 0; c < C; ++c) qv[h * C + c] = vload(tmp + LANES * c);
  }
  // bf16 products are exact in float32: only the order of the sums differs from VDPBF16PS
  score_chunks<T, D>(scores, heads, group, len, scale, kc, table, block_size, block_stride, row,
                     [&](const T* k, int64_t h) {
                       fvec acc = vzero();
                       for (int64_t c = 0; c < C; ++c) acc = vfma(qv[h * C + c], load_float(k + LANES * c), acc);
                       return acc;
                     });
}

#if defined(__AVX512BF16__)
// acc as values_vec's, for bf16 on VDPBF16PS, two tokens at a time: their rows interleaved word
// by word (an unpack), each head's pair of probabilities rounded to bf16, so one instruction adds
// p_t v_t + p_t+1 v_t+1 for 16 dims (SDPA rounds the probabilities to bf16 for its P @ V too).
// A third of the instructions of widening the values and one FMA per token; the unpacks leave the
// dims in a lane-wise order, put back once at the end.
template <int64_t D>
void values_bf16_pairs(float* acc, const float* p, int64_t heads, int64_t group, int64_t len,
                       const c10::BFloat16* vc, const int64_t* table, int64_t block_size, int64_t block_stride,
                       int64_t row) {
  constexpr int64_t C = D / 32;  // 32 bf16 per register
  const int64_t kv_heads = heads / group, stride = len + 1;  // one zero after each head's row: odd lengths
  std::vector<uint16_t> pb(heads * stride, 0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < len; ++t) pb[h * stride + t] = c10::BFloat16(p[h * len + t]).x;
  std::vector<__m512> sums(heads * 2 * C, _mm512_setzero_ps());  // per head: (low, high) per register
  const c10::BFloat16* rows[CHUNK];
  const c10::BFloat16* ahead[CHUNK];
  for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, len - t0);
    chunk_rows(rows, ahead, vc, table, t0, n, len, block_size, block_stride, row);
    for (int64_t i = 0; i < n; i += 2) {  // a lone last token pairs with itself at weight zero
      prefetch_row(ahead[i], row);
      prefetch_row(ahead[i + 1], row);  // i is even, CHUNK too: i + 1 < CHUNK
      const c10::BFloat16* second = i + 1 < n ? rows[i + 1] : rows[i];
      for (int64_t g = 0; g < kv_heads; ++g) {
        __m512i lo[C], hi[C];
        for (int64_t c = 0; c < C; ++c) {
          const __m512i a = _mm512_loadu_si512(rows[i] + g * D + 32 * c);
          const __m512i b = _mm512_loadu_si512(second + g * D + 32 * c);
          lo[c] = _mm512_unpacklo_epi16(a, b), hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          uint32_t pair;
          std::memcpy(&pair, pb.data() + h * stride + t0 + i, sizeof pair);  // p_t low, p_t+1 high
          const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          __m512* sum = sums.data() + h * 2 * C;
          for (int64_t c = 0; c < C; ++c) {
            sum[2 * c] = _mm512_dpbf16_ps(sum[2 * c], (__m512bh)lo[c], weight);
            sum[2 * c + 1] = _mm512_dpbf16_ps(sum[2 * c + 1], (__m512bh)hi[c], weight);
          }
        }
      }
    }
  }
  // 128-bit lane j of the low sums holds dims 8j .. 8j + 3 of its 32, of the high ones 8j + 4 .. 8j + 7
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < C; ++c) {
      alignas(64) float low[16], high[16];
      _mm512_store_ps(low, sums[h * 2 * C + 2 * c]);
      _mm512_store_ps(high, sums[h * 2 * C + 2 * c + 1]);
      float* out = acc + h * D + 32 * c;
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t k = 0; k < 4; ++k) out[8 * j + k] = low[4 * j + k], out[8 * j + 4 + k] = high[4 * j + k];
    }
}
#endif

// acc[h * D ..] = sum_t p[h * len + t] * v_t,(h / group), token by token as the keys are read;
// the sums stay in L1 (widening bf16 is a shift).
template <typename T, int64_t D>
void values_vec(float* acc, const float* p, int64_t heads, int64_t group, int64_t len, const T* vc,
                const int64_t* table, int64_t block_size, int64_t block_stride, int64_t row) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    values_bf16_pairs<D>(acc, p, heads, group, len, vc, table, block_size, block_stride, row);
    return;
  }
#endif
  constexpr int64_t C = D / LANES;  // floats per register
  std::fill(acc, acc + heads * D, 0.0f);
  const T* rows[CHUNK];
  const T* ahead[CHUNK];
  for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, len - t0);
    chunk_rows(rows, ahead, vc, table, t0, n, len, block_size, block_stride, row);
    for (int64_t i = 0; i < n; ++i) {  // token by token, as the keys: memory order
      prefetch_row(ahead[i], row);
      for (int64_t h = 0; h < heads; ++h) {
        const fvec weight = vset1(p[h * len + t0 + i]);
        const T* v_row = rows[i] + (h / group) * D;
        float* sum = acc + h * D;
        for (int64_t c = 0; c < C; ++c)
          vstore(sum + LANES * c, vfma(weight, load_float(v_row + LANES * c), vload(sum + LANES * c)));
      }
    }
  }
}
#endif

template <typename T, int64_t D>
void attend(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  const int64_t batch = query.size(0), heads = query.size(1), head_dim = query.size(3);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t q_batch = query.stride(0), q_head = query.stride(1), q_dim = query.stride(3);
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t row = kv_heads * head_dim;  // one token's keys (all heads): contiguous
  const int64_t block_stride = block_size * row;
  const float fscale = static_cast<float>(scale);

  // One sequence per task; its keys are read token by token, all heads of a token at once, so the
  // pool streams through memory in order. Tasks go out in shrinking runs (guided): a thread the
  // OS preempts holds up only the run it has, not a static share.
#pragma omp parallel if (batch > 1 && !omp_in_parallel())
  {
    std::vector<float> qf(heads * head_dim), acc(heads * head_dim), scores;
#pragma omp for schedule(guided)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens[b];
      scores.resize(heads * len);
      if constexpr (!kVectors<T, D>)  // the vector paths read the query as it is
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < head_dim; ++d)
            qf[h * head_dim + d] = to_float(q[b * q_batch + h * q_head + d * q_dim]) * fscale;

      if constexpr (kVectors<T, D>) {
        keys_vec<T, D>(scores.data(), q + b * q_batch, q_head, q_dim, heads, group, len, fscale, kc,
                       tables + b * max_blocks, block_size, block_stride, row);
      } else {
        for (int64_t t = 0; t < len; ++t) {  // scores[h][t] = q_h . k_t,(h / group)
          const T* k = kc + tables[b * max_blocks + t / block_size] * block_stride + (t % block_size) * row;
          for (int64_t h = 0; h < heads; ++h)
            scores[h * len + t] = dot<D>(qf.data() + h * head_dim, k + (h / group) * head_dim, head_dim);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {  // softmax per head
        float* s = scores.data() + h * len;
        const float sum = tokenfleet::exp_shifted(s, len);
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      if constexpr (kVectors<T, D>) {
        values_vec<T, D>(acc.data(), scores.data(), heads, group, len, vc, tables + b * max_blocks, block_size,
                         block_stride, row);
      } else {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < len; ++t) {  // acc[h] = sum_t p[h][t] * v_t,(h / group)
          const T* v = vc + tables[b * max_blocks + t / block_size] * block_stride + (t % block_size) * row;
          for (int64_t h = 0; h < heads; ++h)
            axpy<D>(scores[h * len + t], v + (h / group) * head_dim, acc.data() + h * head_dim, head_dim);
        }
      }
      T* dst = o + b * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  }
}

template <typename T>
void attend_any_dim(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens, double scale) {
  switch (query.size(3)) {
    case 64: attend<T, 64>(out, query, k_cache, v_cache, tables, lens, scale); break;
    case 128: attend<T, 128>(out, query, k_cache, v_cache, tables, lens, scale); break;
    default: attend<T, 0>(out, query, k_cache, v_cache, tables, lens, scale);
  }
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& write_blocks, const at::Tensor& write_offsets,
                        const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "query must be [B, H, 1, D]");
  TORCH_CHECK(k_cache.dim() == 4 && query.size(3) == k_cache.size(3), "cache and query head dims differ");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  tokenfleet::write_step(k_cache, v_cache, key, value, write_blocks, write_offsets);
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == query.size(0) && lens.size(0) == query.size(0), "one table and length per query");
  auto out = at::empty({query.size(0), 1, query.size(1), query.size(3)}, query.options());
  switch (query.scalar_type()) {
    case at::kFloat: attend_any_dim<float>(out, query, k_cache, v_cache, tables, lens, scale); break;
    case at::kBFloat16: attend_any_dim<c10::BFloat16>(out, query, k_cache, v_cache, tables, lens, scale); break;
    case at::kHalf: attend_any_dim<c10::Half>(out, query, k_cache, v_cache, tables, lens, scale); break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor write_blocks, Tensor write_offsets, Tensor block_tables, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) { m.impl("paged_decode", &paged_decode); }
