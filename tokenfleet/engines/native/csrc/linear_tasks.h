// How the linear kernels (linear_bf16_cpu.cpp, linear_f32_cpu.cpp) split a call into tasks.
#pragma once

#include <omp.h>

#include <cstdint>

namespace tokenfleet {

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
