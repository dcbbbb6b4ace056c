"""`brisk bench structured`: what constraining generation costs, and what jump-forward decoding saves.

Two engines of the same settings, arms alternated in the same run (the first round is a warm-up, the medians are
compared):

    free-plain  unconstrained, ignore_eos, as many tokens as the constrained answers have, on a second engine that
                never sees a structured request (no grammar compiler is built, no mask code runs): the baseline
    free        the same on the engine that serves every constrained arm (an unconstrained request there must
                cost what it costs on free-plain: no regression)
    mask        constrained to a JSON schema with long fixed keys, jump-forward off: the mask's cost per token
    jf-auto     the same, jump-forward auto (output identical to `mask`, checked)
    jf-on       the same, jump-forward on (every forced byte appended; the output may differ, it is validated)

tokens/s is output tokens over wall time; the jump-forward speed-up is the wall time of the same requests.
Grammar compile time is measured cold (cache cleared) and cached. --validate N sends N sampled requests over a
dozen schemas (nested objects, bounded arrays, enums, integer ranges, string patterns, optional fields) and
counts the outputs that parse and validate with jsonschema, per kind: json, regex, choice, and tool calls as
`tool_choice: "required"` constrains them (serve/tools.py: a JSON array of {"name", "parameters"}, each call's
parameters checked against its tool's schema). An answer cut by --max-tokens (finish_reason "length") is counted
as cut, and as not valid.
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
# tool_choice "required" over two tools; add_numbers leaves its integers unbounded (the digit-run cap's case)
VALIDATION_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add_numbers", "description": "The sum of two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
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
    plain = build_llm(kw)  # free-plain's engine: never given a constraint
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
                                                   for a in ("free-plain", "free", "mask", "jf-auto", "jf-on")}
        outputs: dict[str, list[str]] = {}
        finish: dict[str, list[str | None]] = {}
        for rep in range(repeats + 1):
            for arm in arms:
                engine.config.jump_forward = {"jf-auto": "auto", "jf-on": "on"}.get(arm, "off")
                t0 = time.perf_counter()
                outs = (plain if arm == "free-plain" else llm).generate(
                    prompts, constrained if arm in ("mask", "jf-auto", "jf-on") else free)
                wall = time.perf_counter() - t0
                if rep:
                    arms[arm]["wall_s"].append(wall)
                    arms[arm]["tok_s"].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
                outputs[arm] = [o.outputs[0].text for o in outs]
                finish[arm] = [o.outputs[0].finish_reason for o in outs]
        assert plain.engine._grammar_compiler is None, "free-plain's engine built a grammar compiler"
        same_free = outputs["free"] == outputs["free-plain"]
        assert outputs["jf-auto"] == outputs["mask"], "jump-forward auto changed the output"
        valid_on = sum(_valid(t, FIXED_KEYS_SCHEMA, jsonschema) for t in outputs["jf-on"])
        cut = {a: finish[a].count("length") for a in ("mask", "jf-auto", "jf-on")}
        med = {a: {k: statistics.median(v) for k, v in d.items()} for a, d in arms.items()}
        click.echo(f"batch {bs}: {statistics.mean(lengths):.0f} tokens per answer, executor "
                   f"{engine.runner.executor.path}")
        for arm in arms:
            m = med[arm]
            line = (f"  {arm:10s} {m['tok_s']:8.1f} tok/s {m['tok_s'] / med['free-plain']['tok_s']:6.3f}x free-plain"
                    f" {m['tok_s'] / med['free']['tok_s']:6.3f}x free")
            if arm in cut:
                line += f"   wall {m['wall_s']:.3f} s, {med['mask']['wall_s'] / m['wall_s']:.2f}x mask's speed"
            click.echo(line)
        click.echo(f"  free output identical to free-plain: {'yes' if same_free else 'NO'}; jf-auto output identical "
                   f"to mask: yes; jf-on outputs valid: {valid_on}/{bs}; cut at --max-tokens: "
                   + ", ".join(f"{a} {n}" for a, n in cut.items()))
        report["batches"][str(bs)] = {"arms": arms, "median": med, "tokens_per_answer": lengths,
                                      "jf_on_valid": valid_on, "cut_at_length": cut, "free_identical": same_free}
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
    """n sampled requests over VALIDATION_SCHEMAS, a regex, a choice list and VALIDATION_TOOLS (tool_choice
    "required"), round robin: every output must parse and validate; answers cut by max_tokens are counted."""
    import re

    from brisk.engine.sampling_params import SamplingParams
    from brisk.serve import tools
    from brisk.structured.params import StructuredOutputsParams

    regex, choices = r"[A-Z][a-z]{2,8} [0-9]{1,3}", ["positive", "negative", "neutral"]
    tool_so = tools.required_constraint(VALIDATION_TOOLS, parallel=True)
    kinds: list[tuple[str, Any]] = ([("json", s) for s in VALIDATION_SCHEMAS]
                                    + [("regex", regex), ("choice", choices), ("tools", tool_so.json)])
    tok = llm.engine.tokenizer
    # a short listing rather than tools.hermes_system_prompt (hundreds of tokens): the constraint does the work
    listing = "; ".join(f"{t['function']['name']}({', '.join(t['function']['parameters']['properties'])})"
                        for t in VALIDATION_TOOLS)
    prompts, params, checks = [], [], []
    for i, prompt in enumerate(_prompts(llm, n)):
        kind, value = kinds[i % len(kinds)]
        so = tool_so if kind == "tools" else StructuredOutputsParams(**{kind: value})
        if kind == "tools":
            question = ("What is the weather in Lima?", "What is 1234 plus 98765?")[i % 2]
            prompt = tok.apply_chat_template([{"role": "user", "content": f"Call one of the functions {listing} "
                                                                          f"to answer: {question}"}])
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens,
                                     structured_outputs=so))
        checks.append((kind, value))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    per_kind: dict[str, dict[str, int]] = {}
    for (kind, value), o in zip(checks, outs, strict=True):
        c = o.outputs[0]
        row = per_kind.setdefault(kind, {"requests": 0, "valid": 0, "cut_at_length": 0})
        row["requests"] += 1
        if c.finish_reason == "length":
            row["cut_at_length"] += 1
        if kind == "json":
            ok = _valid(c.text, value, jsonschema)
        elif kind == "regex":
            ok = re.fullmatch(value, c.text) is not None
        elif kind == "choice":
            ok = c.text in value
        else:
            ok = _valid_tool_calls(c.text, value, jsonschema)
        row["valid"] += ok and c.finish_reason != "length"
    total = {k: sum(r[k] for r in per_kind.values()) for k in ("requests", "valid", "cut_at_length")}
    click.echo(f"validation: {n} requests ({len(VALIDATION_SCHEMAS)} schemas, a regex, a choice list, tool_choice "
               f"required) in {wall:.1f} s: {total['valid']}/{n} valid, {total['cut_at_length']} cut at --max-tokens")
    for kind, r in per_kind.items():
        click.echo(f"  {kind:7s} {r['valid']}/{r['requests']} valid, {r['cut_at_length']} cut")
    return {**total, "per_kind": per_kind, "wall_s": wall}


def _valid_tool_calls(text: str, schema: dict, jsonschema: Any) -> bool:
    """A `required` answer: the array validates, it parses into calls of known tools, and each call's arguments
    validate against its tool's parameters."""
    from brisk.serve import tools

    if not _valid(text, schema, jsonschema):
        return False
    calls = tools.parse_required(text)
    by_name = {t["function"]["name"]: tools.function_schema(t) for t in VALIDATION_TOOLS}
    return bool(calls) and all(c.name in by_name and _valid(c.arguments, by_name[c.name], jsonschema) for c in calls)
