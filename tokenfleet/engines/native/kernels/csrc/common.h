// Helpers shared by the CPU kernels: float vectors, bf16 widening and rounding, the attention
// kernels' row writes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tokenfleet {

// One register of floats: 16 with AVX-512, 8 elsewhere (a 16-float type on AVX2 is split in two
// by the compiler, and register blocks sized for 32 registers then spill). Softmax needs exp
// over such vectors; the compilers call scalar expf for std::exp.
#ifdef __AVX512F__
#define TOKENFLEET_VEC_BYTES 64
#else
#define TOKENFLEET_VEC_BYTES 32
#endif
typedef float vec __attribute__((vector_size(TOKENFLEET_VEC_BYTES)));
typedef float vec_unaligned __attribute__((vector_size(TOKENFLEET_VEC_BYTES), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(TOKENFLEET_VEC_BYTES)));
constexpr int64_t W = TOKENFLEET_VEC_BYTES / sizeof(float);

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }
inline vec splat(float x) { return vec{} + x; }
inline float hsum(vec v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(vec v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) for x <= 0 (softmax arguments), within 2 ulp: Cephes' expf, 2^n times a degree-6
// polynomial of the remainder; below -87.3 it returns ~0.
inline vec exp_nonpositive(vec x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  const vec fx = x * 1.44269504088896341f + 0.5f;
  vec n = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);  // truncates toward 0
  n = n > fx ? n - 1.0f : n;                                                  // floor
  const vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vec y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const ivec scale = (__builtin_convertvector(n, ivec) + 127) << 23;
  return y * reinterpret_cast<const vec&>(scale);
}

// In place: row[0 .. n) = exp(row - max(row)), returning their sum.
inline float exp_shifted(float* row, int64_t n) {
  vec mx = splat(-3.0e38f);
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    const vec x = load(row + t);
    mx = x > mx ? x : mx;
  }
  float m = hmax(mx);
  for (int64_t i = t; i < n; ++i) m = row[i] > m ? row[i] : m;
  vec sum = {};
  for (t = 0; t + W <= n; t += W) {
    const vec e = exp_nonpositive(load(row + t) - m);
    store(row + t, e);
    sum += e;
  }
  float total = hsum(sum);
  if (t < n) {  // the tail, padded to a full vector on the stack
    float tail[W];
    for (int i = 0; i < W; ++i) tail[i] = t + i < n ? row[t + i] - m : -87.3f;
    const vec e = exp_nonpositive(load(tail));
    for (int64_t i = t; i < n; ++i) row[i] = e[i - t], total += e[i - t];
  }
  return total;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {  // the exact widening, as a shift the compiler vectorizes
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Rounds a float as a cast to T does (bf16: to nearest even; NaN stays NaN), back as a float.
template <typename T>
inline float round_as(float x) {
  return x;
}
template <>
inline float round_as<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits = nan ? 0x7fc00000u : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T>
inline T store_as(float rounded) {  // ``rounded`` is already representable: the cast is exact
  return static_cast<T>(rounded);
}
template <>
inline c10::BFloat16 store_as<c10::BFloat16>(float rounded) {
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// The same on registers of W values (loaded from, and stored to, T).
typedef uint32_t uvec __attribute__((vector_size(TOKENFLEET_VEC_BYTES)));
typedef uint16_t hvec __attribute__((vector_size(TOKENFLEET_VEC_BYTES / 2), aligned(2)));

template <typename T>
inline vec round_vec(vec x) {
  return x;
}
template <>
inline vec round_vec<c10::BFloat16>(vec x) {
  const uvec bits = reinterpret_cast<const uvec&>(x);
  const uvec nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const uvec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uvec out = (nan & 0x7fc00000u) | (~nan & rounded);
  return reinterpret_cast<const vec&>(out);
}

inline vec load_vec(const float* p) { return load(p); }
inline vec load_vec(const c10::BFloat16* p) {
  const uvec bits = __builtin_convertvector(*reinterpret_cast<const hvec*>(p), uvec) << 16;
  return reinterpret_cast<const vec&>(bits);
}
inline void store_vec(float* p, vec rounded) { store(p, rounded); }
inline void store_vec(c10::BFloat16* p, vec rounded) {  // ``rounded``: bf16 values, the low halves zero
  *reinterpret_cast<hvec*>(p) = __builtin_convertvector(reinterpret_cast<const uvec&>(rounded) >> 16, hvec);
}

// New key/value rows into their slots: step [T, KVH, 1, D] (any strides) -> cache[block, offset],
// one row per token (a decode step's batch, or a prefill's packed tokens viewed that way).
template <typename T>
void write_rows(at::Tensor& cache, const at::Tensor& step, const int64_t* blocks, const int64_t* offsets) {
  const int64_t tokens = step.size(0), kv_heads = step.size(1), head_dim = step.size(3);
  const int64_t s_token = step.stride(0), s_head = step.stride(1), s_dim = step.stride(3);
  const int64_t block_size = cache.size(1), row = kv_heads * head_dim;
  const T* src = step.data_ptr<T>();
  T* dst = cache.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    T* slot = dst + (blocks[t] * block_size + offsets[t]) * row;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* from = src + t * s_token + h * s_head;
      if (s_dim == 1)
        std::memcpy(slot + h * head_dim, from, head_dim * sizeof(T));
      else
        for (int64_t d = 0; d < head_dim; ++d) slot[h * head_dim + d] = from[d * s_dim];
    }
  }
}

// Writes a step's key and value rows into one layer's pool, after checking that they fit it.
inline void write_step(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& write_blocks, const at::Tensor& write_offsets) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad cache shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(key.dim() == 4 && key.sizes() == value.sizes() && key.size(2) == 1, "rows must be [T, KVH, 1, D]");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(3) == k_cache.size(3), "cache and step heads differ");
  for (const at::Tensor* t : {&key, &value, static_cast<const at::Tensor*>(&v_cache)})
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "key, value and cache dtypes differ");
  auto blocks = write_blocks.to(at::kLong).contiguous(), offsets = write_offsets.to(at::kLong).contiguous();
  TORCH_CHECK(blocks.numel() == key.size(0) && offsets.numel() == key.size(0), "one write place per token");
  const int64_t *b = blocks.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>();
  switch (key.scalar_type()) {
    case at::kFloat: write_rows<float>(k_cache, key, b, off), write_rows<float>(v_cache, value, b, off); break;
    case at::kBFloat16:
      write_rows<c10::BFloat16>(k_cache, key, b, off), write_rows<c10::BFloat16>(v_cache, value, b, off);
      break;
    case at::kHalf: write_rows<c10::Half>(k_cache, key, b, off), write_rows<c10::Half>(v_cache, value, b, off); break;
    default: TORCH_CHECK(false, "unsupported dtype ", key.scalar_type());
  }
}

}  // namespace tokenfleet
