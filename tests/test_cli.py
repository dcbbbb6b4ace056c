"""The command line: generate, chat, and clear one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cli")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


def test_generate_streams_the_same_text_as_the_api(model_dir):
    result = CliRunner().invoke(main, ["generate", "Emma Woodhouse", "--model", model_dir, "--max-tokens", "12",
                                       "--max-model-len", "128", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    want = LLM(model_dir, max_model_len=128).generate(["Emma Woodhouse"], SamplingParams(temperature=0,
                                                                                        max_tokens=12))[0]
    assert result.stdout == want.outputs[0].text + "\n"


def test_generate_chat_applies_the_template(model_dir):
    result = CliRunner().invoke(main, ["generate", "--chat", "hello", "--model", model_dir, "--max-tokens", "8",
                                       "--no-stream", "--max-model-len", "128", "-t", "0"])
    assert result.exit_code == 0, result.output
    llm = LLM(model_dir, max_model_len=128)
    want = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert result.stdout == want.outputs[0].text + "\n"


def test_chat_keeps_the_conversation(model_dir):
    result = CliRunner().invoke(main, ["chat", "--model", model_dir, "--max-tokens", "6", "--max-model-len", "256",
                                       "--temperature", "0"],
                                input="hi there\nand again\n/exit\n")
    assert result.exit_code == 0, result.output
    answers = [line for line in result.output.splitlines() if line.startswith("you> ") or "assistant> " in line]
    assert sum("assistant> " in a for a in answers) == 2
    # the second answer is generated with the first exchange in context
    llm = LLM(model_dir, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = llm.chat([{"role": "user", "content": "hi there"}], greedy)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "hi there"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "and again"}], greedy)[0].outputs[0].text
    assert f"assistant> {first}" in result.output
    assert f"assistant> {second}" in result.output


@pytest.mark.parametrize("args,message", [
    (["generate", "x", "--model", "/no/such/model"], "does not exist"),
    (["generate", "x", "--model", "someorg/somemodel"], "does not download"),
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "x", "--max-tokens", "0"], "max_tokens"),
    (["generate", "x", "--kv-cache-memory", "lots"], "cannot parse memory size"),
])
def test_bad_input_is_one_clear_line(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_console_script_runs(model_dir):
    proc = subprocess.run([sys.executable, "-m", "brisk.cli", "generate", "Emma", "--model", model_dir,
                           "--max-tokens", "4", "--max-model-len", "64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1
