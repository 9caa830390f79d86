// float32 products of the CPU decode step on AVX2 + FMA (tlt/model/cpu_f32.py).
//
// A weight [N, K] is packed as groups of 16 output columns, [ceil(N / 16), K, 16] (the last group padded
// with zeros): a group is one contiguous stream, and each input k reads its 16 weights with two loads.
// A block of up to 6 rows times one group keeps 12 accumulators in registers; every weight read serves all
// rows of the block. The blocks of rows take a group's inputs in chunks of 128, all blocks one chunk before
// the next, so the group streams from memory once while every block multiplies by it (from L1), and a
// product over a few rows costs about what streaming the weight once does, until arithmetic bounds it. Rows
// come in tiles of 48, each multiplied by every group in turn, so many rows (a log-prob pass) reread the
// weights per tile rather than their inputs per group.
//
// On float32 weights each output element is one float32 accumulator summed over k in order (one fused
// multiply-add per k), whatever the number of rows or the block a row falls in: a row's result does not depend
// on how many rows are multiplied (a draft's verification gives the one-token step's values bit for bit). Bias and
// residual are added after the sum, in that order.
//
// 4-bit weights (a drafter's, cpu_f32.pack4): per group and input k, 8 bytes whose byte j holds the code of
// column j in its low nibble and of column 8 + j in its high one, with a scale and a low value per column and
// k-group (cpu_kernels.levels4). A product streams an eighth of the float32 weight's bytes, and expanding the
// codes, not memory, bounds it; so the scale and low value are taken out of the sum over a k-group:
// sum_k x_k (scale code_k + low) = scale sum_k x_k code_k + low sum_k x_k, the codes multiplied as they are
// (0..15 as float32). Each row's sum over a k-group runs in two chains, even and odd k, so one row keeps both
// FMA pipes busy instead of waiting on one chain. Rows come in blocks of up to 2 (8 partial sums), a k-group at
// a time. A row's result does not depend on the rows beside it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#define TARGET __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t GROUP = 16;  // output columns per packed group
constexpr int64_t BLOCK = 6;   // rows per register block: 12 accumulators, 2 weights, 1 broadcast

constexpr int64_t CHUNK = 128;  // inputs per pass of every row block over a group (8 KB of its weights)
constexpr int64_t TILE = 48;    // rows multiplied by every group before the next rows: x's rows stay in cache
constexpr int64_t AHEAD = 48;   // cache lines requested ahead: of float32 weights (an input each), of codes (8 inputs)

// Partial sums acc[r, 0:16] (row stride 16) of rows r < R of x go on over inputs k0 <= k < k1 of one group's
// weights w [K, 16]. The accumulators are named variables, not an array, so that the compiler keeps all 12 in
// registers through the loop.
template <int R, bool PREFETCH>
TARGET void block(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* acc) {
  __m256 l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5;
#define TLT_LOAD(i)                                                 \
  if constexpr (R > i) {                                            \
    l##i = _mm256_loadu_ps(acc + i * GROUP);                        \
    h##i = _mm256_loadu_ps(acc + i * GROUP + 8);                    \
  }
  TLT_LOAD(0) TLT_LOAD(1) TLT_LOAD(2) TLT_LOAD(3) TLT_LOAD(4) TLT_LOAD(5)
#undef TLT_LOAD
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + (k + AHEAD) * GROUP), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k * GROUP), w1 = _mm256_loadu_ps(w + k * GROUP + 8);
#define TLT_ROW(i)                                                  \
    if constexpr (R > i) {                                          \
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);       \
      l##i = _mm256_fmadd_ps(xv, w0, l##i);                         \
      h##i = _mm256_fmadd_ps(xv, w1, h##i);                         \
    }
    TLT_ROW(0) TLT_ROW(1) TLT_ROW(2) TLT_ROW(3) TLT_ROW(4) TLT_ROW(5)
#undef TLT_ROW
  }
#define TLT_STORE(i)                                                \
  if constexpr (R > i) {                                            \
    _mm256_storeu_ps(acc + i * GROUP, l##i);                        \
    _mm256_storeu_ps(acc + i * GROUP + 8, h##i);                    \
  }
  TLT_STORE(0) TLT_STORE(1) TLT_STORE(2) TLT_STORE(3) TLT_STORE(4) TLT_STORE(5)
#undef TLT_STORE
}

template <bool PREFETCH>
TARGET void rows_block(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* acc) {
  switch (rows) {
    case 1: block<1, PREFETCH>(x, ldx, w, k0, k1, acc); break;
    case 2: block<2, PREFETCH>(x, ldx, w, k0, k1, acc); break;
    case 3: block<3, PREFETCH>(x, ldx, w, k0, k1, acc); break;
    case 4: block<4, PREFETCH>(x, ldx, w, k0, k1, acc); break;
    case 5: block<5, PREFETCH>(x, ldx, w, k0, k1, acc); break;
    default: block<6, PREFETCH>(x, ldx, w, k0, k1, acc); break;
  }
}

// M rows times inputs k0 <= k < k1 of one group (w [K, 16]), in ceil(M / 6) blocks of nearly equal size (9 rows:
// 5 and 4, each with enough independent sums to keep both FMA pipes busy, where 6 and 3 would leave the 3-row
// block waiting on its sums). Over more than one row the first block requests the weights ahead of its multiply,
// so the next chunk arrives from memory while this one is multiplied; a single row streams as fast without (the
// hardware prefetcher keeps up with it).
TARGET void all_blocks(int64_t M, const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, float* acc,
                       bool prefetch) {
  const int64_t blocks = (M + BLOCK - 1) / BLOCK;
  for (int64_t i = 0, r0 = 0; i < blocks; ++i) {
    const int64_t rows = M / blocks + (i < M % blocks);
    if (i == 0 && prefetch && M > 1) {
      rows_block<true>(rows, x + r0 * ldx, ldx, w, k0, k1, acc + r0 * GROUP);
    } else {
      rows_block<false>(rows, x + r0 * ldx, ldx, w, k0, k1, acc + r0 * GROUP);
    }
    r0 += rows;
  }
}

// out[r, 0:valid] = acc[r, 0:valid] (+ bias) (+ residual[r]) for the M rows of one group.
void finish(int64_t M, const float* acc, const float* bias, const float* residual, int64_t ldr, float* out, int64_t ldo,
            int64_t valid) {
  for (int64_t r = 0; r < M; ++r) {
    float* o = out + r * ldo;
    for (int64_t c = 0; c < valid; ++c) {
      float v = acc[r * GROUP + c];
      if (bias) v += bias[c];
      if (residual) v += residual[r * ldr + c];
      o[c] = v;
    }
  }
}

// out[:, c0 : c0 + valid] (+ bias, + residual) of all M rows over group g's weights w [K, 16]. Every row block
// takes a chunk of the inputs before any takes the next, so the group streams from memory once while all blocks
// multiply by it; a row's sums go on in memory between chunks, exactly as in registers.
TARGET void group(int64_t M, int64_t K, const float* x, int64_t ldx, const float* w, const float* bias,
                  const float* residual, int64_t ldr, float* out, int64_t ldo, int64_t valid, float* acc) {
  std::fill(acc, acc + M * GROUP, 0.0f);
  const int64_t chunk = M <= BLOCK ? K : CHUNK;  // one block of rows: one pass
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    all_blocks(M, x, ldx, w, k0, k1, acc, true);
  }
  finish(M, acc, bias, residual, ldr, out, ldo, valid);
}

// acc[r, 0:16] (row stride 16) += scale * sum_k x[r, k] code_k + low * xsum[r] over one k-group of n inputs of a
// group's 4-bit weights (codes [n, 8], scales [2, 16]), for rows r < R (R <= 2: 8 partial sums in registers).
template <int R, bool PREFETCH>
TARGET void block4(const float* x, int64_t ldx, const float* xsum, int64_t xsum_stride, const uint8_t* codes,
                   const float* scales, int64_t n, float* acc) {
  const __m256i low_nibble = _mm256_set1_epi32(15);
  // partial sums: even and odd k, low and high 8 columns, per row
  __m256 el0 = _mm256_setzero_ps(), eh0 = el0, ol0 = el0, oh0 = el0, el1 = el0, eh1 = el0, ol1 = el0, oh1 = el0;
#define TLT_CODES(kk, c0, c1)                                                                                  \
  const __m256i c0##v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (kk) * 8))); \
  const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(c0##v, low_nibble));                                    \
  const __m256 c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c0##v, 4));
#define TLT_ROW(i, kk, l, h, c0, c1)                                                                           \
  if constexpr (R > i) {                                                                                       \
    const __m256 xv = _mm256_broadcast_ss(x + i * ldx + (kk));                                                 \
    l##i = _mm256_fmadd_ps(xv, c0, l##i);                                                                      \
    h##i = _mm256_fmadd_ps(xv, c1, h##i);                                                                      \
  }
  int64_t k = 0;
  for (; k + 2 <= n; k += 2) {
    if (PREFETCH && k % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (k + 8 * AHEAD) * 8), _MM_HINT_T0);
    TLT_CODES(k, a0, a1)
    TLT_CODES(k + 1, b0, b1)
    TLT_ROW(0, k, el, eh, a0, a1) TLT_ROW(1, k, el, eh, a0, a1)
    TLT_ROW(0, k + 1, ol, oh, b0, b1) TLT_ROW(1, k + 1, ol, oh, b0, b1)
  }
  if (k < n) {  // an odd k-group (one over all of an odd K): its last input in the even chain
    TLT_CODES(k, a0, a1)
    TLT_ROW(0, k, el, eh, a0, a1) TLT_ROW(1, k, el, eh, a0, a1)
  }
#undef TLT_ROW
#undef TLT_CODES
  const __m256 scale0 = _mm256_loadu_ps(scales), scale1 = _mm256_loadu_ps(scales + 8);
  const __m256 low0 = _mm256_loadu_ps(scales + GROUP), low1 = _mm256_loadu_ps(scales + GROUP + 8);
#define TLT_FOLD(i)                                                                                            \
  if constexpr (R > i) {                                                                                       \
    const __m256 xs = _mm256_set1_ps(xsum[i * xsum_stride]);                                                   \
    float* a = acc + i * GROUP;                                                                                \
    const __m256 sum0 = _mm256_fmadd_ps(scale0, _mm256_add_ps(el##i, ol##i), _mm256_loadu_ps(a));             \
    const __m256 sum1 = _mm256_fmadd_ps(scale1, _mm256_add_ps(eh##i, oh##i), _mm256_loadu_ps(a + 8));         \
    _mm256_storeu_ps(a, _mm256_fmadd_ps(low0, xs, sum0));                                                      \
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(low1, xs, sum1));                                                  \
  }
  TLT_FOLD(0) TLT_FOLD(1)
#undef TLT_FOLD
}

template <bool PREFETCH>
TARGET void rows_block4(int64_t rows, const float* x, int64_t ldx, const float* xsum, int64_t xsum_stride,
                        const uint8_t* codes, const float* scales, int64_t n, float* acc) {
  if (rows == 1) {
    block4<1, PREFETCH>(x, ldx, xsum, xsum_stride, codes, scales, n, acc);
  } else {
    block4<2, PREFETCH>(x, ldx, xsum, xsum_stride, codes, scales, n, acc);
  }
}

// group() on 4-bit weights: k-group by k-group, the M rows in blocks of 2 (and one of 1 for odd M), each block
// converting the k-group's codes itself (faster here than the first block leaving them converted in L1 for the
// others); the first requests the codes ahead, the others find them in cache.
TARGET void group4(int64_t M, int64_t K, const float* x, int64_t ldx, const float* xsum, const uint8_t* codes,
                   const float* scales, int64_t kgroup, const float* bias, const float* residual, int64_t ldr,
                   float* out, int64_t ldo, int64_t valid, float* acc) {
  const int64_t kgroups = K / kgroup;
  std::fill(acc, acc + M * GROUP, 0.0f);
  for (int64_t q = 0; q < kgroups; ++q) {
    const uint8_t* c = codes + q * kgroup * (GROUP / 2);
    const float* sc = scales + q * 2 * GROUP;
    for (int64_t r0 = 0; r0 < M; r0 += 2) {
      const float* xr = x + r0 * ldx + q * kgroup;
      const float* sr = xsum + r0 * kgroups + q;
      const int64_t rows = std::min<int64_t>(2, M - r0);
      if (r0 == 0) {
        rows_block4<true>(rows, xr, ldx, sr, kgroups, c, sc, kgroup, acc + r0 * GROUP);
      } else {
        rows_block4<false>(rows, xr, ldx, sr, kgroups, c, sc, kgroup, acc + r0 * GROUP);
      }
    }
  }
  finish(M, acc, bias, residual, ldr, out, ldo, valid);
}

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

bool supported() { return cpu_has_avx2_fma(); }

// x [M, K] (columns contiguous, any row stride) times the packed weight -> [M, N] float32, plus bias [N] and
// residual [M, N] when given. The weight is float32 [G, K, 16] (cpu_f32.pack), or 4-bit codes [G, K, 8] uint8 with their scales
// [G, K / kgroup, 2, 16] float32 (cpu_f32.pack4).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(supported(), "cpu_f32.linear: this CPU has no AVX2 and FMA");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "cpu_f32.linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x: 2-D float32 rows with contiguous columns");
  const bool four = scales.has_value() && scales->defined();
  if (four) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == GROUP / 2 && packed.is_contiguous() &&
                packed.scalar_type() == torch::kByte, "packed: 4-bit codes [groups, K, 8] uint8, contiguous (cpu_f32.pack4)");
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == GROUP && packed.is_contiguous() && packed.scalar_type() == torch::kFloat,
                "packed: [groups, K, 16] float32, contiguous (cpu_f32.pack)");
  }
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed weight has K = ", packed.size(1), ", x has ", K);
  TORCH_CHECK(N >= 1 && (N + GROUP - 1) / GROUP == G, "N = ", N, " does not fill ", G, " groups of ", GROUP);
  int64_t kgroup = K, kgroups = 1;
  if (four) {
    TORCH_CHECK(scales->is_cpu() && scales->dim() == 4 && scales->size(0) == G && scales->size(2) == 2 &&
                scales->size(3) == GROUP && scales->is_contiguous() && scales->scalar_type() == torch::kFloat &&
                K >= 1 && scales->size(1) >= 1 && K % scales->size(1) == 0,
                "scales: [groups, K / kgroup, 2, 16] float32, contiguous (cpu_f32.pack4)");
    kgroups = scales->size(1);
    kgroup = K / kgroups;
  }
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_cpu() && bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == torch::kFloat,
                "bias: [N] float32 on the CPU");
    b = bias->data_ptr<float>();
  }
  const float* res = nullptr;
  int64_t ldr = 0;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->is_cpu() && residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                residual->stride(1) == 1 && residual->scalar_type() == torch::kFloat,
                "residual: [M, N] float32 with contiguous columns on the CPU");
    res = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  std::vector<float> xsum;  // 4-bit weights: each row's sum of x over each k-group, in order
  if (four) {
    xsum.resize(M * kgroups);
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t q = 0; q < kgroups; ++q) {
        float total = 0.0f;
        for (int64_t k = q * kgroup; k < (q + 1) * kgroup; ++k) total += xp[r * ldx + k];
        xsum[r * kgroups + q] = total;
      }
    }
  }
  // Tiles of rows, each multiplied by every group; within a tile each thread takes a contiguous run of groups
  // (one stream of weights) and all the tile's rows for each. Up to TILE rows (every decode step of a small
  // batch) the weights stream once; past it each tile streams them again, and its arithmetic, not the stream,
  // bounds it.
  for (int64_t t0 = 0; t0 < M; t0 += TILE) {
    const int64_t rows = std::min(TILE, M - t0);
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> acc(rows * GROUP);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t c0 = g * GROUP;
        const float* gb = b ? b + c0 : nullptr;
        const float* gr = res ? res + t0 * ldr + c0 : nullptr;
        float* go = op + t0 * N + c0;
        const int64_t valid = std::min(GROUP, N - c0);
        if (four) {
          group4(rows, K, xp + t0 * ldx, ldx, xsum.data() + t0 * kgroups,
                 packed.data_ptr<uint8_t>() + g * K * (GROUP / 2), scales->data_ptr<float>() + g * kgroups * 2 * GROUP,
                 kgroup, gb, gr, ldr, go, N, valid, acc.data());
        } else {
          group(rows, K, xp + t0 * ldx, ldx, packed.data_ptr<float>() + g * K * GROUP, gb, gr, ldr, go, N, valid,
                acc.data());
        }
      }
    });
  }
  return out;
}

namespace {

// One row's x * rsqrt(mean(x^2) + eps) (* w): the squares summed in 8 lanes in order, then across the lanes in
// order, so a row's result does not depend on the rows beside it.
TARGET void norm_row(const float* x, const float* w, int64_t D, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  for (; d < D; ++d) sum += x[d] * x[d];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + d), rv);
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + d));
    _mm256_storeu_ps(out + d, v);
  }
  for (; d < D; ++d) out[d] = w ? x[d] * r * w[d] : x[d] * r;
}

}  // namespace

// x [A, R, D] float32 (each row of D contiguous) normalised over D, times weight [D] or [R, D] (per r) when given;
// the result is contiguous.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight, double eps) {
  TORCH_CHECK(supported(), "cpu_f32.rms_norm: this CPU has no AVX2 and FMA");
  TORCH_CHECK(x.is_cpu() && x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1,
              "rms_norm: x must be [A, R, D] float32 with contiguous rows, on the CPU");
  const int64_t A = x.size(0), R = x.size(1), D = x.size(2);
  const float* w = nullptr;
  int64_t per_row = 0;
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->is_cpu() && weight->scalar_type() == torch::kFloat && weight->is_contiguous() &&
                (weight->numel() == D || weight->numel() == R * D), "rms_norm: weight must be [D] or [R, D] float32");
    w = weight->data_ptr<float>();
    per_row = weight->numel() == D ? 0 : D;
  }
  auto out = torch::empty({A, R, D}, x.options());
  const int64_t sa = x.stride(0), sr = x.stride(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // A row is a few microseconds of work: threads only for many rows.
  at::parallel_for(0, A * R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(D, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t a = i / R, r = i % R;
      norm_row(xp + a * sa + r * sr, w ? w + r * per_row : nullptr, D, e, op + i * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported);
  m.def("linear", &linear, "x @ W^T (+ bias) (+ residual) on a weight packed in groups of 16 columns (float32, or "
        "4-bit codes with their scales)", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), py::arg("scales") = py::none());
  m.def("rms_norm", &rms_norm, "x / rms(x) over the last dimension (* weight)", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
}
