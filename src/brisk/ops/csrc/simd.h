// AVX2 helpers shared by brisk's kernels. Every ops/csrc/*.cpp is built as its own extension library, so each one
// that includes this header compiles its own copy; kernels.py folds this header into every build's cache key.
// A file takes the names it uses with using-declarations inside its anonymous namespace, so they overload with
// its own helpers of the same name.
#pragma once

#include <ATen/ATen.h>
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

}  // namespace brisk_simd
