// W8A8 integer GEMM: int8 weights (per output channel scales) times int8 activations (per token or per tensor
// scales), int32 accumulation on the CPU's integer units (ops/w8a8.py; SmoothQuant and LLM.int8() layers).
//
//   y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * wq[n, k]  (+ bias[n])
//
// AVX-512 VNNI build: VPDPBUSD multiplies unsigned bytes by signed bytes and adds groups of 4 into int32 lanes.
// The activations are signed, so they enter shifted, xu = xq + 128 (a XOR with 0x80), and the shift is paid back
// by a column sum of the weights computed once at load time:
//   sum_k (xq + 128) wq = sum_k xq wq + 128 * colsum[n],   colsum[n] = sum_k wq[n, k].
// AVX2 build (no VNNI): VPMADDUBSW on |xq| and sign(xq) * wq (VPSIGNB), then VPMADDWD by ones. With |xq|, |wq| <=
// 127 a pair of products is at most 2 * 127 * 127 = 32258 < 2^15, so the saturating int16 step never saturates
// and the result is exact as well. AVX-VNNI build (the avx2vnni tier: VEX VPDPBUSD on 256-bit registers): the
// AVX-512 build's shifted activations and column sums, one VPDPBUSD per 8 outputs and 4 columns where the AVX2
// build takes six instructions: on a Xeon (AVX-512 + AMX) forced to each tier, one thread, 576 x 576, 128 rows in
// 0.36 ms against 0.66 ms (1.9x), 8 rows 1.7x; one row about the same (the weights' stream bounds it). Every build
// gives the same int32 sums, bit for bit `torch` int32 matmul.
// AMX-INT8 (Intel Sapphire Rapids and later; in the AVX-512 builds, chosen at run time): TDPBUSD on the same
// shifted activations, the weights' B tiles read in place from the layout below (16 of its 64-byte lines are one
// 16 x 64-byte tile), the same int32 sums into the same epilogue; for 4 rows and more (prefill, batches), where it
// runs 2-7x the VNNI path. Its code is one function compiled for AMX (amx_items, below), called only when
// w8a8_amx() switched it on: /proc/cpuinfo reports amx_tile and amx_int8 (ops/kernels.py asks), Linux granted the
// process the tile state (arch_prctl), and the setting allows it (BRISK_DISABLE_AMX, kernels.configure(amx=...)).
//
// Weight layout (ops/w8a8.py pack_weight; N a multiple of 16, K of 4), as quant_q8t.cpp's 8-bit tiles:
//   w [N / 16][K / 4][16][4] int8: per 4 input columns a tile of 16 rows stores one 64-byte line, lane r (dword r)
//   holding row 16 t + r's 4 weights. One load serves 16 output columns; 4 activation bytes are broadcast.
// Register blocking (VNNI): 6 activation rows x 4 tiles (64 outputs) = 24 int32 accumulators, 4 weight vectors and
// one broadcast: 29 of the 32 zmm registers, 24 VPDPBUSD per 4 weight loads and 6 broadcasts.
// AVX2: 4 rows x 1 tile (two ymm halves) = 8 accumulators; AVX-VNNI: 6 rows x 1 tile = 12 accumulators, two weight
// vectors and one broadcast: 15 of the 16 ymm registers.
// Work items are (weight panel, chunk of 48 rows), panel-major, so a thread keeps one panel of weights in L1/L2
// while it walks the rows. AMX: 32 rows x 2 tiles per block, row-block-major (see the AMX section).
//
// Activation rounding (bit for bit ops/w8a8.py quantize_rows): dynamic per token, amax = max_k |x[m, k]|,
// xs = amax / 127, xq = round_half_even(x * (127 / amax)) (0 where amax = 0); static per tensor (a calibrated
// scale s), xs = s, xq = clamp(round_half_even(x * (1 / s)), -127, 127).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__x86_64__) && \
    defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define BRISK_AMX 1  // the AMX-INT8 path (VNNI builds, GCC >= 11, Linux: arch_prctl grants the tile state)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#define BRISK_INLINE inline __attribute__((always_inline))

constexpr int64_t kTile = 16;
constexpr int64_t kMChunk = 48;  // activation rows per work item (a multiple of both builds' MR)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
constexpr int kMR = 6, kNR = 4;
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;  // shifted activations, as the AVX-512 build
constexpr int kMR = 6, kNR = 1;
#else
constexpr bool kVnni = false;
constexpr int kMR = 4, kNR = 1;
#endif

BRISK_INLINE int32_t load_u32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ------------------------------------------------------------------------------------------ activation rounding
// Quantize one row of K floats into q (int8; the VNNI build stores q + 128 as uint8), returning its scale.
float quantize_row(const float* x, int64_t K, float static_scale, uint8_t* q) {
  float scale, inv;
  if (static_scale > 0.f) {
    scale = static_scale;
    inv = 1.0f / static_scale;
  } else {
    float amax = 0.f;
    int64_t k = 0;
#ifdef __AVX512F__
    __m512 mx = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    amax = _mm512_reduce_max_ps(mx);
#else
    __m256 mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    scale = amax / 127.0f;
    inv = amax > 0.f ? 127.0f / amax : 0.f;
  }
  const uint8_t shift = kVnni ? 0x80 : 0;
  int64_t k = 0;
#ifdef __AVX512F__
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m128i sh = _mm_set1_epi8(static_cast<char>(shift));
  for (; k + 16 <= K; k += 16) {
    // cvtps rounds to nearest even under the default MXCSR, as std::nearbyint below and torch.round
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), iv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm_xor_si128(_mm512_cvtepi32_epi8(v), sh));
  }
#else
  // 16 at a time, clamped in float before the conversion (also where x / s passes 2^31 on a static scale, where
  // the conversion's overflow value would clamp to -127), then packed to bytes. The scalar loop took 0.11-0.24 ms
  // of a 0.8 ms GEMM of 128 rows, 576 x 576, on a Xeon (AVX-512 + AMX) forced to the avx2 tier.
  const __m256 iv = _mm256_set1_ps(inv);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m128i sh = _mm_set1_epi8(static_cast<char>(shift));
  for (; k + 16 <= K; k += 16) {
    // cvtps rounds to nearest even under the default MXCSR, as std::nearbyint below
    const __m256i a =
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv), lo), hi));
    const __m256i b =
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), iv), lo), hi));
    const __m256i w = _mm256_packs_epi32(a, b);  // a0-3 b0-3 | a4-7 b4-7 as int16
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    // a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7
    const __m128i ordered = _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm_xor_si128(ordered, sh));
  }
#endif
  for (; k < K; ++k) {
    const float r = std::nearbyint(x[k] * inv);
    const int v = static_cast<int>(std::min(127.f, std::max(-127.f, r)));
    q[k] = static_cast<uint8_t>(static_cast<int8_t>(v)) ^ shift;
  }
  return scale;
}

// ------------------------------------------------------------------------------------------ micro-kernels
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// acc[i][j] = sum over K of the MR rows of xu (uint8, shifted) with tile j of the panel at w, then epi(i, j, acc).
template <int MR, int NR, typename Epi>
BRISK_INLINE void micro(const uint8_t* xu, int64_t K, const int8_t* w, int64_t tile_bytes, const Epi& epi) {
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t nc = K / 4;
  for (int64_t c = 0; c < nc; ++c) {
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + j * tile_bytes + c * 64);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i xb = _mm512_set1_epi32(load_u32(xu + i * K + 4 * c));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) epi(i, j, acc[i][j]);
}

// the VNNI sums minus the shift's 128 * colsum: the exact sum_k xq wq of 16 outputs
BRISK_INLINE __m512i unshift(__m512i acc, const int32_t* colsum128) {
  return _mm512_sub_epi32(acc, _mm512_loadu_si512(colsum128));
}

struct IntEpi {  // int32 out [M, N]
  int32_t* out;
  int64_t N, m0, n0;
  const int32_t* colsum128;
  BRISK_INLINE void operator()(int i, int j, __m512i acc) const {
    const int64_t n = n0 + j * kTile;
    _mm512_storeu_si512(out + (m0 + i) * N + n, unshift(acc, colsum128 + n));
  }
};

struct FloatEpi {  // float out [M, N] = acc * xs[m] * ws[n] + bias[n]
  float* out;
  int64_t N, m0, n0;
  const int32_t* colsum128;
  const float* xs;
  const float* ws;
  const float* bias;
  BRISK_INLINE void operator()(int i, int j, __m512i acc) const {
    const int64_t n = n0 + j * kTile;
    const __m512 a = _mm512_cvtepi32_ps(unshift(acc, colsum128 + n));
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(xs[m0 + i]), _mm512_loadu_ps(ws + n));
    const __m512 y = bias ? _mm512_fmadd_ps(a, s, _mm512_loadu_ps(bias + n)) : _mm512_mul_ps(a, s);
    _mm512_storeu_ps(out + (m0 + i) * N + n, y);
  }
};
#else
// AVX2: the MR rows of xq (int8; AVX-VNNI: xq + 128 as uint8) with the 16 rows of one tile (two ymm halves of 8),
// then epi(i, half, acc).
template <int MR, int NR, typename Epi>
BRISK_INLINE void micro(const uint8_t* xu, int64_t K, const int8_t* w, int64_t /*tile_bytes*/, const Epi& epi) {
  static_assert(NR == 1, "the AVX2 micro-kernel takes one tile");
  __m256i acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#ifndef __AVXVNNI__
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const int64_t nc = K / 4;
  for (int64_t c = 0; c < nc; ++c) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 64 + 32));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256i xb = _mm256_set1_epi32(load_u32(xu + i * K + 4 * c));
#ifdef __AVXVNNI__
      acc[i][0] = _mm256_dpbusd_avx_epi32(acc[i][0], xb, w0);
      acc[i][1] = _mm256_dpbusd_avx_epi32(acc[i][1], xb, w1);
#else
      const __m256i ax = _mm256_abs_epi8(xb);
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones);
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones);
      acc[i][0] = _mm256_add_epi32(acc[i][0], p0);
      acc[i][1] = _mm256_add_epi32(acc[i][1], p1);
#endif
    }
  }
  for (int i = 0; i < MR; ++i) {
    epi(i, 0, acc[i][0]);
    epi(i, 1, acc[i][1]);
  }
}

// AVX-VNNI: the sums minus the shift's 128 * colsum, the exact sum_k xq wq of 8 outputs; plain AVX2: no shift
BRISK_INLINE __m256i unshift(__m256i acc, const int32_t* colsum128) {
  if constexpr (kVnni) return _mm256_sub_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum128)));
  (void)colsum128;
  return acc;
}

struct IntEpi {
  int32_t* out;
  int64_t N, m0, n0;
  const int32_t* colsum128;
  BRISK_INLINE void operator()(int i, int half, __m256i acc) const {
    const int64_t n = n0 + 8 * half;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + i) * N + n), unshift(acc, colsum128 + n));
  }
};

struct FloatEpi {
  float* out;
  int64_t N, m0, n0;
  const int32_t* colsum128;
  const float* xs;
  const float* ws;
  const float* bias;
  BRISK_INLINE void operator()(int i, int half, __m256i acc) const {
    const int64_t n = n0 + 8 * half;
    const __m256 a = _mm256_cvtepi32_ps(unshift(acc, colsum128 + n));
    const __m256 s = _mm256_mul_ps(_mm256_set1_ps(xs[m0 + i]), _mm256_loadu_ps(ws + n));
    const __m256 y = bias ? _mm256_fmadd_ps(a, s, _mm256_loadu_ps(bias + n)) : _mm256_mul_ps(a, s);
    _mm256_storeu_ps(out + (m0 + i) * N + n, y);
  }
};
#endif

template <int MR, typename Epi>
BRISK_INLINE void micro_nr(int nr, const uint8_t* xu, int64_t K, const int8_t* w, int64_t tile_bytes, const Epi& e) {
  if constexpr (kNR == 1) {
    micro<MR, 1>(xu, K, w, tile_bytes, e);
  } else {
    switch (nr) {
      case 1: micro<MR, 1>(xu, K, w, tile_bytes, e); break;
      case 2: micro<MR, 2>(xu, K, w, tile_bytes, e); break;
      case 3: micro<MR, 3>(xu, K, w, tile_bytes, e); break;
      default: micro<MR, kNR>(xu, K, w, tile_bytes, e); break;
    }
  }
}

template <typename Epi>
void micro_dispatch(int mr, int nr, const uint8_t* xu, int64_t K, const int8_t* w, int64_t tile_bytes, const Epi& e) {
  switch (mr) {
    case 1: micro_nr<1>(nr, xu, K, w, tile_bytes, e); break;
    case 2: micro_nr<2>(nr, xu, K, w, tile_bytes, e); break;
    case 3: micro_nr<3>(nr, xu, K, w, tile_bytes, e); break;
    case 4: micro_nr<4>(nr, xu, K, w, tile_bytes, e); break;
    case 5: if constexpr (kMR >= 5) { micro_nr<5>(nr, xu, K, w, tile_bytes, e); } break;
    default: micro_nr<kMR>(nr, xu, K, w, tile_bytes, e); break;
  }
}

#ifdef BRISK_AMX
// ------------------------------------------------------------------------------------------ AMX-INT8
// Eight tile registers of up to 16 rows x 64 bytes; TDPBUSD C[16 x 16 int32] += A[16 x 64 u8] . B[16 x 64 s8], where
// A row i holds 64 activations of row i (16 groups of 4 columns) and B row g holds group g's 4 weights of each of
// 16 outputs: exactly 16 consecutive 64-byte lines of the weight layout above, read in place (stride 64).
//
//   tmm0 C[rows 0-15][tile 0]   tmm1 C[0-15][tile 1]   tmm4 A rows 0-15    tmm6 B tile 0 (16 groups = 64 columns)
//   tmm2 C[16-31][tile 0]       tmm3 C[16-31][tile 1]  tmm5 A rows 16-31   tmm7 B tile 1
//
// A block is 32 rows x 32 outputs, 4 TDPBUSD per 4 tile loads and 64 columns of K. The activations are the VNNI
// build's shifted xu (u8), so the sums, the 128 * colsum correction and the epilogue are the VNNI path's.
// K tail (K % 64 = 4 g, g < 16 groups): A still loads 64 bytes a row (the rest of the row and the next row's first
// bytes; the buffer has 64 bytes of slack after its last row), against a B tile whose first g lines are the
// weights' and whose other lines are zeros (a copy of g lines per tile and work item): the extra bytes add 0.
// Rows: A loads 16 rows at a time, so the activation buffer holds M rounded up to 16 rows (activation_buffer);
// the padded rows' sums land in C rows that are never stored.
constexpr int64_t kAmxK = 64;         // bytes of K per A tile row
constexpr int64_t kAmxMBlock = 32;    // rows per block and work item (2 A tiles)
// fewer rows stay on VNNI (Sapphire Rapids: AMX 0.7-0.95x VNNI at 1-2 rows, a tie at 4, 1.7-2.7x at 8)
constexpr int64_t kAmxMinRows = 4;

std::atomic<bool> g_amx{false};  // set by w8a8_amx(): the CPU has AMX-INT8 and this process may use it

// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux (>= 5.16) allocates the 8 KiB tile state only for a process
// that asked; a tile instruction without the grant faults. Asked once per process.
bool request_amx_permission() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// The one function that runs tile instructions (amx_items, the helpers inlined into it) carries this target: AMX
// is enabled for it alone, the rest of the build stays within its tier, and tests/test_kernel_instructions.py
// checks that no AMX instruction lies in any other function. It is reached only through gemm() when g_amx is set.
#define BRISK_AMX_FN __attribute__((target("amx-tile,amx-int8"), noinline))
#define BRISK_AMX_INLINE inline __attribute__((target("amx-tile,amx-int8"), always_inline))

struct alignas(64) TileConfig {  // palette 1: the 64-byte operand of LDTILECFG
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tmm0..tmm15 (only 8 exist)
  uint8_t rows[16] = {};
};

// acc (int32 [32][32], row stride 32) = the MT x NT tiles' sums over K of the block at xu (rows of K bytes) and the
// panel at w (NT tiles of tile_bytes), tail: NT zero-padded B tiles of the K tail (null when K % 64 == 0)
template <int MT, int NT>
BRISK_AMX_INLINE void amx_block(const uint8_t* xu, int64_t K, const int8_t* w, int64_t tile_bytes,
                                const int8_t* tail, int32_t* acc) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  const int64_t full = K / kAmxK;
  for (int64_t kc = 0; kc <= full; ++kc) {
    const int8_t* b;
    int64_t b_stride = 64;
    if (kc < full) {
      b = w + kc * kAmxK * kTile;  // 16 groups x 64 bytes
    } else if (tail != nullptr) {
      b = tail;
    } else {
      break;
    }
    const int64_t b1 = kc < full ? tile_bytes : kTile * kAmxK;  // the second tile: in the panel, or the next copy
    const uint8_t* a = xu + kc * kAmxK;
    _tile_loadd(4, a, K);
    if constexpr (MT == 2) _tile_loadd(5, a + 16 * K, K);
    _tile_loadd(6, b, b_stride);
    if constexpr (NT == 2) _tile_loadd(7, b + b1, b_stride);
    _tile_dpbusd(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbusd(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbusd(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, acc, 128);
  if constexpr (NT == 2) _tile_stored(1, acc + 16, 128);
  if constexpr (MT == 2) _tile_stored(2, acc + 16 * 32, 128);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, acc + 16 * 32 + 16, 128);
}

// Work items [a, b) of (block of 32 rows, panel of 2 tiles), row-block-major: the block's activations (32 K bytes)
// stay in L1 while the panels of weights stream from L2 (measured on Sapphire Rapids, M = 512: ~1.5x the
// panel-major order, where the activations were streamed instead).
template <typename MakeEpi>
BRISK_AMX_FN void amx_items(int64_t a, int64_t b, const uint8_t* xu, int64_t M, int64_t K, const int8_t* w,
                            int64_t N, const MakeEpi& make_epi) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t tiles = N / kTile, panels = (tiles + 1) / 2;
  const int64_t tile_bytes = kTile * K, tail_groups = (K % kAmxK) / 4;
  alignas(64) int32_t acc[32 * 32];           // C tiles: [32 rows][2 tiles x 16 outputs]
  alignas(64) int8_t tail[2 * kTile * kAmxK];  // the K tail's B tiles of one panel, zero-padded to 16 groups
  for (int64_t item = a; item < b; ++item) {
    const int64_t mb = item / panels, p = item % panels;
    const int64_t t0 = 2 * p, m0 = mb * kAmxMBlock;
    const int nt = static_cast<int>(std::min<int64_t>(2, tiles - t0));
    const int mr = static_cast<int>(std::min<int64_t>(kAmxMBlock, M - m0));
    const int8_t* wp = w + t0 * tile_bytes;
    if (tail_groups > 0) {
      std::memset(tail, 0, sizeof(tail));
      for (int j = 0; j < nt; ++j)
        std::memcpy(tail + j * kTile * kAmxK, wp + j * tile_bytes + (K / kAmxK) * kAmxK * kTile, tail_groups * 64);
    }
    const int8_t* tp = tail_groups > 0 ? tail : nullptr;
    const uint8_t* x = xu + m0 * K;
    if (mr > 16) {
      if (nt == 2) amx_block<2, 2>(x, K, wp, tile_bytes, tp, acc);
      else amx_block<2, 1>(x, K, wp, tile_bytes, tp, acc);
    } else {
      if (nt == 2) amx_block<1, 2>(x, K, wp, tile_bytes, tp, acc);
      else amx_block<1, 1>(x, K, wp, tile_bytes, tp, acc);
    }
    const auto epi = make_epi(m0, t0 * kTile);
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nt; ++j) epi(i, j, _mm512_load_si512(acc + i * 32 + 16 * j));
  }
  _tile_release();  // the thread's tile state back to init: no 8 KiB to save at each context switch
}

template <typename MakeEpi>
void gemm_amx(const uint8_t* xu, int64_t M, int64_t K, const int8_t* w, int64_t N, const MakeEpi& make_epi) {
  const int64_t panels = (N / kTile + 1) / 2, blocks = (M + kAmxMBlock - 1) / kAmxMBlock;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t a, int64_t b) {
    amx_items(a, b, xu, M, K, w, N, make_epi);
  });
}
#endif  // BRISK_AMX

// the GEMM over work items (panel of kNR tiles, chunk of kMChunk rows); make_epi(m0, n0) gives a block's epilogue
template <typename MakeEpi>
void gemm(const uint8_t* xu, int64_t M, int64_t K, const int8_t* w, int64_t N, const MakeEpi& make_epi) {
#ifdef BRISK_AMX
  if (M >= kAmxMinRows && g_amx.load(std::memory_order_relaxed)) {
    gemm_amx(xu, M, K, w, N, make_epi);
    return;
  }
#endif
  const int64_t tiles = N / kTile, panels = (tiles + kNR - 1) / kNR, chunks = (M + kMChunk - 1) / kMChunk;
  const int64_t tile_bytes = kTile * K;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t item = a; item < b; ++item) {
      const int64_t p = item / chunks, mc = item % chunks;  // panel-major: one panel's weights stay hot
      const int64_t t0 = p * kNR;
      const int nr = static_cast<int>(std::min<int64_t>(kNR, tiles - t0));
      const int64_t m_end = std::min(M, (mc + 1) * kMChunk);
      for (int64_t m0 = mc * kMChunk; m0 < m_end; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, m_end - m0));
        micro_dispatch(mr, nr, xu + m0 * K, K, w + t0 * tile_bytes, tile_bytes, make_epi(m0, t0 * kTile));
      }
    }
  });
}

void check_weight(const char* op, const at::Tensor& w, const at::Tensor& colsum, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous() && w.size(1) == K &&
                  w.size(0) % kTile == 0 && K % 4 == 0,
              op, ": the weight must be a contiguous int8 [N, K] tensor in the tiled layout (N % 16 == 0, K % 4 "
              "== 0, K = the activations' columns)");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.dim() == 1 &&
                  colsum.size(0) == w.size(0),
              op, ": col_sum must be int32 [N]");
}

// The kernels' activation rows: [M, K] uint8 in a buffer of M rounded up to 16 rows plus 64 bytes (the AMX path
// loads 16-row tiles of 64 bytes a row), the padding zeroed
at::Tensor activation_buffer(int64_t M, int64_t K, const at::TensorOptions& options) {
  const int64_t rows = (M + 15) / 16 * 16;
  auto buf = at::empty({rows * K + 64}, options.dtype(at::kByte));
  std::memset(buf.data_ptr<uint8_t>() + M * K, 0, (rows - M) * K + 64);
  return buf;
}

// 128 * colsum (the VNNI build's shift), or zeros where the build takes signed activations directly
at::Tensor shift_terms(const at::Tensor& colsum) {
  return kVnni ? colsum * 128 : at::zeros_like(colsum);
}

}  // namespace

// x [M, K] float32 -> (xq int8 [M, K], xs float32 [M]); input_scale: a calibrated per-tensor scale, else per token
std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x, const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "w8a8_quantize_rows: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const float s = input_scale.has_value() && input_scale->defined() ? input_scale->item<float>() : 0.f;
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto xs = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = reinterpret_cast<uint8_t*>(xq.data_ptr<int8_t>());
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) {
      sp[m] = quantize_row(xp + m * K, K, s, qp + m * K);
      if (kVnni)  // the stored form is signed: undo the shift
        for (int64_t k = 0; k < K; ++k) qp[m * K + k] ^= 0x80;
    }
  });
  return {xq, xs};
}

// xq [M, K] int8 x tiled w [N, K] int8 -> int32 [M, N]: the exact integer products (tests' oracle is torch)
at::Tensor w8a8_int_mm(const at::Tensor& xq, const at::Tensor& w, const at::Tensor& colsum) {
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.is_contiguous(),
              "w8a8_int_mm: xq must be a contiguous int8 [M, K] tensor");
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  check_weight("w8a8_int_mm", w, colsum, K);
  TORCH_CHECK(xq.min().item<int8_t>() >= -127, "w8a8_int_mm: activation codes must lie in [-127, 127]");
  const at::Tensor xu = activation_buffer(M, K, xq.options());
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(xq.data_ptr<int8_t>());
  uint8_t* up = xu.data_ptr<uint8_t>();
  for (int64_t i = 0; i < M * K; ++i) up[i] = qp[i] ^ (kVnni ? 0x80 : 0);
  const at::Tensor c128 = shift_terms(colsum);
  auto out = at::empty({M, N}, colsum.options());
  int32_t* o = out.data_ptr<int32_t>();
  const int32_t* cp = c128.data_ptr<int32_t>();
  gemm(up, M, K, w.data_ptr<int8_t>(), N, [&](int64_t m0, int64_t n0) { return IntEpi{o, N, m0, n0, cp}; });
  return out;
}

// y [M, N] float32 = (xs[m] * ws[n]) * sum_k xq wq + bias, x [M, K] float32 rounded as w8a8_quantize_rows does.
// col_sum128: 128 * col_sum for the VNNI build (w8a8_shift_terms), computed once per layer.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& col_sum128,
                       const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "w8a8_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight("w8a8_linear", w, col_sum128, K);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == N,
              "w8a8_linear: w_scale must be float32 [N]");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "w8a8_linear: bias must be float32 [N]");
  const float s = input_scale.has_value() && input_scale->defined() ? input_scale->item<float>() : 0.f;
  const at::Tensor xu = activation_buffer(M, K, x.options());  // [M, K] rows (+ the AMX path's padding)
  auto xs = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* up = xu.data_ptr<uint8_t>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) sp[m] = quantize_row(xp + m * K, K, s, up + m * K);
  });
  auto out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  const int32_t* cp = col_sum128.data_ptr<int32_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  gemm(up, M, K, w.data_ptr<int8_t>(), N,
       [&](int64_t m0, int64_t n0) { return FloatEpi{o, N, m0, n0, cp, sp, wsp, bp}; });
  return out;
}

at::Tensor w8a8_shift_terms(const at::Tensor& colsum) { return shift_terms(colsum); }

// enable: use AMX-INT8 for the GEMMs of at least kAmxMinRows rows from now on, where this build has the AMX path and
// the process is granted the tile state (ops/kernels.py asks only where /proc/cpuinfo reports amx_tile and
// amx_int8); enable = false: the VNNI path for every row count. Returns the row count from which AMX is used, 0
// when it is not.
int64_t w8a8_amx(bool enable) {
#ifdef BRISK_AMX
  g_amx.store(enable && request_amx_permission());
  return g_amx.load() ? kAmxMinRows : 0;
#else
  (void)enable;
  return 0;
#endif
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("w8a8_quantize_rows(Tensor x, Tensor? input_scale) -> (Tensor, Tensor)", &w8a8_quantize_rows);
  m.def("w8a8_int_mm(Tensor xq, Tensor w, Tensor col_sum) -> Tensor", &w8a8_int_mm);
  m.def("w8a8_shift_terms(Tensor col_sum) -> Tensor", &w8a8_shift_terms);
  m.def("w8a8_amx(bool enable) -> int", &w8a8_amx);
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor col_sum128, Tensor? input_scale, Tensor? bias) "
        "-> Tensor", &w8a8_linear);
}

#endif  // AVX2 + FMA
