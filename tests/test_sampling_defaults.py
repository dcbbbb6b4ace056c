"""Sampling defaults from the model: where they come from, that omitted fields take them, explicit ones win.

Sources (engine/sampling_defaults.py): an HF folder's generation_config.json, a GGUF's general.sampling.* keys,
else brisk's conservative defaults; `generation_config="vllm"` is SamplingParams' own; overrides on top. They
reach LLM.generate with no params, `brisk generate/chat` with no sampling flags, and every server request
(checked on the real default model with the openai client), and brisk's checkpoints carry them on.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.engine.sampling_defaults import CONSERVATIVE, SamplingDefaults, parse_overrides, resolve_sampling_defaults
from brisk.model.generation_config import generation_config_from_gguf_metadata, read_generation_config
from brisk.model.loader import default_model_path
from brisk.serve.process import ServerProcess
from brisk.serve.protocol import ChatCompletionRequest, CompletionRequest

MODEL_SAMPLING = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}


def write_generation_config(folder: Path, **fields: object) -> None:
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.fixture(scope="module")
def sampling_dir(tmp_path_factory) -> Path:
    """The same model with recommended sampling values in its generation_config.json."""
    path = tmp_path_factory.mktemp("tiny-sampling")
    make_tiny_hf_model(path, "llama", seed=3)
    write_generation_config(path, **MODEL_SAMPLING)
    return path


# ---------------------------------------------------------------------------------------------- resolution
def test_auto_takes_exactly_the_fields_the_model_states():
    d = resolve_sampling_defaults("auto", {}, {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 300,
                                               "do_sample": True, "eos_token_id": 2}, "m")
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (0.6, 0.9, 0, 0.0,
                                                                                                1.0, 300)
    assert d.source == "m's generation config"


def test_auto_without_sampling_fields_is_conservative_and_vllm_is_sampling_params():
    d = resolve_sampling_defaults("auto", {}, {"eos_token_id": 2, "temperature": None}, "m")
    assert {k: getattr(d, k) for k in CONSERVATIVE} == CONSERVATIVE == {"temperature": 0.8, "top_k": 40,
                                                                       "top_p": 0.95, "min_p": 0.05}
    assert "conservative" in d.source
    v = resolve_sampling_defaults("vllm", {}, MODEL_SAMPLING, "m")
    plain = SamplingParams()
    assert (v.temperature, v.top_p, v.top_k, v.min_p, v.repetition_penalty) == (
        plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty)


def test_path_and_overrides(sampling_dir, tmp_path):
    d = resolve_sampling_defaults(str(sampling_dir), parse_overrides('{"top_k": 20, "max_new_tokens": 64}'), {}, "m")
    assert (d.temperature, d.top_p, d.repetition_penalty, d.top_k, d.max_tokens) == (0.6, 0.9, 1.1, 20, 64)
    assert str(sampling_dir) in d.source and "override_generation_config" in d.source
    file = tmp_path / "gen.json"
    file.write_text(json.dumps({"temperature": 0.2}))
    assert resolve_sampling_defaults(str(file), {}, {}, "m").temperature == 0.2


@pytest.mark.parametrize("overrides,message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"temp": 1}, "unknown field 'temp'"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
])
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ValueError) as e:
        parse_overrides(overrides)
    assert message in str(e.value)


def test_bad_model_generation_config_names_its_source(tmp_path):
    with pytest.raises(ValueError, match="bad sampling default from m's generation config: temperature"):
        resolve_sampling_defaults("auto", {}, {"temperature": -1}, "m")
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="is not valid JSON"):
        resolve_sampling_defaults(str(tmp_path), {}, {}, "m")
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or the path"):
        LLM(generation_config=str(tmp_path / "missing"))


def test_explicit_values_win_and_none_means_omitted():
    d = SamplingDefaults(temperature=0.6, top_k=40, max_tokens=50, source="t")
    p = d.sampling_params(temperature=0.0, top_k=None, seed=3)
    assert (p.temperature, p.seed, p.max_tokens) == (0.0, 3, 50)
    p = d.sampling_params(top_p=0.5, max_tokens=7)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 40, 0.5, 7)
    assert SamplingDefaults().sampling_params() == SamplingParams()


def test_gguf_sampling_keys_map_to_generation_config_names():
    md = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "general.sampling.top_p": 0.8,
          "general.sampling.min_p": 0.01, "general.sampling.penalty_repeat": 1.05,
          "general.sampling.mirostat": 0, "general.name": "x"}
    assert generation_config_from_gguf_metadata(md) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                                        "min_p": 0.01, "repetition_penalty": 1.05}


def test_the_default_models_gguf_states_no_sampling_values():
    # SmolLM2-135M-Instruct.Q4_1.gguf has no general.sampling.* key: auto falls back to the conservative defaults
    assert read_generation_config(default_model_path()) == {}


# ---------------------------------------------------------------------------------------------- LLM and CLI
def test_llm_applies_the_models_defaults_when_no_params_are_given(sampling_dir):
    llm = LLM(str(sampling_dir), max_model_len=64, kv_cache_memory="8MiB")
    p = llm.get_default_sampling_params(max_tokens=6)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 0, 0.0, 1.1)
    vllm = LLM(str(sampling_dir), max_model_len=64, kv_cache_memory="8MiB", generation_config="vllm")
    assert asdict(vllm.get_default_sampling_params()) == asdict(SamplingParams())


def test_llm_generate_without_params_uses_the_model_defaults(tmp_path):
    # a model that recommends greedy decoding: generate() with no params must equal explicit greedy
    folder = tmp_path / "greedy"
    make_tiny_hf_model(folder, "llama", seed=3)
    write_generation_config(folder, temperature=0.0, max_new_tokens=3)
    llm = LLM(str(folder), max_model_len=64, kv_cache_memory="8MiB")
    got = llm.generate(["Emma Woodhouse"])[0].outputs[0]
    want = llm.generate(["Emma Woodhouse"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "length" and len(got.token_ids) == 3


def test_cli_generate_without_sampling_flags_uses_the_model_defaults(tmp_path):
    folder = tmp_path / "greedy"
    make_tiny_hf_model(folder, "llama", seed=3)
    write_generation_config(folder, temperature=0.0)
    result = CliRunner().invoke(main, ["generate", "Emma Woodhouse", "--model", str(folder), "--max-tokens", "10",
                                       "--max-model-len", "64", "--no-stream"])
    assert result.exit_code == 0, result.output
    want = LLM(str(folder), max_model_len=64).generate(["Emma Woodhouse"], SamplingParams(temperature=0,
                                                                                          max_tokens=10))[0]
    assert result.stdout == want.outputs[0].text + "\n"
    assert "sampling: greedy, temperature=0.0 repetition_penalty=1.0 max_tokens=10" in result.stderr
    # an override on the command line, shown in the start-up line
    result = CliRunner().invoke(main, ["generate", "x", "--model", str(folder), "--max-tokens", "2", "--max-model-len",
                                       "64", "--override-generation-config", '{"top_k": 5}', "-t", "0.7"])
    assert result.exit_code == 0, result.output
    assert "top_k=5" in result.stderr and 'override_generation_config {"top_k": 5}' in result.stderr


# ---------------------------------------------------------------------------------------------- checkpoints
def test_quantized_and_pruned_checkpoints_carry_the_source_generation_config(sampling_dir, tmp_path):
    runner = CliRunner()
    q, p = tmp_path / "q8", tmp_path / "pruned"
    result = runner.invoke(main, ["quantize", "--bits", "8", "--group-size", "-1", str(sampling_dir), str(q)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["prune", "--method", "magnitude", "--sparsity", "0.5", str(sampling_dir), str(p)])
    assert result.exit_code == 0, result.output
    source = json.loads((sampling_dir / "generation_config.json").read_text())
    for folder in (q, p):
        written = json.loads((folder / "generation_config.json").read_text())
        assert {k: written.get(k) for k in MODEL_SAMPLING} == MODEL_SAMPLING
        assert written["eos_token_id"] == source["eos_token_id"] or written["eos_token_id"] == [source["eos_token_id"]]
        llm = LLM(str(folder), max_model_len=64, kv_cache_memory="8MiB")
        assert llm.engine.sampling_defaults.temperature == 0.6


# ---------------------------------------------------------------------------------------------- the server
def test_server_requests_take_the_defaults_for_omitted_fields_only(sampling_dir):
    from brisk.serve.app import ServerConfig, _Server

    engine = LLM(str(sampling_dir), max_model_len=64, kv_cache_memory="8MiB").engine
    server = _Server(engine, ServerConfig())
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    (req,) = server.chat_requests(chat, "r")
    d = engine.sampling_defaults
    assert (req.params.temperature, req.params.top_p, req.params.top_k, req.params.repetition_penalty) == (
        d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.6, 0.9, 0, 1.1)
    comp = CompletionRequest.model_validate({"prompt": "Emma", "temperature": 0.3, "top_k": 7, "top_p": None})
    (req,) = server.completion_requests(comp, "r")
    assert (req.params.temperature, req.params.top_k, req.params.top_p, req.params.max_tokens) == (0.3, 7, 0.9, 16)


@pytest.mark.slow
def test_three_asks_on_the_default_model_use_its_defaults():
    """The first thing a user does: ask the default model three times with the openai client's defaults."""
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "64MiB"], startup_timeout_s=120) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        want = resolve_sampling_defaults("auto", {}, read_generation_config(default_model_path()),
                                         "SmolLM2-135M-Instruct")
        assert card.model_extra["sampling_defaults"] == want.as_dict()
        assert {k: card.model_extra["sampling_defaults"][k] for k in CONSERVATIVE} == CONSERVATIVE
        assert "sampling defaults: temperature=0.8 top_p=0.95 top_k=40 min_p=0.05" in server.log()
        for _ in range(3):
            r = client.chat.completions.create(model=card.id, max_tokens=32,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert r.choices[0].message.content.strip()
