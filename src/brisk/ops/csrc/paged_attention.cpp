// Paged attention for the CPU that reads brisk's KV cache in place: no gathered contiguous copy per step.
//
// kv_cache: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim], contiguous. Logical position p of a
// sequence lives at kv_cache[:, block_table[p / block_size], p % block_size].
//
// One work item = (sequence, tile of its query tokens, kv heads [kv_begin, kv_end)). Its "rows" are the tile's
// query tokens times the query heads of those kv heads; the h / kvh query heads of one kv head (the GQA group)
// share every key and value row read from the cache while it sits in L1:
//
//   row r = (query token i, query head)   sees positions [lo_i, hi_i):  hi_i = pos_i + 1,  lo_i = hi_i - window
//   keys walked in chunks of kChunk positions, each position found through the block table:
//       | block_table[0] | block_table[1] | ... |   ->   chunk [p0, p1)
//   per chunk and kv head:  S = Q K^T  ->  online softmax (running max m_r and sum l_r, flash-style)
//                                      ->  acc_r = acc_r * exp(m_old - m_new) + P V
//
// The softmax runs in base 2: q is pre-multiplied by scale * log2(e), so exp(s - m) becomes exp2(s' - m').
// Decode is the case "one query token per sequence"; chunked prefill / verification has several, with the
// causal limit of token i offset by the tokens already in the cache (pos_i = context_len - query_len + i).
// Accumulation is float32 whatever the cache and query dtypes (float32 or bfloat16).
//
// Where the time goes (2-core AVX2 EPYC, SmolLM2 shapes): with the data in L1 a (key, query head) pair costs
// ~6 ns; at batch 64 x 370 tokens the float32 cache (36 MB a layer) comes from DRAM and that dominates.
// Batch-1 decode has one work item per kv head (3 on 2 threads): split-K cuts each into parts over the keys
// (attention_impl, merge_parts): one layer at 140 / 400 / 1,000 tokens 24.8 -> 19.4, 55.0 -> 36.2,
// 122.3 -> 76.6 us (median of 7 x 300 calls, float32, old and new builds alternated in one process).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BRISK_AVX2 1
#if defined(__AVX512F__)
// 512-bit dot products and value accumulation for head_dim % 16 == 0, and a whole GQA group of three query rows
// sharing every key and value load (32 registers hold its 12 accumulators)
#define BRISK_AVX512 1
#endif
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
// ARM64: 4-lane NEON versions of the inner loops (q . k, the softmax's exp2, the weighted sum of the values, the
// widening of bfloat16 / int8 / int4 cache rows) under the same item, chunk and row loops as x86
#include <arm_neon.h>
#define BRISK_NEON 1
#endif

namespace brisk {
namespace {

#ifndef BRISK_CHUNK
#define BRISK_CHUNK 32
#endif
// keys per chunk (they may span cache blocks): the per-chunk softmax bookkeeping of a row is amortized over
// this many keys, and the chunk's widened K and V rows (bfloat16 cache) stay in L1
constexpr int64_t kChunk = BRISK_CHUNK;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, c10::BFloat16* dst) { *dst = c10::BFloat16(x); }  // round to nearest even

#ifdef BRISK_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift into place
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 2^x for x <= 0 (all our arguments are s - max), 0 below 2^-126 and for -inf (masked keys).
// 2^x = 2^n * 2^f with n = round(x), f in [-1/2, 1/2];  2^f = e^r, r = f ln2, |r| <= 0.347, by its Taylor series
// to degree 7 (truncation error r^8 / 8! < 6e-9, below float32 rounding).
inline __m256 exp2_8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n as a float: biased exponent n + 127 in bits 23..30
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// [sum(a0), sum(a1), ..., sum(a7)]: the eight horizontal sums of eight registers, by pairwise adds.
inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1);  // [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67]
  const __m256 t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5);
  const __m256 t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0 0..3, a1 0..3, a2 0..3, a3 0..3 | the same over 4..7]
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#ifdef BRISK_NEON
// exp2_8's 2^x, 4 lanes: the same range reduction (round to nearest even), polynomial and fused multiply-adds, so
// the same bits per lane for any finite x
inline float32x4_t exp2_4(float32x4_t x) {
  const float32x4_t lo = vdupq_n_f32(-126.0f);
  const uint32x4_t underflow = vcltq_f32(x, lo);
  x = vmaxq_f32(x, lo);
  const float32x4_t n = vrndnq_f32(x);
  const float32x4_t r = vmulq_f32(vsubq_f32(x, n), vdupq_n_f32(0.6931471805599453f));
  float32x4_t p = vdupq_n_f32(1.0f / 5040);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  const float32x4_t v = vmulq_f32(p, vreinterpretq_f32_s32(e));
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), underflow));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)] by pairwise adds
inline float32x4_t hsum4x4(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  return vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
}
#endif

#ifdef BRISK_AVX512
inline __m256 fold(__m512 v) {  // 16 lanes -> 8 (pairwise sums of the halves)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// dot_rows for head_dim % 16 == 0, R = 1..3 query rows, four keys a step (R x 4 accumulators)
template <int R>
inline void dot_rows_512(const float* const* q, const float* const* keys, int64_t n, int64_t d,
                         float* const* scores) {
  for (int64_t t0 = 0; t0 < n; t0 += 4) {
    const float* k[4];
    for (int j = 0; j < 4; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      __m512 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(k[j] + c);
      for (int r = 0; r < R; ++r) {
        const __m512 qv = _mm512_loadu_ps(q[r] + c);
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(qv, kv[j], a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(scores[r] + t0, hsum4x8(fold(a[r][0]), fold(a[r][1]), fold(a[r][2]), fold(a[r][3])));
  }
}

#endif

#ifdef BRISK_AVX512
// bfloat16 cache rows read in place (head_dim % 32 == 0): 32 values a 512-bit load, widened by two operations:
// the even-indexed values are the low halves of the 32-bit lanes (a shift up), the odd-indexed ones the high
// halves (a mask). The query rows and accumulators of such an item are kept in that split order, per 32 columns
// [16 even | 16 odd] (perm_index), so nothing is shuffled in the loops.
inline int64_t perm_index(int64_t c) { return c / 32 * 32 + (c % 2) * 16 + c % 32 / 2; }

inline void widen_bf16(const c10::BFloat16* src, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(src);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int R>
inline void dot_rows_bf16(const float* const* q, const c10::BFloat16* const* keys, int64_t n, int64_t d,
                          float* const* scores) {
  for (int64_t t0 = 0; t0 < n; t0 += 4) {
    const c10::BFloat16* k[4];
    for (int j = 0; j < 4; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      __m512 ke[4], ko[4];
      for (int j = 0; j < 4; ++j) widen_bf16(k[j] + c, ke[j], ko[j]);
      for (int r = 0; r < R; ++r) {
        const __m512 qe = _mm512_loadu_ps(q[r] + c), qo = _mm512_loadu_ps(q[r] + c + 16);
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(qo, ko[j], _mm512_fmadd_ps(qe, ke[j], a[r][j]));
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(scores[r] + t0, hsum4x8(fold(a[r][0]), fold(a[r][1]), fold(a[r][2]), fold(a[r][3])));
  }
}

// acc (split order) [r][c0 .. c0 + 32W) for R rows, bfloat16 value rows
template <int R, int W>
inline void accumulate_slice_bf16(const float* const* p, int64_t n, const c10::BFloat16* const* values, int64_t c0,
                                  const float* alpha, float* const* acc) {
  __m512 a[R][2 * W];
  for (int r = 0; r < R; ++r) {
    const __m512 av = _mm512_set1_ps(alpha[r]);
    for (int w = 0; w < 2 * W; ++w) a[r][w] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c0 + 16 * w), av);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 pt[R];
    for (int r = 0; r < R; ++r) pt[r] = _mm512_set1_ps(p[r][t]);
    const c10::BFloat16* vt = values[t] + c0;
    for (int w = 0; w < W; ++w) {
      __m512 ve, vo;
      widen_bf16(vt + 32 * w, ve, vo);
      for (int r = 0; r < R; ++r) {
        a[r][2 * w] = _mm512_fmadd_ps(pt[r], ve, a[r][2 * w]);
        a[r][2 * w + 1] = _mm512_fmadd_ps(pt[r], vo, a[r][2 * w + 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < 2 * W; ++w) _mm512_storeu_ps(acc[r] + c0 + 16 * w, a[r][w]);
}

template <int R>
inline void accumulate_values_bf16(const float* const* p, int64_t n, const c10::BFloat16* const* values, int64_t d,
                                   const float* alpha, float* const* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {  // 64 columns a pass: R x 4 <= 12 accumulators
    if (d - c0 >= 64) accumulate_slice_bf16<R, 2>(p, n, values, c0, alpha, acc);
    else accumulate_slice_bf16<R, 1>(p, n, values, c0, alpha, acc);
  }
}
#endif

// scores[r][t] = q[r] . keys[t] for R query rows (1 to 3) and t < n (n <= kChunk); keys[t] point at head_dim
// floats. Two rows share every key load: with 4 keys x 2 rows in 8 accumulators a step is 6 loads for 8 FMAs
// instead of 9 (the loads, not the FMAs, are the limit). Tail lanes recompute a valid key; scores has room.
template <int R>
inline void dot_rows(const float* const* q, const float* const* keys, int64_t n, int64_t d, float* const* scores) {
#ifdef BRISK_AVX512
  if (d % 16 == 0) return dot_rows_512<R>(q, keys, n, d, scores);
#endif
  if constexpr (R == 3) {  // (the 512-bit path takes three rows at once)
    dot_rows<2>(q, keys, n, d, scores);
    return dot_rows<1>(q + 2, keys, n, d, scores + 2);
  }
#ifdef BRISK_AVX2
  if constexpr (R == 2) {
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      const float* k[4];
      for (int j = 0; j < 4; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 q0 = _mm256_loadu_ps(q[0] + c), q1 = _mm256_loadu_ps(q[1] + c);
        const __m256 k0 = _mm256_loadu_ps(k[0] + c), k1 = _mm256_loadu_ps(k[1] + c);
        const __m256 k2 = _mm256_loadu_ps(k[2] + c), k3 = _mm256_loadu_ps(k[3] + c);
        a0 = _mm256_fmadd_ps(q0, k0, a0);
        a1 = _mm256_fmadd_ps(q0, k1, a1);
        a2 = _mm256_fmadd_ps(q0, k2, a2);
        a3 = _mm256_fmadd_ps(q0, k3, a3);
        b0 = _mm256_fmadd_ps(q1, k0, b0);
        b1 = _mm256_fmadd_ps(q1, k1, b1);
        b2 = _mm256_fmadd_ps(q1, k2, b2);
        b3 = _mm256_fmadd_ps(q1, k3, b3);
      }
      const __m256 sums = hsum8x8(a0, a1, a2, a3, b0, b1, b2, b3);  // [row 0: 4 keys | row 1: 4 keys]
      _mm_storeu_ps(scores[0] + t0, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(scores[1] + t0, _mm256_extractf128_ps(sums, 1));
    }
  } else {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const float* k[8];
      for (int j = 0; j < 8; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q[0] + c);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + c), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + c), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + c), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + c), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + c), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + c), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + c), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + c), a7);
      }
      _mm256_storeu_ps(scores[0] + t0, hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
#elif defined(BRISK_NEON)
  // as the AVX2 loops, 4 lanes: two rows x 4 keys (6 loads for 8 FMAs), or one row x 8 keys
  if constexpr (R == 2) {
    for (int64_t t0 = 0; t0 < n; t0 += 4) {
      const float* k[4];
      for (int j = 0; j < 4; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
      float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t c = 0; c < d; c += 4) {
        const float32x4_t q0 = vld1q_f32(q[0] + c), q1 = vld1q_f32(q[1] + c);
        const float32x4_t k0 = vld1q_f32(k[0] + c), k1 = vld1q_f32(k[1] + c);
        const float32x4_t k2 = vld1q_f32(k[2] + c), k3 = vld1q_f32(k[3] + c);
        a0 = vfmaq_f32(a0, q0, k0);
        a1 = vfmaq_f32(a1, q0, k1);
        a2 = vfmaq_f32(a2, q0, k2);
        a3 = vfmaq_f32(a3, q0, k3);
        b0 = vfmaq_f32(b0, q1, k0);
        b1 = vfmaq_f32(b1, q1, k1);
        b2 = vfmaq_f32(b2, q1, k2);
        b3 = vfmaq_f32(b3, q1, k3);
      }
      vst1q_f32(scores[0] + t0, hsum4x4(a0, a1, a2, a3));
      vst1q_f32(scores[1] + t0, hsum4x4(b0, b1, b2, b3));
    }
  } else {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const float* k[8];
      for (int j = 0; j < 8; ++j) k[j] = keys[t0 + j < n ? t0 + j : t0];
      float32x4_t a[8];
      for (int j = 0; j < 8; ++j) a[j] = vdupq_n_f32(0.0f);
      for (int64_t c = 0; c < d; c += 4) {
        const float32x4_t qv = vld1q_f32(q[0] + c);
        for (int j = 0; j < 8; ++j) a[j] = vfmaq_f32(a[j], qv, vld1q_f32(k[j] + c));
      }
      vst1q_f32(scores[0] + t0, hsum4x4(a[0], a[1], a[2], a[3]));
      vst1q_f32(scores[0] + t0 + 4, hsum4x4(a[4], a[5], a[6], a[7]));
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < n; ++t) {
      float s = 0.0f;
      for (int64_t c = 0; c < d; ++c) s += q[r][c] * keys[t][c];
      scores[r][t] = s;
    }
  }
#endif
}

// One online-softmax step of one row over a chunk of n scores (masked ones are -inf, at least one is not):
// scores become p = exp2(s - m_new), the running max m and sum l move to the chunk, and the factor that
// rescales the row's accumulator to the new max is returned.
inline float softmax_chunk(float* scores, int64_t n, float& m, float& l) {
  float m_chunk = kNegInf, sum = 0.0f;
#ifdef BRISK_AVX2
  for (int64_t t = n; t < (n + 7) / 8 * 8; ++t) scores[t] = kNegInf;  // padding lanes -> p = 0
  __m256 mx = _mm256_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(scores + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float x : lanes) m_chunk = std::max(m_chunk, x);
  const float m_new = std::max(m, m_chunk);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 p = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    _mm256_storeu_ps(scores + t, p);
    sv = _mm256_add_ps(sv, p);
  }
  _mm256_store_ps(lanes, sv);
  for (float x : lanes) sum += x;
#elif defined(BRISK_NEON)
  for (int64_t t = n; t < (n + 3) / 4 * 4; ++t) scores[t] = kNegInf;  // padding lanes -> p = 0
  float32x4_t mx = vdupq_n_f32(kNegInf);
  for (int64_t t = 0; t < n; t += 4) mx = vmaxq_f32(mx, vld1q_f32(scores + t));
  m_chunk = vmaxvq_f32(mx);
  const float m_new = std::max(m, m_chunk);
  const float32x4_t mv = vdupq_n_f32(m_new);
  float32x4_t sv = vdupq_n_f32(0.0f);
  for (int64_t t = 0; t < n; t += 4) {
    const float32x4_t p = exp2_4(vsubq_f32(vld1q_f32(scores + t), mv));
    vst1q_f32(scores + t, p);
    sv = vaddq_f32(sv, p);
  }
  sum = vaddvq_f32(sv);
#else
  for (int64_t t = 0; t < n; ++t) m_chunk = std::max(m_chunk, scores[t]);
  const float m_new = std::max(m, m_chunk);
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp2(scores[t] - m_new);
    sum += scores[t];
  }
#endif
  const float alpha = std::exp2(m - m_new);  // 0 on the first chunk (m = -inf)
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

#ifdef BRISK_AVX2
// float vectors of 8 (AVX2) or 16 (AVX-512) lanes, for the kernels written once for both widths
struct F256 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#ifdef BRISK_AVX512
struct F512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif
#endif
#ifdef BRISK_NEON
struct F128 {
  using V = float32x4_t;
  static constexpr int kLanes = 4;
  static V load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static V set1(float x) { return vdupq_n_f32(x); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
};
#endif

#if defined(BRISK_AVX2) || defined(BRISK_NEON)
// acc[r][c0 .. c0 + L W) = alpha[r] * acc[r] + sum_t p[r][t] * values[t][c0 ..) for R rows sharing each value
// load (L = the vector's lanes). The R x W accumulators stay in registers while the n value rows stream past, so
// the FMAs form R x W independent chains instead of one chain n long.
template <class F, int R, int W>
inline void accumulate_slice(const float* const* p, int64_t n, const float* const* values, int64_t c0,
                             const float* alpha, float* const* acc) {
  constexpr int L = F::kLanes;
  typename F::V a[R][W];
  for (int r = 0; r < R; ++r) {
    const auto av = F::set1(alpha[r]);
    for (int w = 0; w < W; ++w) a[r][w] = F::mul(F::load(acc[r] + c0 + L * w), av);
  }
  for (int64_t t = 0; t < n; ++t) {
    typename F::V pt[R];
    for (int r = 0; r < R; ++r) pt[r] = F::set1(p[r][t]);
    const float* vt = values[t] + c0;
    for (int w = 0; w < W; ++w) {
      const auto vv = F::load(vt + L * w);
      for (int r = 0; r < R; ++r) a[r][w] = F::fma(pt[r], vv, a[r][w]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int w = 0; w < W; ++w) F::store(acc[r] + c0 + L * w, a[r][w]);
  }
}
#endif

// acc[r] = alpha[r] * acc[r] + sum_t p[r][t] * values[t] over the whole head_dim, for R rows (1 or 2).
template <int R>
inline void accumulate_values(const float* const* p, int64_t n, const float* const* values, int64_t d,
                              const float* alpha, float* const* acc) {
#ifdef BRISK_AVX512
  if (d % 16 == 0) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {  // up to 4 x 16 columns a pass: R x 4 <= 12 accumulators
      switch (std::min<int64_t>(4, (d - c0) / 16)) {
        case 4: accumulate_slice<F512, R, 4>(p, n, values, c0, alpha, acc); break;
        case 3: accumulate_slice<F512, R, 3>(p, n, values, c0, alpha, acc); break;
        case 2: accumulate_slice<F512, R, 2>(p, n, values, c0, alpha, acc); break;
        default: accumulate_slice<F512, R, 1>(p, n, values, c0, alpha, acc); break;
      }
    }
    return;
  }
#endif
  if constexpr (R == 3) {
    accumulate_values<2>(p, n, values, d, alpha, acc);
    return accumulate_values<1>(p + 2, n, values, d, alpha + 2, acc + 2);
  }
#ifdef BRISK_AVX2
  constexpr int kMaxW = R == 1 ? 8 : 4;  // registers per row: R * W accumulators fit in 16 with room to spare
  for (int64_t c0 = 0; c0 < d; c0 += 8 * kMaxW) {
    switch (std::min<int64_t>(kMaxW, (d - c0) / 8)) {
      case 8: accumulate_slice<F256, R, (kMaxW >= 8 ? 8 : 1)>(p, n, values, c0, alpha, acc); break;
      case 7: accumulate_slice<F256, R, (kMaxW >= 7 ? 7 : 1)>(p, n, values, c0, alpha, acc); break;
      case 6: accumulate_slice<F256, R, (kMaxW >= 6 ? 6 : 1)>(p, n, values, c0, alpha, acc); break;
      case 5: accumulate_slice<F256, R, (kMaxW >= 5 ? 5 : 1)>(p, n, values, c0, alpha, acc); break;
      case 4: accumulate_slice<F256, R, 4>(p, n, values, c0, alpha, acc); break;
      case 3: accumulate_slice<F256, R, 3>(p, n, values, c0, alpha, acc); break;
      case 2: accumulate_slice<F256, R, 2>(p, n, values, c0, alpha, acc); break;
      default: accumulate_slice<F256, R, 1>(p, n, values, c0, alpha, acc); break;
    }
  }
#elif defined(BRISK_NEON)
  // NEON's 32 registers: 16 accumulators (64 columns of one row, 32 of two) a pass, then what is left of head_dim
  // (a multiple of 8) 16 and 4 columns at a time
  constexpr int kMaxW = R == 1 ? 16 : 8;
  int64_t c0 = 0;
  for (; c0 + 4 * kMaxW <= d; c0 += 4 * kMaxW) accumulate_slice<F128, R, kMaxW>(p, n, values, c0, alpha, acc);
  for (; c0 + 16 <= d; c0 += 16) accumulate_slice<F128, R, 4>(p, n, values, c0, alpha, acc);
  for (; c0 < d; c0 += 4) accumulate_slice<F128, R, 1>(p, n, values, c0, alpha, acc);
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      float a = acc[r][c] * alpha[r];
      for (int64_t t = 0; t < n; ++t) a += p[r][t] * values[t][c];
      acc[r][c] = a;
    }
  }
#endif
}

// Row pointers of a chunk of n cache rows (cache + offsets[t]), as float: in place for a float32 cache, else
// widened into buf.
inline void chunk_rows(const float* cache, const int64_t* offsets, int64_t n, int64_t /*d*/, float* /*buf*/,
                       const float** rows) {
  for (int64_t t = 0; t < n; ++t) rows[t] = cache + offsets[t];
}
inline void chunk_rows(const c10::BFloat16* cache, const int64_t* offsets, int64_t n, int64_t d, float* buf,
                       const float** rows) {
  for (int64_t t = 0; t < n; ++t) {
    const c10::BFloat16* src = cache + offsets[t];
    float* dst = buf + t * d;
#if defined(__AVX512F__)
    int64_t c = 0;
    for (; c + 16 <= d; c += 16)  // 16 at a time: bf16 -> f32 is a zero-extend and a 16-bit shift
      _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c))),
                                    16)));
    for (; c < d; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
#elif defined(BRISK_AVX2)
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
#elif defined(BRISK_NEON)
    for (int64_t c = 0; c < d; c += 8) {  // bf16 -> f32: a 16-bit shift, exact
      const uint16x8_t h = vld1q_u16(reinterpret_cast<const uint16_t*>(src + c));
      vst1q_f32(dst + c, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)));
      vst1q_f32(dst + c + 4, vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)));
    }
#else
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]);
#endif
    rows[t] = dst;
  }
}

struct WorkItem {
  int64_t seq;
  int64_t q_begin, q_end;  // query tokens [q_begin, q_end) of the sequence (0 = its first query token)
  int64_t kv_begin, kv_end;  // kv heads [kv_begin, kv_end)
  int64_t cost;  // rows x keys walked, to hand out the longest items first
  // split-K (one query token, few items): this item walks only key positions [key_lo, key_hi) and leaves its
  // rows' unnormalized (m, l, acc) in partials slot `part` for the merge; part < 0: the whole range, normalized
  int64_t key_lo = 0, key_hi = 0, part = -1;
};

struct Problem {
  const void* q;  // [T, h, d], last dim contiguous
  int64_t q_stride_t, q_stride_h;
  void* out;  // [T, h, d], last dim contiguous
  int64_t out_stride_t, out_stride_h;
  float* partials;  // split-K: per part, per row of the item, (m, l, acc[d])
  const void* k;  // kv_cache[0]: [num_blocks, block_size, kvh, d]
  const void* v;
  int64_t block_size, num_kv_heads, head_dim, group;
  const int32_t* block_tables;  // [B, max_blocks]
  int64_t max_blocks;
  const int64_t* query_start;  // [B + 1] first row of each sequence in q / out
  const int32_t* context_lens;  // [B]
  float scale_log2;  // softmax scale * log2(e)
  int64_t window;  // sliding window in tokens, 0 = none
  // quantized caches (kvcache/quant.py; k and v above are their codes), widened to float a chunk at a time
  const c10::Half* k_scale = nullptr;  // int8: [slots, kvh]; int4: [num_blocks, kvh, d], per block and channel
  const c10::Half* v_scale = nullptr;  // [slots, kvh]
  const c10::Half* k_min = nullptr;  // int4: [num_blocks, kvh, d]
  const c10::Half* v_min = nullptr;  // int4: [slots, kvh]
  const c10::Half* k_residual = nullptr;  // int4: [R, block_size, kvh, d], float16 keys of blocks being filled
  const int64_t* residual_of_block = nullptr;  // int4: [num_blocks], a block's residual buffer, -1 = quantized
  // StreamingLLM (with a window): keys [0, sinks) are seen by every row too, scored by q_sink [T, h, d] float32
  // (each row's query rotated back by its evicted-token count, ops/attention.py _sink_window_attention)
  const float* q_sink = nullptr;
  int64_t sinks = 0;
  // token trees (engine/token_tree.py): per query token [T], bit j set where it sees its sequence's in-step row j (the key
  // at position context_len - query_len + j); kAllRows for a token with no tree mask (causal as usual)
  const int64_t* tree_bits = nullptr;
};

constexpr int64_t kAllRows = -1;  // tree_bits of a row that sees every in-step row its causal limit allows

struct Scratch {
  std::vector<float> q, qs, acc, m, l, kbuf, vbuf;  // qs: the rows' q_sink during a sink pass
  std::vector<int64_t> live, live_lo, live_hi;  // rows taking part in the current chunk, and their windows
  std::vector<int64_t> live_bits;  // and their tree masks (Problem::tree_bits), when the problem has any
  int64_t tree_base = 0;  // position of the item's sequence's in-step row 0
  bool tree = false;
  float scores[3][kChunk + 8];  // up to three rows' scores, then probabilities
  const float* krows[kChunk];
  const float* vrows[kChunk];
  const c10::BFloat16* krows16[kChunk];  // bfloat16 rows read in place (dot_rows_bf16)
  const c10::BFloat16* vrows16[kChunk];
  int64_t offsets[kChunk];
  int64_t slots[kChunk];  // quantized caches: the chunk's cache slots (block * block_size + offset)
  int64_t max_rows, d;
  Scratch(int64_t max_rows_, int64_t d_)
      : q(max_rows_ * d_), qs(max_rows_ * d_), acc(max_rows_ * d_), m(max_rows_), l(max_rows_), kbuf(kChunk * d_), vbuf(kChunk * d_),
        live(max_rows_), live_lo(max_rows_), live_hi(max_rows_), live_bits(max_rows_), max_rows(max_rows_),
        d(d_) {}
};

// ---- quantized caches (kvcache/quant.py), read in place: a chunk's rows of one kv head widened into float32 ----
// int8 (keys and values): code * scale, one float16 scale per (slot, kv head).
// int4 values: code * scale + min per (slot, kv head). int4 keys (KIVI): code * scale[c] + min[c] per (block, kv head,
// channel c), or the block's float16 residual row while the block is still being filled. 4-bit codes: channel 2i
// in the low nibble of byte i, channel 2i + 1 in the high one. The products are float32, as the reference path's
// dequantization (codes.float() * scale.float() + min.float()).
#if defined(BRISK_AVX2) && defined(__F16C__)
#define BRISK_QKV_SIMD 1
inline __m256 widen_i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen_u4x8(const uint8_t* p) {  // 4 bytes -> 8 codes, in channel order
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i b = _mm_cvtsi32_si128(word), low = _mm_set1_epi8(0x0F);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
}
inline __m256 widen_h8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(BRISK_NEON)
// 8 values a step into two float32x4 (lo: values 0-3, hi: 4-7); the same float32 products as the AVX2 code (a
// multiply for int8, fused multiply-adds for int4), so the same bits
inline void widen_i8x8(const int8_t* p, float32x4_t& lo, float32x4_t& hi) {
  const int16x8_t w = vmovl_s8(vld1_s8(p));
  lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
  hi = vcvtq_f32_s32(vmovl_high_s16(w));
}
inline void widen_u4x8(const uint8_t* p, float32x4_t& lo, float32x4_t& hi) {  // 4 bytes -> 8 codes, channel order
  uint32_t word;
  std::memcpy(&word, p, 4);
  const uint8x8_t b = vcreate_u8(word);
  const uint16x8_t w = vmovl_u8(vzip1_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4)));
  lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
  hi = vcvtq_f32_u32(vmovl_high_u16(w));
}
inline float32x4_t widen_h4(const c10::Half* p) {  // float16 -> float32 with base NEON (fcvtl), exact
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
#endif
inline float nibble(const uint8_t* row, int64_t c) { return static_cast<float>(c % 2 ? row[c / 2] >> 4 : row[c / 2] & 15); }

// int8 rows, keys or values: codes [slots, kvh, d], scales [slots, kvh]
inline void widen_rows_q8(const int8_t* codes, const c10::Half* scales, int64_t kvh, int64_t head, int64_t d,
                          const int64_t* slots, int64_t n, float* buf, const float** rows) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = slots[t] * kvh + head;
    const int8_t* src = codes + row * d;
    const float sc = static_cast<float>(scales[row]);
    float* dst = buf + t * d;
#ifdef BRISK_QKV_SIMD
    const __m256 sv = _mm256_set1_ps(sc);
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(widen_i8x8(src + c), sv));
#elif defined(BRISK_NEON)
    for (int64_t c = 0; c < d; c += 8) {
      float32x4_t lo, hi;
      widen_i8x8(src + c, lo, hi);
      vst1q_f32(dst + c, vmulq_n_f32(lo, sc));
      vst1q_f32(dst + c + 4, vmulq_n_f32(hi, sc));
    }
#else
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * sc;
#endif
    rows[t] = dst;
  }
}

// int4 values: codes [slots, kvh, d / 2], scale and min [slots, kvh]
inline void widen_values_q4(const uint8_t* codes, const c10::Half* scales, const c10::Half* mins, int64_t kvh,
                            int64_t head, int64_t d, const int64_t* slots, int64_t n, float* buf, const float** rows) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = slots[t] * kvh + head;
    const uint8_t* src = codes + row * (d / 2);
    const float sc = static_cast<float>(scales[row]), mn = static_cast<float>(mins[row]);
    float* dst = buf + t * d;
#ifdef BRISK_QKV_SIMD
    const __m256 sv = _mm256_set1_ps(sc), mv = _mm256_set1_ps(mn);
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(widen_u4x8(src + c / 2), sv, mv));
#elif defined(BRISK_NEON)
    const float32x4_t sv = vdupq_n_f32(sc), mv = vdupq_n_f32(mn);
    for (int64_t c = 0; c < d; c += 8) {
      float32x4_t lo, hi;
      widen_u4x8(src + c / 2, lo, hi);
      vst1q_f32(dst + c, vfmaq_f32(mv, lo, sv));
      vst1q_f32(dst + c + 4, vfmaq_f32(mv, hi, sv));
    }
#else
    for (int64_t c = 0; c < d; ++c) dst[c] = nibble(src, c) * sc + mn;
#endif
    rows[t] = dst;
  }
}

// int4 keys: codes [num_blocks, bs, kvh, d / 2] (slot order), scale and min [num_blocks, kvh, d]; a block with a
// residual buffer reads k_residual [R, bs, kvh, d] instead
inline void widen_keys_q4(const Problem& p, int64_t head, const int64_t* slots, int64_t n, float* buf,
                          const float** rows) {
  const int64_t d = p.head_dim, kvh = p.num_kv_heads, bs = p.block_size;
  const uint8_t* codes = static_cast<const uint8_t*>(p.k);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    const int64_t res = p.residual_of_block[block];
    float* dst = buf + t * d;
    rows[t] = dst;
    if (res >= 0) {
      const c10::Half* src = p.k_residual + ((res * bs + offset) * kvh + head) * d;
#ifdef BRISK_QKV_SIMD
      for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, widen_h8(src + c));
#elif defined(BRISK_NEON)
      for (int64_t c = 0; c < d; c += 4) vst1q_f32(dst + c, widen_h4(src + c));
#else
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]);
#endif
      continue;
    }
    const uint8_t* src = codes + (slots[t] * kvh + head) * (d / 2);
    const c10::Half* sc = p.k_scale + (block * kvh + head) * d;
    const c10::Half* mn = p.k_min + (block * kvh + head) * d;
#ifdef BRISK_QKV_SIMD
    for (int64_t c = 0; c < d; c += 8)
      _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(widen_u4x8(src + c / 2), widen_h8(sc + c), widen_h8(mn + c)));
#elif defined(BRISK_NEON)
    for (int64_t c = 0; c < d; c += 8) {
      float32x4_t lo, hi;
      widen_u4x8(src + c / 2, lo, hi);
      vst1q_f32(dst + c, vfmaq_f32(widen_h4(mn + c), lo, widen_h4(sc + c)));
      vst1q_f32(dst + c + 4, vfmaq_f32(widen_h4(mn + c + 4), hi, widen_h4(sc + c + 4)));
    }
#else
    for (int64_t c = 0; c < d; ++c) dst[c] = nibble(src, c) * static_cast<float>(sc[c]) + static_cast<float>(mn[c]);
#endif
  }
}

// Rows rows[0 .. R) (query rows sharing a kv head) against the chunk's keys [p0, p1) in s.krows / s.vrows (or, BF16
// in place: s.krows16 / s.vrows16, the rows' q and acc in split order); row i sees positions [lo[i], hi[i]) (causal
// limit, window) and at least one of them in the chunk; with token trees (s.tree), a row whose live_bits are not
// kAllRows sees an in-step key (position >= s.tree_base) only where its bit is set.
template <int R, bool BF16 = false>
inline void attend_chunk(Scratch& s, const int64_t* rows, const int64_t* lo, const int64_t* hi, int64_t n,
                         int64_t d, int64_t p0, int64_t p1) {
  const float* q[R];
  float* scores[R];
  float* acc[R];
  float alpha[R];
  for (int i = 0; i < R; ++i) {
    q[i] = s.q.data() + rows[i] * d;
    scores[i] = s.scores[i];
    acc[i] = s.acc.data() + rows[i] * d;
  }
#ifdef BRISK_AVX512
  if constexpr (BF16) dot_rows_bf16<R>(q, s.krows16, n, d, scores);
  else
#endif
    dot_rows<R>(q, s.krows, n, d, scores);
  for (int i = 0; i < R; ++i) {
    if (lo[i] > p0 || hi[i] < p1) {  // the chunk straddles this row's causal limit or window start
      for (int64_t t = 0; t < n; ++t) {
        if (p0 + t < lo[i] || p0 + t >= hi[i]) scores[i][t] = kNegInf;
      }
    }
    if (s.tree && p1 > s.tree_base) {  // a token tree's row: only its ancestors and itself among the in-step keys
      const int64_t bits = s.live_bits[rows + i - s.live.data()];
      if (bits != kAllRows) {
        for (int64_t t = std::max<int64_t>(0, s.tree_base - p0); t < n; ++t) {
          if (!((bits >> (p0 + t - s.tree_base)) & 1)) scores[i][t] = kNegInf;
        }
      }
    }
    alpha[i] = softmax_chunk(scores[i], n, s.m[rows[i]], s.l[rows[i]]);
  }
#ifdef BRISK_AVX512
  if constexpr (BF16) accumulate_values_bf16<R>(scores, n, s.vrows16, d, alpha, acc);
  else
#endif
    accumulate_values<R>(scores, n, s.vrows, d, alpha, acc);
}

// The key positions [lo, hi) an item walks: all its query tokens' windows, or its split-K share.
inline void item_keys(const Problem& p, const WorkItem& it, int64_t& lo, int64_t& hi) {
  const int64_t ctx = p.context_lens[it.seq];
  const int64_t q_len = p.query_start[it.seq + 1] - p.query_start[it.seq];
  hi = ctx - q_len + it.q_end;  // the last query token's causal limit
  lo = p.window > 0 ? std::max<int64_t>(0, ctx - q_len + it.q_begin + 1 - p.window) : 0;
  if (it.part >= 0) {
    lo = std::max(lo, it.key_lo);
    hi = std::min(hi, it.key_hi);
  }
  if (p.sinks > 0) lo = std::max(lo, std::min(p.sinks, hi));  // the sink keys are walked in a pass of their own
}

#ifdef BRISK_AVX2
// The K and V rows (kv heads [kv_begin, kv_end)) of item `it`'s key positions [a, b) into L1 (_MM_HINT_T0) or L2
// (_MM_HINT_T1): rows scattered by the block table, which the hardware prefetchers cannot guess.
template <typename cache_t, _mm_hint HINT>
inline __attribute__((always_inline)) void prefetch_rows(const Problem& p, const WorkItem& it, int64_t a,
                                                    int64_t b) {
  const int64_t d = p.head_dim, bs = p.block_size, token_stride = p.num_kv_heads * d, block_stride = bs * token_stride;
  const int32_t* table = p.block_tables + it.seq * p.max_blocks;
  const cache_t* k = static_cast<const cache_t*>(p.k) + it.kv_begin * d;
  const cache_t* v = static_cast<const cache_t*>(p.v) + it.kv_begin * d;
  const int64_t slice_bytes = (it.kv_end - it.kv_begin) * d * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t pos = a; pos < b; ++pos) {
    const int64_t off = static_cast<int64_t>(table[pos / bs]) * block_stride + (pos % bs) * token_stride;
    const char* kr = reinterpret_cast<const char*>(k + off);
    const char* vr = reinterpret_cast<const char*>(v + off);
    for (int64_t c = 0; c < slice_bytes; c += 64) {
      _mm_prefetch(kr + c, HINT);
      _mm_prefetch(vr + c, HINT);
    }
  }
}
#endif

// `ahead`: the item this thread runs next, or null: its K and V rows are prefetched into L2 a slice per chunk of
// this one, so that their fetch (latency-bound: rows scattered by the block table) overlaps this item's arithmetic.
// `prefetched`: this item's own rows were so requested (no up-front prefetch of them).
template <typename cache_t, typename q_t>
void attend_item(const Problem& p, const WorkItem& it, Scratch& s, const WorkItem* ahead, bool prefetched) {
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t ctx = p.context_lens[it.seq];
  const int64_t row0 = p.query_start[it.seq];
  const int64_t q_len = p.query_start[it.seq + 1] - row0;
  const int64_t first_pos = ctx - q_len;  // absolute position of the sequence's query token 0
  s.tree = p.tree_bits != nullptr;
  s.tree_base = first_pos;
  const int64_t num_tokens = it.q_end - it.q_begin, num_heads = (it.kv_end - it.kv_begin) * g;
  const int32_t* table = p.block_tables + it.seq * p.max_blocks;
  // rows r = (token i, query head): r = i * num_heads + (kv head - kv_begin) * g + hq; token i sees [lo_i, hi_i)
  auto hi_of = [&](int64_t i) { return first_pos + it.q_begin + i + 1; };
  auto lo_of = [&](int64_t i) { return p.window > 0 ? std::max<int64_t>(0, hi_of(i) - p.window) : 0; };
  auto query_row = [&](int64_t r, int64_t& token, int64_t& head) {
    token = row0 + it.q_begin + r / num_heads;
    head = it.kv_begin * g + r % num_heads;
  };

  constexpr bool kQ8 = std::is_same_v<cache_t, int8_t>, kQ4 = std::is_same_v<cache_t, uint8_t>;
  // bfloat16 cache rows read in place, q and acc in split order (dot_rows_bf16)
#ifdef BRISK_AVX512
  const bool split = std::is_same_v<cache_t, c10::BFloat16> && d % 32 == 0;
#else
  constexpr bool split = false;
#endif
  auto col = [&](int64_t c) __attribute__((always_inline)) {
#ifdef BRISK_AVX512
    return split ? perm_index(c) : c;
#else
    return c;
#endif
  };
  for (int64_t r = 0; r < num_tokens * num_heads; ++r) {
    int64_t token, head;
    query_row(r, token, head);
    const q_t* src = static_cast<const q_t*>(p.q) + token * p.q_stride_t + head * p.q_stride_h;
    float* dst = s.q.data() + r * d;
    for (int64_t c = 0; c < d; ++c) dst[col(c)] = to_float(src[c]) * p.scale_log2;
    std::fill_n(s.acc.data() + r * d, d, 0.0f);
    s.m[r] = kNegInf;
    s.l[r] = 0.0f;
  }

  const int64_t token_stride = p.num_kv_heads * d, block_stride = bs * token_stride;
  // this item's slice of a token's row: kv heads [kv_begin, kv_end), contiguous in the cache
  const cache_t* k = static_cast<const cache_t*>(p.k) + it.kv_begin * d;
  const cache_t* v = static_cast<const cache_t*>(p.v) + it.kv_begin * d;
  int64_t lo_all, hi_all;  // all its tokens' windows, or (split-K, a single query token) its share of the keys
  item_keys(p, it, lo_all, hi_all);
  // where position pos of the sequence lives in the cache: block_table[pos / bs] * bs + pos % bs, as an offset
  auto slot_offset = [&](int64_t pos) __attribute__((always_inline)) {
    return static_cast<int64_t>(table[pos / bs]) * block_stride + (pos % bs) * token_stride;
  };
#ifdef BRISK_AVX2
  // all of this item's rows into L2 now: the chunks below then find them there instead of waiting on each row's
  // first touch (the wait on the widening loads was ~3/4 of this function's samples). 30 layers of a bfloat16
  // cache, 8 sequences x 160 tokens: 87-99 -> 65-67 us a layer; 64 x 370: 1.76 -> 1.56-1.59 ms; batch 1
  // unchanged (alternated processes)
  if (!prefetched && !kQ4) prefetch_rows<cache_t, _MM_HINT_T1>(p, it, lo_all, hi_all);
  int64_t ahead_lo = 0, ahead_hi = 0, ahead_per_chunk = 0, chunk_index = 0;
  if (ahead != nullptr && !kQ4) {  // (int4 rows are half a head_dim of bytes: not prefetched)
    item_keys(p, *ahead, ahead_lo, ahead_hi);
    const int64_t chunks = (hi_all - lo_all + kChunk - 1) / kChunk;
    if (chunks > 0 && ahead_hi > ahead_lo) ahead_per_chunk = (ahead_hi - ahead_lo + chunks - 1) / chunks;
  }
#endif
  // StreamingLLM: keys [0, sink_end) first, scored by the rows' back-rotated queries (swapped in for the pass),
  // then the window [lo_all, hi_all), which item_keys starts at sink_end or later
  const int64_t sink_end = p.sinks > 0 ? std::min(p.sinks, first_pos + it.q_end) : 0;
  for (int pass = sink_end > 0 ? 0 : 1; pass < 2; ++pass) {
  const bool sink_pass = pass == 0;
  const int64_t range_lo = sink_pass ? 0 : lo_all, range_hi = sink_pass ? sink_end : hi_all;
  if (sink_pass) {
    for (int64_t r = 0; r < num_tokens * num_heads; ++r) {
      int64_t token, head;
      query_row(r, token, head);
      const float* src = p.q_sink + (token * p.group * p.num_kv_heads + head) * d;
      float* dst = s.qs.data() + r * d;
      for (int64_t c = 0; c < d; ++c) dst[col(c)] = src[c] * p.scale_log2;
    }
    s.q.swap(s.qs);
  }
  for (int64_t p0 = range_lo; p0 < range_hi;) {
    const int64_t p1 = std::min(range_hi, p0 + kChunk);  // chunk [p0, p1) of key positions
    const int64_t n = p1 - p0;
    for (int64_t t = 0; t < n; ++t) s.offsets[t] = slot_offset(p0 + t);
    if constexpr (kQ8 || kQ4) {
      for (int64_t t = 0; t < n; ++t) s.slots[t] = table[(p0 + t) / bs] * bs + (p0 + t) % bs;
    }
#ifdef BRISK_AVX2
    // the next chunk's rows into L1 now: its blocks are unrelated to this one's, so the hardware prefetchers
    // cannot guess them (measured at batch 64: a few percent on float32, up to ~10% on bfloat16; noisy)
    if (!kQ4 && !sink_pass) prefetch_rows<cache_t, _MM_HINT_T0>(p, it, p1, std::min(hi_all, p1 + kChunk));
    if (ahead_per_chunk > 0 && !sink_pass) {  // the next item's share for this chunk, into L2
      const int64_t a0 = ahead_lo + chunk_index * ahead_per_chunk;
      prefetch_rows<cache_t, _MM_HINT_T1>(p, *ahead, a0, std::min(ahead_hi, a0 + ahead_per_chunk));
    }
    ++chunk_index;
#endif
    for (int64_t j = 0; j < it.kv_end - it.kv_begin; ++j) {
      if (split) {
        if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
          for (int64_t t = 0; t < n; ++t) {
            s.krows16[t] = k + j * d + s.offsets[t];
            s.vrows16[t] = v + j * d + s.offsets[t];
          }
        }
      } else if constexpr (kQ8) {
        const int64_t head = it.kv_begin + j;
        widen_rows_q8(static_cast<const int8_t*>(p.k), p.k_scale, p.num_kv_heads, head, d, s.slots, n,
                      s.kbuf.data(), s.krows);
        widen_rows_q8(static_cast<const int8_t*>(p.v), p.v_scale, p.num_kv_heads, head, d, s.slots, n,
                      s.vbuf.data(), s.vrows);
      } else if constexpr (kQ4) {
        const int64_t head = it.kv_begin + j;
        widen_keys_q4(p, head, s.slots, n, s.kbuf.data(), s.krows);
        widen_values_q4(static_cast<const uint8_t*>(p.v), p.v_scale, p.v_min, p.num_kv_heads, head, d, s.slots,
                        n, s.vbuf.data(), s.vrows);
      } else {
        chunk_rows(k + j * d, s.offsets, n, d, s.kbuf.data(), s.krows);
        chunk_rows(v + j * d, s.offsets, n, d, s.vbuf.data(), s.vrows);
      }
      // the rows of kv head j that see some of the chunk, three (AVX-512) or two at a time so they share key and
      // value loads
      int64_t num_live = 0;
      for (int64_t i = 0; i < num_tokens; ++i) {
        const int64_t lo = sink_pass ? 0 : lo_of(i), hi = hi_of(i);
        if (hi <= p0 || lo >= p1) continue;  // this token sees nothing of the chunk (causal / window)
        const int64_t bits = p.tree_bits != nullptr ? p.tree_bits[row0 + it.q_begin + i] : kAllRows;
        if (bits != kAllRows && p0 >= first_pos) {  // a tree row that sees none of this chunk's in-step keys
          const int64_t width = std::min<int64_t>(p1, hi) - p0;  // keys [p0, min(p1, hi)) (hi <= first_pos + 64)
          const uint64_t seen = static_cast<uint64_t>(bits) >> (p0 - first_pos);
          if (width < 64 ? (seen & ((uint64_t{1} << width) - 1)) == 0 : seen == 0) continue;
        }
        for (int64_t r = i * num_heads + j * g; r < i * num_heads + (j + 1) * g; ++r) {
          s.live[num_live] = r;
          s.live_lo[num_live] = lo;
          s.live_hi[num_live] = hi;
          s.live_bits[num_live] = bits;
          ++num_live;
        }
      }
      int64_t x = 0;
#ifdef BRISK_AVX512
      if (split) {
        for (; x + 2 < num_live; x += 3)
          attend_chunk<3, true>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
        for (; x + 1 < num_live; x += 2)
          attend_chunk<2, true>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
        if (x < num_live) attend_chunk<1, true>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
        continue;
      }
      if (d % 16 == 0)
        for (; x + 2 < num_live; x += 3)
          attend_chunk<3>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
#endif
      for (; x + 1 < num_live; x += 2) attend_chunk<2>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
      if (x < num_live) attend_chunk<1>(s, &s.live[x], &s.live_lo[x], &s.live_hi[x], n, d, p0, p1);
    }
    p0 = p1;
  }
  if (sink_pass) s.q.swap(s.qs);
  }

  if (it.part >= 0) {  // unnormalized: merge_parts combines the parts of this (sequence, kv heads)
    float* dst = p.partials + it.part * num_heads * (d + 2);
    for (int64_t r = 0; r < num_heads; ++r, dst += d + 2) {
      dst[0] = s.m[r];
      dst[1] = s.l[r];
      const float* acc = s.acc.data() + r * d;
      for (int64_t c = 0; c < d; ++c) dst[2 + c] = acc[col(c)];
    }
    return;
  }
  for (int64_t r = 0; r < num_tokens * num_heads; ++r) {
    int64_t token, head;
    query_row(r, token, head);
    q_t* dst = static_cast<q_t*>(p.out) + token * p.out_stride_t + head * p.out_stride_h;
    const float inv = 1.0f / s.l[r];  // l >= 1: every row sees at least its own position
    const float* acc = s.acc.data() + r * d;
    for (int64_t c = 0; c < d; ++c) from_float(acc[col(c)] * inv, dst + c);
  }
}

// Split-K merge: `num_parts` consecutive partials slots from `first` hold one (sequence, kv heads) item's rows,
// each over a disjoint key range; softmax in base 2, so a part with running max m_j is rescaled by 2^(m_j - M).
template <typename q_t>
void merge_parts(const Problem& p, const WorkItem& it, int64_t first, int64_t num_parts) {
  const int64_t d = p.head_dim, num_heads = (it.kv_end - it.kv_begin) * p.group;
  const int64_t token = p.query_start[it.seq] + it.q_begin;
  thread_local std::vector<float> acc;
  acc.resize(d);
  for (int64_t r = 0; r < num_heads; ++r) {
    float mx = kNegInf;
    for (int64_t j = 0; j < num_parts; ++j) mx = std::max(mx, p.partials[((first + j) * num_heads + r) * (d + 2)]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < num_parts; ++j) {
      const float* part = p.partials + ((first + j) * num_heads + r) * (d + 2);
      if (part[1] == 0.0f) continue;  // a part whose keys all lay outside the row's window (m = -inf)
      const float w = std::exp2(part[0] - mx);
      l += part[1] * w;
      for (int64_t c = 0; c < d; ++c) acc[c] += part[2 + c] * w;
    }
    const int64_t head = it.kv_begin * p.group + r;
    q_t* dst = static_cast<q_t*>(p.out) + token * p.out_stride_t + head * p.out_stride_h;
    const float inv = 1.0f / l;
    for (int64_t c = 0; c < d; ++c) from_float(acc[c] * inv, dst + c);
  }
}

// A split item's parts: the item as built (for its rows) and its partials slots [first, first + count).
struct SplitGroup {
  WorkItem item;
  int64_t first, count;
};

template <typename cache_t, typename q_t>
void run(const Problem& p, std::vector<WorkItem>& items, int64_t max_rows, const std::vector<SplitGroup>& groups) {
  // Longest first, handed out by an atomic counter: sequences differ wildly in length (a 2,000-token chunk
  // next to 1-token decodes), so a static split of the item range would leave one core idle.
  std::sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    // each thread's scratch outlives the call, as do attention_impl's item lists: a batch-1 decode step calls
    // this 30 times for ~5 us each, and their ~15 allocations (and the zeroing of 16 KiB of row buffers) were
    // ~7% of that (30 layers, 160 tokens: 0.33 -> 0.30 ms, same-process A/B)
    thread_local std::unique_ptr<Scratch> cached;
    if (!cached || cached->max_rows < max_rows || cached->d != p.head_dim)
      cached = std::make_unique<Scratch>(max_rows, p.head_dim);
    Scratch& s = *cached;
    for (int64_t worker = begin; worker < end; ++worker) {
      // each thread takes its next item one ahead of time, to fetch its rows during the current one
      bool prefetched = false;
      for (int64_t i = next++; i < num_items;) {
        const int64_t j = next++;
        attend_item<cache_t, q_t>(p, items[i], s, j < num_items ? &items[j] : nullptr, prefetched);
        prefetched = j < num_items;
        i = j;
      }
    }
  });
  for (const SplitGroup& g : groups) merge_parts<q_t>(p, g.item, g.first, g.count);
}

void check_layout(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_seqs) {
  // q, out: [T, h, d]; kv_cache: [2, num_blocks, block_size, kvh, d]; block_tables: [B, max_blocks] int32;
  // context_lens: [B] int32
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "brisk paged attention: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_dim] tensor, got ",
              kv_cache.sizes());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kv_cache.size(4) && q.stride(2) == 1,
              "q must be [tokens, heads, head_dim] with a contiguous last dim and head_dim = kv_cache.size(4), got ",
              q.sizes(), " strides ", q.strides(), " vs kv_cache ", kv_cache.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "out must be like q ", q.sizes(), " ", q.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "query heads (", q.size(1), ") must be a multiple of kv heads (",
              kv_cache.size(3), ")");
  TORCH_CHECK(q.size(2) % 8 == 0, "head_dim must be a multiple of 8, got ", q.size(2));
  const auto ok_dtype = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  TORCH_CHECK(ok_dtype(q.scalar_type()) && ok_dtype(kv_cache.scalar_type()),
              "q and kv_cache must be float32 or bfloat16, got ", q.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [num_seqs=", num_seqs, ", max_blocks] tensor, got ",
              block_tables.sizes(), " ", block_tables.scalar_type());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "context_lens must be a contiguous int32 [num_seqs=", num_seqs, "] tensor, got ", context_lens.sizes(),
              " ", context_lens.scalar_type());
}

// Check every sequence's lengths and the block ids it will read before any thread touches the cache: a bad
// table would otherwise read out of bounds.
void check_sequences(const Problem& p, int64_t num_seqs, int64_t num_blocks) {
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t ctx = p.context_lens[b], q_len = p.query_start[b + 1] - p.query_start[b];
    TORCH_CHECK(q_len >= 1 && ctx >= q_len, "sequence ", b, ": need 1 <= query_len (", q_len,
                ") <= context_len (", ctx, ")");
    const int64_t used = (ctx + p.block_size - 1) / p.block_size;
    TORCH_CHECK(used <= p.max_blocks, "sequence ", b, ": context_len ", ctx, " needs ", used,
                " blocks but block_tables has ", p.max_blocks, " columns");
    // with a window, blocks wholly before every row's window (and past the sinks) are never read: an evicting policy
    // leaves -1 there
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, ctx - q_len + 1 - p.window) : 0;
    for (int64_t j = 0; j < used; ++j) {
      if ((j + 1) * p.block_size <= lo && j * p.block_size >= p.sinks) continue;
      const int32_t blk = p.block_tables[b * p.max_blocks + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "sequence ", b, ": block_tables[", j, "] = ", blk,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

enum class CacheKind { kFloat, kBFloat16, kInt8, kInt4 };

// The cache fields of a Problem (k, v, block_size, num_kv_heads, head_dim) for a float32 / bfloat16 cache tensor.
CacheKind float_cache(Problem& p, const at::Tensor& kv_cache) {
  const int64_t cache_half = kv_cache.numel() / 2;  // elements of kv_cache[0]
  p.k = kv_cache.data_ptr();
  p.v = static_cast<const char*>(kv_cache.data_ptr()) + cache_half * kv_cache.element_size();
  p.block_size = kv_cache.size(2);
  p.num_kv_heads = kv_cache.size(3);
  p.head_dim = kv_cache.size(4);
  return kv_cache.scalar_type() == at::kBFloat16 ? CacheKind::kBFloat16 : CacheKind::kFloat;
}

// p: its cache fields set (float_cache or quantized_cache); num_blocks bounds the block ids of the tables.
void attention_impl(at::Tensor& out, const at::Tensor& q, Problem& p, CacheKind kind, int64_t num_blocks,
                    const int64_t* query_start, const at::Tensor& block_tables, const at::Tensor& context_lens,
                    double scale, int64_t sliding_window, int64_t q_tile) {
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(query_start[num_seqs] <= q.size(0), "query_start_loc ends at row ", query_start[num_seqs],
              " but q has ", q.size(0), " rows");
  TORCH_CHECK(sliding_window >= 0 && q_tile >= 1, "sliding_window must be >= 0 (0 = none), q_tile >= 1");
  p.q = q.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.out = out.data_ptr();
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.group = q.size(1) / p.num_kv_heads;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.max_blocks = block_tables.size(1);
  p.query_start = query_start;
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.window = sliding_window;
  check_sequences(p, num_seqs, num_blocks);

  // Work items: (sequence, tile of query tokens, kv heads). An item takes all kv heads of its tokens when there
  // are enough items to keep every thread busy: a token's K (and V) row is one contiguous run of kvh * head_dim
  // values, and reading it whole runs at about 3x the bandwidth of reading one head's slice per item (the
  // prefetchers fetch the neighbouring heads' lines anyway). Few sequences (batch-1 decode) split by head.
  int64_t num_tiles = 0;
  for (int64_t b = 0; b < num_seqs; ++b) num_tiles += (query_start[b + 1] - query_start[b] + q_tile - 1) / q_tile;
  const int64_t heads_per_item = num_tiles >= 4 * at::get_num_threads() ? p.num_kv_heads : 1;
  thread_local std::vector<WorkItem> items;  // reused across calls (see run)
  items.clear();
  items.reserve(num_tiles * (p.num_kv_heads / heads_per_item));
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = query_start[b + 1] - query_start[b], ctx = p.context_lens[b];
    for (int64_t t0 = 0; t0 < q_len; t0 += q_tile) {
      const int64_t t1 = std::min(q_len, t0 + q_tile);
      const int64_t hi = ctx - q_len + t1;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, ctx - q_len + t0 + 1 - sliding_window) : 0;
      for (int64_t h = 0; h < p.num_kv_heads; h += heads_per_item) {
        items.push_back({b, t0, t1, h, h + heads_per_item, (t1 - t0) * heads_per_item * (hi - lo)});
      }
    }
  }
  // Split-K: with fewer items than twice the threads (batch-1 decode: one item per kv head, 3 on 2 threads
  // leave one thread idle a third of the time), a single-token item over many keys is cut into parts of whole
  // chunks, each leaving unnormalized (m, l, acc) for merge_parts (flash-decoding's split).
  thread_local std::vector<SplitGroup> groups;
  thread_local std::vector<float> partials;
  thread_local std::vector<WorkItem> split;
  groups.clear();
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && static_cast<int64_t>(items.size()) < 2 * threads && p.sinks == 0) {
    split.clear();
    int64_t next_part = 0, part_rows = 0;
    for (const WorkItem& it : items) {
      const int64_t q_len = query_start[it.seq + 1] - query_start[it.seq], ctx = p.context_lens[it.seq];
      const int64_t hi = ctx - q_len + it.q_begin + 1;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, hi - sliding_window) : 0;
      const int64_t chunks = (hi - lo + kChunk - 1) / kChunk;
      const int64_t want = (2 * threads + static_cast<int64_t>(items.size()) - 1) / static_cast<int64_t>(items.size());
      const int64_t parts = std::min(want, chunks / 2);  // at least two chunks a part
      if (it.q_end - it.q_begin != 1 || parts < 2) {
        split.push_back(it);
        continue;
      }
      const int64_t per = (chunks + parts - 1) / parts * kChunk;  // keys per part, whole chunks
      const int64_t first = next_part;
      for (int64_t k0 = lo; k0 < hi; k0 += per) {
        WorkItem part = it;
        part.key_lo = k0;
        part.key_hi = std::min(hi, k0 + per);
        part.part = next_part++;
        part.cost = (it.kv_end - it.kv_begin) * (part.key_hi - part.key_lo);
        split.push_back(part);
      }
      groups.push_back({it, first, next_part - first});
      part_rows = std::max(part_rows, (it.kv_end - it.kv_begin) * p.group);
    }
    items.swap(split);
    partials.resize(next_part * part_rows * (p.head_dim + 2));
  }
  p.partials = partials.data();
  const int64_t max_rows = std::min(q_tile, q.size(0)) * q.size(1);
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  switch (kind) {
    case CacheKind::kBFloat16:
      if (q_bf16) run<c10::BFloat16, c10::BFloat16>(p, items, max_rows, groups);
      else run<c10::BFloat16, float>(p, items, max_rows, groups);
      break;
    case CacheKind::kInt8:
      if (q_bf16) run<int8_t, c10::BFloat16>(p, items, max_rows, groups);
      else run<int8_t, float>(p, items, max_rows, groups);
      break;
    case CacheKind::kInt4:
      if (q_bf16) run<uint8_t, c10::BFloat16>(p, items, max_rows, groups);
      else run<uint8_t, float>(p, items, max_rows, groups);
      break;
    default:
      if (q_bf16) run<float, c10::BFloat16>(p, items, max_rows, groups);
      else run<float, float>(p, items, max_rows, groups);
  }
}

// A quantized cache's tensors (kvcache/quant.py `kernel_tensors`) into p's cache fields, checked; returns the
// number of blocks. bits 8: [codes [2, slots, kvh, d] int8, scales [2, slots, kvh] float16]. bits 4: [k_codes
// [nb, bs, kvh, d/2] uint8, k_scale [nb, kvh, d] float16, k_min (same), v_codes [nb * bs, kvh, d/2] uint8, v_scale
// [nb * bs, kvh] float16, v_min (same), k_residual [R, bs, kvh, d] float16, residual_of_block [nb] int64].
int64_t quantized_cache(Problem& p, CacheKind& kind, at::TensorList cache, int64_t bits,
                        int64_t block_size) {
  for (const at::Tensor& t : cache)
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "brisk quantized paged attention: contiguous CPU tensors");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  p.block_size = block_size;
  if (bits == 8) {
    TORCH_CHECK(cache.size() == 2, "an int8 cache is [codes, scales], got ", cache.size(), " tensors");
    const at::Tensor &codes = cache[0], &scales = cache[1];
    TORCH_CHECK(codes.dim() == 4 && codes.size(0) == 2 && codes.scalar_type() == at::kChar &&
                    codes.size(1) % block_size == 0,
                "int8 codes must be [2, slots, kv_heads, head_dim] int8 with slots a multiple of block_size, got ",
                codes.sizes(), " ", codes.scalar_type());
    TORCH_CHECK(scales.sizes() == codes.sizes().slice(0, 3) && scales.scalar_type() == at::kHalf,
                "int8 scales must be float16 ", codes.sizes().slice(0, 3), ", got ", scales.sizes(), " ",
                scales.scalar_type());
    const int64_t slots = codes.size(1);
    p.num_kv_heads = codes.size(2);
    p.head_dim = codes.size(3);
    p.k = codes.data_ptr();
    p.v = codes.data_ptr<int8_t>() + slots * p.num_kv_heads * p.head_dim;
    p.k_scale = scales.data_ptr<c10::Half>();
    p.v_scale = p.k_scale + slots * p.num_kv_heads;
    kind = CacheKind::kInt8;
    return slots / block_size;
  }
  TORCH_CHECK(bits == 4, "bits must be 0 (a float cache), 8 or 4, got ", bits);
  TORCH_CHECK(cache.size() == 8, "an int4 cache is [k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_residual, "
              "residual_of_block], got ", cache.size(), " tensors");
  const at::Tensor &k_codes = cache[0], &k_scale = cache[1], &k_min = cache[2], &v_codes = cache[3],
                   &v_scale = cache[4], &v_min = cache[5], &residual = cache[6], &res_of_block = cache[7];
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(1) == block_size && k_codes.scalar_type() == at::kByte,
              "int4 k_codes must be [num_blocks, block_size, kv_heads, head_dim / 2] uint8, got ", k_codes.sizes(),
              " ", k_codes.scalar_type());
  const int64_t nb = k_codes.size(0), kvh = k_codes.size(2), d = 2 * k_codes.size(3);
  const auto half_of = [](const at::Tensor& t, at::IntArrayRef shape) {
    return t.scalar_type() == at::kHalf && t.sizes() == shape;
  };
  TORCH_CHECK(half_of(k_scale, {nb, kvh, d}) && half_of(k_min, {nb, kvh, d}),
              "int4 k_scale / k_min must be float16 [", nb, ", ", kvh, ", ", d, "]");
  TORCH_CHECK(v_codes.scalar_type() == at::kByte && v_codes.sizes() == at::IntArrayRef({nb * block_size, kvh, d / 2}),
              "int4 v_codes must be uint8 [", nb * block_size, ", ", kvh, ", ", d / 2, "], got ", v_codes.sizes());
  TORCH_CHECK(half_of(v_scale, {nb * block_size, kvh}) && half_of(v_min, {nb * block_size, kvh}),
              "int4 v_scale / v_min must be float16 [", nb * block_size, ", ", kvh, "]");
  TORCH_CHECK(residual.scalar_type() == at::kHalf && residual.dim() == 4 && residual.size(1) == block_size &&
                  residual.size(2) == kvh && residual.size(3) == d,
              "int4 k_residual must be float16 [R, ", block_size, ", ", kvh, ", ", d, "], got ", residual.sizes());
  TORCH_CHECK(res_of_block.scalar_type() == at::kLong && res_of_block.sizes() == at::IntArrayRef({nb}),
              "int4 residual_of_block must be int64 [", nb, "], got ", res_of_block.sizes());
  const int64_t* res = res_of_block.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; ++b)
    TORCH_CHECK(res[b] >= -1 && res[b] < residual.size(0), "residual_of_block[", b, "] = ", res[b],
                " is outside the ", residual.size(0), " residual buffers");
  p.num_kv_heads = kvh;
  p.head_dim = d;
  p.k = k_codes.data_ptr();
  p.v = v_codes.data_ptr();
  p.k_scale = k_scale.data_ptr<c10::Half>();
  p.k_min = k_min.data_ptr<c10::Half>();
  p.v_scale = v_scale.data_ptr<c10::Half>();
  p.v_min = v_min.data_ptr<c10::Half>();
  p.k_residual = residual.data_ptr<c10::Half>();
  p.residual_of_block = res;
  kind = CacheKind::kInt4;
  return nb;
}

}  // namespace

// Decode: one query token per sequence, row b of q is sequence b.
// out, q: [B, h, d]; kv_cache: [2, num_blocks, block_size, kvh, d]; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32 (tokens in the cache including this step's); sliding_window: 0 = none.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t sliding_window) {
  const int64_t num_seqs = block_tables.size(0);
  check_layout(out, q, kv_cache, block_tables, context_lens, num_seqs);
  TORCH_CHECK(q.size(0) == num_seqs, "decode: q has ", q.size(0), " rows for ", num_seqs, " sequences");
  thread_local std::vector<int64_t> query_start;
  query_start.resize(num_seqs + 1);
  for (int64_t b = 0; b <= num_seqs; ++b) query_start[b] = b;
  Problem p;
  const CacheKind kind = float_cache(p, kv_cache);
  attention_impl(out, q, p, kind, kv_cache.size(1), query_start.data(), block_tables, context_lens, scale,
                 sliding_window, 1);
}

// Prefill / chunked prefill / multi-token verification: sequence b owns rows
// [query_start_loc[b], query_start_loc[b + 1]) of q and out, and its query tokens are the last ones of its
// context_lens[b] positions (the earlier ones are read from the cache).
// out, q: [T, h, d]; query_start_loc: [B + 1] int32 or int64; the rest as for decode; q_tile: query tokens per
// work item.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale, int64_t sliding_window, int64_t q_tile) {
  const int64_t num_seqs = block_tables.size(0);
  check_layout(out, q, kv_cache, block_tables, context_lens, num_seqs);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
              "query_start_loc must be [num_seqs + 1] = [", num_seqs + 1, "], got ", query_start_loc.sizes());
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] >= 0, "query_start_loc[0] must be >= 0");
  Problem p;
  const CacheKind kind = float_cache(p, kv_cache);
  attention_impl(out, q, p, kind, kv_cache.size(1), starts, block_tables, context_lens, scale, sliding_window,
                 q_tile);
}

// paged_prefill_attention for steps that verify token trees (engine/token_tree.py): tree_bits [T] int64, per query token
// bit j set where it may see its sequence's in-step row j (its ancestors and itself), or -1 for a token with no
// tree (every earlier row, as paged_prefill_attention). Each row sees its sequence's earlier cache entries as
// usual. A sequence with tree rows has at most 64 query tokens; no sliding window (a tree attends everything).
void paged_tree_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, double scale, int64_t q_tile, const at::Tensor& tree_bits) {
  const int64_t num_seqs = block_tables.size(0);
  check_layout(out, q, kv_cache, block_tables, context_lens, num_seqs);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
              "query_start_loc must be [num_seqs + 1] = [", num_seqs + 1, "], got ", query_start_loc.sizes());
  TORCH_CHECK(tree_bits.dim() == 1 && tree_bits.size(0) == q.size(0) && tree_bits.scalar_type() == at::kLong &&
                  tree_bits.is_contiguous(),
              "tree_bits must be a contiguous int64 [T = ", q.size(0), "] tensor, got ", tree_bits.sizes(), " ",
              tree_bits.scalar_type());
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  const int64_t* bits = tree_bits.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] >= 0, "query_start_loc[0] must be >= 0");
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t t = starts[b]; t < starts[b + 1]; ++t) {
      TORCH_CHECK(bits[t] == kAllRows || (starts[b + 1] - starts[b] <= 64 && (bits[t] >> (t - starts[b]) & 1)),
                  "tree rows: a sequence of at most 64 query tokens, each seeing itself; token ", t, " of sequence ",
                  b, " has bits ", bits[t], " in a chunk of ", starts[b + 1] - starts[b]);
    }
  }
  Problem p;
  const CacheKind kind = float_cache(p, kv_cache);
  p.tree_bits = bits;
  attention_impl(out, q, p, kind, kv_cache.size(1), starts, block_tables, context_lens, scale, 0, q_tile);
}

// Either of the above on any cache, with StreamingLLM's sinks: `bits` 0 for a float32 / bfloat16 cache tensor
// (cache = [kv_cache]), 8 or 4 for a quantized one (kvcache/quant.py; its tensors as quantized_cache lists them),
// read in place; query_start_loc None for a decode-only step (row b of q is sequence b). num_sinks > 0 (with a
// sliding window): keys [0, num_sinks) are seen by every row as well, scored by q_sink [T, h, d] float32.
void paged_attention_general(at::Tensor out, const at::Tensor& q, at::TensorList cache, int64_t bits,
                             int64_t block_size, const std::optional<at::Tensor>& query_start_loc,
                             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                             int64_t sliding_window, int64_t q_tile, const std::optional<at::Tensor>& q_sink,
                             int64_t num_sinks) {
  Problem p;
  CacheKind kind = CacheKind::kFloat;
  int64_t num_blocks;
  if (bits == 0) {
    TORCH_CHECK(cache.size() == 1, "a float cache is [kv_cache], got ", cache.size(), " tensors");
    const at::Tensor& kv_cache = cache[0];
    TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                    kv_cache.is_contiguous() && kv_cache.size(2) == block_size &&
                    (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16),
                "kv_cache must be a contiguous float32 or bfloat16 [2, num_blocks, block_size=", block_size,
                ", kv_heads, head_dim] CPU tensor, got ", kv_cache.sizes(), " ", kv_cache.scalar_type());
    kind = float_cache(p, kv_cache);
    num_blocks = kv_cache.size(1);
  } else {
    num_blocks = quantized_cache(p, kind, cache, bits, block_size);
  }
  TORCH_CHECK(num_sinks >= 0 && (num_sinks == 0 || sliding_window > 0),
              "num_sinks must be >= 0, and sinks need a sliding window");
  if (num_sinks > 0) {
    TORCH_CHECK(q_sink.has_value() && q_sink->scalar_type() == at::kFloat && q_sink->is_contiguous() &&
                    q_sink->sizes() == q.sizes(),
                "sinks need q_sink: a contiguous float32 tensor like q ", q.sizes());
    p.q_sink = q_sink->data_ptr<float>();
    p.sinks = num_sinks;
  }
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.size(2) == p.head_dim && q.stride(2) == 1,
              "q must be CPU [tokens, heads, head_dim = ", p.head_dim, "] with a contiguous last dim, got ", q.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "out must be like q ", q.sizes(), " ", q.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(q.size(1) % p.num_kv_heads == 0, "query heads (", q.size(1), ") must be a multiple of kv heads (",
              p.num_kv_heads, ")");
  TORCH_CHECK(p.head_dim % 8 == 0, "head_dim must be a multiple of 8, got ", p.head_dim);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [num_seqs, max_blocks] tensor");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "context_lens must be a contiguous int32 [num_seqs=", num_seqs, "] tensor");
  thread_local std::vector<int64_t> decode_start;
  at::Tensor qsl;
  const int64_t* starts;
  if (query_start_loc.has_value()) {
    TORCH_CHECK(query_start_loc->dim() == 1 && query_start_loc->size(0) == num_seqs + 1,
                "query_start_loc must be [num_seqs + 1] = [", num_seqs + 1, "]");
    qsl = query_start_loc->to(at::kLong).contiguous();
    starts = qsl.data_ptr<int64_t>();
    TORCH_CHECK(starts[0] >= 0, "query_start_loc[0] must be >= 0");
  } else {
    TORCH_CHECK(q.size(0) == num_seqs, "decode: q has ", q.size(0), " rows for ", num_seqs, " sequences");
    decode_start.resize(num_seqs + 1);
    for (int64_t b = 0; b <= num_seqs; ++b) decode_start[b] = b;
    starts = decode_start.data();
    q_tile = 1;
  }
  attention_impl(out, q, p, kind, num_blocks, starts, block_tables, context_lens, scale, sliding_window, q_tile);
}

#ifndef BRISK_OPS_NAMESPACE  // overridable only to load two builds side by side when comparing variants
#define BRISK_OPS_NAMESPACE brisk
#endif

TORCH_LIBRARY_FRAGMENT(BRISK_OPS_NAMESPACE, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int sliding_window) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor block_tables, Tensor context_lens, float scale, int sliding_window, int q_tile) -> ()");
  m.def(
      "paged_tree_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor block_tables, Tensor context_lens, float scale, int q_tile, Tensor tree_bits) -> ()");
  m.def(
      "paged_attention_general(Tensor(a!) out, Tensor q, Tensor[] cache, int bits, int block_size, "
      "Tensor? query_start_loc, Tensor block_tables, Tensor context_lens, float scale, int sliding_window, "
      "int q_tile, Tensor? q_sink=None, int num_sinks=0) -> ()");
}

TORCH_LIBRARY_IMPL(BRISK_OPS_NAMESPACE, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_attention_general", &paged_attention_general);
  m.impl("paged_tree_attention", &paged_tree_attention);
}

}  // namespace brisk
