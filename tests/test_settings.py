"""Engine settings are defined once (config fields): LLM's keywords, the CLI options and the config agree; and the
KV pool's size in blocks, exactly, on a fake model."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner

from brisk import LLM
from brisk.bench.cli import bench
from brisk.cli import main
from brisk.engine.config import CacheConfig, EngineConfig
from brisk.engine.settings import SETTINGS, build_engine_config, cli_args, engine_settings
from brisk.kvcache.policy import make_policy
from brisk.kvcache.sizing import check_kv_pool, check_policy_supports, min_blocks_evicting, num_kv_blocks

ENGINE_COMMANDS = {"generate": main.commands["generate"], "chat": main.commands["chat"],
                   "serve": main.commands["serve"], "bench latency": bench.commands["latency"],
                   "bench throughput": bench.commands["throughput"], "bench serve": bench.commands["serve"]}
# per-command defaults that differ on purpose (bench latency repeats one prompt: a prefix cache would skip it)
COMMAND_DEFAULTS = {("bench latency", "enable_prefix_caching"): False}
API_ONLY: set[str] = set()  # keywords with no command-line form (a dict is a JSON object there)


def _llm_keywords() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(LLM).parameters)


def test_llm_signature_is_the_settings():
    params = _llm_keywords()
    assert list(params) == [s.kwarg for s in engine_settings()]
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {"dtype", "max_model_len", "kv_cache_dtype", "enable_prefix_caching", "speculative_config",
            "num_kv_blocks", "scheduling_policy", "num_threads", "execution", "compile"} <= set(params)
    for s in engine_settings():
        assert params[s.kwarg].default == s.default, s.kwarg
        assert f"    {s.kwarg} (default {s.default!r}" in LLM.__doc__


@pytest.mark.parametrize("name", list(ENGINE_COMMANDS))
def test_every_llm_keyword_is_an_option_with_the_same_default(name):
    options = {p.name: p for p in ENGINE_COMMANDS[name].params if isinstance(p, click.Option)}
    for kwarg, param in _llm_keywords().items():
        if kwarg in API_ONLY:
            assert kwarg not in options
            continue
        assert kwarg in options, f"{name} has no option for LLM's {kwarg}"
        want = COMMAND_DEFAULTS.get((name, kwarg), param.default)
        assert options[kwarg].default == want, (name, kwarg)


def test_flags_keep_their_names():
    opts = {o for p in ENGINE_COMMANDS["generate"].params for o in (*p.opts, *p.secondary_opts)}
    assert {"--model", "-m", "--dtype", "--max-model-len", "--kv-cache-memory", "--max-num-seqs",
            "--max-num-batched-tokens", "--block-size", "--no-prefix-caching", "--no-chunked-prefill", "--seed",
            "--threads", "--prepack-weights", "--quant-activations", "--compile", "--speculative",
            "--num-speculative-tokens", "--kv-cache-dtype", "--kv-policy", "--kv-budget", "--sink-tokens",
            "--h2o-recent", "--execution"} <= opts


@pytest.mark.parametrize("setting", engine_settings(), ids=lambda s: s.kwarg)
def test_every_setting_has_help_and_validated_choices(setting):
    assert len(setting.meta.help) > 10
    if not setting.meta.choices:
        return
    option = next(p for p in ENGINE_COMMANDS["generate"].params if p.name == setting.kwarg)
    assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == setting.meta.choices
    with pytest.raises(ValueError):  # the dataclass checks them too (LLM's keywords go there, not through click)
        setting.check("no-such-value")


@pytest.mark.parametrize("kwarg,bad", [("kv_cache_dtype", "int3"), ("prepack_weights", "yes"),
                                       ("kv_policy", "lru"), ("scheduling_policy", "lifo"),
                                       ("execution", "fast"), ("dtype", "float8"),
                                       ("quant_activations", "int4"), ("kv_cache_memory", "lots"),
                                       ("block_size", "3")])
def test_a_bad_value_gives_the_same_error_from_the_cli_and_from_llm(kwarg, bad):
    value = int(bad) if SETTINGS[kwarg].is_int else bad
    with pytest.raises(ValueError) as api:
        LLM(**{kwarg: value})  # fails before any model loads
    result = CliRunner().invoke(main, ["generate", "x", *cli_args({kwarg: value})])
    assert result.exit_code != 0
    assert str(api.value) in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_keywords_reach_their_config_fields():
    config = build_engine_config(num_kv_blocks=7, scheduling_policy="priority", enable_prefix_caching=False,
                                 num_threads=2, max_model_len=512, enable_chunked_prefill=False, kv_cache_dtype="bf16",
                                 speculative="ngram", num_speculative_tokens=3)
    assert config.cache.num_blocks == 7 and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_dtype == "bfloat16"
    assert config.scheduler.policy == "priority" and config.num_threads == 2
    # without chunked prefill the default budget is max(2048, max_model_len), filled in before the model loads
    assert config.scheduler.max_model_len == 512 and config.scheduler.max_num_batched_tokens == 2048
    assert config.spec is not None and config.spec.method == "ngram" and config.spec.num_speculative_tokens == 3
    assert build_engine_config().spec is None
    with pytest.raises(TypeError, match="'max_seqs'"):
        build_engine_config(max_seqs=4)
    with pytest.raises(ValueError, match="not both"):
        build_engine_config(speculative="ngram", speculative_config={"method": "ngram"})


def test_compile_is_an_alias_of_execution_compiled():
    assert EngineConfig(compile=True).execution == "compiled"
    assert EngineConfig(execution="compiled").compile
    assert not EngineConfig().compile and EngineConfig().execution == "auto"
    with pytest.raises(ValueError, match="contradicts execution 'plan'"):
        EngineConfig(compile=True, execution="plan")


def test_cli_args_parse_back_to_the_same_settings():
    values = {"dtype": "bfloat16", "max_model_len": 256, "enable_prefix_caching": False, "num_threads": 2,
              "kv_cache_memory": "8MiB", "compile": False, "kv_policy": "streaming", "kv_budget": 64}
    ctx = main.commands["serve"].make_context("serve", cli_args(values))
    assert {k: ctx.params[k] for k in values} == values
    assert cli_args({"max_model_len": None}) == []


# ---------------------------------------------------------------------------- KV pool sizing
# 2 layers, 2 KV heads, head_dim 8: float32 K+V cost 2 * 2 * 8 * 4 bytes per layer per token
FAKE = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("kv_cache_dtype,dtype,blocks", [
    ("auto", torch.float32, 256),  # 256 B/token * 16 = 4096 B/block; 1 MiB / 4096
    ("auto", torch.bfloat16, 512),  # 128 B/token
    ("bfloat16", torch.float32, 512),
    ("int8", torch.float32, 819),  # 2 * 2 * (8 + 2) * 2 layers = 80 B/token: 1 MiB // 1280
    # int4: (2 * (4 + 2) + 2 * (4 + 4)) * 2 = 56 B/token = 896 B/block, after 16 residual buffers x 2 layers x 512 B
    ("int4", torch.float32, (2**20 - 16 * 2 * 512) // 896),
])
def test_num_kv_blocks_from_the_memory_budget(kv_cache_dtype, dtype, blocks):
    cache = CacheConfig(kv_cache_memory="1MiB", kv_cache_dtype=kv_cache_dtype)
    assert num_kv_blocks(cache, FAKE, dtype) == blocks
    assert num_kv_blocks(CacheConfig(num_blocks=7, kv_cache_dtype=kv_cache_dtype), FAKE, dtype) == 7


def test_the_pool_must_hold_one_sequence():
    cache = CacheConfig(kv_cache_memory="1MiB")  # 256 blocks of 16 = 4096 tokens
    full = make_policy("full")
    check_kv_pool(256, cache, FAKE, torch.float32, full, 2048, 4096)
    with pytest.raises(ValueError, match=r"256 blocks of 16 tokens\) cannot hold one sequence of max_model_len=4097"):
        check_kv_pool(256, cache, FAKE, torch.float32, full, 2048, 4097)


@pytest.mark.parametrize("kv_policy,needed", [
    ("streaming", 1 + 6 + 2),  # the sinks' block, (60 window + 32 new) / 16, a partial block at each end
    ("h2o", 6 + 4),  # (63 kept + 32 new) / 16, and 63 / 16 destination blocks while compacting
])
def test_an_evicting_pool_must_hold_one_request(kv_policy, needed):
    cache = CacheConfig(kv_policy=kv_policy, kv_budget=64)
    policy = make_policy(kv_policy, 64, 4, cache.h2o_recent)
    assert min_blocks_evicting(policy, 16, 32) == needed
    check_kv_pool(needed, cache, FAKE, torch.float32, policy, 32, 10**6)  # max_model_len does not matter
    with pytest.raises(ValueError, match=f"under --kv-budget 64 with 32 tokens per step \\({needed} blocks\\)"):
        check_kv_pool(needed - 1, cache, FAKE, torch.float32, policy, 32, 16)


def test_an_evicting_policy_needs_a_plain_rope_and_no_sliding_window():
    streaming = make_policy("streaming", 64, 4)
    check_policy_supports(make_policy("full"), "full", sliding_window=128, dynamic_rope=True)
    with pytest.raises(ValueError, match="sliding window"):
        check_policy_supports(streaming, "streaming", sliding_window=128, dynamic_rope=False)
    with pytest.raises(ValueError, match="dynamic NTK"):
        check_policy_supports(streaming, "streaming", sliding_window=None, dynamic_rope=True)
