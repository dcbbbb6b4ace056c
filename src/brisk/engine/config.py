"""Validated configuration dataclasses, one per subsystem, gathered in EngineConfig."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_size(value: int | str) -> int:
    """'512MiB' / '1GB' / '1e9' / 1048576 -> bytes."""
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse memory size {value!r}; use e.g. 512MiB, 2GiB or a byte count")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32 or bfloat16")
        return dtype
    if dtype == "auto":
        return torch.float32
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or auto") from None


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | str = "512MiB"  # budget for the KV pool; sets the number of blocks
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools to force preemption)
    enable_prefix_caching: bool = True
    # "auto" (the model dtype), "bfloat16" (16-bit K/V under a float32 model, llama.cpp's default f16 cache),
    # "int8" or "int4" (kvcache/quant.py)
    kv_cache_dtype: str = "auto"
    num_residual_blocks: int = 16  # int4 only: float16 key buffers of blocks being filled (KIVI's window)
    kv_policy: str = "full"  # "full", "streaming" or "h2o" (kvcache/policy.py)
    kv_budget: int | None = None  # tokens kept per request by an evicting policy (sinks included)
    sink_tokens: int = 4  # streaming: leading tokens always kept (attention sinks)
    h2o_recent: int | None = None  # h2o: newest entries always kept (default kv_budget // 2), the rest heavy hitters

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_dtype in ("bf16", "bfloat16"):
            self.kv_cache_dtype = "bfloat16"
        if self.kv_cache_dtype not in ("auto", "bfloat16", "int8", "int4"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16, int8 or int4, got {self.kv_cache_dtype!r}")
        if self.num_residual_blocks < 1:
            raise ValueError(f"num_residual_blocks must be at least 1, got {self.num_residual_blocks}")
        if self.kv_policy not in ("full", "streaming", "h2o"):
            raise ValueError(f"kv_policy must be full, streaming or h2o, got {self.kv_policy!r}")
        if self.kv_policy == "streaming" and (self.kv_budget is None or self.kv_budget <= self.sink_tokens):
            raise ValueError(f"kv_policy 'streaming' needs --kv-budget larger than --sink-tokens "
                             f"({self.sink_tokens}), got {self.kv_budget}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.kv_policy == "h2o":
            if self.kv_budget is None:
                raise ValueError("kv_policy 'h2o' needs --kv-budget N (tokens of KV kept per request)")
            if self.h2o_recent is None:
                self.h2o_recent = self.kv_budget // 2
            if not 0 < self.h2o_recent < self.kv_budget:
                raise ValueError(f"kv_policy 'h2o' needs 0 < --h2o-recent ({self.h2o_recent}) < --kv-budget "
                                 f"({self.kv_budget}): the budget holds the recent window and the heavy hitters")
            if self.kv_cache_dtype == "bfloat16":
                raise ValueError("kv_policy 'h2o' runs with kv_cache_dtype auto only (its score and compaction path "
                                 "is not built or tested for a 16-bit cache under a float32 model); use "
                                 "kv_cache_dtype auto with h2o, or kv_policy streaming with bfloat16")
            if self.kv_cache_dtype != "auto":
                # compaction moves entries between blocks: int4 keys share per-block channel scales (a moved key
                # would need re-quantizing with its new block), and the H2O score path reads the float cache only
                raise ValueError(f"kv_policy 'h2o' does not support kv_cache_dtype {self.kv_cache_dtype} (compaction "
                                 "moves entries between blocks); use kv_cache_dtype auto with h2o, or kv_policy "
                                 f"streaming with {self.kv_cache_dtype}")
        elif self.h2o_recent is not None:
            raise ValueError(f"h2o_recent is an h2o setting; it has no meaning under kv_policy {self.kv_policy!r}")
        self.kv_cache_bytes = parse_size(self.kv_cache_memory)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 128  # requests running at once
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority" (lower priority value first)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) so that any prompt fits in one step")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


SPEC_METHODS = ("ngram", "draft", "self", "layerskip", "lookahead")
SELF_DRAFT_BITS = {"int8": 8, "int4": 4, "int2": 2}


@dataclass
class SpecConfig:
    """Speculative decoding; keys follow vLLM's speculative_config where they exist.

    method: ngram (prompt lookup) | draft (a separate model: `model` is its path) | self (an RTN-quantized copy
    of the target built at load: `model` is int8, int4 or int2) | layerskip (the target with some layers skipped:
    `skip_layers`, or the set stored next to the model by `brisk spec layerskip-search`) | lookahead (Jacobi
    iterations + an n-gram pool, spec/lookahead.py).
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4  # the most drafts per step (γ); adaptive γ chooses per request below it
    adaptive: bool = True
    prompt_lookup_max: int = 4  # ngram: longest suffix matched against prompt + output
    prompt_lookup_min: int = 1
    skip_layers: list[int] | None = None
    lookahead_ngram_size: int = 4  # lookahead: N of the n-grams the pool keeps (the paper's N)
    lookahead_pool_size: int = 8  # lookahead: n-grams kept per first token (the paper's G)
    # vLLM's disable_by_batch_size: no drafts while more than this many requests are running; None = always
    # speculate. On a 2-core CPU verification rows cost nearly full decode tokens once several requests decode
    # together; adaptive γ prices that from measured steps (one line per kernel regime, spec/adaptive.py) and
    # drafts only where it pays: at 8 concurrent requests 1.40-1.57x on input-grounded text, 0.98-1.05x (drafting
    # off) on chat and code. Past 8 requests it is unmeasured here, hence the default.
    disable_by_batch_size: int | None = 8

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use ngram, lookahead, layerskip, "
                             "draft:PATH, self:int4, self:int8 or self:int2")
        if self.lookahead_ngram_size < 2 or self.lookahead_pool_size < 1:
            raise ValueError(f"lookahead needs lookahead_ngram_size >= 2 and lookahead_pool_size >= 1, got "
                             f"{self.lookahead_ngram_size} and {self.lookahead_pool_size}")
        if self.method == "draft" and not self.model:
            raise ValueError("the draft method needs a model path: --speculative draft:PATH")
        if self.method == "self":
            self.model = self.model or "int4"
            if self.model not in SELF_DRAFT_BITS:
                raise ValueError(f"self-draft quantization must be one of {', '.join(SELF_DRAFT_BITS)}, "
                                 f"got {self.model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, spec: str | dict | SpecConfig | None, num_speculative_tokens: int | None = None
              ) -> SpecConfig | None:
        """'ngram' | 'layerskip' | 'lookahead' | 'draft:PATH' | 'self:int4' | a vLLM-style dict | None (off)."""
        if spec is None or isinstance(spec, SpecConfig):
            return spec
        if isinstance(spec, dict):
            kwargs = dict(spec)
            if "method" not in kwargs:  # vLLM: {"model": "ngram"} or {"model": PATH}
                model = kwargs.pop("model", None)
                kwargs["method"], kwargs["model"] = ("ngram", None) if model in (None, "ngram") else ("draft", model)
        else:
            method, _, arg = str(spec).partition(":")
            kwargs = {"method": method, "model": arg or None}
        if num_speculative_tokens is not None:
            kwargs["num_speculative_tokens"] = num_speculative_tokens
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"bad speculative config {spec!r}: {e}") from None


@dataclass
class EngineConfig:
    model: str | None = None  # None = the default model
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None  # None = min(model's context, 2048)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig | None = None  # None = defaults with max_model_len filled in
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    spec: SpecConfig | None = None  # speculative decoding; None = off
    # oneDNN-packed copies of float32 linear weights for batched GEMMs (ops.linear.prepack_weight): "auto" = when
    # batches can exceed the small-M kernel's 8 rows (max_num_seqs > 8), "on", "off"
    prepack_weights: str = "auto"
    # activations of 8/4-bit quantized linears: "float" (codes decoded to float), "int8" (every row of x rounded to
    # int8 per 32 columns, integer dot products: ops/qlinear_q8.py; faster decode, slightly different numerics), or
    # "auto": int8 for layers of 4 bits or fewer (llama.cpp's Q4 x Q8 convention), float for 8-bit layers
    quant_activations: str = "auto"
    # torch.compile (inductor) of the decoder's dense parts, attention on the paged kernels (engine/compiled.py);
    # every shape bucket is compiled at start-up (~15-20 s for the default model). Off by default: on this CPU it
    # is slower than brisk's own C++ layer loop (BENCHMARKS.md)
    compile: bool = False
    # which path runs the forward (engine/executor.py): "auto" (the C++ layer loop where built, else the decode
    # plan, else the modules), "modules", "plan", "cpp" or "compiled" (= compile=True)
    execution: str = "auto"

    def __post_init__(self) -> None:
        self.torch_dtype = parse_dtype(self.dtype)
        from brisk.engine.executor import EXECUTIONS

        if self.execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {self.execution!r}")
        if self.compile and self.execution not in ("auto", "compiled"):
            raise ValueError(f"compile=True is execution='compiled'; it cannot be combined with "
                             f"execution={self.execution!r}")
        if self.compile:
            self.execution = "compiled"
        self.compile = self.execution == "compiled"
        if self.prepack_weights not in ("auto", "on", "off"):
            raise ValueError(f"prepack_weights must be 'auto', 'on' or 'off', got {self.prepack_weights!r}")
        if self.quant_activations not in ("auto", "float", "int8"):
            raise ValueError(f"quant_activations must be 'auto', 'float' or 'int8', got {self.quant_activations!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.spec is not None and self.cache.kv_cache_dtype == "int4":
            # An int4 block's keys share per-channel scales fixed when the block fills; drafts can fill it and
            # then be rejected, and re-quantizing it after the rewrite does not give the plain path's codes,
            # so greedy output would no longer equal plain decoding (measured on a tiny model).
            raise ValueError("speculative decoding does not support kv_cache_dtype int4 (KIVI's per-block key "
                             "scales would depend on rejected drafts); use kv_cache_dtype int8 or auto with it")
        if self.spec is not None and self.cache.kv_policy == "h2o":
            # H2O scores and compacts after every step; drafts would add rejected tokens' keys and queries to the
            # attention mass that chooses the kept entries, so greedy output would no longer equal plain H2O.
            raise ValueError("speculative decoding does not support kv_policy h2o (rejected drafts would take part "
                             "in choosing the heavy hitters); use kv_policy streaming or full with it")
