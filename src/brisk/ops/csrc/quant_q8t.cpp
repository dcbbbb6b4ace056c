// 8- and 4-bit affine codes and 4-bit codebook (NF4) codes in a row-interleaved ("tiled") layout, and the AVX-512
// (VNNI) and AVX2 kernels that read it: quant_linear_q8t (int8 activations, integer dot products, affine codes;
// ops/qlinear_q8.py), quant_linear_t (float activations; ops/qlinear.py) and quant_dequantize_t (prefill rows:
// dequantize + GEMM). load_model puts every such layer with whole 16-row tiles in this layout, in place
// (brisk.quant.layers.tile_quantized_layers), on every tier that builds this file; the blocked layout of
// quant_linear.cpp stays for 3/2-bit codes and odd row counts. With float activations a 4-bit column goes through a
// 16-entry table (vpermps: the codebook, or 0..15 for affine codes), which needs neither a mask nor a conversion:
// NF4 batch-1 decode 172 -> 374 tok/s against the blocked kernel; the table instead of AND + convert for affine
// int4: 120 linears 1.61 -> 1.55 ms (AVX-512; on AVX2 a 16-entry table takes two vpermps and a blend, so there
// affine codes take AND + convert and only codebook codes the table).
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
// The AVX2 build (avx2 and avx2vnni tiers: Intel client chips since Alder Lake, AMD Zen 1-3) reads the same layout
// with a tile as two 256-bit vectors (rows 0..7 in bytes 0..31 of every line, rows 8..15 in bytes 32..63), the same
// sums lane by lane: int8 activations give the AVX-512 kernel's results bit for bit, float ones too at the same row
// split. Int8 dot products: vpdpbusd (VEX) with AVX-VNNI, else vpmaddubsw + vpmaddwd (see its tile for the int16
// ranges). Xeon (AVX-512 + AMX) forced to the avx2 tier, 1 thread, the default model's shapes, 30 layers' weights
// cycled, best of 21 on a shared machine (us per call, blocked kernels of quant_linear.cpp / quant_q8.cpp -> these):
// int4 g64 int8 activations M = 1: 576 x 576 16.5 -> 11.7, 960 x 576 25.4 -> 17.7, 3072 x 576 68.2 -> 49.2, 576 x
// 1536 29.2 -> 26.9; M = 8: 71.5 -> 47.9, 118 -> 76.5, 609 -> 530, 238 -> 251. Float activations M = 1 level (24.1
// -> 24.2 .. 130 -> 116), M = 8 1.2-1.3x; 8-bit codes (per channel) with float ones 1.3-1.8x at M = 1, with int8
// ones 0.84-0.92x at M = 1 (the nibble split costs more than quant_q8.cpp's sign trick) and level at M = 8. Prefill
// rows: ops/qlinear.py MAX_TILED_M_AVX2, ops/qlinear_q8.py max_tiled_q8_rows.
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)


#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define BRISK_Q8T_ZMM 1  // the AVX-512 kernels; otherwise the AVX2 ones (AVX-VNNI dot products where built)
#endif

namespace {

#define BRISK_INLINE_T inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;       // weight rows per tile (lanes of a 512-bit vector)
#ifdef BRISK_Q8T_ZMM
constexpr int kMaxRows = 8;         // activation rows per pass over a tile
#else
constexpr int kMaxRows = 4;         // activation rows per pass over half a tile (16 ymm registers)
#endif
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

#ifdef BRISK_Q8T_ZMM

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

#else  // AVX2: a tile's 16 rows are two 256-bit vectors, rows 0..7 (bytes 0..31 of every line) and rows 8..15

// The 8 rows' scales at group-parameter index i (the tile's, + 8 for its second half), as float32.
BRISK_INLINE_T __m256 scales8(const TW& p, int64_t i) {
  if (p.scales32) return _mm256_loadu_ps(p.scales32 + i);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + i)));
}

// -min of the 8 rows at index i, as neg_mins16.
BRISK_INLINE_T __m256 neg_mins8(const TW& p, int64_t i, __m256 sv) {
  if (p.mins32) return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(p.mins32 + i));
  if (p.mins16)
    return _mm256_sub_ps(_mm256_setzero_ps(),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mins16 + i))));
  const __m256 z = p.zeros ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.zeros + i))))
                           : _mm256_set1_ps(p.zero);
  return _mm256_mul_ps(sv, z);
}

BRISK_INLINE_T int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

#endif

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

#ifdef BRISK_Q8T_ZMM

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

#else  // AVX2

// Rows 8 h0 .. 8 (h0 + H) - 1 of tile t (H = 2: the whole tile, H = 1: one half of it) against activation rows
// 0 .. MT-1 of x: out[m * ldo + 16 t + 8 h0 + r] for r < 8 H. The same sums as the AVX-512 kernel, lane by lane.
// Int8 dot products: with AVX-VNNI vpdpbusd (VEX, 256 bits), as above. Without it vpmaddubsw (u8 x s8, each pair of
// products summed into a SATURATING int16) + vpmaddwd by ones (-> int32). A pair of 4-bit codes reaches 2 * 15 * 127
// = 3810, so the low + high nibbles of a block's 4 lines sum to <= 30480 in int16, exactly, and one vpmaddwd a block
// widens them. 8-bit codes (pairs up to 2 * 255 * 127 = 64770 would saturate) are split into nibbles the same way,
// q = 16 hi + lo: each nibble's sums over the block's 8 lines reach <= 30480, and vpmaddwd by 16 and by 1 recombines
// them in int32. The int32 sums are vpdpbusd's, so the results are the AVX-512 kernel's, bit for bit.
template <int BITS, int MT, int H>
void tile(const TW& p, int64_t t, int h0, const TX& x, const float* bias, float* out, int64_t ldo) {
  constexpr int kLines = BITS == 4 ? 4 : 8;  // 64-byte lines per 32-column block
  const uint8_t* w = p.data + t * kTile * (p.K * BITS / 8) + h0 * 32;
  const int64_t pi = t * kTile * p.ngroups + h0 * 8;  // the first group-parameter index of these rows
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 tot[H][MT];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MT; ++m) tot[h][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    __m256 sv[H];
    for (int h = 0; h < H; ++h) sv[h] = scales8(p, pi + g * kTile + 8 * h);
    for (int64_t b = g * p.bpg; b < (g + 1) * p.bpg; ++b) {
      const int8_t* xb = x.xq + b * kBlock;
      __m256i a[H][MT];
#ifdef __AVXVNNI__
      constexpr int NA = MT == 1 ? 2 : 1;  // MT = 1: two chains, as above
      __m256i acc[NA][H][MT];
      for (int k = 0; k < NA; ++k)
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < MT; ++m) acc[k][h][m] = _mm256_setzero_si256();
      for (int c = 0; c < kLines; ++c) {
        const uint8_t* wc = w + (b * kLines + c) * 64;
        prefetch_stream(wc);
        for (int h = 0; h < H; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * h));
          if constexpr (BITS == 4) {
            const __m256i lo = _mm256_and_si256(d, low), hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), low);
            for (int m = 0; m < MT; ++m) {
              const int8_t* xm = xb + m * x.K + c * 8;
              acc[0][h][m] = _mm256_dpbusd_avx_epi32(acc[0][h][m], lo, _mm256_set1_epi32(dword(xm)));
              acc[NA - 1][h][m] = _mm256_dpbusd_avx_epi32(acc[NA - 1][h][m], hi, _mm256_set1_epi32(dword(xm + 4)));
            }
          } else {
            for (int m = 0; m < MT; ++m)
              acc[c % NA][h][m] =
                  _mm256_dpbusd_avx_epi32(acc[c % NA][h][m], d, _mm256_set1_epi32(dword(xb + m * x.K + c * 4)));
          }
        }
      }
      for (int h = 0; h < H; ++h)
        for (int m = 0; m < MT; ++m) {
          a[h][m] = acc[0][h][m];
          if constexpr (NA == 2) a[h][m] = _mm256_add_epi32(a[h][m], acc[1][h][m]);
        }
#else
      constexpr int NS = BITS == 8 ? 2 : 1;  // int16 sums: 4 bits one, 8 bits one per nibble (low, high)
      __m256i s16[NS][H][MT];
      for (int k = 0; k < NS; ++k)
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < MT; ++m) s16[k][h][m] = _mm256_setzero_si256();
      for (int c = 0; c < kLines; ++c) {
        const uint8_t* wc = w + (b * kLines + c) * 64;
        prefetch_stream(wc);
        for (int h = 0; h < H; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * h));
          const __m256i lo = _mm256_and_si256(d, low), hi = _mm256_and_si256(_mm256_srli_epi16(d, 4), low);
          for (int m = 0; m < MT; ++m) {
            if constexpr (BITS == 4) {
              const int8_t* xm = xb + m * x.K + c * 8;
              const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(dword(xm)));
              const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(dword(xm + 4)));
              s16[0][h][m] = _mm256_add_epi16(s16[0][h][m], _mm256_add_epi16(pl, ph));
            } else {
              const __m256i xv = _mm256_set1_epi32(dword(xb + m * x.K + c * 4));
              s16[0][h][m] = _mm256_add_epi16(s16[0][h][m], _mm256_maddubs_epi16(lo, xv));
              s16[NS - 1][h][m] = _mm256_add_epi16(s16[NS - 1][h][m], _mm256_maddubs_epi16(hi, xv));
            }
          }
        }
      }
      for (int h = 0; h < H; ++h)
        for (int m = 0; m < MT; ++m) {
          a[h][m] = _mm256_madd_epi16(s16[0][h][m], _mm256_set1_epi16(1));
          if constexpr (BITS == 8)
            a[h][m] = _mm256_add_epi32(a[h][m], _mm256_madd_epi16(s16[NS - 1][h][m], _mm256_set1_epi16(16)));
        }
#endif
      for (int m = 0; m < MT; ++m) {
        const __m256 xs = _mm256_set1_ps(x.xs[m * x.nblocks + b]);
        for (int h = 0; h < H; ++h)
          tot[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][m]), _mm256_mul_ps(sv[h], xs), tot[h][m]);
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 mn = neg_mins8(p, pi + g * kTile + 8 * h, sv[h]);  // -min_g of the 8 rows
      for (int m = 0; m < MT; ++m)
        tot[h][m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(x.xr[m * x.ngroups + g]), tot[h][m]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t n = t * kTile + 8 * (h0 + h);
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + n, _mm256_add_ps(tot[h][m], bv));
  }
}

#endif

inline TX rows_from(const TX& x, int64_t m) {
  return TX{x.xq + m * x.K, x.xs + m * x.nblocks, x.xr + m * x.ngroups, x.K, x.nblocks, x.ngroups};
}

#ifdef BRISK_Q8T_ZMM

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

#else  // AVX2

// Tiles t0 .. t1-1 against all M activation rows, as f(t, h0, first row, rows, halves), rows and halves as
// std::integral_constant. One or two rows take a whole tile at once (both halves' sums fit the 16 registers); more
// rows take one half of it at a time (8 weight rows), kMaxRows activation rows per pass, while the half tile's codes
// stay in L1.
template <typename F>
void each_tile_rows(int64_t M, int64_t t0, int64_t t1, F&& f) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int64_t t = t0; t < t1; ++t) {
    if (M <= 2) {
      if (M == 1) f(t, 0, 0, One{}, Two{});
      else f(t, 0, 0, Two{}, Two{});
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      int64_t m = 0;
      for (; m + kMaxRows <= M; m += kMaxRows) f(t, h, m, std::integral_constant<int, kMaxRows>{}, One{});
      if (m < M)
        brisk_simd::with_rows(M - m, [&](auto mt) {
          if constexpr (decltype(mt)::value < kMaxRows) f(t, h, m, mt, One{});
        });
    }
  }
}

template <int BITS>
void run(const TW& p, const TX& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out, int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int h0, int64_t m, auto mt, auto halves) {
    tile<BITS, decltype(mt)::value, decltype(halves)::value>(p, t, h0, rows_from(x, m), bias, out + m * ldo, ldo);
  });
}

// One 32-column block at src rounded to integers in [-qmax, qmax], as round_block32 (the same float32 operations,
// so the same numbers): four vectors of 8 int32; returns the block's scale max|x| / qmax.
template <typename T>
BRISK_INLINE_T float round_block32(const T* src, float qmax, __m256i q[4]) {
  __m256 f[4];
  const float amax = brisk_simd::load_block(src, f);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));  // round half to even
  return amax / qmax;
}

template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xr) {
  const int64_t nblocks = K / kBlock, ngroups = K / G, bpg = G / kBlock;
  // the packs below leave dwords [q0 0..3, q1 0..3, q2 0..3, q3 0..3 | q0 4..7, ...]: back to column order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      float gsum = 0.f;
      for (int64_t j = g * bpg; j < (g + 1) * bpg; ++j) {
        __m256i q[4];
        const float scale = round_block32(x + m * K + j * kBlock, 127.f, q);
        xs[m * nblocks + j] = scale;
        const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        gsum += scale * static_cast<float>(hsum_epi32(qs));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + j * kBlock), _mm256_permutevar8x32_epi32(b, order));
      }
      xr[m * ngroups + g] = gsum;
    }
  }
}

#endif

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

#ifdef BRISK_Q8T_ZMM

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
                         : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // codes as floats
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

#else  // AVX2

// 8 codes (int32 lanes, 0..15) through a 16-entry table held as two vectors: vpermps of either by the low 3 bits,
// a blend on bit 3.
BRISK_INLINE_T __m256 lookup16(__m256i q, __m256 lut0, __m256 lut1) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut0, q), _mm256_permutevar8x32_ps(lut1, q),
                          _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}

// Column j of 8 rows' dwords as floats. Affine codes: shift, AND, conversion. A 16-entry table takes two vpermps
// (each reads the low 3 bits of a lane) and a blend on bit 3 on AVX2, so only codebook codes go through one.
template <bool LUT>
BRISK_INLINE_T __m256 column(__m256i d, int j, __m256 lut0, __m256 lut1) {
  const int shift = j < 4 ? 8 * j : 8 * (j - 4) + 4;
  const __m256i q = j == 0 ? d : _mm256_srli_epi32(d, shift);
  if constexpr (LUT) {
    return lookup16(q, lut0, lut1);
  } else {
    return _mm256_cvtepi32_ps(j == 7 ? q : _mm256_and_si256(q, _mm256_set1_epi32(0x0F)));
  }
}

// As tile_f above for rows 8 h0 .. 8 (h0 + H) - 1 (see the AVX2 tile): the same operations lane by lane, so the
// same numbers.
template <int BITS, bool LUT, int MT, int H>
void tile_f(const TW& p, int64_t t, int h0, const FX& x, const float* bias, float* out, int64_t ldo) {
  static_assert(BITS == 4, "8-bit codes take tile16");
  constexpr int kCols = 32 / BITS;  // columns per 64-byte line
  constexpr int NA = MT == 1 ? 4 : MT == 2 ? 2 : 1;  // independent FMA chains per activation row
  const uint8_t* w = p.data + t * kTile * (p.K * BITS / 8) + h0 * 32;
  const int64_t pi = t * kTile * p.ngroups + h0 * 8;
  const int64_t group = p.group, lines = group / kCols;
  const __m256 lut0 = LUT ? _mm256_loadu_ps(p.codebook) : _mm256_setzero_ps();
  const __m256 lut1 = LUT ? _mm256_loadu_ps(p.codebook + 8) : _mm256_setzero_ps();
  __m256 tot[H][MT];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MT; ++m) tot[h][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    __m256 acc[NA][H][MT];
    for (int a = 0; a < NA; ++a)
      for (int h = 0; h < H; ++h)
        for (int m = 0; m < MT; ++m) acc[a][h][m] = _mm256_setzero_ps();
    for (int64_t l = 0; l < lines; ++l) {
      const uint8_t* wl = w + (g * lines + l) * 64;
      prefetch_stream(wl);
      __m256i d[H];
      for (int h = 0; h < H; ++h) d[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl + 32 * h));
      const int64_t c0 = g * group + l * kCols;  // the line's first column
      for (int j = 0; j < kCols; ++j) {
        __m256 xv[MT];
        for (int m = 0; m < MT; ++m) xv[m] = _mm256_set1_ps(x.x[m * x.K + c0 + j]);
        for (int h = 0; h < H; ++h) {
          const __m256 v = column<LUT>(d[h], j, lut0, lut1);
          for (int m = 0; m < MT; ++m) acc[j % NA][h][m] = _mm256_fmadd_ps(v, xv[m], acc[j % NA][h][m]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 sv = scales8(p, pi + g * kTile + 8 * h);
      for (int m = 0; m < MT; ++m) {
        __m256 a = acc[0][h][m];
        for (int k = 1; k < NA; ++k) a = _mm256_add_ps(a, acc[k][h][m]);
        tot[h][m] = _mm256_fmadd_ps(a, sv, tot[h][m]);
      }
      if constexpr (!LUT) {  // affine codes: + min (= - scale * zero) * (the group's sum of x)
        const __m256 mn = neg_mins8(p, pi + g * kTile + 8 * h, sv);
        for (int m = 0; m < MT; ++m)
          tot[h][m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(x.xg[m * x.ngroups + g]), tot[h][m]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t n = t * kTile + 8 * (h0 + h);
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + n, _mm256_add_ps(tot[h][m], bv));
  }
}

template <int BITS, bool LUT>
void run_f(const TW& p, const FX& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out, int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int h0, int64_t m, auto mt, auto halves) {
    const FX rows{x.x + m * x.K, x.xg + m * x.ngroups, x.K, x.ngroups};
    tile_f<BITS, LUT, decltype(mt)::value, decltype(halves)::value>(p, t, h0, rows, bias, out + m * ldo, ldo);
  });
}

#endif

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

#ifdef BRISK_Q8T_ZMM

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

#else  // AVX2

template <typename T>
void quantize_x16(const T* x, int64_t M, int64_t K, int64_t G, int16_t* xq, float* xs, int32_t* xi, float* xr) {
  const int64_t nblocks = K / kBlock, ngroups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    float* xrm = xr + m * ngroups;
    for (int64_t g = 0; g < ngroups; ++g) xrm[g] = 0.f;
    for (int64_t b = 0; b < nblocks; ++b) {
      __m256i q[4];
      const float scale = round_block32(x + m * K + b * kBlock, 32767.f, q);
      xs[m * nblocks + b] = scale;
      int16_t* dst = xq + m * K + b * kBlock;
      for (int i = 0; i < 2; ++i) {  // 16 columns: the packed words back in column order, then 0, 2, 1, 3 of every 4
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i),
                            _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(w, 0xD8), 0xD8));
      }
      const int32_t s0 = hsum_epi32(_mm256_add_epi32(q[0], q[1])), s1 = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
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

#endif

inline int32_t dword16(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef BRISK_Q8T_ZMM

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

#else  // AVX2

// As tile16 above for rows 8 h0 .. 8 (h0 + H) - 1 (see the AVX2 tile): vpdpwssd with AVX-VNNI, else vpmaddwd and
// two adds (no saturation: the same int32 sums), so the same numbers.
template <int MT, int H>
void tile16(const TW& p, int64_t t, int h0, const TX16& x, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT == 1 ? 2 : 1;  // independent chains per activation row (integer sums: any split is exact)
  const uint8_t* w = p.data + t * kTile * p.K + h0 * 32;
  const int64_t pi = t * kTile * p.ngroups + h0 * 8;
  const int64_t seg = std::min<int64_t>(p.group, kBlock), lines = seg / 4, segs = p.group / seg;
  const bool float_mins = p.mins16 || p.mins32;
  const __m256i low = _mm256_set1_epi32(0x00FF00FF);
  __m256i zv[H];  // the 8 rows' zero points
  for (int h = 0; h < H; ++h) zv[h] = _mm256_set1_epi32(static_cast<int32_t>(p.zero));
  __m256 tot[H][MT];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MT; ++m) tot[h][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.ngroups; ++g) {
    __m256 sv[H];
    for (int h = 0; h < H; ++h) {
      sv[h] = scales8(p, pi + g * kTile + 8 * h);
      if (p.zeros)
        zv[h] = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.zeros + pi + g * kTile + 8 * h)));
    }
    for (int64_t s = 0; s < segs; ++s) {
      const int64_t c0 = g * p.group + s * seg;  // the segment's first column
      __m256i acc[NA][H][MT];
      for (int a = 0; a < NA; ++a)
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < MT; ++m) acc[a][h][m] = _mm256_setzero_si256();
      for (int64_t l = 0; l < lines; ++l) {
        const uint8_t* wl = w + (c0 / 4 + l) * 64;
        prefetch_stream(wl);
        for (int h = 0; h < H; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl + 32 * h));
          const __m256i lo = _mm256_and_si256(d, low), hi = _mm256_srli_epi16(d, 8);
          for (int m = 0; m < MT; ++m) {
            const int16_t* xm = x.xq + m * x.K + c0 + 4 * l;
            __m256i& a = acc[l % NA][h][m];
#ifdef __AVXVNNI__
            a = _mm256_dpwssd_avx_epi32(a, lo, _mm256_set1_epi32(dword16(xm)));
            a = _mm256_dpwssd_avx_epi32(a, hi, _mm256_set1_epi32(dword16(xm + 2)));
#else
            a = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi32(dword16(xm))),
                                                     _mm256_madd_epi16(hi, _mm256_set1_epi32(dword16(xm + 2)))));
#endif
          }
        }
      }
      const int64_t b = c0 / kBlock;
      for (int m = 0; m < MT; ++m) {
        const int32_t* xim = x.xi + m * (x.K / 16) + c0 / 16;
        const int32_t sum = seg == kBlock ? xim[0] + xim[1] : xim[0];
        const __m256 xs = _mm256_set1_ps(x.xs[m * x.nblocks + b]);
        for (int h = 0; h < H; ++h) {
          __m256i a = acc[0][h][m];
          for (int k = 1; k < NA; ++k) a = _mm256_add_epi32(a, acc[k][h][m]);
          if (!float_mins) a = _mm256_sub_epi32(a, _mm256_mullo_epi32(zv[h], _mm256_set1_epi32(sum)));
          tot[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(sv[h], xs), tot[h][m]);
        }
      }
    }
    if (float_mins) {  // + m_g * (the group's sum of the rounded x)
      for (int h = 0; h < H; ++h) {
        const __m256 mn = neg_mins8(p, pi + g * kTile + 8 * h, sv[h]);
        for (int m = 0; m < MT; ++m)
          tot[h][m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(x.xr[m * x.ngroups + g]), tot[h][m]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t n = t * kTile + 8 * (h0 + h);
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + n, _mm256_add_ps(tot[h][m], bv));
  }
}

void run16(const TW& p, const TX16& x, int64_t M, int64_t t0, int64_t t1, const float* bias, float* out,
           int64_t ldo) {
  each_tile_rows(M, t0, t1, [&](int64_t t, int h0, int64_t m, auto mt, auto halves) {
    const TX16 rows{x.xq + m * x.K, x.xs + m * x.nblocks, x.xi + m * (x.K / 16), x.xr + m * x.ngroups,
                    x.K, x.nblocks, x.ngroups};
    tile16<decltype(mt)::value, decltype(halves)::value>(p, t, h0, rows, bias, out + m * ldo, ldo);
  });
}

#endif

// ---- the pieces of the ops' bodies that differ by build ----

#ifdef BRISK_Q8T_ZMM

// n bfloat16 values (n % 16 == 0) as float32
void widen_rows(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
}

// xg [M, K / G]: each group's sum of x (quant_linear_t's min terms)
void group_sums(const float* xf, int64_t M, int64_t K, int64_t group_size, float* xg) {
  const int64_t ngroups = K / group_size;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ngroups; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        s = _mm512_add_ps(s, _mm512_loadu_ps(xf + m * K + k));
      xg[m * ngroups + g] = _mm512_reduce_add_ps(s);
    }
}

// Tile t (its codes at `tile`) as float32 rows [16, K] at `rows`: w = scale * (q - zero), or scale * lut[q].
void dequantize_tile(const TW& p, const uint8_t* tile, int64_t t, int64_t bits, const float* lut_values,
                     float* rows) {
  const int64_t K = p.K, group_size = p.group, ngroups = p.ngroups;
  const bool lut = lut_values != nullptr;
  const __m512 table = lut ? _mm512_loadu_ps(lut_values) : _mm512_setzero_ps();
  alignas(64) float sv[kTile], mv[kTile];
  // per 16 columns of a tile: four vectors X0..X3 of bytes (8 bits: four lines; 4 bits: the low and high nibbles of
  // two), whose 4 x 4 dword transposes (per 128-bit lane) give each row its 16 codes in column order; each row's 16
  // codes then widen to float32 and take w = q * s + m (m = -s * z: exact, as the reference's form)
  for (int64_t c0 = 0; c0 < K; c0 += 16) {
    if (c0 % group_size == 0) {  // a new group: its 16 rows' scales and mins
      const int64_t g = c0 / group_size;
      const __m512 s = scales16(p, (t * ngroups + g) * kTile);
      _mm512_store_ps(sv, s);
      _mm512_store_ps(mv, lut ? _mm512_setzero_ps()
                              : _mm512_sub_ps(_mm512_setzero_ps(), neg_mins16(p, (t * ngroups + g) * kTile, s)));
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
                             : _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(sv[r]),
                                               _mm512_set1_ps(mv[r]));
        _mm512_storeu_ps(rows + r * K + c0, w);
      }
    }
  }
}

#else  // AVX2

void widen_rows(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, brisk_simd::load8(src + i));
}

// As above, each group's sum in 16 lanes (two vectors of 8) reduced in the order of _mm512_reduce_add_ps: the
// AVX-512 build's sums, bit for bit.
void group_sums(const float* xf, int64_t M, int64_t K, int64_t group_size, float* xg) {
  const int64_t ngroups = K / group_size;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ngroups; ++g) {
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(xf + m * K + k));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(xf + m * K + k + 8));
      }
      const __m256 s8 = _mm256_add_ps(s1, s0);
      const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
      const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
      xg[m * ngroups + g] = _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
    }
}

// As above, per half tile (8 rows): the same transposes per 128-bit lane, lane k holding row 8 h + 4 k + i.
void dequantize_tile(const TW& p, const uint8_t* tile, int64_t t, int64_t bits, const float* lut_values,
                     float* rows) {
  const int64_t K = p.K, group_size = p.group, ngroups = p.ngroups;
  const bool lut = lut_values != nullptr;
  const __m256 lut0 = lut ? _mm256_loadu_ps(lut_values) : _mm256_setzero_ps();
  const __m256 lut1 = lut ? _mm256_loadu_ps(lut_values + 8) : _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) float sv[kTile], mv[kTile];
  for (int64_t c0 = 0; c0 < K; c0 += 16) {
    if (c0 % group_size == 0) {  // a new group: its 16 rows' scales and mins
      const int64_t i = (t * ngroups + c0 / group_size) * kTile;
      for (int h = 0; h < 2; ++h) {
        const __m256 s = scales8(p, i + 8 * h);
        _mm256_store_ps(sv + 8 * h, s);
        _mm256_store_ps(mv + 8 * h, lut ? _mm256_setzero_ps()
                                        : _mm256_sub_ps(_mm256_setzero_ps(), neg_mins8(p, i + 8 * h, s)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i x[4];
      if (bits == 8) {
        for (int i = 0; i < 4; ++i)
          x[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (c0 / 4 + i) * 64 + 32 * h));
      } else {
        for (int i = 0; i < 2; ++i) {
          const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (c0 / 8 + i) * 64 + 32 * h));
          x[2 * i] = _mm256_and_si256(l, low);
          x[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
        }
      }
      const __m256i p0 = _mm256_unpacklo_epi32(x[0], x[1]), p1 = _mm256_unpackhi_epi32(x[0], x[1]);
      const __m256i p2 = _mm256_unpacklo_epi32(x[2], x[3]), p3 = _mm256_unpackhi_epi32(x[2], x[3]);
      const __m256i r4[4] = {_mm256_unpacklo_epi64(p0, p2), _mm256_unpackhi_epi64(p0, p2),
                             _mm256_unpacklo_epi64(p1, p3), _mm256_unpackhi_epi64(p1, p3)};
      for (int i = 0; i < 4; ++i) {
        for (int k = 0; k < 2; ++k) {
          const int r = 8 * h + 4 * k + i;
          const __m128i q = k == 0 ? _mm256_castsi256_si128(r4[i]) : _mm256_extracti128_si256(r4[i], 1);
          for (int e = 0; e < 2; ++e) {  // columns c0 + 8 e .. c0 + 8 e + 7
            const __m256i qi = _mm256_cvtepu8_epi32(e == 0 ? q : _mm_srli_si128(q, 8));
            const __m256 w = lut ? _mm256_mul_ps(lookup16(qi, lut0, lut1), _mm256_set1_ps(sv[r]))
                                 : _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(sv[r]),
                                                   _mm256_set1_ps(mv[r]));
            _mm256_storeu_ps(rows + r * K + c0 + 8 * e, w);
          }
        }
      }
    }
  }
}

#endif

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
  if (!direct) widen_rows(c.x.data_ptr<at::BFloat16>(), xg + M * ngroups, M * K);  // K % 32 == 0
  group_sums(xf, M, K, group_size, xg);
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
  p.K = K;
  p.group = group_size;
  p.ngroups = ngroups;
  const int64_t tile_bytes = kTile * K * bits / 8;
  float* o = out.data_ptr<float>();
  at::parallel_for(t0, t1, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      dequantize_tile(p, d + t * tile_bytes, t, bits, lut_values, o + (t - t0) * kTile * K);
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

#endif  // AVX2 + FMA + F16C: without them no op is registered and nothing is tiled (ops/qlinear.py can_tile)
