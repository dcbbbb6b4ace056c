// Writes into the quantized paged KV caches of kvcache/quant.py, each in one pass and bit-identical to the PyTorch
// write there (tests/test_kv_quant.py): the codes, scales, minima, and for int4 the residual window's state.
//
// int8 (Int8KVCache): per (token, kv head) over d channels, symmetric:
//     s = fp16(max(max|x| / 127, 2^-24)),   q = clamp(round_half_even(x / s), -127, 127)
// int4 (Int4KVCache, KIVI): values per (token, kv head), keys per (block, kv head, channel), asymmetric min-max:
//     lo = fp16(min x),  s = fp16(max((max x - lo) / 15, 1e-6)),  q = clamp(round_half_even((x - lo) / s), 0, 15)
// with the keys of a block still being filled held in float16 in a residual buffer until the block's last slot is
// written; when every buffer is taken, the least recently written one is quantized early (the module docstring of
// kvcache/quant.py). All arithmetic is float32, as torch's on float32 tensors (true divisions); bfloat16 and
// float16 inputs widen exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace brisk {
namespace {

template <typename T>
inline void quantize_row_int8(const T* x, int64_t d, int8_t* codes, c10::Half* scale) {
  float amax = 0.0f;
  for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(static_cast<float>(x[c])));
  const c10::Half s(std::max(amax / 127.0f, 5.9604644775390625e-8f));  // 2^-24, the smallest float16
  *scale = s;
  const float sf = static_cast<float>(s);
  for (int64_t c = 0; c < d; ++c)
    codes[c] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(static_cast<float>(x[c]) / sf))));
}

// (scale, min) of n values x[i * stride] (float32 after widening), as quantize_int4
template <typename T>
inline void int4_params(const T* x, int64_t n, int64_t stride, c10::Half& scale, c10::Half& lo) {
  float mn = static_cast<float>(x[0]), mx = mn;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(x[i * stride]);
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  lo = c10::Half(mn);
  scale = c10::Half(std::max((mx - static_cast<float>(lo)) / 15.0f, 1e-6f));
}

inline uint8_t int4_code(float x, float lo, float scale) {
  return static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, std::nearbyint((x - lo) / scale))));
}

void check_slots(const char* op, const at::Tensor& slot_mapping, int64_t T, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              op, ": slot_mapping must be a contiguous int64 [", T, "] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, op, ": slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's ", num_slots, " slots");
}

void check_kv(const char* op, const at::Tensor& k, const at::Tensor& v, int64_t kvh, int64_t d) {
  const int64_t T = k.size(0);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == kvh && t->size(2) == d && t->stride(2) == 1 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == k.scalar_type() && t->device().is_cpu(),
                op, ": k and v must be float32 or bfloat16 [", T, ", ", kvh, ", ", d,
                "] with a contiguous last dim, got ", t->sizes(), " ", t->scalar_type());
}

}  // namespace

// k, v [T, kvh, d] float32 or bfloat16, last dim contiguous (views of a projection's output); codes
// [2, slots, kvh, d] int8, scales [2, slots, kvh] float16; slot_mapping [T] int64.
void kv_write_int8(at::Tensor codes, at::Tensor scales, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "kv_write_int8: codes must be a contiguous int8 [2, slots, kv_heads, head_dim] tensor, got ",
              codes.sizes());
  const int64_t num_slots = codes.size(1), kvh = codes.size(2), d = codes.size(3), T = k.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == codes.sizes().slice(0, 3),
              "kv_write_int8: scales must be a contiguous float16 ", codes.sizes().slice(0, 3), " tensor");
  check_kv("kv_write_int8", k, v, kvh, d);
  check_slots("kv_write_int8", slot_mapping, T, num_slots);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int8_t* out = codes.data_ptr<int8_t>();
  c10::Half* sc = scales.data_ptr<c10::Half>();
  auto run = [&](auto* kp, auto* vp) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < kvh; ++h) {
        const int64_t row = slots[t] * kvh + h;
        quantize_row_int8(kp + t * k.stride(0) + h * k.stride(1), d, out + row * d, sc + row);
        quantize_row_int8(vp + t * v.stride(0) + h * v.stride(1), d, out + (num_slots * kvh + row) * d,
                          sc + num_slots * kvh + row);
      }
    }
  };
  if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
  else run(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
}

namespace {

// One int4 cache's tensors (Int4KVCache.write_state) and the residual window's bookkeeping.
struct Int4Cache {
  uint8_t* k_codes;  // [nb, bs, kvh, d/2]
  c10::Half *k_scale, *k_min;  // [nb, kvh, d]
  uint8_t* v_codes;  // [nb * bs, kvh, d/2]
  c10::Half *v_scale, *v_min;  // [nb * bs, kvh]
  c10::Half* k_residual;  // [R, bs, kvh, d]
  int64_t* residual_of_block;  // [nb], -1 = none
  int64_t* block_of_residual;  // [R], -1 = free
  int64_t* residual_tick;  // [R], when the buffer was last written (least recently written = smallest)
  int64_t* clock;  // [1]
  int64_t nb, bs, kvh, d, R;

  // keys of `rows` rows of block b (float16 values, row stride kvh * d) -> its codes and per-channel params
  void quantize_keys(int64_t b, const c10::Half* keys, int64_t rows) {
    const int64_t row = kvh * d;
    for (int64_t h = 0; h < kvh; ++h) {
      for (int64_t c = 0; c < d; ++c) {
        const c10::Half* x = keys + h * d + c;
        c10::Half scale, lo;
        int4_params(x, rows, row, scale, lo);
        k_scale[(b * kvh + h) * d + c] = scale;
        k_min[(b * kvh + h) * d + c] = lo;
        const float sf = static_cast<float>(scale), lf = static_cast<float>(lo);
        for (int64_t r = 0; r < rows; ++r) {
          const uint8_t q = int4_code(static_cast<float>(x[r * row]), lf, sf);
          uint8_t& byte = k_codes[((b * bs + r) * kvh + h) * (d / 2) + c / 2];
          byte = c % 2 ? static_cast<uint8_t>((byte & 0x0F) | (q << 4)) : static_cast<uint8_t>((byte & 0xF0) | q);
        }
      }
    }
  }

  // rows [0, rows) of block b's quantized keys back to float16 (codes * scale + min, then rounded: no FMA)
  void dequantize_keys(int64_t b, int64_t rows, c10::Half* dst) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < kvh; ++h) {
        for (int64_t c = 0; c < d; ++c) {
          const uint8_t byte = k_codes[((b * bs + r) * kvh + h) * (d / 2) + c / 2];
          const float q = static_cast<float>(c % 2 ? byte >> 4 : byte & 15);
          // the product rounded on its own (volatile: no fused multiply-add), as PyTorch's two operations
          const volatile float prod = q * static_cast<float>(k_scale[(b * kvh + h) * d + c]);
          dst[(r * kvh + h) * d + c] = c10::Half(prod + static_cast<float>(k_min[(b * kvh + h) * d + c]));
        }
      }
    }
  }

  void touch(int64_t buf) { residual_tick[buf] = (*clock)++; }

  void release(int64_t b) {
    block_of_residual[residual_of_block[b]] = -1;
    residual_of_block[b] = -1;
  }

  int64_t take(int64_t b) {
    int64_t buf = -1;
    for (int64_t i = 0; i < R && buf < 0; ++i)
      if (block_of_residual[i] < 0) buf = i;  // the lowest free buffer
    if (buf < 0) {  // every buffer taken: quantize the least recently written block early, over its buffer
      buf = 0;
      for (int64_t i = 1; i < R; ++i)
        if (residual_tick[i] < residual_tick[buf]) buf = i;
      const int64_t old = block_of_residual[buf];
      quantize_keys(old, k_residual + buf * bs * kvh * d, bs);
      release(old);
    }
    residual_of_block[b] = buf;
    block_of_residual[buf] = b;
    touch(buf);
    return buf;
  }
};

}  // namespace

// state: Int4KVCache.write_state() = [k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_residual,
// residual_of_block, block_of_residual, residual_tick, clock]; k, v [T, kvh, d] float32 or bfloat16, last dim
// contiguous; slot_mapping [T] int64 (a step's tokens, sequence after sequence, in position order).
void kv_write_int4(at::TensorList state, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(state.size() == 11, "kv_write_int4: state is Int4KVCache.write_state() (11 tensors), got ",
              state.size());
  for (const at::Tensor& t : state)
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "kv_write_int4: contiguous CPU tensors only");
  const at::Tensor& kc = state[0];
  TORCH_CHECK(kc.dim() == 4 && kc.scalar_type() == at::kByte, "kv_write_int4: k_codes must be uint8 [nb, bs, kvh, "
              "d / 2], got ", kc.sizes());
  Int4Cache c;
  c.nb = kc.size(0);
  c.bs = kc.size(1);
  c.kvh = kc.size(2);
  c.d = 2 * kc.size(3);
  c.R = state[6].size(0);
  const int64_t T = k.size(0), kvh = c.kvh, d = c.d, bs = c.bs;
  TORCH_CHECK(state[1].numel() == c.nb * kvh * d && state[2].numel() == c.nb * kvh * d &&
                  state[3].numel() == c.nb * bs * kvh * d / 2 && state[4].numel() == c.nb * bs * kvh &&
                  state[5].numel() == c.nb * bs * kvh && state[6].dim() == 4 &&
                  state[6].numel() == c.R * bs * kvh * d && state[7].numel() == c.nb && state[8].numel() == c.R &&
                  state[9].numel() == c.R && state[10].numel() == 1,
              "kv_write_int4: the state's shapes do not match k_codes ", kc.sizes());
  for (int i : {1, 2, 4, 5, 6})
    TORCH_CHECK(state[i].scalar_type() == at::kHalf, "kv_write_int4: state[", i, "] must be float16");
  TORCH_CHECK(state[3].scalar_type() == at::kByte, "kv_write_int4: v_codes must be uint8");
  for (int i : {7, 8, 9, 10})
    TORCH_CHECK(state[i].scalar_type() == at::kLong, "kv_write_int4: state[", i, "] must be int64");
  check_kv("kv_write_int4", k, v, kvh, d);
  check_slots("kv_write_int4", slot_mapping, T, c.nb * bs);
  c.k_codes = kc.data_ptr<uint8_t>();
  c.k_scale = state[1].data_ptr<c10::Half>();
  c.k_min = state[2].data_ptr<c10::Half>();
  c.v_codes = state[3].data_ptr<uint8_t>();
  c.v_scale = state[4].data_ptr<c10::Half>();
  c.v_min = state[5].data_ptr<c10::Half>();
  c.k_residual = state[6].data_ptr<c10::Half>();
  c.residual_of_block = state[7].data_ptr<int64_t>();
  c.block_of_residual = state[8].data_ptr<int64_t>();
  c.residual_tick = state[9].data_ptr<int64_t>();
  c.clock = state[10].data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();

  auto run = [&](auto* kp, auto* vp) {
    // values: per (token, kv head), at once
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < kvh; ++h) {
        const auto* x = vp + t * v.stride(0) + h * v.stride(1);
        const int64_t row = slots[t] * kvh + h;
        c10::Half scale, lo;
        int4_params(x, d, 1, scale, lo);
        c.v_scale[row] = scale;
        c.v_min[row] = lo;
        const float sf = static_cast<float>(scale), lf = static_cast<float>(lo);
        uint8_t* dst = c.v_codes + row * (d / 2);
        for (int64_t i = 0; i < d; i += 2)
          dst[i / 2] = static_cast<uint8_t>(int4_code(static_cast<float>(x[i]), lf, sf) |
                                            (int4_code(static_cast<float>(x[i + 1]), lf, sf) << 4));
      }
    }
    // keys, per run of consecutive tokens in one block: whole blocks (a prefill) first, quantized from the step's
    // rows; then the others, through their residual buffers
    struct Run {
      int64_t block, start, count;
    };
    std::vector<Run> runs;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t b = slots[t] / bs;
      if (runs.empty() || runs.back().block != b) runs.push_back({b, t, 0});
      ++runs.back().count;
    }
    std::vector<c10::Half> rows(bs * kvh * d);
    auto key_rows = [&](int64_t start, int64_t n, c10::Half* dst) {  // k[start:start + n] as float16
      for (int64_t r = 0; r < n; ++r)
        for (int64_t h = 0; h < kvh; ++h)
          for (int64_t i = 0; i < d; ++i)
            dst[(r * kvh + h) * d + i] = c10::Half(static_cast<float>(kp[(start + r) * k.stride(0) + h * k.stride(1) + i]));
    };
    auto whole = [&](const Run& r) { return r.count == bs && slots[r.start] % bs == 0; };
    for (const Run& r : runs) {
      if (!whole(r)) continue;
      if (c.residual_of_block[r.block] >= 0) c.release(r.block);
      key_rows(r.start, bs, rows.data());
      c.quantize_keys(r.block, rows.data(), bs);
    }
    for (const Run& r : runs) {
      if (whole(r)) continue;
      int64_t buf = c.residual_of_block[r.block];
      const int64_t first = slots[r.start] % bs;
      if (buf < 0) {
        buf = c.take(r.block);
        if (first > 0)  // rows [0, first) are valid and were quantized: bring them back
          c.dequantize_keys(r.block, first, c.k_residual + buf * bs * kvh * d);
      } else {
        c.touch(buf);
      }
      key_rows(r.start, r.count, rows.data());
      for (int64_t i = 0; i < r.count; ++i) {
        const int64_t off = slots[r.start + i] % bs;
        std::copy_n(rows.data() + i * kvh * d, kvh * d, c.k_residual + (buf * bs + off) * kvh * d);
      }
      if (slots[r.start + r.count - 1] % bs == bs - 1) {  // the block is full: quantize its keys over all bs
        c.quantize_keys(r.block, c.k_residual + buf * bs * kvh * d, bs);
        c.release(r.block);
      }
    }
  };
  if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
  else run(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("kv_write_int8(Tensor(a!) codes, Tensor(b!) scales, Tensor k, Tensor v, Tensor slot_mapping) -> ()",
        &kv_write_int8);
  m.def("kv_write_int4(Tensor(a!)[] state, Tensor k, Tensor v, Tensor slot_mapping) -> ()", &kv_write_int4);
}

}  // namespace brisk
