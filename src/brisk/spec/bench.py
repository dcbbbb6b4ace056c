"""`brisk bench spec`: speculative decoding against plain decoding, in the same process, on three fixed prompt sets.

Prompt sets (chat-templated, built from real text; fixed, so runs on different days compare):
  grounded  a passage of a novel (default: the bundled calibration text, Emma) in the prompt,
            then: quote it / extract sentences / summarise it — the output copies from the input;
  chat      open questions and story continuations seeded by the novel's own sentences;
  code      write a function, or rewrite / document a real function of brisk's own source given in the prompt.

Each set runs its prompts one at a time (batch 1) and all at once (concurrent). Every method's engine shares
one loaded target, and each prompt runs under plain decoding and every method back to back, so a busy shared
machine slows them alike. Greedy, so every method's output must equal plain decoding's token for token
(checked, reported). tokens/s is decode throughput: tokens after the first over the time from the first token
to the last (prefill is the same work with or without speculation). Speedup = a method's tokens/s over plain
decoding's on the same set and batch mode, in this run.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from brisk.data import calibration_text_path
from brisk.engine.config import TREE_METHODS, CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.model.loader import LoadedModel

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
    # Emma, the calibration text, is the text these prompts have always been cut from (the figures in
    # BENCHMARKS.md); it only supplies prompts here, nothing is scored on it.
    text = (text_path or calibration_text_path()).read_text(encoding="utf-8")
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
    seconds: float  # decode time: from each request's first token to its last (prefill excluded)
    tokens_per_s: float  # tokens after the first, per decode second
    speedup: float | None = None  # vs plain, same set and batch mode
    acceptance_rate: float | None = None
    mean_accepted_per_step: float | None = None
    identical_to_plain: bool | None = None


def _engine(loaded: LoadedModel, spec: SpecConfig | None, max_model_len: int, kv_memory: str) -> LLMEngine:
    config = EngineConfig(model=str(loaded.path), max_model_len=max_model_len,
                          cache=CacheConfig(kv_cache_memory=kv_memory),
                          scheduler=SchedulerConfig(max_model_len=max_model_len), spec=spec)
    return LLMEngine(config, loaded)


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
              ) -> tuple[list[list[int]], float]:
    """Outputs, and the decode seconds: from the moment every request has its first token to the last finish
    (prefill is the same work with or without speculation, so it is left out of the ratio)."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    started: set[str] = set()
    decode_start = None
    while len(done) < len(ids):
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if decode_start is None and len(started) == len(ids):
            decode_start = time.perf_counter()
    return [done[i] for i in ids], time.perf_counter() - decode_start


def run_spec_bench(loaded: LoadedModel, methods: list[str], num_prompts: int, max_tokens: int, concurrency: int,
                   num_speculative_tokens: int, sets: list[str] | None = None, max_model_len: int = 1536,
                   kv_memory: str = "96MiB", text_path: Path | None = None, progress=print,
                   spec_overrides: dict | None = None, rounds: int = 1, tree_size: int = 8) -> list[SpecRun]:
    """Every method's engine is built once; each prompt (or concurrent group) then runs under plain decoding and
    every method back to back, so load changes on a shared machine hit all of them alike; with `rounds` > 1 that
    is repeated and each method's fastest round of the group counts (a concurrent group decodes in well under a
    second, so one slow moment of the machine moved single-round speedups by +-20%). Acceptance statistics cover
    every round. `spec_overrides` sets SpecConfig fields on every method (e.g. disable_by_batch_size); token-tree
    methods (medusa, eagle) draft trees of `tree_size` nodes."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tok = loaded.tokenizer
    conversations = prompt_sets(max(num_prompts, concurrency), text_path)
    names = ["plain", *methods]
    def spec_config(m: str) -> SpecConfig:  # token-tree methods (medusa, eagle) get tree_size nodes instead of γ
        tree = m.partition(":")[0] in TREE_METHODS
        return replace(SpecConfig.parse(m, tree_size if tree else num_speculative_tokens), **(spec_overrides or {}))

    engines = {m: _engine(loaded, None if m == "plain" else spec_config(m), max_model_len, kv_memory)
               for m in names}
    for engine in engines.values():
        _generate(engine, [tok.encode("Warm-up.")], SamplingParams(temperature=0, max_tokens=4))
    runs: list[SpecRun] = []
    for name, convs in conversations.items():
        if sets and name not in sets:
            continue
        prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in convs]
        for batch, groups in (("1", [[p] for p in prompts[:num_prompts]]), ("concurrent", [prompts[:concurrency]])):
            outputs: dict[str, list[list[int]]] = {m: [] for m in names}
            seconds = dict.fromkeys(names, 0.0)
            for engine in engines.values():
                if engine.speculator is not None:
                    engine.speculator.reset_stats()
            for group in groups:
                best = dict.fromkeys(names, float("inf"))
                for r in range(rounds):
                    for m in names:
                        outs, secs = _generate(engines[m], group, params)
                        if r == 0:
                            outputs[m] += outs
                        elif outs != outputs[m][-len(outs):]:  # greedy: every round must repeat the first
                            raise RuntimeError(f"{m}: round {r + 1} of a group gave other tokens than round 1")
                        best[m] = min(best[m], secs)
                for m in names:
                    seconds[m] += best[m]
            for m in names:
                num_tokens = sum(len(o) for o in outputs[m])
                rate = (num_tokens - len(outputs[m])) / seconds[m]
                run = SpecRun(name, m, batch, len(outputs[m]), num_tokens, seconds[m], rate)
                if m == "plain":
                    plain_rate = rate
                if m != "plain":
                    stats = engines[m].speculator.stats
                    run.speedup = rate / plain_rate
                    run.acceptance_rate = stats.acceptance_rate
                    run.mean_accepted_per_step = stats.mean_accepted_per_step
                    run.identical_to_plain = outputs[m] == outputs["plain"]
                runs.append(run)
                progress(run)
    return runs


def runs_as_dicts(runs: list[SpecRun]) -> list[dict]:
    return [asdict(r) for r in runs]
