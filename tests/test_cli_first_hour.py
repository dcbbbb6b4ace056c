"""The command line a new user meets: LoRA adapters on generate / chat, the timing line, the sampling line, vLLM's
spellings of the engine flags, and help that lists every option (grouped) and every command in full."""

from __future__ import annotations

import re
import subprocess
import sys

import click
import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk import LLM, LoRARequest, SamplingParams
from brisk.bench.cli import bench
from brisk.cli import GenerationStats, first_sentence, human, main
from brisk.engine import memory
from brisk.engine.config import SPEC_METHODS, CacheConfig
from brisk.engine.settings import SECTIONS, build_engine_config, engine_kwargs, engine_settings

TIMING = re.compile(r"^brisk: prompt \d+ tok(?: \(\d+ cached\))?, [\d.]+ tok/s \| generated \d+ tok(?:, [\d.]+ tok/s)?"
                    r"(?: \| speculative: (?:\d+% of \d+ drafts accepted|no drafts)(?:, [\d.]+ tok/step)?)?$", re.M)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-first-hour")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


def _generate(model_dir, *args, input=None):  # noqa: A002 - CliRunner's name
    result = CliRunner().invoke(main, ["generate", *args, "--model", model_dir, "--max-model-len", "128"]
                                if input is None else ["chat", *args, "--model", model_dir, "--max-model-len", "256"],
                                input=input)
    assert result.exit_code == 0, result.output
    return result


# ---------------------------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    peft = pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("cli-lora")
    ref = make_tiny_hf_model(tmp / "m", "llama", num_kv_heads=2, tie_word_embeddings=False, seed=1)
    for name, seed, r in (("sql", 1, 4), ("poet", 2, 32)):  # rank 32: more than --max-lora-rank's default
        pm = peft.get_peft_model(ref, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj",
                                                                                              "down_proj"]))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        pm.save_pretrained(tmp / name)
        ref = pm.unload()
    return str(tmp / "m"), str(tmp / "sql"), str(tmp / "poet")


def test_generate_lora_equals_the_api_with_the_same_lora_request(adapters):
    model, sql, poet = adapters
    args = ["generate", "Emma Woodhouse", "--model", model, "--max-tokens", "12", "-t", "0", "--max-model-len", "128",
            "--no-stream"]
    runner = CliRunner()
    plain = runner.invoke(main, args)
    first = runner.invoke(main, [*args, "--lora", f"sql={sql}", "--lora", poet])  # the first applies
    second = runner.invoke(main, [*args, "--lora", f"sql={sql}", "--lora", poet, "--lora-name", "poet"])
    for result in (plain, first, second):
        assert result.exit_code == 0, result.output
    llm = LLM(model, max_model_len=128, enable_lora=True, max_lora_rank=32)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    requests = {"base": None, "sql": LoRARequest("sql", 1, sql), "poet": LoRARequest("poet", 2, poet)}
    want = {name: llm.generate(["Emma Woodhouse"], greedy, lora_request=lora)[0].outputs[0].text
            for name, lora in requests.items()}
    assert len(set(want.values())) == 3  # each adapter changes the greedy output
    assert plain.stdout == want["base"] + "\n"
    assert first.stdout == want["sql"] + "\n" and "LoRA adapter sql" in first.stderr
    assert second.stdout == want["poet"] + "\n"


@pytest.mark.parametrize("args,message", [
    (["--lora-name", "x"], "no --lora adapter named 'x'"),
    (["--lora", "/no/such/adapter"], "is not a folder"),
    (["--lora", "a=/x", "--lora", "a=/y"], "two adapters are named 'a'"),
])
def test_bad_lora_flags_are_one_clear_line(args, message):
    result = CliRunner().invoke(main, ["generate", "x", *args])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------- timing, sampling
def test_generate_prints_one_timing_line_and_the_sampling_it_used(model_dir):
    result = _generate(model_dir, "Emma Woodhouse", "--max-tokens", "8", "-t", "0")
    assert len(TIMING.findall(result.stderr)) == 1, result.stderr
    assert "temperature=0.8" not in result.stderr  # brisk's fallback default is not what -t 0 runs with
    assert "sampling: greedy, temperature=0.0" in result.stderr and "temperature, max_tokens from the command line" \
        in result.stderr
    quiet = _generate(model_dir, "Emma Woodhouse", "--max-tokens", "8", "-t", "0", "-q")
    assert quiet.stderr == "" and quiet.stdout == result.stdout


def test_speculative_timing_reports_acceptance(model_dir):
    text = "Emma Woodhouse, handsome, clever, and rich. Emma Woodhouse, handsome, clever, and rich. Emma"
    result = _generate(model_dir, text, "--max-tokens", "24", "-t", "0", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3}', "--no-stream")
    line = TIMING.findall(result.stderr)
    assert len(line) == 1 and "| speculative: " in line[0], result.stderr
    plain = _generate(model_dir, text, "--max-tokens", "24", "-t", "0", "--no-stream")
    assert plain.stdout == result.stdout  # greedy speculative output is plain greedy output


def test_timing_summary_is_rounded_for_a_person():
    assert [human(x) for x in (1523.4, 152.34, 15.234, 1.5234, 0.0)] == ["1520", "152", "15.2", "1.52", "0.00"]
    stats = GenerationStats(prompt_tokens=40, cached_tokens=32, prompt_seconds=0.02, output_tokens=65,
                            decode_seconds=1.6, decode_steps=30, draft_tokens=80, accepted_tokens=34)
    assert stats.summary() == ("prompt 40 tok (32 cached), 400 tok/s | generated 65 tok, 40.0 tok/s | "
                               "speculative: 42% of 80 drafts accepted, 2.13 tok/step")


def test_chat_reset_says_what_it_did(model_dir):
    result = _generate(model_dir, "--max-tokens", "4", "-t", "0", "--system", "Be brief.",
                       input="hi\n/reset\n/lora\n/exit\n")
    assert "[conversation cleared: 1 exchange(s) forgotten; the system message is kept]" in result.stderr
    assert "[adapter: none (the base model)" in result.stderr
    assert len(TIMING.findall(result.stderr)) == 1


# ---------------------------------------------------------------------------------------------- vLLM's spellings
@pytest.mark.parametrize("command", [main.commands["generate"], main.commands["chat"], main.commands["serve"],
                                     bench.commands["throughput"]], ids=lambda c: c.name)
def test_vllm_spellings_are_aliases_on_every_engine_command(command):
    def parse(*args):
        return command.make_context(command.name, ["x", *args] if command.name == "generate" else list(args)).params

    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parse("--no-enable-chunked-prefill")["enable_chunked_prefill"] is False
    assert parse("-tp", "2", "-pp", "3")["tensor_parallel_size"] == 2
    assert parse("--num-gpu-blocks-override", "64")["num_kv_blocks"] == 64
    params = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert params["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    spec = build_engine_config(**engine_kwargs(params)).spec
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 2)


def test_speculative_config_json_maps_vllm_keys():
    spec = build_engine_config(speculative_config={"method": "draft_model", "model": "/some/draft",
                                                   "num_speculative_tokens": 5}).spec
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == ("draft", "/some/draft", 5)
    result = CliRunner().invoke(main, ["generate", "x", "--speculative-config", "{not json"])
    assert result.exit_code != 0 and "not valid JSON" in result.output
    result = CliRunner().invoke(main, ["generate", "x", "--speculative", "ngram", "--speculative-config",
                                       '{"method": "ngram"}'])
    assert result.exit_code != 0 and "not both" in result.output


def test_kv_cache_memory_takes_a_share_of_the_available_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: (2**30, "test"))
    for share in (0.25, "0.25", "25%"):
        assert CacheConfig(kv_cache_memory=share).kv_cache_bytes == 2**28
    assert CacheConfig(kv_cache_memory="512MiB").kv_cache_bytes == 2**29
    assert CacheConfig(kv_cache_memory="1e9").kv_cache_bytes == 10**9
    with pytest.raises(ValueError, match="memory share"):
        CacheConfig(kv_cache_memory="150%")
    # the memory check prices the pool the share gives
    config = build_engine_config(kv_cache_memory="0.25", max_model_len=64, load_format="dummy")
    footprint = memory.model_footprint(config.model, config.load_format, config.shape)
    estimate = memory.estimate_memory(config, footprint)
    assert 2**28 - 2**20 < estimate.kv_pool <= 2**28


# ---------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("name", ["generate", "chat", "serve"])
def test_help_is_grouped_and_lists_every_value(name):
    out = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
    titles = [line for line in out.splitlines() if line.endswith(" options:")]
    want = ["Model", "Generation", "KV cache", "Speculative decoding", "Performance", "Parallel"] \
        + (["Server"] if name == "serve" else []) + ["Other"]
    assert titles == [f"{t} options:" for t in want]
    flat = " ".join(out.split())
    for s in engine_settings():
        if s.meta.choices:
            assert f"[{'|'.join(s.meta.choices)}]" in flat, s.kwarg
    spec_help = flat[flat.index("--speculative METHOD"):flat.index("--num-speculative-tokens")]
    for method in SPEC_METHODS:
        assert method in spec_help, method
    assert "draft:PATH" in spec_help and "eagle[:PATH]" in spec_help and "medusa[:PATH]" in spec_help
    assert "--enable-prefix-caching" in flat and "--speculative-config JSON" in flat


def test_every_setting_names_a_known_section():
    for s in engine_settings():
        assert s.meta.section in SECTIONS and s.meta.section != "other", s.kwarg


def test_top_level_help_does_not_cut_command_descriptions():
    out = CliRunner().invoke(main, ["--help"]).output
    commands = out[out.index("Commands:"):]
    assert "..." not in commands
    flat = "".join(commands.split())  # wrapping breaks lines at spaces and hyphens
    for name, cmd in main.commands.items():
        assert isinstance(cmd, click.Command) and name + "".join(first_sentence(cmd.help or "").split()) in flat, name
    assert "(/v1/completions,/v1/chat/completions)" in flat


def test_default_model_end_to_end():
    """One real process on the default model: the answer on stdout, the sampling and timing lines on stderr."""
    proc = subprocess.run([sys.executable, "-m", "brisk.cli", "generate", "The capital of France is", "-t", "0",
                           "--max-tokens", "6", "--max-model-len", "128", "--kv-cache-memory", "0.01"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "temperature=0.8" not in proc.stderr and len(TIMING.findall(proc.stderr)) == 1, proc.stderr


@pytest.mark.parametrize("content,message", [
    ({}, "has no config.json; a Hugging Face model folder holds config.json"),
    ({"model-q4.gguf": b"GGUF"}, "holds model-q4.gguf: pass the file itself"),
    ({"adapter_config.json": b"{}"}, "it is a LoRA adapter: pass it with --lora"),
])
def test_a_folder_that_is_no_model_is_one_clear_line(tmp_path, content, message):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    for name, data in content.items():
        (folder / name).write_bytes(data)
    result = CliRunner().invoke(main, ["generate", "hi", "--model", str(folder), "--max-tokens", "2"])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output
