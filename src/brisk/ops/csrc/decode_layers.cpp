// The decode plan's layer loop in C++: one call per decode step instead of ~10 Python-dispatched kernel calls per
// layer (each ~5-6 us of Python argument handling on this CPU, ~2 ms a step over 30 layers, against ~11 ms of
// arithmetic at batch 1 for an int4 model).
//
// It calls the very kernels brisk.engine.decode_plan.DecodePlan.run calls, through the dispatcher (each lives in its
// own extension library), in the same order with the same arguments, so its results equal the Python loop's bit
// for bit. Only steps of up to 8 rows come here (every linear then takes its small-M kernel): decode batches, and
// speculative verification or short prefill chunks (query_start given); larger ones stay in Python, whose linears
// switch to GEMMs.
//
// Per layer the Python side gives the tensors, the ints of each linear and the layer's own ints; a
// mixture-of-experts layer (model/moe.py) has, in place of the dense MLP's two linears, the router, the shared
// expert's gate and the E + S experts' two linears each (S = 1 with a shared expert):
//
//   tensors  | norms (6) | qkv (6) | o (6) | gate_up (6) | down (6) |                                   dense MLP
//            | norms (6) | qkv (6) | o (6) | router shared_gate | E+S x [gate_up (6) down (6)] |          MoE
//   ints     | qkv (3) | o (3) | gate_up (3) | down (3) |  or  | qkv (3) | o (3) | E+S x [gate_up (3) down (3)] |
//   layer    | window rope activation | 0 0 0 0 0 |  or  | window rope activation | E top_k normalize f32 S |
//
// so the layers' offsets into the tensors and ints are computed once, in DecodeWeights' constructor. The six norm
// slots:
//   0  the input norm (its residual add fused in)
//   1  the norm before the MLP (residual add fused in): llama's post-attention norm, gemma3's pre-feed-forward one
//   2, 3  the per-head q and k norm weights, or none (qwen3, gemma3)
//   4  a norm of the attention output before its residual add, or none (gemma3's post-attention norm)
//   5  a norm of the MLP output, or none (gemma3's post-feed-forward norm)
// (each the weight that multiplies the normalized rows: gemma3's 1 + w); router [E, hidden] and shared_gate
// [1, hidden] (or none) are float weights of the model dtype; each linear has six slots and three ints (kind, bits,
// group size):
//   kind 0, float weight:               [weight, bias, -, -, -, -]                          -> linear_small_m
//   kind 1, 8/4-bit, int8 activations:  [data, scales, zeros (- if symmetric), bias, -, -]  -> quant_linear_q8
//   kind 2, packed codes, float act.:   [data, scales, zeros, codebook, bias, -]            -> quant_linear_small
//   kind 3, pruned (bits = value kind): [mask, row_ptr, values, scales, mins, bias]         -> sparse_linear
//   kind 4, pruned int8, int8 act.:     [mask, row_ptr, values, scales, bias, -]            -> sparse_q8_linear
//   kind 5, tiled 8/4-bit, int8 act.:   [data, scales, zeros (- if symmetric), bias, -, -]  -> quant_linear_q8t
//   kind 6, tiled 8/4-bit, float act.:  [data, scales, zeros, codebook, bias, -]            -> quant_linear_t
//   kind 7, W8A8 (SmoothQuant):         [data, w_scale, shift_terms, input_scale, bias, -]  -> w8a8_linear
//   kind 9, table codes (SqueezeLLM):   [codes, lut, row_ptr, cols, values, bias]           -> lut_linear
//   kind 10, table codes, int8 act.:    [codes, qlut, row_ptr, cols, values, bias]          -> lut_linear_q8
// The layer's 8 ints (layer_spec):
//   window      the layer's own attention window (0: full; gemma3's local and global layers), or -1: the step's
//   rope        which of the stacked cos / sin tables [2, T, d/2] the layer rotates with (gemma3: 0 global, 1
//               local), or -1: cos / sin are the one [T, d/2] table
//   activation  0: silu_mul (SwiGLU), 1: gelu_tanh_mul (GeGLU, gemma3); a MoE layer's experts use it too
//   E           the number of routed experts, 0: a dense MLP (the four after it then 0 too)
//   top_k       the experts each row picks
//   normalize   1: the top-k weights renormalized to sum 1 (mixtral; qwen where norm_topk_prob)
//   f32         1: the weighted sum in float32 (mixtral), 0: the weights cast to the model dtype first (qwen)
//   S           1: a shared expert (qwen2_moe), gated by sigmoid(shared_gate x)
// and 2 floats per layer, its RMSNorm eps (every norm of the layer) and its attention scale. All of it is given
// once, in a DecodeWeights object that every step then passes as one argument: converting the ~800-entry list and
// ~360 ints at each call cost ~45 us a step (1.3% of an int4 step).
//
// A MoE layer's block (moe_block below) is model/moe.py moe_forward op for op: the router linear, softmax in float32,
// topk, the renormalization, the picks ordered by expert (a stable counting sort of at most 8 x top_k ids: the
// stable argsort's order), index_select of rows and weights, each expert with rows once on them through its
// small-row kernels, the weighted rows index_add_-ed back in that order; then the shared expert's sigmoid-gated
// output added. Same ATen ops, same expert kernels, same order of summation: the module path's numbers.
//
// LoRA (brisk/lora/layers.py): DecodeWeights.set_lora gives each projection its adapters' stacked buffers,
// A [slots, R, K] and B^T [slots, R, N] (float32, the LoRALinear's own storage, so adapters loaded later are
// seen), and a step passes lora_rows [T] (each row's slot, -1: none); each projection then adds B[s] (A[s] x) to
// its rows' outputs, the LoRALinear's math one row at a time: t = R dot products of length K, then y += t_j *
// row j of B^T (contiguous: both loops vectorize), ~100 k multiply-adds a row and layer (no GEMM needed).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptT = std::optional<at::Tensor>;
constexpr int64_t kSlots = 6;                  // tensor slots per linear
constexpr int64_t kNorms = 6;                  // input / pre-MLP norms, q / k head norms, attention / MLP output norms
constexpr int64_t kInts = 3;                   // ints per linear
constexpr int64_t kLayerInts = 8;              // window, RoPE table, activation; E, top_k, normalize, f32, S

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("brisk::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, double)> add_rms_norm =
      handle<at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, double)>("brisk::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      handle<at::Tensor(const at::Tensor&)>("brisk::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> gelu_tanh_mul =
      handle<at::Tensor(const at::Tensor&)>("brisk::gelu_tanh_mul");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                                int64_t, int64_t)>
      rope_cache = handle<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
                               int64_t, int64_t)>("brisk::rope_cache");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t)>
      attention = handle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              double, int64_t)>("brisk::paged_decode_attention");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>
      prefill_attention = handle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>(
          "brisk::paged_prefill_attention");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&)> linear_small =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&)>("brisk::linear_small_m");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&,
                                      const OptT&, int64_t, int64_t, const OptT&)>
      quant_small = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, const OptT&,
                                      int64_t, int64_t, const OptT&)>("brisk::quant_linear_small");
  // absent where quant_q8.cpp was not built (no AVX2): plans then never pass kind 1
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptT&, int64_t, int64_t, const OptT&)>>
      q8;
  // absent where quant_q8t.cpp was not built (no AVX2 + FMA + F16C): plans then never pass kinds 5 / 6
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptT&, int64_t, int64_t, const OptT&)>>
      q8t;
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptT&, const OptT&, int64_t, int64_t, const OptT&)>>
      tiled_f;

  // absent where sparse_linear.cpp / sparse_q8.cpp were not built: plans then never pass kinds 3 / 4
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const OptT&, const OptT&, int64_t, int64_t,
                                                    const OptT&)>>
      sparse;
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&, int64_t, const OptT&)>>
      sparse_q8;
  // absent where int8_gemm.cpp was not built (no AVX2 + FMA): plans then never pass kind 7
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const OptT&, const OptT&)>>
      w8a8;
  // absent where lut_linear.cpp was not built (no AVX2 + FMA): plans then never pass kind 9
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptT&, const OptT&, const OptT&, const OptT&)>>
      lut;
  // absent where lut_linear.cpp was not built (no AVX2 + FMA): plans then never pass kind 10
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const OptT&, const OptT&, const OptT&, const OptT&)>>
      lut_q8;
  // a quantized KV cache's ops (fused_ops.cpp, kv_write.cpp, paged_attention.cpp): absent where one did not build;
  // plans then never pass kv_bits (DecodePlan.cpp_applies)
  using Ints = int64_t;
  std::optional<c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, Ints, Ints)>> rope_qk;
  std::optional<c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&)>>
      write_int8;
  std::optional<c10::TypedOperatorHandle<void(at::TensorList, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&)>>
      write_int4;
  std::optional<c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, at::TensorList, Ints, Ints, const OptT&,
                                              const at::Tensor&, const at::Tensor&, double, Ints, Ints, const OptT&,
                                              Ints)>>
      attention_quantized;
  // token-tree verification (engine/token_tree.py): paged_prefill_attention with each tree row seeing its
  // ancestors only
  std::optional<c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, double, int64_t,
                                              const at::Tensor&)>>
      tree_attention;

  Ops() {
    auto& d = c10::Dispatcher::singleton();
    if (auto h = d.findSchema({"brisk::paged_tree_attention", ""}); h.has_value())
      tree_attention = h->typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, double, int64_t, const at::Tensor&)>();
    if (auto h = d.findSchema({"brisk::rope_qk", ""}); h.has_value())
      rope_qk = h->typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, Ints, Ints)>();
    if (auto h = d.findSchema({"brisk::kv_write_int8", ""}); h.has_value())
      write_int8 = h->typed<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    if (auto h = d.findSchema({"brisk::kv_write_int4", ""}); h.has_value())
      write_int4 = h->typed<void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    if (auto h = d.findSchema({"brisk::paged_attention_general", ""}); h.has_value())
      attention_quantized = h->typed<void(at::Tensor, const at::Tensor&, at::TensorList, Ints, Ints, const OptT&,
                                          const at::Tensor&, const at::Tensor&, double, Ints, Ints, const OptT&,
                                          Ints)>();
    if (auto h = d.findSchema({"brisk::quant_linear_q8", ""}); h.has_value())
      q8 = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, int64_t,
                               int64_t, const OptT&)>();
    if (auto h = d.findSchema({"brisk::quant_linear_q8t", ""}); h.has_value())
      q8t = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, int64_t,
                                int64_t, const OptT&)>();
    if (auto h = d.findSchema({"brisk::quant_linear_t", ""}); h.has_value())
      tiled_f = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&,
                                    const OptT&, int64_t, int64_t, const OptT&)>();
    if (auto h = d.findSchema({"brisk::sparse_linear", ""}); h.has_value())
      sparse = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const OptT&, const OptT&, int64_t, int64_t, const OptT&)>();
    if (auto h = d.findSchema({"brisk::w8a8_linear", ""}); h.has_value())
      w8a8 = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const OptT&, const OptT&)>();
    if (auto h = d.findSchema({"brisk::lut_linear", ""}); h.has_value())
      lut = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, const OptT&,
                                const OptT&, const OptT&)>();
    if (auto h = d.findSchema({"brisk::lut_linear_q8", ""}); h.has_value())
      lut_q8 = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, const OptT&,
                                   const OptT&, const OptT&)>();
    if (auto h = d.findSchema({"brisk::sparse_q8_linear", ""}); h.has_value())
      sparse_q8 = h->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, int64_t, const OptT&)>();
  }
};

const Ops& ops() {
  static const Ops instance;  // looked up on the first call, when every kernel library is loaded
  return instance;
}

// The weights as the step reads them: by reference into a plain vector (c10::List hands out copies, and the ~800
// tensor copies a step made, an atomic reference count up and down each, were ~1.5% of an int4 batch-1 step)
using Params = std::vector<OptT>;

const at::Tensor& get(const Params& params, int64_t i) {
  const OptT& t = params[i];
  TORCH_CHECK(t.has_value(), "decode_layers: parameter slot ", i, " must hold a tensor");
  return *t;
}

at::Tensor linear(const Ops& o, const at::Tensor& x, const Params& params, int64_t base,
                  at::IntArrayRef spec, int64_t s) {
  const int64_t kind = spec[s], bits = spec[s + 1], group = spec[s + 2];
  if (kind == 0) return o.linear_small.call(x, get(params, base), params[base + 1]);
  if (kind == 1 || kind == 5) {
    const auto& op = kind == 1 ? o.q8 : o.q8t;
    TORCH_CHECK(op.has_value(), "decode_layers: the kernel of linear kind ", kind, " is not built");
    return op->call(x, get(params, base), get(params, base + 1), params[base + 2], bits, group,
                    params[base + 3]);
  }
  if (kind == 6) {
    TORCH_CHECK(o.tiled_f.has_value(), "decode_layers: quant_linear_t is not built");
    return o.tiled_f->call(x, get(params, base), get(params, base + 1), params[base + 2], params[base + 3], bits,
                           group, params[base + 4]);
  }
  if (kind == 2)
    return o.quant_small.call(x, get(params, base), get(params, base + 1), params[base + 2], params[base + 3],
                              bits, group, params[base + 4]);
  if (kind == 3) {
    TORCH_CHECK(o.sparse.has_value(), "decode_layers: sparse_linear is not built");
    return o.sparse->call(x, get(params, base), get(params, base + 1), get(params, base + 2), params[base + 3],
                          params[base + 4], bits, group, params[base + 5]);
  }
  if (kind == 7) {
    TORCH_CHECK(o.w8a8.has_value(), "decode_layers: w8a8_linear is not built");
    return o.w8a8->call(x.is_contiguous() ? x : x.contiguous(), get(params, base), get(params, base + 1),
                        get(params, base + 2), params[base + 3], params[base + 4]);
  }
  if (kind == 9 || kind == 10) {
    const auto& op = kind == 9 ? o.lut : o.lut_q8;
    TORCH_CHECK(op.has_value(), "decode_layers: the kernel of linear kind ", kind, " is not built");
    return op->call(x, get(params, base), get(params, base + 1), params[base + 2], params[base + 3],
                    params[base + 4], params[base + 5]);
  }
  TORCH_CHECK(kind == 4, "decode_layers: unknown linear kind ", kind);
  TORCH_CHECK(o.sparse_q8.has_value(), "decode_layers: sparse_q8_linear is not built");
  return o.sparse_q8->call(x, get(params, base), get(params, base + 1), get(params, base + 2), get(params, base + 3),
                           group, params[base + 4]);
}

// sum a[i] b[i] over 16 independent partial sums, which the compiler vectorizes without reassociating
inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  float acc = 0.f;
  for (; i < n; ++i) acc += a[i] * b[i];
  for (int l = 0; l < 16; ++l) acc += part[l];
  return acc;
}

// The rows of one slot together, so that slot's A and B^T are read once for all of them; slots in parallel.
template <typename T>
void lora_rows_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                   const int64_t* row_slot, int64_t rows) {
  const int64_t r = a.size(1), k = a.size(2), n = b.size(2);
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  const T* px = x.data_ptr<T>();
  T* py = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  std::vector<int64_t> slots;  // the distinct slots of the step's rows
  for (int64_t row = 0; row < rows; ++row)
    if (row_slot[row] >= 0 && std::find(slots.begin(), slots.end(), row_slot[row]) == slots.end())
      slots.push_back(row_slot[row]);
  const int64_t num_slots = static_cast<int64_t>(slots.size());
#pragma omp parallel for schedule(dynamic, 1) if (num_slots > 1)
  for (int64_t g = 0; g < num_slots; ++g) {
    const int64_t s = slots[g];
    std::vector<int64_t> members;
    for (int64_t row = 0; row < rows; ++row)
      if (row_slot[row] == s) members.push_back(row);
    const int64_t m = static_cast<int64_t>(members.size());
    std::vector<float> xr(m * k), t(m * r), acc(m * n, 0.f);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < k; ++c) xr[i * k + c] = static_cast<float>(px[members[i] * xs + c]);
    const float* as = pa + s * r * k;
    for (int64_t j = 0; j < r; ++j)  // t = A[s] x  [m, R]
      for (int64_t i = 0; i < m; ++i) t[i * r + j] = dot(as + j * k, xr.data() + i * k, k);
    const float* bs = pb + s * r * n;
    for (int64_t j = 0; j < r; ++j) {  // acc = B[s] t = sum_j t_j B^T[s, j]  [m, N]
      const float* bj = bs + j * n;
      for (int64_t i = 0; i < m; ++i) {
        const float tj = t[i * r + j];
        if (tj == 0.f) continue;  // a rank below R: the padding rows of A are zero
        float* ai = acc.data() + i * n;
        for (int64_t o = 0; o < n; ++o) ai[o] += tj * bj[o];
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      T* yr = py + members[i] * ys;
      const float* ai = acc.data() + i * n;
      for (int64_t o = 0; o < n; ++o) yr[o] = static_cast<T>(static_cast<float>(yr[o]) + ai[o]);
    }
  }
}

// y [T, N] += per row: B[slot] (A[slot] x) (module docstring); no-op without adapters or adapter rows
void apply_lora(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& lora, int64_t linear_index,
                const OptT& lora_rows) {
  if (!lora_rows.has_value() || lora.empty()) return;
  const at::Tensor& a = lora[2 * linear_index];
  const at::Tensor& b = lora[2 * linear_index + 1];
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.is_contiguous() && y.is_contiguous() && x.stride(-1) == 1 && a.size(2) == x.size(1) &&
                  b.size(2) == y.size(1) && b.size(1) == a.size(1),
              "decode_layers: LoRA buffers do not fit linear ", linear_index);
  const int64_t* slot = lora_rows->data_ptr<int64_t>();
  if (y.scalar_type() == at::kFloat)
    lora_rows_add<float>(y, x, a, b, slot, y.size(0));
  else if (y.scalar_type() == at::kBFloat16)
    lora_rows_add<c10::BFloat16>(y, x, a, b, slot, y.size(0));
  else
    TORCH_CHECK(false, "decode_layers: LoRA on ", y.scalar_type(), " activations");
}

// One layer's ints (layer_spec, the header's table) and its offsets into the tensors and the linears' ints.
struct LayerSpec {
  int64_t window = -1, rope = -1, act = 0;  // -1: the step's window, the one RoPE table; act 0 silu, 1 gelu_tanh
  int64_t num_experts = 0, top_k = 0;       // num_experts 0: a dense MLP
  bool normalize = false, float32_weights = false, shared = false;
  int64_t param_start = 0, spec_start = 0;  // the layer's first tensor slot, its first linear int
};

// [T, 2I] -> [T, I]: the layer's activation of gate times up
at::Tensor act_mul(const Ops& o, const at::Tensor& gate_up, int64_t act) {
  return act == 0 ? o.silu_mul.call(gate_up) : o.gelu_tanh_mul.call(gate_up);
}

// A (fused) MLP's down(act_mul(gate_up(x))): its two linears at params[p...], spec[s...].
at::Tensor mlp(const Ops& o, const at::Tensor& x, const Params& params, int64_t p, at::IntArrayRef spec, int64_t s,
               int64_t act) {
  return linear(o, act_mul(o, linear(o, x, params, p, spec, s), act), params, p + kSlots, spec, s + kInts);
}

// x [T, hidden] -> a routed expert block's output [T, hidden] (model/moe.py moe_forward, op for op); p / s: the
// layer's router slot / its first expert's ints. counts: null, or [E] filled with each expert's rows this step
// (record_expert_loads).
at::Tensor moe_block(const Ops& o, const at::Tensor& x, const Params& params, int64_t p, at::IntArrayRef spec,
                     int64_t s, const LayerSpec& m, int64_t* counts) {
  const int64_t t = x.size(0), k = m.top_k, e_count = m.num_experts;
  const at::Tensor& router = get(params, p);  // [E, hidden]
  TORCH_CHECK(router.dim() == 2 && router.size(0) == e_count && router.size(1) == x.size(1),
              "decode_layers: the router must be [", e_count, ", ", x.size(1), "], got ", router.sizes());
  // route: softmax over all experts in float32, the k largest, renormalized (model/moe.py route)
  at::Tensor probs = at::softmax(at::linear(x, router), -1, at::kFloat);  // [T, E]
  auto [weights, ids] = at::topk(probs, k, -1);                                   // [T, k] x 2
  if (m.normalize) weights = weights.div(weights.sum(at::IntArrayRef{-1}, true));
  if (!m.float32_weights) weights = weights.to(x.scalar_type());
  // the picks grouped by expert, tokens ascending within each (= argsort(ids.flatten(), stable=True))
  at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<int64_t> rows_of(e_count, 0);
  for (int64_t j = 0; j < t * k; ++j) ++rows_of[id[j]];
  std::vector<int64_t> start(e_count + 1, 0);
  for (int64_t e = 0; e < e_count; ++e) start[e + 1] = start[e] + rows_of[e];
  at::Tensor order = at::empty({t * k}, flat.options()), rows = at::empty({t * k}, flat.options());
  int64_t* po = order.data_ptr<int64_t>();
  int64_t* pr = rows.data_ptr<int64_t>();
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t j = 0; j < t * k; ++j) {
    const int64_t at_ = fill[id[j]]++;
    po[at_] = j;      // the pick
    pr[at_] = j / k;  // its token
  }
  if (counts != nullptr) std::copy(rows_of.begin(), rows_of.end(), counts);
  at::Tensor xs = x.index_select(0, rows);                                    // [T*k, hidden] in expert order
  at::Tensor ws = weights.reshape({-1}).index_select(0, order).unsqueeze(1);  // [T*k, 1]
  at::Tensor ys = at::empty_like(xs);                                         // [T*k, hidden]
  const int64_t first = p + 2;  // the first expert's gate_up slots (after the router and the shared gate)
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t n = rows_of[e];
    if (n == 0) continue;  // an expert with no rows is not read
    at::Tensor y = mlp(o, xs.narrow(0, start[e], n), params, first + 2 * e * kSlots, spec, s + 2 * e * kInts, m.act);
    ys.narrow(0, start[e], n).copy_(y.mul(ws.narrow(0, start[e], n)).to(x.scalar_type()));
  }
  at::Tensor out = at::zeros_like(x).index_add_(0, rows, ys);  // [T, hidden]: each token's k rows, expert order
  if (m.shared) {
    at::Tensor shared = mlp(o, x, params, first + 2 * e_count * kSlots, spec, s + 2 * e_count * kInts, m.act);
    out = out.add(at::sigmoid(at::linear(x, get(params, p + 1))).mul(shared));  // [T, 1] * [T, hidden]
  }
  return out;
}

}  // namespace

// The plan's weights as decode_layers reads them, built once per plan (torch.classes.brisk.DecodeWeights).
struct DecodeWeights : torch::CustomClassHolder {
  Params params;
  std::vector<int64_t> spec;
  std::vector<LayerSpec> layers;  // per layer: its ints (layer_spec, the header's table) and offsets
  std::vector<double> eps;
  std::vector<double> scales;  // per layer: the attention scale
  at::Tensor final_norm;  // the model's norm after the last layer
  double final_eps;
  int64_t max_experts = 0;       // the most experts of a layer (0: no MoE layer)
  std::vector<at::Tensor> lora;  // per layer, per projection (qkv, o, gate_up, down): A, B; empty without LoRA
  OptT expert_counts;  // [layers, max_experts] int64: each step's rows per expert, while loads are recorded

  DecodeWeights(c10::List<OptT> p, std::vector<int64_t> s, std::vector<int64_t> layer_spec, std::vector<double> e,
                std::vector<double> sc, at::Tensor fn, double fe)
      : params(p.begin(), p.end()), spec(std::move(s)), eps(std::move(e)), scales(std::move(sc)),
        final_norm(std::move(fn)), final_eps(fe) {
    const int64_t num_layers = static_cast<int64_t>(eps.size());
    TORCH_CHECK(static_cast<int64_t>(layer_spec.size()) == num_layers * kLayerInts &&
                    static_cast<int64_t>(scales.size()) == num_layers,
                "decode_layers: ", num_layers, " layers need ", num_layers * kLayerInts, " layer ints and ",
                num_layers, " scales; got ", layer_spec.size(), " and ", scales.size());
    int64_t num_params = 0, num_ints = 0;
    for (int64_t i = 0; i < num_layers; ++i) {
      const int64_t* li = layer_spec.data() + i * kLayerInts;
      LayerSpec l{li[0], li[1], li[2], li[3], li[4], li[5] != 0, li[6] != 0, li[7] != 0, num_params, num_ints};
      TORCH_CHECK(l.rope >= -1 && l.rope <= 1 && (l.act == 0 || l.act == 1), "decode_layers: layer ", i,
                  ": RoPE table must be -1, 0 or 1 and activation 0 or 1");
      TORCH_CHECK(l.num_experts == 0 ? l.top_k == 0 && !l.shared : l.top_k >= 1 && l.top_k <= l.num_experts,
                  "decode_layers: layer ", i, ": top_k ", l.top_k, " of ", l.num_experts, " experts");
      // | norms | qkv | o | (router, shared gate: MoE) | dense: gate_up, down; MoE: E + S x (gate_up, down) |
      const int64_t mlp_linears = l.num_experts == 0 ? 2 : 2 * (l.num_experts + l.shared);
      num_params += kNorms + 2 * kSlots + (l.num_experts == 0 ? 0 : 2) + mlp_linears * kSlots;
      num_ints += (2 + mlp_linears) * kInts;
      max_experts = std::max(max_experts, l.num_experts);
      layers.push_back(l);
    }
    TORCH_CHECK(static_cast<int64_t>(params.size()) == num_params && static_cast<int64_t>(spec.size()) == num_ints,
                "decode_layers: ", num_layers, " layers need ", num_params, " parameter slots and ", num_ints,
                " linear ints; got ", params.size(), " and ", spec.size());
  }

  void set_lora(std::vector<at::Tensor> buffers) {
    TORCH_CHECK(buffers.empty() || buffers.size() == eps.size() * 8, "decode_layers: LoRA needs A and B for each "
                "of the 4 projections of ", eps.size(), " layers; got ", buffers.size(), " tensors");
    TORCH_CHECK(buffers.empty() || max_experts == 0, "decode_layers: LoRA adapters on a mixture-of-experts model");
    lora = std::move(buffers);
  }

  // counts [layers, max_experts] int64, filled at each step with each MoE layer's rows per expert; None: stop
  void set_expert_counts(OptT counts) {
    TORCH_CHECK(!counts.has_value() || (counts->scalar_type() == at::kLong && counts->is_contiguous() &&
                                        counts->numel() == static_cast<int64_t>(eps.size()) * max_experts),
                "decode_layers: expert counts must be int64 [", eps.size(), ", ", max_experts, "]");
    expert_counts = std::move(counts);
  }
};

// x: [T, hidden] embeddings (T <= 8 rows) -> (the final norm's output, the residual stream), exactly as
// DecodePlan.run. x is the residual stream's storage: add_rms_norm updates it in place. Without query_start a
// decode step (one row per sequence, paged_decode_attention); with it, rows of sequence b are
// [query_start[b], query_start[b + 1]) (speculative verification, short prefill chunks: paged_prefill_attention).
// cos, sin: [T, d/2] float32, or [2, T, d/2] where layers pick a table (layer_spec's rope); window: the step's
// attention window (0: none), for layers without one of their own. tree_bits (with query_start, a float cache, no
// window): a step that verifies token trees, each row seeing the in-step rows its bits name (paged_tree_attention).
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                 const at::Tensor& slots, const at::Tensor& tables,
                                                 const at::Tensor& lens, at::TensorList kv_caches,
                                                 const c10::intrusive_ptr<DecodeWeights>& weights,
                                                 int64_t window, int64_t num_heads, int64_t num_kv_heads,
                                                 int64_t head_dim, const OptT& query_start, int64_t q_tile,
                                                 const OptT& lora_rows, int64_t kv_bits, int64_t kv_block_size,
                                                 const OptT& tree_bits) {
  // kv_bits 0: one cache tensor per layer; 8: [codes, scales] per layer (Int8KVCache); 4: Int4KVCache.write_state()
  // per layer (its first 8 tensors are what attention reads)
  TORCH_CHECK(kv_bits == 0 || kv_bits == 8 || kv_bits == 4, "decode_layers: kv_bits must be 0, 8 or 4, got ", kv_bits);
  const int64_t per_layer = kv_bits == 0 ? 1 : kv_bits == 8 ? 2 : 11;
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) % per_layer == 0, "decode_layers: ", kv_caches.size(),
              " KV cache tensors are not ", per_layer, " per layer");
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size()) / per_layer;
  const Params& params = weights->params;
  const at::IntArrayRef spec = weights->spec;
  const at::ArrayRef<double> eps = weights->eps;
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == num_layers, "decode_layers: the weights are for ", eps.size(),
              " layers, the step passes ", num_layers, " KV caches");
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= 8, "decode_layers: x must be [T <= 8, hidden], got ", x.sizes());
  const std::vector<at::Tensor>& lora = weights->lora;
  TORCH_CHECK(!lora_rows.has_value() || (lora_rows->scalar_type() == at::kLong && lora_rows->numel() == x.size(0)),
              "decode_layers: lora_rows must be int64 [T]");
  const Ops& o = ops();
  TORCH_CHECK(kv_bits == 0 || (o.rope_qk && o.write_int8 && o.write_int4 && o.attention_quantized),
              "decode_layers: the quantized KV cache kernels did not build");
  TORCH_CHECK(!tree_bits.has_value() || (kv_bits == 0 && query_start.has_value() && window == 0 && o.tree_attention),
              "decode_layers: token trees need query_start, a float cache, no window and paged_tree_attention");
  const int64_t t = x.size(0), h = num_heads, kvh = num_kv_heads, d = head_dim;
  at::Tensor residual = x;
  at::Tensor cur = x;
  int64_t* counts = weights->expert_counts.has_value() ? weights->expert_counts->data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerSpec& layer = weights->layers[i];
    const int64_t p = layer.param_start, s = layer.spec_start;
    const at::Tensor& kv = kv_caches[i * per_layer];
    const int64_t layer_window = layer.window < 0 ? window : layer.window;
    TORCH_CHECK(layer.rope < 0 || (cos.dim() == 3 && sin.dim() == 3), "decode_layers: layer ", i,
                " picks a RoPE table: cos and sin must be [2, T, d/2]");
    const at::Tensor c = layer.rope < 0 ? cos : cos.select(0, layer.rope);  // [T, d/2]
    const at::Tensor sn = layer.rope < 0 ? sin : sin.select(0, layer.rope);
    const double scale = weights->scales[i];
    at::Tensor hid = i == 0 ? o.rms_norm.call(cur, get(params, p), eps[i])
                            : o.add_rms_norm.call(cur, residual, get(params, p), eps[i]);
    at::Tensor qkv = linear(o, hid, params, p + kNorms, spec, s);  // [B, (h + 2 kvh) d]
    apply_lora(qkv, hid, lora, 4 * i, lora_rows);
    if (params[p + 2].has_value()) {
      // qwen3, gemma3: RMSNorm over each q and k head's d dims before RoPE, as ops.fused.rms_norm_qk_heads_ (the same
      // kernel on the same [rows of d], so the same numbers)
      at::Tensor heads = qkv.view({t, h + 2 * kvh, d});  // q heads | k heads | v heads
      at::Tensor qh = heads.slice(1, 0, h), kh = heads.slice(1, h, h + kvh);
      // (rows of d made contiguous: one k head, as MQA has, reshapes to a strided view)
      at::Tensor qn = o.rms_norm.call(qh.reshape({t * h, d}).contiguous(), get(params, p + 2), eps[i]);
      at::Tensor kn = o.rms_norm.call(kh.reshape({t * kvh, d}).contiguous(), get(params, p + 3), eps[i]);
      qh.copy_(qn.view({t, h, d}));
      kh.copy_(kn.view({t, kvh, d}));
    }
    at::Tensor q = qkv.view({t, h + 2 * kvh, d}).slice(1, 0, h);
    at::Tensor out = at::empty({t, h, d}, x.options());
    if (kv_bits != 0) {  // rotate, quantize on write, attend over the codes: DecodePlan.run's _quantized_attention
      o.rope_qk->call(qkv, c, sn, h, kvh);
      at::Tensor heads = qkv.view({t, h + 2 * kvh, d});
      at::Tensor k = heads.slice(1, h, h + kvh), v = heads.slice(1, h + kvh, h + 2 * kvh);
      const at::TensorList cache = kv_caches.slice(i * per_layer, per_layer);
      if (kv_bits == 8) o.write_int8->call(cache[0], cache[1], k, v, slots);
      else o.write_int4->call(cache, k, v, slots);
      o.attention_quantized->call(out, q, cache.slice(0, kv_bits == 8 ? 2 : 8), kv_bits, kv_block_size, query_start,
                                  tables, lens, scale, layer_window, q_tile, std::nullopt, 0);
    } else {
      o.rope_cache.call(qkv, c, sn, kv, slots, h, kvh);
      if (tree_bits.has_value())
        o.tree_attention->call(out, q, kv, *query_start, tables, lens, scale, q_tile, *tree_bits);
      else if (query_start.has_value())
        o.prefill_attention.call(out, q, kv, *query_start, tables, lens, scale, layer_window, q_tile);
      else
        o.attention.call(out, q, kv, tables, lens, scale, layer_window);
    }
    at::Tensor attn = out.view({t, h * d});
    at::Tensor proj = linear(o, attn, params, p + kNorms + kSlots, spec, s + kInts);
    apply_lora(proj, attn, lora, 4 * i + 1, lora_rows);
    if (params[p + 4].has_value()) proj = o.rms_norm.call(proj, *params[p + 4], eps[i]);  // gemma3's sandwich
    hid = o.add_rms_norm.call(proj, residual, get(params, p + 1), eps[i]);
    if (layer.num_experts > 0) {  // routed experts (model/moe.py): router, top-k, each chosen expert on its rows
      cur = moe_block(o, hid, params, p + kNorms + 2 * kSlots, spec, s + 2 * kInts, layer,
                      counts == nullptr ? nullptr : counts + i * weights->max_experts);
    } else {
      at::Tensor gate_up = linear(o, hid, params, p + kNorms + 2 * kSlots, spec, s + 2 * kInts);  // [T, 2I]
      apply_lora(gate_up, hid, lora, 4 * i + 2, lora_rows);
      at::Tensor act = act_mul(o, gate_up, layer.act);  // [T, I]
      cur = linear(o, act, params, p + kNorms + 3 * kSlots, spec, s + 3 * kInts);
      apply_lora(cur, act, lora, 4 * i + 3, lora_rows);
    }
    if (params[p + 5].has_value()) cur = o.rms_norm.call(cur, *params[p + 5], eps[i]);
  }
  return {o.add_rms_norm.call(cur, residual, weights->final_norm, weights->final_eps), residual};
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.class_<DecodeWeights>("DecodeWeights")
      .def(torch::init<c10::List<OptT>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>,
                       std::vector<double>, at::Tensor, double>())
      .def("set_lora", &DecodeWeights::set_lora)
      .def("set_expert_counts", &DecodeWeights::set_expert_counts);
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor tables, Tensor lens, "
        "Tensor[] kv_caches, __torch__.torch.classes.brisk.DecodeWeights weights, int window, "
        "int num_heads, int num_kv_heads, int head_dim, Tensor? query_start, int q_tile, Tensor? lora_rows=None, "
        "int kv_bits=0, int kv_block_size=0, Tensor? tree_bits=None) -> (Tensor, Tensor)",
        &decode_layers);
}
