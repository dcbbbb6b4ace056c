// Small-M linear (decode): out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W float32 or bfloat16, M <= 16.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

// AVX2 loops; NEON ones for ARM64 at the end of the file. Elsewhere no ops: brisk.ops.linear takes ATen's path.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"

namespace {

using brisk_simd::hsum;
using brisk_simd::load8;
using brisk_simd::with_rows;

// Software prefetch of the weight row stream (simd.h). On an AVX2-only VM 2-4 KiB into L1 measured
// 5-15% faster than none at M = 2..8, and none was best at M = 1 (the hardware prefetcher follows one stream
// well). On the avx512 build's machine, 8-16 KiB into L2: float32 M = 8, the default model's decoder shapes,
// 2 threads: none 19.5 ms, 4 KiB L1 10.4, 8 KiB L2 9.2-9.4, 16 KiB L2 9.1-9.5; M = 1 6.65 -> 6.3 with 16 KiB
// (standalone copies of these loops, one process).
constexpr int64_t kPrefetchBytes = brisk_simd::stream_distance(4096, 8192);
constexpr int64_t kGemvPrefetchBytes = brisk_simd::stream_distance(0, 16384);  // M = 1
constexpr auto kPrefetchHint = brisk_simd::kStreamHint;

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// 4 weight rows against every activation row; the 4 rows (4*K elements) stay in L1 across the M rows.
template <typename W>
void rows4(const W* w, int64_t K, const float* x, int64_t M, float* out, int64_t ldo) {
  const W* w0 = w; const W* w1 = w + K; const W* w2 = w + 2 * K; const W* w3 = w + 3 * K;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 xv = load8(xm + k);
      a0 = _mm256_fmadd_ps(load8(w0 + k), xv, a0);
      a1 = _mm256_fmadd_ps(load8(w1 + k), xv, a1);
      a2 = _mm256_fmadd_ps(load8(w2 + k), xv, a2);
      a3 = _mm256_fmadd_ps(load8(w3 + k), xv, a3);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; k < K; ++k) {
      s0 += to_f(w0[k]) * xm[k]; s1 += to_f(w1[k]) * xm[k]; s2 += to_f(w2[k]) * xm[k]; s3 += to_f(w3[k]) * xm[k];
    }
    float* o = out + m * ldo;
    o[0] = s0; o[1] = s1; o[2] = s2; o[3] = s3;
  }
}

template <typename W>
void row1(const W* w, int64_t K, const float* x, int64_t M, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load8(w + k), load8(xm + k), a);
    float s = hsum(a);
    for (; k < K; ++k) s += to_f(w[k]) * xm[k];
    out[m * ldo] = s;
  }
}

// M = 1: one weight row at a time, two accumulators over 16 columns. A single sequential stream per thread is
// what the hardware prefetcher follows best: measured ~20% more GB/s than 4 interleaved rows on this CPU.
template <typename W>
void gemv_rows(const W* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      if constexpr (kGemvPrefetchBytes > 0)
        if (sizeof(W) == 4 || (k & 31) == 0)  // a prefetch per 64 bytes of weights
          _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kGemvPrefetchBytes, kPrefetchHint);
      a0 = _mm256_fmadd_ps(load8(wr + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(load8(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(wr + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; ++k) s += to_f(wr[k]) * x[k];
    out[n] = s;
  }
}

// 2..8 activation rows (batched decode, speculative verification): still one weight row at a time, the single
// sequential stream of gemv_rows, each 8-column chunk multiplied into MT accumulators (the x rows stay in L1).
// Measured 5-15% faster than rows4's four interleaved row streams at M = 2..8.
template <int MT, typename W>
void gemm_rows_seq(const W* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    __m256 a[MT];
    for (int m = 0; m < MT; ++m) a[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kPrefetchBytes, kPrefetchHint);
      const __m256 wv = load8(wr + k);
      for (int m = 0; m < MT; ++m) a[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), a[m]);
    }
    for (int m = 0; m < MT; ++m) {
      float s = hsum(a[m]);
      for (int64_t kk = k; kk < K; ++kk) s += to_f(wr[kk]) * x[m * K + kk];
      out[m * ldo + n] = s;
    }
  }
}

template <typename W>
void seq_dispatch(int64_t M, const W* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  with_rows(M, [&](auto mt) { gemm_rows_seq<decltype(mt)::value>(w, K, x, n0, n1, out, ldo); });
}

// bfloat16 weights, K % 16 == 0: 16 weights per 256-bit load, split into the even elements (the low halves of
// each 32-bit lane, shifted up: exact bf16 -> f32) and the odd ones (the high halves, masked), multiplied into
// x stored de-interleaved per 16 columns (xp[16b..16b+7] = x[16b + 0, 2, .., 14], xp[16b+8..] = the odd ones).
// Two integer ops per 16 weights instead of four (a widening shuffle and a shift per 8).
inline void split16(const at::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

void gemv_rows_eo(const at::BFloat16* w, int64_t K, const float* xp, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wr = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    __m256 e, o;
    for (; k + 32 <= K; k += 32) {
      split16(wr + k, e, o);
      a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xp + k), a0);
      a1 = _mm256_fmadd_ps(o, _mm256_loadu_ps(xp + k + 8), a1);
      split16(wr + k + 16, e, o);
      a2 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xp + k + 16), a2);
      a3 = _mm256_fmadd_ps(o, _mm256_loadu_ps(xp + k + 24), a3);
    }
    if (k < K) {
      split16(wr + k, e, o);
      a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(xp + k), a0);
      a1 = _mm256_fmadd_ps(o, _mm256_loadu_ps(xp + k + 8), a1);
    }
    out[n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

template <int MT>
void gemm_rows_seq_eo(const at::BFloat16* w, int64_t K, const float* xp, int64_t n0, int64_t n1, float* out,
                      int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wr = w + n * K;
    __m256 a[MT];
    for (int m = 0; m < MT; ++m) a[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kPrefetchBytes, kPrefetchHint);
      __m256 e, o;
      split16(wr + k, e, o);
      for (int m = 0; m < MT; ++m) {
        a[m] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xp + m * K + k), a[m]);
        a[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xp + m * K + k + 8), a[m]);
      }
    }
    for (int m = 0; m < MT; ++m) out[m * ldo + n] = hsum(a[m]);
  }
}

void seq_dispatch_eo(int64_t M, const at::BFloat16* w, int64_t K, const float* xp, int64_t n0, int64_t n1,
                     float* out, int64_t ldo) {
  with_rows(M, [&](auto mt) { gemm_rows_seq_eo<decltype(mt)::value>(w, K, xp, n0, n1, out, ldo); });
}

// M <= 8 rows of de-interleaved x (xp, see split16) against bfloat16 weights with K % 16 == 0
void run_bf16_eo(const at::BFloat16* w, const float* xpp, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * 2));
  if (M == 1)
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemv_rows_eo(w, K, xpp, n0, n1, out); });
  else
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { seq_dispatch_eo(M, w, K, xpp, n0, n1, out, N); });
}

template <typename W>
void run(const W* w, const float* x, float* out, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * (int64_t)sizeof(W)));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemv_rows(w, K, x, n0, n1, out); });
    return;
  }
  if (M <= 8) {
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * (int64_t)sizeof(W)));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { seq_dispatch(M, w, K, x, n0, n1, out, N); });
    return;
  }
  const int64_t blocks = N / 4;
  // grain: enough rows per task that a task streams >= ~64 KiB of weights
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (4 * K * (int64_t)sizeof(W)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows4(w + b * 4 * K, K, x, M, out + b * 4, N);
  });
  for (int64_t n = blocks * 4; n < N; ++n) row1(w + n * K, K, x, M, out + n, N);
}


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BRISK_LINEAR_AVX512 1
// The avx512 build (kernels.py): bfloat16 weights against bfloat16 activations, M <= 8 rows. vdpbf16ps multiplies
// 32 bf16 pairs and adds each pair's two products into one float32 lane (products exact, sums in float32 as in the
// loops above), so one load of 32 weights feeds each activation row with one instruction and nothing is widened
// or de-interleaved: the linears of a bf16 decode step (30 layers) took 6.3-6.5 ms at M = 8 against 9.0-10.3 with
// the AVX2 split16 loop, 3.8-4.0 against 5.5-6.1 at M = 2 (same machine, alternated processes; M = 1 is memory
// bound either way). The tail of a row (K % 32) is a masked load, whose masked-off lanes read as zero.
// float32 at M = 2..8 has its own tiled loop below (tile_f32_512); M = 1 stays on the 256-bit gemv_rows.

inline __m512bh load_bh(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const at::BFloat16* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }

// Several weight rows at once (NR) against all MT activation rows: each activation vector loaded serves NR rows,
// so a step of 32 columns is NR + MT loads for NR * MT dot products instead of 1 + MT loads for MT, and NR
// sequential weight streams are in flight instead of one. At M = 8 the single-row loop is bound by its loads
// (9 per 8 vdpbf16ps); three rows bring that to 11 per 24. Accumulators: NR * MT zmm registers (24 at 3 x 8).
// 1B shape's decoder linears, M = 2..8, 2 threads, alternated in one process on the shared 2-core Zen 5 VM:
// NR = 3 1.05-1.43x the single-row loop, NR = 4 1.25-1.30x (registers run out at 4 x 8).
template <int MT, int NR>
void rows_bf16_512(const at::BFloat16* w, int64_t K, const at::BFloat16* x, int64_t n0, int64_t n1, float* out,
                   int64_t ldo) {
  const int64_t kfull = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - kfull)) - 1ull);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const at::BFloat16* wr = w + n * K;
    __m512 a[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kfull; k += 32) {
      __m512bh wv[NR];
      for (int r = 0; r < NR; ++r) {
        if ((k & 63) == 0)  // one prefetch per 64 bytes of each row
          _mm_prefetch(reinterpret_cast<const char*>(wr + r * K + k) + kPrefetchBytes, kPrefetchHint);
        wv[r] = load_bh(wr + r * K + k);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = load_bh(x + m * K + k);
        for (int r = 0; r < NR; ++r) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
      }
    }
    if (tail) {
      __m512bh wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = load_bh(wr + r * K + kfull, tail);
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = load_bh(x + m * K + kfull, tail);
        for (int r = 0; r < NR; ++r) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) out[m * ldo + n + r] = _mm512_reduce_add_ps(a[r][m]);
  }
  if constexpr (NR > 1)
    if (n < n1) rows_bf16_512<MT, 1>(w, K, x, n, n1, out, ldo);  // the last rows of the range
}

// float32 weights and activations, M = 2..8, the same tiling with 512-bit FMAs: four weight rows (4 x 8 = 32
// accumulators; the compiler takes the weight vectors as FMA memory operands). Same measurement as above:
// NR = 4 1.16-1.46x the 256-bit single-row loop at M = 8, 1.03-1.29x at M = 4; NR = 3 1.01-1.21x at M = 8.
template <int MT, int NR>
void rows_f32_512(const float* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t kfull = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - kfull)) - 1u);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const float* wr = w + n * K;
    __m512 a[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kfull; k += 16) {
      __m512 wv[NR];
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + r * K + k) + kPrefetchBytes, kPrefetchHint);
        wv[r] = _mm512_loadu_ps(wr + r * K + k);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * K + k);
        for (int r = 0; r < NR; ++r) a[r][m] = _mm512_fmadd_ps(wv[r], xv, a[r][m]);
      }
    }
    if (tail) {
      __m512 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, wr + r * K + kfull);
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + kfull);
        for (int r = 0; r < NR; ++r) a[r][m] = _mm512_fmadd_ps(wv[r], xv, a[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) out[m * ldo + n + r] = _mm512_reduce_add_ps(a[r][m]);
  }
  if constexpr (NR > 1)
    if (n < n1) rows_f32_512<MT, 1>(w, K, x, n, n1, out, ldo);
}

// Tiles of NR rows over the threads; the last thread's range also takes the N % NR rows left over.
template <int NR, typename T, typename F>
void parallel_tiles(int64_t N, int64_t K, F&& rows) {
  const int64_t tiles = N / NR;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * (int64_t)sizeof(T) * NR));
  if (tiles == 0) {
    rows(0, N);
    return;
  }
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { rows(t0 * NR, t1 == tiles ? N : t1 * NR); });
}

// M = 1..8 rows of bfloat16 x against bfloat16 weights; M = 1 one row at a time (one stream: memory bound)
void run_bf16_512(const at::BFloat16* w, const at::BFloat16* x, float* out, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * 2));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_bf16_512<1, 1>(w, K, x, n0, n1, out, N); });
    return;
  }
  parallel_tiles<3, at::BFloat16>(N, K, [&](int64_t n0, int64_t n1) {
    with_rows(M, [&](auto mt) { rows_bf16_512<decltype(mt)::value, 3>(w, K, x, n0, n1, out, N); });
  });
}

// M = 2..8 rows of float32 x against float32 weights
void run_f32_512(const float* w, const float* x, float* out, int64_t M, int64_t N, int64_t K) {
  parallel_tiles<4, float>(N, K, [&](int64_t n0, int64_t n1) {
    with_rows(M, [&](auto mt) { rows_f32_512<decltype(mt)::value, 4>(w, K, x, n0, n1, out, N); });
  });
}
#endif  // AVX-512 F + BW + BF16

// x as float32 rows in `dst` ([M, K]); with `deinterleave`, each 16 columns stored evens first (split16's order).
// A plain loop: for decode-sized x, ATen's .to() costs more in dispatch and allocation than the copy itself.
template <typename T>
void gather_x(const T* x, int64_t M, int64_t K, bool deinterleave, float* dst) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * K;
    float* d = dst + m * K;
    if (!deinterleave) {
      for (int64_t k = 0; k < K; ++k) d[k] = static_cast<float>(xr[k]);
      continue;
    }
    for (int64_t k = 0; k < K; k += 16)
      for (int j = 0; j < 8; ++j) {
        d[k + j] = static_cast<float>(xr[k + 2 * j]);
        d[k + 8 + j] = static_cast<float>(xr[k + 2 * j + 1]);
      }
  }
}

}  // namespace

// x: [M, K] (float32 or the weight dtype), weight: [N, K] contiguous, bias: [N] or empty -> [M, N] in x's dtype.
// A bfloat16 result is the float32 sum (+ bias) rounded once, as before (at::BFloat16's round-to-nearest-even).
// From this many rows, bfloat16 x times bfloat16 weights is left to ATen's GEMM (oneDNN): on a CPU with AMX-BF16
// its tile GEMM streams the weights at the memory's speed from a few rows on, where the vdpbf16ps loops below
// become compute-bound (Xeon, 2 threads, four 16384 x 3072 weights: 8 rows 25.3 -> 19.1 ms, 4 rows 21.7 -> 19.9;
// 1-2 rows no faster). 0 (the default): never. Set by ops/kernels.py with the AMX switch, where /proc/cpuinfo
// reports amx_bf16.
std::atomic<int64_t> g_bf16_gemm_rows{0};

int64_t linear_small_bf16_gemm_rows(int64_t rows) {
  g_bf16_gemm_rows.store(std::max<int64_t>(rows, 0));
  return g_bf16_gemm_rows.load();
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear_small_m: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_small_m: K mismatch");
  TORCH_CHECK(weight.is_contiguous(), "linear_small_m: weight must be contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear_small_m: weight must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_small_m: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool bf16_w = weight.scalar_type() == at::kBFloat16;
  if (const int64_t gemm_rows = g_bf16_gemm_rows.load(std::memory_order_relaxed);
      gemm_rows > 0 && M >= gemm_rows && bf16_w && x.scalar_type() == at::kBFloat16)
    return at::linear(x, weight, bias.has_value() && bias->defined() ? std::optional<at::Tensor>(bias->to(at::kBFloat16))
                                                                        : std::nullopt);
  const bool eo = bf16_w && M <= 8 && K % 16 == 0;
  const bool f32_x = x.scalar_type() == at::kFloat;
  auto xc = x.contiguous();
#ifdef BRISK_LINEAR_AVX512
  // bfloat16 x and weights: the vdpbf16ps loops, x read as it is
  const bool wide = M <= 8 && bf16_w && !f32_x;
  const bool wide_f32 = M >= 2 && M <= 8 && !bf16_w && f32_x;  // the tiled 512-bit float32 loop
#else
  const bool wide = false;
  const bool wide_f32 = false;
#endif
  std::vector<float> xbuf;
  const float* xf;
  if (wide || (f32_x && !eo)) {
    xf = f32_x ? xc.data_ptr<float>() : nullptr;
  } else {
    xbuf.resize(M * K);
    if (f32_x) gather_x(xc.data_ptr<float>(), M, K, eo, xbuf.data());
    else gather_x(xc.data_ptr<at::BFloat16>(), M, K, eo, xbuf.data());
    xf = xbuf.data();
  }
  auto out = at::empty({M, N}, x.options());
  std::vector<float> obuf;
  float* of = f32_x ? out.data_ptr<float>() : (obuf.resize(M * N), obuf.data());
  if (wide) {
#ifdef BRISK_LINEAR_AVX512
    run_bf16_512(weight.data_ptr<at::BFloat16>(), xc.data_ptr<at::BFloat16>(), of, M, N, K);
#endif
  } else if (wide_f32) {
#ifdef BRISK_LINEAR_AVX512
    run_f32_512(weight.data_ptr<float>(), xf, of, M, N, K);
#endif
  } else if (!bf16_w) run(weight.data_ptr<float>(), xf, of, M, N, K);
  else if (eo) run_bf16_eo(weight.data_ptr<at::BFloat16>(), xf, of, M, N, K);
  else run(weight.data_ptr<at::BFloat16>(), xf, of, M, N, K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_small_m: bias must have N elements");
    auto bf = bias->to(at::kFloat).contiguous();
    const float* b = bf.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) of[m * N + n] += b[n];
  }
  if (!f32_x) {
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) o[i] = at::BFloat16(of[i]);
  }
  return out;
}

// The schema, then a CPU kernel (not a catch-all): torch.compile traces the op as one opaque call through the
// shape function engine/compiled.py registers (a catch-all kernel would have to be decomposed, which C++ cannot).
TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_small_bf16_gemm_rows(int rows) -> int", &linear_small_bf16_gemm_rows);
}

TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
}

#endif  // AVX2 + FMA

#if defined(__aarch64__) && defined(__ARM_NEON)
// ---- ARM64 (NEON) ----
// The same op: one weight row at a time (the single sequential stream the AVX2 GEMV measured best with), 16 columns
// per step into 4-lane float32 accumulators for each of up to 8 activation rows; bfloat16 weights widened exactly
// (a 16-bit shift). The float32 sums add in another order than the AVX2 build's, so their last bits may differ.
#include <arm_neon.h>

namespace {

inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const at::BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// weight rows n0 .. n1-1 against MT rows of x ([MT, K] float32) -> out[m * ldo + n]
template <int MT, typename W>
void rows_neon(const W* w, int64_t K, const float* x, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    float32x4_t a[MT][2];
    for (int m = 0; m < MT; ++m) a[m][0] = a[m][1] = vdupq_n_f32(0.f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      if ((k & 31) == 0) __builtin_prefetch(wr + k + 2048);
      const float32x4_t w0 = load4(wr + k), w1 = load4(wr + k + 4);
      for (int m = 0; m < MT; ++m) {  // two accumulators per row: two FMA chains in flight
        a[m][0] = vfmaq_f32(a[m][0], w0, vld1q_f32(x + m * K + k));
        a[m][1] = vfmaq_f32(a[m][1], w1, vld1q_f32(x + m * K + k + 4));
      }
    }
    for (int m = 0; m < MT; ++m) {
      float s = vaddvq_f32(vaddq_f32(a[m][0], a[m][1]));
      for (int64_t kk = k; kk < K; ++kk) s += to_f(wr[kk]) * x[m * K + kk];
      out[m * ldo + n] = s;
    }
  }
}

// f(std::integral_constant<int, M>{}) for M = 1..8 (simd.h's with_rows; that header is x86 code)
template <typename F>
inline void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

template <typename W>
void run_neon(const W* w, const float* x, float* out, int64_t M, int64_t N, int64_t K) {
  // grain: enough rows per task that a task streams >= ~64 KiB of weights
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {  // tiles of up to 8 rows, each over the task's weight rows
      const int64_t mt = std::min<int64_t>(8, M - m);
      with_rows(mt, [&](auto t) { rows_neon<decltype(t)::value>(w, K, x + m * K, n0, n1, out + m * N, N); });
    }
  });
}

}  // namespace

std::atomic<int64_t> g_bf16_gemm_rows{0};  // as in the x86 build: rows from which bf16 x bf16 goes to ATen's GEMM

int64_t linear_small_bf16_gemm_rows(int64_t rows) {
  g_bf16_gemm_rows.store(std::max<int64_t>(rows, 0));
  return g_bf16_gemm_rows.load();
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear_small_m: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_small_m: K mismatch");
  TORCH_CHECK(weight.is_contiguous(), "linear_small_m: weight must be contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear_small_m: weight must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_small_m: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool bf16_w = weight.scalar_type() == at::kBFloat16, f32_x = x.scalar_type() == at::kFloat;
  if (const int64_t gemm_rows = g_bf16_gemm_rows.load(std::memory_order_relaxed);
      gemm_rows > 0 && M >= gemm_rows && bf16_w && !f32_x)
    return at::linear(x, weight,
                      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(bias->to(at::kBFloat16))
                                                          : std::nullopt);
  auto xc = x.contiguous();
  std::vector<float> xbuf;
  const float* xf;
  if (f32_x) {
    xf = xc.data_ptr<float>();
  } else {  // bfloat16 rows widened once (exact); decode-sized x costs less than ATen's .to() dispatch
    xbuf.resize(M * K);
    const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = static_cast<float>(xb[i]);
    xf = xbuf.data();
  }
  auto out = at::empty({M, N}, x.options());
  std::vector<float> obuf;
  float* of = f32_x ? out.data_ptr<float>() : (obuf.resize(M * N), obuf.data());
  if (bf16_w) run_neon(weight.data_ptr<at::BFloat16>(), xf, of, M, N, K);
  else run_neon(weight.data_ptr<float>(), xf, of, M, N, K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_small_m: bias must have N elements");
    auto bf = bias->to(at::kFloat).contiguous();
    const float* b = bf.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) of[m * N + n] += b[n];
  }
  if (!f32_x) {  // the float32 sum (+ bias) rounded once, as the x86 build
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; ++i) o[i] = at::BFloat16(of[i]);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_small_bf16_gemm_rows(int rows) -> int", &linear_small_bf16_gemm_rows);
}

TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("linear_small_m", &linear_small_m);
}
#endif  // aarch64 NEON
