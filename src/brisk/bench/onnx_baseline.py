"""ONNX Runtime as a baseline: brisk's float weights exported to one ONNX graph with its KV cache as explicit
inputs and outputs, run by onnxruntime's CPUExecutionProvider (an optional extra: `pip install 'brisk[onnx]'`).

The graph (names as Optimum and onnxruntime-genai give them; one graph for prefill and decode):

    inputs   input_ids [batch, seq] int64, past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim]
    outputs  logits [batch, 1, vocab] (the last position's only), present.{i}.key / .value
             [batch, kv_heads, past + seq, head_dim]

Prefill feeds a past of length 0; each decode step feeds the last step's `present` back as `past` with one new
token, so decode is one `session.run` per token. Positions are past .. past + seq - 1 for every row: no padding
and no attention_mask input, so the sequences of a batch share one length (the benchmark's rotated prompts do).

The graph is traced by torch.onnx (dynamo) from `ReferenceLlama`, a small plain-PyTorch decoder holding brisk's
loaded weights dequantized to float32, and cached under ~/.cache/brisk/onnx keyed by the model's content and
brisk's version, so a second benchmark does not export again.
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
import torch.nn.functional as F
from torch import nn

ONNX_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # the dense decoders whose math ReferenceLlama has
ONNX_ROPE_KINDS = ("default", "linear", "llama3")  # a fixed table of rotations (not length-dependent)
_FORMAT = 1  # bumped when the graph changes: part of the cache key


class OnnxRuntimeMissingError(RuntimeError):
    """The onnxruntime baseline was asked for but onnxruntime / onnx / onnxscript is not installed."""


def require_onnxruntime() -> Any:
    try:
        import onnx  # noqa: F401 - the exporter's
        import onnxruntime
        import onnxscript  # noqa: F401 - the exporter's
    except ImportError as e:
        raise OnnxRuntimeMissingError(
            f"the onnxruntime baseline needs onnxruntime, onnx and onnxscript ({e.name} is not installed); install "
            "them with `pip install 'brisk[onnx]'`, or leave onnxruntime out of --baselines") from e
    return onnxruntime


def check_exportable(config: Any) -> None:  # noqa: ANN401 - brisk.model.config.ModelConfig
    """ValueError naming what the exporter does not support (architecture, RoPE variant, activation)."""
    if config.architecture not in ONNX_ARCHITECTURES:
        raise ValueError(f"the ONNX export supports {', '.join(ONNX_ARCHITECTURES)}; this model is "
                         f"{config.architecture!r}: leave onnxruntime out of --baselines for it")
    s = dict(config.rope_scaling or {})
    kind = s.get("rope_type", s.get("type", "default")) or "default"
    if kind not in ONNX_ROPE_KINDS:
        raise ValueError(f"the ONNX export supports RoPE {', '.join(ONNX_ROPE_KINDS)}; this model's is {kind!r}")


class ReferenceLlama(nn.Module):
    """The decoder with the cache as tensors: (input_ids [B, S], past [2 L x [B, kvh, P, d]]) ->
    (logits [B, 1, vocab], present [2 L x [B, kvh, P + S, d]]). Float32 throughout, the same math as
    model/llama.py's module path (RMSNorm statistics in float32, RoPE of the first and second halves)."""

    def __init__(self, net: nn.Module, config: Any) -> None:  # noqa: ANN401 - LlamaForCausalLM, ModelConfig
        super().__init__()
        self.num_layers = config.num_hidden_layers
        self.h, self.kvh, self.d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.sliding_window
        sd = {k: v.detach().float().contiguous() for k, v in net.state_dict().items()}
        if "lm_head.weight" not in sd:  # tied
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.w = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(v, requires_grad=False) for k, v in sd.items()})
        self.register_buffer("cos_table", net.rope.cos_table.float().clone())  # [max_position, d/2]
        self.register_buffer("sin_table", net.rope.sin_table.float().clone())

    def p(self, name: str) -> torch.Tensor | None:
        key = name.replace(".", "__")
        return self.w[key] if key in self.w else None

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.p(name)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.d // 2  # x: [B, heads, S, d]; cos, sin: [S, d/2]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, input_ids: torch.Tensor, past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        b, s = input_ids.shape
        num_past = past[0].shape[2]
        pos = torch.arange(s) + num_past  # [S] absolute positions
        cos, sin = self.cos_table[pos], self.sin_table[pos]  # [S, d/2]
        keys = torch.arange(num_past + s)  # [P + S]
        allowed = keys[None, :] <= pos[:, None]  # [S, P + S] causal
        if self.window is not None:
            allowed = allowed & (pos[:, None] - keys[None, :] < self.window)
        mask = torch.where(allowed, 0.0, float("-inf"))  # [S, P + S]
        x = F.embedding(input_ids, self.p("model.embed_tokens.weight"))  # [B, S, hidden]
        g = self.h // self.kvh
        present: list[torch.Tensor] = []
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            y = self.norm(x, pre + "input_layernorm.weight")
            q = F.linear(y, self.p(pre + "self_attn.q_proj.weight"), self.p(pre + "self_attn.q_proj.bias"))
            k = F.linear(y, self.p(pre + "self_attn.k_proj.weight"), self.p(pre + "self_attn.k_proj.bias"))
            v = F.linear(y, self.p(pre + "self_attn.v_proj.weight"), self.p(pre + "self_attn.v_proj.bias"))
            q = q.view(b, s, self.h, self.d).transpose(1, 2)  # [B, h, S, d]
            k = k.view(b, s, self.kvh, self.d).transpose(1, 2)  # [B, kvh, S, d]
            v = v.view(b, s, self.kvh, self.d).transpose(1, 2)
            if self.p(pre + "self_attn.q_norm.weight") is not None:  # qwen3: per-head RMSNorm before RoPE
                q, k = self.norm(q, pre + "self_attn.q_norm.weight"), self.norm(k, pre + "self_attn.k_norm.weight")
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            k = torch.cat((past[2 * i], k), dim=2)  # [B, kvh, P + S, d]
            v = torch.cat((past[2 * i + 1], v), dim=2)
            present += [k, v]
            qg = q.reshape(b, self.kvh, g, s, self.d)  # [B, kvh, g, S, d]: the g query heads of each kv head
            scores = qg @ k.unsqueeze(2).transpose(-1, -2) * self.d**-0.5 + mask  # [B, kvh, g, S, P + S]
            o = torch.softmax(scores, dim=-1) @ v.unsqueeze(2)  # [B, kvh, g, S, d]
            o = o.reshape(b, self.h, s, self.d).transpose(1, 2).reshape(b, s, self.h * self.d)  # [B, S, h d]
            x = x + F.linear(o, self.p(pre + "self_attn.o_proj.weight"))
            y = self.norm(x, pre + "post_attention_layernorm.weight")
            gate = F.linear(y, self.p(pre + "mlp.gate_proj.weight"))
            up = F.linear(y, self.p(pre + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, self.p(pre + "mlp.down_proj.weight"))
        x = self.norm(x[:, -1:], "model.norm.weight")  # [B, 1, hidden]: the last position only
        return (F.linear(x, self.p("lm_head.weight")), *present)


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
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "brisk" / "onnx"


def export_onnx(model_path: str | Path, out: str | Path) -> Path:
    """Load `model_path` with brisk in float32 and export its ReferenceLlama to `out` (weights in `out`.data)."""
    import warnings

    from brisk.model.loader import load_model

    require_onnxruntime()
    loaded = load_model(model_path, dtype=torch.float32, fuse=False, sparse=False, show_progress=False)
    check_exportable(loaded.config)
    ref = ReferenceLlama(loaded.model, loaded.config).eval()
    del loaded
    past_names, present_names, input_names = io_names(ref.num_layers)
    batch, seq, past_len = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    example = (torch.zeros(2, 3, dtype=torch.long), tuple(torch.zeros(2, ref.kvh, 4, ref.d) for _ in past_names))
    shapes = ({0: batch, 1: seq}, tuple({0: batch, 2: past_len} for _ in past_names))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(ref, example, input_names=input_names,
                                    output_names=["logits", *present_names], dynamic_shapes=shapes, dynamo=True,
                                    verbose=False, optimize=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # weights in NAME.onnx.data beside the graph (a 1B model is past protobuf's 2 GiB), which names that file;
        # written aside and moved in, the graph last: an export that dies leaves no graph in the cache
        program.save(str(Path(tmp) / out.name), external_data=True)
        for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == out.name):
            f.replace(out.parent / f.name)
    return out


def onnx_cache_path(model_path: str | Path) -> Path:
    """Where the exported graph of `model_path` is cached: its name and a digest of its content and brisk's version."""
    return cache_dir() / f"{Path(model_path).stem}-{model_digest(model_path)}.onnx"


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
