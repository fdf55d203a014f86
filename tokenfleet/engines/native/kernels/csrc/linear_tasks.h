// What the linear kernels (linear_bf16_cpu.cpp, linear_f32_cpu.cpp) share: the output and bias
// set-up of a call, and how a call splits into tasks.
#pragma once

#include <ATen/ATen.h>
#include <omp.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace tokenfleet {

// The output of a linear on x: x's shape with out_features last, in x's dtype.
inline at::Tensor linear_output(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return at::empty(shape, x.options());
}

// The bias as contiguous float32 (the tiles add it to their float32 sums), or undefined for none.
inline at::Tensor linear_bias_f32(const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
  return bias->to(at::kFloat).contiguous();
}

// Rows a (panel, rows) task takes, for m input rows over `panels` column panels. Normally
// row_chunk (its panel stays in L2 over the task's tiles). A decode-sized input (one chunk) whose
// few panels do not split evenly over the threads is cut into one share of rows per thread
// instead: on 2 threads SmolLM2's 576-column linears are 9 panels of 64, and the thread with 5
// left the other idle for a ninth of the call (375 against 402-409 GF/s for 8 or 10 panels).
inline int64_t task_rows(int64_t m, int64_t panels, int64_t row_chunk, int64_t min_rows) {
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads < 2 || m > row_chunk || panels % threads == 0 || panels >= 8 * threads) return row_chunk;
  const int64_t share = (m + threads - 1) / threads;
  return share >= min_rows ? share : row_chunk;
}

}  // namespace tokenfleet
