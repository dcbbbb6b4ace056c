"""`brisk bench spec`: speculative decoding against plain decoding, in the same process, on three fixed prompt sets.

Prompt sets (chat-templated, built from real text; fixed, so runs on different days compare):
  grounded  a passage of a novel (default /work/shared/data/emma.txt, else the bundled excerpt) in the prompt,
            then: quote it / extract sentences / summarise it — the output copies from the input;
  chat      open questions and story continuations seeded by the novel's own sentences;
  code      write a function, or rewrite / document a real function of brisk's own source given in the prompt.

Each (set, method) runs the set's prompts one at a time (batch 1) and all at once (concurrent); every
method reuses one loaded target model. Greedy by default, so the outputs must match plain decoding token for
token (checked and reported). Speedup = tokens/s of the method / tokens/s of plain decoding on the same set
and batch mode, measured in this run.
"""

from __future__ import annotations

import gc
import inspect
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from brisk.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.model.loader import LoadedModel

DEFAULT_TEXT = Path("/work/shared/data/emma.txt")
TASKS = [
    "Quote the first three sentences of the passage exactly, word for word.",
    "Extract every sentence of the passage that contains dialogue, exactly as written.",
    "Summarise the passage in three sentences, reusing its wording where you can.",
    "Copy the passage's last paragraph exactly.",
]
CHAT = [
    "What makes a good friend? Answer in a few paragraphs.",
    "Explain to a child why the sky is blue.",
    "Write a short poem about the sea at night.",
    "Give me five tips for learning a new language, with a sentence on each.",
    "Describe a busy market in the morning, in a short paragraph.",
    "What are the pros and cons of living in a small village?",
    "Tell me a short story about a lost dog finding its way home.",
    "Why do people keep diaries? Give a few reasons.",
]
CODE = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and tests.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a Python function that counts word frequencies in a text file and returns the top 10.",
]


def _passages(text: str, num: int, chars: int = 900) -> list[str]:
    """`num` passages of about `chars` characters from evenly spaced places, cut at paragraph boundaries."""
    out = []
    for i in range(num):
        start = text.find("\n\n", (i + 1) * len(text) // (num + 2)) + 2
        end = text.find("\n\n", start + chars)
        out.append(" ".join(text[start:end].split("\n")).strip())
    return out


def _code_snippets() -> list[str]:
    from brisk.engine import sampler
    from brisk.spec import adaptive, ngram

    funcs = [ngram.find_continuation, adaptive.best_gamma, sampler.apply_top_k, sampler.token_counts]
    return [inspect.getsource(f) for f in funcs]


def prompt_sets(num_prompts: int, text_path: Path | None = None) -> dict[str, list[list[dict[str, str]]]]:
    """The three fixed sets of chat conversations; `num_prompts` of each (at most 8)."""
    if text_path is None:
        text_path = DEFAULT_TEXT if DEFAULT_TEXT.exists() else None
    if text_path is None:
        from brisk.bench.prompts import bench_text

        text = bench_text()
    else:
        text = text_path.read_text(encoding="utf-8")
    passages = _passages(text, 8)
    grounded = [f"Here is a passage from a novel:\n\n{p}\n\n{TASKS[i % len(TASKS)]}" for i, p in enumerate(passages)]
    openers = [p.split(". ")[0] + "." for p in _passages(text, 4, chars=300)]
    chat = CHAT[:4] + [f"Continue this story in your own words: \"{o}\"" for o in openers]
    code = CODE + [f"Add comments to this Python function and explain what it does:\n\n```python\n{s}```"
                   for s in _code_snippets()]
    sets = {"grounded": grounded, "chat": chat, "code": code}
    return {name: [[{"role": "user", "content": c}] for c in contents[:num_prompts]]
            for name, contents in sets.items()}


@dataclass
class SpecRun:
    prompt_set: str
    method: str
    batch: str  # "1" (one request at a time) or "concurrent"
    num_requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None = None  # vs plain, same set and batch mode
    acceptance_rate: float | None = None
    mean_accepted_per_step: float | None = None
    identical_to_plain: bool | None = None


def _engine(loaded: LoadedModel, spec: SpecConfig | None, max_model_len: int, kv_memory: str) -> LLMEngine:
    config = EngineConfig(model=str(loaded.path), max_model_len=max_model_len,
                          cache=CacheConfig(kv_cache_memory=kv_memory),
                          scheduler=SchedulerConfig(max_model_len=max_model_len), spec=spec)
    return LLMEngine(config, loaded)


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(None, p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def run_spec_bench(loaded: LoadedModel, methods: list[str], num_prompts: int, max_tokens: int, concurrency: int,
                   num_speculative_tokens: int, sets: list[str] | None = None, max_model_len: int = 1536,
                   kv_memory: str = "256MiB", text_path: Path | None = None, progress=print) -> list[SpecRun]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tok = loaded.tokenizer
    conversations = prompt_sets(max(num_prompts, concurrency), text_path)
    runs: list[SpecRun] = []
    for name, convs in conversations.items():
        if sets and name not in sets:
            continue
        prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in convs]
        plain_outputs: dict[str, list[list[int]]] = {}
        plain_rate: dict[str, float] = {}
        for method in ["plain", *methods]:
            spec = None if method == "plain" else SpecConfig.parse(method, num_speculative_tokens)
            engine = _engine(loaded, spec, max_model_len, kv_memory)
            _generate(engine, [prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            for batch, group in (("1", [[p] for p in prompts[:num_prompts]]), ("concurrent", [prompts[:concurrency]])):
                if engine.speculator is not None:
                    engine.speculator.reset_stats()
                start = time.perf_counter()
                outputs = [o for g in group for o in _generate(engine, g, params)]
                seconds = time.perf_counter() - start
                num_tokens = sum(len(o) for o in outputs)
                run = SpecRun(name, method, batch, sum(len(g) for g in group), num_tokens, seconds,
                              num_tokens / seconds)
                if method == "plain":
                    plain_outputs[batch], plain_rate[batch] = outputs, run.tokens_per_s
                else:
                    stats = engine.speculator.stats
                    run.speedup = run.tokens_per_s / plain_rate[batch]
                    run.acceptance_rate = stats.acceptance_rate
                    run.mean_accepted_per_step = stats.mean_accepted_per_step
                    run.identical_to_plain = outputs == plain_outputs[batch]
                runs.append(run)
                progress(run)
            del engine
            gc.collect()
    return runs


def runs_as_dicts(runs: list[SpecRun]) -> list[dict]:
    return [asdict(r) for r in runs]
