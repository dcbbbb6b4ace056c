// Lookup-table (non-uniform) quantized linear, SqueezeLLM's dense-and-sparse format (Kim et al. 2023):
//
//   out[m, n] = sum_k x[m, k] * lut[n, q[n, k]]  +  sum_{i in row n of S} values[i] * x[m, cols[i]]  (+ bias[n])
//
// Dense part: every weight row n has its own table lut[n, 0 .. E - 1] (E = 8 for 3-bit codes, 16 for 4-bit ones,
// float32) and a 4-bit code per weight (3-bit codes are stored in 4-bit fields too, so one decoder serves both).
// Sparse part: the outliers kept in float, a CSR matrix (row_ptr [N + 1], cols [nnz], values [nnz]).
//
// Layout of the codes (made by brisk.ops.lut.pack_nibbles): [N, K / 2] uint8, two codes a byte, the even column
// in the low nibble: byte j of row n = q[n, 2 j] | q[n, 2 j + 1] << 4. So the 4 bytes of columns k .. k + 7 read
// as one little-endian 32-bit word hold code k + l at bits 4 l .. 4 l + 3:
//
//   word = | q7 | q6 | q5 | q4 | q3 | q2 | q1 | q0 |     (bit 31 ... bit 0)
//
// AVX2 build, decode of 8 weights: broadcast the word, shift lane l right by 4 l (one variable shift), mask to
// 4 bits; the codes then index the row's table with one 8-entry permute (lut[0..7], which reads bits 0-2 of each
// lane) and, for 16 entries, a second permute of lut[8..15] and a blend on bit 3 of the code (shifted to the sign bit).
// The row's table sits in two registers for the whole row; each decoded vector is reused by up to 4 activation
// rows. The AVX-512 build (BF16 dot products) takes 64 codes at a time instead, in bfloat16 (see rows_tile_bf16).
// Every weight is read once per call (decode, M <= a few); the large-row path dequantizes a chunk of rows with
// lut_dequantize and runs a float32 GEMM (brisk/ops/lut.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using brisk_simd::hsum;

constexpr int kTile = 4;  // activation rows per pass over a weight row

struct Sparse {
  const int32_t* row_ptr = nullptr;  // [N + 1]; nullptr: no outliers
  const int32_t* cols = nullptr;     // [nnz]
  const float* values = nullptr;     // [nnz]
};

struct Lut {
  const uint8_t* codes;  // [N, K / 2]
  const float* lut;      // [N, E]
  int64_t N, K, E;
  Sparse sparse;
};

// 8 codes of columns k .. k + 7 of a row -> their table values
template <bool WIDE>
inline __m256 decode8(const uint8_t* p, __m256 lo, __m256 hi, __m256i shifts, __m256i mask) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), mask);
  const __m256 w = _mm256_permutevar8x32_ps(lo, idx);
  if constexpr (!WIDE) {
    return w;
  } else {
    const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 of the code -> sign bit
    return _mm256_blendv_ps(w, _mm256_permutevar8x32_ps(hi, idx), sel);
  }
}

// out[m, n] for rows m0 .. m0 + MT - 1 of x and weight rows n0 .. n1 - 1 (float32 acc into out_f)
template <bool WIDE, int MT>
void rows_tile(const Lut& p, const float* x, int64_t m0, int64_t n0, int64_t n1, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  const int64_t K = p.K, N = p.N;
  for (int64_t n = n0; n < n1; ++n) {
    const float* t = p.lut + n * p.E;
    const __m256 lo = _mm256_loadu_ps(t);
    const __m256 hi = WIDE ? _mm256_loadu_ps(t + 8) : lo;
    const uint8_t* row = p.codes + n * (K / 2);
    __m256 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 w = decode8<WIDE>(row + k / 2, lo, hi, shifts, mask);
      for (int i = 0; i < MT; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (m0 + i) * K + k), acc[i]);
    }
    for (int i = 0; i < MT; ++i) {
      float s = hsum(acc[i]);
      if (p.sparse.row_ptr) {
        const float* xr = x + (m0 + i) * K;
        for (int32_t j = p.sparse.row_ptr[n]; j < p.sparse.row_ptr[n + 1]; ++j)
          s += p.sparse.values[j] * xr[p.sparse.cols[j]];
      }
      out[(m0 + i) * N + n] = s;
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BRISK_LUT_BF16 1
// AVX-512 with BF16 dot products: the row's table (8 or 16 entries) rounded once to bfloat16 and held in one
// register; 64 codes (32 bytes) at a time: their low nibbles are the even columns' codes and their high nibbles
// the odd columns', each widened to 32 16-bit lanes and looked up with one vpermw, then multiplied with 32
// bfloat16 activations by one vdpbf16ps (float32 sums of exact products). The activations are deinterleaved once
// per call to match (per block of 64 columns: the 32 even columns, then the 32 odd ones; zero-padded to a whole
// block), so no shuffle of the codes is needed. A 3-bit code never reads past entry 7.
constexpr int64_t kBlock = 64;

// x [M, K] (bfloat16 bits) -> [M, Kp] in the block order above, Kp = K rounded up to 64, zeros past K
void deinterleave(const uint16_t* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out) {
  std::memset(out, 0, static_cast<size_t>(M * Kp) * sizeof(uint16_t));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = k / kBlock, j = k % kBlock;
      out[m * Kp + b * kBlock + (j % 2) * 32 + j / 2] = x[m * K + k];
    }
}

template <int MT, int UNR>
void rows_tile_bf16(const Lut& p, const uint16_t* x, int64_t Kp, const float* xf, int64_t m0, int64_t n0,
                    int64_t n1, float* out) {
  const int64_t K = p.K, N = p.N;
  const int64_t whole = K / kBlock;  // blocks of 64 codes read in place; a partial last one from a copy
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const float* t = p.lut + n * p.E;
    const __m512 tf = p.E == 16 ? _mm512_loadu_ps(t) : _mm512_zextps256_ps512(_mm256_loadu_ps(t));
    const __m512i table = _mm512_zextsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(tf)));
    const uint8_t* row = p.codes + n * (K / 2);
    __m512 acc[MT][2 * UNR];
    for (int i = 0; i < MT; ++i)
      for (int u = 0; u < 2 * UNR; ++u) acc[i][u] = _mm512_setzero_ps();
    auto step = [&](const uint8_t* c, int64_t k, int u) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      const __m512i even = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(b, nib)), table);
      const __m512i odd =
          _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), nib)), table);
      for (int i = 0; i < MT; ++i) {
        const uint16_t* xr = x + (m0 + i) * Kp + k;
        acc[i][2 * u] = _mm512_dpbf16_ps(acc[i][2 * u], reinterpret_cast<__m512bh>(even),
                                         reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr)));
        acc[i][2 * u + 1] = _mm512_dpbf16_ps(acc[i][2 * u + 1], reinterpret_cast<__m512bh>(odd),
                                             reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + 32)));
      }
    };
    int64_t blk = 0;
    for (; blk + UNR <= whole; blk += UNR)
      for (int u = 0; u < UNR; ++u) step(row + (blk + u) * 32, (blk + u) * kBlock, u);
    for (; blk < whole; ++blk) step(row + blk * 32, blk * kBlock, 0);
    if (K % kBlock) {  // the last 8 .. 56 columns: codes past the row read as 0, their activations are 0
      alignas(32) uint8_t last[32] = {};
      std::memcpy(last, row + whole * 32, static_cast<size_t>((K % kBlock) / 2));
      step(last, whole * kBlock, 0);
    }
    for (int i = 0; i < MT; ++i) {
      __m512 sum = acc[i][0];
      for (int u = 1; u < 2 * UNR; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
      float s = _mm512_reduce_add_ps(sum);
      if (p.sparse.row_ptr) {  // the outliers in float32, as stored
        const float* xr = xf + (m0 + i) * K;
        for (int32_t j = p.sparse.row_ptr[n]; j < p.sparse.row_ptr[n + 1]; ++j)
          s += p.sparse.values[j] * xr[p.sparse.cols[j]];
      }
      out[(m0 + i) * N + n] = s;
    }
  }
}

void run_bf16(const Lut& p, const uint16_t* x, int64_t Kp, const float* xf, int64_t M, float* out) {
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(p.K, 1));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + kTile <= M; m0 += kTile) rows_tile_bf16<kTile, 1>(p, x, Kp, xf, m0, n0, n1, out);
    switch (M - m0) {
      case 3: rows_tile_bf16<3, 1>(p, x, Kp, xf, m0, n0, n1, out); break;
      case 2: rows_tile_bf16<2, 1>(p, x, Kp, xf, m0, n0, n1, out); break;
      case 1: rows_tile_bf16<1, 2>(p, x, Kp, xf, m0, n0, n1, out); break;
      default: break;
    }
  });
}
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BRISK_LUT_Q8 1
// Int8 activations against uint8 tables (lut_linear_q8). The activations are rounded as quant_linear_q8 rounds
// them (quant_q8.cpp: per 32-column block b, xs_b = max|x_b| / 127, xq = round_half_even(x * 127 / max|x_b|)); each
// row's table is rounded once, at load, to uint8 with zero point 128 (brisk.ops.lut.quantize_tables: t_n = max|lut
// row| / 127, u = round(lut / t_n) + 128), so that
//
//   out[m, n] = t_n * sum_b xs_b * sum_{k in b} (u[n, q[n, k]] - 128) * xq_k  +  outliers . (xs * xq)  (+ bias)
//
// 128 codes (64 bytes) a step: vpermb looks the low nibbles up in the row's 16-byte table repeated to 64 bytes
// (its 6-bit index then needs no mask: entry i & 15), a 16-bit shift right by 4 brings the high nibbles down for a
// second vpermb, and two vpdpbusd (table bytes unsigned, activations signed) add the products, 4 to a 32-bit lane.
// The activations are reordered once per call to match: per chunk of 128 columns, the 64 even columns, then the 64
// odd ones, so lane l of either product holds columns of block 4 c + l / 4 only. Each lane starts from -128 times
// the sum of its activations (the zero point, computed with the same vpdpbusd), so its int32 sum is exact: the
// chunk's 16 lanes are converted once and multiplied by their blocks' scales. About 8 instructions per 128 weights
// per activation row, against the bfloat16 table kernel's 10 per 64.
constexpr int64_t kChunk = 128;
constexpr int64_t kQBlock = 32;
constexpr int64_t kLanes = 16;  // int32 sums a chunk and activation row (4 columns of one block each)
// the code stream prefetched 8 KiB ahead, as quant_q8t.cpp does (non-temporal on AMD, into L2 elsewhere)
constexpr int64_t kPrefetchBytes = 8192;
#ifdef BRISK_CPU_AMD
constexpr auto kPrefetchHint = _MM_HINT_NTA;
#else
constexpr auto kPrefetchHint = _MM_HINT_T1;
#endif

struct XQ8 {
  int64_t Kc;            // K rounded up to whole chunks
  const int8_t* xq;      // [M, Kc]: per chunk the 64 even columns, then the 64 odd ones; zeros past K
  const int8_t* xa;      // unused here (the AVX2 build's |xq|)
  const int32_t* start;  // [M, Kc / 128 * 16]: each lane's initial sum, -128 * the sum of its activations
  const float* scale;    // [M, Kc / 128 * 16]: lane l of chunk c holds xs of block 4 c + l / 4
  const float* xr;       // [M, K]: xs_b * xq, the rounded activations (for the outliers)
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [M, K] -> the XQ8 arrays, rows m0 .. m1 - 1
template <typename T>
void quantize_chunks(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t Kc, int8_t* xq, int8_t* /*xa*/,
                     int32_t* start, float* scale, float* xr) {
  const int64_t chunks = Kc / kChunk;
  alignas(64) int8_t plain[kChunk];
  __m512i even_idx, odd_idx;
  {
    alignas(64) int8_t e[64], o[64];
    for (int j = 0; j < 64; ++j) e[j] = static_cast<int8_t>(2 * j), o[j] = static_cast<int8_t>(2 * j + 1);
    even_idx = _mm512_load_si512(e);
    odd_idx = _mm512_load_si512(o);
  }
  const __m512i zp = _mm512_set1_epi8(static_cast<char>(128));
  for (int64_t m = m0; m < m1; ++m) {
    const T* xm = x + m * K;
    for (int64_t c = 0; c < chunks; ++c) {
      alignas(64) float sc[16];
      for (int b = 0; b < 4; ++b) {
        const int64_t k0 = c * kChunk + b * kQBlock;
        const int64_t n = std::clamp<int64_t>(K - k0, 0, kQBlock);
        __m512 a, bq;
        if (n == kQBlock) {
          a = load16(xm + k0);
          bq = load16(xm + k0 + 16);
        } else {  // past K (K is a multiple of 32): zeros
          a = bq = _mm512_setzero_ps();
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(bq)));
        const float s = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // round half to even
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(bq, inv));
        _mm_store_si128(reinterpret_cast<__m128i*>(plain + b * kQBlock), _mm512_cvtsepi32_epi8(qa));
        _mm_store_si128(reinterpret_cast<__m128i*>(plain + b * kQBlock + 16), _mm512_cvtsepi32_epi8(qb));
        for (int l = 0; l < 4; ++l) sc[4 * b + l] = s;
        if (n > 0) {  // the rounded values, as fake_quantize_q8 gives them
          alignas(64) float r[kQBlock];
          _mm512_store_ps(r, _mm512_mul_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(s)));
          _mm512_store_ps(r + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(qb), _mm512_set1_ps(s)));
          std::memcpy(xr + m * K + k0, r, static_cast<size_t>(n) * sizeof(float));
        }
      }
      const __m512i lo = _mm512_load_si512(plain), hi = _mm512_load_si512(plain + 64);
      const __m512i ev = _mm512_permutex2var_epi8(lo, even_idx, hi), od = _mm512_permutex2var_epi8(lo, odd_idx, hi);
      int8_t* dst = xq + m * Kc + c * kChunk;
      _mm512_storeu_si512(dst, ev);
      _mm512_storeu_si512(dst + 64, od);
      const __m512i corr = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), zp, ev), zp, od);
      _mm512_storeu_si512(start + (m * chunks + c) * 16, _mm512_sub_epi32(_mm512_setzero_si512(), corr));
      _mm512_storeu_ps(scale + (m * chunks + c) * 16, _mm512_load_ps(sc));
    }
  }
}

// [a, b, c, d]: the sums of the 16 lanes of each (one transposing reduction for four weight rows)
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13 a lane
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d per 128 bits
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[m, n] += the outliers of weight rows n0 .. n1 - 1 against activation rows x[m] (float32, [M, K]), for every
// m < M: a pass of its own after the table products, 16 weight rows at a time. The block's outliers (CSR order: one
// run) go 16 at a time through a gather of x, a product with their values and a prefix sum, written out as the
// run's exclusive prefix E (E[0] = 0); row n's sum is then E[end of n] - E[start of n], two gathers for 16 rows.
// Branches depend only on the block's count of outliers: done inside the table loop, a row's outliers cost more
// than its table products at 0.45% outliers (each row's exit from its own loop, at a varying count, mispredicted,
// and took the next rows' loads in flight with it).
void add_outliers(const Sparse& sp, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, int64_t N,
                  float* out) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512i zi = _mm512_setzero_si512();
  std::vector<float> prefix;
  for (int64_t nb = n0; nb < n1; nb += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, n1 - nb));
    const __mmask16 live_rows = _cvtu32_mask16((1u << rows) - 1);
    const int32_t j_start = sp.row_ptr[nb], j_end = sp.row_ptr[nb + rows];
    if (j_start == j_end) continue;
    const int32_t count = j_end - j_start;
    prefix.resize(static_cast<size_t>(count) + 16);
    const __m512i first = _mm512_set1_epi32(j_start);
    const __m512i lo = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(live_rows, sp.row_ptr + nb), first);
    const __m512i hi = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(live_rows, sp.row_ptr + nb + 1), first);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float carry = 0.f;
      for (int32_t j0 = 0; j0 < count; j0 += 16) {
        const int n_live = std::min<int32_t>(16, count - j0);
        const __mmask16 live = _cvtu32_mask16(n_live == 16 ? 0xFFFFu : (1u << n_live) - 1);
        const __m512i cols = _mm512_maskz_loadu_epi32(live, sp.cols + j_start + j0);
        const __m512 prod = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, sp.values + j_start + j0),
                                          _mm512_mask_i32gather_ps(zero, live, cols, xm, 4));
        // inclusive prefix over the lanes, then shifted up one lane: lane l holds the lanes before l
        __m512 s = prod;
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), zi, 15)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), zi, 14)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), zi, 12)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), zi, 8)));
        const __m512 total = _mm512_permutexvar_ps(_mm512_set1_epi32(15), s);  // the piece's sum (zeros past it)
        const __m512 exclusive = _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(s), zi, 15));
        _mm512_storeu_ps(prefix.data() + j0, _mm512_add_ps(exclusive, _mm512_set1_ps(carry)));
        carry += _mm_cvtss_f32(_mm512_castps512_ps128(total));
      }
      prefix[static_cast<size_t>(count)] = carry;  // E[count]: the block's total
      const __m512 d = _mm512_sub_ps(_mm512_mask_i32gather_ps(zero, live_rows, hi, prefix.data(), 4),
                                     _mm512_mask_i32gather_ps(zero, live_rows, lo, prefix.data(), 4));
      float* o = out + m * N + nb;
      _mm512_mask_storeu_ps(o, live_rows, _mm512_add_ps(_mm512_maskz_loadu_ps(live_rows, o), d));
    }
  }
}

// out[m, n] for activation rows m0 .. m0 + MT - 1 and weight rows n0 .. n1 - 1, R weight rows a pass (1 or 4)
// sharing each chunk's activation loads
template <int MT, int R>
void rows_tile_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t m0, int64_t n0, int64_t n1,
                  float* out) {
  static_assert(R == 1 || R == 4, "one weight row a pass, or four");
  const int64_t K = p.K, N = p.N, chunks = a.Kc / kChunk, whole = K / kChunk;
  const __mmask64 tail = _cvtu64_mask64((uint64_t{1} << ((K % kChunk) / 2)) - 1);  // the partial chunk's bytes
  for (int64_t n = n0; n + R <= n1; n += R) {
    __m512i table[R];
    float row_scale[R];
    const uint8_t* row[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* t = qlut + (n + r) * 20;
      table[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      std::memcpy(&row_scale[r], t + 16, sizeof(float));
      row[r] = p.codes + (n + r) * (K / 2);
    }
    constexpr int kAlt = R == 1 ? 2 : 1;  // independent float sums per (activation row, weight row)
    __m512 acc[MT][R][kAlt];
    for (int i = 0; i < MT; ++i)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < kAlt; ++u) acc[i][r][u] = _mm512_setzero_ps();
    auto step = [&](bool last, int64_t c) {
      __m512i ev[R], od[R];
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + c * 64) + kPrefetchBytes, kPrefetchHint);
        const __m512i b = last ? _mm512_maskz_loadu_epi8(tail, row[r] + c * 64) : _mm512_loadu_si512(row[r] + c * 64);
        ev[r] = _mm512_permutexvar_epi8(b, table[r]);
        od[r] = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), table[r]);
      }
      for (int i = 0; i < MT; ++i) {
        const int64_t m = m0 + i;
        const int8_t* xq = a.xq + m * a.Kc + c * kChunk;
        const __m512i s0 = _mm512_loadu_si512(a.start + (m * chunks + c) * 16);
        const __m512i xe = _mm512_loadu_si512(xq), xo = _mm512_loadu_si512(xq + 64);
        const __m512 sc = _mm512_loadu_ps(a.scale + (m * chunks + c) * 16);
        for (int r = 0; r < R; ++r) {
          const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s0, ev[r], xe), od[r], xo);
          acc[i][r][c % kAlt] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[i][r][c % kAlt]);
        }
      }
    };
    for (int64_t c = 0; c < whole; ++c) step(false, c);
    if (whole < chunks) step(true, whole);  // the last 32 .. 96 columns: codes past the row read as 0, x as 0
    float v[MT][R];
    for (int i = 0; i < MT; ++i) {
      if constexpr (R == 1) {
        v[i][0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0][0], acc[i][0][1]));
      } else {
        _mm_storeu_ps(v[i], reduce4(acc[i][0][0], acc[i][1][0], acc[i][2][0], acc[i][3][0]));
      }
      for (int r = 0; r < R; ++r) v[i][r] *= row_scale[r];
    }
    for (int i = 0; i < MT; ++i)
      for (int r = 0; r < R; ++r) out[(m0 + i) * N + n + r] = v[i][r];
  }
}

// four weight rows a pass, the last n1 - n0 mod 4 one at a time
template <int MT>
void rows_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t m0, int64_t n0, int64_t n1, float* out) {
  const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
  rows_tile_q8<MT, 4>(p, qlut, a, m0, n0, n4, out);
  rows_tile_q8<MT, 1>(p, qlut, a, m0, n4, n1, out);
}

void run_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t M, float* out) {
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(p.K, 1));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + kTile <= M; m0 += kTile) rows_q8<kTile>(p, qlut, a, m0, n0, n1, out);
    switch (M - m0) {
      case 3: rows_q8<3>(p, qlut, a, m0, n0, n1, out); break;
      case 2: rows_q8<2>(p, qlut, a, m0, n0, n1, out); break;
      case 1: rows_q8<1>(p, qlut, a, m0, n0, n1, out); break;
      default: break;
    }
    if (p.sparse.row_ptr) add_outliers(p.sparse, a.xr, M, p.K, n0, n1, p.N, out);  // against the rounded x
  });
}
#else
#define BRISK_LUT_Q8 1
// Int8 activations against uint8 tables (lut_linear_q8) without AVX-512 VBMI: the function of the kernel above (the
// same rounding of x and of the tables, exact int32 sums per 32-column block, float32 scaling and sums) on 256-bit
// registers. A row's 16-byte table is exactly one vpshufb lookup (16 entries; vpshufb works per 128-bit half, so the
// table is held in both halves): 64 codes (32 bytes) a step, a mask and a 16-bit shift right by 4 give the low
// nibbles (even columns) and the high ones (odd columns), and two vpshufb their table bytes. The activations are
// reordered once per call to match: per chunk of 64 columns the 32 even ones, then the 32 odd ones, so int32 lane l
// of either product holds columns of block 2 c + l / 4 only. The products, 4 to an int32 lane:
// - with AVX-VNNI (the avx2vnni tier; the avx512nv tier's AVX-512 VNNI on 256-bit registers alike): two vpdpbusd,
//   the table bytes unsigned (zero point 128), from a start of -128 times the lane's activations, as above;
// - plain AVX2: vpmaddubsw adds its products in pairs with int16 saturation, and u * xq reaches 255 * 127 (a pair
//   64770 > 32767), so the table is read signed instead, w = u - 128 in [-127, 127] (quantize_tables never writes
//   u = 0), and the activations' sign moves onto it: vpmaddubsw(|xq|, sign(w, xq)) (vpsignb), a pair at most
//   2 * 127 * 127 = 32258, exact; vpmaddwd by ones then adds the pairs into int32. |xq| is stored once per call.
// Against the float path it replaces (lut_linear_q8's rounded x through the float table kernel), on a Xeon (AVX-512
// + AMX) forced to the avx2 tier, one thread, 4-bit tables, 0.5% outliers: 576 x 576 at one row 13.8 us against
// 71 us (5.2x), 3072 x 576 6.1x; at 8 rows 2.0x and 3.0x, where the products dominate (per activation row, weight
// row and step nine instructions, against four with VNNI): forced to the avx2vnni tier, 8 rows 2.8x and 3.0x.
constexpr int64_t kChunk = 64;
constexpr int64_t kQBlock = 32;
constexpr int64_t kLanes = 8;  // int32 sums a chunk and activation row (4 columns of one block each)
// the code stream prefetched 8 KiB ahead, as the AVX-512 kernel does
constexpr int64_t kPrefetchBytes = 8192;
#ifdef BRISK_CPU_AMD
constexpr auto kPrefetchHint = _MM_HINT_NTA;
#else
constexpr auto kPrefetchHint = _MM_HINT_T1;
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// acc + the sums of 4 products u * x (u unsigned, x signed) a lane: vpdpbusd where the build has it
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  (void)u, (void)x;  // never called: without VNNI the kernel takes dot4_signed
  return acc;
#endif
}

// the sums of 4 products w * x a lane, w and x signed in [-127, 127], xa = |x|: no int16 pair can saturate
inline __m256i dot4_signed(__m256i w, __m256i x, __m256i xa) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1));
}

struct XQ8 {
  int64_t Kc;            // K rounded up to whole chunks
  const int8_t* xq;      // [M, Kc]: per chunk the 32 even columns, then the 32 odd ones; zeros past K
  const int8_t* xa;      // [M, Kc]: |xq| (plain AVX2)
  const int32_t* start;  // [M, Kc / 64 * 8]: each lane's initial sum, -128 * the sum of its activations (VNNI)
  const float* scale;    // [M, Kc / 64 * 8]: lane l of chunk c holds xs of block 2 c + l / 4
  const float* xr;       // [M, K]: xs_b * xq, the rounded activations (for the outliers)
};

// x [M, K] -> the XQ8 arrays, rows m0 .. m1 - 1
template <typename T>
void quantize_chunks(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t Kc, int8_t* xq, int8_t* xa,
                     int32_t* start, float* scale, float* xr) {
  const int64_t chunks = Kc / kChunk;
  // per 16-byte half: its 8 even bytes, then its 8 odd ones
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes vpackss*'s interleave of the halves
  const __m256i zp = _mm256_set1_epi8(static_cast<char>(128));
  for (int64_t m = m0; m < m1; ++m) {
    const T* xm = x + m * K;
    for (int64_t c = 0; c < chunks; ++c) {
      __m256i part[2];  // per block: its 16 even columns, then its 16 odd ones
      float sc[2];
      for (int b = 0; b < 2; ++b) {
        const int64_t k0 = c * kChunk + b * kQBlock;
        __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const float amax = k0 < K ? brisk_simd::load_block(xm + k0, f) : 0.f;  // past K (K % 32 == 0): zeros
        const float s = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));  // round half to even
        if (k0 < K)  // the rounded values, as fake_quantize_q8 gives them
          for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(xr + m * K + k0 + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(s)));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        part[b] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), _MM_SHUFFLE(3, 1, 2, 0));
        sc[b] = s;
      }
      const __m256i ev = _mm256_permute2x128_si256(part[0], part[1], 0x20);
      const __m256i od = _mm256_permute2x128_si256(part[0], part[1], 0x31);
      const int64_t at = m * Kc + c * kChunk, lane = (m * chunks + c) * kLanes;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at), ev);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at + 32), od);
      if constexpr (kVnni) {
        const __m256i corr = dot4(dot4(_mm256_setzero_si256(), zp, ev), zp, od);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(start + lane), _mm256_sub_epi32(_mm256_setzero_si256(), corr));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xa + at), _mm256_abs_epi8(ev));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xa + at + 32), _mm256_abs_epi8(od));
      }
      _mm256_storeu_ps(scale + lane, _mm256_setr_ps(sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1]));
    }
  }
}

// [a, b, c, d]: the sums of the 8 lanes of each (one transposing reduction for four weight rows)
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d per 128 bits
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// out[m, n] += the outliers of weight rows n0 .. n1 - 1 against activation rows x[m] (float32, [M, K]), for every
// m < M: the AVX-512 kernel's pass (one run of a block's outliers through a gather, a product and a prefix sum,
// each row's sum a difference of two prefix entries), 8 weight rows and 8 outliers at a time.
void add_outliers(const Sparse& sp, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, int64_t N,
                  float* out) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i up_one = _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6);
  std::vector<float> prefix;
  for (int64_t nb = n0; nb < n1; nb += 8) {
    const int rows = static_cast<int>(std::min<int64_t>(8, n1 - nb));
    const int32_t j_start = sp.row_ptr[nb], j_end = sp.row_ptr[nb + rows];
    if (j_start == j_end) continue;
    const int32_t count = j_end - j_start;
    prefix.resize(static_cast<size_t>(count) + 8);
    alignas(32) int32_t lo_i[8] = {}, hi_i[8] = {};  // rows past n1: 0 and 0, a difference of 0
    for (int r = 0; r < rows; ++r) lo_i[r] = sp.row_ptr[nb + r] - j_start, hi_i[r] = sp.row_ptr[nb + r + 1] - j_start;
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo_i));
    const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi_i));
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float carry = 0.f;
      for (int32_t j0 = 0; j0 < count; j0 += 8) {
        const int32_t n_live = std::min<int32_t>(8, count - j0);
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_live), lanes);
        const int32_t* cp = sp.cols + j_start + j0;
        const float* vp = sp.values + j_start + j0;
        const __m256i cols = n_live == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp))
                                         : _mm256_maskload_epi32(cp, live);
        const __m256 vals = n_live == 8 ? _mm256_loadu_ps(vp) : _mm256_maskload_ps(vp, live);
        __m256 s = _mm256_mul_ps(vals, _mm256_mask_i32gather_ps(zero, xm, cols, _mm256_castsi256_ps(live), 4));
        // inclusive prefix over the lanes: within each 128-bit half, then the low half's total into the high one
        s = _mm256_add_ps(s, _mm256_castsi256_ps(_mm256_slli_si256(_mm256_castps_si256(s), 4)));
        s = _mm256_add_ps(s, _mm256_castsi256_ps(_mm256_slli_si256(_mm256_castps_si256(s), 8)));
        const __m256 low_total = _mm256_shuffle_ps(s, s, _MM_SHUFFLE(3, 3, 3, 3));
        s = _mm256_add_ps(s, _mm256_permute2f128_ps(low_total, low_total, 0x08));  // (0 in the low half)
        const __m256 exclusive = _mm256_blend_ps(_mm256_permutevar8x32_ps(s, up_one), zero, 0x01);
        _mm256_storeu_ps(prefix.data() + j0, _mm256_add_ps(exclusive, _mm256_set1_ps(carry)));
        carry += _mm_cvtss_f32(_mm_permute_ps(_mm256_extractf128_ps(s, 1), _MM_SHUFFLE(3, 3, 3, 3)));
      }
      prefix[static_cast<size_t>(count)] = carry;  // E[count]: the block's total
      alignas(32) float d[8];
      _mm256_store_ps(d, _mm256_sub_ps(_mm256_i32gather_ps(prefix.data(), hi, 4),
                                       _mm256_i32gather_ps(prefix.data(), lo, 4)));
      float* o = out + m * N + nb;
      for (int r = 0; r < rows; ++r) o[r] += d[r];
    }
  }
}

// out[m, n] for activation rows m0 .. m0 + MT - 1 and weight rows n0 .. n1 - 1, R weight rows a pass (1, 2 or 4)
// sharing each chunk's activation loads
template <int MT, int R>
void rows_tile_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t m0, int64_t n0, int64_t n1,
                  float* out) {
  static_assert(R == 1 || R == 2 || R == 4, "one, two or four weight rows a pass");
  const int64_t K = p.K, N = p.N, chunks = a.Kc / kChunk, whole = K / kChunk;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(kVnni ? 0 : 0x80));  // plain AVX2: w = u - 128
  for (int64_t n = n0; n + R <= n1; n += R) {
    __m256i table[R];
    float row_scale[R];
    const uint8_t* row[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* t = qlut + (n + r) * 20;
      table[r] = _mm256_xor_si256(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))), flip);
      std::memcpy(&row_scale[r], t + 16, sizeof(float));
      row[r] = p.codes + (n + r) * (K / 2);
    }
    constexpr int kAlt = R == 1 ? 2 : 1;  // independent float sums per (activation row, weight row)
    __m256 acc[MT][R][kAlt];
    for (int i = 0; i < MT; ++i)
      for (int r = 0; r < R; ++r)
        for (int u = 0; u < kAlt; ++u) acc[i][r][u] = _mm256_setzero_ps();
    auto step = [&](bool last, int64_t c) {
      __m256i ev[R], od[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* cp = row[r] + c * 32;
        _mm_prefetch(reinterpret_cast<const char*>(cp) + kPrefetchBytes, kPrefetchHint);
        // the partial last chunk (32 columns): 16 bytes of codes, the rest 0 (against activations of 0)
        const __m256i b = last ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cp)))
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp));
        ev[r] = _mm256_shuffle_epi8(table[r], _mm256_and_si256(b, nib));
        od[r] = _mm256_shuffle_epi8(table[r], _mm256_and_si256(_mm256_srli_epi16(b, 4), nib));
      }
      for (int i = 0; i < MT; ++i) {
        const int64_t m = m0 + i, at = m * a.Kc + c * kChunk, lane = (m * chunks + c) * kLanes;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + at));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + at + 32));
        const __m256 sc = _mm256_loadu_ps(a.scale + lane);
        for (int r = 0; r < R; ++r) {
          __m256i s;
          if constexpr (kVnni) {
            const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.start + lane));
            s = dot4(dot4(s0, ev[r], xe), od[r], xo);
          } else {
            const __m256i ae = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xa + at));
            const __m256i ao = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xa + at + 32));
            s = _mm256_add_epi32(dot4_signed(ev[r], xe, ae), dot4_signed(od[r], xo, ao));
          }
          acc[i][r][c % kAlt] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[i][r][c % kAlt]);
        }
      }
    };
    for (int64_t c = 0; c < whole; ++c) step(false, c);
    if (whole < chunks) step(true, whole);  // the last 32 columns
    for (int i = 0; i < MT; ++i) {
      float v[R];
      if constexpr (R == 4) {
        _mm_storeu_ps(v, reduce4(acc[i][0][0], acc[i][1][0], acc[i][2][0], acc[i][3][0]));
      } else {
        for (int r = 0; r < R; ++r) {
          __m256 sum = acc[i][r][0];
          for (int u = 1; u < kAlt; ++u) sum = _mm256_add_ps(sum, acc[i][r][u]);
          v[r] = hsum(sum);
        }
      }
      for (int r = 0; r < R; ++r) out[(m0 + i) * N + n + r] = v[r] * row_scale[r];
    }
  }
}

// weight rows in passes of R (four for one activation row, two for more: 16 ymm registers), the rest one at a time
template <int MT>
void rows_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t m0, int64_t n0, int64_t n1, float* out) {
  constexpr int R = MT == 1 ? 4 : 2;
  const int64_t nr = n0 + (n1 - n0) / R * R;
  rows_tile_q8<MT, R>(p, qlut, a, m0, n0, nr, out);
  rows_tile_q8<MT, 1>(p, qlut, a, m0, nr, n1, out);
}

void run_q8(const Lut& p, const uint8_t* qlut, const XQ8& a, int64_t M, float* out) {
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(p.K, 1));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + kTile <= M; m0 += kTile) rows_q8<kTile>(p, qlut, a, m0, n0, n1, out);
    switch (M - m0) {
      case 3: rows_q8<3>(p, qlut, a, m0, n0, n1, out); break;
      case 2: rows_q8<2>(p, qlut, a, m0, n0, n1, out); break;
      case 1: rows_q8<1>(p, qlut, a, m0, n0, n1, out); break;
      default: break;
    }
    if (p.sparse.row_ptr) add_outliers(p.sparse, a.xr, M, p.K, n0, n1, p.N, out);  // against the rounded x
  });
}
#endif

template <bool WIDE>
void run(const Lut& p, const float* x, int64_t M, float* out) {
  // each thread takes whole weight rows: the codes stream from memory once, every activation tile reuses them
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(p.K, 1));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    for (; m0 + kTile <= M; m0 += kTile) rows_tile<WIDE, kTile>(p, x, m0, n0, n1, out);
    switch (M - m0) {
      case 3: rows_tile<WIDE, 3>(p, x, m0, n0, n1, out); break;
      case 2: rows_tile<WIDE, 2>(p, x, m0, n0, n1, out); break;
      case 1: rows_tile<WIDE, 1>(p, x, m0, n0, n1, out); break;
      default: break;
    }
  });
}

// lut: the float32 tables, or nullptr where the caller reads tables of its own (lut_linear_q8)
Lut make_lut(const at::Tensor& codes, const at::Tensor* lut, const std::optional<at::Tensor>& row_ptr,
             const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& values, const char* who) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), who,
              ": codes must be a contiguous uint8 [N, K / 2] tensor (two 4-bit codes a byte)");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % 8 == 0, who, ": K must be a multiple of 8, got ", K);
  if (lut)
    TORCH_CHECK(lut->scalar_type() == at::kFloat && lut->dim() == 2 && lut->is_contiguous() && lut->size(0) == N &&
                    (lut->size(1) == 8 || lut->size(1) == 16),
                who, ": lut must be a contiguous float32 [N, 8] or [N, 16] tensor");
  Lut p{codes.data_ptr<uint8_t>(), lut ? lut->data_ptr<float>() : nullptr, N, K, lut ? lut->size(1) : 0, Sparse{}};
  const bool has_sparse = row_ptr.has_value() && row_ptr->defined();
  TORCH_CHECK(has_sparse == (cols.has_value() && cols->defined()) &&
                  has_sparse == (values.has_value() && values->defined()),
              who, ": row_ptr, cols and values come together (the outliers' CSR matrix) or not at all");
  if (has_sparse) {
    TORCH_CHECK(row_ptr->scalar_type() == at::kInt && row_ptr->is_contiguous() && row_ptr->numel() == N + 1, who,
                ": row_ptr must be a contiguous int32 [N + 1] tensor");
    TORCH_CHECK(cols->scalar_type() == at::kInt && cols->is_contiguous() && values->scalar_type() == at::kFloat &&
                    values->is_contiguous() && cols->numel() == values->numel(),
                who, ": cols must be int32 and values float32, both contiguous [nnz]");
    const int32_t* rp = row_ptr->data_ptr<int32_t>();
    TORCH_CHECK(rp[0] == 0 && rp[N] == cols->numel(), who, ": row_ptr must run from 0 to nnz");
    p.sparse = Sparse{rp, cols->data_ptr<int32_t>(), values->data_ptr<float>()};
  }
  return p;
}

}  // namespace

// x: [..., K] float32 or bfloat16; codes: [N, K / 2] uint8 (layout above); lut: [N, 8 | 16] float32; row_ptr,
// cols, values: the outliers' CSR matrix (int32 [N + 1], int32 [nnz], float32 [nnz]) or absent; bias: [N] or
// absent. Returns [..., N] in x's dtype; float32 arithmetic. Meant for few activation rows; any number works.
at::Tensor lut_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& lut,
                      const std::optional<at::Tensor>& row_ptr, const std::optional<at::Tensor>& cols,
                      const std::optional<at::Tensor>& values, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lut_linear: x must be float32 or bfloat16 [..., K]");
  Lut p = make_lut(codes, &lut, row_ptr, cols, values, "lut_linear");
  const int64_t K = p.K, N = p.N;
  TORCH_CHECK(x.size(-1) == K, "lut_linear: x has ", x.size(-1), " features, the codes ", K);
  const int64_t M = x.numel() / K;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "lut_linear: bias must be a contiguous [N] tensor");
  auto acc = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef BRISK_LUT_BF16
  // bfloat16 activations and table entries (round to nearest even), float32 sums; the outliers read x in float32
  auto xb = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();  // [M, K]
  at::Tensor xf;
  if (p.sparse.row_ptr) xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  if (M > 0 && N > 0) {
    const int64_t Kp = (K + kBlock - 1) / kBlock * kBlock;
    auto xd = at::empty({M, Kp}, xb.options());  // the activations in the kernel's block order
    auto* xd_bits = reinterpret_cast<uint16_t*>(xd.data_ptr<at::BFloat16>());
    deinterleave(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, Kp, xd_bits);
    run_bf16(p, xd_bits, Kp, xf.defined() ? xf.data_ptr<float>() : nullptr, M, acc.data_ptr<float>());
  }
#else
  auto xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();  // [M, K] (bf16: exact)
  if (M > 0 && N > 0) {
    if (p.E == 16) run<true>(p, xf.data_ptr<float>(), M, acc.data_ptr<float>());
    else run<false>(p, xf.data_ptr<float>(), M, acc.data_ptr<float>());
  }
#endif
  if (has_bias) acc.add_(bias->to(at::kFloat));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return acc.to(x.scalar_type()).view(sizes);
}

#ifdef BRISK_LUT_Q8
// x: [..., K] float32 or bfloat16, K a multiple of 32; codes, row_ptr, cols, values, bias: as lut_linear; qlut:
// uint8 [N, 20], per row the 16-byte uint8 table (zero point 128; a 3-bit row's entries 8 .. 15 unused) and then
// the row's float32 scale t_n (brisk.ops.lut.quantize_tables). Returns [..., N] in x's dtype: x rounded to int8 per
// 32 columns, exact int32 dot products per block, float32 scaling and sums (the layout above).
at::Tensor lut_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& qlut,
                         const std::optional<at::Tensor>& row_ptr, const std::optional<at::Tensor>& cols,
                         const std::optional<at::Tensor>& values, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lut_linear_q8: x must be float32 or bfloat16 [..., K]");
  const int64_t N = codes.size(0);
  TORCH_CHECK(qlut.scalar_type() == at::kByte && qlut.dim() == 2 && qlut.is_contiguous() && qlut.size(0) == N &&
                  qlut.size(1) == 20,
              "lut_linear_q8: qlut must be a contiguous uint8 [N, 20] tensor (brisk.ops.lut.quantize_tables)");
  Lut p = make_lut(codes, nullptr, row_ptr, cols, values, "lut_linear_q8");
  const int64_t K = p.K;
  TORCH_CHECK(x.size(-1) == K, "lut_linear_q8: x has ", x.size(-1), " features, the codes ", K);
  TORCH_CHECK(K % kQBlock == 0, "lut_linear_q8: K must be a multiple of 32, got ", K);
  const int64_t M = x.numel() / K;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "lut_linear_q8: bias must be a contiguous [N] tensor");
  auto acc = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && N > 0) {
    const int64_t Kc = (K + kChunk - 1) / kChunk * kChunk, chunks = Kc / kChunk;
    const int64_t lanes = chunks * kLanes;
    auto xc = x.contiguous();
    // one buffer: xq and xa [M, Kc] int8, start [M, lanes] int32, scale [M, lanes] float32, xr [M, K] float32
    auto buffer = at::empty({M * (2 * Kc + lanes * 8 + K * 4)}, x.options().dtype(at::kByte));
    auto* xq = reinterpret_cast<int8_t*>(buffer.data_ptr<uint8_t>());
    auto* xa = xq + M * Kc;
    auto* start = reinterpret_cast<int32_t*>(xa + M * Kc);
    auto* scale = reinterpret_cast<float*>(start + M * lanes);
    auto* xr = scale + M * lanes;
    if (xc.scalar_type() == at::kFloat) quantize_chunks(xc.data_ptr<float>(), 0, M, K, Kc, xq, xa, start, scale, xr);
    else quantize_chunks(xc.data_ptr<at::BFloat16>(), 0, M, K, Kc, xq, xa, start, scale, xr);
    const XQ8 a{Kc, xq, xa, start, scale, xr};
    run_q8(p, qlut.data_ptr<uint8_t>(), a, M, acc.data_ptr<float>());
  }
  if (has_bias) acc.add_(bias->to(at::kFloat));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return acc.to(x.scalar_type()).view(sizes);
}
#endif

// The float32 weight rows n0 .. n1 - 1 ([n1 - n0, K]): lut[n, q[n, k]] plus the outliers of those rows.
at::Tensor lut_dequantize(const at::Tensor& codes, const at::Tensor& lut, const std::optional<at::Tensor>& row_ptr,
                          const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& values, int64_t n0,
                          int64_t n1) {
  Lut p = make_lut(codes, &lut, row_ptr, cols, values, "lut_dequantize");
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= p.N, "lut_dequantize: rows [", n0, ", ", n1, ") outside [0, ", p.N, ")");
  const int64_t K = p.K;
  auto out = at::empty({n1 - n0, K}, lut.options());
  float* o = out.data_ptr<float>();
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  at::parallel_for(n0, n1, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const float* t = p.lut + n * p.E;
      const __m256 lo = _mm256_loadu_ps(t);
      const __m256 hi = p.E == 16 ? _mm256_loadu_ps(t + 8) : lo;
      const uint8_t* row = p.codes + n * (K / 2);
      float* orow = o + (n - n0) * K;
      for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(orow + k, p.E == 16 ? decode8<true>(row + k / 2, lo, hi, shifts, mask)
                                             : decode8<false>(row + k / 2, lo, hi, shifts, mask));
      if (p.sparse.row_ptr)
        for (int32_t j = p.sparse.row_ptr[n]; j < p.sparse.row_ptr[n + 1]; ++j)
          orow[p.sparse.cols[j]] += p.sparse.values[j];
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("lut_linear(Tensor x, Tensor codes, Tensor lut, Tensor? row_ptr, Tensor? cols, Tensor? values, "
        "Tensor? bias) -> Tensor", &lut_linear);
#ifdef BRISK_LUT_Q8
  m.def("lut_linear_q8(Tensor x, Tensor codes, Tensor qlut, Tensor? row_ptr, Tensor? cols, Tensor? values, "
        "Tensor? bias) -> Tensor", &lut_linear_q8);
#endif
  m.def("lut_dequantize(Tensor codes, Tensor lut, Tensor? row_ptr, Tensor? cols, Tensor? values, int n0, "
        "int n1) -> Tensor", &lut_dequantize);
}

#endif  // AVX2 + FMA: without them no ops are registered and brisk.ops.lut takes its reference path
