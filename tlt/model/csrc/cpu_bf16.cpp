// bf16 inference kernels for the CPU decode step (AVX-512 BF16), compiled on first use by
// tlt/model/cpu_kernels.py.
//
// linear: out[M, N] = bf16(x[M, K] @ W[N, K]^T (+ bias) (+ residual)), float32 accumulation.
// The weight is packed once (cpu_kernels.pack) into groups of GROUP = 32 output columns,
// packed[g][k / 2][c][2] = W[32 g + c][k], W[32 g + c][k + 1], so a group streams as one contiguous run
// and each 64-byte line feeds one vdpbf16ps (16 columns x 2 k). Up to 12 rows take one pass over a
// group (12 x 2 accumulators in registers), so a 9-17 token verification streams each weight once or
// twice. Each output element is one float32
// accumulator summed over k in increasing pairs, whichever row block, task or thread computes it and
// however many rows are multiplied: a row's result is the same bit for bit at every M (a draft's
// verification sees the logits plain decoding sees).
// 4-bit weights (a drafter's, where a few rows' products stream its weights from memory) take the same
// path on a quarter of the bytes (block4).
//
// With `silu` the weight stacks gate over up (N = 2 I, I a multiple of GROUP) and linear returns
// bf16(silu(gate) * up) [M, I] directly: each task takes gate group g and up group g + I / GROUP, rounds both
// products to bf16 as the plain product would store them and applies silu_mul's arithmetic, so the bits are
// those of silu_mul(linear(...)) while the [M, 2 I] product is neither written nor read back (bench policy,
// 216 rows: the gate|up product's output lines cost about a tenth of the layer's products).
//
// rms_norm: out = bf16(x * rsqrt(mean(x^2) + eps) (* weight)) over the last dimension, in float32.
//
// rope_write: the q/k per-head norm, RoPE and the cache write of one layer's stacked q|k|v in one pass:
// q comes back, k and v go straight into the cache (bf16, or float32 holding bf16 values) at each row's
// next slots. q and k are rounded to bf16 after the norm and after the rotation (the rotation in float32),
// as the reference layer rounds them, so the cache holds the same values whichever path wrote it.
//
// attention: bf16 queries over bf16 or float32 keys and values (the CPU cache of a bf16 model), the queries of
// one kv head together. Scores are linear's product of the queries with the head's keys, packed as a
// weight once per call, or kept so by the cache where no AMX runs (packed keys, key_word), read in place
// (a key's score is the same arithmetic wherever it sits), and the weighted sum of
// values and the sum of weights run in slot order, where masked keys (an additive -inf) add exact zeros:
// a query's result depends only on the keys it sees, in their order, not on how many queries share the
// forward or which masked keys lie between. 17 queries per kv head over 217 keys: 90 us a layer against
// 223 with a lane reduction per score.
// A bf16 cache on the CPU keeps its values paired (two slots' dimensions interleaved, tlt/model/kv_cache.py),
// the layout of an AMX B tile over slots. Each row's weighted sum runs on weights rounded to bf16 up to a split
// fixed by the count of keys the row sees, then in float32 in slot order, so a tree node still gets plain
// decoding's bits (bf16_split): on AMX on the tiles, with the keys as A tiles as they lie in the cache (no
// packing); on AVX-512 as VDPBF16PS over the paired values, two slots an instruction (dot_values; the 2-core
// EPYC, 32 rows x 400-800 cached tokens through twelve layers: 0.74x the attention's time at nine tokens a row
// against float32 FMAs, 0.91-0.94x at one). On AMX (a 2-core Xeon), bench policy (16 heads, 8 kv heads of 48),
// 24 rows x 1,200 cached tokens, a layer: 2.08 ms at one token a row and 3.53 at nine, against 2.60 and 5.65 with
// the keys packed per call and the weighted sums in float32 FMAs (medians of 7, 12 caches so nothing stays in
// cache; 64 rows x 300: 1.53 and 3.09 against 2.01 and 4.43).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "shared.h"

namespace {

constexpr int64_t GROUP = 32;  // output columns per packed group: 2 zmm of 16 float32
constexpr int64_t ROWS = 12;   // rows per register block: 12 x 2 accumulators + 2 weights + 1 input
constexpr int64_t CHUNK = 48;  // rows per task: a weight group (K * 64 bytes) stays in L2 while they pass
// Weight elements (4 KB) prefetched ahead into L2: compute-heavy blocks (9-12 rows) otherwise stall on the
// stream (a 9-row product over 230 MB: 9.3 ms against 12.1 without; one row unchanged). A group's later row
// blocks read it from L2 and prefetch the next group instead, so the stream never pauses while they compute
// (17 rows over 296 MB: 17.1 against 17.8 ms, medians of 21 alternating runs). The distance: on the 2-core
// EPYC the bench policy's products through twelve layers (scripts/kernel_ab.py --linear 1 9 24) take 0.95-0.98x
// the time at one row with 2,048 elements ahead than with 4,096, 0.96x at nine rows, 0.99-1.00x at 24 (two
// runs); 1,024 ahead 1.18x at nine, 8,192 1.07-1.10x.
constexpr int64_t PREFETCH = 2048;

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// R rows x one group: acc_out[r][c] = sum over pairs p of x[r][2p, 2p+1] . w[p][c]; the lines at prefetch + p * 64
// elements go to L2 as pair p is read.
template <int R>
TARGET void block(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, float* acc_out,
                  const uint16_t* prefetch) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * GROUP * 2;
    const uint16_t* ahead = prefetch + p * GROUP * 2;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 32), _MM_HINT_T1);
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    for (int r = 0; r < R; ++r) {
      // x[r][2p], x[r][2p + 1] broadcast as one 32-bit pair
      __m512bh xb = (__m512bh)_mm512_castps_si512(
          _mm512_set1_ps(*reinterpret_cast<const float*>(x + r * x_stride + 2 * p)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc_out + r * GROUP, acc[r][0]);
    _mm512_storeu_ps(acc_out + r * GROUP + 16, acc[r][1]);
  }
}

using Block = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, const uint16_t*);

// 4-bit weights (a drafter's, cpu_kernels.pack4): per 32-column group, pair p is 32 bytes whose byte i holds,
// in its low nibble, code m of element i of the bf16 pair line of columns 0-15 (column i / 2, k = 2p + i % 2)
// and, in its high nibble, the same element for columns 16-31. A code m becomes the bf16 number 128 + m in
// two integer operations (zero-extend, then OR the exponent of 128 into the mantissa's low bits), so the
// products run on vdpbf16ps as bf16 weights do. Weight w[k][c] = scale[j][c] m + low[j][c] over the k-group j
// (pairs / qgroups pairs: 64, 32 or 16, or all of K), so per k-group and row the block adds scale * acc +
// shift * xsum, shift = low - 128 scale and xsum the row's sum of x over the k-group (linear computes it
// once per row). The prefetch runs PREFETCH bytes (2 K elements of bf16, 4 K codes here) ahead.
template <int R>
TARGET void block4(const uint16_t* x, int64_t x_stride, const uint8_t* w, int64_t pairs, const float* scale_shift,
                   const float* xsum, int64_t qgroups, float* acc_out, const uint8_t* prefetch) {
  const __m512i exponent = _mm512_set1_epi16(0x4300), nibble = _mm512_set1_epi16(0x000f);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc_out + r * GROUP, _mm512_setzero_ps());
    _mm512_storeu_ps(acc_out + r * GROUP + 16, _mm512_setzero_ps());
  }
  int64_t per_group = pairs / qgroups;
  for (int64_t j = 0; j < qgroups; ++j) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = j * per_group; p < (j + 1) * per_group; ++p) {
      if (!(p & 1)) _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 32), _MM_HINT_T1);
      __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
      // (codes & 0xf) | 0x4300 and (codes >> 4) | 0x4300
      __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(codes, nibble, exponent, 0xea);
      __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(codes, 4), exponent);
      for (int r = 0; r < R; ++r) {
        __m512bh xb = (__m512bh)_mm512_castps_si512(
            _mm512_set1_ps(*reinterpret_cast<const float*>(x + r * x_stride + 2 * p)));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      }
    }
    const float* ss = scale_shift + j * 2 * GROUP;  // scale[32], then shift[32]
    __m512 s0 = _mm512_loadu_ps(ss), s1 = _mm512_loadu_ps(ss + 16);
    __m512 b0 = _mm512_loadu_ps(ss + GROUP), b1 = _mm512_loadu_ps(ss + GROUP + 16);
    for (int r = 0; r < R; ++r) {
      __m512 xs = _mm512_set1_ps(xsum[r * qgroups + j]);
      float* o = acc_out + r * GROUP;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(s0, acc[r][0], _mm512_fmadd_ps(b0, xs, _mm512_loadu_ps(o))));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(s1, acc[r][1], _mm512_fmadd_ps(b1, xs, _mm512_loadu_ps(o + 16))));
    }
  }
}


// AMX (Intel's tile unit, where the CPU has it): the same product on the same packed weights, 16 pairs of k
// at a time. A pair line of the packed group holds 16 columns' pairs in its first 64 bytes and the other 16
// in its second, so a B tile is 16 consecutive pair lines' halves (row stride 128 bytes), in the layout
// TDPBF16PS reads; the A tile is R rows x 32 k of x. At 9-17 rows the AVX-512 block is bound by its
// arithmetic (~235 GFLOP/s on two cores of a Xeon with AMX, against ~1.9 TFLOP/s for oneDNN's AMX products),
// so a draft's verification costs 1.5-2.6x a one-token step there; on tiles it streams the weights. Each
// output element is still one float32 accumulator over k in increasing order, whatever the row block, so a
// row's result does not depend on the row count as long as every product of the weight takes the tiles,
// which they do whatever M (the choice depends on the machine and K only): the tiles' sums can differ from
// the AVX-512 block's in the last bit. At one row the tiles stream about as fast (92 MB of weights: 1.77
// against 1.71 ms), at 8 rows 1.8x faster (1.87 against 3.31 ms).
#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 configured with rows[t] rows of colsb[t] bytes.
TARGET_AMX void tile_configure(const uint8_t* rows, const uint16_t* colsb) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  asm volatile("" : : "r"(&c) : "memory");  // GCC does not see ldtilecfg read c: keep the stores above
  _tile_loadconfig(&c);
}

// tiles 0, 1: C (R rows x 16 float32) for columns 0-15, 16-31; tile 2: A (R rows x 32 bf16); tiles 3, 4: B
TARGET_AMX void amx_configure(int64_t R) {
  uint8_t rows[8] = {(uint8_t)R, (uint8_t)R, (uint8_t)R, 16, 16, 0, 0, 0};
  uint16_t colsb[8] = {64, 64, 64, 64, 64, 0, 0, 0};
  tile_configure(rows, colsb);
}

TARGET_AMX void amx_release() { _tile_release(); }

constexpr int64_t AMX_ROWS = 16;

// Many rows on tiles: one pass of amx_block per 16-row block reads the group's weights (48 KB at K = 768, more
// than L1 beside the rows) from L2 for every block. Sliced over k, each slice's weight tiles (16 KB) serve all the
// chunk's row blocks from L1 while the next slice is prefetched: the bench policy's four layer products at 64-312
// rows 1.17-1.34x faster (2 threads; 128 rows: 0.82 against 1.10 ms), one to 24 rows unchanged.
constexpr int64_t AMX_CHUNK = 128;  // rows per task on tiles: a k-slice of the group's weights serves 8 row blocks
constexpr int64_t AMX_SLICE = 8;    // k-steps of 32 per slice: 16 KB of the group's B tiles, kept in L1 across blocks
constexpr int AMX_PF = 4;           // lines of the next slice's B prefetched to L1 per k-step of each block's pass
constexpr int64_t AMX_RUN = 8;      // groups a task takes chunk by chunk (linear): their weights beside a chunk in L2

// The configured rows (<= 16) x one group over `steps` k-steps of 32 from where x and w point (tiles as
// amx_configure sets them); C starts at zero (first) or from c, and goes back to c (row stride GROUP floats):
// storing and reloading a C tile is exact, so the k-steps still sum into one float32 accumulator per element in
// increasing order. pf: lines to prefetch (AMX_PF a step) or null.
TARGET_AMX void amx_slice(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t steps, float* c, bool first,
                          const char* pf) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_loadd(0, c, GROUP * 4);
    _tile_loadd(1, c + 16, GROUP * 4);
  }
  for (int64_t s = 0; s < steps; ++s) {
    if (pf)
      for (int i = 0; i < AMX_PF; ++i) _mm_prefetch(pf + (s * AMX_PF + i) * 64, _MM_HINT_T0);
    _tile_loadd(2, x + 32 * s, x_stride * 2);
    _tile_loadd(3, w + s * 16 * GROUP * 2, GROUP * 4);
    _tile_loadd(4, w + s * 16 * GROUP * 2 + 32, GROUP * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, c, GROUP * 4);
  _tile_stored(1, c + 16, GROUP * 4);
}

// acc_out[r][c] for the configured rows x one group, the whole of K (pairs a multiple of 16) in one pass
TARGET_AMX void amx_block(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, float* acc_out) {
  amx_slice(x, x_stride, w, pairs / 16, acc_out, true, nullptr);
}

// Whether this process may run AMX: the CPU has AMX-BF16 and AMX-TILE, and Linux granted the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). TLT_AMX=0 turns it off.
bool amx_granted() {
  static const bool granted = [] {  // initialised once, thread-safely
    unsigned a, b, c, d;
    const char* env = std::getenv("TLT_AMX");
    bool cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
    return cpu && !(env && env[0] == '0') && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return granted;
}
bool amx_on = true;  // set_amx: tests take either unit where both run

using Block4 = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const float*, const float*, int64_t, float*,
                        const uint8_t*);

// The next block's rows out of `left`: blocks of at most ROWS, as even as they divide (13 rows: 7 + 6).
inline int64_t block_rows(int64_t left) {
  int64_t blocks = (left + ROWS - 1) / ROWS;
  return (left + blocks - 1) / blocks;
}
constexpr Block BLOCKS[ROWS + 1] = {nullptr,   block<1>, block<2>, block<3>,  block<4>,  block<5>, block<6>,
                                    block<7>, block<8>, block<9>, block<10>, block<11>, block<12>};
constexpr Block4 BLOCKS4[ROWS + 1] = {nullptr,    block4<1>, block4<2>,  block4<3>,  block4<4>,
                                      block4<5>,  block4<6>, block4<7>,  block4<8>,  block4<9>,
                                      block4<10>, block4<11>, block4<12>};

TARGET inline __m512 load_bf16(__mmask16 m, const uint16_t* p) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET inline void store_bf16(__mmask16 m, uint16_t* p, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// v rounded to bf16 (to nearest even, as torch rounds), as float32
TARGET inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
inline __mmask16 count_mask(int64_t n) { return n <= 0 ? (__mmask16)0 : tail_mask(n); }  // n may be <= 0

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

TARGET float sum_values(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_add_ps(acc, load_bf16(tail_mask(n - i), x + i));
  return _mm512_reduce_add_ps(acc);
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

// exp(x) for x <= 0 (a max-subtracted score), float32 to about 2 ulp: x = n ln2 + r, exp(r) by its
// degree-7 expansion (Cephes' expf coefficients), scaled by 2^n; below -87.3 (and -inf) exactly 0.
TARGET inline __m512 exp_nonpositive(__m512 x) {
  __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// silu(x) * u of bf16 values (as float32): silu rounded to bf16 first, as torch computes it in bf16.
TARGET inline __m512 silu_times(__m512 x, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
  __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  __m512 sig = _mm512_mask_mul_ps(r, negative, e, r);  // x < 0: e / (1 + e)
  return _mm512_mul_ps(round_bf16(_mm512_mul_ps(x, sig)), u);
}

// One row of a gate|up product's two groups (gate, up: GROUP float32 sums each; biases or null) -> GROUP
// bf16 of silu(gate) * up, each sum rounded to bf16 first as finish would store it.
TARGET void finish_silu(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
                        uint16_t* out) {
  for (int64_t c = 0; c < GROUP; c += 16) {
    __m512 g = _mm512_loadu_ps(gate + c), u = _mm512_loadu_ps(up + c);
    if (gate_bias) g = _mm512_add_ps(g, _mm512_loadu_ps(gate_bias + c));
    if (up_bias) u = _mm512_add_ps(u, _mm512_loadu_ps(up_bias + c));
    store_bf16(0xffff, out + c, silu_times(round_bf16(g), round_bf16(u)));
  }
}

// 16 cached keys' or values' elements (float32 or bf16 cache) as float32.
TARGET inline __m512 load_kv(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
TARGET inline __m512 load_kv(__mmask16 m, const uint16_t* p) { return load_bf16(m, p); }

constexpr int64_t MAX_CHUNKS = 8;  // head dims up to 128

// r[i][j] -> r[j][i] for sixteen vectors of sixteen 32-bit elements
TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Pairs p0 .. p0 + 15 of a key's dimensions as 32-bit (bf16, bf16) elements, zero past n of them.
TARGET inline __m512i key_pairs(const uint16_t* key, int64_t p0, int64_t n) {
  return _mm512_maskz_loadu_epi32(count_mask(n), key + 2 * p0);
}
TARGET inline __m512i key_pairs(const float* key, int64_t p0, int64_t n) {  // float32 holding bf16 values
  const __m512i upper_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                                27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  __m512i lo = _mm512_castps_si512(_mm512_maskz_loadu_ps(count_mask(2 * n), key + 2 * p0));
  __m512i hi = _mm512_castps_si512(_mm512_maskz_loadu_ps(count_mask(2 * n - 16), key + 2 * p0 + 16));
  return _mm512_permutex2var_epi16(lo, upper_halves, hi);
}

// Rows ahead of the one being packed whose keys (to L1) and values (to L2, read by the weighted sum after the
// scores) are prefetched: the cache streams from memory at long contexts and the packing's arithmetic
// otherwise waits on it (24 rows x 1,200 cached tokens, bench policy, a layer: 2.98 -> 2.29 ms at one
// token, 5.93 -> 5.06 at nine; 16 rows ahead did better than 32, 64 or 128).
constexpr int64_t KV_AHEAD = 16;

// The cache lines of rows from .. to - 1 (clipped to S) of an [S, D] array with row stride `stride`.
template <typename KV>
inline void prefetch_rows(const KV* p, int64_t stride, int64_t from, int64_t to, int64_t S, int64_t D, int hint) {
  to = std::min(to, S);
  if (from >= to) return;
  const char* last = reinterpret_cast<const char*>(p + (to - 1) * stride + D);
  for (const char* c = reinterpret_cast<const char*>(p + from * stride); c < last; c += 64)
    _mm_prefetch(c, static_cast<_mm_hint>(hint));
}

// Packed keys (a bf16 cache's keys kept as pack_keys would pack them, tlt/model/kv_cache.py `packed_keys`): each
// GROUP slots of a [C, D] key plane (C a multiple of GROUP) are a weight group of D / 2 pairs, pair p of slot s the
// 32-bit word key_word(s, p, D / 2) of the plane, so the attention's scores read the keys as they lie instead of
// packing every cached key each call (twelve layers, `kernel_ab.py --old-keys natural`: bench policy, 0.92-0.93x the
// attention's time at 32 rows x 800 cached tokens, one or nine tokens a row, 0.86-0.88x at 16 x 1,500; 32 query heads
// over 8 kv heads of 128, one token a row, 0.71-0.74x). Ahead has fetched the task's keys and values into L2 already:
// prefetching the next group of keys or this group's values as the scores run gains nothing more.
inline int64_t key_word(int64_t s, int64_t p, int64_t pairs) { return (s / GROUP * pairs + p) * GROUP + s % GROUP; }

// Keys [S, D] (bf16, or float32 holding bf16 values; row stride ks) packed as linear's weights, one key per
// output column: packed[g][p][c] = the pair (2p, 2p + 1) of key 32 g + c, zero past S and from pair D / 2 to
// `pairs` (the tiles' 16-pair steps); sixteen keys by sixteen pairs transposed at a time. The values [S, D]
// (row stride vs) are prefetched to L2 alongside.
template <typename KV>
TARGET void pack_keys(const KV* k, int64_t ks, int64_t S, int64_t D, int64_t pairs, uint32_t* packed, const KV* v,
                      int64_t vs) {
  int64_t used = D / 2;
  prefetch_rows(k, ks, 0, KV_AHEAD, S, D, _MM_HINT_T0);
  prefetch_rows(v, vs, 0, KV_AHEAD, S, D, _MM_HINT_T1);
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    prefetch_rows(k, ks, s0 + KV_AHEAD, s0 + KV_AHEAD + 16, S, D, _MM_HINT_T0);
    prefetch_rows(v, vs, s0 + KV_AHEAD, s0 + KV_AHEAD + 16, S, D, _MM_HINT_T1);
    uint32_t* group = packed + key_word(s0, 0, pairs);
    for (int64_t p0 = 0; p0 < used; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = s0 + i < S ? key_pairs(k + (s0 + i) * ks, p0, used - p0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < std::min<int64_t>(16, used - p0); ++j) _mm512_storeu_si512(group + (p0 + j) * GROUP, r[j]);
    }
    for (int64_t p = used; p < pairs; ++p) _mm512_storeu_si512(group + p * GROUP, _mm512_setzero_si512());
  }
  if (S % GROUP != 0 && S % GROUP <= 16)  // the last group's second half: keys past S
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(packed + key_word(S / GROUP * GROUP + 16, p, pairs), _mm512_setzero_si512());
}

// Sixteen dimensions of two neighbouring slots' values in the paired layout (below) as float32: the even slot's
// are the 32-bit lanes' low halves, the odd slot's their high halves.
TARGET inline __m512 even_slot(__m512i pair) { return _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)); }
TARGET inline __m512 odd_slot(__m512i pair) {
  return _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// out[r] = bf16(sum over s of p[r][s] v[s] / total[r]) for N rows of weights p (row stride `stride`) over the values
// of slots from .. S - 1, float32 sums in slot order, starting from init[r] (row stride D; null: zero).
// Natural values: [S, D], row stride vs. PAIRED (bf16 only): slots 2i and 2i + 1 share the 2 D elements from
// 2 i vs on, dimension d of slot s at 2 d + s % 2 (the AMX tiles' layout for a product over slots); `from` is
// even and a weight past S (the odd partner of the last slot) must be zero.
template <int C, int N, bool PAIRED, typename KV>
TARGET void weighted_values(const float* p, int64_t stride, int64_t from, int64_t S, const KV* v, int64_t vs,
                            __mmask16 last, const float* init, int64_t D, const float* total, uint16_t* const* out) {
  __m512 acc[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = init ? _mm512_maskz_loadu_ps(c == C - 1 ? last : (__mmask16)0xffff, init + r * D + 16 * c)
                       : _mm512_setzero_ps();
  if constexpr (PAIRED) {
    for (int64_t s = from; s < S; s += 2) {
      const uint16_t* pr = reinterpret_cast<const uint16_t*>(v) + s / 2 * 2 * vs;
      for (int c = 0; c < C; ++c) {
        __m512i x = _mm512_maskz_loadu_epi32(c == C - 1 ? last : (__mmask16)0xffff, pr + 32 * c);
        __m512 even = even_slot(x), odd = odd_slot(x);
        for (int r = 0; r < N; ++r) {
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + s]), even, acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + s + 1]), odd, acc[r][c]);
        }
      }
    }
  } else {
    for (int64_t s = from; s < S; ++s) {
      const KV* vr = v + s * vs;
      for (int c = 0; c < C; ++c) {
        __m512 vc = load_kv(c == C - 1 ? last : (__mmask16)0xffff, vr + 16 * c);
        for (int r = 0; r < N; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + s]), vc, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c)
      store_bf16(c == C - 1 ? last : (__mmask16)0xffff, out[r] + 16 * c,
                 _mm512_mul_ps(acc[r][c], _mm512_set1_ps(1.0f / total[r])));
}

// The sum of a row's weights, fed 16 at a time in slot order: its nonzero ones summed 16 lanes at a time as if
// they stood next to each other, so the exact zeros of masked keys between them change nothing (a tree node's
// weights then sum as plain decoding's, which has the same weights with nothing between). A scalar sum in slot
// order would do the same at one add a key and row (24 rows x 1,200 cached tokens, nine tokens a row: 5.38
// against 5.15 ms a layer; one token 2.57 against 2.49).
struct PackedSum {
  alignas(64) float staged[32];  // nonzero weights not yet added: `fill` of them
  __m512 sum;
  int64_t fill = 0;

  TARGET PackedSum() : sum(_mm512_setzero_ps()) {}

  TARGET void add(__m512 x) {
    __mmask16 nonzero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (nonzero == 0xffff && fill == 0) {  // sixteen in a row, nothing staged: the common case
      sum = _mm512_add_ps(sum, x);
      return;
    }
    _mm512_mask_compressstoreu_ps(staged + fill, nonzero, x);
    fill += __builtin_popcount(nonzero);
    if (fill >= 16) {
      sum = _mm512_add_ps(sum, _mm512_load_ps(staged));
      fill -= 16;
      _mm512_store_ps(staged, _mm512_loadu_ps(staged + 16));
    }
  }

  TARGET float total() const {
    return _mm512_reduce_add_ps(_mm512_add_ps(sum, _mm512_maskz_load_ps(count_mask(fill), staged)));
  }
};

// pass(std::integral_constant<int, n>{}, r0) over R rows: blocks of n = BLOCK (at most 8) rows, then the rest in
// one block of its own size (a block's row count is a template argument: its sums stay in registers).
template <int BLOCK, typename F>
TARGET void row_blocks(int64_t R, const F& pass) {
  static_assert(BLOCK <= 8, "row_blocks: at most 8 rows a block");
  int64_t r0 = 0;
  for (; r0 + BLOCK <= R; r0 += BLOCK) pass(std::integral_constant<int, BLOCK>{}, r0);
  auto rest = [&](auto rows) {
    if constexpr (decltype(rows)::value < BLOCK) pass(rows, r0);
  };
  switch (R - r0) {
    case 1: rest(std::integral_constant<int, 1>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 4: rest(std::integral_constant<int, 4>{}); break;
    case 5: rest(std::integral_constant<int, 5>{}); break;
    case 6: rest(std::integral_constant<int, 6>{}); break;
    case 7: rest(std::integral_constant<int, 7>{}); break;
    default: break;
  }
}

// weighted_values over R rows, BLOCK rows a pass (BLOCK * C accumulators in registers) and the rest in one block
// of their own size (each row's sums are the same in any block). from[r]: where row r's sums start (its weights
// before are already summed into init); a block starts at its rows' least and zeroes the weights of a row from
// there to the row's own start.
template <int C, bool PAIRED, typename KV>
TARGET void value_passes(const float* p, int64_t stride, int64_t R, const int64_t* from, int64_t S, const KV* v,
                         int64_t vs, __mmask16 last, const float* init, int64_t D, const float* total,
                         uint16_t* const* out) {
  constexpr int BLOCK = C <= 4 ? 6 : 3;
  auto pass = [&](auto rows, int64_t r0) {
    constexpr int n = decltype(rows)::value;
    int64_t start = *std::min_element(from + r0, from + r0 + n);
    for (int64_t r = r0; r < r0 + n; ++r)
      if (from[r] > start) std::memset(const_cast<float*>(p) + r * stride + start, 0, (from[r] - start) * 4);
    weighted_values<C, n, PAIRED>(p + r0 * stride, stride, start, S, v, vs, last, init ? init + r0 * D : nullptr, D,
                                  total + r0, out + r0);
  };
  row_blocks<BLOCK>(R, pass);
}

// Tile numbers are instructions' immediates: these pick them from a small variable.
TARGET_AMX inline void tile_load(int t, const void* p, int64_t stride) {
  switch (t) {
    case 0: _tile_loadd(0, p, stride); break;
    case 1: _tile_loadd(1, p, stride); break;
    case 2: _tile_loadd(2, p, stride); break;
    case 3: _tile_loadd(3, p, stride); break;
    case 4: _tile_loadd(4, p, stride); break;
    case 5: _tile_loadd(5, p, stride); break;
    case 6: _tile_loadd(6, p, stride); break;
    default: _tile_loadd(7, p, stride); break;
  }
}
TARGET_AMX inline void tile_store(int t, void* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    case 3: _tile_stored(3, p, stride); break;
    case 4: _tile_stored(4, p, stride); break;
    default: _tile_stored(5, p, stride); break;
  }
}
TARGET_AMX inline void tile_clear(int t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    case 3: _tile_zero(3); break;
    case 4: _tile_zero(4); break;
    default: _tile_zero(5); break;
  }
}
// C tile 6 += A tile a (0-3) . B tile b (4 or 5)
TARGET_AMX inline void scores_product(int a, int b) {
  if (b == 4) {
    switch (a) {
      case 0: _tile_dpbf16ps(6, 0, 4); break;
      case 1: _tile_dpbf16ps(6, 1, 4); break;
      case 2: _tile_dpbf16ps(6, 2, 4); break;
      default: _tile_dpbf16ps(6, 3, 4); break;
    }
  } else {
    switch (a) {
      case 0: _tile_dpbf16ps(6, 0, 5); break;
      case 1: _tile_dpbf16ps(6, 1, 5); break;
      case 2: _tile_dpbf16ps(6, 2, 5); break;
      default: _tile_dpbf16ps(6, 3, 5); break;
    }
  }
}
// C tile c (0-5) += A tile 6 . B tile 7
TARGET_AMX inline void values_product(int c) {
  switch (c) {
    case 0: _tile_dpbf16ps(0, 6, 7); break;
    case 1: _tile_dpbf16ps(1, 6, 7); break;
    case 2: _tile_dpbf16ps(2, 6, 7); break;
    case 3: _tile_dpbf16ps(3, 6, 7); break;
    case 4: _tile_dpbf16ps(4, 6, 7); break;
    default: _tile_dpbf16ps(5, 6, 7); break;
  }
}

// AVX-512's own bf16 throughput, the ceiling of the products that run on block (no AMX): `iterations` x DOT_CHAINS
// VDPBF16PS on registers, each into its own accumulator (independent chains hide the instruction's latency), so
// the loop reads no memory. The accumulators end as inputs of an empty asm, so the compiler keeps the loop.
constexpr int DOT_CHAINS = 24;  // as many as block<12> keeps
TARGET void dot_peak_task(int64_t iterations) {
  __m512 acc[DOT_CHAINS];
#pragma GCC unroll 24
  for (int c = 0; c < DOT_CHAINS; ++c) acc[c] = _mm512_set1_ps(c + 1);  // distinct: no two chains merge into one
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00), w = (__m512bh)_mm512_set1_epi16(0x3c00);  // bf16 1/128
  for (int64_t i = 0; i < iterations; ++i) {
    asm volatile("" : "+v"(x));  // x is opaque each iteration: the compiler cannot fold the products into one
#pragma GCC unroll 24
    for (int c = 0; c < DOT_CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, w);  // accumulators in registers
  }
#pragma GCC unroll 24
  for (int c = 0; c < DOT_CHAINS; ++c) asm volatile("" : : "v"(acc[c]));
}

// The tile unit's own throughput, the ceiling of every product on tiles: `tasks` x `iterations` x four TDPBF16PS
// (two A by two B tiles into four C tiles). Unfed, the operands are loaded once, so the loop reads no memory. Fed,
// every iteration loads its two A and two B tiles first (from 16 KB of contiguous 1 KB tiles that stay in L1): one
// 1 KB load a product, the fewest any product on tiles can take with eight tiles, so this is the ceiling of a
// product whose operands come from memory at all, whatever its blocking.
TARGET_AMX void tile_peak_task(int64_t iterations, int64_t tasks, bool fed) {
  uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  tile_configure(rows, colsb);
  alignas(64) uint16_t small[16 * 32];
  std::fill(small, small + 16 * 32, static_cast<uint16_t>(0x3c00));  // bf16 1/128: the sums stay small
  for (int t = 4; t < 8; ++t) tile_load(t, small, 64);
  alignas(64) float sink[16 * 16];
  constexpr int64_t TILES = 16;  // 1 KB tiles the fed loop cycles through: 16 KB, in L1
  alignas(64) static thread_local uint16_t operands[TILES * 16 * 32];
  if (fed) std::fill(operands, operands + TILES * 16 * 32, static_cast<uint16_t>(0x3c00));
  for (int64_t t = 0; t < tasks; ++t) {
    for (int c = 0; c < 4; ++c) tile_clear(c);
    for (int64_t i = 0; i < iterations; ++i) {
      if (fed) {
        const uint16_t* o = operands + (4 * i % TILES) * 16 * 32;
        _tile_loadd(4, o, 64);
        _tile_loadd(5, o + 16 * 32, 64);
        _tile_loadd(6, o + 2 * 16 * 32, 64);
        _tile_loadd(7, o + 3 * 16 * 32, 64);
      }
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sink, 64);
  }
  _tile_release();
}

// Scores of R query rows (bf16, row stride qs, zero from D to qs, a multiple of 32) against S keys read by the tiles
// where they lie in the cache (bf16 [S, D], row stride ks; D a multiple of 16): 16 keys are an A tile per 32
// dimensions (the last of 16 where D is not a multiple of 32), the queries B tiles of 16 (their pairs of
// dimensions transposed once a call), and scores[r][s] (row stride `stride`) the product's transpose. A score is
// the key's and query's product alone, wherever either sits. Values (natural row stride vs) are prefetched to L2.
TARGET_AMX void tile_scores(const uint16_t* q, int64_t qs, int64_t R, const uint16_t* k, int64_t ks, int64_t S,
                              int64_t D, float* scores, int64_t stride, const uint16_t* v, int64_t vs) {
  int64_t steps = (D + 31) / 32, blocks = (R + 15) / 16;
  bool half = D % 32 != 0;
  thread_local std::vector<uint32_t> qt;  // qt[((j * steps + c) * 16 + p) * 16 + n]: pair 16 c + p of query 16 j + n
  qt.resize(blocks * steps * 256);
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t c = 0; c < steps; ++c) {
      __m512i r[16];
      for (int64_t n = 0; n < 16; ++n)
        r[n] = 16 * j + n < R ? _mm512_loadu_si512(q + (16 * j + n) * qs + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(qt.data() + ((j * steps + c) * 16 + p) * 16, r[p]);
    }
  alignas(64) uint16_t tail[16 * 16 * MAX_CHUNKS];
  alignas(64) float c_out[2][256];
  prefetch_rows(k, ks, 0, KV_AHEAD, S, D, _MM_HINT_T0);
  prefetch_rows(v, vs, 0, KV_AHEAD, S, D, _MM_HINT_T1);
  // Keys s0 .. s0 + 15 (prefetching those KV_AHEAD on), and their row stride.
  auto key_block = [&](int64_t s0) TARGET_AMX {
    prefetch_rows(k, ks, s0 + KV_AHEAD, s0 + KV_AHEAD + 16, S, D, _MM_HINT_T0);
    prefetch_rows(v, vs, s0 + KV_AHEAD, s0 + KV_AHEAD + 16, S, D, _MM_HINT_T1);
    if (S - s0 >= 16) return std::pair<const uint16_t*, int64_t>(k + s0 * ks, ks);
    // the last keys, zero-padded to a tile's 16 rows (nothing read past the cache)
    std::memset(tail, 0, sizeof(tail));
    for (int64_t i = 0; i < S - s0; ++i) std::memcpy(tail + i * D, k + (s0 + i) * ks, D * 2);
    return std::pair<const uint16_t*, int64_t>(tail, D);
  };
  // c[i][n] (key s0 + i, query 16 j + n) -> scores, transposed
  auto put = [&](const float* c, int64_t j, int64_t s0) TARGET_AMX {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + 16 * i);
    transpose16(r);
    for (int64_t n = 0; n < std::min<int64_t>(16, R - 16 * j); ++n)
      _mm512_storeu_si512(scores + (16 * j + n) * stride + s0, r[n]);
  };
  if (steps <= 2 && blocks <= 2) {
    // Up to 64 dimensions and 32 queries: the queries stay in tiles 2 + 2 j + c (block j, step c) for the whole
    // call, the keys' steps take tiles 0 and 1 and block j's scores C tile 6 + j, so the blocks' products and
    // stores overlap instead of queueing on one C tile (bench policy, 9 tokens a row: 0.96x the time).
    uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    if (half) colsb[steps - 1] = 32, rows[2 + steps - 1] = rows[4 + steps - 1] = 8;
    tile_configure(rows, colsb);
    for (int64_t j = 0; j < blocks; ++j)
      for (int64_t c = 0; c < steps; ++c) tile_load(2 + 2 * j + c, qt.data() + (j * steps + c) * 256, 64);
    for (int64_t s0 = 0; s0 < S; s0 += 16) {
      auto [keys, key_stride] = key_block(s0);
      _tile_loadd(0, keys, key_stride * 2);
      _tile_zero(6);
      _tile_dpbf16ps(6, 0, 2);
      if (blocks == 2) {
        _tile_zero(7);
        _tile_dpbf16ps(7, 0, 4);
      }
      if (steps == 2) {
        _tile_loadd(1, keys + 32, key_stride * 2);
        _tile_dpbf16ps(6, 1, 3);
        if (blocks == 2) _tile_dpbf16ps(7, 1, 5);
      }
      _tile_stored(6, c_out[0], 64);
      if (blocks == 2) _tile_stored(7, c_out[1], 64);
      for (int64_t j = 0; j < blocks; ++j) put(c_out[j], j, s0);
    }
    _tile_release();
    return;
  }
  uint8_t rows[8] = {16, 16, 16, 16, 16, 8, 16, 0};
  uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 0};
  if (half) colsb[steps - 1] = 32;
  tile_configure(rows, colsb);
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    auto [keys, key_stride] = key_block(s0);
    for (int64_t c = 0; c < steps; ++c) tile_load(c, keys + 32 * c, key_stride * 2);
    for (int64_t j = 0; j < blocks; ++j) {
      _tile_zero(6);
      for (int64_t c = 0; c < steps; ++c) {
        int b = half && c == steps - 1 ? 5 : 4;
        tile_load(b, qt.data() + (j * steps + c) * 256, 64);
        scores_product(c, b);
      }
      _tile_stored(6, c_out[0], 64);
      put(c_out[0], j, s0);
    }
  }
  _tile_release();
}

// The next task's keys and values (attention's tasks: one row's kv head), fetched into L2 a few lines at a time
// while this task's softmax and weighted sums compute on what it already holds: otherwise the memory streams only
// while a task's scores run and idles after them (bench policy, 25 rows x 1,000 cached tokens: with the queries
// resident in tile_scores, the attention 0.91x the time at nine tokens a row, 0.96x at one; `kernel_ab.py`).
// One a thread; the task loop sets it.
struct Ahead {
  // two byte ranges (keys, values) and their lines not yet fetched; scalars, not an indexed array, so that a loop
  // holding a copy keeps them in registers (an array goes through memory, a store-to-load chain per line: 0.95x the
  // time at nine tokens as scalars)
  const char* keys = nullptr;
  const char* values = nullptr;
  int64_t key_lines = 0, value_lines = 0;

  void set(const char* k, int64_t key_bytes, const char* v, int64_t value_bytes) {
    keys = k, key_lines = (key_bytes + 63) / 64;
    values = v, value_lines = (value_bytes + 63) / 64;
  }
  // One more line, if any is left (keys first).
  void one() {
    if (key_lines) {
      _mm_prefetch(keys, _MM_HINT_T1);
      keys += 64, --key_lines;
    } else if (value_lines) {
      _mm_prefetch(values, _MM_HINT_T1);
      values += 64, --value_lines;
    }
  }
  // Up to n more lines.
  void drip(int64_t n) {
    for (; n > 0 && key_lines + value_lines > 0; --n) one();
  }
};
thread_local Ahead ahead;

// acc[r][d] = sum over slots s < split[r] of w[r][s] v[s][d] on the tiles (float32 sums), for R rows of bf16 weights
// (row stride `top`, zero from split[r] on; attend_rows writes them as its softmax computes them) over paired values
// (row stride vs = D; weighted_values' layout: a B tile is 32 slots x 16 dimensions as it lies), split[r] multiples
// of 32, D a multiple of 16. acc: R rows, row stride D.
// Each row's product is its weights' alone: rows with fewer slots add tiles of zero weights, which change no sum, and
// a tile's rows are summed apart from each other whatever the rows configured.
TARGET_AMX void tile_values(const uint16_t* w, int64_t top, int64_t R, const int64_t* split, const uint16_t* v,
                              int64_t vs, int64_t D, float* acc) {
  int64_t chunks = D / 16;
  Ahead pf = ahead;  // a local copy the loop keeps in registers (a thread_local is an address lookup)
  // A block of rows at a time, its weights and sums configured with its own row count, not padded with rows of
  // zeros to 16 (a one-token step's task has two rows: attention 0.95x the time at one token, 1.00x at nine).
  int64_t configured = 0;
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    int64_t rows_now = std::min<int64_t>(16, R - r0), upto = *std::max_element(split + r0, split + r0 + rows_now);
    if (rows_now != configured) {
      uint8_t n = static_cast<uint8_t>(rows_now);
      uint8_t rows[8] = {n, n, n, n, n, n, n, 16};
      uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
      tile_configure(rows, colsb);
      configured = rows_now;
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += 6) {  // C tiles: up to six of 16 dimensions
      int64_t n = std::min<int64_t>(6, chunks - c0);
      for (int64_t i = 0; i < n; ++i) tile_clear(i);
      for (int64_t s0 = 0; s0 < upto; s0 += 32) {
        pf.drip(8);
        tile_load(6, w + r0 * top + s0, top * 2);
        for (int64_t i = 0; i < n; ++i) {
          tile_load(7, v + s0 / 2 * 2 * vs + 32 * (c0 + i), vs * 4);
          values_product(i);
        }
      }
      for (int64_t i = 0; i < n; ++i) tile_store(i, acc + r0 * D + 16 * (c0 + i), D * 4);
    }
  }
  ahead = pf;
  if (configured) _tile_release();
}

// tile_values' sums on AVX-512 (no tiles): VDPBF16PS takes a slot pair's bf16 weights (w[s], w[s + 1]) as one 32-bit
// broadcast against a line of paired values (dimension d of slots s and s + 1 side by side), so one instruction adds
// two slots' products to 16 dimensions' sums, where float32 FMAs take two a row (and the values' conversion). N rows
// a pass (N * C sums and the C lines in registers), up to the pass's largest split (a row's weights are zero from its
// split on, which changes no sum): each row's sums are its own whatever rows share the pass.
template <int C, int N>
TARGET void pair_values(const uint16_t* w, int64_t top, int64_t upto, const uint16_t* v, int64_t vs, int64_t D,
                        float* acc) {
  __m512 sum[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < upto; s += 2) {
    const uint16_t* pr = v + s / 2 * 2 * vs;
    __m512bh line[C];
    for (int c = 0; c < C; ++c) line[c] = (__m512bh)_mm512_loadu_si512(pr + 32 * c);
    for (int r = 0; r < N; ++r) {
      int32_t bits;  // w[s], w[s + 1]
      std::memcpy(&bits, w + r * top + s, 4);
      __m512bh pair = (__m512bh)_mm512_set1_epi32(bits);
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], line[c], pair);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, sum[r][c]);
}

// pair_values over R rows (D = 16 C), BLOCK rows a pass and the rest in one pass of their own size. BLOCK keeps
// BLOCK * C sums, C lines and the broadcast weight pair within the 32 registers: at C = 8 (head size 128) 3 rows
// would take 33, one sum going through the stack every slot pair (32 heads over 8 kv heads of 128, 8-16 rows x
// 1,000 cached tokens: 2 rows a pass take 0.95x the time of 3 at one token a row, 0.99x at nine; same bits).
template <int C>
TARGET void dot_values(const uint16_t* w, int64_t top, int64_t R, const int64_t* split, const uint16_t* v, int64_t vs,
                       int64_t D, float* acc) {
  constexpr int BLOCK = C <= 3 ? 8 : C <= 4 ? 6 : C <= 7 ? 3 : 2;
  auto pass = [&](auto rows, int64_t r0) {
    constexpr int n = decltype(rows)::value;
    int64_t upto = *std::max_element(split + r0, split + r0 + n);
    pair_values<C, n>(w + r0 * top, top, upto, v, vs, D, acc + r0 * D);
  };
  row_blocks<BLOCK>(R, pass);
}

// Keys a row may see past its first masked key with its weighted sum still plain decoding's bit for bit: a draft's
// path (its depth + 1; tlt's strategies stay within it, tlt/speculative/strategy.py MAX_DEPTH).
constexpr int64_t SPLIT_MARGIN = 64;

// Where row r's weighted sum leaves the bf16 products (tiles or VDPBF16PS) for weighted_values: a multiple of 32 at
// least SPLIT_MARGIN short of its count n of visible keys, 0 below that or where a masked key lies before it. Counted
// over the row's visible keys only, a row of a tree's verification (its cache, then its ancestors among the draft's
// slots) splits where plain decoding's same row (the same keys, next to each other) does, and both sum the same keys
// in the same bf16 products, so they agree bit for bit: the masked keys of a draft lie among its last slots, past
// the split as long as the row sees at most SPLIT_MARGIN keys from the first of them on.
TARGET int64_t bf16_split(const float* mask, int64_t visible) {
  int64_t n = visible, gap = visible;
  if (mask) {
    n = 0;
    for (int64_t s = 0; s < visible; s += 16) {
      __mmask16 m = count_mask(visible - s);
      __mmask16 hidden =
          _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, mask + s), _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
      n += __builtin_popcount(m & ~hidden);
      if (hidden && gap == visible) gap = s + __builtin_ctz(hidden);
    }
  }
  int64_t split = n >= SPLIT_MARGIN + 32 ? (n - SPLIT_MARGIN) / 32 * 32 : 0;
  return split <= gap ? split : 0;
}

// The leading slots of an additive mask row (of S) that are all exactly 0, in whole vectors of 16.
TARGET int64_t zero_prefix(const float* mask, int64_t S) {
  int64_t s = 0;
  while (s + 16 <= S && _mm512_cmp_ps_mask(_mm512_loadu_ps(mask + s), _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0) s += 16;
  return s;
}

// One past the last key an additive mask row of S keys leaves visible (not -inf); at least 1.
TARGET int64_t visible_end(const float* mask, int64_t S) {
  for (int64_t s = (S - 1) / 16 * 16; s >= 0; s -= 16) {
    __mmask16 m = count_mask(S - s);
    __mmask16 shown =
        _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, mask + s), _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    if (shown) return s + 32 - __builtin_clz(static_cast<unsigned>(shown));
  }
  return 1;
}

// R query rows (bf16, [R][D], row stride qs, zero from D to qs) that share one kv head, over its keys/values
// [S, D] (row stride ks / vs; values PAIRED as weighted_values reads them, or natural):
// row r sees keys 0 .. visible[r] - 1 with the additive mask masks[r] (null: none; exactly 0 before slot
// unmasked[r], a multiple of 16, so not read there) and writes out[r] [D] bf16. A score is linear's product of
// the query row and the key (one accumulator over the pairs of dimensions in order, whatever the row's block), the
// keys packed once for all rows; values are read once per block of rows. Where AMX runs (`tiles`) the scores take
// its tiles, the query rows padded with zeros to qs, a multiple of 32, and the keys' pairs likewise; a query's
// scores are the same whatever R.
// With paired values (D a multiple of 16) each row's weighted sum runs on bf16-rounded weights up to split[r] (its
// bf16_split), on the tiles (tile_values) or on VDPBF16PS (dot_values), then in float32 in slot order; on the tiles
// the keys are not packed either (tile_scores). `scores` holds R * stride floats (stride: S rounded up to 32, plus
// 16), `packed` S * qs bf16 rounded up to 32 keys. packed_keys: the keys are a bf16 plane of packed keys (key_word),
// read in place by the AVX-512 block on either unit, whose arithmetic is pack_keys' and linear's: the same scores.
template <int C, bool PAIRED, typename KV>
TARGET void attend_rows(const uint16_t* q, int64_t qs, int64_t R, const KV* k, int64_t ks, const KV* v, int64_t vs,
                        const float* const* masks, const int64_t* unmasked, const int64_t* visible,
                        const int64_t* split, int64_t D,
                        float scale, float* scores, uint32_t* packed, uint16_t* const* out, bool tiles,
                        bool packed_keys) {
  int64_t S = *std::max_element(visible, visible + R), stride = (S + GROUP - 1) / GROUP * GROUP + 16;
  int64_t pairs = packed_keys ? D / 2 : qs / 2;
  __mmask16 last = tail_mask(D - 16 * (C - 1));
  bool bf16_sums = PAIRED && D % 16 == 0, direct = bf16_sums && tiles && !packed_keys;
  if (direct) {
    tile_scores(q, qs, R, reinterpret_cast<const uint16_t*>(k), ks, S, D, scores, stride,
                reinterpret_cast<const uint16_t*>(v), vs);
  } else {
    if (packed_keys)
      packed = reinterpret_cast<uint32_t*>(const_cast<KV*>(k));
    else
      pack_keys(k, ks, S, D, pairs, packed, v, vs);
    alignas(64) float acc[AMX_ROWS * GROUP];
    int64_t configured = 0;
    for (int64_t s0 = 0; s0 < S; s0 += GROUP) {
      const uint16_t* group = reinterpret_cast<const uint16_t*>(packed + key_word(s0, 0, pairs));
      for (int64_t r0 = 0, rows = 0; r0 < R; r0 += rows) {
        if (tiles && !packed_keys) {
          rows = std::min(AMX_ROWS, R - r0);
          if (rows != configured) amx_configure(configured = rows);
          amx_block(q + r0 * qs, qs, group, pairs, acc);
        } else {
          rows = block_rows(R - r0);
          BLOCKS[rows](q + r0 * qs, qs, group, pairs, acc, group);
        }
        for (int64_t r = 0; r < rows; ++r) std::memcpy(scores + (r0 + r) * stride + s0, acc + r * GROUP, GROUP * 4);
      }
    }
    if (configured) amx_release();
  }
  thread_local std::vector<float> totals;
  totals.resize(R);
  // With bf16 sums a row's weights before its split go to tile_values or dot_values as bf16, rounded as they leave
  // the exp ([R][top], zero from the split on); the float32 tail keeps the rest in scores.
  int64_t top_split = bf16_sums ? *std::max_element(split, split + R) : 0;
  thread_local std::vector<uint16_t> wb;
  wb.resize(R * top_split);
  Ahead pf = ahead;  // one line of the next task's for each vector of 16 scores, in both passes
  for (int64_t r = 0; r < R; ++r) {
    // scale, mask, -inf past the row's keys (up to S rounded up to 16), a max-subtracted exp, its sum
    float* sr = scores + r * stride;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S; s += 16) {
      __mmask16 sm = count_mask(visible[r] - s);
      __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(sm, sr + s), _mm512_set1_ps(scale));
      if (s >= unmasked[r]) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(sm, masks[r] + s));
      x = _mm512_mask_blend_ps(sm, _mm512_set1_ps(-INFINITY), x);
      _mm512_storeu_ps(sr + s, x);
      top = _mm512_max_ps(top, x);
      pf.one();
    }
    __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    PackedSum sum;
    // Two loops, the bf16 slots then the float32 ones (one loop choosing the store per vector: 1.02-1.05x
    // the attention's time at nine tokens a row).
    int64_t cut = top_split ? split[r] : 0, s = 0;  // a multiple of 32
    uint16_t* wr = wb.data() + r * top_split;
    auto weight_at = [&](int64_t s) TARGET {
      __m512 weight = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + s), peak));
      sum.add(weight);
      pf.one();
      return weight;
    };
    for (; s < cut; s += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wr + s), (__m256i)_mm512_cvtneps_pbh(weight_at(s)));
    for (; s < S; s += 16) _mm512_storeu_ps(sr + s, weight_at(s));
    if (top_split) std::memset(wr + cut, 0, (top_split - cut) * 2);
    totals[r] = sum.total();
  }
  ahead = pf;
  // Weighted values key by key in slot order: weights of masked keys and keys past a row's are exact zeros, which
  // leave the sums unchanged, so a query's result does not depend on which other keys sit between the ones it
  // sees (a tree draft's node equals plain decoding's token bit for bit); PackedSum likewise.
  // With bf16 sums the float32 sums start at each row's split, from the bf16 products' sums.
  if (top_split) {
    thread_local std::vector<float> init;
    init.resize(R * D);
    if (tiles)
      tile_values(wb.data(), top_split, R, split, reinterpret_cast<const uint16_t*>(v), vs, D, init.data());
    else
      dot_values<C>(wb.data(), top_split, R, split, reinterpret_cast<const uint16_t*>(v), vs, D, init.data());
    value_passes<C, PAIRED, KV>(scores, stride, R, split, S, v, vs, last, init.data(), D, totals.data(), out);
    return;
  }
  thread_local std::vector<int64_t> from;
  from.assign(R, 0);
  value_passes<C, PAIRED, KV>(scores, stride, R, from.data(), S, v, vs, last, nullptr, D, totals.data(), out);
}

template <typename KV>
using Attend = void (*)(const uint16_t*, int64_t, int64_t, const KV*, int64_t, const KV*, int64_t, const float* const*,
                        const int64_t*, const int64_t*, const int64_t*, int64_t, float, float*, uint32_t*,
                        uint16_t* const*, bool, bool);
template <typename KV, bool PAIRED = false>
constexpr Attend<KV> ATTEND[9] = {nullptr,
                                  attend_rows<1, PAIRED, KV>,
                                  attend_rows<2, PAIRED, KV>,
                                  attend_rows<3, PAIRED, KV>,
                                  attend_rows<4, PAIRED, KV>,
                                  attend_rows<5, PAIRED, KV>,
                                  attend_rows<6, PAIRED, KV>,
                                  attend_rows<7, PAIRED, KV>,
                                  attend_rows<8, PAIRED, KV>};

}  // namespace

bool amx() { return amx_on && amx_granted(); }
void set_amx(bool on) { amx_on = on; }

// Floating-point operations of tile_peak_task run once on every thread of the pool (AMX only); the caller times it.
double tile_peak(int64_t iterations, bool fed) {
  TORCH_CHECK(amx(), "tile_peak: this CPU or process does not run AMX tiles");
  TORCH_CHECK(iterations >= 1, "tile_peak: iterations must be >= 1");
  int64_t tasks = at::get_num_threads();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) { tile_peak_task(iterations, t1 - t0, fed); });
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iterations) * static_cast<double>(tasks);  // 2 a multiply-add
}

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Floating-point operations of dot_peak_task run once on every thread of the pool; the caller times it.
double dot_peak(int64_t iterations) {
  TORCH_CHECK(supported(), "dot_peak: this CPU has no AVX-512 bf16");
  TORCH_CHECK(iterations >= 1, "dot_peak: iterations must be >= 1");
  int64_t tasks = at::get_num_threads();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) dot_peak_task(iterations);
  });
  return 2.0 * 32 * DOT_CHAINS * static_cast<double>(iterations) * static_cast<double>(tasks);  // 2 a multiply-add
}

namespace {
// Tasks 0 .. n-1 handed to the pool's threads one at a time as each comes free (an atomic counter), where
// at::parallel_for would give each thread a fixed half: a thread slowed by a neighbour on a shared machine, or
// tasks of unequal cost (attention rows of different lengths), no longer leave the other thread waiting at the end.
// body(take) runs once on each thread; take() returns the thread's next task, -1 when none is left. A task's
// result depends on the task alone, whatever thread runs it.
template <typename F>
void parallel_tasks(int64_t n, const F& body) {
  std::atomic<int64_t> counter{0};
  auto take = [&counter, n] {
    int64_t t = counter.fetch_add(1, std::memory_order_relaxed);
    return t < n ? t : int64_t{-1};
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) { body(take); });
}
}  // namespace

// x [M, K] bf16 (rows contiguous), packed [G, K / 2, 32, 2] bf16, bias [N] float32 or undefined,
// residual [M, N] bf16 (rows contiguous) or undefined -> [M, N] bf16. 4-bit weights (block4): packed
// [G, K / 2, 32] uint8 with scales [G, K / 128 (or 1), 2, 32] float32 (scale, then shift, per k-group).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> scales, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "linear: x must be [M, K] bf16 with contiguous rows");
  bool four = packed.scalar_type() == torch::kUInt8;
  if (four) {
    TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == GROUP && scales && scales->defined(),
                "linear: 4-bit weights must come from cpu_kernels.pack4, with their scales");
  } else {
    TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == GROUP && packed.size(3) == 2 &&
                packed.scalar_type() == torch::kBFloat16, "linear: packed must come from cpu_kernels.pack");
  }
  int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs * 2 == K, "linear: x has ", K, " columns, the packed weight ", pairs * 2);
  TORCH_CHECK(N > (groups - 1) * GROUP && N <= groups * GROUP, "linear: N does not match the packed weight");
  int64_t qgroups = 0;
  if (four) {
    qgroups = scales->dim() == 4 ? scales->size(1) : 0;
    TORCH_CHECK(scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() && qgroups > 0 &&
                scales->size(0) == groups && scales->size(2) == 2 && scales->size(3) == GROUP &&
                pairs % qgroups == 0, "linear: scales must come from cpu_kernels.pack4");
  }
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
  // silu: gate group g (of I / GROUP) pairs with up group g + I / GROUP, and the output has I columns
  TORCH_CHECK(!silu || (N % (2 * GROUP) == 0 && !(residual && residual->defined())),
              "linear: silu needs N a multiple of ", 2 * GROUP, " (gate over up) and no residual");
  int64_t units = silu ? groups / 2 : groups, cols_out = silu ? N / 2 : N;
  auto out = torch::empty({M, cols_out}, x.options());
  if (M == 0) return out;
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Rows m0 .. m0 + rows - 1 of unit g's output from its sums (acc[r][c]; with silu, acc_up the up group's).
  auto store = [&](int64_t g, int64_t m0, int64_t rows, const float* acc, const float* acc_up) {
    for (int64_t r = 0; r < rows; ++r) {
      if (silu)
        finish_silu(acc + r * GROUP, acc_up + r * GROUP, b ? b + g * GROUP : nullptr,
                    b ? b + (g + units) * GROUP : nullptr, op + (m0 + r) * cols_out + g * GROUP);
      else
        finish(acc + r * GROUP, b ? b + g * GROUP : nullptr, res ? res + (m0 + r) * res_stride + g * GROUP : nullptr,
               op + (m0 + r) * N + g * GROUP, std::min(GROUP, N - g * GROUP));
    }
  };
  int64_t xs = x.stride(0), chunks = (M + CHUNK - 1) / CHUNK;
  // 4-bit weights: each row's sum of x over each k-group (the codes' offset, block4)
  std::vector<float> xsum(four ? M * qgroups : 0);
  for (int64_t m = 0; m < (four ? M : 0); ++m)
    for (int64_t j = 0; j < qgroups; ++j) xsum[m * qgroups + j] = sum_values(xp + m * xs + j * (K / qgroups), K / qgroups);
  const uint16_t* wp = four ? nullptr : reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (!four && pairs % 16 == 0 && amx()) {
    // Tasks: groups x chunks of AMX_CHUNK rows. A chunk of one row block (M <= 16, or a last chunk of <= 16 rows)
    // takes amx_block (tiles configured to its rows, whole K in one pass). Otherwise the group's k-steps go
    // in slices of AMX_SLICE, each applied to every 16-row block of the chunk before the next (its B tiles stay in
    // L1), C kept in acc between slices; the next slice's B lines are prefetched during the passes. Bit for bit the
    // same sums as one pass per block: each C row depends only on its own A row (padding rows are zeros whose
    // results are dropped), and every element's k-steps go in increasing order into its one accumulator.
    int64_t amx_chunks = (M + AMX_CHUNK - 1) / AMX_CHUNK, steps = pairs / 16, tail = M % 16;
    std::vector<uint16_t> xt(tail && M > 16 ? 16 * K : 0, 0);  // the last partial block, zero-padded to 16 rows
    for (int64_t r = 0; r < (xt.empty() ? 0 : tail); ++r) std::memcpy(xt.data() + r * K, xp + (M - tail + r) * xs, K * 2);
    // A task is a run of consecutive groups, taken chunk by chunk: for each chunk of rows, every group of the run,
    // so the chunk's rows (128 x K bf16) and the run's weights both stay in the thread's L2. One group per task
    // re-reads all of x from L3 for every group once x outgrows L2 (1,664 rows x 768: 2.5 MB, 160 groups: products
    // 1.2-1.75x slower). Where x fits L2 too, a run streams the thread's weights from consecutive addresses where single
    // groups jump from one thread's group to the other's: the bench policy's four products through twelve layers at
    // 24-256 rows 0.86-0.97x the time of single groups (2 threads, `kernel_ab.py`, same bits). One row block (M <= 16)
    // takes single groups: its products stream at the read bandwidth either way.
    int64_t run = M <= 16 ? 1 : std::clamp<int64_t>(units / (4 * at::get_num_threads()), 1, AMX_RUN);
    parallel_tasks((units + run - 1) / run, [&](const auto& take) {
      alignas(64) float acc[AMX_CHUNK * GROUP];
      alignas(64) float acc_up[AMX_CHUNK * GROUP];  // silu: the up group's sums
      int64_t configured = 0;  // rows the tiles are configured for, 0 none
      // acc_out[r][c]: group g's sums for rows m_start .. m_end - 1
      auto product = [&](int64_t g, int64_t m_start, int64_t m_end, float* acc_out) {
        int64_t blocks = (m_end - m_start + 15) / 16;
        const uint16_t* wg = wp + g * pairs * GROUP * 2;
        if (blocks == 1) {
          int64_t rows = m_end - m_start;
          if (rows != configured) amx_configure(configured = rows);
          amx_block(xp + m_start * xs, xs, wg, pairs, acc_out);
          return;
        }
        if (configured != AMX_ROWS) amx_configure(configured = AMX_ROWS);
        for (int64_t s0 = 0; s0 < steps; s0 += AMX_SLICE) {
          int64_t n = std::min(AMX_SLICE, steps - s0);
          const uint16_t* ws = wg + s0 * 16 * GROUP * 2;
          // the next slice (or the next group's first), n * 32 lines, AMX_PF lines a step over the blocks' passes
          const char* next = reinterpret_cast<const char*>(ws + n * 16 * GROUP * 2);
          for (int64_t blk = 0; blk < blocks; ++blk) {
            int64_t m0 = m_start + 16 * blk;
            bool padded = m0 + 16 > M;
            const uint16_t* xb = padded ? xt.data() : xp + m0 * xs;
            const char* pf = next + blk * n * AMX_PF * 64;
            amx_slice(xb + 32 * s0, padded ? K : xs, ws, n, acc_out + blk * 16 * GROUP, s0 == 0,
                      pf < next + n * 16 * GROUP * 4 ? pf : nullptr);
          }
        }
      };
      for (int64_t t; (t = take()) >= 0;) {
        for (int64_t i = 0; i < amx_chunks * run; ++i) {
          int64_t c = i / run, g = t * run + i % run;
          if (g >= units) continue;
          int64_t m_start = c * AMX_CHUNK, m_end = std::min(M, m_start + AMX_CHUNK);
          product(g, m_start, m_end, acc);
          if (silu) product(g + units, m_start, m_end, acc_up);
          store(g, m_start, m_end - m_start, acc, acc_up);
        }
      }
      if (configured) amx_release();
    });
    return out;
  }
  const uint8_t* wq = four ? packed.data_ptr<uint8_t>() : nullptr;
  const float* sp = four ? scales->data_ptr<float>() : nullptr;
  // One task: one weight group (with silu, a gate group and its up group) times one chunk of rows.
  parallel_tasks(units * chunks, [&](const auto& take) {
    alignas(64) float acc[ROWS * GROUP];
    alignas(64) float acc_up[ROWS * GROUP];  // silu: the up group's sums
    for (int64_t t; (t = take()) >= 0;) {
      int64_t g = t / chunks, m_end = std::min(M, (t % chunks + 1) * CHUNK);
      int64_t m_start = (t % chunks) * CHUNK;
      for (int64_t m0 = m_start, rows = 0; m0 < m_end; m0 += rows) {
        rows = block_rows(m_end - m0);
        // group j's sums for this block; a later block of one chunk of rows (the task's next group comes next)
        // prefetches that group
        auto product = [&](int64_t j, float* acc_out) {
          bool next = m0 > m_start && chunks == 1 && j + 1 < groups;
          if (four) {
            const uint8_t* wg = wq + j * pairs * GROUP;
            BLOCKS4[rows](xp + m0 * xs, xs, wg, pairs, sp + j * qgroups * 2 * GROUP, xsum.data() + m0 * qgroups,
                          qgroups, acc_out, next ? wg + pairs * GROUP : wg + PREFETCH);
          } else {
            const uint16_t* wg = wp + j * pairs * GROUP * 2;
            BLOCKS[rows](xp + m0 * xs, xs, wg, pairs, acc_out, next ? wg + pairs * GROUP * 2 : wg + PREFETCH);
          }
        };
        product(g, acc);
        if (silu) product(g + units, acc_up);
        store(g, m0, rows, acc, acc_up);
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
  // Rows are short (a head, a hidden state): a decode step's few rows stay on one thread (a fork costs more than
  // their work); a verification's hundreds of rows (432 x 768: ~40 us) split, RMS_GRAIN elements a task at least.
  constexpr int64_t RMS_GRAIN = 1 << 15;
  at::parallel_for(0, A * R, std::max<int64_t>(1, RMS_GRAIN / D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t a = i / R, r = i % R;
      const uint16_t* row = xp + a * sa + r * sr;
      float s = 1.0f / std::sqrt(sum_squares(row, D) / static_cast<float>(D) + static_cast<float>(eps));
      scale_row(row, s, w ? w + r * w_stride : nullptr, op + i * D, D);
    }
  });
  return out;
}

// q [B, H, T, D] bf16, keys / values [B, H_kv, S, D] bf16 or float32 (rows of D contiguous, any
// strides otherwise), mask [B, 1, T, S] float32 additive (last dim contiguous) or undefined (causal over the
// last T keys) -> [B, T, H * D] bf16. Query head h reads kv head h / (H / H_kv). paired: bf16 values in
// weighted_values' paired layout (slot rows of D elements next to each other, S rounded up to even inside the
// buffer). packed_keys: bf16 keys in planes of packed keys (key_word; S rounded up to GROUP inside the buffer).
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        bool paired, c10::optional<torch::Tensor> counts, bool packed_keys) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kBFloat16 && q.stride(3) == 1,
              "attention: q must be [B, H, T, D] bf16 with contiguous rows");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16) &&
              k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(),
              "attention: keys and values must be [B, H_kv, S, D] float32 or bf16 with contiguous rows");
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0 && S >= T, "attention: q, keys and values disagree");
  TORCH_CHECK(D <= 16 * MAX_CHUNKS && D % 2 == 0, "attention: head dim must be even and at most ", 16 * MAX_CHUNKS);
  TORCH_CHECK(!paired || (v.scalar_type() == torch::kBFloat16 && v.stride(2) == D),
              "attention: paired values must be bf16 with slot rows next to each other");
  // Packed keys are read a whole group at a time: the last plane's group holding slot S - 1 must lie inside the
  // keys' storage (a cache's capacity is a multiple of GROUP).
  TORCH_CHECK(!packed_keys || (k.scalar_type() == torch::kBFloat16 && k.stride(2) == D &&
                               (k.storage_offset() + (B - 1) * k.stride(0) + (Hkv - 1) * k.stride(1) +
                                (S + GROUP - 1) / GROUP * GROUP * D) * 2 <= static_cast<int64_t>(k.storage().nbytes())),
              "attention: packed keys must be bf16 planes of slot rows next to each other, whole groups of ", GROUP,
              " slots inside their buffer");
  // An odd S reads the pair row of slot S - 1 whole: slot S must lie inside the values' storage (a cache's even
  // capacity), holding finite values.
  TORCH_CHECK(!paired || S % 2 == 0 ||
                  (v.storage_offset() + (B - 1) * v.stride(0) + (Hkv - 1) * v.stride(1) + (S + 1) * D) * 2 <=
                      static_cast<int64_t>(v.storage().nbytes()),
              "attention: paired values over an odd slot count need the next slot in their buffer");
  const float* mp = nullptr;
  int64_t mb = 0, mt = 0;
  if (mask && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == torch::kFloat32 && mask->dim() == 4 && mask->size(0) == B &&
                mask->size(2) == T && mask->size(3) == S && mask->stride(3) == 1,
                "attention: mask must be [B, 1, T, S] float32");
    mp = mask->data_ptr<float>();
    mb = mask->stride(0);
    mt = mask->stride(2);
  }
  // counts [B]: row b's queries are its first counts[b] tokens (a batch of ragged drafts, right-padded); the
  // others' outputs are left unwritten.
  const int64_t* cp = nullptr;
  if (counts && counts->defined()) {
    TORCH_CHECK(counts->scalar_type() == torch::kLong && counts->dim() == 1 && counts->size(0) == B &&
                counts->is_contiguous(), "attention: counts must be [B] int64");
    cp = counts->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cp[b] >= 0 && cp[b] <= T, "attention: counts[", b, "] outside [0, T]");
  }
  auto out = torch::empty({B, T, H * D}, q.options());
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr());
  bool half = k.scalar_type() == torch::kBFloat16;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  int64_t item = k.element_size();
  int64_t group = H / Hkv;
  float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // One task: the group * T query rows of one row's kv head. On AMX tiles the rows are 32 dimensions wide
  // or a multiple (zero past D).
  int64_t R = group * T;
  bool tiles = amx();
  int64_t Dq = tiles ? (D + 31) / 32 * 32 : D;
  // Where each query row's weighted sum leaves the bf16 products (bf16_split): once a row and token, not a kv head.
  bool bf16_sums = paired && D % 16 == 0;
  // Query rows past a row's counts are padding: no task reads their split or limit.
  auto real = [cp, T](int64_t i) { return !cp || i % T < cp[i / T]; };
  std::vector<int64_t> splits(bf16_sums ? B * T : 0);
  for (int64_t i = 0; i < (bf16_sums ? B * T : 0); ++i)
    if (real(i)) splits[i] = bf16_split(mp ? mp + i / T * mb + i % T * mt : nullptr, mp ? S : S - T + i % T + 1);
  // Under a mask, the keys a query row may see end at its last unmasked one: a shorter row of the batch (a cache's
  // rows have different lengths) reads and weighs only its own slots, not the longest row's. The keys past it
  // would add exact zeros (their weights), so the results are the same bit for bit, at less work.
  std::vector<int64_t> limits(mp ? B * T : 0);
  for (int64_t i = 0; i < (mp ? B * T : 0); ++i)
    if (real(i)) limits[i] = visible_end(mp + i / T * mb + i % T * mt, S);
  // And it starts with slots whose mask is exactly 0 (a row's cache before its draft): the softmax adds the mask
  // from the first 16 slots that hold anything else on, the same sums at fewer reads (a mask row is read once
  // here, then by each of the row's kv heads and heads).
  std::vector<int64_t> zeros(mp ? B * T : 0);
  for (int64_t i = 0; i < (mp ? B * T : 0); ++i)
    if (real(i)) zeros[i] = zero_prefix(mp + i / T * mb + i % T * mt, limits[i]);
  // The slots a row's tasks read: up to its queries' last visible key (what Ahead fetches for a task).
  std::vector<int64_t> reach(B, 0);
  for (int64_t i = 0; i < B * T; ++i)
    if (real(i)) reach[i / T] = std::max(reach[i / T], mp ? limits[i] : S - T + i % T + 1);
  parallel_tasks(B * Hkv, [&](const auto& take) {
    // Each thread's scratch lives across calls: a decode step calls this once a layer.
    thread_local std::vector<float> scores;
    thread_local std::vector<uint32_t> packed;
    thread_local std::vector<uint16_t> qb;
    thread_local std::vector<const float*> masks;
    thread_local std::vector<int64_t> visible;
    thread_local std::vector<int64_t> unmasked;
    thread_local std::vector<int64_t> split;
    thread_local std::vector<uint16_t*> outs;
    int64_t keys_up = (S + GROUP - 1) / GROUP * GROUP;
    scores.resize(R * (keys_up + 16));
    if (!packed_keys) packed.resize(keys_up * Dq / 2);
    qb.assign(R * Dq, 0);
    masks.resize(R);
    visible.resize(R);
    unmasked.resize(R);
    split.resize(R);
    outs.resize(R);
    // Each thread takes its next task before it runs this one, and fetches that task's keys and values while
    // this one computes (Ahead).
    for (int64_t i = take(), next; i >= 0; i = next) {
      next = take();
      ahead.set(nullptr, 0, nullptr, 0);
      if (next >= 0) {
        int64_t nb = next / Hkv, nj = next % Hkv, n = reach[nb];
        ahead.set(kp + (nb * k.stride(0) + nj * k.stride(1)) * item, n * k.stride(2) * item,
                  vp + (nb * v.stride(0) + nj * v.stride(1)) * item,
                  (paired ? (n + 1) / 2 * 2 : n) * v.stride(2) * item);
      }
      int64_t b = i / Hkv, j = i % Hkv, Tb = cp ? cp[b] : T, Rb = group * Tb;
      if (Rb == 0) continue;
      for (int64_t r = 0; r < Rb; ++r) {
        int64_t h = j * group + r / Tb, t = r % Tb;
        std::memcpy(&qb[r * Dq], qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2), D * 2);
        masks[r] = mp ? mp + b * mb + t * mt : nullptr;
        unmasked[r] = mp ? zeros[b * T + t] : S;
        visible[r] = mp ? limits[b * T + t] : S - T + t + 1;
        split[r] = bf16_sums ? splits[b * T + t] : 0;
        outs[r] = op + (b * T + t) * H * D + h * D;
      }
      const char* kh = kp + (b * k.stride(0) + j * k.stride(1)) * item;
      const char* vh = vp + (b * v.stride(0) + j * v.stride(1)) * item;
      if (paired)
        ATTEND<uint16_t, true>[(D + 15) / 16](qb.data(), Dq, Rb, reinterpret_cast<const uint16_t*>(kh), k.stride(2),
                                              reinterpret_cast<const uint16_t*>(vh), v.stride(2), masks.data(),
                                              unmasked.data(), visible.data(), split.data(), D, scale, scores.data(),
                                              packed.data(), outs.data(), tiles, packed_keys);
      else if (half)
        ATTEND<uint16_t>[(D + 15) / 16](qb.data(), Dq, Rb, reinterpret_cast<const uint16_t*>(kh), k.stride(2),
                                        reinterpret_cast<const uint16_t*>(vh), v.stride(2), masks.data(),
                                        unmasked.data(), visible.data(), split.data(), D, scale, scores.data(),
                                        packed.data(), outs.data(), tiles, packed_keys);
      else
        ATTEND<float>[(D + 15) / 16](qb.data(), Dq, Rb, reinterpret_cast<const float*>(kh), k.stride(2),
                                     reinterpret_cast<const float*>(vh), v.stride(2), masks.data(), unmasked.data(),
                                     visible.data(), split.data(), D, scale, scores.data(), packed.data(), outs.data(),
                                     tiles, false);
    }
  });
  return out;
}



namespace {
// v rounded to bf16 at element d of q (bf16) or, q null, of the cache row dst (bf16, or float32 if not half);
// parity 0 or 1: dst is a pair row of paired values (weighted_values) and element d goes to 2 d + parity.
TARGET inline void put_bf16(uint16_t* q, char* dst, bool half, int64_t d, __mmask16 m, __m512 v, int parity = -1) {
  if (q) {
    store_bf16(m, q + d, v);
  } else if (parity >= 0) {
    __m512i x = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));  // bf16 in the lanes' low halves
    if (parity) x = _mm512_slli_epi32(x, 16);
    uint32_t lanes = 0;
    for (int i = 0; i < 16; ++i)
      if (m >> i & 1) lanes |= (parity ? 2u : 1u) << (2 * i);
    _mm512_mask_storeu_epi16(reinterpret_cast<uint16_t*>(dst) + 2 * d, lanes, x);
  } else if (half) {
    store_bf16(m, reinterpret_cast<uint16_t*>(dst) + d, v);
  } else {
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(dst) + d, m, round_bf16(v));
  }
}

// One head of D elements: a value head (rotate false) is copied; a query or key head is normed (weight
// non-null: x * rsqrt(mean(x^2) + eps) * weight, rounded to bf16) and rotated (x * cos + roll(x, D / 2) * sin
// in float32, rounded to bf16). The result goes to q (bf16) or to the cache row dst (bf16, or float32 holding
// the bf16 value; a value head at `parity` of the pair row dst where paired). x: scratch of 2 D floats.
TARGET void rope_head(const uint16_t* head, int64_t D, bool rotate, const float* weight, float eps, const uint16_t* c,
                      const uint16_t* sn, float* x, uint16_t* q, char* dst, bool half, int parity) {
  if (!rotate) {
    for (int64_t d = 0; d < D; d += 16)
      put_bf16(q, dst, half, d, tail_mask(D - d), load_bf16(tail_mask(D - d), head + d), parity);
    return;
  }
  float scale = 1.0f;
  if (weight) scale = 1.0f / std::sqrt(sum_squares(head, D) / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    __m512 v = load_bf16(m, head + d);
    if (weight) v = round_bf16(_mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(scale)), _mm512_maskz_loadu_ps(m, weight + d)));
    _mm512_mask_storeu_ps(x + d, m, v);
    _mm512_mask_storeu_ps(x + D + d, m, v);
  }
  for (int64_t d = 0; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), load_bf16(m, c + d)),
                             _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d + D / 2), load_bf16(m, sn + d)));
    put_bf16(q, dst, half, d, m, v);
  }
}
}  // namespace

// qkv [B, T, H + 2 H_kv, D] bf16 contiguous (heads: H queries, H_kv keys, H_kv values); norm [H + H_kv, D]
// float32 or undefined (no q/k norm); cos, sin [B or 1, T, D] bf16, rows contiguous (tlt/model/rope.py's tables:
// x * cos + roll(x, D / 2) * sin); keys, values [B, H_kv, C, D] bf16 or float32 (rows of D contiguous); slots [B]
// int64: row b's T new tokens go to slots[b] .. slots[b] + T - 1; paired: values in attention's paired layout;
// packed_keys: keys in planes of packed keys (key_word). Returns q [B, H, T, D] bf16.
torch::Tensor rope_write(torch::Tensor qkv, int64_t H, c10::optional<torch::Tensor> norm, double eps, torch::Tensor cos,
                         torch::Tensor sin, torch::Tensor keys, torch::Tensor values, torch::Tensor slots,
                         bool paired, bool packed_keys) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous(),
              "rope_write: qkv must be [B, T, heads, D] bf16, contiguous");
  int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(3), Hkv = (qkv.size(2) - H) / 2;
  TORCH_CHECK(H > 0 && Hkv > 0 && H + 2 * Hkv == qkv.size(2) && D % 2 == 0 && D <= 256, "rope_write: bad head counts");
  TORCH_CHECK(cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16 && cos.dim() == 3 &&
              cos.sizes() == sin.sizes() && cos.strides() == sin.strides() && (cos.size(0) == B || cos.size(0) == 1) &&
              cos.size(1) == T && cos.size(2) == D && cos.stride(2) == 1,
              "rope_write: cos and sin must be [B or 1, T, D] bf16 with contiguous rows");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
              (keys.scalar_type() == torch::kFloat32 || keys.scalar_type() == torch::kBFloat16) && keys.dim() == 4 &&
              keys.sizes() == values.sizes() && keys.size(0) == B && keys.size(1) == Hkv && keys.size(3) == D &&
              keys.stride(3) == 1 && values.stride(3) == 1,
              "rope_write: keys and values must be [B, H_kv, C, D] float32 or bf16");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == B && slots.is_contiguous(),
              "rope_write: slots must be [B] int64");
  const float* w = nullptr;
  if (norm && norm->defined()) {
    TORCH_CHECK(norm->scalar_type() == torch::kFloat32 && norm->is_contiguous() && norm->numel() == (H + Hkv) * D,
                "rope_write: norm must be [H + H_kv, D] float32");
    w = norm->data_ptr<float>();
  }
  TORCH_CHECK(!paired || (values.scalar_type() == torch::kBFloat16 && values.stride(2) == D && keys.size(2) % 2 == 0),
              "rope_write: paired values must be bf16 with slot rows next to each other and an even capacity");
  TORCH_CHECK(!packed_keys || (keys.scalar_type() == torch::kBFloat16 && keys.stride(2) == D && keys.size(2) % GROUP == 0),
              "rope_write: packed keys must be bf16 planes of slot rows next to each other, a capacity a multiple of ",
              GROUP);
  const int64_t* slot = slots.data_ptr<int64_t>();
  int64_t C = keys.size(2);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] + T <= C, "rope_write: row ", b, " would write past the cache's capacity");
  auto q = torch::empty({B, H, T, D}, qkv.options());
  auto src = reinterpret_cast<const uint16_t*>(qkv.data_ptr());
  auto cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  auto sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  auto qp = reinterpret_cast<uint16_t*>(q.data_ptr());
  bool half = keys.scalar_type() == torch::kBFloat16;
  char* kp = static_cast<char*>(keys.data_ptr());
  char* vp = static_cast<char*>(values.data_ptr());
  int64_t item = keys.element_size();
  int64_t heads = H + 2 * Hkv;
  // One item: one head of one token, rounded as the reference layer rounds (see the top of the file).
  at::parallel_for(0, B * T * heads, 256, [&](int64_t i0, int64_t i1) {
    alignas(64) float x[512];  // the head twice: x[d + D / 2] is x's rotation by half
    alignas(64) uint16_t key[256];  // a packed key's D elements before they go to their words
    for (int64_t i = i0; i < i1; ++i) {
      int64_t b = i / (T * heads), t = i / heads % T, h = i % heads;
      const uint16_t* head = src + i * D;
      int64_t rope_at = (cos.size(0) == 1 ? 0 : b * cos.stride(0)) + t * cos.stride(1);
      char* dst = nullptr;  // the cache row it goes to, if a key or a value (the pair row of paired values)
      uint16_t* to = h < H ? qp + ((b * H + h) * T + t) * D : nullptr;  // bf16 out: a query (or a packed key)
      int parity = -1;
      bool packed_key = packed_keys && h >= H && h < H + Hkv;
      if (h >= H + Hkv) {
        int64_t s = slot[b] + t;
        if (paired) parity = s % 2, s -= parity;
        dst = vp + (b * values.stride(0) + (h - H - Hkv) * values.stride(1) + s * values.stride(2)) * item;
      } else if (packed_key) {
        to = key;
      } else if (h >= H) {
        dst = kp + (b * keys.stride(0) + (h - H) * keys.stride(1) + (slot[b] + t) * keys.stride(2)) * item;
      }
      rope_head(head, D, h < H + Hkv, w ? w + h * D : nullptr, static_cast<float>(eps), cp + rope_at, sp + rope_at,
                x, to, dst, half, parity);
      if (packed_key) {
        auto plane = reinterpret_cast<uint32_t*>(kp + (b * keys.stride(0) + (h - H) * keys.stride(1)) * item);
        const uint32_t* words = reinterpret_cast<const uint32_t*>(key);
        for (int64_t p = 0; p < D / 2; ++p) plane[key_word(slot[b] + t, p, D / 2)] = words[p];
      }
    }
  });
  return q;
}

namespace {
// silu(g) * u with silu rounded to bf16 first, as torch's bf16 `F.silu(g) * u` rounds: sigmoid from the
// exp of -|g| (never overflows).
TARGET void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    store_bf16(m, out + i, silu_times(load_bf16(m, g + i), load_bf16(m, u + i)));
  }
}
}  // namespace

// gate_up [M, 2 I] bf16 (rows contiguous) -> [M, I] bf16: silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kBFloat16 && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [M, 2 I] bf16 with contiguous rows");
  int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, s = gate_up.stride(0);
  auto out = torch::empty({M, I}, gate_up.options());
  auto gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Items of 512 elements, 32 to a task at least: a decode step's row stays on one thread (a fork costs
  // more than its work), a verification's 17 rows split.
  constexpr int64_t ITEM = 512;
  int64_t per_row = (I + ITEM - 1) / ITEM;
  at::parallel_for(0, M * per_row, 32, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t m = i / per_row, c = i % per_row * ITEM, n = std::min(ITEM, I - c);
      silu_mul_row(gp + m * s + c, gp + m * s + I + c, op + m * I + c, n);
    }
  });
  return out;
}

namespace {
// Slot src's D values of a paired row (weighted_values' layout, row stride D) copied to slot dst: sixteen
// dimensions at a time, the source's half of each 32-bit lane into the destination's half.
TARGET void move_paired(uint16_t* v, int64_t D, int64_t src, int64_t dst) {
  const uint16_t* from = v + src / 2 * 2 * D;
  uint16_t* to = v + dst / 2 * 2 * D;
  for (int64_t d = 0; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    __m512i x = _mm512_maskz_loadu_epi32(m, from + 2 * d);
    x = src % 2 ? _mm512_srli_epi32(x, 16) : _mm512_and_si512(x, _mm512_set1_epi32(0xffff));
    if (dst % 2) x = _mm512_slli_epi32(x, 16);
    uint32_t lanes = 0;
    for (int i = 0; i < 16; ++i)
      if (m >> i & 1) lanes |= (dst % 2 ? 2u : 1u) << (2 * i);
    _mm512_mask_storeu_epi16(to + 2 * d, lanes, x);
  }
}
}  // namespace

// KVCache.compact on the store [2L, B, H_kv, C, D] (float32 or bf16, rows of D contiguous, any strides otherwise;
// entries L.. paired values where `paired`, entries ..L - 1 planes of packed keys where `packed_keys`): in every
// layer's keys and values, row b's slot base[b] + keep[b][j] moves to base[b] + j for j < counts[b] (base, counts
// [B], keep [B, K] int64). keep ascends, so moving in increasing j never overwrites a slot still to be read.
void compact(torch::Tensor store, int64_t L, torch::Tensor base, torch::Tensor keep, torch::Tensor counts,
             bool paired, bool packed_keys) {
  TORCH_CHECK(store.dim() == 5 && store.stride(4) == 1 && store.size(0) == 2 * L &&
              (store.scalar_type() == torch::kFloat32 || store.scalar_type() == torch::kBFloat16),
              "compact: store must be [2L, B, H_kv, C, D] float32 or bf16 with contiguous rows");
  int64_t B = store.size(1), H = store.size(2), C = store.size(3), D = store.size(4), K = keep.size(1);
  TORCH_CHECK(base.scalar_type() == torch::kLong && keep.scalar_type() == torch::kLong &&
              counts.scalar_type() == torch::kLong && base.is_contiguous() && keep.is_contiguous() &&
              counts.is_contiguous() && base.numel() == B && counts.numel() == B && keep.dim() == 2 &&
              keep.size(0) == B, "compact: base, counts [B] and keep [B, K] must be int64");
  TORCH_CHECK(!paired || (store.scalar_type() == torch::kBFloat16 && store.stride(3) == D && C % 2 == 0),
              "compact: paired values must be bf16 with slot rows next to each other");
  TORCH_CHECK(!packed_keys || (store.scalar_type() == torch::kBFloat16 && store.stride(3) == D && C % GROUP == 0),
              "compact: packed keys must be bf16 planes of slot rows next to each other, a capacity a multiple of ",
              GROUP);
  const int64_t* bp = base.data_ptr<int64_t>();
  const int64_t* kp = keep.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < cp[b]; ++j)
      TORCH_CHECK(j < K && bp[b] >= 0 && kp[b * K + j] >= 0 && bp[b] + kp[b * K + j] < C &&
                      (j == 0 || kp[b * K + j] > kp[b * K + j - 1]),
                  "compact: row ", b, " keeps slots outside the cache or not ascending");
  char* data = static_cast<char*>(store.data_ptr());
  int64_t item = store.element_size();
  at::parallel_for(0, 2 * L * B * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t half = i / (B * H), b = i / H % B, h = i % H;
      char* row = data + (half * store.stride(0) + b * store.stride(1) + h * store.stride(2)) * item;
      for (int64_t j = 0; j < cp[b]; ++j) {
        int64_t src = bp[b] + kp[b * K + j], dst = bp[b] + j;
        if (src == dst) continue;
        if (paired && half >= L) {
          move_paired(reinterpret_cast<uint16_t*>(row), D, src, dst);
        } else if (packed_keys && half < L) {
          auto plane = reinterpret_cast<uint32_t*>(row);
          for (int64_t p = 0; p < D / 2; ++p) plane[key_word(dst, p, D / 2)] = plane[key_word(src, p, D / 2)];
        } else {
          std::memmove(row + dst * store.stride(3) * item, row + src * store.stride(3) * item, D * item);
        }
      }
    }
  });
}

// One decoder layer's inference step on the packed weights of tlt/model/fused.py's FusedWeights, the
// operators fused_layer_step calls one by one, in one call: x [B, T, hidden] bf16 contiguous (or packed, below);
// input_eps < 0: no input norm (a drafter's layer); weights[i] packed for linear, sizes[i] its N,
// biases[i] float32 or undefined, scales[i] those of 4-bit weights or undefined, for i = q|k|v, o, gate|up,
// down; qk_norm as rope_write's; cos, sin
// [B or 1, T, (1,) D]; keys, values the layer's cache buffers with room for T more per row, slots [B] the
// rows' lengths, S the slots attention reads; mask as attention's over those S slots; paired: the values in
// attention's paired layout; packed_keys: the keys in planes of packed keys. With counts [B] x is packed, [N, hidden] (N = sum of counts): row b's first
// counts[b] tokens, rows in order, the rest of its T (cos.size(1)) padding. The products then run over the N
// real tokens only; rope_write and the cache see them at their places in [B, T] (padding as zeros) and the
// attention computes only their queries. Each token's result is the same bit for bit either way.
torch::Tensor layer_step(torch::Tensor x, double input_eps, std::vector<torch::Tensor> weights,
                         std::vector<int64_t> sizes, std::vector<c10::optional<torch::Tensor>> biases,
                         std::vector<c10::optional<torch::Tensor>> scales, int64_t H,
                         c10::optional<torch::Tensor> qk_norm, double qk_eps, double post_eps, torch::Tensor cos,
                         torch::Tensor sin, torch::Tensor keys, torch::Tensor values, torch::Tensor slots, int64_t S,
                         c10::optional<torch::Tensor> mask, bool paired, c10::optional<torch::Tensor> counts,
                         bool packed_keys) {
  bool packed = counts && counts->defined();
  TORCH_CHECK(x.dim() == (packed ? 2 : 3) && x.is_contiguous(),
              packed ? "layer_step: packed x must be [N, hidden], contiguous"
                     : "layer_step: x must be [B, T, hidden], contiguous");
  TORCH_CHECK(weights.size() == 4 && sizes.size() == 4 && biases.size() == 4 && scales.size() == 4,
              "layer_step: four products expected");
  if (cos.dim() == 4) cos = cos.select(2, 0), sin = sin.select(2, 0);  // rope tables [B or 1, T, 1, D]
  int64_t B = packed ? slots.size(0) : x.size(0), T = packed ? cos.size(1) : x.size(1);
  int64_t hidden = x.size(-1), D = keys.size(3);
  TORCH_CHECK(S <= keys.size(2), "layer_step: S past the cache buffers");
  torch::Tensor rows;  // packed: each token's index in [B * T]
  if (packed) rows = packed_rows(*counts, B, T, x.size(0));
  auto x2 = x.view({-1, hidden});
  auto normed = input_eps < 0 ? x2 : rms_norm(x2.unsqueeze(0), c10::nullopt, input_eps).squeeze(0);
  auto qkv = linear(normed, weights[0], sizes[0], biases[0], c10::nullopt, scales[0], false);
  if (packed) qkv = torch::zeros({B * T, sizes[0]}, qkv.options()).index_copy_(0, rows, qkv);
  auto q = rope_write(qkv.view({B, T, sizes[0] / D, D}), H, qk_norm, qk_eps, cos, sin, keys, values, slots, paired,
                      packed_keys);
  auto ks = keys.narrow(2, 0, S), vs = values.narrow(2, 0, S);
  auto attended = attention(q, ks, vs, mask, paired, counts, packed_keys).view({B * T, -1});
  if (packed) attended = attended.index_select(0, rows);
  auto h = linear(attended, weights[1], sizes[1], biases[1], x2, scales[1], false);
  auto normed_h = rms_norm(h.unsqueeze(0), c10::nullopt, post_eps).squeeze(0);
  // silu(gate) * up straight from the gate|up product where the halves split on a weight group
  auto act = sizes[2] % (2 * GROUP) == 0
                 ? linear(normed_h, weights[2], sizes[2], biases[2], c10::nullopt, scales[2], true)
                 : silu_mul(linear(normed_h, weights[2], sizes[2], biases[2], c10::nullopt, scales[2], false));
  return linear(act, weights[3], sizes[3], biases[3], h, scales[3], false).view(x.sizes());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, py::arg("qkv"), py::arg("H"), py::arg("norm"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("paired") = false,
        py::arg("packed_keys") = false);
  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("paired") = false,
        py::arg("counts") = py::none(), py::arg("packed_keys") = false);
  m.def("supported", &supported);
  m.def("amx", &amx);
  m.def("set_amx", &set_amx);
  m.def("tile_peak", &tile_peak, py::arg("iterations"), py::arg("fed") = false);
  m.def("dot_peak", &dot_peak);
  m.def("linear", &linear, py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("bias"), py::arg("residual"),
        py::arg("scales") = py::none(), py::arg("silu") = false);
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("compact", &compact, py::arg("store"), py::arg("L"), py::arg("base"), py::arg("keep"), py::arg("counts"),
        py::arg("paired"), py::arg("packed_keys") = false);
  m.def("tree_mask", &tree_mask, py::arg("lengths"), py::arg("tree"), py::arg("valid"), py::arg("S"));
  m.def("layer_step", &layer_step, py::arg("x"), py::arg("input_eps"), py::arg("weights"), py::arg("sizes"),
        py::arg("biases"), py::arg("scales"), py::arg("H"), py::arg("qk_norm"), py::arg("qk_eps"), py::arg("post_eps"),
        py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("S"),
        py::arg("mask"), py::arg("paired") = false, py::arg("counts") = py::none(), py::arg("packed_keys") = false);
}
