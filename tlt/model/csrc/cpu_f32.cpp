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
//
// layer_step runs a whole decoder layer in one call (tlt/model/fused.py): the products, rms norms, the q/k norm
// with RoPE and the cache write (rope_write), attention over a float32 cache (attention) and silu(gate) * up. Every
// token's result depends only on its own inputs and the keys it sees, whatever else the call holds.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "shared.h"

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

namespace {

// exp(x) in float32 to a few ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 expansion,
// times 2^n); below -87.33 (and -inf) exactly 0, above 88 as at 88. Elementwise: a value's result does not depend on
// the lane it sits in.
TARGET inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// Lanes 0..n-1 set (n <= 8): the elements a masked load reads and a masked store writes.
TARGET inline __m256i lanes(int64_t n) {
  alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
}

// The first n <= 8 floats at p (the rest of the vector zero), and their store: masked moves only for a partial
// vector (a masked store is microcoded on AMD's Zen cores, many times a plain one).
TARGET inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n));
}
TARGET inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, lanes(n), v);
  }
}

// [sum of a0's lanes, ..., sum of a7's lanes], each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): every
// output lane sums its vector in the same order, so a key's score does not depend on where in a block of 8 it falls.
TARGET inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// scores[i] = q . key[j + i] (+ mask[j + i]) for the n <= 8 keys from slot j (rows of D at stride ks; q padded with
// zeros to whole chunks of 8): each a sum of fused multiply-adds in order over the head's chunks of 8 dimensions, then
// across lanes (sum8). A key the mask hides scores -inf whatever its slot holds (a hidden slot may hold anything).
template <bool TAIL>
TARGET void score_block(const float* q, const float* k, int64_t ks, int64_t D, int64_t n, const float* mask,
                        float* scores) {
  const __m256i tail = lanes(D % 8);
#define key(i, d) ((TAIL && (d) + 8 > D) ? _mm256_maskload_ps(k + (i) * ks + (d), tail) : _mm256_loadu_ps(k + (i) * ks + (d)))
  __m256 s;
  if (n == 8) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, key(0, d), a0);
      a1 = _mm256_fmadd_ps(qv, key(1, d), a1);
      a2 = _mm256_fmadd_ps(qv, key(2, d), a2);
      a3 = _mm256_fmadd_ps(qv, key(3, d), a3);
      a4 = _mm256_fmadd_ps(qv, key(4, d), a4);
      a5 = _mm256_fmadd_ps(qv, key(5, d), a5);
      a6 = _mm256_fmadd_ps(qv, key(6, d), a6);
      a7 = _mm256_fmadd_ps(qv, key(7, d), a7);
    }
    s = sum8(a0, a1, a2, a3, a4, a5, a6, a7);
  } else {  // the last keys: the same sums, one key at a time
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; d += 8) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), key(i, d), a[i]);
    s = sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
  }
#undef key
  if (mask) {
    const __m256 add = load8(mask, n);
    const __m256 hidden = _mm256_cmp_ps(add, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    s = _mm256_blendv_ps(_mm256_add_ps(s, add), add, hidden);
  }
  store8(scores, s, n);
}

// out[r] = sum over slots j < limit of p[r][j] v_j for the QB (1 or 2) queries from r, over the head's NC chunks of 8
// dimensions from chunk c0 (the last one partial where TAIL and D % 8): in slot order, a weight of 0 (a hidden key)
// skipped, as if absent. The sums stay in registers (two queries' 12 of them with the weights and a value chunk).
template <int QB, int NC, bool TAIL>
TARGET void value_pass(float* const* p, int64_t limit, const float* v, int64_t vs, int64_t D, int64_t c0,
                       float* const* out) {
  __m256 acc[QB][NC];
  for (int r = 0; r < QB; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  const bool part = TAIL && D % 8 && (c0 + NC) * 8 > D;  // the last chunk is partial
  const __m256i tail = lanes(D % 8);
  const float* p0 = p[0];
  const float* p1 = p[QB - 1];
  for (int64_t j = 0; j < limit; ++j) {
    const float* value = v + j * vs + c0 * 8;
    const float w0 = p0[j], w1 = p1[j];
    if (QB == 2 && w0 != 0.0f && w1 != 0.0f) {  // both see the key (the usual case): each value chunk read once
      const __m256 v0 = _mm256_set1_ps(w0), v1 = _mm256_set1_ps(w1);
      for (int c = 0; c < NC; ++c) {
        const __m256 x = (part && c == NC - 1) ? _mm256_maskload_ps(value + c * 8, tail) : _mm256_loadu_ps(value + c * 8);
        acc[0][c] = _mm256_fmadd_ps(v0, x, acc[0][c]);
        acc[QB - 1][c] = _mm256_fmadd_ps(v1, x, acc[QB - 1][c]);
      }
      continue;
    }
    if (w0 != 0.0f) {
      const __m256 v0 = _mm256_set1_ps(w0);
      for (int c = 0; c < NC; ++c) {
        const __m256 x = (part && c == NC - 1) ? _mm256_maskload_ps(value + c * 8, tail) : _mm256_loadu_ps(value + c * 8);
        acc[0][c] = _mm256_fmadd_ps(v0, x, acc[0][c]);
      }
    }
    if (QB == 2 && w1 != 0.0f) {
      const __m256 v1 = _mm256_set1_ps(w1);
      for (int c = 0; c < NC; ++c) {
        const __m256 x = (part && c == NC - 1) ? _mm256_maskload_ps(value + c * 8, tail) : _mm256_loadu_ps(value + c * 8);
        acc[QB - 1][c] = _mm256_fmadd_ps(v1, x, acc[QB - 1][c]);
      }
    }
  }
  for (int r = 0; r < QB; ++r) {
    for (int c = 0; c < NC; ++c) {
      float* o = out[r] + (c0 + c) * 8;
      if (part && c == NC - 1) {
        _mm256_maskstore_ps(o, tail, acc[r][c]);
      } else {
        _mm256_storeu_ps(o, acc[r][c]);
      }
    }
  }
}

template <int QB, bool TAIL>
TARGET void value_passes(float* const* p, int64_t limit, const float* v, int64_t vs, int64_t D, float* const* out) {
  const int64_t chunks = (D + 7) / 8;
  for (int64_t c0 = 0; c0 < chunks; c0 += 6) {
    switch (std::min<int64_t>(6, chunks - c0)) {
      case 1: value_pass<QB, 1, TAIL>(p, limit, v, vs, D, c0, out); break;
      case 2: value_pass<QB, 2, TAIL>(p, limit, v, vs, D, c0, out); break;
      case 3: value_pass<QB, 3, TAIL>(p, limit, v, vs, D, c0, out); break;
      case 4: value_pass<QB, 4, TAIL>(p, limit, v, vs, D, c0, out); break;
      case 5: value_pass<QB, 5, TAIL>(p, limit, v, vs, D, c0, out); break;
      default: value_pass<QB, 6, TAIL>(p, limit, v, vs, D, c0, out); break;
    }
  }
}

// R queries q[r] (rows of Dq >= D floats, zero past D, already times 1 / sqrt(D)) of one kv head over its keys and
// values (rows of D at strides ks, vs): query r sees slots j < limit[r] where masks[r] (additive, S floats; or null:
// all of them) is not -inf. out[r] (D floats) = sum_j p_j v_j / sum_j p_j, p_j = exp(score_j - max score). Every sum
// runs in slot order over the keys the query sees (a hidden key adds nothing), so a query's result depends only on
// which keys it sees and their order: a tree node's query gets what plain decoding's query at its place gets, bit for
// bit, whatever nodes lie between, and whatever other queries the call holds. p: R rows of P floats (limit + 8 <= P);
// total: R floats.
template <bool TAIL>
TARGET void attend_rows(const float* q, int64_t Dq, int64_t R, const float* k, int64_t ks, const float* v, int64_t vs,
                        int64_t D, const float* const* masks, const int64_t* limit, float* p, int64_t P,
                        float* const* out, float* total) {
  std::vector<float*> rows(R);
  const int64_t reach = R ? *std::max_element(limit, limit + R) : 0;
  for (int64_t r = 0; r < R; ++r) {
    float* pr = rows[r] = p + r * P;
    std::fill(pr + limit[r], pr + reach, 0.0f);  // past its keys: weights of 0 (value_pass takes two queries at once)
    for (int64_t j = 0; j < limit[r]; j += 8)
      score_block<TAIL>(q + r * Dq, k + j * ks, ks, D, std::min<int64_t>(8, limit[r] - j),
                        masks[r] ? masks[r] + j : nullptr, pr + j);
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < limit[r]; j += 8) {
      const int64_t n = std::min<int64_t>(8, limit[r] - j);
      top = _mm256_max_ps(top, n == 8 ? _mm256_loadu_ps(pr + j)
                                      : _mm256_blendv_ps(top, load8(pr + j, n), _mm256_castsi256_ps(lanes(n))));
    }
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top);
    float most = tops[0];
    for (int i = 1; i < 8; ++i) most = std::max(most, tops[i]);
    if (most == -INFINITY) {  // sees no key (a padding token's query): weights of 0
      std::fill(pr, pr + limit[r], 0.0f);
      continue;
    }
    const __m256 shift = _mm256_set1_ps(most);
    for (int64_t j = 0; j < limit[r]; j += 8) {
      const int64_t n = std::min<int64_t>(8, limit[r] - j);
      store8(pr + j, exp8(_mm256_sub_ps(load8(pr + j, n), shift)), n);
    }
  }
  // Each query's sum of weights, in slot order (a hidden key's 0 changes nothing), four queries' chains side by side.
  for (int64_t r = 0; r < R; r += 4) {
    const float* pr[4];
    for (int i = 0; i < 4; ++i) pr[i] = rows[std::min<int64_t>(r + i, R - 1)];
    int64_t upto = 0;
    for (int64_t i = r; i < std::min<int64_t>(r + 4, R); ++i) upto = std::max(upto, limit[i]);
    float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
    for (int64_t j = 0; j < upto; ++j) t0 += pr[0][j], t1 += pr[1][j], t2 += pr[2][j], t3 += pr[3][j];
    const float t[4] = {t0, t1, t2, t3};
    for (int64_t i = r; i < std::min<int64_t>(r + 4, R); ++i) total[i] = t[i - r];
  }
  for (int64_t r = 0; r < R; r += 2) {
    if (r + 1 < R) {
      value_passes<2, TAIL>(rows.data() + r, std::max(limit[r], limit[r + 1]), v, vs, D, out + r);
    } else {
      value_passes<1, TAIL>(rows.data() + r, limit[r], v, vs, D, out + r);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r][d] *= inv;
  }
}

// silu(g) * u for n elements: g / (1 + exp(-g)) * u.
TARGET void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t w = std::min<int64_t>(8, n - i);
    const __m256 x = load8(g + i, w);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
    store8(out + i, _mm256_mul_ps(s, load8(u + i, w)), w);
  }
}

}  // namespace

// gate_up [M, 2 I] float32 (rows contiguous) -> silu(gate) * up [M, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(supported(), "cpu_f32.silu_mul: this CPU has no AVX2 and FMA");
  TORCH_CHECK(gate_up.is_cpu() && gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat &&
              gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [M, 2 I] float32 rows");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * ld, gp + r * ld + I, op + r * I, I);
  });
  return out;
}

// The q/k per-head norm, RoPE and cache write of one layer's stacked q|k|v in one pass: qkv [B, T, H + 2 H_kv, D]
// float32 contiguous; norm [H + H_kv, D] (q_norm's weight per query head, then k_norm's per kv head) or undefined
// (no per-head norm); cos, sin [B or 1, T, D] (rotate-half tables: x cos + roll(x, D / 2) sin); keys, values
// [B, H_kv, C, D] float32 (rows of D contiguous) with room at slots[b] .. slots[b] + T - 1 of row b. k and v go
// there; q comes back [B, T, H, D].
torch::Tensor rope_write(const torch::Tensor& qkv, int64_t H, const c10::optional<torch::Tensor>& norm, double eps,
                         torch::Tensor cos, torch::Tensor sin, const torch::Tensor& keys, const torch::Tensor& values,
                         const torch::Tensor& slots) {
  TORCH_CHECK(supported(), "cpu_f32.rope_write: this CPU has no AVX2 and FMA");
  TORCH_CHECK(qkv.is_cpu() && qkv.dim() == 4 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat,
              "rope_write: qkv must be [B, T, H + 2 H_kv, D] float32, contiguous");
  const int64_t B = qkv.size(0), T = qkv.size(1), heads = qkv.size(2), D = qkv.size(3), Hkv = (heads - H) / 2;
  TORCH_CHECK(H >= 1 && Hkv >= 1 && H + 2 * Hkv == heads && H % Hkv == 0, "rope_write: ", heads,
              " heads do not split into H = ", H, " query heads and two sets of kv heads");
  if (cos.dim() == 4) cos = cos.select(2, 0), sin = sin.select(2, 0);  // [B or 1, T, 1, D]
  cos = cos.contiguous(), sin = sin.contiguous();
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.sizes() == cos.sizes() && cos.dim() == 3 &&
              (cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == T && cos.size(2) == D && D % 2 == 0,
              "rope_write: cos and sin must be [B or 1, T, D] float32 (D even)");
  for (const auto* t : {&keys, &values})
    TORCH_CHECK(t->is_cpu() && t->scalar_type() == torch::kFloat && t->dim() == 4 && t->size(0) == B &&
                t->size(1) == Hkv && t->size(3) == D && t->stride(3) == 1,
                "rope_write: keys and values must be [B, H_kv, C, D] float32 with rows of D contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == B,
              "rope_write: slots must be [B] int64");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] + T <= keys.size(2) && sp[b] + T <= values.size(2),
                "rope_write: row ", b, "'s slots ", sp[b], " .. ", sp[b] + T - 1, " lie past the cache buffers");
  const float* w = nullptr;
  if (norm.has_value() && norm->defined()) {
    TORCH_CHECK(norm->scalar_type() == torch::kFloat && norm->is_contiguous() && norm->numel() == (H + Hkv) * D,
                "rope_write: norm must be [H + H_kv, D] float32, contiguous");
    w = norm->data_ptr<float>();
  }
  auto q = torch::empty({B, T, H, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const int64_t table_b = cos.size(0) == B ? T * D : 0, half = D / 2;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, B * T, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(heads * D, 1)), [&](int64_t i0, int64_t i1) {
    std::vector<float> x(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / T, t = i % T, slot = sp[b] + t;
      const float* row = xp + i * heads * D;
      const float* c = cp + b * table_b + t * D;
      const float* s = snp + b * table_b + t * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        const float* src = row + h * D;
        if (w) {
          norm_row(src, w + h * D, D, e, x.data());
        } else {
          std::copy(src, src + D, x.begin());
        }
        float* dst = h < H ? qp + (i * H + h) * D
                           : kp + b * keys.stride(0) + (h - H) * keys.stride(1) + slot * keys.stride(2);
        for (int64_t d = 0; d < half; ++d) dst[d] = x[d] * c[d] + x[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) dst[d] = x[d] * c[d] + x[d - half] * s[d];
      }
      for (int64_t g = 0; g < Hkv; ++g) {
        const float* src = row + (H + Hkv + g) * D;
        std::copy(src, src + D, vp + b * values.stride(0) + g * values.stride(1) + slot * values.stride(2));
      }
    }
  });
  return q;
}

// Attention of q [B, T, H, D] float32 (contiguous) over keys and values [B, H_kv, >= S, D] float32 (rows of D
// contiguous) -> [B, T, H * D]: query head h reads kv head h / (H / H_kv), token t of row b the slots below S where
// mask [B, 1, T, S] float32 (additive, rows contiguous) is not -inf, or without a mask the slots up to S - T + t (causal
// over the last T). With counts [B] only row b's first counts[b] tokens are computed (the rest come back as zeros).
// Each query as attend_rows: its result depends only on the keys it sees, in slot order.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, int64_t S,
                        const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& counts) {
  TORCH_CHECK(supported(), "cpu_f32.attention: this CPU has no AVX2 and FMA");
  TORCH_CHECK(q.is_cpu() && q.dim() == 4 && q.is_contiguous() && q.scalar_type() == torch::kFloat,
              "attention: q must be [B, T, H, D] float32, contiguous");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  for (const auto* t : {&keys, &values})
    TORCH_CHECK(t->is_cpu() && t->scalar_type() == torch::kFloat && t->dim() == 4 && t->size(0) == B &&
                t->size(3) == D && t->stride(3) == 1 && t->size(2) >= S,
                "attention: keys and values must be [B, H_kv, >= S, D] float32 with rows of D contiguous");
  const int64_t Hkv = keys.size(1), group = H / std::max<int64_t>(Hkv, 1);
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0 && values.size(1) == Hkv, "attention: ", H, " query heads over ", Hkv,
              " kv heads");
  TORCH_CHECK(S >= T, "attention: S = ", S, " slots cannot hold the ", T, " new tokens");
  const float* mp = nullptr;
  int64_t mb = 0, mt = 0;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == torch::kFloat && mask->dim() == 4 && mask->size(0) == B && mask->size(1) == 1 &&
                mask->size(2) == T && mask->size(3) == S && mask->stride(3) == 1,
                "attention: mask must be [B, 1, T, S] float32 with rows contiguous");
    mp = mask->data_ptr<float>();
    mb = mask->stride(0), mt = mask->stride(2);
  }
  torch::Tensor cnt;
  const int64_t* np = nullptr;
  if (counts.has_value() && counts->defined()) {
    TORCH_CHECK(counts->scalar_type() == torch::kLong && counts->dim() == 1 && counts->size(0) == B,
                "attention: counts must be [B] int64");
    cnt = counts->contiguous();
    np = cnt.data_ptr<int64_t>();
  }
  auto out = torch::zeros({B, T, H * D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t Dq = (D + 7) / 8 * 8, P = S + 8;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    const int64_t R = group * T;  // a task's queries at most: its heads' at each token
    std::vector<float> qs(R * Dq, 0.0f), p(R * P), total(R);
    std::vector<const float*> masks(R);
    std::vector<int64_t> limit(R);
    std::vector<float*> outs(R);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv, Tb = np ? std::clamp<int64_t>(np[b], 0, T) : T;
      int64_t n = 0;
      for (int64_t t = 0; t < Tb; ++t) {
        const float* m = mp ? mp + b * mb + t * mt : nullptr;
        int64_t seen = mp ? S : S - T + t + 1;
        while (m && seen > 0 && m[seen - 1] == -INFINITY) --seen;  // the hidden slots past the last visible one
        for (int64_t h = g * group; h < (g + 1) * group; ++h, ++n) {
          const float* src = qp + ((b * T + t) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) qs[n * Dq + d] = src[d] * scale;
          masks[n] = m;
          limit[n] = seen;
          outs[n] = op + (b * T + t) * H * D + h * D;
        }
      }
      const float* k = kp + b * keys.stride(0) + g * keys.stride(1);
      const float* v = vp + b * values.stride(0) + g * values.stride(1);
      if (D % 8) {
        attend_rows<true>(qs.data(), Dq, n, k, keys.stride(2), v, values.stride(2), D, masks.data(), limit.data(),
                          p.data(), P, outs.data(), total.data());
      } else {
        attend_rows<false>(qs.data(), Dq, n, k, keys.stride(2), v, values.stride(2), D, masks.data(), limit.data(),
                           p.data(), P, outs.data(), total.data());
      }
    }
  });
  return out;
}

// One decoder layer's inference step on the packed weights of tlt/model/fused.py's FusedWeights, in one call: the
// arguments of the bf16 kernels' layer_step (csrc/cpu_bf16.cpp), on float32 weights packed for `linear` (or 4-bit
// ones with their scales), a float32 x [B, T, hidden] contiguous, float32 cos / sin and a float32 cache in the usual
// layout (paired and packed_keys false). With counts [B] x is packed, [N, hidden]: row b's first counts[b] tokens,
// rows in order, the rest of its T (cos.size(1)) padding; the products run over the N real tokens only, the cache
// sees the padding as zeros and the attention computes only the real tokens' queries. Each token's result is the
// same bit for bit either way, and whatever other tokens the call holds.
torch::Tensor layer_step(torch::Tensor x, double input_eps, std::vector<torch::Tensor> weights,
                         std::vector<int64_t> sizes, std::vector<c10::optional<torch::Tensor>> biases,
                         std::vector<c10::optional<torch::Tensor>> scales, int64_t H,
                         c10::optional<torch::Tensor> qk_norm, double qk_eps, double post_eps, torch::Tensor cos,
                         torch::Tensor sin, torch::Tensor keys, torch::Tensor values, torch::Tensor slots, int64_t S,
                         c10::optional<torch::Tensor> mask, bool paired, c10::optional<torch::Tensor> counts,
                         bool packed_keys) {
  TORCH_CHECK(!paired && !packed_keys, "cpu_f32.layer_step: a float32 cache in the usual layout only");
  const bool packed = counts.has_value() && counts->defined();
  TORCH_CHECK(x.dim() == (packed ? 2 : 3) && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              packed ? "layer_step: packed x must be [N, hidden] float32, contiguous"
                     : "layer_step: x must be [B, T, hidden] float32, contiguous");
  TORCH_CHECK(weights.size() == 4 && sizes.size() == 4 && biases.size() == 4 && scales.size() == 4,
              "layer_step: four products expected");
  const int64_t B = packed ? slots.size(0) : x.size(0), T = packed ? cos.size(1) : x.size(1);
  const int64_t hidden = x.size(-1), D = keys.size(3);
  TORCH_CHECK(S <= keys.size(2), "layer_step: S past the cache buffers");
  TORCH_CHECK(sizes[0] % D == 0, "layer_step: the q|k|v product's ", sizes[0], " columns are not heads of ", D);
  torch::Tensor rows;  // packed: each token's index in [B * T]
  if (packed) rows = packed_rows(*counts, B, T, x.size(0));
  auto x2 = x.view({-1, hidden});
  auto normed = input_eps < 0 ? x2 : rms_norm(x2.unsqueeze(0), c10::nullopt, input_eps).squeeze(0);
  auto qkv = linear(normed, weights[0], sizes[0], biases[0], c10::nullopt, scales[0]);
  if (packed) qkv = torch::zeros({B * T, sizes[0]}, qkv.options()).index_copy_(0, rows, qkv);
  auto q = rope_write(qkv.view({B, T, sizes[0] / D, D}), H, qk_norm, qk_eps, cos, sin, keys, values, slots);
  auto attended = attention(q, keys, values, S, mask, counts).view({B * T, -1});
  if (packed) attended = attended.index_select(0, rows);
  auto h = linear(attended, weights[1], sizes[1], biases[1], x2, scales[1]);
  auto normed_h = rms_norm(h.unsqueeze(0), c10::nullopt, post_eps).squeeze(0);
  auto act = silu_mul(linear(normed_h, weights[2], sizes[2], biases[2], c10::nullopt, scales[2]));
  return linear(act, weights[3], sizes[3], biases[3], h, scales[3]).view(x.sizes());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported);
  m.def("linear", &linear, "x @ W^T (+ bias) (+ residual) on a weight packed in groups of 16 columns (float32, or "
        "4-bit codes with their scales)", py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none(), py::arg("scales") = py::none());
  m.def("rms_norm", &rms_norm, "x / rms(x) over the last dimension (* weight)", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a stacked gate|up product [M, 2 I]", py::arg("gate_up"));
  m.def("rope_write", &rope_write, "q/k per-head norm, RoPE and the cache write of a layer's q|k|v; returns q",
        py::arg("qkv"), py::arg("H"), py::arg("norm"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
        py::arg("values"), py::arg("slots"));
  m.def("attention", &attention, "attention of q [B, T, H, D] over a float32 cache's first S slots", py::arg("q"),
        py::arg("keys"), py::arg("values"), py::arg("S"), py::arg("mask"), py::arg("counts") = py::none());
  m.def("layer_step", &layer_step, py::arg("x"), py::arg("input_eps"), py::arg("weights"), py::arg("sizes"),
        py::arg("biases"), py::arg("scales"), py::arg("H"), py::arg("qk_norm"), py::arg("qk_eps"), py::arg("post_eps"),
        py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("S"),
        py::arg("mask"), py::arg("paired") = false, py::arg("counts") = py::none(), py::arg("packed_keys") = false);
  m.def("tree_mask", &tree_mask, py::arg("lengths"), py::arg("tree"), py::arg("valid"), py::arg("S"));
}
