// Paged decode attention for the CPU: each new query attends to its sequence's keys and values
// read in place from the block pool, so a decode step reads the KV cache once instead of copying
// it into a contiguous batch first (the gather costs about as much as the attention itself).
//
// Layouts (see tokenfleet/kvcache/store.py):
//   query        [B, H, D]            this step's query, one token per sequence
//   k_cache      [NB, BS, KVH, D]     one layer of the pool (v_cache the same)
//   block_tables [B, MB] int64        the blocks of each sequence, in order
//   lengths      [B] int64            tokens each sequence attends to (its new token included)
//   out          [B, H, D]
// Work is split over sequences; query head h reads kv head h / (H / KVH) (GQA). Sums and the
// softmax are in float32, as SDPA does for bf16 inputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void decode_kernel(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& lengths,
                   double scale) {
  const int64_t batch = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t token_stride = kv_heads * head_dim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  // One sequence per task; its keys are read token by token, all heads of a token at once (one
  // contiguous row of the block), so the pool streams through memory in order.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * head_dim), acc(heads * head_dim), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      scores.assign(heads * len, 0.0f);
      load_row(q + b * heads * head_dim, qf.data(), heads * head_dim);

      // scores[h][t] = q_h . k_t,(h / group) * scale
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * max_blocks + t / block_size];
        const T* k = kc + block * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const T* kh = k + (h / group) * head_dim;
          const float* qh = qf.data() + h * head_dim;
          float s = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * to_float(kh[d]);
          scores[h * len + t] = s * fscale;
        }
      }
      // softmax per head
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * len;
        float mx = std::numeric_limits<float>::lowest();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // acc[h] = sum_t p[h][t] * v_t,(h / group)
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[b * max_blocks + t / block_size];
        const T* v = vc + block * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const T* vh = v + (h / group) * head_dim;
          const float p = scores[h * len + t];
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(vh[d]);
        }
      }
      T* dst = o + b * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0, "bad head layout");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  auto q = query.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "one table and length per query");
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: decode_kernel<float>(out, q, k_cache, v_cache, tables, lens, scale); break;
    case at::kBFloat16: decode_kernel<c10::BFloat16>(out, q, k_cache, v_cache, tables, lens, scale); break;
    case at::kHalf: decode_kernel<c10::Half>(out, q, k_cache, v_cache, tables, lens, scale); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading K/V in place from a paged block pool");
}
