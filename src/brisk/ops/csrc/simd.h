// AVX2 helpers shared by brisk's kernels. Every ops/csrc/*.cpp is built as its own extension library, so each one
// that includes this header compiles its own copy; kernels.py folds this header into every build's cache key.
// A file takes the names it uses with using-declarations inside its anonymous namespace, so they overload with
// its own helpers of the same name.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace brisk_simd {

// f(std::integral_constant<int, M>{}) for M = 1..8 (larger M as 8): one switch for every row-count template
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

// Software prefetch of a weight stream: the cache level, and stream_distance(avx2, avx512) picks each kernel's
// distance in bytes for its build. The avx512 build is for the newer machine (Zen 5, about twice the bandwidth of
// the AVX2 VM, so more bytes in flight), where prefetching further ahead into L2 measured best in every GEMV;
// on the AVX2 VM, L1 at a shorter distance did.
#ifdef __AVX512F__
constexpr auto kStreamHint = _MM_HINT_T1;
constexpr int64_t stream_distance(int64_t /*avx2*/, int64_t avx512) { return avx512; }
#else
constexpr auto kStreamHint = _MM_HINT_T0;
constexpr int64_t stream_distance(int64_t avx2, int64_t /*avx512*/) { return avx2; }
#endif

// sum of the 8 lanes
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// 8 consecutive values as float32 (bf16 -> f32 is a 16-bit shift, exact)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One block of 32 activations as four float32 vectors f; returns max |x| over the block (the int8 activation
// kernels' per-block scale is this / 127).
template <typename T>
inline float load_block(const T* src, __m256 f[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    f[i] = load8(src + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, f[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Group parameters. The quantized-linear kernels read a weight's float16 scales (as the checkpoint stores them) and
// uint8 zero points, or none for symmetric codes (zero = 2^(bits-1)). The float32 min of the affine form
// w = scale * q + min is min = -scale * zero, exact in float32 (an 11-bit significand times an integer below 256),
// so these give the same numbers as float32 scales and mins, in 3 bytes a group instead of 8.

#define BRISK_INLINE inline __attribute__((always_inline))

BRISK_INLINE float scale1(const at::Half* s) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(s)); }
// n <= 8 float16 / uint8 values as float32 lanes (lanes from n on are 0), never reading past the n-th value. The
// tail is not assembled in a stack buffer: a wide load of narrow stores misses store forwarding (~15 cycles), and
// with a row's 9 groups (576 / 64) that stall per row made the int4 kernel 1.35x slower.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
BRISK_INLINE __m256 scales8(const at::Half* s, int64_t n = 8) {
  return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), s));
}
BRISK_INLINE __m256 zeros8(const uint8_t* z, int64_t n = 8) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), z)));
}
#else
BRISK_INLINE __m256 scales8(const at::Half* s, int64_t n = 8) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = i < n ? scale1(s + i) : 0.f;
  return _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}
BRISK_INLINE __m256 zeros8(const uint8_t* z, int64_t n = 8) {
  if (n == 8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z))));
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = i < n ? static_cast<float>(z[i]) : 0.f;
  return _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
}
#endif

// the first n < 8 floats at x as lanes, zeros above
BRISK_INLINE __m256 load_first(const float* x, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  return _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1), x);
#else
  const __m256i mask =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(x, mask);
#endif
}

// acc[m] + sum over groups g < n of (c - zero_g) * scale_g * x[m * ldx + g] for m < MT: the affine min term (c -
// zero = -zero, or with a code offset c) of MT activation rows, 8 groups at a time, each group vector formed once
// for all rows. s, z: one weight row's scales and zero points (z null: `zero` for every group).
template <int MT>
BRISK_INLINE void min_terms(__m256* acc, const at::Half* s, const uint8_t* z, float zero, float c, const float* x,
                            int64_t ldx, int64_t n) {
  const __m256 cv = _mm256_set1_ps(c), zv = _mm256_set1_ps(zero);
  int64_t g = 0;
  for (; g + 8 <= n; g += 8) {
    const __m256 mn = _mm256_mul_ps(scales8(s + g), _mm256_sub_ps(cv, z ? zeros8(z + g) : zv));
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(x + m * ldx + g), acc[m]);
  }
  if (g < n) {  // the tail: masked loads (AVX2's maskload is slow on AMD: only here, as before)
    const int64_t k = n - g;
    const __m256 mn = _mm256_mul_ps(scales8(s + g, k), _mm256_sub_ps(cv, z ? zeros8(z + g, k) : zv));
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(mn, load_first(x + m * ldx + g, k), acc[m]);
  }
}

#undef BRISK_INLINE

}  // namespace brisk_simd
