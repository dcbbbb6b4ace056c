// 8- and 4-bit affine codes and 4-bit codebook (NF4) codes in a row-interleaved ("tiled") layout, and the AVX-512
// (VNNI) kernels that read it: quant_linear_q8t (int8 activations, integer dot products, affine codes;
// ops/qlinear_q8.py), quant_linear_t (float activations; ops/qlinear.py) and quant_dequantize_t (prefill rows:
// dequantize + GEMM). load_model puts every such layer with whole 16-row tiles in this layout, in place
// (brisk.quant.layers.tile_quantized_layers); the blocked layout of quant_linear.cpp stays for 3/2-bit codes, odd
// row counts and the AVX2 build. With float activations a 4-bit column goes through a 16-entry table (vpermps: the
// codebook, or 0..15 for affine codes), which needs neither a mask nor a conversion: NF4 batch-1 decode 172 -> 374
// tok/s against the blocked kernel; the table instead of AND + convert for affine int4: 120 linears 1.61 -> 1.55 ms.
//
// Why another layout. quant_q8.cpp's blocked layout keeps a weight row's codes together, so a 512-bit dot product
// holds 16 partial sums of ONE row: every row then ends in a horizontal reduction, its group scales must be
// spread over lanes by permutes, and its min term is a loop of its own. That is ~12 vector operations per 128 codes,
// and at batch 1 the kernel ran at ~40 GB/s, its in-cache compute rate, not at the memory's ~60.
// Here lane r of every vector is weight row 16 t + r of a tile of 16 rows, as in the interleaved ("repacked")
// formats of llama.cpp and oneDNN. 4 bits: per 8 input columns a tile stores one 64-byte line, row r's dword holding
// the 8 codes of columns 8 c .. 8 c + 7 as bytes j = q[8 c + j] | q[8 c + 4 + j] << 4 (j = 0..3); one load, two ANDs
// and a shift give the low and high nibbles, and two vpdpbusd against the 4 activation bytes of columns 8 c .. 8 c + 3
// and 8 c + 4 .. 8 c + 7, broadcast, add 8 products into each of the 16 rows' int32 sums. 8 bits: a line per 4
// columns, row r's dword = q[4 c .. 4 c + 3], one vpdpbusd (codes unsigned as they are). Per 32-column activation
// block one conversion and one FMA (by the 16 rows' group scales times the block's activation scale); per group one
// FMA for the min term; the 16 results leave in one store.
// Measured with int8 activations (same process, the default model's 120 int4 g64 decoder linears streamed from
// memory): M = 1 1.44 ms (the blocked kernel: ~1.95), M = 8 2.18 ms (5.17); whole-engine batch-1 decode 329 -> 378
// tok/s, batch 8 574 -> 837. Prefill rows too (M = 128 .. 1024: 2.5-3x the float GEMM path), so with int8
// activations a tiled weight takes this kernel at every row count. Float activations: see tile_f (4 bits) and
// tile16 (8 bits).
//
// Layout (made by brisk.ops.qlinear.set_tiled from the blocked layout; N a multiple of 16):
//   data   [N / 16][K * bits / 32][16][4] uint8   (as the tensor [N, K * bits / 8])
//   scales [N / 16][K / G][16] float16            (as [N, K / G])
//   zeros  [N / 16][K / G][16] uint8              (as [N, K / G]), or none for symmetric codes (zero 2^(bits-1))
// Float-minimum form (GGUF's Q4_1 / Q5_1 / K-quants, loaded as they are: model/gguf_repack.py): `zeros` holds float16
// or float32 MINIMUMS instead of uint8 zero points, w = s q + m, and the min term below takes m_g for -zero_g s_g;
// scales may be float32 where float16 cannot hold them exactly (K-quants' d * sc_j). Float activations also take groups
// of 16 columns (GGUF's Q6_K / Q3_K / Q2_K sub-blocks): 4 lines of 8-bit or 2 of 4-bit codes a group; the int8
// activation kernel keeps groups of 32 or more (its activation scales are per 32 columns).
// Activations, as quant_q8.cpp (and bit for bit brisk.ops.sparse_q8.quantize_activations_q8): per 32 columns
// xs = max|x| / 127, xq = round_half_even(x * 127 / max|x|), here in their natural order; xr_g = sum_{b in g} xs_b *
// sum(xq_b). Result per row n: sum_g s_g (sum_{b in g} xs_b dot(q_b, xq_b)) - sum_g zero_g s_g xr_g (+ bias).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

#define BRISK_INLINE_T inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;       // weight rows per tile (lanes of a 512-bit vector)
constexpr int kMaxRows = 8;         // activation rows per pass over a tile
// Software prefetch 8 KiB ahead (as quant_q8.cpp's avx512 build; 4 and 16 KiB measured no better). The cache level
// depends on the maker of the CPU (BRISK_CPU_AMD: ops/isa.py vendor_cflags). AMD (Zen 5): NON-TEMPORAL, since a
// batch-1 step streams ~87 MB of int4 weights through a 32 MB L3 that cannot keep them to the next step anyway, and
// marking them non-temporal leaves the L3 to what is reused (the KV cache, activations, the engine's own data). Same
// engine, alternated runs of int4 g64 a8 batch-1 decode: T1 -> NTA medians 333.9 -> 350.1 tok/s (best 344.6 ->
// 384.4), again 337.8 -> 352.2 (350.6 -> 389.8); batch 8 1011 -> 1030. Keeping the first 20-60 of a step's 121
// weights temporal (a subset that could stay in L3 across steps) was no better than all non-temporal. Intel (Xeon,
// Sapphire Rapids class): T1 (L2), as the other kernels' avx512 builds; NTA there throttled every kernel of this
// file, in cache as from memory (a 262,144 x 640 int8 head, 2 threads, same process: float activations 12.1 -> 6.9
// ms, int8 activations 16.6 -> 5.6 ms, a plain int64 sum of the same bytes 5.3 ms; 4,096 rows in L2, 1 thread:
// 0.33 -> 0.16 ms).
constexpr int64_t kPrefetchBytes = 8192;
#ifdef BRISK_CPU_AMD
constexpr auto kPrefetchHint = _MM_HINT_NTA;
#else
constexpr auto kPrefetchHint = _MM_HINT_T1;
#endif

BRISK_INLINE_T void prefetch_stream(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, kPrefetchHint);
}

struct TW {
  const uint8_t* data;
  const at::Half* scales;
  const uint8_t* zeros;  // null: symmetric (zero 2^(bits-1)), or float minimums below
  int64_t K, ngroups, bpg, nblocks;  // bpg: 32-column blocks per group (int8 activations: G a multiple of 32)
  float zero;  // symmetric codes' zero point
  int64_t group = 0;  // G; float activations also take G = 16 (GGUF's Q6_K / Q3_K / Q2_K as they are)
  const float* codebook = nullptr;  // 16 float32 values (4-bit codebook codes such as NF4: w = scale * lut[q])
  const float* scales32 = nullptr;  // float32 scales instead of `scales`
  const at::Half* mins16 = nullptr;  // float minimums (w = s q + m) instead of zero points
  const float* mins32 = nullptr;
};

// The 16 rows' scales of group-parameter index i (= (t * ngroups + g) * 16), as float32.
BRISK_INLINE_T __m512 scales16(const TW& p, int64_t i) {
  if (p.scales32) return _mm512_loadu_ps(p.scales32 + i);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scales + i)));
}

// -min of the 16 rows at index i: s * zero (zero points, or the symmetric zero), or the negated float minimum.
BRISK_INLINE_T __m512 neg_mins16(const TW& p, int64_t i, __m512 sv) {
  if (p.mins32) return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(p.mins32 + i));
  if (p.mins16)
    return _mm512_sub_ps(_mm512_setzero_ps(),
                         _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.mins16 + i))));
  const __m512 z = p.zeros ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zeros + i))))
                           : _mm512_set1_ps(p.zero);
  return _mm512_mul_ps(sv, z);
}

struct TX {
  const int8_t* xq;  // [M, K] natural order
  const float* xs;   // [M, nblocks]
  const float* xr;   // [M, ngroups]
  int64_t K, nblocks, ngroups;
};

inline int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tile t against activation rows 0 .. MT-1 of x: out[m * ldo + 16 t + r] for r < 16.
template <int BITS, int MT>
void tile(const TW& p, int64_t t, const TX& x, const float* bias, float* out, int64_t ldo) {
  const uint8_t* w = p.data + t * kTile * (p.K * BITS / 8);
  const int64_t pi = t * kTile * p.ngroups;  // the tile's first group-parameter index
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 tot[MT];
  for (int m = 0; m < MT; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    const __m512 sv = scales16(p, pi + g * kTile);
    for (int64_t b = g * p.bpg; b < (g + 1) * p.bpg; ++b) {
      // MT = 1: two chains (low and high nibbles; even and odd lines) instead of 8 dependent vpdpbusd a block
      constexpr int NA = MT == 1 ? 2 : 1;
      __m512i acc[NA][MT];
      for (int a = 0; a < NA; ++a)
        for (int m = 0; m < MT; ++m) acc[a][m] = _mm512_setzero_si512();
      if constexpr (BITS == 4) {
        for (int c = 0; c < 4; ++c) {
          const uint8_t* wc = w + (b * 4 + c) * 64;
          prefetch_stream(wc);
          const __m512i d = _mm512_loadu_si512(wc);
          const __m512i lo = _mm512_and_si512(d, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(d, 4), low);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xm = x.xq + m * x.K + b * kBlock + c * 8;
            acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], lo, _mm512_set1_epi32(dword(xm)));
            acc[NA - 1][m] = _mm512_dpbusd_epi32(acc[NA - 1][m], hi, _mm512_set1_epi32(dword(xm + 4)));
          }
        }
      } else {  // 8 bits: a line per 4 columns, the codes as they are (vpdpbusd takes them unsigned)
        for (int c = 0; c < 8; ++c) {
          const uint8_t* wc = w + (b * 8 + c) * 64;
          prefetch_stream(wc);
          const __m512i d = _mm512_loadu_si512(wc);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xm = x.xq + m * x.K + b * kBlock + c * 4;
            acc[c % NA][m] = _mm512_dpbusd_epi32(acc[c % NA][m], d, _mm512_set1_epi32(dword(xm)));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        __m512i a = acc[0][m];
        if constexpr (NA == 2) a = _mm512_add_epi32(a, acc[1][m]);
        const __m512 s = _mm512_mul_ps(sv, _mm512_set1_ps(x.xs[m * x.nblocks + b]));
        tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, tot[m]);
      }
    }
    const __m512 mn = neg_mins16(p, pi + g * kTile, sv);  // -min_g of the 16 rows
    for (int m = 0; m < MT; ++m) tot[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x.xr[m * x.ngroups + g]), tot[m]);
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + t * kTile, _mm512_add_ps(tot[m], bv));
}

inline TX rows_from(const TX& x, int64_t m) {
  return TX{x.xq + m * x.K, x.xs + m * x.nblocks, x.xr + m * x.ngroups, x.K, x.nblocks, x.ngroups};
}

// Tiles t0 .. t1-1 against all M activation rows: per tile, every group of up to kMaxRows rows (the tile's codes
// stay in L1 meanwhile), as f(t, first row, std::integral_constant<int, rows>).
template <typename F>
void each_tile_rows(int64_t M, int64_t t0, int64_t t1, F&& f) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + kMaxRows <= M; m += kMaxRows) f(t, m, std::integral_constant<int, kMaxRows>{});
    if (m < M)
      brisk_simd::with_rows(M - m, [&](auto mt) {
        if constexpr (decltype(mt)::value < kMaxRows) f(t, m, mt);
      });
  }
}

template <int BITS>
void run(const TW& p, const TX& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out, int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int64_t m, auto mt) {
    tile<BITS, decltype(mt)::value>(p, t, rows_from(x, m), bias, out + m * ldo, ldo);
  });
}

// x [M, K] -> xq [M, K] int8 (natural order), xs [M, K / 32], xr [M, K / G]: quant_q8.cpp's quantize_x without its
// permutation (the same float32 operations, so the same numbers).
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// One 32-column block at src rounded to integers in [-qmax, qmax] (127: int8, 32767: int16): q = round_half_even(x *
// qmax / max|x|) as two vectors of 16 int32; returns the block's scale max|x| / qmax. Both activation quantizers
// use it, so their float32 operations are the same.
template <typename T>
BRISK_INLINE_T float round_block32(const T* src, float qmax, __m512i& q0, __m512i& q1) {
  const __m512 f0 = load16(src), f1 = load16(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  q0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, inv));  // round half to even
  q1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, inv));
  return amax / qmax;
}

template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xr) {
  const int64_t nblocks = K / kBlock, ngroups = K / G, bpg = G / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      float gsum = 0.f;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        __m512i q0, q1;
        const float scale = round_block32(x + m * K + j * kBlock, 127.f, q0, q1);
        xs[m * nblocks + j] = scale;
        gsum += scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
        int8_t* dst = xq + m * K + j * kBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
      }
      xr[m * ngroups + g] = gsum;
    }
  }
}

// ---- 4-bit codes, float activations (quant_linear_t): the same tiles, each code widened to float32 ----
// Column j of a line is nibble j (low nibbles of bytes 0..3, then their high nibbles) of every row's dword: a shift
// and a 16-entry table lookup (see column) give the 16 rows' codes of that column as floats, and one FMA per
// activation row (x[col] broadcast) adds them into the group's sums; per group one FMA by the scales and one for
// the min term (-zero * scale times the group's sum of x). w = s (q - z), so sum_k w_k x_k = s sum_k q_k x_k - s z
// sum_k x_k, exact in the reals; float32 rounding differs from quant_linear_small's only in the order of sums.
// (8-bit codes take tile16 below: x rounded to 16-bit integers, integer dot products.)

struct FX {
  const float* x;   // [M, K] float32
  const float* xg;  // [M, ngroups]: sum of x over each group
  int64_t K, ngroups;
};

// Through a table (the codebook, or 0..15 for affine codes): vpermps reads the low 4 bits of each lane, so neither a
// mask nor a conversion is needed.
BRISK_INLINE_T __m512 column(__m512i d, int j, __m512 lut) {
  const int shift = j < 4 ? 8 * j : 8 * (j - 4) + 4;
  return _mm512_permutexvar_ps(j == 0 ? d : _mm512_srli_epi32(d, shift), lut);
}

template <int BITS, bool LUT, int MT>
void tile_f(const TW& p, int64_t t, const FX& x, const float* bias, float* out, int64_t ldo) {
  static_assert(BITS == 4, "8-bit codes take tile16");
  constexpr int kCols = 32 / BITS;  // columns per 64-byte line
  constexpr int NA = MT == 1 ? 4 : MT == 2 ? 2 : 1;  // independent FMA chains per activation row
  const uint8_t* w = p.data + t * kTile * (p.K * BITS / 8);
  const int64_t pi = t * kTile * p.ngroups;  // the tile's first group-parameter index
  const int64_t group = p.group, lines = group / kCols;  // G = 16: 2 lines a group
  const __m512 lut = LUT ? _mm512_loadu_ps(p.codebook)
                         : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // 4-bit codes as floats
  __m512 tot[MT];
  for (int m = 0; m < MT; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    const __m512 sv = scales16(p, pi + g * kTile);
    __m512 acc[NA][MT];
    for (int a = 0; a < NA; ++a)
      for (int m = 0; m < MT; ++m) acc[a][m] = _mm512_setzero_ps();
    for (int64_t l = 0; l < lines; ++l) {
      const uint8_t* wl = w + (g * lines + l) * 64;
      prefetch_stream(wl);
      const __m512i d = _mm512_loadu_si512(wl);
      const int64_t c0 = g * group + l * kCols;  // the line's first column
      for (int j = 0; j < kCols; ++j) {
        const __m512 v = column(d, j, lut);
        for (int m = 0; m < MT; ++m)
          acc[j % NA][m] = _mm512_fmadd_ps(v, _mm512_set1_ps(x.x[m * x.K + c0 + j]), acc[j % NA][m]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      __m512 a = acc[0][m];
      for (int k = 1; k < NA; ++k) a = _mm512_add_ps(a, acc[k][m]);
      tot[m] = _mm512_fmadd_ps(a, sv, tot[m]);
    }
    if constexpr (!LUT) {  // affine codes: + min (= - scale * zero) * (the group's sum of x)
      const __m512 mn = neg_mins16(p, pi + g * kTile, sv);
      for (int m = 0; m < MT; ++m) tot[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x.xg[m * x.ngroups + g]), tot[m]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + t * kTile, _mm512_add_ps(tot[m], bv));
}

template <int BITS, bool LUT>
void run_f(const TW& p, const FX& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out, int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int64_t m, auto mt) {
    const FX rows{x.x + m * x.K, x.xg + m * x.ngroups, x.K, x.ngroups};
    tile_f<BITS, LUT, decltype(mt)::value>(p, t, rows, bias, out + m * ldo, ldo);
  });
}

// ---- 8-bit codes, float activations (quant_linear_t): x as 16-bit integers per 32 columns ----
// Widening each 8-bit code to float32 costs three vector operations per column on top of one FMA per activation row
// (tile_f), 44 operations per 64-byte line at 8 rows: batched decode of 8-bit models was compute-bound (the 1B shape's
// Q8_0 file at batch 8 read ~7 of the ~22 GB/s here). Instead x is rounded ONCE per call to int16 per 32 columns (xs =
// max|x| / 32767, xq = round_half_even(x * 32767 / max|x|): brisk.ops.qlinear.round_activations_16) and vpdpwssd
// multiplies pairs of codes, zero-extended to 16 bits by one AND or one shift per line, with pairs of activations: 2
// decode operations and 2 dot products per activation row per line. A 32-column block's (16-column group's) sum
// sum_k (u_k - z) xq_k is exact in int32 (|.| <= 32 * 255 * 32767 < 2^31): the zero point comes off in integers, z
// times the block's sum of xq, so no large float terms cancel; then one conversion and one FMA by s_g * xs_b per
// activation row. Float minimums (GGUF's Q4_1 / K-quants as they are: w = s u + m) add m_g times the group's sum of
// the rounded activations instead. x's rounding error is <= max|x_b| / 65534 per element (1/256 of int8
// activations', below bfloat16's 2^-9 relative), ~2e-5 of an output's scale; a row's integer sums, and so its
// result, do not depend on the rows it shares a call with.
// Pairs: a line's dword for row r holds codes u0..u3 of columns 4c..4c+3; AND 0x00FF00FF gives the 16-bit pair
// (u0, u2), a right shift by 8 of each 16-bit word (u1, u3). xq stores each 4 columns as x0, x2, x1, x3 to match.

struct TX16 {
  const int16_t* xq;   // [M, K], each 4 columns in the order 0, 2, 1, 3
  const float* xs;     // [M, K / 32]
  const int32_t* xi;   // [M, K / 16]: sum of xq over each 16 columns
  const float* xr;     // [M, ngroups]: sum of the rounded activations of each group (float-minimum codes)
  int64_t K, nblocks, ngroups;
};

template <typename T>
void quantize_x16(const T* x, int64_t M, int64_t K, int64_t G, int16_t* xq, float* xs, int32_t* xi, float* xr) {
  const int64_t nblocks = K / kBlock, ngroups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    float* xrm = xr + m * ngroups;
    for (int64_t g = 0; g < ngroups; ++g) xrm[g] = 0.f;
    for (int64_t b = 0; b < nblocks; ++b) {
      __m512i q0, q1;
      const float scale = round_block32(x + m * K + b * kBlock, 32767.f, q0, q1);
      xs[m * nblocks + b] = scale;
      int16_t* dst = xq + m * K + b * kBlock;
      // words 0, 2, 1, 3 of every 4: one shuffle of each 64-bit quarter's words
      const __m256i w0 = _mm512_cvtsepi32_epi16(q0), w1 = _mm512_cvtsepi32_epi16(q1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(w0, 0xD8), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(w1, 0xD8), 0xD8));
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      xi[m * (K / 16) + 2 * b] = s0;
      xi[m * (K / 16) + 2 * b + 1] = s1;
      if (G == 16) {
        xrm[2 * b] = scale * static_cast<float>(s0);
        xrm[2 * b + 1] = scale * static_cast<float>(s1);
      } else {
        xrm[b * kBlock / G] += scale * static_cast<float>(s0 + s1);
      }
    }
  }
}

inline int32_t dword16(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int MT>
void tile16(const TW& p, int64_t t, const TX16& x, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT == 1 ? 4 : MT == 2 ? 2 : 1;  // independent vpdpwssd chains per activation row
  const uint8_t* w = p.data + t * kTile * p.K;
  const int64_t pi = t * kTile * p.ngroups;
  const int64_t seg = std::min<int64_t>(p.group, kBlock), lines = seg / 4, segs = p.group / seg;
  const bool float_mins = p.mins16 || p.mins32;
  const __m512i low = _mm512_set1_epi32(0x00FF00FF);
  __m512i zv = _mm512_set1_epi32(static_cast<int32_t>(p.zero));  // the 16 rows' zero points
  __m512 tot[MT];
  for (int m = 0; m < MT; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    const __m512 sv = scales16(p, pi + g * kTile);
    if (p.zeros) zv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zeros + pi + g * kTile)));
    for (int64_t s = 0; s < segs; ++s) {
      const int64_t c0 = g * p.group + s * seg;  // the segment's first column
      __m512i acc[NA][MT];
      for (int a = 0; a < NA; ++a)
        for (int m = 0; m < MT; ++m) acc[a][m] = _mm512_setzero_si512();
      for (int64_t l = 0; l < lines; ++l) {
        const uint8_t* wl = w + (c0 / 4 + l) * 64;
        prefetch_stream(wl);
        const __m512i d = _mm512_loadu_si512(wl);
        const __m512i lo = _mm512_and_si512(d, low), hi = _mm512_srli_epi16(d, 8);
        for (int m = 0; m < MT; ++m) {
          const int16_t* xm = x.xq + m * x.K + c0 + 4 * l;
          __m512i& a = acc[l % NA][m];
          a = _mm512_dpwssd_epi32(a, lo, _mm512_set1_epi32(dword16(xm)));
          a = _mm512_dpwssd_epi32(a, hi, _mm512_set1_epi32(dword16(xm + 2)));
        }
      }
      const int64_t b = c0 / kBlock;
      for (int m = 0; m < MT; ++m) {
        __m512i a = acc[0][m];
        for (int k = 1; k < NA; ++k) a = _mm512_add_epi32(a, acc[k][m]);
        if (!float_mins) {  // - z * (the segment's sum of xq), in integers
          const int32_t* xim = x.xi + m * (x.K / 16) + c0 / 16;
          const int32_t sum = seg == kBlock ? xim[0] + xim[1] : xim[0];
          a = _mm512_sub_epi32(a, _mm512_mullo_epi32(zv, _mm512_set1_epi32(sum)));
        }
        const __m512 sc = _mm512_mul_ps(sv, _mm512_set1_ps(x.xs[m * x.nblocks + b]));
        tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sc, tot[m]);
      }
    }
    if (float_mins) {  // + m_g * (the group's sum of the rounded x)
      const __m512 mn = neg_mins16(p, pi + g * kTile, sv);
      for (int m = 0; m < MT; ++m) tot[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(x.xr[m * x.ngroups + g]), tot[m]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo + t * kTile, _mm512_add_ps(tot[m], bv));
}

void run16(const TW& p, const TX16& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out,
           int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int64_t m, auto mt) {
    const TX16 rows{x.xq + m * x.K, x.xs + m * x.nblocks, x.xi + m * (x.K / 16), x.xr + m * x.ngroups,
                    x.K, x.nblocks, x.ngroups};
    tile16<decltype(mt)::value>(p, t, rows, bias, out + m * ldo, ldo);
  });
}

}  // namespace

namespace {

// A calling thread's scratch of at least `words` floats, kept across calls: a scratch tensor per call cost ~0.45 us
// (one layer's four int4 linears at batch 1 in cache, same process: 32.1 -> 30.3 us with int8 activations, 54.8 ->
// 53.1 with float ones), ~55 us over the 121 linears of a step. Past 1 Mi floats (prefill rows) a tensor held by
// `big` serves, so that no thread keeps a prefill's scratch for good.
float* scratch(int64_t words, at::Tensor& big) {
  constexpr int64_t kKeep = int64_t{1} << 20;
  if (words > kKeep) {
    big = at::empty({words}, at::TensorOptions().dtype(at::kFloat));
    return big.data_ptr<float>();
  }
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < words) buffer.resize(words);
  return buffer.data();
}

// The group parameters, checked, into p: scales float16 or float32 [N, K / G]; zeros absent (symmetric), uint8 zero
// points, or float16 / float32 minimums (w = s q + m), shaped like scales.
void group_params(const char* name, TW& p, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                  int64_t N, int64_t ngroups) {
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == N && scales.size(1) == ngroups,
              name, ": scales must be float16 or float32 [N, K / G]");
  p.scales = nullptr;
  p.scales32 = nullptr;
  if (scales.scalar_type() == at::kHalf) p.scales = scales.data_ptr<at::Half>();
  else p.scales32 = scales.data_ptr<float>();
  p.zeros = nullptr;
  p.mins16 = nullptr;
  p.mins32 = nullptr;
  if (!zeros.has_value() || !zeros->defined()) return;
  const auto zt = zeros->scalar_type();
  TORCH_CHECK((zt == at::kByte || zt == at::kHalf || zt == at::kFloat) && zeros->is_contiguous() &&
                  zeros->sizes() == scales.sizes(),
              name, ": zeros must be uint8 zero points or float16 / float32 minimums, shaped like scales");
  if (zt == at::kByte) p.zeros = zeros->data_ptr<uint8_t>();
  else if (zt == at::kHalf) p.mins16 = zeros->data_ptr<at::Half>();
  else p.mins32 = zeros->data_ptr<float>();
}

bool has_zero_terms(const TW& p) { return p.zeros || p.mins16 || p.mins32; }

// The arguments both ops take, checked: the weight as the kernels read it, the bias as float32, the output.
struct Call {
  TW p;
  at::Tensor bias, out, x;  // bias as float32 (or undefined), out [..., N] in x's dtype, x contiguous
  int64_t M, N, K, ngroups, grain;
  std::vector<int64_t> sizes;
};

Call prepare(const char* name, const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
             const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
             const std::optional<at::Tensor>& bias, bool groups_of_16) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              ": x must be float32 or bfloat16 [..., K]");
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4 or 8");
  const int64_t K = x.size(-1);
  if (groups_of_16 && group_size == 16) {
    TORCH_CHECK(K > 0 && K % kBlock == 0, name, ": K must be a multiple of 32");
  } else {
    TORCH_CHECK(K > 0 && K % kBlock == 0 && group_size > 0 && group_size % kBlock == 0 && K % group_size == 0, name,
                ": K and group_size must be multiples of 32 (float activations: or group_size 16), and group_size "
                "must divide K");
  }
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous() &&
                  data.size(1) == K * bits / 8 && data.size(0) % kTile == 0,
              name, ": data must be a contiguous uint8 [N, K * bits / 8] tensor with N a multiple of 16");
  const int64_t N = data.size(0), ngroups = K / group_size;
  Call c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                name, ": bias must be a float32 or bfloat16 [N] tensor");
    c.bias = bias->to(at::kFloat).contiguous();
  }
  c.p = TW{data.data_ptr<uint8_t>(), nullptr, nullptr, K, ngroups, group_size / kBlock, K / kBlock,
           static_cast<float>(int64_t{1} << (bits - 1))};
  c.p.group = group_size;
  group_params(name, c.p, scales, zeros, N, ngroups);
  c.M = x.numel() / K;
  c.N = N;
  c.K = K;
  c.ngroups = ngroups;
  c.sizes = x.sizes().vec();
  c.sizes.back() = N;
  c.out = at::empty(c.sizes, x.options());
  c.x = x.contiguous();
  // tiles per task such that a task streams >= ~32 KiB of codes
  c.grain = std::max<int64_t>(1, (32 * 1024) / (kTile * K * bits / 8));
  return c;
}

// The codebook's values, or null when none is given (affine codes); checked: 16 float32 values, 4-bit codes, no
// zero points.
const float* codebook_of(const char* name, const std::optional<at::Tensor>& codebook, int64_t bits, bool zeros) {
  if (!codebook.has_value() || !codebook->defined()) return nullptr;
  TORCH_CHECK(bits == 4 && codebook->scalar_type() == at::kFloat && codebook->numel() == 16 &&
                  codebook->is_contiguous(),
              name, ": a codebook is 16 float32 values, for 4-bit codes");
  TORCH_CHECK(!zeros, name, ": codebook codes take no zero points");
  return codebook->data_ptr<float>();
}

}  // namespace

// x: [..., K] float32 or bfloat16 (K a multiple of 32); data: uint8 [N, K * bits / 8] in the tiled layout above (N a
// multiple of 16); scales: float16 [N, K / G] tiled; zeros: uint8 [N, K / G] tiled, or absent (symmetric); bias:
// float32 / bfloat16 [N] or absent. Returns [..., N] in x's dtype. x is rounded to int8 per 32 columns.
at::Tensor quant_linear_q8t(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                            const std::optional<at::Tensor>& bias) {
  Call c = prepare("quant_linear_q8t", x, data, scales, zeros, bits, group_size, bias, false);
  const int64_t M = c.M, N = c.N, K = c.K, ngroups = c.ngroups, nblocks = K / kBlock;
  if (M == 0 || N == 0) return c.out;
  const bool direct = x.scalar_type() == at::kFloat;
  // scratch (float32 words): xs [M, nblocks], xr [M, ngroups], the float32 result unless written in place, xq
  const int64_t words = M * (nblocks + ngroups + (direct ? 0 : N) + K / 4);
  at::Tensor big;
  float* xs = scratch(words, big);
  float* xr = xs + M * nblocks;
  float* acc = direct ? c.out.data_ptr<float>() : xr + M * ngroups;
  int8_t* xq = reinterpret_cast<int8_t*>(xr + M * ngroups + (direct ? 0 : M * N));
  if (direct) quantize_x(c.x.data_ptr<float>(), M, K, group_size, xq, xs, xr);
  else quantize_x(c.x.data_ptr<at::BFloat16>(), M, K, group_size, xq, xs, xr);
  const TX xa{xq, xs, xr, K, nblocks, ngroups};
  const float* b = c.bias.defined() ? c.bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, N / kTile, c.grain, [&](int64_t t0, int64_t t1) {
    if (bits == 4) run<4>(c.p, xa, M, t0, t1, b, acc, N);
    else run<8>(c.p, xa, M, t0, t1, b, acc, N);
  });
  if (!direct) c.out.copy_(at::from_blob(acc, c.sizes, x.options().dtype(at::kFloat)));
  return c.out;
}

// The same arguments, x as it is (float32 arithmetic on the codes widened to float32): few rows (decode).
at::Tensor quant_linear_t(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& codebook,
                          int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias) {
  Call c = prepare("quant_linear_t", x, data, scales, zeros, bits, group_size, bias, true);
  c.p.codebook = codebook_of("quant_linear_t", codebook, bits, has_zero_terms(c.p));
  const bool lut = c.p.codebook != nullptr;
  const int64_t M = c.M, N = c.N, K = c.K, ngroups = c.ngroups;
  if (M == 0 || N == 0) return c.out;
  const bool direct = x.scalar_type() == at::kFloat;
  const float* b = c.bias.defined() ? c.bias.data_ptr<float>() : nullptr;
  if (bits == 8 && !lut) {  // x as 16-bit integers (tile16)
    // scratch (32-bit words): xs [M, K / 32], xr [M, ngroups], xi [M, K / 16], the float32 result unless in place,
    // xq (int16)
    const int64_t nblocks = K / kBlock;
    at::Tensor big;
    float* xs = scratch(M * (nblocks + ngroups + K / 16 + (direct ? 0 : N) + K / 2), big);
    float* xr = xs + M * nblocks;
    int32_t* xi = reinterpret_cast<int32_t*>(xr + M * ngroups);
    float* acc = direct ? c.out.data_ptr<float>() : xr + M * (ngroups + K / 16);
    int16_t* xq = reinterpret_cast<int16_t*>(xr + M * (ngroups + K / 16) + (direct ? 0 : M * N));
    if (direct) quantize_x16(c.x.data_ptr<float>(), M, K, group_size, xq, xs, xi, xr);
    else quantize_x16(c.x.data_ptr<at::BFloat16>(), M, K, group_size, xq, xs, xi, xr);
    const TX16 xa{xq, xs, xi, xr, K, nblocks, ngroups};
    at::parallel_for(0, N / kTile, c.grain, [&](int64_t t0, int64_t t1) { run16(c.p, xa, M, t0, t1, b, acc, N); });
    if (!direct) c.out.copy_(at::from_blob(acc, c.sizes, x.options().dtype(at::kFloat)));
    return c.out;
  }
  // scratch (float32 words): xg [M, ngroups], x as float32 [M, K] unless it is, the float32 result unless in place
  at::Tensor big;
  float* xg = scratch(M * (ngroups + (direct ? 0 : K + N)), big);
  const float* xf = direct ? c.x.data_ptr<float>() : xg + M * ngroups;
  float* acc = direct ? c.out.data_ptr<float>() : xg + M * (ngroups + K);
  if (!direct) {
    const at::BFloat16* src = c.x.data_ptr<at::BFloat16>();
    float* dst = xg + M * ngroups;
    for (int64_t i = 0; i < M * K; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));  // K % 32 == 0
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ngroups; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        s = _mm512_add_ps(s, _mm512_loadu_ps(xf + m * K + k));
      xg[m * ngroups + g] = _mm512_reduce_add_ps(s);
    }
  const FX xa{xf, xg, K, ngroups};
  at::parallel_for(0, N / kTile, c.grain, [&](int64_t t0, int64_t t1) {
    if (lut) run_f<4, true>(c.p, xa, M, t0, t1, b, acc, N);
    else run_f<4, false>(c.p, xa, M, t0, t1, b, acc, N);
  });
  if (!direct) c.out.copy_(at::from_blob(acc, c.sizes, x.options().dtype(at::kFloat)));
  return c.out;
}

// Rows [16 t0, 16 t1) of a tiled weight as float32 [16 (t1 - t0), K]: w = scale * (q - zero), for the GEMM path of
// many activation rows (prefill), a chunk of rows at a time.
at::Tensor quant_dequantize_t(const at::Tensor& data, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                              const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                              int64_t in_features, int64_t t0, int64_t t1) {
  const int64_t K = in_features;
  TORCH_CHECK(bits == 4 || bits == 8, "quant_dequantize_t: bits must be 4 or 8");
  TORCH_CHECK(K > 0 && K % kBlock == 0 && (group_size == 16 || (group_size > 0 && group_size % kBlock == 0)) &&
                  K % group_size == 0,
              "quant_dequantize_t: K must be a multiple of 32 and group_size 16 or a multiple of 32 that divides K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous() &&
                  data.size(1) == K * bits / 8 && data.size(0) % kTile == 0,
              "quant_dequantize_t: data must be a contiguous uint8 [N, K * bits / 8] tensor with N a multiple of 16");
  const int64_t N = data.size(0), ngroups = K / group_size;
  TW p{};
  p.zero = static_cast<float>(int64_t{1} << (bits - 1));
  group_params("quant_dequantize_t", p, scales, zeros, N, ngroups);
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= N / kTile, "quant_dequantize_t: tiles [", t0, ", ", t1, ") out of [0, ",
              N / kTile, ")");
  auto out = at::empty({(t1 - t0) * kTile, K}, scales.options().dtype(at::kFloat));
  const uint8_t* d = data.data_ptr<uint8_t>();
  const float* lut_values = codebook_of("quant_dequantize_t", codebook, bits, has_zero_terms(p));
  const bool lut = lut_values != nullptr;
  const __m512 table = lut ? _mm512_loadu_ps(lut_values) : _mm512_setzero_ps();
  const int64_t tile_bytes = kTile * K * bits / 8;
  float* o = out.data_ptr<float>();
  // per 16 columns of a tile: four vectors X0..X3 of bytes (8 bits: four lines; 4 bits: the low and high nibbles of
  // two), whose 4 x 4 dword transposes (per 128-bit lane) give each row its 16 codes in column order; each row's 16
  // codes then widen to float32 and take w = q * s + m (m = -s * z: exact, as the reference's form)
  at::parallel_for(t0, t1, 1, [&](int64_t a, int64_t b) {
    alignas(64) float sv[kTile], mv[kTile];
    for (int64_t t = a; t < b; ++t) {
      float* rows = o + (t - t0) * kTile * K;
      const uint8_t* tile = d + t * tile_bytes;
      for (int64_t c0 = 0; c0 < K; c0 += 16) {
        if (c0 % group_size == 0) {  // a new group: its 16 rows' scales and mins
          const int64_t g = c0 / group_size;
          const __m512 s = scales16(p, (t * ngroups + g) * kTile);
          _mm512_store_ps(sv, s);
          _mm512_store_ps(mv, lut ? _mm512_setzero_ps() : _mm512_sub_ps(_mm512_setzero_ps(), neg_mins16(p, (t * ngroups + g) * kTile, s)));
        }
        __m512i x[4];
        if (bits == 8) {
          for (int i = 0; i < 4; ++i) x[i] = _mm512_loadu_si512(tile + (c0 / 4 + i) * 64);
        } else {
          const __m512i low = _mm512_set1_epi8(0x0F);
          for (int i = 0; i < 2; ++i) {
            const __m512i l = _mm512_loadu_si512(tile + (c0 / 8 + i) * 64);
            x[2 * i] = _mm512_and_si512(l, low);
            x[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(l, 4), low);
          }
        }
        const __m512i p0 = _mm512_unpacklo_epi32(x[0], x[1]), p1 = _mm512_unpackhi_epi32(x[0], x[1]);
        const __m512i p2 = _mm512_unpacklo_epi32(x[2], x[3]), p3 = _mm512_unpackhi_epi32(x[2], x[3]);
        const __m512i r4[4] = {_mm512_unpacklo_epi64(p0, p2), _mm512_unpackhi_epi64(p0, p2),
                               _mm512_unpacklo_epi64(p1, p3), _mm512_unpackhi_epi64(p1, p3)};
        for (int i = 0; i < 4; ++i) {    // r4[i], lane k: row 4 k + i
          for (int k = 0; k < 4; ++k) {
            const int r = 4 * k + i;
            const __m128i q = k == 0 ? _mm512_castsi512_si128(r4[i]) : k == 1 ? _mm512_extracti32x4_epi32(r4[i], 1)
                              : k == 2 ? _mm512_extracti32x4_epi32(r4[i], 2) : _mm512_extracti32x4_epi32(r4[i], 3);
            const __m512i qi = _mm512_cvtepu8_epi32(q);
            const __m512 w = lut ? _mm512_mul_ps(_mm512_permutexvar_ps(qi, table), _mm512_set1_ps(sv[r]))
                                 : _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(sv[r]), _mm512_set1_ps(mv[r]));
            _mm512_storeu_ps(rows + r * K + c0, w);
          }
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("quant_linear_q8t(Tensor x, Tensor data, Tensor scales, Tensor? zeros, int bits, int group_size, "
        "Tensor? bias) -> Tensor", &quant_linear_q8t);
  m.def("quant_linear_t(Tensor x, Tensor data, Tensor scales, Tensor? zeros, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias) -> Tensor", &quant_linear_t);
  m.def("quant_dequantize_t(Tensor data, Tensor scales, Tensor? zeros, Tensor? codebook, int bits, int group_size, "
        "int in_features, int t0, int t1) -> Tensor", &quant_dequantize_t);
}

#endif  // AVX-512 VNNI
