// The elementwise parts of a Llama-family decoder layer, one pass each. Eager PyTorch runs them
// as ~35 small operators a layer (each a dispatch and a pass over memory); SmolLM2's 30 thin
// layers spent a fifth of a batch-32 decode step there.
//
// Each rounds where the model's own PyTorch code rounds (to bf16 after every operation in a bf16
// model), so results match transformers' up to the order of one sum (the norm's) and the
// last bit of SiLU's exp.
//
// Ops (torch.ops.tokenfleet):
//   rms_norm(x [N, E], weight [E], eps) -> [N, E]
//   add_rms_norm(x [N, E], residual [N, E], weight [E], eps) -> [N, E]; residual += x, in place,
//       then the norm of the sum (what a layer does between its attention and its MLP)
//   rotary_(qkv [N, (H + 2 KVH) * D], cos [N, D], sin [N, D], heads) -> qkv: rotary embedding
//       applied in place to the first ``heads`` heads (the queries' and the keys'), rotate-half
//   silu_and_mul(gate_up [N, 2 I]) -> [N, I]: silu(gate) * up

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "common.h"

namespace tokenfleet {
namespace {

constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 14;  // below, a thread team costs more than it saves

// A product kept apart from the sum it feeds: no fused multiply-add skips its rounding.
inline vec kept(vec x) {
  asm("" : "+v"(x));
  return x;
}

// transformers' RMSNorm on one row: float32 mean of squares, x * rsqrt(mean + eps) rounded to the
// model's dtype, times the weight. ``add``: the row is residual + x (rounded), stored back first.
template <typename T>
void norm_row(const T* x, T* residual, const T* weight, T* out, int64_t width, float eps, bool add, float* row) {
  float squares = 0.0f;
  for (int64_t i = 0; i < width; ++i) {
    const float v = add ? round_as<T>(to_float(residual[i]) + to_float(x[i])) : to_float(x[i]);
    row[i] = v;
    squares += v * v;
  }
  if (add)
    for (int64_t i = 0; i < width; ++i) residual[i] = store_as<T>(row[i]);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; ++i)
    out[i] = store_as<T>(round_as<T>(to_float(weight[i]) * round_as<T>(row[i] * scale)));
}

template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* src = x.data_ptr<T>();
  T* res = residual ? residual->data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
#pragma omp parallel if (rows * width >= PARALLEL_MIN_ELEMENTS)
  {
    std::vector<float> row(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      norm_row<T>(src + r * width, res ? res + r * width : nullptr, w, dst + r * width, width, static_cast<float>(eps),
                  res != nullptr, row.data());
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, E]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [E]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
}

template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), " (float32 or bfloat16)");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  by_dtype(x, [&](auto tag) { norm_rows<decltype(tag)>(x, nullptr, weight, out, eps); });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous(), "residual must be like x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "x and residual dtypes differ");
  auto out = at::empty_like(x);
  by_dtype(x, [&](auto tag) { norm_rows<decltype(tag)>(x, &residual, weight, out, eps); });
  return out;
}

// q * cos + rotate_half(q) * sin, every product and the sum rounded to T as transformers' code
// rounds them (no fused multiply-adds: they would skip the products' rounding in float32).
template <typename T>
inline void rotate_head(T* p, const T* c, const T* s, int64_t half) {
  int64_t d = 0;
  for (; d + W <= half; d += W) {
    const vec a = load_vec(p + d), b = load_vec(p + d + half);
    const vec lo = round_vec<T>(kept(round_vec<T>(a * load_vec(c + d))) - kept(round_vec<T>(b * load_vec(s + d))));
    const vec hi = round_vec<T>(kept(round_vec<T>(b * load_vec(c + d + half))) +
                                kept(round_vec<T>(a * load_vec(s + d + half))));
    store_vec(p + d, lo);
    store_vec(p + d + half, hi);
  }
  for (; d < half; ++d) {  // head dims that are no multiple of 2 W
    const float a = to_float(p[d]), b = to_float(p[d + half]);
    float x = round_as<T>(a * to_float(c[d])), y = round_as<T>(b * to_float(s[d]));
    asm("" : "+x"(x), "+x"(y));
    const float lo = round_as<T>(x - y);
    x = round_as<T>(b * to_float(c[d + half])), y = round_as<T>(a * to_float(s[d + half]));
    asm("" : "+x"(x), "+x"(y));
    p[d] = store_as<T>(lo);
    p[d + half] = store_as<T>(round_as<T>(x + y));
  }
}

template <typename T>
void rotate_rows(T* qkv, int64_t rows, int64_t row_stride, const T* cos, const T* sin, int64_t heads, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * heads * dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      rotate_head<T>(qkv + r * row_stride + h * dim, cos + r * dim, sin + r * dim, dim / 2);
}

at::Tensor& rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [N, width] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0), "cos, sin must be [N, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous");
  const int64_t dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && heads * dim <= qkv.size(1), "heads x head_dim exceeds the row");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "dtypes differ");
  by_dtype(qkv, [&](auto tag) {
    using T = decltype(tag);
    rotate_rows<T>(qkv.data_ptr<T>(), qkv.size(0), qkv.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), heads, dim);
  });
  return qkv;
}

// exp over a register, any argument: common.h's Cephes expf holds for every x up to float's
// range (2^n is built from n + 127 in the exponent bits, n <= 127 there).
inline vec exp_any(vec x) { return exp_nonpositive(x > 88.3f ? splat(88.3f) : x); }

// silu(g) * u, rounded as transformers rounds: silu's result, then the product.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* o = out + r * width;
    int64_t i = 0;
    for (; i + W <= width; i += W) {
      const vec g = load_vec(gate + i);
      store_vec(o + i, round_vec<T>(round_vec<T>(g / (1.0f + exp_any(-g))) * load_vec(up + i)));
    }
    for (; i < width; ++i) {
      const float g = to_float(gate[i]);
      o[i] = store_as<T>(round_as<T>(round_as<T>(g / (1.0f + std::exp(-g))) * to_float(up[i])));
    }
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up must be [N, 2I]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  by_dtype(gate_up, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), gate_up.size(0), out.size(1));
  });
  return out;
}

}  // namespace
}  // namespace tokenfleet

TORCH_LIBRARY_FRAGMENT(tokenfleet, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("rms_norm", &tokenfleet::rms_norm);
  m.impl("add_rms_norm", &tokenfleet::add_rms_norm);
  m.impl("rotary_", &tokenfleet::rotary_);
  m.impl("silu_and_mul", &tokenfleet::silu_and_mul);
}
