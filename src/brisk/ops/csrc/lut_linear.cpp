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

Lut make_lut(const at::Tensor& codes, const at::Tensor& lut, const std::optional<at::Tensor>& row_ptr,
             const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& values, const char* who) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), who,
              ": codes must be a contiguous uint8 [N, K / 2] tensor (two 4-bit codes a byte)");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % 8 == 0, who, ": K must be a multiple of 8, got ", K);
  TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.dim() == 2 && lut.is_contiguous() && lut.size(0) == N &&
                  (lut.size(1) == 8 || lut.size(1) == 16),
              who, ": lut must be a contiguous float32 [N, 8] or [N, 16] tensor");
  Lut p{codes.data_ptr<uint8_t>(), lut.data_ptr<float>(), N, K, lut.size(1), Sparse{}};
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
  Lut p = make_lut(codes, lut, row_ptr, cols, values, "lut_linear");
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

// The float32 weight rows n0 .. n1 - 1 ([n1 - n0, K]): lut[n, q[n, k]] plus the outliers of those rows.
at::Tensor lut_dequantize(const at::Tensor& codes, const at::Tensor& lut, const std::optional<at::Tensor>& row_ptr,
                          const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& values, int64_t n0,
                          int64_t n1) {
  Lut p = make_lut(codes, lut, row_ptr, cols, values, "lut_dequantize");
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
  m.def("lut_dequantize(Tensor codes, Tensor lut, Tensor? row_ptr, Tensor? cols, Tensor? values, int n0, "
        "int n1) -> Tensor", &lut_dequantize);
}

#endif  // AVX2 + FMA: without them no ops are registered and brisk.ops.lut takes its reference path
