// What tlt's CPU kernels (cpu_bf16.cpp, cpu_f32.cpp) share: plain C++, no vector instructions. The extension
// loader (tlt/model/cpu_kernels.py) hashes the headers of this folder with each source, so a change here rebuilds
// both.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

// The additive mask [B, 1, T, S] (float32: 0 visible, -inf hidden) of T new tokens written after row b's
// lengths[b] cached ones, keys in slots 0 .. S - 1 (transformer.cached_mask with `additive`, in one pass): slots
// before the row's last D cached ones are visible to all; slot lengths[b] - D + j (j < D + T) is visible to new
// token t where tree[b][t][j] and key j is real (j < D, or valid[b][j - D]), and always to itself (j = D + t);
// slots past lengths[b] + T - 1 are hidden. tree: [B or 1, T, D + T] bool; valid: [B, T] bool or undefined.
inline torch::Tensor tree_mask(torch::Tensor lengths, torch::Tensor tree, c10::optional<torch::Tensor> valid, int64_t S) {
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == torch::kLong, "tree_mask: lengths must be [B] int64");
  TORCH_CHECK(tree.dim() == 3 && tree.scalar_type() == torch::kBool, "tree_mask: tree must be [B or 1, T, D + T] bool");
  int64_t B = lengths.size(0), T = tree.size(1), W = tree.size(2), D = W - T;
  TORCH_CHECK(D >= 0 && (tree.size(0) == B || tree.size(0) == 1), "tree_mask: tree must be [B or 1, T, D + T]");
  bool has_valid = valid && valid->defined();
  TORCH_CHECK(!has_valid || (valid->scalar_type() == torch::kBool && valid->dim() == 2 && valid->size(0) == B &&
                             valid->size(1) == T), "tree_mask: valid must be [B, T] bool");
  auto len = lengths.contiguous();
  auto tr = tree.contiguous();
  auto va = has_valid ? valid->contiguous() : torch::Tensor();
  auto out = torch::empty({B, 1, T, S}, torch::dtype(torch::kFloat32));
  const int64_t* lp = len.data_ptr<int64_t>();
  const bool* tp = tr.data_ptr<bool>();
  const bool* vp = has_valid ? va.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  int64_t tree_batch = tree.size(0) == B ? W * T : 0;
  at::parallel_for(0, B * T, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(S, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t b = i / T, t = i % T, start = lp[b] - D;  // the slot of the row's first draft key
      float* row = op + i * S;
      const bool* seen = tp + b * tree_batch + t * W;
      int64_t open = std::clamp<int64_t>(start, 0, S);
      std::fill(row, row + open, 0.0f);
      std::fill(row + open, row + S, -INFINITY);
      for (int64_t j = std::max<int64_t>(0, -start); j < W && start + j < S; ++j) {
        bool real = j < D || !vp || vp[b * T + j - D];
        if (j == D + t || (seen[j] && real)) row[start + j] = 0.0f;
      }
    }
  });
  return out;
}

// A layer step's packed tokens (counts [B] int64: row b's first counts[b] of T tokens, N in all, rows in order) ->
// each token's index in [B * T], checked against N.
inline torch::Tensor packed_rows(const torch::Tensor& counts, int64_t B, int64_t T, int64_t N) {
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.dim() == 1 && counts.size(0) == B,
              "layer_step: counts must be [B] int64");
  auto cnt = counts.contiguous();
  auto rows = torch::empty({N}, cnt.options());
  int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* np = cnt.data_ptr<int64_t>();
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 0 && np[b] <= T && n + np[b] <= N, "layer_step: counts disagree with x and T");
    for (int64_t t = 0; t < np[b]; ++t) rp[n++] = b * T + t;
  }
  TORCH_CHECK(n == N, "layer_step: x has ", N, " rows, counts sum to ", n);
  return rows;
}
