// Weight-only quantized linear: out[M, N] = x[M, K] @ W_hat[N, K]^T (+ bias), W_hat decoded on the fly from
// 8/4/3/2-bit codes (affine: w = scale * q + min, min = -scale * zero) or 4-bit codebook codes (w = scale * lut[q]).
//
// Arithmetic. Per group g of G elements (G a multiple of 32, or 16), with s = scale[n, g] and m = min[n, g]:
//   dot(x_g, w_g) = s * dot(x_g, q_g) + m * sum(x_g)
// so the weights are never formed: the inner loop multiplies activations by the codes, s is applied once per
// (row, group) to the partial dot product (or, for 32-element groups, to the 4 decoded vectors of the block,
// shared by all activation rows of the tile; 16-element groups, GGUF's Q6_K / Q3_K / Q2_K as they are: vectors 0-1 of
// a block by one scale, 2-3 by the next), and the m term is one short dot(min[n, :], xsum[row, :]) per
// output, with xsum[row, g] = sum(x_g) computed once per call and shared by all N rows. Scales are float16 and
// the mins come from uint8 zero points (min = -scale * zero, exact in float32; simd.h, "Group parameters"); in the
// float-minimum form (GGUF's Q4_1 / Q5_1 / K-quants as they are, model/gguf_repack.py) `zeros` holds float16 or float32
// minimums instead, and scales may be float32 (where float16 cannot hold a K-quant's d * sc_j exactly). Each
// weight block is decoded once per tile of up to 4 activation rows, in registers, and a chunk of packed rows stays
// in L1 while the tiles of a larger M run over it: the weights stream from memory once per call.
//
// Layout (made by brisk.ops.qlinear.prepack, not the checkpoint layout): each row is cut into blocks of 32
// elements, one block in 32 * bits / 8 bytes. The decoder turns a block into 4 vectors of 8 float lanes; lane l of
// vector i holds element e = 8 i + l. The bytes are permuted so that one load (or broadcast load) puts every
// element's code in a fixed bit field of its lane:
//
//   8 bits: 32 bytes, 8 dwords; lane l = dword l, element 8 i + l in byte i          field offset 8 i
//   4 bits: 16 bytes broadcast to both 128-bit halves; lane l = dword l % 4, element 8 i + l in nibble
//           2 i + l / 4                                                               field offset 8 i + 4 (l / 4)
//   2 bits: 8 bytes broadcast to all four 64-bit quarters; lane l = dword l % 2, element 8 i + l in crumb
//           4 i + l / 2                                                               field offset 8 i + 2 (l / 2)
//   3 bits: 12 bytes holding the 12-bit fields F_l = sum_i q[8 i + l] << 3 i, F_l at bit 12 l; a byte shuffle
//           copies bytes floor(1.5 l) and floor(1.5 l) + 1 into lane l                field offset 4 (l % 2) + 3 i
//
// and the decode is a mask: and(lane, ((1 << bits) - 1) << offset) converted to float is q * 2^offset, exact.
// The factor 2^offset is folded into the activations instead, once per call: x'[e] = x[e] * 2^-offset(e), and
// x'[e] * (q_e * 2^offset(e)) == x[e] * q_e exactly (powers of two; offsets are at most 28, so only activations
// below ~3e-30 in magnitude, whose products vanish anyway, could turn subnormal). So unpacking 8 codes costs one
// AND and one int->float conversion, with no shifts or shuffles. The one exception is the top field of a lane,
// whose 2^offset could reach the int32 sign bit: vector 3 of the 8/4/2-bit layouts is shifted right first (by
// 24, 4 and 2 bits) and its offsets shrink by as much. Codebook (NF4) codes index a 16-entry table instead: a
// variable shift brings each code to bit 0, two 8-entry permutes look up both halves of the table, and a blend on
// bit 3 of the code picks one; the activations are then used as they are.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// The x86 (AVX2 + FMA) and aarch64 (NEON) builds share everything but the block decoding and the inner kernels:
// the QW view of the weights, its checks, the parallel driver and the ops. Each ISA section below defines the same
// names for the common code to call: scale_at, chunk_params, tile, prepare_x, BlockDequant, set_codebook, and the
// constants kParamsPad and kCopyFloat32X. Elsewhere no ops: brisk.ops.qlinear takes its reference path.
#if defined(__AVX2__) && defined(__FMA__)
#define BRISK_QUANT_LINEAR_X86 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define BRISK_QUANT_LINEAR_NEON 1
#endif

#if defined(BRISK_QUANT_LINEAR_X86) || defined(BRISK_QUANT_LINEAR_NEON)

#if defined(BRISK_QUANT_LINEAR_X86)
#include <immintrin.h>

#include "simd.h"
#else
#include <arm_neon.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxTileRows = 4;

struct QW {
  const uint8_t* data;     // [N, row_bytes]
  int64_t row_bytes;       // K / 32 * BPB
  const at::Half* scales = nullptr;  // [N, ngroups] float16 (simd.h, "Group parameters"), or
  const float* scales32 = nullptr;   // float32 scales
  const uint8_t* zeros = nullptr;    // [N, ngroups] zero points (min = -scale * zero); nullptr: symmetric / codebook
  const at::Half* mins16 = nullptr;  // float minimums (w = scale * q + min) instead of zero points
  const float* mins32 = nullptr;
  float zero;                // the symmetric zero point 2^(bits-1)
  int64_t ngroups;
  int64_t group;             // G: a multiple of 32, or 16 (two groups per block)
  int64_t blocks_per_group;  // G / 32 (1 for G = 16)
  int64_t nblocks;           // K / 32
#if defined(BRISK_QUANT_LINEAR_X86)
  __m256 lut_lo, lut_hi;     // codebook entries 0-7 and 8-15 (codebook mode)
#else
  uint8x16x4_t lut;          // the codebook's 16 float32 entries as 64 bytes (codebook mode)
#endif
  // a chunk's group parameters as float32 (tile reads these): rows [row0, row0 + chunk rows), made by run() from
  // scales / zeros, so the block loop reads one float per group as with float32 scales
  const float* s32 = nullptr;  // [rows, ngroups]
  const float* m32 = nullptr;  // [rows, ngroups] = -scale * zero (exact); affine codes only
  int64_t row0 = 0;
};

// group i's min (w = s q + m) as float32, given its scale sc
inline float min_at(const QW& p, int64_t i, float sc) {
  if (p.mins32) return p.mins32[i];
  if (p.mins16) return static_cast<float>(p.mins16[i]);
  return -sc * (p.zeros ? static_cast<float>(p.zeros[i]) : p.zero);
}

int64_t block_bytes(int64_t bits) { return kBlock * bits / 8; }

}  // namespace

#endif  // x86 or NEON

#if defined(BRISK_QUANT_LINEAR_X86)
// ---- x86 (AVX2 + FMA) ----

namespace {

using brisk_simd::hsum;
using brisk_simd::load8;
using brisk_simd::scale1;
using brisk_simd::scales8;
using brisk_simd::zeros8;

// software prefetch of the code stream (simd.h): on the AVX2 VM the hardware prefetcher alone left int8 at ~12 GB/s
// of ~15 at M = 1, and 1 KiB ahead into L1 brought it to ~15 (int4: 10.5 -> 11.8 GB/s); on the avx512 build's
// machine 8 KiB into L2 measured 8-14% faster for int8 codes than 1 KiB into L1 (int4: within noise)
constexpr int64_t kPrefetchBytes = brisk_simd::stream_distance(1024, 8192);
constexpr auto kPrefetchHint = brisk_simd::kStreamHint;

// the float32 copies of a chunk's group parameters get this many floats of slack: chunk_params stores whole
// vectors of 8, past the chunk's last group
constexpr int64_t kParamsPad = 8;
// the kernel reads prescaled activations (xq, see prepare_x), so float32 x is copied too
constexpr bool kCopyFloat32X = true;

// group i's scale as float32
inline float scale_at(const QW& p, int64_t i) { return p.scales32 ? p.scales32[i] : scale1(p.scales + i); }

// rows [c, c1)'s scales and mins as float32 into s32 / m32 (m32 only for affine codes)
inline void chunk_params(const QW& p, int64_t c, int64_t c1, bool affine, float* s32, float* m32) {
  const int64_t n = (c1 - c) * p.ngroups;  // the chunk's rows are consecutive: one run of n groups
  const int64_t i0 = c * p.ngroups;
  if (p.scales32 || p.mins16 || p.mins32) {  // float-minimum form (or float32 scales): element by element
    for (int64_t g = 0; g < n; ++g) {
      const int64_t i = i0 + g;
      s32[g] = p.scales32 ? p.scales32[i] : static_cast<float>(p.scales[i]);
      if (affine)
        m32[g] = p.mins32 ? p.mins32[i] : p.mins16 ? static_cast<float>(p.mins16[i])
                 : -s32[g] * (p.zeros ? static_cast<float>(p.zeros[i]) : p.zero);
    }
    return;
  }
  const at::Half* s = p.scales + i0;
  const uint8_t* z = p.zeros ? p.zeros + i0 : nullptr;
  const __m256 zv = _mm256_set1_ps(p.zero);
  for (int64_t g = 0; g < n; g += 8) {
    const int64_t k = std::min<int64_t>(8, n - g);
    const __m256 sv = scales8(s + g, k);
    _mm256_storeu_ps(s32 + g, sv);  // (the buffers have room for a whole last vector)
    if (affine)
      _mm256_storeu_ps(m32 + g, _mm256_mul_ps(sv, _mm256_sub_ps(_mm256_setzero_ps(), z ? zeros8(z + g, k) : zv)));
  }
}

// Bit offset of element 8 i + l's code within lane l of decoded vector i (after vector 3's pre-shift).
template <int BITS>
constexpr int field_offset(int i, int l) {
  if (BITS == 8) return i < 3 ? 8 * i : 0;
  if (BITS == 4) return i < 3 ? 8 * i + 4 * (l / 4) : 20 + 4 * (l / 4);
  if (BITS == 2) return i < 3 ? 8 * i + 2 * (l / 2) : 22 + 2 * (l / 2);
  return 4 * (l % 2) + 3 * i;  // 3 bits
}

// Right shift applied to the block before decoding vector 3, so that no field reaches the int32 sign bit.
template <int BITS>
constexpr int top_shift() { return BITS == 8 ? 24 : (BITS == 4 ? 4 : (BITS == 2 ? 2 : 0)); }

template <int BITS, int I>
inline __m256i field_mask() {
  constexpr int q = (1 << BITS) - 1;
  return _mm256_setr_epi32(q << field_offset<BITS>(I, 0), q << field_offset<BITS>(I, 1),
                           q << field_offset<BITS>(I, 2), q << field_offset<BITS>(I, 3),
                           q << field_offset<BITS>(I, 4), q << field_offset<BITS>(I, 5),
                           q << field_offset<BITS>(I, 6), q << field_offset<BITS>(I, 7));
}

// Shift counts that bring each lane's code of vector I to bit 0 (codebook mode, 4 bits).
template <int I>
inline __m256i code_shift() {
  constexpr int t = I == 3 ? top_shift<4>() : 0;
  return _mm256_setr_epi32(field_offset<4>(I, 0) + t, field_offset<4>(I, 1) + t, field_offset<4>(I, 2) + t,
                           field_offset<4>(I, 3) + t, field_offset<4>(I, 4) + t, field_offset<4>(I, 5) + t,
                           field_offset<4>(I, 6) + t, field_offset<4>(I, 7) + t);
}

// The 2^-offset factor of element e (0..31) of a block: activations are multiplied by it once per call.
template <int BITS, bool LUT>
float x_factor(int e) {
  return LUT ? 1.f : std::ldexp(1.f, -field_offset<BITS>(e / 8, e % 8));
}

// One block (32 elements) at p as a vector whose lanes hold the bit fields described at the top of the file.
// `tail`: the block is the last of its row, so the 3-bit loader must not read past its 12 bytes.
template <int BITS>
inline __m256i load_block(const uint8_t* p, bool tail) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else if constexpr (BITS == 4) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (BITS == 2) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
  } else {
    static_assert(BITS == 3, "bits must be 8, 4, 3 or 2");
    __m128i raw;
    if (tail) {  // 8 + 4 bytes: never touch the byte after the row
      int32_t hi;
      std::memcpy(&hi, p + 8, 4);
      raw = _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), hi, 2);
    } else {
      raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // 4 bytes of the next block ride along
    }
    // lane l <- bytes floor(1.5 l), floor(1.5 l) + 1 (the shuffle works within each 128-bit half, and both halves
    // hold the same 16 bytes)
    const __m256i gather = _mm256_setr_epi8(0, 1, -1, -1, 1, 2, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1,
                                            6, 7, -1, -1, 7, 8, -1, -1, 9, 10, -1, -1, 10, 11, -1, -1);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(raw), gather);
  }
}

// codes at bit 0 of each lane (junk above bit 3 is ignored) -> codebook values: the permutes read bits 0-2, the
// blend reads the sign bit, where the shift puts bit 3
inline __m256 lookup(__m256i q, const QW& p) {
  const __m256 lo = _mm256_permutevar8x32_ps(p.lut_lo, q);
  const __m256 hi = _mm256_permutevar8x32_ps(p.lut_hi, q);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}

// Decode one block into w[0..3]: q * 2^offset (affine codes) or codebook values (LUT), lane l of w[i] being
// element 8 i + l.
template <int BITS, bool LUT>
inline void decode(const uint8_t* p, bool tail, const QW& qw, __m256 w[4]) {
  const __m256i d = load_block<BITS>(p, tail);
  if constexpr (LUT) {
    static_assert(BITS == 4, "codebook codes are 4-bit");
    w[0] = lookup(_mm256_srlv_epi32(d, code_shift<0>()), qw);
    w[1] = lookup(_mm256_srlv_epi32(d, code_shift<1>()), qw);
    w[2] = lookup(_mm256_srlv_epi32(d, code_shift<2>()), qw);
    w[3] = lookup(_mm256_srlv_epi32(d, code_shift<3>()), qw);
  } else {
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(d, field_mask<BITS, 0>()));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(d, field_mask<BITS, 1>()));
    w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(d, field_mask<BITS, 2>()));
    if constexpr (BITS == 8) {
      w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 24));  // the top byte needs no mask
    } else if constexpr (top_shift<BITS>() > 0) {
      w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, top_shift<BITS>()), field_mask<BITS, 3>()));
    } else {
      w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(d, field_mask<BITS, 3>()));
    }
  }
}

// a[0:n] . b[0:n] added into the lanes of acc (8 at a time; the masked load of the tail never touches memory
// past the end)
inline __m256 dot_into(__m256 acc, const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
  }
  return acc;
}

// Weight row n against MT activation rows. NV independent accumulators per activation row keep at least 6 FMA
// chains in flight (FMA latency 4, two per cycle) even for one activation row, without spilling registers.
// SCALED (32-element groups): the decoded codes are multiplied by the block's scale (4 multiplies per block, shared
// by the MT rows); SCALED = 2 (16-element groups): vectors 0-1 by the block's first scale, 2-3 by its second; otherwise
// (SCALED = 0) the raw codes are accumulated and the scale applied once per group and activation row.
// Either way the min term comes from xsum at the end.
// xq: [MT, K] prescaled activations (row stride K); xsum: [MT, ngroups] (affine codes only); out: [MT, ldo] at
// column n.
template <int BITS, bool LUT, int SCALED, int MT>
void tile(const QW& p, int64_t n, const float* xq, int64_t K, const float* xsum, float* out, int64_t ldo) {
  constexpr int NV = MT <= 2 ? 4 : 2;
  constexpr int BPB = 32 * BITS / 8;
  __m256 acc[MT][NV], tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = _mm256_setzero_ps();
    for (int a = 0; a < NV; ++a) acc[m][a] = _mm256_setzero_ps();
  }
  const uint8_t* wp = p.data + n * p.row_bytes;
  const uint8_t* const wend = wp + p.row_bytes;
  const float* sp = p.s32 + (n - p.row0) * p.ngroups;
  const float* xk = xq;
  // one flat loop over the row's blocks (a nested group/block loop costs a loop setup per group, which is most of
  // the time for 32-element groups); `left` counts down the blocks left in the current group
  int64_t left = p.blocks_per_group;
  for (; wp < wend; wp += BPB, xk += kBlock) {
    __m256 w[4];
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, kPrefetchHint);
    decode<BITS, LUT>(wp, wp + BPB == wend, p, w);
    if constexpr (SCALED == 1) {  // one group per block
      const __m256 s = _mm256_broadcast_ss(sp++);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], s);
    } else if constexpr (SCALED == 2) {  // two groups per block: elements 0-15 (vectors 0, 1) and 16-31 (2, 3)
      const __m256 s0 = _mm256_broadcast_ss(sp), s1 = _mm256_broadcast_ss(sp + 1);
      sp += 2;
      w[0] = _mm256_mul_ps(w[0], s0);
      w[1] = _mm256_mul_ps(w[1], s0);
      w[2] = _mm256_mul_ps(w[2], s1);
      w[3] = _mm256_mul_ps(w[3], s1);
    }
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < 4; ++i)
        acc[m][i % NV] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xk + m * K + 8 * i), acc[m][i % NV]);
    if constexpr (SCALED == 0) {
      if (--left == 0) {  // end of a group: tot += s * dot(x_g, q_g)
        left = p.blocks_per_group;
        const __m256 s = _mm256_broadcast_ss(sp++);
        for (int m = 0; m < MT; ++m) {
          __m256 a = acc[m][0];
          for (int i = 1; i < NV; ++i) a = _mm256_add_ps(a, acc[m][i]);
          tot[m] = _mm256_fmadd_ps(a, s, tot[m]);
          for (int i = 0; i < NV; ++i) acc[m][i] = _mm256_setzero_ps();
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 a = tot[m];
    if constexpr (SCALED != 0) {
      a = acc[m][0];
      for (int i = 1; i < NV; ++i) a = _mm256_add_ps(a, acc[m][i]);
    }
    // + sum_g min_g * sum(x_g)
    if constexpr (!LUT) a = dot_into(a, p.m32 + (n - p.row0) * p.ngroups, xsum + m * p.ngroups, p.ngroups);
    out[m * ldo + n] = hsum(a);
  }
}

// the codebook's 16 entries into QW (nullptr: none, zeros)
inline void set_codebook(QW& p, const float* cb) {
  p.lut_lo = cb ? _mm256_loadu_ps(cb) : _mm256_setzero_ps();
  p.lut_hi = cb ? _mm256_loadu_ps(cb + 8) : _mm256_setzero_ps();
}

// The activations as the kernel reads them, made once per call in one pass over x:
//   xq[m, k] = x[m, k] * 2^-offset(k % 32)   (cancels the 2^offset the decoder leaves on each code)
//   xsum[m, g] = sum(x[m, g G : (g + 1) G])   (the min term's partner)
// Returns xq.
template <int BITS, bool LUT, typename T>
const float* prepare_x(const T* x, int64_t M, int64_t K, int64_t G, float* xq, float* xsum) {
  __m256 f[4];
  for (int i = 0; i < 4; ++i) {
    float v[8];
    for (int l = 0; l < 8; ++l) v[l] = x_factor<BITS, LUT>(8 * i + l);
    f[i] = _mm256_loadu_ps(v);
  }
  const int64_t ngroups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) {  // 8 elements: vector (k % 32) / 8 of their block
        const __m256 v = load8(x + m * K + k);
        s = _mm256_add_ps(s, v);
        _mm256_storeu_ps(xq + m * K + k, _mm256_mul_ps(v, f[(k % kBlock) / 8]));
      }
      if (xsum) xsum[m * ngroups + g] = hsum(s);
    }
  }
  return xq;
}

// One block of a row, dequantized: o[0..31] = (q * 2^offset) * 2^-offset * s + m (quant_dequantize), the factors
// made once per op
template <int BITS, bool LUT>
struct BlockDequant {
  float factor[kBlock];
  BlockDequant() {
    for (int e = 0; e < kBlock; ++e) factor[e] = x_factor<BITS, LUT>(e);
  }
  void operator()(const QW& p, int64_t n, int64_t blk, const uint8_t* row, float* o) const {
    constexpr int BPB = 32 * BITS / 8;
    __m256 w[4];
    decode<BITS, LUT>(row + blk * BPB, blk + 1 == p.nblocks, p, w);
    for (int i = 0; i < 4; ++i) {
      const int64_t g = (blk * kBlock + 8 * i) / p.group;  // 16-element groups: two per block
      const float sc = scale_at(p, n * p.ngroups + g);
      const __m256 s = _mm256_set1_ps(sc);  // min = -scale * zero (exact), or the float minimum
      const __m256 mn = LUT ? _mm256_setzero_ps() : _mm256_set1_ps(min_at(p, n * p.ngroups + g, sc));
      const __m256 q = _mm256_mul_ps(w[i], _mm256_loadu_ps(factor + 8 * i));
      _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(q, s, mn));
    }
  }
};

}  // namespace

#endif  // AVX2 + FMA

#if defined(BRISK_QUANT_LINEAR_NEON)
// ---- ARM64 (NEON) ----
//
// The same ops for aarch64, on the same packed layout and with the same arithmetic per (row, group): s * dot(x_g, q_g)
// (or the codes scaled per block for 16- and 32-element groups) plus one dot(min[n, :], xsum[row, :]) per output.
// NEON vectors have 4 lanes, not 8, so the decoder does not use the AVX2 bit-field trick; each block becomes 8
// float32x4 vectors in element order (element e in lane e % 4 of vector e / 4) and the activations are used as they
// are (no 2^-offset factors):
//   8, 4, 2 bits: the codes one per byte in a pair of 16-byte registers, where (for all three widths alike) element
//                 8 i + l sits at byte 4 l + i: the 8-bit codes as loaded, 4-bit ones as low nibbles | high nibbles,
//                 2-bit ones as the four crumbs of each byte in turn. A 2-register table lookup (tbl) then moves 4
//                 codes at a time into the low bytes of 4 uint32 lanes (the other bytes read out of range: 0), and
//                 they are converted to float. One lookup and one conversion per 4 codes, no widening chain.
//   3 bits:       the 12-bit fields F_l into uint32 lanes (a 1-register tbl and a shift by 4 (l % 2)), then
//                 q[8 i + l] = (F_l >> 3 i) & 7.
//   codebook:     the nibbles times 4, gathered four times over per lane by tbl, plus 0..3, index the codebook's 64
//                 bytes (a 4-register tbl): the float32 entries themselves.
// quant_dequantize gives the x86 build's bits (w = fma(q, s, min), the same scalar s and min); quant_linear_small's
// float32 sums add in another order (4 lanes, no prescaled activations), so their last bits may differ.

namespace {

// no slack: chunk_params writes the chunk's groups one by one
constexpr int64_t kParamsPad = 0;
// float32 x is read in place (no prescaling); only bfloat16 rows are converted
constexpr bool kCopyFloat32X = false;

// group i's scale as float32
inline float scale_at(const QW& p, int64_t i) {
  return p.scales32 ? p.scales32[i] : static_cast<float>(p.scales[i]);
}

// rows [c, c1)'s scales and mins as float32 into s32 / m32 (m32 only for affine codes)
inline void chunk_params(const QW& p, int64_t c, int64_t c1, bool affine, float* s32, float* m32) {
  const int64_t i0 = c * p.ngroups;
  for (int64_t g = 0; g < (c1 - c) * p.ngroups; ++g) {
    s32[g] = scale_at(p, i0 + g);
    if (affine) m32[g] = min_at(p, i0 + g, s32[g]);
  }
}

// tbl indices that move codes 4 j .. 4 j + 3 (at bytes 4 (e % 8) + e / 8 of the code pair) into the low bytes of 4
// uint32 lanes; 0xFF (out of range) reads as 0
alignas(16) constexpr uint8_t kGather[8][16] = {
    {0, 255, 255, 255, 4, 255, 255, 255, 8, 255, 255, 255, 12, 255, 255, 255},
    {16, 255, 255, 255, 20, 255, 255, 255, 24, 255, 255, 255, 28, 255, 255, 255},
    {1, 255, 255, 255, 5, 255, 255, 255, 9, 255, 255, 255, 13, 255, 255, 255},
    {17, 255, 255, 255, 21, 255, 255, 255, 25, 255, 255, 255, 29, 255, 255, 255},
    {2, 255, 255, 255, 6, 255, 255, 255, 10, 255, 255, 255, 14, 255, 255, 255},
    {18, 255, 255, 255, 22, 255, 255, 255, 26, 255, 255, 255, 30, 255, 255, 255},
    {3, 255, 255, 255, 7, 255, 255, 255, 11, 255, 255, 255, 15, 255, 255, 255},
    {19, 255, 255, 255, 23, 255, 255, 255, 27, 255, 255, 255, 31, 255, 255, 255}};
// the same codes, each repeated in all 4 bytes of its lane (codebook mode)
alignas(16) constexpr uint8_t kGather4[8][16] = {
    {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12},
    {16, 16, 16, 16, 20, 20, 20, 20, 24, 24, 24, 24, 28, 28, 28, 28},
    {1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13},
    {17, 17, 17, 17, 21, 21, 21, 21, 25, 25, 25, 25, 29, 29, 29, 29},
    {2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14},
    {18, 18, 18, 18, 22, 22, 22, 22, 26, 26, 26, 26, 30, 30, 30, 30},
    {3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15},
    {19, 19, 19, 19, 23, 23, 23, 23, 27, 27, 27, 27, 31, 31, 31, 31}};

// The codes of a block of 8, 4 or 2 bits, one per byte: element 8 i + l at byte 4 l + i of {lo, hi}. Codebook codes
// come times 4 (the byte offset of their entry).
template <int BITS, bool LUT>
inline uint8x16x2_t code_bytes(const uint8_t* p) {
  uint8x16x2_t t;
  if constexpr (BITS == 8) {
    t.val[0] = vld1q_u8(p);
    t.val[1] = vld1q_u8(p + 16);
  } else if constexpr (BITS == 4) {  // byte 4 j + i: element 8 i + j in the low nibble, 8 i + j + 4 in the high one
    const uint8x16_t c = vld1q_u8(p);
    if constexpr (LUT) {
      t.val[0] = vshlq_n_u8(vandq_u8(c, vdupq_n_u8(0x0F)), 2);
      t.val[1] = vandq_u8(vshrq_n_u8(c, 2), vdupq_n_u8(0x3C));
    } else {
      t.val[0] = vandq_u8(c, vdupq_n_u8(0x0F));
      t.val[1] = vshrq_n_u8(c, 4);
    }
  } else {
    static_assert(BITS == 2, "code_bytes: 8, 4 or 2 bits");
    // byte 4 (l % 2) + i, crumb l / 2: element 8 i + l; crumb k of the 8 bytes becomes bytes 8 k .. 8 k + 7
    const uint8x8_t b = vld1_u8(p), three = vdup_n_u8(3);
    t.val[0] = vcombine_u8(vand_u8(b, three), vand_u8(vshr_n_u8(b, 2), three));
    t.val[1] = vcombine_u8(vand_u8(vshr_n_u8(b, 4), three), vshr_n_u8(b, 6));
  }
  return t;
}

// Decode one block into w[0..7]: the codes q (affine) or codebook values (LUT), lane k of w[j] being element 4 j + k.
// `tail`: the block is the last of its row, so the 3-bit loader must not read past its 12 bytes.
template <int BITS, bool LUT>
inline void decode(const uint8_t* p, bool tail, const QW& qw, float32x4_t w[8]) {
  if constexpr (BITS == 3) {
    uint8x16_t raw;
    if (tail) {  // 8 + 4 bytes: never touch the byte after the row
      uint64_t lo;
      uint32_t hi;
      std::memcpy(&lo, p, 8);
      std::memcpy(&hi, p + 8, 4);
      raw = vcombine_u8(vcreate_u8(lo), vcreate_u8(hi));
    } else {
      raw = vld1q_u8(p);  // 4 bytes of the next block ride along
    }
    // lane l <- bytes floor(1.5 l), floor(1.5 l) + 1, shifted right by 4 (l % 2): F_l in bits 0-11
    alignas(16) static constexpr uint8_t ga[16] = {0, 1, 255, 255, 1, 2, 255, 255, 3, 4, 255, 255, 4, 5, 255, 255};
    alignas(16) static constexpr uint8_t gb[16] = {6, 7, 255, 255, 7, 8, 255, 255, 9, 10, 255, 255, 10, 11, 255, 255};
    alignas(16) static constexpr int32_t odd[4] = {0, -4, 0, -4};
    const int32x4_t sh = vld1q_s32(odd);
    const uint32x4_t fa = vshlq_u32(vreinterpretq_u32_u8(vqtbl1q_u8(raw, vld1q_u8(ga))), sh);  // F_0 .. F_3
    const uint32x4_t fb = vshlq_u32(vreinterpretq_u32_u8(vqtbl1q_u8(raw, vld1q_u8(gb))), sh);  // F_4 .. F_7
    const uint32x4_t seven = vdupq_n_u32(7);
    w[0] = vcvtq_f32_u32(vandq_u32(fa, seven));
    w[1] = vcvtq_f32_u32(vandq_u32(fb, seven));
    w[2] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fa, 3), seven));
    w[3] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fb, 3), seven));
    w[4] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fa, 6), seven));
    w[5] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fb, 6), seven));
    w[6] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fa, 9), seven));
    w[7] = vcvtq_f32_u32(vandq_u32(vshrq_n_u32(fb, 9), seven));
  } else if constexpr (LUT) {
    static_assert(BITS == 4, "codebook codes are 4-bit");
    const uint8x16x2_t t = code_bytes<4, true>(p);
    const uint8x16_t within = vreinterpretq_u8_u32(vdupq_n_u32(0x03020100));  // byte b of a lane: + b
    for (int j = 0; j < 8; ++j) {
      const uint8x16_t idx = vaddq_u8(vqtbl2q_u8(t, vld1q_u8(kGather4[j])), within);
      w[j] = vreinterpretq_f32_u8(vqtbl4q_u8(qw.lut, idx));
    }
  } else {
    const uint8x16x2_t t = code_bytes<BITS, false>(p);
    for (int j = 0; j < 8; ++j) w[j] = vcvtq_f32_u32(vreinterpretq_u32_u8(vqtbl2q_u8(t, vld1q_u8(kGather[j]))));
  }
}

// Weight row n against MT activation rows, as the x86 tile: NV accumulators per activation row (at least 8 FMA
// chains in flight: 4-cycle FMAs, two pipes on Neoverse cores). SCALED 1 (32-element groups): the decoded codes
// times the block's scale; 2 (16-element groups): vectors 0-3 by the first scale, 4-7 by the second; 0: raw codes,
// the scale applied at the end of each group. The min term comes from xsum at the end.
// x: [MT, K] activations (row stride K); xsum: [MT, ngroups] (affine codes only); out: [MT, ldo] at column n.
template <int BITS, bool LUT, int SCALED, int MT>
void tile(const QW& p, int64_t n, const float* x, int64_t K, const float* xsum, float* out, int64_t ldo) {
  constexpr int NV = MT == 1 ? 8 : (MT == 2 ? 4 : 2);
  constexpr int BPB = 32 * BITS / 8;
  float32x4_t acc[MT][NV], tot[MT];
  for (int m = 0; m < MT; ++m) {
    tot[m] = vdupq_n_f32(0.f);
    for (int a = 0; a < NV; ++a) acc[m][a] = vdupq_n_f32(0.f);
  }
  const uint8_t* wp = p.data + n * p.row_bytes;
  const uint8_t* const wend = wp + p.row_bytes;
  const float* sp = p.s32 + (n - p.row0) * p.ngroups;
  const float* xk = x;
  int64_t left = p.blocks_per_group;
  for (; wp < wend; wp += BPB, xk += kBlock) {
    float32x4_t w[8];
    __builtin_prefetch(wp + 1024);
    decode<BITS, LUT>(wp, wp + BPB == wend, p, w);
    if constexpr (SCALED == 1) {
      const float s = *sp++;
      for (int j = 0; j < 8; ++j) w[j] = vmulq_n_f32(w[j], s);
    } else if constexpr (SCALED == 2) {
      const float s0 = sp[0], s1 = sp[1];
      sp += 2;
      for (int j = 0; j < 4; ++j) w[j] = vmulq_n_f32(w[j], s0);
      for (int j = 4; j < 8; ++j) w[j] = vmulq_n_f32(w[j], s1);
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 8; ++j) acc[m][j % NV] = vfmaq_f32(acc[m][j % NV], w[j], vld1q_f32(xk + m * K + 4 * j));
    if constexpr (SCALED == 0) {
      if (--left == 0) {  // end of a group: tot += s * dot(x_g, q_g)
        left = p.blocks_per_group;
        const float s = *sp++;
        for (int m = 0; m < MT; ++m) {
          float32x4_t a = acc[m][0];
          for (int i = 1; i < NV; ++i) a = vaddq_f32(a, acc[m][i]);
          tot[m] = vfmaq_n_f32(tot[m], a, s);
          for (int i = 0; i < NV; ++i) acc[m][i] = vdupq_n_f32(0.f);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float32x4_t a = tot[m];
    if constexpr (SCALED != 0) {
      a = acc[m][0];
      for (int i = 1; i < NV; ++i) a = vaddq_f32(a, acc[m][i]);
    }
    float rest = 0.f;
    if constexpr (!LUT) {  // + sum_g min_g * sum(x_g)
      const float* mn = p.m32 + (n - p.row0) * p.ngroups;
      const float* xs = xsum + m * p.ngroups;
      int64_t g = 0;
      for (; g + 4 <= p.ngroups; g += 4) a = vfmaq_f32(a, vld1q_f32(mn + g), vld1q_f32(xs + g));
      for (; g < p.ngroups; ++g) rest += mn[g] * xs[g];
    }
    out[m * ldo + n] = vaddvq_f32(a) + rest;
  }
}

// the codebook's 16 entries into QW (nullptr: none, zeros)
inline void set_codebook(QW& p, const float* cb) {
  p.lut = cb ? vld1q_u8_x4(reinterpret_cast<const uint8_t*>(cb))
             : uint8x16x4_t{{vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0)}};
}

inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift, exact
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

// xf[m, k] = x[m, k] as float32 (only for bfloat16 x: float32 rows are read in place), xsum[m, g] = sum(x_g).
// Returns the rows the kernel reads. (BITS, LUT: the x86 build's signature; no prescaling here.)
template <int BITS, bool LUT, typename T>
const float* prepare_x(const T* x, int64_t M, int64_t K, int64_t G, float* xf, float* xsum) {
  constexpr bool copy = !std::is_same_v<T, float>;
  const int64_t ngroups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < ngroups; ++g) {
      float32x4_t s = vdupq_n_f32(0.f);
      for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
        const float32x4_t v = load4(x + m * K + k);
        s = vaddq_f32(s, v);
        if constexpr (copy) vst1q_f32(xf + m * K + k, v);
      }
      if (xsum) xsum[m * ngroups + g] = vaddvq_f32(s);
    }
  }
  if constexpr (copy) return xf;
  else return x;
}

// One block of a row, dequantized: o[0..31] = fma(q, s, m), the x86 build's one rounding, so its bits
template <int BITS, bool LUT>
struct BlockDequant {
  void operator()(const QW& p, int64_t n, int64_t blk, const uint8_t* row, float* o) const {
    constexpr int BPB = 32 * BITS / 8;
    float32x4_t w[8];
    decode<BITS, LUT>(row + blk * BPB, blk + 1 == p.nblocks, p, w);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = (blk * kBlock + 4 * j) / p.group;
      const float sc = scale_at(p, n * p.ngroups + g);
      const float32x4_t mn = vdupq_n_f32(LUT ? 0.f : min_at(p, n * p.ngroups + g, sc));
      vst1q_f32(o + 4 * j, vfmaq_f32(mn, w[j], vdupq_n_f32(sc)));
    }
  }
};

}  // namespace

#endif  // aarch64 NEON

#if defined(BRISK_QUANT_LINEAR_X86) || defined(BRISK_QUANT_LINEAR_NEON)
// ---- common: the driver and the ops ----

namespace {

template <int BITS, bool LUT, int SCALED, int MT>
void tile_rows(const QW& p, int64_t n0, int64_t n1, const float* x, int64_t K, const float* xsum, float* out,
               int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) tile<BITS, LUT, SCALED, MT>(p, n, x, K, xsum, out, ldo);
}

// Weight rows n0 .. n1-1 against all M activation rows, one tile of up to 4 activation rows at a time. The caller
// keeps n1 - n0 small enough that those packed rows stay in L1 from one tile to the next, and one tile of
// activations (4 K floats) stays in L1 across the rows: every byte of weights comes from memory once per call.
template <int BITS, bool LUT, int SCALED>
void run_rows(const QW& p, int64_t n0, int64_t n1, const float* x, int64_t M, int64_t K, const float* xsum,
              float* out, int64_t ldo) {
  int64_t m = 0;
  auto xs = [&](int64_t row) { return xsum ? xsum + row * p.ngroups : nullptr; };
  for (; m + kMaxTileRows <= M; m += kMaxTileRows)
    tile_rows<BITS, LUT, SCALED, kMaxTileRows>(p, n0, n1, x + m * K, K, xs(m), out + m * ldo, ldo);
  switch (M - m) {
    case 1: tile_rows<BITS, LUT, SCALED, 1>(p, n0, n1, x + m * K, K, xs(m), out + m * ldo, ldo); break;
    case 2: tile_rows<BITS, LUT, SCALED, 2>(p, n0, n1, x + m * K, K, xs(m), out + m * ldo, ldo); break;
    case 3: tile_rows<BITS, LUT, SCALED, 3>(p, n0, n1, x + m * K, K, xs(m), out + m * ldo, ldo); break;
    default: break;
  }
}

// out[M, N] = x[M, K] @ W_hat^T, without bias. x: the activation rows as the ISA's prepare_x made them (x86:
// prescaled; NEON: as they are); xsum: [M, ngroups] (affine codes only).
template <int BITS, bool LUT>
void run(const QW& p, const float* x, int64_t M, int64_t N, int64_t K, const float* xsum, float* out) {
  // per-element scaling pays 4 multiplies per block; per-group scaling pays ~2 ops per activation row and group
  const bool half = p.group == 16, scaled = !half && p.blocks_per_group == 1;
  // rows per chunk: their packed codes (<= 4 KiB) stay in L1 while the activation tiles run over them
  const int64_t chunk = std::clamp<int64_t>(4096 / p.row_bytes, 1, 32);
  // grain: rows per task such that a task streams >= ~32 KiB of codes
  const int64_t grain = std::max<int64_t>(chunk, (32 * 1024) / p.row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // this thread's float32 copies of a chunk's group parameters (see QW::s32); they only grow
    thread_local std::vector<float> s32, m32;
    const size_t need = static_cast<size_t>(chunk * p.ngroups + kParamsPad);
    if (s32.size() < need) {
      s32.resize(need);
      m32.resize(need);
    }
    QW pc = p;
    pc.s32 = s32.data();
    pc.m32 = m32.data();
    for (int64_t c = n0; c < n1; c += chunk) {
      const int64_t c1 = std::min(n1, c + chunk);
      chunk_params(p, c, c1, !LUT, s32.data(), m32.data());
      pc.row0 = c;
      if (half) run_rows<BITS, LUT, 2>(pc, c, c1, x, M, K, xsum, out, N);
      else if (scaled) run_rows<BITS, LUT, 1>(pc, c, c1, x, M, K, xsum, out, N);
      else run_rows<BITS, LUT, 0>(pc, c, c1, x, M, K, xsum, out, N);
    }
  });
}

QW make_qw(const at::Tensor& data, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
           const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size, int64_t K) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 3 || bits == 2, "quant_linear: bits must be 8, 4, 3 or 2");
  TORCH_CHECK(K > 0 && K % kBlock == 0 && (group_size % kBlock == 0 || group_size == 16) && group_size > 0 &&
                  K % group_size == 0,
              "quant_linear: K must be a multiple of 32 and group_size 16 or a multiple of 32 that divides K");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "quant_linear: data must be a contiguous uint8 [N, K * bits / 8] tensor");
  const int64_t N = data.size(0);
  const int64_t ngroups = K / group_size;
  TORCH_CHECK(data.size(1) == K / kBlock * block_bytes(bits), "quant_linear: data has ", data.size(1),
              " bytes per row, expected ", K / kBlock * block_bytes(bits));
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
              scales.dim() == 2 && scales.size(0) == N && scales.size(1) == ngroups,
              "quant_linear: scales must be float16 or float32 [N, K / G]");
  QW p{};
  p.data = data.data_ptr<uint8_t>();
  p.row_bytes = data.size(1);
  if (scales.scalar_type() == at::kHalf) p.scales = scales.data_ptr<at::Half>();
  else p.scales32 = scales.data_ptr<float>();
  p.zero = static_cast<float>(int64_t{1} << (bits - 1));
  if (zeros.has_value() && zeros->defined()) {
    const auto zt = zeros->scalar_type();
    TORCH_CHECK((zt == at::kByte || zt == at::kHalf || zt == at::kFloat) && zeros->is_contiguous() &&
                zeros->sizes() == scales.sizes(),
                "quant_linear: zeros must be uint8 zero points or float16 / float32 minimums, shaped like scales");
    if (zt == at::kByte) p.zeros = zeros->data_ptr<uint8_t>();
    else if (zt == at::kHalf) p.mins16 = zeros->data_ptr<at::Half>();
    else p.mins32 = zeros->data_ptr<float>();
  }
  p.ngroups = ngroups;
  p.group = group_size;
  p.blocks_per_group = std::max<int64_t>(1, group_size / kBlock);
  p.nblocks = K / kBlock;
  set_codebook(p, nullptr);
  if (codebook.has_value() && codebook->defined()) {
    TORCH_CHECK(bits == 4 && codebook->scalar_type() == at::kFloat && codebook->numel() == 16 &&
                codebook->is_contiguous(), "quant_linear: a codebook is 16 float32 values, for 4-bit codes");
    TORCH_CHECK(p.zeros == nullptr && p.mins16 == nullptr && p.mins32 == nullptr,
                "quant_linear: codebook codes take no zero points");
    set_codebook(p, codebook->data_ptr<float>());
  }
  return p;
}

template <typename F>
void dispatch(int64_t bits, bool lut, F&& f) {
  switch (bits) {
    case 8: f(std::integral_constant<int, 8>{}, std::false_type{}); break;
    case 4:
      if (lut) f(std::integral_constant<int, 4>{}, std::true_type{});
      else f(std::integral_constant<int, 4>{}, std::false_type{});
      break;
    case 3: f(std::integral_constant<int, 3>{}, std::false_type{}); break;
    default: f(std::integral_constant<int, 2>{}, std::false_type{}); break;
  }
}

// out[m, n] = acc[m, n] (+ bias[n]) in the output dtype
template <typename T, typename B>
void finish(const float* acc, const B* bias, int64_t M, int64_t N, T* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      out[m * N + n] = static_cast<T>(acc[m * N + n] + (bias ? static_cast<float>(bias[n]) : 0.f));
}

}  // namespace

// x: [..., K] float32 or bfloat16; data: [N, K / 32 * 4 * bits] uint8 (layout above); scales: [N, K / G] float16;
// zeros: [N, K / G] uint8 zero points, absent for symmetric codes (zero 2^(bits-1)) and in codebook mode; codebook:
// [16] float32 or absent; bias: [N] or absent.
// Returns [..., N] in x's dtype. Meant for few activation rows (decode); any number works.
at::Tensor quant_linear_small(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                              const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& codebook,
                              int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_small: x must be float32 or bfloat16 [..., K]");
  const int64_t K = x.size(-1);
  const int64_t M = K > 0 ? x.numel() / K : 0;
  QW p = make_qw(data, scales, zeros, codebook, bits, group_size, K);
  const int64_t N = data.size(0);
  const bool lut = codebook.has_value() && codebook->defined();
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() &&
                (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                "quant_linear_small: bias must be a contiguous float32 or bfloat16 [N] tensor");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  const bool f32 = x.scalar_type() == at::kFloat;
  const bool direct = f32 && !has_bias;  // the kernel can write the result in place
  auto out = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return out;
  auto xc = x.contiguous();
  // scratch: the activation rows as the kernel reads them [M, K] (x86: prescaled, always; NEON: only for bfloat16
  // x), xsum [M, ngroups], and the float32 result [M, N] unless written in place
  const int64_t xk_size = f32 && !kCopyFloat32X ? 0 : M * K;
  auto scratch = at::empty({xk_size + M * (p.ngroups + (direct ? 0 : N))}, x.options().dtype(at::kFloat));
  float* xk = scratch.data_ptr<float>();
  float* xsum = lut ? nullptr : xk + xk_size;
  float* acc = direct ? out.data_ptr<float>() : xk + xk_size + M * p.ngroups;
  dispatch(bits, lut, [&](auto b, auto l) {
    constexpr int BITS = decltype(b)::value;
    constexpr bool LUT = decltype(l)::value;
    const float* xr = f32 ? prepare_x<BITS, LUT>(xc.data_ptr<float>(), M, K, group_size, xk, xsum)
                          : prepare_x<BITS, LUT>(xc.data_ptr<at::BFloat16>(), M, K, group_size, xk, xsum);
    run<BITS, LUT>(p, xr, M, N, K, xsum, acc);
  });
  if (!direct) {
    const bool bf16_bias = has_bias && bias->scalar_type() == at::kBFloat16;
    const float* bf = has_bias && !bf16_bias ? bias->data_ptr<float>() : nullptr;
    const at::BFloat16* bb = bf16_bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    if (f32) {
      if (bb) finish(acc, bb, M, N, out.data_ptr<float>());
      else finish(acc, bf, M, N, out.data_ptr<float>());
    } else {
      if (bb) finish(acc, bb, M, N, out.data_ptr<at::BFloat16>());
      else finish(acc, bf, M, N, out.data_ptr<at::BFloat16>());
    }
  }
  return out;
}

// Dequantize the runtime layout to float32 [N, K] (the large-M path runs F.linear on the result).
at::Tensor quant_dequantize(const at::Tensor& data, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                            int64_t in_features) {
  const int64_t K = in_features;
  QW p = make_qw(data, scales, zeros, codebook, bits, group_size, K);
  const int64_t N = data.size(0);
  auto out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  dispatch(bits, codebook.has_value() && codebook->defined(), [&](auto b, auto l) {
    constexpr int BITS = decltype(b)::value;
    constexpr bool LUT = decltype(l)::value;
    const BlockDequant<BITS, LUT> dequant;
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.data + n * p.row_bytes;
        for (int64_t blk = 0; blk < p.nblocks; ++blk) dequant(p, n, blk, row, o + n * K + blk * kBlock);
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("quant_linear_small(Tensor x, Tensor data, Tensor scales, Tensor? zeros, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias) -> Tensor", &quant_linear_small);
  m.def("quant_dequantize(Tensor data, Tensor scales, Tensor? zeros, Tensor? codebook, int bits, int group_size, "
        "int in_features) -> Tensor", &quant_dequantize);
}

#endif  // x86 or NEON
