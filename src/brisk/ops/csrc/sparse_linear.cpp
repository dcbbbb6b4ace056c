// Sparse linear for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W stored compressed (zeros not stored).
//
// Why: batch-1 decode reads every weight once per token and is bound by memory bandwidth, so a 50% sparse matrix
// is only faster if fewer bytes come from memory. The format (made by brisk.ops.sparse) is a bitmask plus the
// nonzero values packed in row order (CSR order without column indices):
//
//   mask    [N, K / 8] uint8    bit l of byte b of row n set  <=>  W[n, 8 b + l] is stored
//   row_ptr [N + 1]    int64    row n's values are entries row_ptr[n] .. row_ptr[n + 1] - 1 of `values`
//   values  float32 (kind 32); signed 8-bit values v = q - zero of a symmetric code (kind 8: w = scale * v); or
//           unsigned 4-bit codes two per byte, the entry with the even index in the low nibble (kind 4:
//           w = scale * q + min, as in quant_linear.cpp); padded so that a 16-byte load at the last entry stays
//           inside the buffer
//   scales [N, K / G] float32 (kinds 8 and 4), mins [N, K / G] float32 (kind 4)
//
// Bytes per weight at sparsity s: (1 - s) * 4 + 1/8 (float32), (1 - s) + 1/8 (int8), (1 - s) / 2 + 1/8 (int4),
// plus the group scales: at s = 0.5, 2.13 / 0.63 / 0.38 against 4 / 1 / 0.5 dense. 2:4 is a bitmask with two bits
// in every nibble: 1 bit per weight of metadata, the same as 2-bit indices per kept value, so it uses this format.
//
// Decoding 8 columns (one mask byte mb) in registers, with p = popcount(mb) values at the stream position:
//
//   values:   v0 v1 v2 v3 v4 .. (8 loaded, p of them ours)      mb = 0b01101001
//   perm[mb]: lane l <- value index rank(l)                     lanes 0 3 5 6 kept
//   w:        [v0, 0, 0, v1, 0, v2, v3, 0]                      permute, then AND with keep[mb] zeroes the rest
//
// then the stream advances by p. perm, keep (and top, below) are 256-entry tables of 8 KiB each; they stay in L1. The decoded 8
// weights are multiplied into every activation row of the call (M <= 8 in one pass), so the weights stream from
// memory once per call. 4-bit codes are widened to int32 before the permute and dequantized (w = s q + m) before
// the AND. 8-bit values take a cheaper road, because at 0.63 bytes per weight the decode, not memory, would be the
// limit: one byte shuffle of the 16 bytes at the stream position (broadcast to both 128-bit halves) puts value
// rank(l) in the top byte of lane l and zeros elsewhere, so the lane is v * 2^24 as a signed int32 and a stored zero
// comes for free; the 2^-24 goes into the group scale, applied once per group and activation row.
//
// Measured on the 2-core AVX2 VM (notes/issue7_sparse_results.md): float32 at 50% is ~2x the dense GEMV
// (linear_small.cpp); int8 and int4 stay slower than quant_linear.cpp's dense kernels, which decode 32 weights with
// a handful of instructions and already run near the bandwidth limit, so brisk.ops.sparse only converts float32
// layers automatically.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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
using brisk_simd::with_rows;

constexpr int64_t kCols = 8;           // columns per mask byte
constexpr int kMaxRows = 8;            // activation rows per pass (one accumulator each)
constexpr int64_t kPrefetchBytes = 1024;  // software prefetch distance in the value stream (as quant_linear.cpp)
// row_tile_f32_x's, into L2 (the Zen 5 machine, see linear_small.cpp): 4 KiB measured 2.2-2.5 ms against 2.6-2.8
// for 1 KiB (60 matrices of the default model at 50%, M = 1, 2 threads; 8 KiB in between)
constexpr int64_t kPrefetchBytes512 = 4096;

struct Tables {
  alignas(32) int32_t perm[256][8];
  alignas(32) int32_t keep[256][8];
  alignas(32) int8_t top[256][32];  // byte shuffle: lane l <- [0, 0, 0, value byte rank(l)], or 0 if not stored
  uint8_t count[256];  // popcount, from a table: the build flags do not enable the POPCNT instruction
  Tables() {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int l = 0; l < 8; ++l) {
        const bool on = (m >> l) & 1;
        perm[m][l] = on ? rank++ : 0;
        keep[m][l] = on ? -1 : 0;
        for (int j = 0; j < 3; ++j) top[m][4 * l + j] = -128;  // 0x80: the byte shuffle writes a zero
        top[m][4 * l + 3] = on ? static_cast<int8_t>(perm[m][l]) : -128;
      }
      count[m] = static_cast<uint8_t>(rank);
    }
  }
};
const Tables kTables;

struct SW {
  const uint8_t* mask;     // [N, nblocks]
  const int64_t* row_ptr;  // [N + 1]
  const uint8_t* values;   // byte view of the value stream
  const float* scales;     // [N, ngroups] (codes only)
  const float* mins;       // [N, ngroups] (codes only)
  int64_t nblocks;         // K / 8
  int64_t ngroups;
  int64_t blocks_per_group;
};

// The next 8 4-bit stream entries at position `pos` (in entries) as int32 lanes, before the permute.
inline __m256i load_codes4(const uint8_t* v, int64_t pos) {
  uint64_t raw;
  std::memcpy(&raw, v + (pos >> 1), 8);
  raw >>= 4 * (pos & 1);  // entry `pos` to the low nibble; 8 entries = the low 32 bits
  const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(raw));
  const __m128i nib = _mm_set1_epi8(0x0F);
  // bytes [lo0, hi0, lo1, hi1, ...] = entries 0, 1, 2, 3, ... in order
  const __m128i e = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
  return _mm256_cvtepu8_epi32(e);
}

#ifdef __AVX512VL__
// float32 values on AVX-512: vexpandps puts the next popcount(mb) values at v into the lanes whose bit is set and
// zeros elsewhere, the AVX2 path's permute and AND in one instruction. Written as a merge into a fresh zero
// register: the zero-masking form waits for the previous value of its destination register on Zen 5, which chains
// every expand of a row one after another (2x slower). The asm keeps the register form: GCC would fold the load
// into the memory form, which measured slower. 256-bit: the 512-bit form was no faster on the Zen 5 VM.
inline __m256 expand_f32(const float* v, uint32_t mb) {
  __m256 raw = _mm256_loadu_ps(v), zero = _mm256_setzero_ps();
  asm("" : "+v"(raw), "+v"(zero));
  return _mm256_mask_expand_ps(zero, static_cast<__mmask8>(mb), raw);
}
#endif

// Weights of one mask byte, zeros where the mask is clear; `pos` advances past the consumed entries.
// s, mn: the block's group scale and min (codes only).
template <int KIND>
inline __m256 expand(const uint8_t* v, int64_t& pos, uint32_t mb, __m256 s, __m256 mn) {
  if constexpr (KIND == 8) {  // v * 2^24 in every stored lane, 0 elsewhere (see the top of the file)
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + pos)));
    const __m256i shuffle = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.top[mb]));
    pos += kTables.count[mb];
    return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(raw, shuffle));
  } else {
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.perm[mb]));
    const __m256 keep = _mm256_load_ps(reinterpret_cast<const float*>(kTables.keep[mb]));
    __m256 w;
    if constexpr (KIND == 32) {
#ifdef __AVX512VL__
      const __m256 e = expand_f32(reinterpret_cast<const float*>(v) + pos, mb);
      pos += kTables.count[mb];
      return e;
#else
      w = _mm256_permutevar8x32_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(v) + pos), perm);
#endif
    } else {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(load_codes4(v, pos), perm));
      w = _mm256_fmadd_ps(q, s, mn);
    }
    pos += kTables.count[mb];
    return _mm256_and_ps(w, keep);
  }
}

template <int KIND>
constexpr int64_t stream_bytes(int64_t entries) {
  return KIND == 32 ? 4 * entries : (KIND == 8 ? entries : entries / 2);
}

// Weight row n against MT activation rows x[0 .. MT-1] (row stride K). With one or two activation rows the blocks
// alternate between two accumulator sets, so two FMA chains are in flight.
template <int KIND, int MT>
void row_tile(const SW& p, int64_t n, const float* x, int64_t K, const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT <= 2 ? 2 : 1;
  __m256 acc[NA][MT];
  for (int a = 0; a < NA; ++a)
    for (int m = 0; m < MT; ++m) acc[a][m] = _mm256_setzero_ps();
  const uint8_t* mrow = p.mask + n * p.nblocks;
  int64_t pos = p.row_ptr[n];
  __m256 s = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
  const float* sp = KIND == 32 ? nullptr : p.scales + n * p.ngroups;
  const float* mp = KIND == 4 ? p.mins + n * p.ngroups : nullptr;
  __m256 tot[MT];  // kind 8: sum over finished groups of scale * dot(v, x)
  for (int m = 0; m < MT; ++m) tot[m] = _mm256_setzero_ps();
  const __m256 unshift = _mm256_set1_ps(1.f / 16777216.f);  // 2^-24 (kind 8 values sit in the top byte)
  int64_t left = KIND == 8 ? p.blocks_per_group : 0;  // blocks left in the current group
  auto step = [&](int64_t b, __m256* a) {
    if constexpr (KIND == 4) {  // the group's scale and min enter the decode
      if (left == 0) {
        s = _mm256_broadcast_ss(sp++);
        mn = _mm256_broadcast_ss(mp++);
        left = p.blocks_per_group;
      }
      --left;
    }
    _mm_prefetch(reinterpret_cast<const char*>(p.values) + stream_bytes<KIND>(pos) + kPrefetchBytes, _MM_HINT_T0);
    const __m256 w = expand<KIND>(p.values, pos, mrow[b], s, mn);
    const float* xb = x + b * kCols;
    for (int m = 0; m < MT; ++m) a[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + m * K), a[m]);
    if constexpr (KIND == 8) {  // end of a group: tot += scale * 2^-24 * (both accumulator sets)
      if (--left == 0) {
        left = p.blocks_per_group;
        const __m256 sc = _mm256_mul_ps(_mm256_broadcast_ss(sp++), unshift);
        for (int m = 0; m < MT; ++m) {
          __m256 t = acc[0][m];
          if constexpr (NA == 2) t = _mm256_add_ps(t, acc[1][m]);
          tot[m] = _mm256_fmadd_ps(t, sc, tot[m]);
          for (int j = 0; j < NA; ++j) acc[j][m] = _mm256_setzero_ps();
        }
      }
    }
  };
  int64_t b = 0;
  if constexpr (NA == 2)
    for (; b + 2 <= p.nblocks; b += 2) {
      step(b, acc[0]);
      step(b + 1, acc[1]);
    }
  for (; b < p.nblocks; ++b) step(b, acc[0]);
  for (int m = 0; m < MT; ++m) {
    __m256 t = tot[m];
    if constexpr (KIND != 8) {
      t = acc[0][m];
      if constexpr (NA == 2) t = _mm256_add_ps(t, acc[NA - 1][m]);
    }
    out[m * ldo + n] = hsum(t) + (bias ? bias[n] : 0.f);
  }
}

#ifdef __AVX512VL__
// float32 values on AVX-512: as row_tile, with vexpandps (see expand) and 32 columns (4 mask bytes) a step, so the
// mask bookkeeping, the popcounts (the instruction) and one prefetch are shared by four expands, and with one
// activation row four accumulators keep four FMA chains in flight. 1.2-1.3x row_tile's speed at M = 1.
template <int MT>
__attribute__((target("popcnt"))) void row_tile_f32_x(const SW& p, int64_t n, const float* x, int64_t K,
                                                      const float* bias, float* out, int64_t ldo) {
  constexpr int NA = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  __m256 acc[NA][MT];
  for (int a = 0; a < NA; ++a)
    for (int m = 0; m < MT; ++m) acc[a][m] = _mm256_setzero_ps();
  const uint8_t* mrow = p.mask + n * p.nblocks;
  const float* v = reinterpret_cast<const float*>(p.values) + p.row_ptr[n];
  auto block = [&](uint32_t mb, const float* xb, __m256* a) __attribute__((always_inline)) {
    const __m256 w = expand_f32(v, mb);
    v += _mm_popcnt_u32(mb);
    for (int m = 0; m < MT; ++m) a[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + m * K), a[m]);
  };
  int64_t b = 0;
  for (; b + 4 <= p.nblocks; b += 4) {
    uint32_t mm;
    std::memcpy(&mm, mrow + b, 4);
    _mm_prefetch(reinterpret_cast<const char*>(v) + kPrefetchBytes512, _MM_HINT_T1);
    const float* xb = x + b * kCols;
    for (int i = 0; i < 4; ++i) block((mm >> (8 * i)) & 0xFF, xb + i * kCols, acc[i % NA]);
  }
  for (; b < p.nblocks; ++b) block(mrow[b], x + b * kCols, acc[0]);
  for (int m = 0; m < MT; ++m) {
    __m256 t = acc[0][m];
    for (int a = 1; a < NA; ++a) t = _mm256_add_ps(t, acc[a][m]);
    out[m * ldo + n] = hsum(t) + (bias ? bias[n] : 0.f);
  }
}
#endif

template <int KIND, int MT>
void rows(const SW& p, int64_t n0, int64_t n1, const float* x, int64_t K, const float* bias, float* out,
          int64_t ldo) {
#ifdef __AVX512VL__
  if constexpr (KIND == 32) {
    for (int64_t n = n0; n < n1; ++n) row_tile_f32_x<MT>(p, n, x, K, bias, out, ldo);
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) row_tile<KIND, MT>(p, n, x, K, bias, out, ldo);
}

template <int KIND>
void run(const SW& p, const float* x, int64_t M, int64_t N, int64_t K, const float* bias, float* out) {
  // grain: rows per task such that a task streams >= ~32 KiB (estimated from the average row)
  const int64_t total = stream_bytes<KIND>(p.row_ptr[N] - p.row_ptr[0]) + N * p.nblocks;
  const int64_t row_bytes = std::max<int64_t>(1, total / std::max<int64_t>(N, 1));
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // more than kMaxRows activation rows: the weights are decoded again per pass (the Python side sends such
    // calls to the densify + GEMM path; this keeps the op correct for any M)
    for (int64_t m = 0; m < M; m += kMaxRows)
      with_rows(std::min<int64_t>(kMaxRows, M - m), [&](auto mt) {
        rows<KIND, decltype(mt)::value>(p, n0, n1, x + m * K, K, bias, out + m * N, N);
      });
  });
}

template <typename F>
void dispatch(int64_t kind, F&& f) {
  switch (kind) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

int64_t entry_bytes_needed(int64_t kind, int64_t entries) {
  // a load at the last entry reads up to 8 entries further (8-bit: 16 bytes, and sparse_q8.cpp's AVX-512 path 32;
  // 4-bit: 8 bytes from the entry's byte)
  return kind == 32 ? 4 * (entries + 8) : (kind == 8 ? entries + 32 : entries / 2 + 8);
}

SW make_sw(const at::Tensor& mask, const at::Tensor& row_ptr, const at::Tensor& values,
           const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins, int64_t kind,
           int64_t group_size, int64_t K) {
  TORCH_CHECK(kind == 32 || kind == 8 || kind == 4, "sparse_linear: kind must be 32 (float32), 8 or 4 (codes)");
  TORCH_CHECK(K > 0 && K % kCols == 0, "sparse_linear: in_features must be a positive multiple of 8");
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 2 && mask.is_contiguous() && mask.size(1) == K / kCols,
              "sparse_linear: mask must be a contiguous uint8 [N, K / 8] tensor");
  const int64_t N = mask.size(0);
  TORCH_CHECK(row_ptr.scalar_type() == at::kLong && row_ptr.dim() == 1 && row_ptr.is_contiguous() &&
              row_ptr.numel() == N + 1, "sparse_linear: row_ptr must be a contiguous int64 [N + 1] tensor");
  TORCH_CHECK(values.is_contiguous() && values.dim() == 1 &&
              values.scalar_type() == (kind == 32 ? at::kFloat : at::kByte),
              "sparse_linear: values must be a contiguous 1-d float32 (kind 32) or uint8 (codes) tensor");
  const int64_t last = row_ptr.data_ptr<int64_t>()[N];  // (a raw read: Tensor::item costs ~2 us a call)
  TORCH_CHECK(values.numel() * values.element_size() >= entry_bytes_needed(kind, last),
              "sparse_linear: values is shorter than row_ptr says (missing the 8-entry padding?)");
  SW p{};
  p.mask = mask.data_ptr<uint8_t>();
  p.row_ptr = row_ptr.data_ptr<int64_t>();
  p.values = static_cast<const uint8_t*>(values.data_ptr());
  p.nblocks = K / kCols;
  p.ngroups = 1;
  p.blocks_per_group = p.nblocks;
  if (kind != 32) {
    TORCH_CHECK(group_size > 0 && group_size % kCols == 0 && K % group_size == 0,
                "sparse_linear: group_size must be a multiple of 8 that divides K");
    TORCH_CHECK(scales.has_value() && scales->defined() && (kind == 8 || (mins.has_value() && mins->defined())),
                "sparse_linear: 8-bit values need scales, 4-bit codes scales and mins");
    p.ngroups = K / group_size;
    p.blocks_per_group = group_size / kCols;
    std::vector<const at::Tensor*> params{&*scales};
    if (kind == 4) params.push_back(&*mins);
    for (const at::Tensor* t : params)
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                  t->size(1) == p.ngroups, "sparse_linear: scales and mins must be float32 [N, K / group_size]");
    p.scales = scales->data_ptr<float>();
    p.mins = kind == 4 ? mins->data_ptr<float>() : nullptr;
  }
  return p;
}

}  // namespace

// x: [M, K] float32; the compressed weight as above; bias: [N] float32 or absent -> [M, N] float32.
at::Tensor sparse_linear(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& row_ptr,
                         const at::Tensor& values, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& mins, int64_t kind, int64_t group_size,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "sparse_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  SW p = make_sw(mask, row_ptr, values, scales, mins, kind, group_size, K);
  const int64_t N = mask.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "sparse_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  dispatch(kind, [&](auto k) { run<decltype(k)::value>(p, x.data_ptr<float>(), M, N, K, b, out.data_ptr<float>()); });
  return out;
}

// The compressed weight back to float32 [N, K] (the large-M path multiplies it with F.linear). `mask` and
// `row_ptr` may be a row slice: row_ptr holds absolute positions in `values`.
at::Tensor sparse_densify(const at::Tensor& mask, const at::Tensor& row_ptr, const at::Tensor& values,
                          const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                          int64_t kind, int64_t group_size, int64_t in_features) {
  const int64_t K = in_features;
  SW p = make_sw(mask, row_ptr, values, scales, mins, kind, group_size, K);
  const int64_t N = mask.size(0);
  auto out = at::empty({N, K}, mask.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  dispatch(kind, [&](auto k) {
    constexpr int KIND = decltype(k)::value;
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        int64_t pos = p.row_ptr[n];
        for (int64_t b = 0; b < p.nblocks; ++b) {
          __m256 s = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
          const int64_t g = n * p.ngroups + b / p.blocks_per_group;
          if constexpr (KIND != 32) s = _mm256_set1_ps(p.scales[g]);
          if constexpr (KIND == 4) mn = _mm256_set1_ps(p.mins[g]);
          __m256 w = expand<KIND>(p.values, pos, p.mask[n * p.nblocks + b], s, mn);
          if constexpr (KIND == 8) w = _mm256_mul_ps(w, _mm256_mul_ps(s, _mm256_set1_ps(1.f / 16777216.f)));
          _mm256_storeu_ps(o + n * K + b * kCols, w);
        }
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("sparse_linear(Tensor x, Tensor mask, Tensor row_ptr, Tensor values, Tensor? scales, Tensor? mins, "
        "int kind, int group_size, Tensor? bias) -> Tensor", &sparse_linear);
  m.def("sparse_densify(Tensor mask, Tensor row_ptr, Tensor values, Tensor? scales, Tensor? mins, int kind, "
        "int group_size, int in_features) -> Tensor", &sparse_densify);
}

#endif  // AVX2 + FMA: without them no ops are registered and brisk.ops.sparse takes its reference path
