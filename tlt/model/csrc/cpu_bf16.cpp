// bf16 inference kernels for the CPU decode step (AVX-512 BF16), compiled on first use by
// tlt/model/cpu_kernels.py.
//
// linear: out[M, N] = bf16(x[M, K] @ W[N, K]^T (+ bias) (+ residual)), float32 accumulation.
// The weight is packed once (cpu_kernels.pack) into groups of GROUP = 64 output columns,
// packed[g][k / 2][c][2] = W[64 g + c][k], W[64 g + c][k + 1], so a group streams as one contiguous run
// and each 64-byte line feeds one vdpbf16ps (16 columns x 2 k). Each output element is one float32
// accumulator summed over k in increasing pairs, whichever row block, task or thread computes it and
// however many rows are multiplied: a row's result is the same bit for bit at every M (a draft's
// verification sees the logits plain decoding sees).
//
// rms_norm: out = bf16(x * rsqrt(mean(x^2) + eps) (* weight)) over the last dimension, in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t GROUP = 64;  // output columns per packed group: 4 zmm of 16 float32
constexpr int64_t ROWS = 6;    // rows per register block: 6 x 4 accumulators + 4 weights + 1 input
constexpr int64_t CHUNK = 48;  // rows per task: a weight group (K * 128 bytes) stays in L2 while they pass

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int R>
TARGET void block(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, float* acc_out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * GROUP * 2;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
    __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < R; ++r) {
      // x[r][2p], x[r][2p + 1] broadcast as one 32-bit pair
      __m512bh xb = (__m512bh)_mm512_castps_si512(
          _mm512_set1_ps(*reinterpret_cast<const float*>(x + r * x_stride + 2 * p)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + r * GROUP + c * 16, acc[r][c]);
}

using Block = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*);
constexpr Block BLOCKS[ROWS + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>, block<5>, block<6>};

TARGET inline __m512 load_bf16(__mmask16 m, const uint16_t* p) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET inline void store_bf16(__mmask16 m, uint16_t* p, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

// out[c] = bf16(acc[c] (+ bias[c]) (+ residual[c])) for c < cols
TARGET void finish(const float* acc, const float* bias, const uint16_t* residual, uint16_t* out, int64_t cols) {
  for (int64_t c = 0; c < cols; c += 16) {
    __mmask16 m = tail_mask(cols - c);
    __m512 v = _mm512_maskz_loadu_ps(m, acc + c);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
    if (residual) v = _mm512_add_ps(v, load_bf16(m, residual + c));
    store_bf16(m, out + c, v);
  }
}

TARGET float sum_squares(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load_bf16(tail_mask(n - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

TARGET void scale_row(const uint16_t* x, float s, const float* weight, uint16_t* out, int64_t n) {
  __m512 sv = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_mul_ps(load_bf16(m, x + i), sv);
    if (weight) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weight + i));
    store_bf16(m, out + i, v);
  }
}

}  // namespace

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// x [M, K] bf16 (rows contiguous), packed [G, K / 2, 64, 2] bf16, bias [N] float32 or undefined,
// residual [M, N] bf16 (rows contiguous) or undefined -> [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "linear: x must be [M, K] bf16 with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == GROUP && packed.size(3) == 2,
              "linear: packed must come from cpu_kernels.pack");
  int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs * 2 == K, "linear: x has ", K, " columns, the packed weight ", pairs * 2);
  TORCH_CHECK(N > (groups - 1) * GROUP && N <= groups * GROUP, "linear: N does not match the packed weight");
  const float* b = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "linear: bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  const uint16_t* res = nullptr;
  int64_t res_stride = 0;
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == torch::kBFloat16 && residual->dim() == 2 && residual->size(0) == M &&
                residual->size(1) == N && residual->stride(1) == 1, "linear: residual must be [M, N] bf16");
    res = reinterpret_cast<const uint16_t*>(residual->data_ptr());
    res_stride = residual->stride(0);
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t xs = x.stride(0), chunks = (M + CHUNK - 1) / CHUNK;
  // One task: one weight group times one chunk of rows.
  at::parallel_for(0, groups * chunks, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[ROWS * GROUP];
    for (int64_t t = t0; t < t1; ++t) {
      int64_t g = t / chunks, m_end = std::min(M, (t % chunks + 1) * CHUNK);
      const uint16_t* wg = wp + g * pairs * GROUP * 2;
      int64_t cols = std::min(GROUP, N - g * GROUP);
      for (int64_t m0 = (t % chunks) * CHUNK; m0 < m_end; m0 += ROWS) {
        int64_t rows = std::min(ROWS, m_end - m0);
        BLOCKS[rows](xp + m0 * xs, xs, wg, pairs, acc);
        for (int64_t r = 0; r < rows; ++r)
          finish(acc + r * GROUP, b ? b + g * GROUP : nullptr,
                 res ? res + (m0 + r) * res_stride + g * GROUP : nullptr, op + (m0 + r) * N + g * GROUP, cols);
      }
    }
  });
  return out;
}

// x [A, R, D] bf16 with contiguous rows of D (any strides otherwise: a slice of heads), weight [D] or
// [R, D] float32 or undefined -> contiguous [A, R, D] bf16.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kBFloat16 && x.stride(2) == 1,
              "rms_norm: x must be [A, R, D] bf16 with contiguous rows");
  int64_t A = x.size(0), R = x.size(1), D = x.size(2);
  const float* w = nullptr;
  int64_t w_stride = 0;
  if (weight && weight->defined()) {
    TORCH_CHECK(weight->scalar_type() == torch::kFloat32 && weight->is_contiguous() &&
                (weight->numel() == D || weight->numel() == R * D), "rms_norm: weight must be [D] or [R, D] float32");
    w = weight->data_ptr<float>();
    w_stride = weight->numel() == D ? 0 : D;
  }
  auto out = torch::empty({A, R, D}, x.options());
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t sa = x.stride(0), sr = x.stride(1);
  // Rows are short (a head, a hidden state): one thread, no fork.
  for (int64_t a = 0; a < A; ++a)
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* row = xp + a * sa + r * sr;
      float s = 1.0f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) + static_cast<float>(eps));
      scale_row(row, s, w ? w + r * w_stride : nullptr, op + (a * R + r) * D, D);
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported);
  m.def("linear", &linear);
  m.def("rms_norm", &rms_norm);
}
