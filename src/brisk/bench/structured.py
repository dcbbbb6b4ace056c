"""`brisk bench structured`: what constraining generation costs, and what jump-forward decoding saves.

One engine, arms alternated in the same run (the first round is a warm-up, the medians are compared):

    free        the same prompts unconstrained, ignore_eos, as many tokens as the constrained answers have
    mask        constrained to a JSON schema with long fixed keys, jump-forward off: the mask's cost per token
    jf-auto     the same, jump-forward auto (output identical to `mask`, checked)
    jf-on       the same, jump-forward on (every forced byte appended; the output may differ, it is validated)

tokens/s is output tokens over wall time; the jump-forward speed-up is the wall time of the same requests.
Grammar compile time is measured cold (cache cleared) and cached. --validate N sends N sampled requests over a
dozen schemas (nested objects, bounded arrays, enums, integer ranges, string patterns, optional fields) and
counts the outputs that parse and validate with jsonschema.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import click

from brisk.bench.options import build_llm, engine_flags

# long fixed keys: what jump-forward appends without a forward pass
FIXED_KEYS_SCHEMA = {"type": "object", "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 24},
    "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
    "preferred_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
    "order_contains_fragile_items": {"type": "boolean"},
    "number_of_items_in_the_order": {"type": "integer", "minimum": 1, "maximum": 50}},
    "required": ["customer_full_legal_name", "customer_account_identifier", "preferred_delivery_window",
                 "order_contains_fragile_items", "number_of_items_in_the_order"], "additionalProperties": False}

VALIDATION_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
                                      "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
     "required": ["city", "population_millions"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"author": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 12}, "last": {"type": "string", "maxLength": 12}},
        "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer", "minimum": 1700, "maximum": 2030}},
     "required": ["author", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "state": {"type": "string", "pattern": "^[A-Z]{2}$"}},
     "required": ["zip", "state"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "subtitle": {"type": "string", "maxLength": 30}},
     "required": ["title"], "additionalProperties": False},  # an optional field
    {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100,
                                                                          "maximum": 599}},
     "required": ["ok", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["color", "hex"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
                                      "verified": {"type": "boolean"}},
     "required": ["email"], "additionalProperties": False},
    FIXED_KEYS_SCHEMA,
]
_TOPICS = ["a customer order", "a person", "a city", "a book", "an address", "a film", "some numbers",
           "an HTTP answer", "a shopping cart", "a colour", "a user account", "a delivery"]


def _prompts(llm: Any, n: int) -> list[str]:
    tok = llm.engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": f"Describe {_TOPICS[i % len(_TOPICS)]} as JSON "
                                      f"(example {i})."}]) for i in range(n)]


@click.command("structured")
@click.option("--batch-sizes", default="1,16", show_default=True, help="Comma-separated batch sizes.")
@click.option("--max-tokens", type=int, default=160, show_default=True,
              help="Token cap of a constrained answer (the schema's objects are shorter).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Measured alternations of the arms.")
@click.option("--validate", "num_validate", type=int, default=0, show_default=True,
              help="Also send this many sampled requests over the dozen validation schemas and check every output.")
@engine_flags()
def structured(batch_sizes: str, max_tokens: int, repeats: int, num_validate: int, json_path: str | None,
               **kw: Any) -> None:
    """Constrained vs unconstrained tokens/s, jump-forward on/off, grammar compile time, in one run."""
    import jsonschema

    from brisk.engine.sampling_params import SamplingParams
    from brisk.structured.params import StructuredOutputsParams

    llm = build_llm(kw)
    engine = llm.engine
    so = StructuredOutputsParams(json=FIXED_KEYS_SCHEMA)
    compiler = engine.grammar_compiler()
    compiler.clear_cache()
    t0 = time.perf_counter()
    compiler.compile(so)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(so)
    cached = time.perf_counter() - t0
    report: dict[str, Any] = {"compile_cold_s": cold, "compile_cached_s": cached, "batches": {}}
    click.echo(f"grammar compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.1f} us")
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
    for bs in [int(b) for b in batch_sizes.split(",") if b.strip()]:
        prompts = _prompts(llm, bs)
        engine.config.jump_forward = "off"
        lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained)]
        free = SamplingParams(temperature=0, max_tokens=max(1, round(statistics.mean(lengths))), ignore_eos=True)
        arms: dict[str, dict[str, list[float]]] = {a: {"tok_s": [], "wall_s": []}
                                                   for a in ("free", "mask", "jf-auto", "jf-on")}
        outputs: dict[str, list[str]] = {}
        for rep in range(repeats + 1):
            for arm in arms:
                engine.config.jump_forward = {"jf-auto": "auto", "jf-on": "on"}.get(arm, "off")
                t0 = time.perf_counter()
                outs = llm.generate(prompts, free if arm == "free" else constrained)
                wall = time.perf_counter() - t0
                if rep:
                    arms[arm]["wall_s"].append(wall)
                    arms[arm]["tok_s"].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
                outputs[arm] = [o.outputs[0].text for o in outs]
        assert outputs["jf-auto"] == outputs["mask"], "jump-forward auto changed the output"
        valid_on = sum(_valid(t, FIXED_KEYS_SCHEMA, jsonschema) for t in outputs["jf-on"])
        med = {a: {k: statistics.median(v) for k, v in d.items()} for a, d in arms.items()}
        click.echo(f"batch {bs}: {statistics.mean(lengths):.0f} tokens per answer, executor "
                   f"{engine.runner.executor.path}")
        for arm in arms:
            m = med[arm]
            line = f"  {arm:8s} {m['tok_s']:8.1f} tok/s {m['tok_s'] / med['free']['tok_s']:6.3f}x free"
            if arm != "free":
                line += f"   wall {m['wall_s']:.3f} s, {med['mask']['wall_s'] / m['wall_s']:.2f}x mask's speed"
            click.echo(line)
        click.echo(f"  jf-auto output identical to mask: yes; jf-on outputs valid: {valid_on}/{bs}")
        report["batches"][str(bs)] = {"arms": arms, "median": med, "tokens_per_answer": lengths,
                                      "jf_on_valid": valid_on}
    engine.config.jump_forward = "auto"
    if num_validate:
        report["validation"] = _validation(llm, num_validate, max_tokens, jsonschema)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


def _valid(text: str, schema: dict, jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _validation(llm: Any, n: int, max_tokens: int, jsonschema: Any) -> dict[str, Any]:
    """n sampled requests over VALIDATION_SCHEMAS (plus a regex and a choice share): every finished output must
    validate; outputs cut by max_tokens are counted apart."""
    import re

    from brisk.engine.sampling_params import SamplingParams
    from brisk.structured.params import StructuredOutputsParams

    regex, choices = r"[A-Z][a-z]{2,8} [0-9]{1,3}", ["positive", "negative", "neutral"]
    kinds: list[tuple[str, Any]] = [("json", s) for s in VALIDATION_SCHEMAS] + [("regex", regex), ("choice", choices)]
    params, checks = [], []
    for i in range(n):
        kind, value = kinds[i % len(kinds)]
        params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens,
                                     structured_outputs=StructuredOutputsParams(**{kind: value})))
        checks.append((kind, value))
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(llm, n), params)
    wall = time.perf_counter() - t0
    valid = truncated = 0
    for (kind, value), o in zip(checks, outs, strict=True):
        c = o.outputs[0]
        if c.finish_reason == "length":
            truncated += 1
            continue
        if kind == "json":
            valid += _valid(c.text, value, jsonschema)
        elif kind == "regex":
            valid += re.fullmatch(value, c.text) is not None
        else:
            valid += c.text in value
    finished = n - truncated
    click.echo(f"validation: {n} requests over {len(VALIDATION_SCHEMAS)} schemas + regex + choice in {wall:.1f} s: "
               f"{valid}/{finished} finished outputs valid, {truncated} cut by --max-tokens")
    return {"requests": n, "valid": valid, "finished": finished, "truncated": truncated, "wall_s": wall}
