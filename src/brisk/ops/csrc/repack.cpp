// Load-time byte shuffles of brisk's packed weights, in C++ because in PyTorch each is a dozen elementwise passes
// over the whole matrix (a 1B model's GGUF took ~25 s to repack and ~15 s to tile that way on 2 cores).
//
// gguf_repack: GGML-encoded rows [N, row_bytes] -> brisk's blocked layout (ops/qlinear.py `_to_blocked`) or the
// tiled one (`_to_tiled`) plus group scales and minimums, one pass, no temporaries beyond one row of codes, into
// any row range of the destination (a part of a fused weight). The decoding of each block
// follows model/gguf_repack.py `_codes_and_params` (the PyTorch reference, which tests/test_gguf_repack.py checks
// against gguf's own dequantization); the parameters are computed with the same float32 operations (one product
// d * sc, one negation), so both paths give the same bits.
//
// packed_retile: the blocked layout <-> the tiled layout of the AVX-512 kernels (ops/qlinear.py `_to_tiled`,
// ops/csrc/quant_q8t.cpp) for 8- and 4-bit codes, in place, one 16-row tile at a time.
//
// Plain scalar loops: the work is memory-bound byte moves that the compiler vectorises where it can; the same
// source builds on every tier.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;     // columns per block of brisk's layouts
constexpr int64_t kTileRows = 16;  // rows per tile of the tiled layout

// GGML type ids (gguf's GGMLQuantizationType)
enum GgmlType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14
};

struct Format {
  int64_t block_size, type_size, bits, group;
  bool mins;
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return {32, 34, 8, 32, false};
    case Q4_0: return {32, 18, 4, 32, false};
    case Q4_1: return {32, 20, 4, 32, true};
    case Q5_0: return {32, 22, 8, 32, false};
    case Q5_1: return {32, 24, 8, 32, true};
    case Q4_K: return {256, 144, 4, 32, true};
    case Q5_K: return {256, 176, 8, 32, true};
    case Q6_K: return {256, 210, 8, 16, false};
    case Q3_K: return {256, 110, 4, 16, false};
    case Q2_K: return {256, 84, 4, 16, true};
    default: TORCH_CHECK(false, "gguf_repack: GGML type ", qtype, " has no packed form");
  }
  return {};
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ggml's get_scale_min_k4: 12 bytes -> 8 6-bit scales and 8 6-bit minimums
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One GGML block -> codes q[block_size] in the container's coding (skipped when q is null), scales s[groups],
// minimums m[groups].
inline __attribute__((always_inline)) void decode_block(int64_t qtype, const uint8_t* __restrict b,
                                                       uint8_t* __restrict q, float* __restrict s,
                                                       float* __restrict m) {
  switch (qtype) {
    case Q8_0:  // d f16 | qs int8[32]: code = q + 128, the sign bit flipped
      s[0] = f16(b);
      if (!q) return;
      for (int i = 0; i < 32; ++i) q[i] = b[2 + i] ^ 0x80;
      return;
    case Q4_0:  // d f16 | qs[16]: low nibbles are weights 0..15, high nibbles 16..31
    case Q4_1: {  // d f16 | m f16 | qs[16]
      const int off = qtype == Q4_1 ? 4 : 2;
      s[0] = f16(b);
      if (qtype == Q4_1) m[0] = f16(b + 2);
      if (!q) return;
      // 8 bytes at a time: low nibbles of bytes i, then (the word shifted by 4) their high nibbles
      constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0FULL;
      for (int h = 0; h < 2; ++h) {
        uint64_t w;
        std::memcpy(&w, b + off + 8 * h, 8);
        const uint64_t low = w & kLow, high = (w >> 4) & kLow;
        std::memcpy(q + 8 * h, &low, 8);
        std::memcpy(q + 16 + 8 * h, &high, 8);
      }
      return;
    }
    case Q5_0:  // d f16 | qh u32 | qs[16]: bit 4 of weight j is bit j of qh; Q5_0's code is q + 112
    case Q5_1: {  // d f16 | m f16 | qh u32 | qs[16]
      const int off = qtype == Q5_1 ? 4 : 2;
      s[0] = f16(b);
      if (qtype == Q5_1) m[0] = f16(b + 2);
      if (!q) return;
      const uint8_t* qh = b + off;
      const uint8_t* qs = b + off + 4;
      const uint8_t add = qtype == Q5_0 ? 112 : 0;
      for (int j = 0; j < 32; ++j) {
        const uint8_t low = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
        const uint8_t high = (qh[j / 8] >> (j % 8)) & 1;
        q[j] = static_cast<uint8_t>((low | (high << 4)) + add);
      }
      return;
    }
    case Q4_K:  // d f16 | dmin f16 | scales[12] | (qh[32]) | qs[128]; sub-block j = 2 c + h of 32 weights
    case Q5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k4_scale_min(b + 4, j, sc, mn);
        s[j] = d * static_cast<float>(sc);
        m[j] = -(dmin * static_cast<float>(mn));
      }
      if (!q) return;
      const uint8_t* qs = qtype == Q5_K ? b + 48 : b + 16;
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 32; ++l) q[64 * c + 32 * h + l] = (qs[32 * c + l] >> (4 * h)) & 0x0F;
      if (qtype == Q5_K) {  // bit 4 of weight 32 j + l is bit j of qh[l]
        const uint8_t* qh = b + 16;
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) q[32 * j + l] |= static_cast<uint8_t>(((qh[l] >> j) & 1) << 4);
      }
      return;
    }
    case Q6_K: {  // ql[128] | qh[64] | scales int8[16] | d f16; weight 128 h + 32 s + l; code q + 96
      const float d = f16(b + 208);
      for (int j = 0; j < 16; ++j) s[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
      if (!q) return;
      for (int h = 0; h < 2; ++h)
        for (int sb = 0; sb < 4; ++sb)
          for (int l = 0; l < 32; ++l) {
            const uint8_t low = (b[64 * h + 32 * (sb % 2) + l] >> (4 * (sb / 2))) & 0x0F;
            const uint8_t high = (b[128 + 32 * h + l] >> (2 * sb)) & 3;
            q[128 * h + 32 * sb + l] = static_cast<uint8_t>((low | (high << 4)) + 96);
          }
      return;
    }
    case Q3_K: {  // hmask[32] | qs[64] | scales[12] | d f16; weight 128 h + 32 s + l; code q + 8
      const float d = f16(b + 108);
      const uint8_t* sc = b + 96;
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? (sc[i] & 0x0F) : (sc[i - 8] >> 4);
        const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        s[i] = d * static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(low | (high << 4))) - 32);
      }
      if (!q) return;
      for (int h = 0; h < 2; ++h)
        for (int sb = 0; sb < 4; ++sb)
          for (int l = 0; l < 32; ++l) {
            const int low = (b[32 + 32 * h + l] >> (2 * sb)) & 3;
            const int high = (b[l] >> (4 * h + sb)) & 1;
            q[128 * h + 32 * sb + l] = static_cast<uint8_t>(low + 4 + (high << 2));
          }
      return;
    }
    case Q2_K: {  // scales[16] | qs[64] | d f16 | dmin f16; weight 128 h + 32 s + l
      const float d = f16(b + 80), dmin = f16(b + 82);
      for (int j = 0; j < 16; ++j) {
        s[j] = d * static_cast<float>(b[j] & 0x0F);
        m[j] = -(dmin * static_cast<float>(b[j] >> 4));
      }
      if (!q) return;
      for (int h = 0; h < 2; ++h)
        for (int sb = 0; sb < 4; ++sb)
          for (int l = 0; l < 32; ++l) q[128 * h + 32 * sb + l] = (b[16 + 32 * h + l] >> (2 * sb)) & 3;
      return;
    }
    default: TORCH_CHECK(false, "gguf_repack: GGML type ", qtype, " has no packed form");
  }
}

// codes q[K] of one row -> the blocked layout (8 bits: word l, byte i = q[8 i + l]; 4 bits: word j < 4, byte i =
// q[8 i + j] | q[8 i + j + 4] << 4)
void to_blocked(const uint8_t* q, int64_t k, int64_t bits, uint8_t* out) {
  for (int64_t b = 0; b < k / kBlock; ++b, q += kBlock) {
    if (bits == 8) {
      for (int l = 0; l < 8; ++l)
        for (int i = 0; i < 4; ++i) out[32 * b + 4 * l + i] = q[8 * i + l];
    } else {
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          out[16 * b + 4 * j + i] = static_cast<uint8_t>(q[8 * i + j] | (q[8 * i + j + 4] << 4));
    }
  }
}




// codes q[K] of one row -> lane `lane` of its 16-row tile in the tiled layout (ops/qlinear.py `_to_tiled`): tiled
// word c of the row sits at bytes (16 c + lane) * 4 of the tile (8 bits: q[4 c .. 4 c + 3]; 4 bits: byte j is
// q[8 c + j] | q[8 c + 4 + j] << 4)
void to_tiled_row(const uint8_t* __restrict q, int64_t k, int64_t bits, uint8_t* __restrict tile, int64_t lane) {
  uint8_t* word = tile + 4 * lane;
  if (bits == 8) {
    for (int64_t c = 0; c < k / 4; ++c, word += 4 * kTileRows) std::memcpy(word, q + 4 * c, 4);
  } else {  // codes are below 16: the four low bytes OR the four high ones shifted by a nibble, no carries
    for (int64_t c = 0; c < k / 8; ++c, word += 4 * kTileRows) {
      uint32_t lo, hi;
      std::memcpy(&lo, q + 8 * c, 4);
      std::memcpy(&hi, q + 8 * c + 4, 4);
      const uint32_t w = lo | (hi << 4);
      std::memcpy(word, &w, 4);
    }
  }
}

// a row's group parameters v[groups] stored at dst[base + g * stride] as float32, or as float16 (round to nearest:
// exact where the caller checked that the values fit, gguf_params_fit_half)
inline void put_params(void* dst, bool half, int64_t base, int64_t stride, const float* v, int64_t groups) {
  if (half) {
    c10::Half* out = static_cast<c10::Half*>(dst) + base;
    for (int64_t g = 0; g < groups; ++g) out[g * stride] = c10::Half(v[g]);
  } else {
    float* out = static_cast<float*>(dst) + base;
    for (int64_t g = 0; g < groups; ++g) out[g * stride] = v[g];
  }
}

void check_raw(const at::Tensor& raw, const Format& f, int64_t k) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
              "gguf_repack: raw must be contiguous CPU uint8 [N, row_bytes]");
  TORCH_CHECK(k % f.block_size == 0 && raw.size(1) == k / f.block_size * f.type_size,
              "gguf_repack: rows of ", raw.size(1), " bytes do not hold ", k, " weights of this type");
}

struct RepackArgs {
  const uint8_t* src;
  const int64_t* perm;  // null: rows in stored order
  int64_t row_bytes;
  uint8_t* dst;
  void *scales, *mins;  // mins null for the symmetric forms
  bool s_half, m_half;
  int64_t n, k, row0;
  bool tiled;
};

// The legacy types into the tiled layout with float16 parameters (what the loader asks for them), without the row
// of codes in between: Q4_0 / Q4_1's 16 code bytes are the block's 4 tiled words after nibble masks and shifts
// (word c = 4 b + w of the row holds codes 8 w + j and 8 w + 4 + j, j = 0..3, of block b; codes 0..15 are the
// low nibbles of bytes 0..15, codes 16..31 their high nibbles), Q8_0's 32 code bytes are its 8 words with the sign
// bits flipped; the float16 d (and m) are copied as they are stored (exact, as gguf_repack.py says).
template <int64_t QT>
void legacy_tiled_row(const uint8_t* __restrict row, int64_t k, uint8_t* __restrict tile, int64_t lane,
                      uint16_t* __restrict scales, uint16_t* __restrict mins) {
  constexpr int64_t type_size = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18, off = QT == Q4_1 ? 4 : 2;
  constexpr uint32_t kLow = 0x0F0F0F0FU, kHigh = 0xF0F0F0F0U;
  uint8_t* word = tile + 4 * lane;  // word c of the row: word + 64 c
  for (int64_t b = 0; b < k / kBlock; ++b, row += type_size) {
    std::memcpy(scales + b * kTileRows, row, 2);
    if (QT == Q4_1) std::memcpy(mins + b * kTileRows, row + 2, 2);
    uint32_t w[8];
    std::memcpy(w, row + off, QT == Q8_0 ? 32 : 16);
    if (QT == Q8_0) {
      for (int c = 0; c < 8; ++c) {
        const uint32_t v = w[c] ^ 0x80808080U;
        std::memcpy(word + (8 * b + c) * 4 * kTileRows, &v, 4);
      }
    } else {  // w[0..3]: code bytes 0-3, 4-7, 8-11, 12-15
      const uint32_t v[4] = {(w[0] & kLow) | ((w[1] & kLow) << 4), (w[2] & kLow) | ((w[3] & kLow) << 4),
                             ((w[0] >> 4) & kLow) | (w[1] & kHigh), ((w[2] >> 4) & kLow) | (w[3] & kHigh)};
      for (int c = 0; c < 4; ++c) std::memcpy(word + (4 * b + c) * 4 * kTileRows, &v[c], 4);
    }
  }
}

template <int64_t QT>
void repack_rows(const RepackArgs& a) {
  const Format f = format_of(QT);
  const int64_t k = a.k, out_bytes = k / kBlock * 4 * f.bits, groups = k / f.group;
  const int64_t per_block = f.block_size / f.group;
  // (rows of one tile may go to different threads: they write disjoint bytes)
  if constexpr (QT == Q4_0 || QT == Q4_1 || QT == Q8_0) {
    if (a.tiled && a.s_half && (QT != Q4_1 || a.m_half)) {
      at::parallel_for(0, a.n, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t out = a.row0 + r, tile = out / kTileRows, lane = out % kTileRows;
          const int64_t params = tile * groups * kTileRows + lane;  // [tile, g, lane]
          legacy_tiled_row<QT>(a.src + (a.perm ? a.perm[r] : r) * a.row_bytes, k, a.dst + tile * kTileRows * out_bytes,
                               lane, static_cast<uint16_t*>(a.scales) + params,
                               QT == Q4_1 ? static_cast<uint16_t*>(a.mins) + params : nullptr);
        }
      });
      return;
    }
  }
  at::parallel_for(0, a.n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> q(k);
    std::vector<float> s(groups), m(groups);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = a.src + (a.perm ? a.perm[r] : r) * a.row_bytes;
      for (int64_t b = 0; b < k / f.block_size; ++b)
        decode_block(QT, row + b * f.type_size, q.data() + b * f.block_size, s.data() + b * per_block,
                     m.data() + b * per_block);
      const int64_t out = a.row0 + r, tile = out / kTileRows, lane = out % kTileRows;
      if (a.tiled)
        to_tiled_row(q.data(), k, f.bits, a.dst + tile * kTileRows * out_bytes, lane);
      else
        to_blocked(q.data(), k, f.bits, a.dst + out * out_bytes);
      // parameters in row order: [out, g]; tiled: [tile, g, lane]
      const int64_t base = a.tiled ? tile * groups * kTileRows + lane : out * groups;
      const int64_t stride = a.tiled ? kTileRows : 1;
      put_params(a.scales, a.s_half, base, stride, s.data(), groups);
      if (a.mins) put_params(a.mins, a.m_half, base, stride, m.data(), groups);
    }
  });
}

// raw [n, row_bytes] uint8 (stored row perm[i] becomes row i when perm is given) -> rows row0 .. row0 + n of
// data [N, K / 32 * 4 * bits] uint8, scales [N, K / group] and mins [N, K / group] (float32 or float16, for the
// forms with a minimum), N >= row0 + n: the blocked layout, or with `tiled` (8- and 4-bit codes, N % 16 == 0) the
// tiled layout with parameters in [N / 16, K / group, 16] order (ops/qlinear.py `_tile_rows`). So a part of a
// fused q/k/v or gate/up weight is written straight into its rows of the fused buffers, in its final layout.
void gguf_repack(const at::Tensor& raw, int64_t qtype, int64_t in_features, const std::optional<at::Tensor>& perm,
                 const at::Tensor& data, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                 int64_t row0, bool tiled) {
  const Format f = format_of(qtype);
  const int64_t n = raw.size(0), k = in_features;
  check_raw(raw, f, k);
  const int64_t out_bytes = k / kBlock * 4 * f.bits, groups = k / f.group;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.numel() % out_bytes == 0,
              "gguf_repack: data must be contiguous uint8 [N, K / 32 * 4 * bits]");
  const int64_t total = data.numel() / out_bytes;
  TORCH_CHECK(row0 >= 0 && row0 + n <= total, "gguf_repack: rows ", row0, "..", row0 + n, " do not fit the ",
              total, " rows of data");
  TORCH_CHECK(!tiled || ((f.bits == 8 || f.bits == 4) && total % kTileRows == 0),
              "gguf_repack: the tiled layout takes 8- or 4-bit codes in whole 16-row tiles");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == f.mins, "gguf_repack: this type ", f.mins ? "needs" : "takes no", " minimums");
  for (const at::Tensor* t : {&scales, has_mins ? &*mins : nullptr}) {
    if (!t) continue;
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) && t->is_contiguous()
                    && t->numel() == total * groups,
                "gguf_repack: scales and mins must be contiguous float32 or float16 [N, K / group]");
  }
  const int64_t* p = nullptr;
  at::Tensor perm_c;
  if (perm.has_value() && perm->defined()) {
    perm_c = perm->to(at::kLong).contiguous();
    TORCH_CHECK(perm_c.numel() == n, "gguf_repack: perm must have N entries");
    p = perm_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] >= 0 && p[i] < n, "gguf_repack: perm entry out of range");
  }
  const RepackArgs a{raw.data_ptr<uint8_t>(), p, raw.size(1), data.data_ptr<uint8_t>(), scales.data_ptr(),
                     has_mins ? mins->data_ptr() : nullptr, scales.scalar_type() == at::kHalf,
                     has_mins && mins->scalar_type() == at::kHalf, n, k, row0, tiled};
  switch (qtype) {  // one instance per type: decode_block's switch folds away in the inner loop
    case Q4_0: return repack_rows<Q4_0>(a);
    case Q4_1: return repack_rows<Q4_1>(a);
    case Q5_0: return repack_rows<Q5_0>(a);
    case Q5_1: return repack_rows<Q5_1>(a);
    case Q8_0: return repack_rows<Q8_0>(a);
    case Q2_K: return repack_rows<Q2_K>(a);
    case Q3_K: return repack_rows<Q3_K>(a);
    case Q4_K: return repack_rows<Q4_K>(a);
    case Q5_K: return repack_rows<Q5_K>(a);
    case Q6_K: return repack_rows<Q6_K>(a);
    default: TORCH_CHECK(false, "gguf_repack: GGML type ", qtype, " has no packed form");
  }
}

// Whether the group parameters of raw [N, row_bytes] survive a round trip through float16: bit 0 the scales, bit
// 1 the minimums (set for types without). The loader picks the parameters' dtype from it before the repack writes
// them (model/gguf_repack.py `_param_dtype`, the same test); only the blocks' parameter bytes are decoded.
int64_t gguf_params_fit_half(const at::Tensor& raw, int64_t qtype, int64_t in_features) {
  const Format f = format_of(qtype);
  const int64_t n = raw.size(0), k = in_features;
  check_raw(raw, f, k);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const int64_t blocks = n * (k / f.block_size), per_block = f.block_size / f.group;
  std::atomic<bool> s_fit{true}, m_fit{true};
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    float s[16], m[16];
    bool sf = true, mf = true;
    for (int64_t b = b0; b < b1 && (sf || mf); ++b) {
      decode_block(qtype, src + b * f.type_size, nullptr, s, m);
      for (int64_t g = 0; g < per_block; ++g) {
        sf = sf && static_cast<float>(c10::Half(s[g])) == s[g];
        mf = mf && (!f.mins || static_cast<float>(c10::Half(m[g])) == m[g]);
      }
    }
    if (!sf) s_fit = false;
    if (!mf) m_fit = false;
  });
  return (s_fit ? 1 : 0) | (m_fit ? 2 : 0);
}

// Both layouts are byte permutations of each other, row by row within a 16-row tile (no code is decoded):
//   4 bits: blocked byte 16 b + 4 j + i (codes 32 b + 8 i + j, + 4) is byte j of tiled word c = 4 b + i of row r;
//   8 bits: blocked byte 32 b + 4 l + i (code 32 b + 8 i + l) is byte l % 4 of tiled word c = 8 b + 2 i + l / 4.
// Tiled word c of row r sits at bytes (16 c + r) * 4 of the tile.
// data [N, K * bits / 8] uint8 (N % 16 == 0), blocked <-> tiled, in place
void packed_retile(const at::Tensor& data, int64_t bits, int64_t in_features, bool to_tiled) {
  TORCH_CHECK(bits == 8 || bits == 4, "packed_retile: 8- or 4-bit codes only");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu(),
              "packed_retile: data must be contiguous CPU uint8");
  const int64_t k = in_features, row_bytes = k * bits / 8;
  TORCH_CHECK(k % kBlock == 0 && data.numel() % (kTileRows * row_bytes) == 0,
              "packed_retile: data must hold whole 16-row tiles of ", k, " columns");
  const int64_t tiles = data.numel() / (kTileRows * row_bytes);
  // one 32-column block of a row: block_bytes bytes; of all 16 rows of a tile: block_span bytes in either layout
  const int64_t block_bytes = 4 * bits, block_span = kTileRows * block_bytes;
  uint8_t* base = data.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> copy(kTileRows * row_bytes);
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* tile = base + t * kTileRows * row_bytes;
      std::memcpy(copy.data(), tile, copy.size());
      for (int64_t b = 0; b < k / kBlock; ++b) {  // a block's bytes of all 16 rows: block_span bytes of the tile
        for (int64_t r = 0; r < kTileRows; ++r) {
          uint8_t* blocked = (to_tiled ? copy.data() : tile) + r * row_bytes + b * block_bytes;
          uint8_t* tiled = (to_tiled ? tile : copy.data()) + b * block_span + r * 4;
          // groups of 4 blocked words whose bytes i make tiled word i: a 4x4 byte transpose (one group for 4 bits,
          // two for 8 bits: words l = 4 h .. 4 h + 3 give tiled words 2 i + h)
          for (int64_t h = 0; h < bits / 4; ++h) {
            for (int64_t i = 0; i < 4; ++i) {
              uint8_t* word = tiled + (bits == 4 ? i : 2 * i + h) * kTileRows * 4;
              const uint8_t* src = blocked + 16 * h + i;
              if (to_tiled) {
                for (int64_t j = 0; j < 4; ++j) word[j] = src[4 * j];
              } else {
                for (int64_t j = 0; j < 4; ++j) blocked[16 * h + 4 * j + i] = word[j];
              }
            }
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("gguf_repack(Tensor raw, int qtype, int in_features, Tensor? perm, Tensor(a!) data, Tensor(b!) scales, "
        "Tensor(c!)? mins, int row0=0, bool tiled=False) -> ()", &gguf_repack);
  m.def("gguf_params_fit_half(Tensor raw, int qtype, int in_features) -> int", &gguf_params_fit_half);
  m.def("packed_retile(Tensor(a!) data, int bits, int in_features, bool to_tiled) -> ()", &packed_retile);
}
