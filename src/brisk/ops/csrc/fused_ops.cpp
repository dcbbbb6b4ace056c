// Fused elementwise ops of the decoder layer: RMSNorm, residual add + RMSNorm, SiLU(gate) * up, GELU-tanh(gate) * up.
//
// At batch-1 decode each of these is a few hundred to a few thousand floats, so the cost is the number of ops,
// not the arithmetic: ATen's rms_norm is ~8 ops (pow, mean, add, rsqrt, mul, to, mul, ...) and SwiGLU is 3
// (chunk, silu, mul). Here each is one pass over its rows. Rounding follows the modules they replace:
//   rms_norm, float32:  x * r * w                    r = 1 / sqrt(mean(x^2) + eps), all float32
//   rms_norm, bfloat16: bf16(w * bf16(x * r))        statistics in float32; HF's `weight * normed.to(dtype)`
//   rms_norm, bfloat16 rows, float32 weight: bf16(x * r * w), all float32, rounded once (HF's Gemma3RMSNorm,
//                                            whose 1 + w multiplies in float32)
//   silu_mul, bfloat16: bf16(bf16(silu(g)) * u)      F.silu(gate) * up in bf16 rounds twice; so does this
//   gelu_tanh_mul:      the same, with gelu_tanh(g)  (Gemma's GeGLU, F.gelu(gate, approximate="tanh") * up)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

// The vector ops are AVX2 code, and for ARM64 NEON code for RMSNorm and the SiLU / GELU products; argmax and
// float16 -> bfloat16 are AVX2 only. Without either (or for those two on ARM64) the portable ops (RoPE, the cache
// write, the 8-bit embedding) are still registered and the callers take their PyTorch reference paths for the rest.
#if defined(__AVX2__) && defined(__FMA__)
#define BRISK_FUSED_AVX2
#include <immintrin.h>

#include "simd.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

// Rows of work below which one thread does it all: waking the OpenMP pool costs more (several us) than
// normalizing a few rows (a 576-wide row is ~0.1 us). Chosen so each task gets >= ~32K elements.
constexpr int64_t kElementsPerTask = 32 * 1024;

inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, width));
}

}  // namespace

#ifdef BRISK_FUSED_AVX2
namespace {

using brisk_simd::hsum;
using brisk_simd::load8;

// ---- 8-wide loads and stores for float and bfloat16 (bf16 = the high 16 bits of a float) ----

// float -> bf16 with round-to-nearest-even, NaN kept a (quiet) NaN: the same rounding as c10::BFloat16.
inline __m128i to_bf16_8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  __m256i hi = _mm256_srli_epi32(rounded, 16);
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  hi = _mm256_blendv_epi8(hi, _mm256_set1_epi32(0x7FC0), is_nan);
  // 8 x u32 (each <= 0xFFFF) -> 8 x u16: pack the two 128-bit halves
  return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(v)); }
// what a float becomes once stored in T and read back (identity for float)
inline __m256 round_to(__m256 v, const float*) { return v; }
inline __m256 round_to(__m256 v, const at::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_8(v)), 16));
}

// Scalar tails go through the same 8-wide code on a zero-padded copy, so a tail element is computed exactly
// like a body element (no second scalar formula whose rounding could differ).
template <typename T>
inline __m256 load_tail(const T* p, int64_t n) {
  T buf[8];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  return load8(buf);
}
template <typename T>
inline void store_tail(T* p, __m256 v, int64_t n) {
  T buf[8];
  store8(buf, v);
  std::memcpy(static_cast<void*>(p), buf, n * sizeof(T));
}

// ---- RMSNorm ----

// out = norm(x) * w for one row of H; when add != nullptr, first x := x + add is written back to x (the
// residual stream), rounded to T as a separate `residual + x` op would round it. W: T, or float32 (Gemma's norm).
template <typename T, typename W>
inline void rms_norm_row(T* x, const T* add, const W* w, T* out, int64_t H, float eps) {
  const int64_t body = H - H % 8;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t k = 0;
  if (add != nullptr) {
    for (; k < body; k += 8) {
      __m256 v = round_to(_mm256_add_ps(load8(x + k), load8(add + k)), x);
      store8(x + k, v);
      acc0 = _mm256_fmadd_ps(v, v, acc0);
    }
    if (k < H) {
      __m256 v = round_to(_mm256_add_ps(load_tail(x + k, H - k), load_tail(add + k, H - k)), x);
      store_tail(x + k, v, H - k);
      acc1 = _mm256_fmadd_ps(v, v, acc1);
    }
  } else {
    for (; k + 16 <= body; k += 16) {  // two accumulators: the FMA latency chain is the bottleneck here
      __m256 a = load8(x + k), b = load8(x + k + 8);
      acc0 = _mm256_fmadd_ps(a, a, acc0);
      acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    for (; k < body; k += 8) {
      __m256 a = load8(x + k);
      acc0 = _mm256_fmadd_ps(a, a, acc0);
    }
    if (k < H) {
      __m256 a = load_tail(x + k, H - k);
      acc1 = _mm256_fmadd_ps(a, a, acc1);
    }
  }
  const float ms = hsum(_mm256_add_ps(acc0, acc1)) / static_cast<float>(H);
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(ms + eps));
  auto norm = [&](__m256 xv, __m256 wv) {
    // float32: (x * r) * w; bf16: w * bf16(x * r), then rounded once more on store; bf16 rows with a float32
    // weight: (x * r) * w in float32, rounded on store only
    __m256 n = _mm256_mul_ps(xv, r);
    if constexpr (std::is_same_v<T, W>) n = round_to(n, x);
    return _mm256_mul_ps(n, wv);
  };
  for (k = 0; k < body; k += 8) store8(out + k, norm(load8(x + k), load8(w + k)));
  if (k < H) store_tail(out + k, norm(load_tail(x + k, H - k), load_tail(w + k, H - k)), H - k);
}

// ---- SiLU(gate) * up ----

// e^x for x <= 0 (the only range silu needs, see below): x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor
// series to degree 7 (truncation r^8/8! < 6e-9, under float32's 6e-8 ulp), 2^n put into the exponent bits.
// Below -87.3 the result would be subnormal: flushed to 0 there (silu's value there is below 1e-36 anyway).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // Cody-Waite: ln2 split in a part exact in float (so n * hi is exact) and the rest
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n in [-126, 0]: 2^n = float with biased exponent n + 127
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// silu(g) = g / (1 + e^-g). Written with e = e^-|g| <= 1 so the exponential never overflows:
//   g >= 0: g / (1 + e)        g < 0: g e / (1 + e)
inline __m256 silu8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // -|g|
  __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// gelu_tanh(g) = 0.5 g (1 + tanh(z / 2)) with z = 2 sqrt(2 / pi) (g + 0.044715 g^3); since 1 + tanh(z / 2) =
// 2 sigmoid(z), that is g sigmoid(z): silu8's division with e = e^-|z| <= 1 (never overflows), z for g.
//   z >= 0: g / (1 + e)        z < 0: g e / (1 + e)
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),  // 2 sqrt(2 / pi)
                                 _mm256_fmadd_ps(g3, _mm256_set1_ps(0.044715f), g));
  __m256 e = exp_nonpositive(_mm256_or_ps(z, sign));  // e^-|z|
  __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// out = act(gate) * up over one row of I; act(g) rounded to T before the product, as `act(gate) * up` in T rounds it
template <typename T, typename Act>
inline void act_mul_row(const T* gate, const T* up, T* out, int64_t I, Act act) {
  auto f = [&](__m256 g, __m256 u) { return _mm256_mul_ps(round_to(act(g), out), u); };
  int64_t k = 0;
  for (; k + 8 <= I; k += 8) store8(out + k, f(load8(gate + k), load8(up + k)));
  if (k < I) store_tail(out + k, f(load_tail(gate + k, I - k), load_tail(up + k, I - k)), I - k);
}

}  // namespace

#elif defined(__aarch64__) && defined(__ARM_NEON)
// ---- ARM64 (NEON): the same loops, 4 lanes wide ----
// The formulas and their float32 operations are the AVX2 ones above (fused multiply-adds where they fuse, the
// same exp polynomial, IEEE division, the same bfloat16 rounding), so silu_mul and gelu_tanh_mul give the x86 bits;
// RMSNorm's sum of squares adds in another order (4 lanes, not 8), so its last bit may differ.
#define BRISK_FUSED_NEON
namespace {

using vf = float32x4_t;

inline vf load4(const float* p) { return vld1q_f32(p); }
inline vf load4(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift, exact
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
// float -> bf16 with round-to-nearest-even, NaN kept a (quiet) NaN: c10::BFloat16's rounding
inline uint16x4_t to_bf16_4(vf v) {
  const uint32x4_t bits = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  uint32x4_t hi = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7FFF), lsb)), 16);
  hi = vbslq_u32(vceqq_f32(v, v), hi, vdupq_n_u32(0x7FC0));  // v != v: NaN
  return vmovn_u32(hi);
}
inline void store4(float* p, vf v) { vst1q_f32(p, v); }
inline void store4(at::BFloat16* p, vf v) { vst1_u16(reinterpret_cast<uint16_t*>(p), to_bf16_4(v)); }
inline vf round_to(vf v, const float*) { return v; }
inline vf round_to(vf v, const at::BFloat16*) {
  return vreinterpretq_f32_u32(vshll_n_u16(to_bf16_4(v), 16));
}
// tails through the same 4-wide code on a zero-padded copy (as the AVX2 build does with 8)
template <typename T>
inline vf load_tail(const T* p, int64_t n) {
  T buf[4];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  return load4(buf);
}
template <typename T>
inline void store_tail(T* p, vf v, int64_t n) {
  T buf[4];
  store4(buf, v);
  std::memcpy(static_cast<void*>(p), buf, n * sizeof(T));
}

template <typename T, typename W>
inline void rms_norm_row(T* x, const T* add, const W* w, T* out, int64_t H, float eps) {
  const int64_t body = H - H % 4;
  vf acc0 = vdupq_n_f32(0.f), acc1 = acc0;
  int64_t k = 0;
  if (add != nullptr) {
    for (; k < body; k += 4) {
      const vf v = round_to(vaddq_f32(load4(x + k), load4(add + k)), x);
      store4(x + k, v);
      acc0 = vfmaq_f32(acc0, v, v);
    }
    if (k < H) {
      const vf v = round_to(vaddq_f32(load_tail(x + k, H - k), load_tail(add + k, H - k)), x);
      store_tail(x + k, v, H - k);
      acc1 = vfmaq_f32(acc1, v, v);
    }
  } else {
    for (; k + 8 <= body; k += 8) {  // two accumulators: the FMA latency chain is the bottleneck
      const vf a = load4(x + k), b = load4(x + k + 4);
      acc0 = vfmaq_f32(acc0, a, a);
      acc1 = vfmaq_f32(acc1, b, b);
    }
    for (; k < body; k += 4) {
      const vf a = load4(x + k);
      acc0 = vfmaq_f32(acc0, a, a);
    }
    if (k < H) {
      const vf a = load_tail(x + k, H - k);
      acc1 = vfmaq_f32(acc1, a, a);
    }
  }
  const float ms = vaddvq_f32(vaddq_f32(acc0, acc1)) / static_cast<float>(H);
  const vf r = vdupq_n_f32(1.0f / std::sqrt(ms + eps));
  auto norm = [&](vf xv, vf wv) {
    vf n = vmulq_f32(xv, r);
    if constexpr (std::is_same_v<T, W>) n = round_to(n, x);
    return vmulq_f32(n, wv);
  };
  for (k = 0; k < body; k += 4) store4(out + k, norm(load4(x + k), load4(w + k)));
  if (k < H) store_tail(out + k, norm(load_tail(x + k, H - k), load_tail(w + k, H - k)), H - k);
}

// exp_nonpositive of the AVX2 build, operation for operation
inline vf exp_nonpositive(vf x) {
  const vf lo = vdupq_n_f32(-87.3f);
  const uint32x4_t underflow = vcltq_f32(x, lo);
  x = vmaxq_f32(x, lo);
  const vf n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  vf r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860682030941723212e-6f));
  vf p = vdupq_n_f32(1.0f / 5040.0f);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  const vf v = vmulq_f32(p, vreinterpretq_f32_s32(e));
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), underflow));
}

// silu and gelu_tanh as in the AVX2 build (the "8" names are shared with it: 4 lanes here)
inline vf silu8(vf g) {
  const vf e = exp_nonpositive(vnegq_f32(vabsq_f32(g)));  // e^-|g|
  const vf num = vbslq_f32(vcltq_f32(g, vdupq_n_f32(0.f)), vmulq_f32(g, e), g);
  return vdivq_f32(num, vaddq_f32(vdupq_n_f32(1.0f), e));
}
inline vf gelu_tanh8(vf g) {
  const vf g3 = vmulq_f32(vmulq_f32(g, g), g);
  const vf z = vmulq_f32(vdupq_n_f32(1.5957691216057308f), vfmaq_f32(g, g3, vdupq_n_f32(0.044715f)));
  const vf e = exp_nonpositive(vnegq_f32(vabsq_f32(z)));  // e^-|z|
  const vf num = vbslq_f32(vcltq_f32(z, vdupq_n_f32(0.f)), vmulq_f32(g, e), g);
  return vdivq_f32(num, vaddq_f32(vdupq_n_f32(1.0f), e));
}

template <typename T, typename Act>
inline void act_mul_row(const T* gate, const T* up, T* out, int64_t I, Act act) {
  auto f = [&](vf g, vf u) { return vmulq_f32(round_to(act(g), out), u); };
  int64_t k = 0;
  for (; k + 4 <= I; k += 4) store4(out + k, f(load4(gate + k), load4(up + k)));
  if (k < I) store_tail(out + k, f(load_tail(gate + k, I - k), load_tail(up + k, I - k)), I - k);
}

}  // namespace
#endif

#if defined(BRISK_FUSED_AVX2) || defined(BRISK_FUSED_NEON)
namespace {

template <typename T, typename W>
void rms_norm_rows(T* x, const T* add, const W* w, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rms_norm_row(x + r * H, add != nullptr ? add + r * H : nullptr, w, out + r * H, H, eps);
  });
}

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, H], got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), op, ": x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, op, ": weight dtype ",
              weight.scalar_type(), " must be x's (", x.scalar_type(), ") or float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must be [H] = [", x.size(1),
              "], got ", weight.sizes());
}

// gate_up: [T, 2I] (gate columns, then up columns, as the fused gate_up_proj writes them) -> act(gate) * up [T, I]
template <typename Act>
at::Tensor act_mul(const char* name, const at::Tensor& gate_up, Act act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, name, ": gate_up must be [T, 2I], got ",
              gate_up.sizes());
  TORCH_CHECK(gate_up.is_contiguous(), name, ": gate_up must be contiguous");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16, name,
              ": gate_up must be float32 or bfloat16, got ", gate_up.scalar_type());
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  auto run = [&](auto* gu, auto* o) {
    at::parallel_for(0, T, row_grain(2 * I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) act_mul_row(gu + r * 2 * I, gu + r * 2 * I + I, o + r * I, I, act);
    });
  };
  if (gate_up.scalar_type() == at::kFloat)
    run(gate_up.data_ptr<float>(), out.data_ptr<float>());
  else
    run(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

// Runs f(x, weight) with their element types: float / float, bf16 / bf16, or bf16 rows with a float32 weight.
template <typename F>
void with_norm_types(const at::Tensor& x, const at::Tensor& weight, F f) {
  if (x.scalar_type() == at::kFloat)
    f(x.data_ptr<float>(), weight.data_ptr<float>());
  else if (weight.scalar_type() == at::kFloat)
    f(x.data_ptr<at::BFloat16>(), weight.data_ptr<float>());
  else
    f(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>());
}

// x: [T, H] float32 or bfloat16, weight: [H] of x's dtype or float32, contiguous -> [T, H] of x's dtype
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", x, weight);
  auto out = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  with_norm_types(x, weight, [&](auto* px, auto* pw) {
    using Tx = std::remove_pointer_t<decltype(px)>;
    rms_norm_rows(px, static_cast<const Tx*>(nullptr), pw, out.data_ptr<Tx>(), T, H, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place), then -> rms_norm(residual, weight): vLLM's fused_add_rms_norm, one pass per row.
// x, residual: [T, H] of one dtype; weight: [H] of that dtype or float32; all contiguous.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args("add_rms_norm", residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x ", x.sizes(), " and residual ", residual.sizes(),
              " must have one shape");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.is_contiguous(),
              "add_rms_norm: x must be contiguous and of residual's dtype");
  auto out = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  with_norm_types(residual, weight, [&](auto* pr, auto* pw) {
    using Tx = std::remove_pointer_t<decltype(pr)>;
    rms_norm_rows(pr, x.data_ptr<Tx>(), pw, out.data_ptr<Tx>(), T, H, static_cast<float>(eps));
  });
  return out;
}

// gate_up: [T, 2I] -> silu(gate) * up [T, I] (SwiGLU)
at::Tensor silu_mul(const at::Tensor& gate_up) {
  return act_mul("silu_mul", gate_up, [](auto g) { return silu8(g); });
}

// gate_up: [T, 2I] -> gelu_tanh(gate) * up [T, I] (GeGLU with the tanh approximation: Gemma's MLP)
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  return act_mul("gelu_tanh_mul", gate_up, [](auto g) { return gelu_tanh8(g); });
}
#endif  // vector ops

// ---- RoPE on the fused q/k/v projection, in place, and this step's keys and values into the paged cache ----
//
// Replaces ~15 small ops per layer (slices, cos/sin casts, 4 muls, sub, add, cat, two index_copy_) with one pass
// per token. Rounding follows model/rope.py `apply_rope` op by op, so the result is bit-identical to it:
//   a' = (a * c) - (b * s),  b' = (b * c) + (a * s)    each product and each sum rounded to the model dtype,
//   with c, s = cos, sin rounded to the model dtype first (`cos.to(x.dtype)`).
// fp-contract=off: a fused multiply-add would skip the products' rounding and change float32 results.

inline float round_as(float v, const float*) { return v; }
inline float round_as(float v, const at::BFloat16*) { return static_cast<float>(at::BFloat16(v)); }

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_heads(T* x, int64_t heads, int64_t d, const float* cos,
                                                              const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* r = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_as(cos[i], r), s = round_as(sin[i], r);
      const float a = static_cast<float>(r[i]), b = static_cast<float>(r[i + half]);
      const float a2 = round_as(round_as(a * c, r) - round_as(b * s, r), r);
      const float b2 = round_as(round_as(b * c, r) + round_as(a * s, r), r);
      r[i] = static_cast<T>(a2);
      r[i + half] = static_cast<T>(b2);
    }
  }
}

// One token's k or v heads into the cache: a copy, or float32 rounded to bfloat16 (nearest even, as
// `tensor.to(torch.bfloat16)`) for a bfloat16 cache under a float32 model.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(at::BFloat16* dst, const at::BFloat16* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(at::BFloat16));
}
inline void store_row(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// qkv: [T, (h + 2 kvh) * d] contiguous (q heads, k heads, v heads), rotated in place (q and k);
// cos, sin: [T, d / 2] float32; kv_cache: [2, num_blocks, block_size, kvh, d] contiguous, qkv's dtype or
// bfloat16 under float32 qkv (a 16-bit cache for a float32 model: --kv-cache-dtype bfloat16);
// slot_mapping: [T] int64, the cache slot of each token (block * block_size + offset).
void rope_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(3) == num_kv_heads,
              "rope_cache: kv_cache must be a contiguous [2, num_blocks, block_size, ", num_kv_heads,
              ", head_dim] tensor, got ", kv_cache.sizes());
  const int64_t d = kv_cache.size(4), T = qkv.size(0), width = (num_heads + 2 * num_kv_heads) * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.is_contiguous(),
              "rope_cache: qkv must be a contiguous [tokens, ", width, "] tensor, got ", qkv.sizes());
  TORCH_CHECK((qkv.scalar_type() == kv_cache.scalar_type() || kv_cache.scalar_type() == at::kBFloat16) &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "rope_cache: qkv and kv_cache must be float32 / float32, bfloat16 / bfloat16 or float32 / bfloat16, "
              "got ", qkv.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK(d % 2 == 0, "rope_cache: head_dim must be even, got ", d);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == d / 2,
                "rope_cache: cos and sin must be contiguous float32 [", T, ", ", d / 2, "], got ", t->sizes(), " ",
                t->scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "rope_cache: slot_mapping must be a contiguous int64 [", T, "] tensor");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), row = num_kv_heads * d;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rope_cache: slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's ", num_slots, " slots");
  auto run = [&](auto* x, auto* cache) {
    auto* k_cache = cache;
    auto* v_cache = cache + kv_cache.numel() / 2;
    at::parallel_for(0, T, row_grain(width * 4), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        auto* r = x + t * width;
        rope_heads(r, num_heads + num_kv_heads, d, cos.data_ptr<float>() + t * (d / 2),
                   sin.data_ptr<float>() + t * (d / 2));
        store_row(k_cache + slots[t] * row, r + num_heads * d, row);
        store_row(v_cache + slots[t] * row, r + (num_heads + num_kv_heads) * d, row);
      }
    });
  };
  if (qkv.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat)
    run(qkv.data_ptr<float>(), kv_cache.data_ptr<float>());
  else if (qkv.scalar_type() == at::kFloat)
    run(qkv.data_ptr<float>(), kv_cache.data_ptr<at::BFloat16>());
  else
    run(qkv.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>());
}

// rope_cache's rotation alone, for a quantized KV cache (which quantizes k and v on its own write): q and k heads of
// qkv [T, (h + 2 kvh) * d] rotated in place, bit-identical to apply_rope; cos, sin [T, d / 2] float32.
void rope_qk(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t T = qkv.size(0), d = 2 * cos.size(-1), width = (num_heads + 2 * num_kv_heads) * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.is_contiguous() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "rope_qk: qkv must be a contiguous float32 or bfloat16 [tokens, ", width, "] tensor, got ", qkv.sizes());
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == d / 2,
                "rope_qk: cos and sin must be contiguous float32 [", T, ", ", d / 2, "], got ", t->sizes());
  auto run = [&](auto* x) {
    for (int64_t t = 0; t < T; ++t)
      rope_heads(x + t * width, num_heads + num_kv_heads, d, cos.data_ptr<float>() + t * (d / 2),
                 sin.data_ptr<float>() + t * (d / 2));
  };
  if (qkv.scalar_type() == at::kFloat) run(qkv.data_ptr<float>());
  else run(qkv.data_ptr<at::BFloat16>());
}

#ifdef BRISK_FUSED_AVX2
namespace {

// Index of the largest value of v[0, n), the lowest index among equal maxima, and of the first NaN if there is one
// (torch.argmax's answers). Four sets of 8 lanes, each keeping its lane's first maximum (strictly greater
// replaces), so ties resolve to the lowest index at the end.
int64_t argmax_row(const float* v, int64_t n) {
  constexpr int A = 4;
  __m256 best[A];
  __m256i at[A], idx[A];
  for (int a = 0; a < A; ++a) {
    best[a] = _mm256_set1_ps(-INFINITY);
    at[a] = _mm256_setzero_si256();
    idx[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * a));
  }
  const __m256i step = _mm256_set1_epi32(8 * A);
  __m256 nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 * A <= n; j += 8 * A) {
    for (int a = 0; a < A; ++a) {
      const __m256 x = _mm256_loadu_ps(v + j + 8 * a);
      const __m256 gt = _mm256_cmp_ps(x, best[a], _CMP_GT_OQ);
      best[a] = _mm256_blendv_ps(best[a], x, gt);
      at[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[a]), _mm256_castsi256_ps(idx[a]), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      idx[a] = _mm256_add_epi32(idx[a], step);
    }
  }
  if (_mm256_movemask_ps(nan) != 0)
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(v[i])) return i;
  float bv = -INFINITY;
  int64_t bi = 0;
  alignas(32) float vals[8];
  alignas(32) int32_t ids[8];
  for (int a = 0; a < A; ++a) {
    _mm256_store_ps(vals, best[a]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ids), at[a]);
    for (int l = 0; l < 8; ++l)
      if (vals[l] > bv || (vals[l] == bv && ids[l] < bi)) {
        bv = vals[l];
        bi = ids[l];
      }
  }
  for (; j < n; ++j) {  // the tail, after every vector lane (higher indices: only strictly greater wins)
    if (std::isnan(v[j])) return j;
    if (v[j] > bv) {
      bv = v[j];
      bi = j;
    }
  }
  return bi;
}

}  // namespace

// logits: [B, V] float32 -> [B] int64, torch.argmax(logits, -1) (greedy sampling: ~2 us for the default model's
// 49,152 logits against ~30 us for ATen's argmax, whose reduction is not vectorized on this CPU).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [B, V > 0]");
  TORCH_CHECK(logits.size(1) <= INT32_MAX, "argmax_rows: V must fit int32");
  const auto x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) o[b] = argmax_row(p + b * V, V);
  return out;
}

#endif  // BRISK_FUSED_AVX2

// Rows of a symmetric 8-bit embedding table: qweight [V, H] uint8, scales [V, G] float32 (G groups of H / G),
// ids [T] int64 -> [T, H] float32, out[t, h] = (q[id, h] - 128) * s[id, h / (H / G)] (QuantEmbedding's float32
// operations, one op instead of six).
at::Tensor embedding_q8(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& ids) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "embedding_q8: qweight must be a contiguous uint8 [V, H] tensor");
  const int64_t V = qweight.size(0), H = qweight.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == V && scales.size(1) > 0 && H % scales.size(1) == 0,
              "embedding_q8: scales must be a contiguous float32 [V, G] tensor with G dividing H");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "embedding_q8: ids must be int64 [T]");
  const auto idc = ids.contiguous();
  const int64_t T = idc.size(0), G = scales.size(1), gs = H / G;
  auto out = at::empty({T, H}, scales.options());
  const int64_t* id = idc.data_ptr<int64_t>();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = id[t];
    TORCH_CHECK(r >= 0 && r < V, "embedding_q8: id ", r, " is out of range for a table of ", V, " rows");
    for (int64_t h = 0; h < H; ++h)
      o[t * H + h] = (static_cast<float>(q[r * H + h]) - 128.f) * sc[r * G + h / gs];
  }
  return out;
}

#ifdef BRISK_FUSED_AVX2
// float16 -> bfloat16 in place of `dst` (both contiguous, the same number of elements): each value widened exactly to
// float32 (F16C), then rounded once to bfloat16 (round to nearest even, NaN kept a NaN), as c10's conversion through
// float does; at memory speed, for loading a float16 checkpoint (a GGUF F16 file) in bfloat16. ATen's own half ->
// bfloat16 copy runs ~1 GB/s here, half -> float -> bfloat16 two passes with a float32 temporary.
void half_to_bfloat16(const at::Tensor& src, at::Tensor& dst) {
  TORCH_CHECK(src.scalar_type() == at::kHalf && src.is_contiguous(), "half_to_bfloat16: src must be contiguous float16");
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16 && dst.is_contiguous() && dst.numel() == src.numel(),
              "half_to_bfloat16: dst must be contiguous bfloat16 with src's number of elements");
  const uint16_t* in = reinterpret_cast<const uint16_t*>(src.data_ptr<at::Half>());
  at::BFloat16* out = dst.data_ptr<at::BFloat16>();
  const int64_t n = src.numel();
  at::parallel_for(0, (n + 7) / 8, kElementsPerTask / 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i = b * 8, left = std::min<int64_t>(8, n - i);
      if (left == 8) {
        store8(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
        continue;
      }
      uint16_t buf[8] = {};
      std::memcpy(buf, in + i, left * sizeof(uint16_t));
      store_tail(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf))), left);
    }
  });
}
#endif  // BRISK_FUSED_AVX2

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("embedding_q8(Tensor qweight, Tensor scales, Tensor ids) -> Tensor", &embedding_q8);
  m.def("rope_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "int num_heads, int num_kv_heads) -> ()", &rope_cache);
  m.def("rope_qk(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> ()", &rope_qk);
#ifdef BRISK_FUSED_AVX2
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
  m.def("half_to_bfloat16(Tensor src, Tensor(a!) dst) -> ()", &half_to_bfloat16);
#endif
#if defined(BRISK_FUSED_AVX2) || defined(BRISK_FUSED_NEON)
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &gelu_tanh_mul);
#endif
}
