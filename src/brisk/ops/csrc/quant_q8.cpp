// Dense quantized linear with int8 activations and integer dot products, for decode (few rows):
// out[M, N] = x[M, K] @ W_hat[N, K]^T (+ bias), W_hat = scale * q + min per group (affine 8- or 4-bit codes in the
// runtime layout of quant_linear.cpp, read as they are: nothing new is stored).
//
// Why. quant_linear.cpp turns every code into a float (an AND and an int->float conversion per 8 codes) and
// multiplies with one FMA per 8 codes; on the AVX2 box that arithmetic, not memory, bounds a 576-wide layer in
// cache (47 us for 576 x 576 int8, of which integer dots alone would take ~27 us: notes/sparseq_results.md). Here,
// as in llama.cpp's Q8_0 dot products, x is rounded once per call to int8 per 32 columns and one block of 32
// codes is multiplied against it with two integer instructions (maddubs: u8 x s8 -> pairs summed to int16, madd
// with ones: -> 8 int32), one int->float conversion and one FMA per activation row.
//
// Activations, per row and per 32-column block b (the kernel's float32 operations, reproduced bit for bit by
// brisk.ops.sparse_q8.quantize_activations_q8):   xs_b = max|x_b| / 127,   xq_b = round_half_even(x_b * 127 / max|x_b|)
// and the sum of the ROUNDED activations per weight group, xr_g = sum_{b in g} xs_b * sum(xq_b), so that the result
// is exactly the product of the rounded x with W_hat (up to float32 summation):
//
//   out[m, n] = sum_g s_g * sum_{b in g} xs_b * dot(q'_b, xq_b)  +  sum_g (min_g + c * s_g) * xr_g
//
// with q' = q - c: c = 128 for 8-bit codes (so that they fit int8; see below), c = 0 for 4-bit codes.
// The group parameters are float16 scales and uint8 zero points, min_g = -zero_g * s_g (simd.h, "Group
// parameters": the same float32 numbers as float32 scales and mins, 3 bytes a group instead of 8); symmetric codes
// (no zero points) take zero_g = 2^(bits-1). At batch 1 the group parameters are streams of their own next to the
// codes: not reading float32 mins for symmetric codes made the default model's 120 decoder linears 1.84 -> 1.70 ms
// (same-process A/B, medians of 60 passes); float16 scales + uint8 zero points instead of float32 scales + mins
// then made the asymmetric ones 1.94 -> 1.82 ms.
//
// Operand ranges. maddubs adds two u8 x s8 products into a saturating int16: 8-bit codes 0..255 against |xq| <= 127
// could reach 2 * 255 * 127 = 64770 and saturate. So 8-bit codes are recentred (q' = q ^ 0x80 = q - 128, in
// [-128, 127]) and multiplied with the sign trick: |q'| (<= 128, unsigned) against sign(q') * xq, whose pair sums
// reach at most 2 * 128 * 127 = 32512 < 32767: exact. 4-bit codes 0..15 are unsigned already: 2 * 15 * 127 fits.
//
// Layout. The codes stay in quant_linear.cpp's blocked order (see its header), and x is permuted once per call to
// match, so that byte p of the 256-bit code vector and byte p of the activation vector hold the same element:
//
//   8 bits: 32 bytes; byte p = 4 l + i of the block is element e = 8 i + l (l = 0..7, i = 0..3)
//   4 bits: 16 bytes; nibbles split into a 256-bit vector [low nibbles | high nibbles]: byte p = 4 j + i of the
//           low half is element 8 i + j, byte 16 + 4 j + i (high half) is element 8 i + j + 4 (j = 0..3)
//
// Both are the same permutation, xperm[4 l + i] = x[8 i + l]: after the packs that narrow four int32 vectors
// (lanes l of x[8 i .. 8 i + 7]) to bytes, each 128-bit half holds a 4 x 4 byte matrix [i][l] that one in-lane byte
// shuffle transposes to [l][i].
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

using brisk_simd::hsum;
using brisk_simd::load8;
using brisk_simd::load_block;
using brisk_simd::min_terms;
using brisk_simd::scale1;
using brisk_simd::scales8;
using brisk_simd::zeros8;

constexpr int64_t kBlock = 32;
constexpr int kMaxTileRows = 4;  // activation rows per tile (a chunk of weight rows stays in L1 across tiles)
// software prefetch distance in the codes: 4 KiB measured ~5% faster than quant_linear.cpp's 1 KiB on the default
// model's int4 decode step (same-process A/B, 1 and 2 threads; 2 and 8 KiB in between). On the avx512 build's
// machine (Zen 5, ~2x the bandwidth) 8 KiB into L2: batch-1 decode of the whole model, int4 g64 283 -> 297 tok/s,
// int8 235 -> 242 (means of six alternated processes each; 16 KiB no better). See simd.h.
constexpr int64_t kPrefetchBytes = brisk_simd::stream_distance(4096, 8192);
constexpr auto kPrefetchHint = brisk_simd::kStreamHint;
// groups of at most this many blocks fold their scale into each block's (see tile): measured 1.1-1.4x faster for
// 32- and 64-column groups on the default model's shapes, M = 1..8 (1 thread, in cache and out)
constexpr int64_t kFoldMaxBlocks = 2;

struct Q8W {
  const uint8_t* data;  // [N, row_bytes] blocked codes
  int64_t row_bytes;    // K / 32 * BPB
  const at::Half* scales;  // [N, ngroups] float16
  const uint8_t* zeros;    // [N, ngroups] zero points (min = -zero * scale), or null for symmetric codes
  int64_t ngroups;
  int64_t blocks_per_group;
  int64_t nblocks;  // K / 32
  float zero;       // symmetric codes' zero point (2^(bits-1)); unused with zeros
};

// The activations as the kernel reads them. xq: [M, K] int8 in the permuted order; xs: [M, nblocks]; xr: [M,
// ngroups] (sums of the rounded activations per weight group).
// xq2, xs2 (4-bit codes, see tile4p; null otherwise): [M, K] int8, per pair of blocks [xA lo | xB lo | xA hi | xB hi]
// (16 bytes each); [M, nblocks * 4] float32, per pair [xs_A x 4 | xs_B x 4].
struct Q8X {
  const int8_t* xq;
  const float* xs;
  const float* xr;
  int64_t K, nblocks, ngroups;
  const int8_t* xq2 = nullptr;
  const float* xs2 = nullptr;
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BRISK_Q8_VNNI 1
// The avx512 build (kernels.py): vpdpbusd multiplies 32 u8 x s8 pairs and adds each four products into an int32
// lane with no int16 step, so nothing can saturate: 8-bit codes are used as they are (c = 0, no recentring and no
// sign trick) and one instruction replaces maddubs + madd.
constexpr bool kVnni = true;
#if defined(__AVX512F__) && defined(__AVX512BW__)
// 4-bit codes: two pairs of blocks (64 bytes of codes) per 512-bit step, see tile4p_512
#define BRISK_Q8_ZMM 1
#endif
#else
constexpr bool kVnni = false;
#endif

// c, the offset subtracted from the codes before the integer dot (q' = q - c)
template <int BITS>
constexpr float code_offset() { return BITS == 8 && !kVnni ? 128.f : 0.f; }

// One block of codes as the unsigned maddubs operand `u`, and (8 bits) the recentred signed codes `sg` whose sign
// the activations take.
template <int BITS>
inline void load_codes(const uint8_t* p, __m256i& u, __m256i& sg) {
  if constexpr (BITS == 8 && kVnni) {
    u = sg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else if constexpr (BITS == 8) {
    sg = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
    u = _mm256_abs_epi8(sg);  // -128 stays 0x80, which maddubs reads as unsigned 128
  } else {
    static_assert(BITS == 4, "bits must be 8 or 4");
    // [16 bytes | the same 16 bytes >> 4], then the low nibble of every byte
    const __m256i d = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    u = _mm256_and_si256(_mm256_srlv_epi32(d, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
    sg = u;
  }
}

// 8 int32 partial sums of the block's dot(q', xq) for one activation row.
template <int BITS>
inline __m256i block_dot(__m256i u, __m256i sg, __m256i x) {
#ifdef BRISK_Q8_VNNI
  (void)sg;
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, sg)), ones);
  else return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
#endif
}

template <int MT>
inline void finish(const Q8W& p, int64_t n, const Q8X& x, const __m256* tot, float offset, const float* bias,
                   float* out, int64_t ldo);

// Weight row n against MT activation rows (xq + m * K, xs + m * nblocks, xr + m * ngroups). With one or two rows
// the blocks alternate between two accumulator sets, so two FMA chains are in flight.
// FOLD (groups of a few blocks): no group loop; each block's activation scale is multiplied by its group's scale
// instead (one multiply per block and activation row against ~5 operations per group end).
template <int BITS, int MT, bool FOLD>
void tile(const Q8W& p, int64_t n, const Q8X& x, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT <= 2 ? 2 : 1;
  constexpr int BPB = 32 * BITS / 8;
  constexpr float kOffset = code_offset<BITS>();
  __m256 acc[NA][MT], tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
    for (int a = 0; a < NA; ++a) acc[a][m] = _mm256_setzero_ps();
  }
  const uint8_t* wp = p.data + n * p.row_bytes;
  const at::Half* sp = p.scales + n * p.ngroups;
  auto step = [&](int64_t b, __m256* a) __attribute__((always_inline)) {
    __m256i u, sg;
    _mm_prefetch(reinterpret_cast<const char*>(wp + b * BPB) + kPrefetchBytes, kPrefetchHint);
    load_codes<BITS>(wp + b * BPB, u, sg);
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xq + m * x.K + b * kBlock));
      const __m256i d = block_dot<BITS>(u, sg, xv);  // [8] int32, exact
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(x.xs + m * x.nblocks + b), a[m]);
    }
  };
  if constexpr (FOLD) {
    const at::Half* sg = sp;
    __m256 s = _mm256_setzero_ps();
    int64_t left = 0;  // blocks left in the current group
    auto fstep = [&](int64_t b, __m256* a) __attribute__((always_inline)) {
      if (left == 0) {
        s = _mm256_set1_ps(scale1(sg++));
        left = p.blocks_per_group;
      }
      --left;
      __m256i u, sgn;
      _mm_prefetch(reinterpret_cast<const char*>(wp + b * BPB) + kPrefetchBytes, kPrefetchHint);
      load_codes<BITS>(wp + b * BPB, u, sgn);
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xq + m * x.K + b * kBlock));
        const __m256 xs = _mm256_mul_ps(_mm256_broadcast_ss(x.xs + m * x.nblocks + b), s);
        a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot<BITS>(u, sgn, xv)), xs, a[m]);
      }
    };
    int64_t b = 0;
    if constexpr (NA == 2)
      for (; b + 2 <= p.nblocks; b += 2) {
        fstep(b, acc[0]);
        fstep(b + 1, acc[1]);
      }
    for (; b < p.nblocks; ++b) fstep(b, acc[0]);
    for (int m = 0; m < MT; ++m) {
      tot[m] = acc[0][m];
      if constexpr (NA == 2) tot[m] = _mm256_add_ps(tot[m], acc[1][m]);
    }
  } else {
    for (int64_t b0 = 0, g = 0; b0 < p.nblocks; b0 += p.blocks_per_group, ++g) {  // weight groups
      const int64_t b1 = b0 + p.blocks_per_group;
      int64_t b = b0;
      if constexpr (NA == 2)
        for (; b + 2 <= b1; b += 2) {
          step(b, acc[0]);
          step(b + 1, acc[1]);
        }
      for (; b < b1; ++b) step(b, acc[0]);
      const __m256 s = _mm256_set1_ps(scale1(sp + g));  // end of the group: tot += s_g * sum_b xs_b dot_b
      for (int m = 0; m < MT; ++m) {
        __m256 t = acc[0][m];
        if constexpr (NA == 2) t = _mm256_add_ps(t, acc[1][m]);
        tot[m] = _mm256_fmadd_ps(t, s, tot[m]);
        for (int a = 0; a < NA; ++a) acc[a][m] = _mm256_setzero_ps();
      }
    }
  }
  finish<MT>(p, n, x, tot, kOffset, bias, out, ldo);
}

// out[m, n] = the row sums tot[m] + sum_g (min_g + c s_g) xr_g (+ bias), min_g + c s_g = (c - zero_g) s_g.
template <int MT>
inline void finish(const Q8W& p, int64_t n, const Q8X& x, const __m256* tot, float offset, const float* bias,
                   float* out, int64_t ldo) {
  __m256 a[MT];
  for (int m = 0; m < MT; ++m) a[m] = tot[m];
  min_terms<MT>(a, p.scales + n * p.ngroups, p.zeros ? p.zeros + n * p.ngroups : nullptr, p.zero, offset, x.xr,
                x.ngroups, p.ngroups);
  for (int m = 0; m < MT; ++m) out[m * ldo + n] = hsum(a[m]) + (bias ? bias[n] : 0.f);
}

inline bool fold(const Q8W& p) { return p.blocks_per_group <= kFoldMaxBlocks && p.blocks_per_group < p.nblocks; }

// 4-bit codes two blocks (32 bytes) at a time, for K / 32 even and groups of one block or an even number of blocks:
// one load, the low nibbles of both blocks in one vector and their high nibbles in another ([A | B] by 128-bit
// half), two maddubs summed as int16 (|sum| <= 4 * 15 * 127, exact), one madd -> [A's 4 partial sums | B's],
// one conversion and one FMA against [xs_A s_A x 4 | xs_B s_B x 4]: about 7 operations a block instead of tile's
// ~11 (the activations are laid out to match once per call: Q8X.xq2 / xs2).
inline bool pairs(const Q8W& p) {
  return p.nblocks % 2 == 0 && (p.blocks_per_group == 1 || p.blocks_per_group % 2 == 0);
}

template <int MT>
void tile4p(const Q8W& p, int64_t n, const Q8X& x, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m256 acc[NA][MT], tot[MT];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[a][m] = _mm256_setzero_ps();
  const uint8_t* wp = p.data + n * p.row_bytes;
  const at::Half* sp = p.scales + n * p.ngroups;
  const __m256i low = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int64_t npairs = p.nblocks / 2, bpg = p.blocks_per_group;
  // the weight scales of pair q, for q = 0, 1, 2, ... in order (a counter: no division in the loop)
  const int64_t pairs_per_group = bpg / 2;
  const at::Half* sg = sp;
  int64_t left = pairs_per_group;
  auto next_scales = [&](int64_t q) __attribute__((always_inline)) {
    if (bpg == 1) return _mm256_set_m128(_mm_set1_ps(scale1(sp + 2 * q + 1)), _mm_set1_ps(scale1(sp + 2 * q)));
    if (left == 0) {
      ++sg;
      left = pairs_per_group;
    }
    --left;
    return _mm256_set1_ps(scale1(sg));
  };
  auto step = [&](int64_t q, __m256* a) __attribute__((always_inline)) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + q * 32) + kPrefetchBytes, kPrefetchHint);
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + q * 32));
    const __m256i lo = _mm256_and_si256(d, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), low);
    const __m256 sv = next_scales(q);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xm = x.xq2 + m * x.K + q * 64;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32));
#ifdef BRISK_Q8_VNNI
      const __m256i d = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
      const __m256i d = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)),
                                          ones);
#endif
      const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(x.xs2 + m * x.nblocks * 4 + q * 8), sv);
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xs, a[m]);
    }
  };
  int64_t q = 0;
  if constexpr (NA == 2)
    for (; q + 2 <= npairs; q += 2) {
      step(q, acc[0]);
      step(q + 1, acc[1]);
    }
  for (; q < npairs; ++q) step(q, acc[0]);
  for (int m = 0; m < MT; ++m) {
    tot[m] = acc[0][m];
    if constexpr (NA == 2) tot[m] = _mm256_add_ps(tot[m], acc[1][m]);
  }
  finish<MT>(p, n, x, tot, 0.f, bias, out, ldo);
}

#ifdef BRISK_Q8_ZMM
// The pieces of tile4p_512 and tile4p_512_r4. A "quad" is two pairs of blocks: 64 bytes of codes, one cache line.

// A weight row's groups in step order: the group of pair q = 0, 1, 2, ... (groups of 2 or more blocks; a counter,
// no division).
struct PairGroups {
  int64_t per_group, g = 0, left;
  explicit PairGroups(int64_t bpg) : per_group(std::max<int64_t>(1, bpg / 2)), left(per_group) {}
  int64_t next() {
    if (left == 0) {
      ++g;
      left = per_group;
    }
    --left;
    return g;
  }
};

// A quad's codes as [pair 2r lo | pair 2r+1 lo] and the same for the high nibbles.
inline void unpack_quad(const uint8_t* w, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i d = _mm512_loadu_si512(w);
  lo = _mm512_and_si512(d, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(d, 4), low);
}

// The weight scales of quad r of a row (s: its scales) per lane of the quad's dot products: four consecutive block
// scales (one-block groups), two group scales (two-block groups), else those of groups ga and gb (PairGroups).
inline __m512 quad_scales(const at::Half* s, int64_t r, int64_t bpg, int64_t ga, int64_t gb) {
  if (bpg == 1)
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(
                                     reinterpret_cast<const __m128i*>(s + 4 * r)))));
  if (bpg == 2) {
    int32_t two;
    std::memcpy(&two, s + 2 * r, 4);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two))));
  }
  return _mm512_shuffle_f32x4(_mm512_set1_ps(scale1(s + ga)), _mm512_set1_ps(scale1(s + gb)), 0);
}

// A row's odd last pair q, 256 bits wide: its int32 dot products against activations xa (low nibbles' elements)
// and xb (high), and its scales per lane (g: its group, for groups of 2 or more blocks).
inline __m256i pair_dot(const uint8_t* w, __m256i xa, __m256i xb) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i lo = _mm256_and_si256(d, low), hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), low);
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
}
inline __m256 pair_scales(const at::Half* s, int64_t q, int64_t bpg, int64_t g) {
  if (bpg == 1) return _mm256_set_m128(_mm_set1_ps(scale1(s + 2 * q + 1)), _mm_set1_ps(scale1(s + 2 * q)));
  return _mm256_set1_ps(scale1(bpg == 2 ? s + q : s + g));
}

inline __m256 fold512(__m512 t) {  // 16 lanes -> 8 (pairwise sums of the halves)
  return _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
}

// tile4p with 512-bit vectors: a step takes a quad: one load, two ANDs and a shift (unpack_quad), two vpdpbusd per
// activation row against xq2 in its tile layout (pair_x), one conversion and one FMA against [xs2 of pair 2r | of
// pair 2r+1] times the weight scales. About half tile4p's operations per code; an odd last pair runs 256 bits wide
// (its activations after the quads).
template <int MT>
void tile4p_512(const Q8W& p, int64_t n, const Q8X& x, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m512 acc[NA][MT];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[a][m] = _mm512_setzero_ps();
  const uint8_t* wp = p.data + n * p.row_bytes;
  const at::Half* sp = p.scales + n * p.ngroups;
  const int64_t npairs = p.nblocks / 2, nquads = npairs / 2, bpg = p.blocks_per_group;
  PairGroups groups(bpg);
  auto step = [&](int64_t r, __m512* a) __attribute__((always_inline)) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + r * 64) + kPrefetchBytes, kPrefetchHint);
    __m512i lo, hi;
    unpack_quad(wp + r * 64, lo, hi);
    const int64_t ga = bpg > 2 ? groups.next() : 0;
    const int64_t gb = bpg > 2 ? groups.next() : 0;
    const __m512 sv = quad_scales(sp, r, bpg, ga, gb);
    const int8_t* xr = x.xq2 + r * (MT * 128);  // the tile layout (pair_x)
    const float* sr = x.xs2 + r * (MT * 16);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xm = xr + m * 128;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xm)),
                                              hi, _mm512_loadu_si512(xm + 64));
      const __m512 xs = _mm512_mul_ps(_mm512_loadu_ps(sr + m * 16), sv);
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), xs, a[m]);
    }
  };
  int64_t r = 0;
  if constexpr (NA == 2)
    for (; r + 2 <= nquads; r += 2) {
      step(r, acc[0]);
      step(r + 1, acc[1]);
    }
  for (; r < nquads; ++r) step(r, acc[0]);
  __m256 tot[MT];
  for (int m = 0; m < MT; ++m) {
    __m512 t = acc[0][m];
    if constexpr (NA == 2) t = _mm512_add_ps(t, acc[1][m]);
    tot[m] = fold512(t);
  }
  if (npairs % 2) {  // the last pair
    const int64_t q = npairs - 1;
    const __m256 sv = pair_scales(sp, q, bpg, bpg > 2 ? groups.next() : 0);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xm = x.xq2 + nquads * (MT * 128) + m * 64;
      const __m256i dot = pair_dot(wp + q * 32, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm)),
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + 32)));
      const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(x.xs2 + nquads * (MT * 16) + m * 8), sv);
      tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), xs, tot[m]);
    }
  }
  finish<MT>(p, n, x, tot, 0.f, bias, out, ldo);
}

// One activation row (batch-1 decode) against weight rows n .. n+3: the activations and their scales are loaded once
// for four rows, and the four rows' sums are reduced together (one horizontal add tree and one 4-float store
// instead of four hsums and scalar stores, which cost about as much as the dot products of a 576-wide row). Per
// call, in cache, 1 thread: the default model's gate/up 40.3 -> 24.4 us, down 16.7 -> 10.0, o 9.6 -> 6.1 (Python
// call overhead ~2.4 us included); its 120 decoder linears streamed from memory (M = 1) 2.13 -> 1.97 ms: there
// memory, not arithmetic, is the bound.
inline void tile4p_512_r4(const Q8W& p, int64_t n, const Q8X& x, const float* bias, float* out) {
  constexpr int R = 4;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* wp = p.data + n * p.row_bytes;
  const int64_t rb = p.row_bytes, ng = p.ngroups;
  const at::Half* sp = p.scales + n * ng;
  const uint8_t* zp = p.zeros ? p.zeros + n * ng : nullptr;
  const int64_t npairs = p.nblocks / 2, nquads = npairs / 2, bpg = p.blocks_per_group;
  PairGroups groups(bpg);
  {  // the scales and zero points are two more streams: prefetched as far ahead (in rows) as the codes
    const int64_t ahead = (kPrefetchBytes / rb + R) * ng;
    const char* sa = reinterpret_cast<const char*>(sp + ahead);
    for (int64_t off = 0; off < R * ng * 2; off += 64) _mm_prefetch(sa + off, kPrefetchHint);
    const char* za = zp ? reinterpret_cast<const char*>(zp + ahead) : nullptr;
    for (int64_t off = 0; za && off < R * ng; off += 64) _mm_prefetch(za + off, kPrefetchHint);
  }
  for (int64_t r = 0; r < nquads; ++r) {
    const __m512i xl = _mm512_loadu_si512(x.xq2 + r * 128);
    const __m512i xh = _mm512_loadu_si512(x.xq2 + r * 128 + 64);
    const __m512 xs = _mm512_loadu_ps(x.xs2 + r * 16);
    const int64_t ga = bpg > 2 ? groups.next() : 0;
    const int64_t gb = bpg > 2 ? groups.next() : 0;
    for (int i = 0; i < R; ++i) {
      const uint8_t* w = wp + i * rb + r * 64;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, kPrefetchHint);
      __m512i lo, hi;
      unpack_quad(w, lo, hi);
      const __m512 sv = quad_scales(sp + i * ng, r, bpg, ga, gb);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(xs, sv), acc[i]);
    }
  }
  __m256 tot[R];
  for (int i = 0; i < R; ++i) tot[i] = fold512(acc[i]);
  if (npairs % 2) {  // the last pair
    const int64_t q = npairs - 1;
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xq2 + q * 64));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.xq2 + q * 64 + 32));
    const __m256 xs = _mm256_loadu_ps(x.xs2 + q * 8);
    const int64_t g = bpg > 2 ? groups.next() : 0;
    for (int i = 0; i < R; ++i) {
      const __m256i dot = pair_dot(wp + i * rb + q * 32, xa, xb);
      tot[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xs, pair_scales(sp + i * ng, q, bpg, g)),
                               tot[i]);
    }
  }
  // + sum_g min_g xr_g per row (4-bit codes: c = 0), min_g = -zero_g s_g, 8 groups of the four rows at a time
  // (sharing the xr loads: a min_terms call per row made the batch-1 step ~10% slower), then the four rows'
  // horizontal sums together
  const __m256 zero = _mm256_set1_ps(p.zero);
  for (int64_t k = 0; k < ng; k += 8) {
    const int64_t c = std::min<int64_t>(8, ng - k);
    const __m256 xr = c == 8 ? _mm256_loadu_ps(x.xr + k) : brisk_simd::load_first(x.xr + k, c);
    for (int i = 0; i < R; ++i) {
      const __m256 z = zp ? zeros8(zp + i * ng + k, c) : zero;
      tot[i] = _mm256_fnmadd_ps(_mm256_mul_ps(scales8(sp + i * ng + k, c), z), xr, tot[i]);
    }
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(tot[0], tot[1]), _mm256_hadd_ps(tot[2], tot[3]));
  __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // [row n .. n+3]
  if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias + n));
  _mm_storeu_ps(out + n, sums);
}
#endif

template <int BITS, int MT>
void tile_rows(const Q8W& p, int64_t n0, int64_t n1, const Q8X& x, const float* bias, float* out, int64_t ldo) {
#ifdef BRISK_Q8_ZMM
  if (BITS == 4 && x.xq2 != nullptr) {
    int64_t n = n0;
    if constexpr (MT == 1)
      for (; n + 4 <= n1; n += 4) tile4p_512_r4(p, n, x, bias, out);
    for (; n < n1; ++n) tile4p_512<MT>(p, n, x, bias, out, ldo);
  }
#else
  if (BITS == 4 && x.xq2 != nullptr) for (int64_t n = n0; n < n1; ++n) tile4p<MT>(p, n, x, bias, out, ldo);
#endif
  else if (fold(p)) for (int64_t n = n0; n < n1; ++n) tile<BITS, MT, true>(p, n, x, bias, out, ldo);
  else for (int64_t n = n0; n < n1; ++n) tile<BITS, MT, false>(p, n, x, bias, out, ldo);
}

// x advanced by `m` activation rows
inline Q8X rows_from(const Q8X& x, int64_t m) {
  return Q8X{x.xq + m * x.K, x.xs + m * x.nblocks, x.xr + m * x.ngroups, x.K, x.nblocks, x.ngroups,
             x.xq2 ? x.xq2 + m * x.K : nullptr, x.xs2 ? x.xs2 + m * x.nblocks * 4 : nullptr};
}

// activation rows per tile: 4, or 8 for tile4p_512 (its weight-side work, a load and three operations per 128 codes,
// is then shared by all rows of a batch-8 step, whose codes are read once instead of twice; with tile4p_512 itself,
// the default model's 120 decoder linears at M = 8 went 6.94 -> 5.72 ms, same-process A/B, medians of 60 passes)
template <int BITS>
constexpr int max_tile_rows() {
#ifdef BRISK_Q8_ZMM
  return BITS == 4 ? 8 : kMaxTileRows;
#else
  return kMaxTileRows;
#endif
}

// Weight rows n0 .. n1-1 against all M activation rows, one tile of up to max_tile_rows rows at a time.
template <int BITS>
void run_rows(const Q8W& p, int64_t n0, int64_t n1, const Q8X& x, int64_t M, const float* bias, float* out,
              int64_t ldo) {
  constexpr int T = max_tile_rows<BITS>();
  int64_t m = 0;
  for (; m + T <= M; m += T) tile_rows<BITS, T>(p, n0, n1, rows_from(x, m), bias, out + m * ldo, ldo);
  if (m < M)
    brisk_simd::with_rows(M - m, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      if constexpr (MT < T) tile_rows<BITS, MT>(p, n0, n1, rows_from(x, m), bias, out + m * ldo, ldo);
    });
}

template <int BITS>
void run(const Q8W& p, const Q8X& x, int64_t M, int64_t N, const float* bias, float* out) {
  // rows per chunk: their codes (<= 4 KiB) stay in L1 while the activation tiles run over them
  const int64_t chunk = std::clamp<int64_t>(4096 / p.row_bytes, 1, 32);
  // grain: rows per task such that a task streams >= ~32 KiB of codes
  const int64_t grain = std::max<int64_t>(chunk, (32 * 1024) / p.row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (M <= max_tile_rows<BITS>()) return run_rows<BITS>(p, n0, n1, x, M, bias, out, N);  // one tile: no chunks
    for (int64_t c = n0; c < n1; c += chunk) run_rows<BITS>(p, c, std::min(n1, c + chunk), x, M, bias, out, N);
  });
}

// x [M, K] -> xq [M, K] int8 (permuted, see the top of the file), xs [M, K / 32], xr [M, K / G].
template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xr) {
  // within each 128-bit half: byte 4 l + i <- byte 4 i + l (a 4 x 4 transpose)
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const int64_t nblocks = K / kBlock, ngroups = K / G, bpg = G / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      float gsum = 0.f;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        __m256 f[4];
        const float amax = load_block(x + m * K + j * kBlock, f);
        const float scale = amax / 127.f;
        xs[m * nblocks + j] = scale;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));  // round half to even
        // sum of the block's codes (exact in int32, then exact in float: |sum| <= 32 * 127)
        __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        gsum += scale * static_cast<float>(_mm_cvtsi128_si32(s4));
        // packs: half h holds [q0 l, q1 l, q2 l, q3 l] for l = 4 h .. 4 h + 3, i.e. byte 4 i + (l - 4 h)
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + j * kBlock), _mm256_shuffle_epi8(b, transpose));
      }
      xr[m * ngroups + g] = gsum;
    }
  }
}

// xq, xs (quantize_x's layout) -> xq2, xs2 (tile4p's): per pair of blocks A, B the 128-bit halves regrouped as
// [A lo | B lo], [A hi | B hi], and the scales as [xs_A x 4 | xs_B x 4].
void pair_x(const int8_t* xq, const float* xs, int64_t M, int64_t K, int8_t* xq2, float* xs2) {
  const int64_t nblocks = K / kBlock, npairs = nblocks / 2;
#ifdef BRISK_Q8_ZMM
  // tile layout (tile4p_512), per tile of activation rows as run_rows cuts them (T rows, the last one fewer): for
  // each quad r (pairs 2r, 2r+1) the tile's rows one after another, each [lo 2r | lo 2r+1 | hi 2r | hi 2r+1] (128
  // bytes) with xs2 [pair 2r | pair 2r+1] (16 floats); an odd last pair after the quads, per row [lo | hi] and 8
  // floats. A tile's loads are then constant offsets from one pointer (8 rows' pointers spilled to the stack).
  constexpr int64_t T = max_tile_rows<4>();
  const int64_t nquads = npairs / 2;
#endif
  for (int64_t m = 0; m < M; ++m) {
#ifdef BRISK_Q8_ZMM
    const int64_t m0 = m / T * T, mt = std::min<int64_t>(T, M - m0), i = m - m0;
    int8_t* base = xq2 + m0 * K;
    float* sbase = xs2 + m0 * nblocks * 4;
#endif
    for (int64_t q = 0; q < npairs; ++q) {
      const int8_t* src = xq + m * K + q * 64;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
#ifdef BRISK_Q8_ZMM
      const int64_t r = q / 2;
      const bool in_quad = r < nquads;
      int8_t* dst = in_quad ? base + (r * mt + i) * 128 + (q % 2) * 32 : base + nquads * mt * 128 + i * 64;
      float* sdst = in_quad ? sbase + (r * mt + i) * 16 + (q % 2) * 8 : sbase + nquads * mt * 16 + i * 8;
      const int64_t hi_off = in_quad ? 64 : 32;
#else
      int8_t* dst = xq2 + m * K + q * 64;
      float* sdst = xs2 + m * nblocks * 4 + q * 8;
      constexpr int64_t hi_off = 32;
#endif
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + hi_off), _mm256_permute2x128_si256(a, b, 0x31));
      const float* sa = xs + m * nblocks + 2 * q;
      _mm256_storeu_ps(sdst, _mm256_set_m128(_mm_set1_ps(sa[1]), _mm_set1_ps(sa[0])));
    }
  }
}

// x [M, K] -> out [M, K] float32: every 32-column block rounded to its int8 grid, xs_b * xq_b (quantize_x's
// float32 operations, then the product), for the GEMM path of many rows.
template <typename T>
void fake_quantize_rows(const T* x, int64_t m0, int64_t m1, int64_t K, float* out) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t j = 0; j < K / kBlock; ++j) {
      float* dst = out + m * K + j * kBlock;
      __m256 f[4];
      const float amax = load_block(x + m * K + j * kBlock, f);
      const __m256 scale = _mm256_set1_ps(amax / 127.f);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      for (int i = 0; i < 4; ++i) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv)));  // round half to even
        _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(q, scale));
      }
    }
  }
}

}  // namespace

// x: [..., K] float32 or bfloat16, K a multiple of 32 -> float32 [..., K]: the activations quant_linear_q8
// multiplies (brisk.ops.qlinear_q8.fake_quantize_activations, bit for bit).
at::Tensor fake_quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fake_quantize_q8: x must be float32 or bfloat16 [..., K]");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "fake_quantize_q8: K must be a multiple of 32");
  auto xc = x.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t M = x.numel() / K;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    if (xc.scalar_type() == at::kFloat) fake_quantize_rows(xc.data_ptr<float>(), m0, m1, K, o);
    else fake_quantize_rows(xc.data_ptr<at::BFloat16>(), m0, m1, K, o);
  });
  return out;
}

// x: [..., K] float32 or bfloat16; data: [N, K / 32 * 4 * bits] uint8 (quant_linear.cpp's blocked layout, 8 or 4
// bits); scales: [N, K / G] float16 (G a multiple of 32 dividing K); zeros: [N, K / G] uint8 zero points (w = scale *
// (q - zero)), absent for symmetric codes (zero 2^(bits-1)); bias: [N] float32 / bfloat16 or absent.
// Returns [..., N] in x's dtype. Meant for few activation rows (decode); any number works.
at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_q8: x must be float32 or bfloat16 [..., K]");
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear_q8: bits must be 8 or 4");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "quant_linear_q8: K and group_size must be multiples of 32, and group_size must divide K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous() &&
              data.size(1) == K / kBlock * 4 * bits,
              "quant_linear_q8: data must be a contiguous uint8 [N, K / 32 * 4 * bits] tensor");
  const int64_t N = data.size(0), ngroups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == N && scales.size(1) == ngroups, "quant_linear_q8: scales must be float16 [N, K / G]");
  const bool affine = zeros.has_value() && zeros->defined();
  TORCH_CHECK(
      !affine || (zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes()),
      "quant_linear_q8: zeros must be uint8 and shaped like scales");
  at::Tensor bf;  // bias as float32
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                "quant_linear_q8: bias must be a float32 or bfloat16 [N] tensor");
    bf = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return out;
  auto xc = x.contiguous();
  const int64_t nblocks = K / kBlock;
  const bool direct = x.scalar_type() == at::kFloat;  // the kernel writes float32 results in place
  const Q8W p{data.data_ptr<uint8_t>(), data.size(1), scales.data_ptr<at::Half>(),
              affine ? zeros->data_ptr<uint8_t>() : nullptr, ngroups, group_size / kBlock, nblocks,
              static_cast<float>(int64_t{1} << (bits - 1))};
  const bool paired = bits == 4 && pairs(p);
  // scratch (float32 words): xs [M, nblocks], xr [M, ngroups], the float32 result [M, N] unless written in place,
  // then xq [M, K] int8 (K / 4 words), and for paired 4-bit codes xs2 [M, nblocks * 4] and xq2 [M, K] int8
  const int64_t words = M * (nblocks + ngroups + (direct ? 0 : N) + K / 4 + (paired ? nblocks * 4 + K / 4 : 0));
  auto scratch = at::empty({words}, x.options().dtype(at::kFloat));
  float* xs = scratch.data_ptr<float>();
  float* xr = xs + M * nblocks;
  float* acc = direct ? out.data_ptr<float>() : xr + M * ngroups;
  int8_t* xq = reinterpret_cast<int8_t*>(xr + M * ngroups + (direct ? 0 : M * N));
  if (xc.scalar_type() == at::kFloat) quantize_x(xc.data_ptr<float>(), M, K, group_size, xq, xs, xr);
  else quantize_x(xc.data_ptr<at::BFloat16>(), M, K, group_size, xq, xs, xr);
  Q8X xa{xq, xs, xr, K, nblocks, ngroups};
  if (paired) {
    float* xs2 = reinterpret_cast<float*>(xq + M * K);
    int8_t* xq2 = reinterpret_cast<int8_t*>(xs2 + M * nblocks * 4);
    pair_x(xq, xs, M, K, xq2, xs2);
    xa.xq2 = xq2;
    xa.xs2 = xs2;
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  if (bits == 8) run<8>(p, xa, M, N, b, acc);
  else run<4>(p, xa, M, N, b, acc);
  if (!direct) out.copy_(at::from_blob(acc, sizes, x.options().dtype(at::kFloat)));  // -> bfloat16
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("quant_linear_q8(Tensor x, Tensor data, Tensor scales, Tensor? zeros, int bits, int group_size, Tensor? bias) "
        "-> Tensor", &quant_linear_q8);
  m.def("fake_quantize_q8(Tensor x) -> Tensor", &fake_quantize_q8);
}

#endif  // AVX2 + FMA: without them no op is registered and brisk.ops.qlinear_q8 takes its reference path

#if defined(__aarch64__) && defined(__ARM_NEON)
// ---- ARM64 (NEON) ----
//
// The same op and arithmetic for aarch64: activations rounded to int8 per 32-column block with quantize_x's float32
// operations (so fake_quantize_q8 and the xs, xr terms are bit for bit the x86 ones), the codes read in the blocked
// layout as they are, integer dot products per block, then the float32 sums of the formula at the top of the file.
// Only the order of those float32 additions differs from the x86 build (4 lanes here, 8 there).
//
// x is permuted once per call into the codes' order (xperm[4 l + i] = x[8 i + l], the same for 8- and 4-bit codes),
// so that byte p of a block's codes meets byte p of the activations and a block's dot product is a plain byte-wise
// one. 8-bit codes are recentred to int8 (q - 128: c = 128, as the AVX2 build), 4-bit codes are used as they are
// (c = 0). With dotprod (-march=armv8.2-a+dotprod: sdot, vdotq_s32) 16 int8 products per instruction summed by 4
// into int32 lanes, exact; without it vmull_s8 (int8 x int8 -> int16: |q'| <= 128 times |xq| <= 127 fits) and
// pairwise widening adds into int32 lanes, exact as well.
#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kTileRows = 4;  // activation rows that share each loaded block of codes

inline float load_f(float v) { return v; }
inline float load_f(at::BFloat16 v) { return static_cast<float>(v); }  // exact: bfloat16 is float32's top half

// 4 int32 lanes += the byte-wise products of a and b (16 int8 each), summed by lanes of 4 (dotprod) or 8 (not)
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#ifdef __ARM_FEATURE_DOTPROD
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// quantize_x's operations per 32-column block: xs = max|x| / 127, xq = round_half_even(x * (127 / max|x|)) (0 where
// max|x| = 0), stored permuted (xperm[4 l + i] = x[8 i + l]); xr per group = sum over its blocks of xs * sum(xq), in
// block order. Rounded values q are returned in `q` (natural order) for fake_quantize_q8.
template <typename T>
inline float quantize_block(const T* x, int8_t* xq_perm, int32_t* q) {
  float f[kBlock];
  for (int64_t e = 0; e < kBlock; ++e) f[e] = load_f(x[e]);
  float32x4_t mx = vdupq_n_f32(0.f);
  for (int e = 0; e < kBlock; e += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(f + e)));
  const float amax = vmaxvq_f32(mx);
  const float32x4_t inv = vdupq_n_f32(amax > 0.f ? 127.f / amax : 0.f);
  for (int e = 0; e < kBlock; e += 4) vst1q_s32(q + e, vcvtnq_s32_f32(vmulq_f32(vld1q_f32(f + e), inv)));
  if (xq_perm != nullptr)
    for (int l = 0; l < 8; ++l)
      for (int i = 0; i < 4; ++i) xq_perm[4 * l + i] = static_cast<int8_t>(q[8 * i + l]);
  return amax;
}

template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xr) {
  const int64_t nblocks = K / kBlock, ngroups = K / G, bpg = G / kBlock;
  int32_t q[kBlock];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      float gsum = 0.f;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        const float scale = quantize_block(x + m * K + j * kBlock, xq + m * K + j * kBlock, q) / 127.f;
        xs[m * nblocks + j] = scale;
        int32_t s = 0;  // exact in int32, then exact in float: |sum| <= 32 * 127
        for (int e = 0; e < kBlock; ++e) s += q[e];
        gsum += scale * static_cast<float>(s);
      }
      xr[m * ngroups + g] = gsum;
    }
  }
}

// One block's codes against one row's permuted activations (32 bytes): 4 int32 lanes of the dot product of (q - c)
// with xq.
template <int BITS>
inline int32x4_t block_dot(const uint8_t* codes, const int8_t* x) {
  const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
  if constexpr (BITS == 8) {
    const uint8x16_t flip = vdupq_n_u8(0x80);
    const int8x16_t q0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes), flip));
    const int8x16_t q1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + 16), flip));
    return dot16(dot16(vdupq_n_s32(0), q0, x0), q1, x1);
  } else {
    const uint8x16_t c = vld1q_u8(codes);
    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(c, vdupq_n_u8(0x0F)));
    const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(c, 4));
    return dot16(dot16(vdupq_n_s32(0), lo, x0), hi, x1);
  }
}

struct Q8Args {
  const uint8_t* data;
  int64_t row_bytes;
  const at::Half* scales;
  const uint8_t* zeros;  // null: symmetric codes, zero point `zero`
  float zero;
  int64_t K, nblocks, ngroups, bpg;
  const int8_t* xq;
  const float* xs;
  const float* xr;
  const float* bias;
};

// Weight rows n0 .. n1-1 against MT activation rows starting at m (out + m * ldo):
//   out[m, n] = sum_g s_g * sum_{b in g} xs_b * dot_b  +  sum_g s_g * (c - zero_g) * xr_g  (+ bias)
template <int BITS, int MT>
void tile(const Q8Args& a, int64_t n0, int64_t n1, int64_t m, float* out, int64_t ldo) {
  constexpr int64_t bpb = 4 * BITS;  // bytes per block of codes
  constexpr float c = BITS == 8 ? 128.f : 0.f;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = a.data + n * a.row_bytes;
    __builtin_prefetch(w + 4096);
    float32x4_t tot[MT];
    float mins[MT];
    for (int r = 0; r < MT; ++r) tot[r] = vdupq_n_f32(0.f), mins[r] = 0.f;
    for (int64_t g = 0; g < a.ngroups; ++g) {
      float32x4_t gacc[MT];
      for (int r = 0; r < MT; ++r) gacc[r] = vdupq_n_f32(0.f);
      for (int64_t b = g * a.bpg; b < (g + 1) * a.bpg; ++b) {
        for (int r = 0; r < MT; ++r) {
          const int32x4_t d = block_dot<BITS>(w + b * bpb, a.xq + (m + r) * a.K + b * kBlock);
          gacc[r] = vfmaq_n_f32(gacc[r], vcvtq_f32_s32(d), a.xs[(m + r) * a.nblocks + b]);
        }
      }
      const float s = static_cast<float>(a.scales[n * a.ngroups + g]);
      const float mn = s * (c - (a.zeros ? static_cast<float>(a.zeros[n * a.ngroups + g]) : a.zero));
      for (int r = 0; r < MT; ++r) {
        tot[r] = vfmaq_n_f32(tot[r], gacc[r], s);
        mins[r] += mn * a.xr[(m + r) * a.ngroups + g];
      }
    }
    for (int r = 0; r < MT; ++r)
      out[(m + r) * ldo + n] = vaddvq_f32(tot[r]) + mins[r] + (a.bias ? a.bias[n] : 0.f);
  }
}

template <int BITS>
void run(const Q8Args& a, int64_t M, int64_t N, float* out) {
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / a.row_bytes);  // >= ~32 KiB of codes per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + kTileRows <= M; m += kTileRows) tile<BITS, kTileRows>(a, n0, n1, m, out, N);
    switch (M - m) {
      case 3: tile<BITS, 3>(a, n0, n1, m, out, N); break;
      case 2: tile<BITS, 2>(a, n0, n1, m, out, N); break;
      case 1: tile<BITS, 1>(a, n0, n1, m, out, N); break;
      default: break;
    }
  });
}

template <typename T>
void fake_quantize_rows(const T* x, int64_t m0, int64_t m1, int64_t K, float* out) {
  int32_t q[kBlock];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t j = 0; j < K / kBlock; ++j) {
      const float scale = quantize_block(x + m * K + j * kBlock, static_cast<int8_t*>(nullptr), q) / 127.f;
      for (int e = 0; e < kBlock; ++e) out[m * K + j * kBlock + e] = static_cast<float>(q[e]) * scale;
    }
  }
}

}  // namespace

// The x86 build's ops, with its argument checks (see above for the shapes).
at::Tensor fake_quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "fake_quantize_q8: x must be float32 or bfloat16 [..., K]");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "fake_quantize_q8: K must be a multiple of 32");
  auto xc = x.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t M = x.numel() / K;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    if (xc.scalar_type() == at::kFloat) fake_quantize_rows(xc.data_ptr<float>(), m0, m1, K, o);
    else fake_quantize_rows(xc.data_ptr<at::BFloat16>(), m0, m1, K, o);
  });
  return out;
}

at::Tensor quant_linear_q8(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_q8: x must be float32 or bfloat16 [..., K]");
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear_q8: bits must be 8 or 4");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "quant_linear_q8: K and group_size must be multiples of 32, and group_size must divide K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous() &&
              data.size(1) == K / kBlock * 4 * bits,
              "quant_linear_q8: data must be a contiguous uint8 [N, K / 32 * 4 * bits] tensor");
  const int64_t N = data.size(0), ngroups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == N && scales.size(1) == ngroups, "quant_linear_q8: scales must be float16 [N, K / G]");
  const bool affine = zeros.has_value() && zeros->defined();
  TORCH_CHECK(
      !affine || (zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales.sizes()),
      "quant_linear_q8: zeros must be uint8 and shaped like scales");
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                "quant_linear_q8: bias must be a float32 or bfloat16 [N] tensor");
    bf = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return out;
  auto xc = x.contiguous();
  const int64_t nblocks = K / kBlock;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * nblocks), xr(M * ngroups);
  if (xc.scalar_type() == at::kFloat)
    quantize_x(xc.data_ptr<float>(), M, K, group_size, xq.data(), xs.data(), xr.data());
  else
    quantize_x(xc.data_ptr<at::BFloat16>(), M, K, group_size, xq.data(), xs.data(), xr.data());
  const Q8Args a{data.data_ptr<uint8_t>(), data.size(1), scales.data_ptr<at::Half>(),
                 affine ? zeros->data_ptr<uint8_t>() : nullptr, static_cast<float>(int64_t{1} << (bits - 1)), K,
                 nblocks, ngroups, group_size / kBlock, xq.data(), xs.data(), xr.data(),
                 bf.defined() ? bf.data_ptr<float>() : nullptr};
  const bool direct = x.scalar_type() == at::kFloat;
  std::vector<float> acc(direct ? 0 : M * N);
  float* o = direct ? out.data_ptr<float>() : acc.data();
  if (bits == 8) run<8>(a, M, N, o);
  else run<4>(a, M, N, o);
  if (!direct) out.copy_(at::from_blob(o, sizes, x.options().dtype(at::kFloat)));  // -> bfloat16
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("quant_linear_q8(Tensor x, Tensor data, Tensor scales, Tensor? zeros, int bits, int group_size, Tensor? bias) "
        "-> Tensor", &quant_linear_q8);
  m.def("fake_quantize_q8(Tensor x) -> Tensor", &fake_quantize_q8);
}
#endif  // aarch64 NEON
