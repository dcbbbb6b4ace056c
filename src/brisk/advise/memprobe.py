"""Peak resident memory of one engine configuration, measured in a fresh process.

    python -m brisk.advise.memprobe '{"model": null, "dtype": "float32", ...}' [NUM_PROMPTS] [PROMPT_LEN]

builds `LLM(**settings)`, runs NUM_PROMPTS greedy requests of PROMPT_LEN prompt tokens and 4 generated tokens
together, and prints one JSON line: the resident bytes after the imports, after the load, and the peak
(VmHWM) over the whole process. `measure_peak_rss` runs it from Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def measure_peak_rss(settings: dict[str, Any], num_prompts: int = 1, prompt_len: int = 64,
                     timeout: float = 1800) -> dict[str, int]:
    """Run the probe in a subprocess (a fresh resident set) and return its figures in bytes."""
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "brisk.advise.memprobe", json.dumps(settings), str(num_prompts),
                          str(prompt_len)], capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    settings = json.loads(argv[0])
    num_prompts = int(argv[1]) if len(argv) > 1 else 1
    prompt_len = int(argv[2]) if len(argv) > 2 else 64
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.engine.llm import LLM
    from brisk.engine.sampling_params import SamplingParams

    after_import = _vm("VmRSS")
    llm = LLM(**settings)
    after_load = _vm("VmRSS")
    tok = llm.get_tokenizer()
    ids = text_token_ids(tok)
    prompts = [make_prompt(tok, ids, 97 * i, prompt_len) for i in range(num_prompts)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"after_import": after_import, "after_load": after_load, "peak": _vm("VmHWM"),
                      "end": _vm("VmRSS")}))


if __name__ == "__main__":
    main(sys.argv[1:])
