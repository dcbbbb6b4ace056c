// Sparse int8 weights times int8-quantized activations, for decode (M <= 8): out[M, N] = x[M, K] @ W[N, K]^T.
//
// Weight format: brisk.ops.sparse's kind 8 (the layout of sparse_linear.cpp): mask [N, K / 8] (bit l of byte b
// <=> column 8 b + l is stored), the stored signed values v (w = scale[n, g] * v) packed in row order, 16 bytes of
// padding, row_ptr [N + 1], scales [N, K / G]. Nothing new is stored: only the arithmetic differs.
//
// Why integers. sparse_linear.cpp's float kernel spends a table load, a shuffle, an int->float conversion and an
// FMA per 8 weights, plus the scalar bookkeeping of each mask byte: ~13 instructions per 8 weights against ~4 for
// brisk's dense int8 kernel, so it loses at the 0.63 bytes/weight that 50% sparsity leaves. Here, as in
// llama.cpp's Q8_0 dot products, x is quantized once per call to int8 per 32 columns (xs = max|x| / 127,
// xq = round(x / xs)), and 32 weights at a time are expanded into one 256-bit register of int8 and multiplied with
// _mm256_maddubs_epi16, which needs an unsigned operand: |w| against sign(w) * xq (the sign trick):
//
//   mask bits   m0        m1          m2        m3         (4 bytes = 32 columns)
//   values      | c0 vals | c1 vals   | c2 vals | c3 vals |   (c_i = popcount(m_i); c0 + c1 <= 16, c2 + c3 <= 16)
//               ^ v                   ^ v + c0 + c1
//   raw  = [16 bytes at v | 16 bytes at v + c0 + c1]                       (two 128-bit halves)
//   ctrl = [first[m0] | first[m1] + c0 | first[m2] | first[m3] + c2]       (8 byte-indices each, 0x80 = zero)
//   w    = pshufb(raw, ctrl)                                               (32 int8 weights, zeros in place)
//   dot  = madd(maddubs(|w|, sign(xq, w)), 1)  -> 8 int32 partial sums, exact
//   acc += float(dot) * xs[block]           per 32 columns;   tot += acc * scale[n, g]   per weight group
//
// Exactness: the integer dot is exact (|sum of a pair| <= 2 * 128 * 127 < 2^15); the only rounding besides
// float32 accumulation is x's quantization, which brisk.ops.sparse.quantize_activations_q8 reproduces bit for bit
// (same float32 division and multiply, round half to even), so the kernel equals sparse_q8_reference within
// float32 summation error.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// POPCNT for the mask bookkeeping (every AVX2 CPU has it; the build flags only name AVX2/FMA/F16C)
#pragma GCC push_options
#pragma GCC target("popcnt")

namespace {

using brisk_simd::hsum;
using brisk_simd::load_block;
using brisk_simd::with_rows;

constexpr int64_t kCols = 8;    // columns per mask byte
constexpr int64_t kBlock = 32;  // columns per activation scale and per inner step (4 mask bytes)
constexpr int kMaxRows = 8;     // activation rows per pass
// software prefetch distance of the AVX-512 path's value stream, into L2: 2 KiB measured 1.65-1.69 ms against
// 1.87-2.29 without (60 matrices of the default model, M = 1, 2 threads; 4 and 8 KiB in between)
constexpr int64_t kPrefetchBytes512 = 2048;

// Byte-shuffle indices per mask byte: first[m], lane l <- packed byte rank_m(l), or 0x80 where column l is not
// stored (the shuffle writes a zero). The second mask byte of each 128-bit half reads its values after the first
// byte's c values: offset[c0][c2] adds c0 to lanes 8-15 and c2 to lanes 24-31 (0x80 + c keeps its top bit, so
// zeros stay zeros). 4.6 KiB in all, so the tables stay in L1 next to the weight stream; a [9][256] table of
// pre-offset indices (18 KiB) or one indexed by both bytes (1 MiB) measured slower with unstructured masks.
struct Tables {
  alignas(16) int8_t first[256][8];
  alignas(32) int8_t offset[9][9][32];
  Tables() {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int l = 0; l < 8; ++l) first[m][l] = (m >> l) & 1 ? static_cast<int8_t>(rank++) : static_cast<int8_t>(-128);
    }
    for (int c0 = 0; c0 <= 8; ++c0)
      for (int c2 = 0; c2 <= 8; ++c2)
        for (int l = 0; l < 32; ++l) offset[c0][c2][l] = static_cast<int8_t>((l / 8) % 2 == 0 ? 0 : (l < 16 ? c0 : c2));
  }
};
const Tables kTables;

// 8 byte-indices at `lo` in the low half, 8 at `hi` in the high half of a 128-bit shuffle control.
inline __m128i control(const int8_t* lo, const int8_t* hi) {
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo));
  return _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(a), reinterpret_cast<const double*>(hi)));
}

// The 32 weights of mask bits `mm` (4 mask bytes) as int8 lanes; `v` advances past the consumed values.
inline __m256i expand(const uint8_t*& v, uint32_t mm) {
  const uint32_t m0 = mm & 0xFF, m1 = (mm >> 8) & 0xFF, m2 = (mm >> 16) & 0xFF, m3 = mm >> 24;
  const int c0 = __builtin_popcount(m0), c01 = __builtin_popcount(mm & 0xFFFF), c2 = __builtin_popcount(m2);
  const __m128i clo = control(kTables.first[m0], kTables.first[m1]);
  const __m128i chi = control(kTables.first[m2], kTables.first[m3]);
  const __m256i ctrl = _mm256_add_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(clo), chi, 1),
                                       _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.offset[c0][c2])));
  const __m256i raw = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + c01)), 1);
  v += __builtin_popcount(mm);
  return _mm256_shuffle_epi8(raw, ctrl);
}

struct Q8 {
  const uint8_t* mask;     // [N, nmask]
  const int64_t* row_ptr;  // [N + 1]
  const uint8_t* values;   // int8 values as bytes
  const float* scales;     // [N, ngroups]
  int64_t nmask;           // K / 8
  int64_t nblocks;         // ceil(K / 32): 32-column steps per row (the last may be partial)
  int64_t ngroups;
  int64_t blocks_per_group;  // 32-column steps per weight group (ngroups == 1: all of them)
};

// Weight row n's 32-column steps, group by group: step(j, mm, a) for step j with its 32 mask bits mm, adding into
// the accumulator set a; with one or two activation rows the full steps alternate between two sets (two FMA chains
// in flight). At each group's end its scale is applied; then out[m * ldo + n] = the row's sum (+ bias). Only a
// row's last step can be partial (K % 32 != 0), and it is kept out of the loops: with its byte loop inside them GCC
// spilled the row's pointers to the stack (1.5-2x slower).
template <int MT, typename Step>
inline __attribute__((always_inline)) void row_steps(const Q8& p, int64_t n, Step&& step, const float* bias,
                                                     float* out, int64_t ldo) {
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m256 acc[NA][MT], tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
    for (int a = 0; a < NA; ++a) acc[a][m] = _mm256_setzero_ps();
  }
  const uint8_t* mrow = p.mask + n * p.nmask;
  const float* ws = p.scales + n * p.ngroups;
  auto word = [&](int64_t j) __attribute__((always_inline)) {
    uint32_t mm;
    std::memcpy(&mm, mrow + 4 * j, 4);
    return mm;
  };
  const int64_t nfull = p.nmask / 4;  // steps whose 4 mask bytes all exist
  for (int64_t j0 = 0, g = 0; j0 < p.nblocks; j0 += p.blocks_per_group, ++g) {  // weight groups
    const int64_t j1 = std::min(p.nblocks, j0 + p.blocks_per_group), jf = std::min(j1, nfull);
    int64_t j = j0;
    if constexpr (NA == 2)
      for (; j + 2 <= jf; j += 2) {
        step(j, word(j), acc[0]);
        step(j + 1, word(j + 1), acc[1]);
      }
    for (; j < jf; ++j) step(j, word(j), acc[0]);
    if (j < j1) {  // the partial last step: its missing mask bytes are zero
      uint32_t mm = 0;
      for (int64_t b = 4 * j; b < p.nmask; ++b) mm |= static_cast<uint32_t>(mrow[b]) << (8 * (b - 4 * j));
      step(j, mm, acc[0]);
    }
    const __m256 s = _mm256_broadcast_ss(ws + g);  // end of the group: apply its scale
    for (int m = 0; m < MT; ++m) {
      __m256 t = acc[0][m];
      if constexpr (NA == 2) t = _mm256_add_ps(t, acc[1][m]);
      tot[m] = _mm256_fmadd_ps(t, s, tot[m]);
      for (int b = 0; b < NA; ++b) acc[b][m] = _mm256_setzero_ps();
    }
  }
  for (int m = 0; m < MT; ++m) out[m * ldo + n] = hsum(tot[m]) + (bias ? bias[n] : 0.f);
}

// Weight row n against MT activation rows. xq: [MT, nblocks * 32] int8 (row stride ldx); xs: [MT, nblocks].
template <int MT>
void row_tile(const Q8& p, int64_t n, const int8_t* xq, int64_t ldx, const float* xs, const float* bias, float* out,
              int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* v = p.values + p.row_ptr[n];
  auto step = [&](int64_t j, uint32_t mm, __m256* a) __attribute__((always_inline)) {  // mm: 32 mask bits
    const __m256i w = expand(v, mm);
    const __m256i aw = _mm256_abs_epi8(w);  // -128 stays 0x80, which maddubs reads as unsigned 128
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldx + j * kBlock));
      const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);  // [8] int32
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(xs + m * p.nblocks + j), a[m]);
    }
  };
  row_steps<MT>(p, n, step, bias, out, ldo);
}

// weight rows n0 .. n1 - 1 (each row count MT its own function: GCC allocates the row loop's registers per MT)
template <int MT>
void rows(const Q8& p, int64_t n0, int64_t n1, const int8_t* xq, int64_t ldx, const float* xs, const float* bias,
          float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) row_tile<MT>(p, n, xq, ldx, xs, bias, out, ldo);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI2__) && \
    defined(__AVX512VNNI__)
#define BRISK_SPARSE_Q8_512 1
// AVX-512 (VBMI2 + VNNI on 256-bit registers): vpexpandb puts the next popcount(mask) stored values into the bytes
// whose mask bit is set and zeros elsewhere (the tables, shuffles and offsets above in one instruction), and
// vpdpbusd multiplies 32 weight bytes with 32 activation bytes into 8 int32 sums of 4. vpdpbusd wants its first
// operand unsigned, so the weights are flipped to u = v + 128 (XOR 0x80; a pruned weight becomes 128, v = 0) and
// the sum corrected by -128 * (sum of the lane's 4 activations), which depends on x only: `xc`, made once per call,
// is where each lane's sum starts. Lane L covers columns 4 L .. 4 L + 3, inside 32-column block L / 8, so `xl`
// holds that block's activation scale for each lane; the int32 sums are exact (|4 * 255 * 128| < 2^31).
//
//   w   = expand(mask32, values ^ 0x80) over 0x80        32 bytes, u = v + 128
//   d   = dpbusd(xc, w, xq)                              8 x int32 = sum over 4 bytes of v * xq   (exact)
//   acc = fma(float(d), xl, acc)                         per 32 columns;  tot += acc * scale   per weight group
//
// 256-bit, because the 512-bit form (64 columns a step) measured slower on the Zen 5 VM: 1.2-1.5 ms against 0.8-0.9
// ms for 60 decoder matrices of the default model at M = 1, 2 threads.
template <int MT>
void row_tile_512(const Q8& p, int64_t n, const int8_t* xq, int64_t ldx, const int32_t* xc, const float* xl,
                  int64_t ldl, const float* bias, float* out, int64_t ldo) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* v = p.values + p.row_ptr[n];
  // mm: the step's 32 mask bits
  auto step = [&](int64_t j, uint32_t mm, __m256* a) __attribute__((always_inline)) {
    // The flip goes first and the expand merges into the flipped zero (0x80), which also avoids the zero-masking
    // form: on Zen 5 that waits for the previous value of its destination register and so chains every step of
    // the row (measured 2.1x slower). The asm keeps the register form: GCC would fold the load into the memory
    // form, which is slower.
    if ((j & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(v) + kPrefetchBytes512, _MM_HINT_T1);
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
    asm("" : "+v"(raw));
    const __m256i w = _mm256_mask_expand_epi8(flip, mm, _mm256_xor_si256(raw, flip));
    v += _mm_popcnt_u32(mm);
    for (int m = 0; m < MT; ++m) {
      const __m256i d = _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + m * ldl + 8 * j)),
                                            w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldx + kBlock * j)));
      a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(xl + m * ldl + 8 * j), a[m]);
    }
  };
  row_steps<MT>(p, n, step, bias, out, ldo);
}

template <int MT>
void rows_512(const Q8& p, int64_t n0, int64_t n1, const int8_t* xq, int64_t ldx, const int32_t* xc, const float* xl,
              int64_t ldl, const float* bias, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) row_tile_512<MT>(p, n, xq, ldx, xc, xl, ldl, bias, out, ldo);
}

// Per 4-column lane of the quantized x: xc = -128 * (sum of its 4 int8 values), xl = its block's scale.
void lane_terms(const int8_t* xq, const float* xs, int64_t M, int64_t nblocks, int32_t* xc, float* xl) {
  const int64_t lanes = nblocks * 8;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t L = 0; L < lanes; ++L) {
      const int8_t* q = xq + m * nblocks * kBlock + 4 * L;
      xc[m * lanes + L] = -128 * (q[0] + q[1] + q[2] + q[3]);
      xl[m * lanes + L] = xs[m * nblocks + L / 8];
    }
}
#endif

// x [M, K] float32 -> xq [M, nblocks * 32] int8 (zeros past K), xs [M, nblocks]: per 32 columns
// xs = amax / 127, xq = round_half_even(x * (127 / amax)) (0 where amax == 0).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t nblocks, int8_t* xq, float* xs) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) float pad[kBlock];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < nblocks; ++j) {
      const float* src = x + m * K + j * kBlock;
      if (j * kBlock + kBlock > K) {  // partial last block: zero-padded copy
        std::fill(pad, pad + kBlock, 0.f);
        std::memcpy(pad, src, sizeof(float) * (K - j * kBlock));
        src = pad;
      }
      __m256 f[4];
      const float amax = load_block(src, f);
      xs[m * nblocks + j] = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));  // round half to even
      // packs interleave the 128-bit halves: [q0 lo, q1 lo, q2 lo, q3 lo | q0 hi, ...] in dwords of 4 bytes
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * nblocks * kBlock + j * kBlock),
                          _mm256_permutevar8x32_epi32(b, order));
    }
  }
}

}  // namespace

// x: [M, K] float32; mask [N, K / 8] uint8; row_ptr [N + 1] int64; values: uint8 view of the int8 values (+ 16
// bytes of padding); scales [N, K / G] float32 (G a multiple of 32, or G == K); bias [N] or absent -> [M, N].
at::Tensor sparse_q8_linear(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& row_ptr,
                            const at::Tensor& values, const at::Tensor& scales, int64_t group_size,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "sparse_q8_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % kCols == 0, "sparse_q8_linear: in_features must be a positive multiple of 8");
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 2 && mask.is_contiguous() && mask.size(1) == K / kCols,
              "sparse_q8_linear: mask must be a contiguous uint8 [N, K / 8] tensor");
  const int64_t N = mask.size(0);
  TORCH_CHECK(row_ptr.scalar_type() == at::kLong && row_ptr.dim() == 1 && row_ptr.is_contiguous() &&
              row_ptr.numel() == N + 1, "sparse_q8_linear: row_ptr must be a contiguous int64 [N + 1] tensor");
  TORCH_CHECK(values.scalar_type() == at::kByte && values.dim() == 1 && values.is_contiguous() &&
              values.numel() >= row_ptr.data_ptr<int64_t>()[N] + 32,
              "sparse_q8_linear: values must be contiguous uint8 [nnz + 32] (32 bytes of padding)");
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && (group_size % kBlock == 0 || group_size == K),
              "sparse_q8_linear: group_size must divide K and be a multiple of 32 (or K itself)");
  const int64_t ngroups = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == N && scales.size(1) == ngroups,
              "sparse_q8_linear: scales must be float32 [N, K / group_size]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "sparse_q8_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  Q8 p{};
  p.mask = mask.data_ptr<uint8_t>();
  p.row_ptr = row_ptr.data_ptr<int64_t>();
  p.values = values.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<float>();
  p.nmask = K / kCols;
  p.nblocks = (K + kBlock - 1) / kBlock;
  p.ngroups = ngroups;
  p.blocks_per_group = ngroups == 1 ? p.nblocks : group_size / kBlock;
  // xq: [M, nblocks * 32] int8, xs: [M, nblocks] float32 (and the AVX-512 path's xc, xl: [M, nblocks * 8] int32 /
  // float32), computed once and shared by all N rows, in a per-thread scratch buffer that only grows: at decode the
  // op runs ~120 times a step, and four tensor allocations a call were a measurable share of its ~10-50 us
  const int64_t ldx = p.nblocks * kBlock, ldl = p.nblocks * 8;
  auto round64 = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t q_bytes = round64(M * ldx), s_bytes = round64(M * p.nblocks * 4), l_bytes = round64(M * ldl * 4);
  thread_local std::vector<uint8_t> scratch;
  const int64_t need = q_bytes + s_bytes + 2 * l_bytes + 64;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* s = reinterpret_cast<float*>(base + q_bytes);
  quantize_rows(x.data_ptr<float>(), M, K, p.nblocks, q, s);
  float* o = out.data_ptr<float>();
  // grain: rows per task such that a task streams >= ~32 KiB (estimated from the average row)
  const int64_t total = p.row_ptr[N] - p.row_ptr[0] + N * p.nmask;
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, total / N));
#ifdef BRISK_SPARSE_Q8_512
  int32_t* c = reinterpret_cast<int32_t*>(base + q_bytes + s_bytes);  // ldl 4-column lanes per row
  float* l = reinterpret_cast<float*>(base + q_bytes + s_bytes + l_bytes);
  lane_terms(q, s, M, p.nblocks, c, l);
#endif
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows)
      with_rows(std::min<int64_t>(kMaxRows, M - m), [&](auto mt) {
#ifdef BRISK_SPARSE_Q8_512
        rows_512<decltype(mt)::value>(p, n0, n1, q + m * ldx, ldx, c + m * ldl, l + m * ldl, ldl, b, o + m * N, N);
#else
        rows<decltype(mt)::value>(p, n0, n1, q + m * ldx, ldx, s + m * p.nblocks, b, o + m * N, N);
#endif
      });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("sparse_q8_linear(Tensor x, Tensor mask, Tensor row_ptr, Tensor values, Tensor scales, int group_size, "
        "Tensor? bias) -> Tensor", &sparse_q8_linear);
}

#pragma GCC pop_options

#endif  // AVX2 + FMA: without them no op is registered and brisk.ops.sparse takes its other paths
