"""ONNX Runtime as a baseline: brisk's float weights exported to one ONNX graph with its KV cache as explicit
inputs and outputs, run by onnxruntime's CPUExecutionProvider (an optional extra: `pip install 'brisk[onnx]'`).

The graph (names as Optimum and onnxruntime-genai give them; one graph for prefill and decode):

    inputs   input_ids [batch, seq] int64, past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim]
    outputs  logits [batch, 1, vocab] (the last position's only), present.{i}.key / .value
             [batch, kv_heads, past + seq, head_dim]

Prefill feeds a past of length 0; each decode step feeds the last step's `present` back as `past` with one new
token, so decode is one `session.run` per token. Positions are past .. past + seq - 1 for every row: no padding
and no attention_mask input, so the sequences of a batch share one length (the benchmark's rotated prompts do).

The graph is written node by node with onnx.helper (`build_graph`) from brisk's loaded weights dequantized to
float32: seconds for a 135M model, where tracing a PyTorch module with torch.onnx's dynamo exporter took minutes
on a 2-core machine. It is cached under ~/.cache/brisk/onnx keyed by the model's content and brisk's version, so
a second benchmark does not export again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ONNX_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # the dense decoders whose math build_graph writes
ONNX_ROPE_KINDS = ("default", "linear", "llama3")  # a fixed table of rotations (not length-dependent)
_FORMAT = 1  # bumped when the graph changes: part of the cache key


class OnnxRuntimeMissingError(RuntimeError):
    """The onnxruntime baseline was asked for but onnxruntime or onnx is not installed."""


def require_onnxruntime() -> Any:
    try:
        import onnx  # noqa: F401 - the graph's writer
        import onnxruntime
    except ImportError as e:
        raise OnnxRuntimeMissingError(
            f"the onnxruntime baseline needs onnxruntime and onnx ({e.name} is not installed); install "
            "them with `pip install 'brisk[onnx]'`, or leave onnxruntime out of --baselines") from e
    return onnxruntime


def check_exportable(config: Any) -> None:  # noqa: ANN401 - brisk.model.config.ModelConfig
    """ValueError naming what the exporter does not support (the architecture, the RoPE variant)."""
    if config.architecture not in ONNX_ARCHITECTURES:
        raise ValueError(f"the ONNX export supports {', '.join(ONNX_ARCHITECTURES)}; this model is "
                         f"{config.architecture!r}: leave onnxruntime out of --baselines for it")
    s = dict(config.rope_scaling or {})
    kind = s.get("rope_type", s.get("type", "default")) or "default"
    if kind not in ONNX_ROPE_KINDS:
        raise ValueError(f"the ONNX export supports RoPE {', '.join(ONNX_ROPE_KINDS)}; this model's is {kind!r}")


class _Graph:
    """onnx.helper nodes and initializers, with fresh value names."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:  # noqa: ANN401
        from onnx import helper

        self.n += 1
        name = out or f"{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(self, name: str, value: np.ndarray | torch.Tensor) -> str:
        from onnx import numpy_helper

        arr = value.detach().float().numpy() if isinstance(value, torch.Tensor) else value
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def ints(self, *values: int) -> str:
        self.n += 1
        return self.const(f"ints_{self.n}", np.array(values, dtype=np.int64))

    def scalar(self, value: float) -> str:
        self.n += 1
        return self.const(f"scalar_{self.n}", np.array(value, dtype=np.float32))


def build_graph(net: nn.Module, config: Any) -> Any:  # noqa: ANN401 - LlamaForCausalLM, ModelConfig -> ModelProto
    """The decoder as an ONNX graph (opset 18), written node by node from brisk's float32 weights; the same math
    as model/llama.py's module path: RMSNorm statistics in float32, RoPE rotating the first and second halves of
    each head (brisk's cos / sin table, gathered by position), GQA by broadcasting each kv head over its group of
    query heads, a causal (and, for mistral, sliding-window) mask of the absolute positions.

    Every linear layer is a Gemm with transB=1 on the rows [batch * seq, in], so the weights stay as brisk holds
    them ([out, in]; a tied head shares the embedding's tensor)."""
    from onnx import TensorProto, helper

    check_exportable(config)
    L, h, kvh, d = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden, g, half = config.hidden_size, h // kvh, d // 2
    sd = net.state_dict()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.0.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}.weight"
        if key not in sd or not sd[key].is_floating_point():
            raise ValueError(f"the ONNX export takes float weights, and {key} is not one in this model (a quantized "
                             "brisk checkpoint?): export the float model it was made from")
    gr = _Graph()
    w = {k: gr.const(k, v) for k, v in sd.items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    cos_t, sin_t = gr.const("rope.cos", net.rope.cos_table), gr.const("rope.sin", net.rope.sin_table)  # [max, d/2]
    eps = gr.scalar(config.rms_norm_eps)
    past_names, present_names, _ = io_names(L)

    def norm(x: str, weight: str) -> str:  # x [..., n] * rsqrt(mean(x^2) + eps) * weight
        ms = gr.op("ReduceMean", gr.op("Mul", x, x), gr.ints(-1), keepdims=1)
        return gr.op("Mul", gr.op("Mul", x, gr.op("Reciprocal", gr.op("Sqrt", gr.op("Add", ms, eps)))), weight)

    def linear(x: str, name: str) -> str:  # x [rows, in] -> [rows, out]
        bias = [w[f"{name}.bias"]] if f"{name}.bias" in w else []
        return gr.op("Gemm", x, w[f"{name}.weight"], *bias, transB=1)

    def rope(x: str) -> str:  # x [B, heads, S, d]; cos, sin [S, d/2]
        x1 = gr.op("Slice", x, gr.ints(0), gr.ints(half), gr.ints(3))
        x2 = gr.op("Slice", x, gr.ints(half), gr.ints(d), gr.ints(3))
        a = gr.op("Sub", gr.op("Mul", x1, cos), gr.op("Mul", x2, sin))
        b = gr.op("Add", gr.op("Mul", x2, cos), gr.op("Mul", x1, sin))
        return gr.op("Concat", a, b, axis=3)

    ids_shape = gr.op("Shape", "input_ids")
    seq = gr.op("Gather", ids_shape, gr.ints(1))  # [1]: S
    num_past = gr.op("Gather", gr.op("Shape", past_names[0]), gr.ints(2))  # [1]: P
    total = gr.op("Add", num_past, seq)
    p0, t0, one = (gr.op("Squeeze", x) for x in (num_past, total, gr.ints(1)))
    pos = gr.op("Range", p0, t0, one)  # [S]: P .. P + S - 1
    keys = gr.op("Range", gr.op("Squeeze", gr.ints(0)), t0, one)  # [P + S]
    cos, sin = gr.op("Gather", cos_t, pos), gr.op("Gather", sin_t, pos)  # [S, d/2]
    q_pos, k_pos = gr.op("Unsqueeze", pos, gr.ints(1)), gr.op("Unsqueeze", keys, gr.ints(0))  # [S, 1], [1, P + S]
    allowed = gr.op("LessOrEqual", k_pos, q_pos)  # [S, P + S] causal
    if config.sliding_window is not None:
        near = gr.op("Less", gr.op("Sub", q_pos, k_pos), gr.ints(config.sliding_window))
        allowed = gr.op("And", allowed, near)
    mask = gr.op("Where", allowed, gr.scalar(0.0), gr.scalar(float("-inf")))  # [S, P + S]
    scale = gr.scalar(d**-0.5)
    heads_shape = {n: gr.op("Concat", gr.ints(-1), seq, gr.ints(n, d), axis=0) for n in {h, kvh}}  # [B, S, n, d]
    group_shape = gr.op("Concat", gr.ints(-1, kvh, g), seq, gr.ints(d), axis=0)  # [B, kvh, g, S, d]
    merged_shape = gr.op("Concat", gr.ints(-1, h), seq, gr.ints(d), axis=0)  # [B, h, S, d]

    x = gr.op("Reshape", gr.op("Gather", w["model.embed_tokens.weight"], "input_ids"), gr.ints(-1, hidden))
    for i in range(L):  # x: [B * S, hidden], the residual stream
        pre = f"model.layers.{i}."
        y = norm(x, w[pre + "input_layernorm.weight"])
        q, k, v = (gr.op("Transpose", gr.op("Reshape", linear(y, pre + f"self_attn.{n}_proj"), heads_shape[m]),
                         perm=[0, 2, 1, 3]) for n, m in (("q", h), ("k", kvh), ("v", kvh)))  # [B, heads, S, d]
        if pre + "self_attn.q_norm.weight" in w:  # qwen3: per-head RMSNorm before RoPE
            q, k = norm(q, w[pre + "self_attn.q_norm.weight"]), norm(k, w[pre + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k = gr.op("Concat", past_names[2 * i], k, axis=2, out=present_names[2 * i])  # [B, kvh, P + S, d]
        v = gr.op("Concat", past_names[2 * i + 1], v, axis=2, out=present_names[2 * i + 1])
        qg = gr.op("Reshape", q, group_shape)  # [B, kvh, g, S, d]: the g query heads of each kv head
        kt = gr.op("Transpose", gr.op("Unsqueeze", k, gr.ints(2)), perm=[0, 1, 2, 4, 3])  # [B, kvh, 1, d, P + S]
        scores = gr.op("Add", gr.op("Mul", gr.op("MatMul", qg, kt), scale), mask)  # [B, kvh, g, S, P + S]
        o = gr.op("MatMul", gr.op("Softmax", scores, axis=-1), gr.op("Unsqueeze", v, gr.ints(2)))  # [B,kvh,g,S,d]
        o = gr.op("Transpose", gr.op("Reshape", o, merged_shape), perm=[0, 2, 1, 3])  # [B, S, h, d]
        x = gr.op("Add", x, linear(gr.op("Reshape", o, gr.ints(-1, h * d)), pre + "self_attn.o_proj"))
        y = norm(x, w[pre + "post_attention_layernorm.weight"])
        gate, up = linear(y, pre + "mlp.gate_proj"), linear(y, pre + "mlp.up_proj")
        act = gr.op("Mul", gr.op("Mul", gate, gr.op("Sigmoid", gate)), up)  # silu(gate) * up
        x = gr.op("Add", x, linear(act, pre + "mlp.down_proj"))
    rows = gr.op("Reshape", x, gr.op("Concat", gr.ints(-1), seq, gr.ints(hidden), axis=0))  # [B, S, hidden]
    last = gr.op("Reshape", gr.op("Slice", rows, gr.ints(-1), gr.ints(2**62), gr.ints(1)), gr.ints(-1, hidden))
    logits = gr.op("Gemm", norm(last, w["model.norm.weight"]), head, transB=1)  # [B, vocab]
    gr.op("Unsqueeze", logits, gr.ints(1), out="logits")  # [B, 1, vocab]

    f32 = TensorProto.FLOAT
    cache = ["batch", kvh, "past", d]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              *[helper.make_tensor_value_info(n, f32, cache) for n in past_names]]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", 1, config.vocab_size]),
               *[helper.make_tensor_value_info(n, f32, ["batch", kvh, "total", d]) for n in present_names]]
    graph = helper.make_graph(gr.nodes, "brisk-llama", inputs, outputs, gr.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9,
                             producer_name="brisk")


def io_names(num_layers: int) -> tuple[list[str], list[str], list[str]]:
    """(past input names, present output names, all input names) in the graph's order."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return past, present, ["input_ids", *past]


def model_digest(path: str | Path) -> str:
    """sha256 of what a model path holds (a GGUF file, or an HF folder's config and weights) and brisk's version."""
    from brisk import __version__

    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                 if p.suffix in (".safetensors", ".json", ".bin") and p.is_file())
    h = hashlib.sha256(f"brisk {__version__} onnx format {_FORMAT}".encode())
    for f in files:
        if path.is_dir():  # a folder's file names are part of what it holds; a file's own name is not
            h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "brisk" / "onnx"


def export_onnx(model_path: str | Path, out: str | Path) -> Path:
    """Load `model_path` with brisk in float32 and write its graph to `out` (the weights in `out`.data beside it,
    which the graph names: a 1B model is past protobuf's 2 GiB)."""
    import onnx

    from brisk.model.loader import load_model

    require_onnxruntime()
    loaded = load_model(model_path, dtype=torch.float32, fuse=False, sparse=False, show_progress=False)
    check_exportable(loaded.config)
    proto = build_graph(loaded.model, loaded.config)
    del loaded
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # written aside and moved in, the graph last: an export that dies leaves no graph in the cache
        onnx.save_model(proto, str(Path(tmp) / out.name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=out.name + ".data", size_threshold=1024)
        for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == out.name):
            f.replace(out.parent / f.name)
    return out


def onnx_cache_path(model_path: str | Path) -> Path:
    """Where the exported graph of `model_path` is cached: NAME-DIGEST.onnx, DIGEST of its content and brisk's version
    (the same content under another file name finds the graph the first name exported)."""
    digest = model_digest(model_path)
    found = sorted(cache_dir().glob(f"*-{digest}.onnx"))
    return found[0] if found else cache_dir() / f"{Path(model_path).stem}-{digest}.onnx"


def cached_onnx(model_path: str | Path, log: Any = None) -> Path:  # noqa: ANN401 - a print-like callable
    """The exported graph of `model_path` from the cache, exported first when it is not there."""
    out = onnx_cache_path(model_path)
    if out.exists():
        return out
    if log:
        log(f"exporting {Path(model_path).name} to ONNX (cached as {out}) ...")
    return export_onnx(model_path, out)


class OnnxModel:
    """An exported graph in an onnxruntime session on the CPU, `threads` intra-op threads, every graph
    optimization on."""

    def __init__(self, path: str | Path, threads: int) -> None:
        ort = require_onnxruntime()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        self.output_names = [o.name for o in self.session.get_outputs()]
        kvh, d = inputs[self.past_names[0]].shape[1], inputs[self.past_names[0]].shape[3]
        self.kv_shape = (int(kvh), int(d))

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        kvh, d = self.kv_shape
        return {n: np.zeros((batch, kvh, 0, d), dtype=np.float32) for n in self.past_names}

    def step(self, ids: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """ids [B, S] -> (logits [B, vocab] of the last position, the cache with these tokens added)."""
        logits, *present = self.session.run(self.output_names, {"input_ids": ids, **past})
        return logits[:, -1], dict(zip(self.past_names, present, strict=True))

    def prefill_seconds(self, prompt: list[int]) -> float:
        """Seconds to run `prompt` through the graph from an empty cache (time to first token, sampling aside)."""
        start = time.perf_counter()
        self.step(np.array([prompt], dtype=np.int64), self.empty_past(1))
        return time.perf_counter() - start

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[int], list[np.ndarray]]:
        """Prefill `prompts` together (one length), then greedy-decode `output_len` tokens each, the cache fed
        back. Returns (seconds of the decode steps, tokens of sequence 0, logits rows of sequence 0)."""
        logits, past = self.step(np.array(prompts, dtype=np.int64), self.empty_past(len(prompts)))
        nxt = logits.argmax(-1)  # [B]
        out0, rows0 = [int(nxt[0])], [logits[0]]
        start = time.perf_counter()
        for _ in range(output_len - 1):
            logits, past = self.step(nxt[:, None].astype(np.int64), past)
            nxt = logits.argmax(-1)
            out0.append(int(nxt[0]))
            rows0.append(logits[0])
        return time.perf_counter() - start, out0, rows0

    def decode_rate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[int]]:
        """Greedy decode of len(prompts) sequences together; (decode tok/s, prefill excluded; tokens of seq 0)."""
        elapsed, out0, _ = self.generate(prompts, output_len)
        return len(prompts) * (output_len - 1) / elapsed, out0
